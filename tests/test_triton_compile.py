"""The Triton kernels compile for an H100/H200 (sm_90) on this CPU machine: Triton's own
compiler and the ptxas it ships build the cubin without a GPU, so a kernel that the interpreter
runs but the GPU compiler rejects fails here rather than at a GPU's start-up.

NOTE: the test process runs Triton interpreted (conftest sets TRITON_INTERPRET=1, read once at
Triton's import), so the compiles run in a fresh interpreter without it: this file's main()."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def compile_sm90(fn, constexprs: dict, pointers: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}
    return triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32)).asm


def main() -> int:
    import triton.language as tl

    import blockspec.layers.fused_moe as moe
    import blockspec.layers.triton_attention as ta
    import blockspec.layers.triton_kv_store as kv

    ptrs = dict(q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", out_ptr="*bf16",
                lse_ptr="*fp32", cu_seqlens_q_ptr="*i32", seq_lens_ptr="*i32",
                block_tables_ptr="*i32", qk_scale="fp32")
    mptrs = dict(part_ptr="*fp32", lse_ptr="*fp32", out_ptr="*bf16", cu_seqlens_q_ptr="*i32",
                 seq_lens_ptr="*i32")
    for flat in (False, True):
        for splits in (1, 4):
            consts = dict(GROUP=4, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_Q=32,
                          BLOCK_M=128, BLOCK_N=64, CAUSAL=True, NUM_SPLITS=splits,
                          MIN_CHUNK=128 * (splits > 1), DOT_DTYPE=tl.bfloat16,
                          DOT_PRECISION="tf32", FLAT_GRID=flat)
            assert "cubin" in compile_sm90(ta._attn_kernel, consts, ptrs)
        merge = dict(GROUP=4, HEAD_DIM=128, D_BLOCK=32, BLOCK_Q=4, BLOCK_M=16, BLOCK_N=64,
                     CAUSAL=True, NUM_SPLITS=8, MIN_CHUNK=64, FLAT_GRID=flat)
        assert "cubin" in compile_sm90(ta._merge_kernel, merge, mptrs)
    store = dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, H_PAD=8, D_PAD=128)
    assert "cubin" in compile_sm90(kv._store_kv_kernel, store, dict(
        k_ptr="*bf16", v_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", slot_ptr="*i64"))
    for per_token, scale in ((True, False), (False, True)):
        consts = dict(TOP_K=8, A_PER_TOKEN=per_token, SCALE=scale, NUM_EXPERTS=384,
                      BLOCK_M=moe.BLOCK_M, BLOCK_N=64, BLOCK_K=64)
        assert "cubin" in compile_sm90(moe._grouped_gemm, consts, dict(
            a_ptr="*bf16", w_ptr="*bf16", c_ptr="*bf16", scale_ptr="*fp32", sorted_ptr="*i64",
            tile_expert_ptr="*i64"))
    import blockspec.layers.quant_gemm as qg

    for fmt, w, s, group in (("int4", "*i32", "*bf16", (1, 32)), ("fp8", "*fp8e4nv", "*fp32",
                                                                   (128, 128))):
        for per_token, scale, block_m in ((True, False, moe.BLOCK_M), (False, True, moe.BLOCK_M),
                                          (True, False, qg.DENSE_BLOCK_M)):
            consts = dict(FORMAT=qg.FORMATS[fmt], GROUP_N=group[0], GROUP_K=group[1], TOP_K=8,
                          A_PER_TOKEN=per_token, SCALE=scale, NUM_EXPERTS=384, BLOCK_M=block_m,
                          BLOCK_N=64, BLOCK_K=64)
            assert "cubin" in compile_sm90(qg._quant_grouped_gemm, consts, dict(
                a_ptr="*bf16", w_ptr=w, s_ptr=s, c_ptr="*bf16", scale_ptr="*fp32",
                sorted_ptr="*i64", tile_expert_ptr="*i64"))
    print("compiled")
    return 0


def test_attention_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]


if __name__ == "__main__":
    raise SystemExit(main())
