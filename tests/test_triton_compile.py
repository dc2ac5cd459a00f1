"""The Triton kernels compile for an H100/H200 (sm_90) on this CPU machine: Triton's own
compiler and the ptxas it ships build the cubin without a GPU, so a kernel that the interpreter
runs but the GPU compiler rejects fails here rather than at a GPU's start-up.

NOTE: the test process runs Triton interpreted (conftest sets TRITON_INTERPRET=1, read once at
Triton's import), so the compiles run in a fresh interpreter without it: this file's main()."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest

SHARED_LIMIT = 227 * 1024  # an H100/H200's shared memory per block


def compile_kernel_sm90(fn, constexprs: dict, pointers: dict, **options):
    """The compiled kernel (its .asm, .metadata.shared) under launch options (num_warps...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # constexprs with defaults (USE_PDL, HAS_SHARED...) are not runtime arguments
    defaults = {p.name: p.default for p in fn.params
                if p.is_constexpr and p.default is not inspect.Parameter.empty}
    constexprs = {**defaults, **constexprs}
    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}
    return triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32),
                          options=options or None)


def compile_sm90(fn, constexprs: dict, pointers: dict) -> dict:
    return compile_kernel_sm90(fn, constexprs, pointers).asm


def compile_mla(mla) -> None:
    """The MLA kernel as the backend launches it for 16 / 64 / 128 heads (decode, verify
    blocks, prefill chunks; split-KV, flat grid), within an H200's shared memory per block."""
    import triton.language as tl

    ptrs = dict(q_ptr="*bf16", cache_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32",
                lse_ptr="*fp32", cu_seqlens_q_ptr="*i32", seq_lens_ptr="*i32",
                block_tables_ptr="*i32", qk_scale="fp32")
    backend, seen = mla.TritonMLABackend(), set()
    for heads in (16, 64, 128):
        for q_len, splits, flat in ((1, 8, True), (4, 4, False), (16, 1, True), (512, 1, False)):
            block_h, block_q, block_m = backend.tiles(q_len, heads)
            block_n, num_warps, num_stages = mla.launch_config(block_m)
            key = (block_h, block_m, splits, flat)
            if key in seen:
                continue
            seen.add(key)
            consts = dict(BLOCK_H=block_h, KV_RANK=512, ROPE_DIM=64, ROPE_PAD=64, BLOCK_SIZE=64,
                          BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=True,
                          NUM_SPLITS=splits, MIN_CHUNK=64 * (splits > 1),
                          DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", FLAT_GRID=flat)
            kernel = compile_kernel_sm90(mla._mla_kernel, consts, ptrs, num_warps=num_warps,
                                         num_stages=num_stages)
            shared = kernel.metadata.shared
            assert "cubin" in kernel.asm and shared <= SHARED_LIMIT, (heads, q_len, shared)
    merge = dict(GROUP=16, HEAD_DIM=512, D_BLOCK=mla.MERGE_D_BLOCK, BLOCK_Q=1, BLOCK_M=16,
                 BLOCK_N=32, CAUSAL=True, NUM_SPLITS=32, MIN_CHUNK=64, FLAT_GRID=True)
    assert "cubin" in compile_sm90(mla._merge_kernel, merge, dict(
        part_ptr="*fp32", lse_ptr="*fp32", out_ptr="*bf16", cu_seqlens_q_ptr="*i32",
        seq_lens_ptr="*i32"))


def compile_quant_gemm(qg, moe) -> None:
    """The quantized GEMM for both formats and launches; int4's dequantizations
    (quant_gemm.DEQUANTS) as bf16 activations and scales take them, and one as fp16's."""
    import torch

    for fmt, w, s, group in (("int4", "*i32", "*bf16", (1, 32)), ("fp8", "*fp8e4nv", "*fp32",
                                                                   (128, 128))):
        for per_token, scale, block_m in ((True, False, moe.BLOCK_M), (False, True, moe.BLOCK_M),
                                          (True, False, qg.DENSE_BLOCK_M)):
            consts = dict(FORMAT=qg.FORMATS[fmt], GROUP_N=group[0], GROUP_K=group[1], TOP_K=8,
                          A_PER_TOKEN=per_token, SCALE=scale, NUM_EXPERTS=384, BLOCK_M=block_m,
                          BLOCK_N=64, BLOCK_K=128 if fmt == "int4" else 64,
                          SPLIT=fmt == "int4")
            dequants = [("convert", torch.bfloat16)]
            if fmt == "int4" and per_token and block_m == moe.BLOCK_M:
                dequants = [(d, torch.bfloat16) for d in qg.DEQUANTS]
            elif fmt == "int4" and scale:
                dequants.append(("magic16x2_join", torch.float16))
            for dequant, dtype in dequants:
                act = "*fp16" if dtype == torch.float16 else "*bf16"
                weight = qg.QuantWeight(fmt, torch.empty(0), torch.empty(0, dtype=dtype), group,
                                        128)
                consts.update(qg._dequant(weight, dtype, dequant))
                assert "cubin" in compile_sm90(qg._quant_grouped_gemm, consts, dict(
                    a_ptr=act, w_ptr=w, s_ptr=act if fmt == "int4" else s, c_ptr=act,
                    scale_ptr="*fp32", sorted_ptr="*i64", tile_expert_ptr="*i64"))


def compile_moe_decode() -> None:
    """The decode-step experts' kernels (down: looping over the picks and one per pick) for
    bf16 (also with the shared experts folded in), int4 (bf16 scales; "subnormal", "mask" and
    "magic") and fp8 weights, in each format's default tiles."""
    import triton.language as tl

    import blockspec.layers.int4_bits as ib
    import blockspec.layers.moe_decode as md

    assert "cubin" in compile_sm90(ib._subnormal_inputs_kernel, dict(BLOCK_W=256), dict(
        x_ptr="*bf16", out_ptr="*fp32"))
    for fmt, w, s, group in ((md.DENSE, "*bf16", "*bf16", (1, 1)), (md.INT4, "*i32", "*bf16",
                                                                   (1, 32)),
                             (md.FP8, "*fp8e4nv", "*fp32", (128, 128))):
        common = dict(FORMAT=fmt, GROUP_N=group[0], GROUP_K=group[1], TOP_K=8,
                      MAGIC=0x4300 if fmt == md.INT4 else 0)
        tg, td = md.DEFAULT_TILES[fmt]["gate_up"], md.DEFAULT_TILES[fmt]["down"]
        # int4: as subnormals (the default), masked in place (MASK32) and by the 16-bit magic
        # float; bf16 also with the shared experts folded in
        variants = [(md.SUBNORMAL, False), (md.MASK32, False), (0x4300, False)] \
            if fmt == md.INT4 else [(0, False)]
        variants += [(0, True)] if fmt == md.DENSE else []
        for magic, shared in variants:
            act = "*fp32" if magic == md.SUBNORMAL else "*bf16"  # subnormal inputs
            kernel = compile_kernel_sm90(md._gate_up_act_kernel, dict(
                common, MAGIC=magic, COUNT=True, S_PAD=8, BLOCK_N=tg.block_n,
                BLOCK_K=tg.block_k, HAS_SHARED=shared, ACT=tl.bfloat16,
                ACT_T=magic == md.SUBNORMAL), dict(
                x_ptr=act, ids_ptr="*i64", w_ptr=w, s_ptr=s, sw_ptr="*bf16", act_ptr=act,
                stats_ptr="*i64"), num_warps=tg.num_warps, enable_fp_fusion=True)
            assert "cubin" in kernel.asm
            down = dict(common, MAGIC=magic, HAS_RES=not shared, HAS_SHARED=shared,
                        BLOCK_N=td.block_n, BLOCK_K=td.block_k)
            ptrs = dict(act_ptr=act, ids_ptr="*i64", wts_ptr="*bf16", w_ptr=w, s_ptr=s,
                        sd_ptr="*bf16", res_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32",
                        lock_ptr="*i32")
            for fn in (md._down_sum_kernel, md._down_split_kernel):  # looping, one per pick
                kernel = compile_kernel_sm90(fn, down, ptrs, num_warps=td.num_warps,
                                             enable_fp_fusion=True)
                assert "cubin" in kernel.asm


def compile_pdl() -> None:
    """With USE_PDL the decode kernels carry the grid-dependency wait and trigger; without it,
    neither (pdl.py)."""
    import blockspec.layers.linear as lin

    ptrs = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16")
    for on in (True, False):
        ptx = compile_kernel_sm90(lin._gemv_kernel, dict(BLOCK_N=2, BLOCK_K=1024, USE_PDL=on),
                                  ptrs, launch_pdl=on).asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == on
        assert ("griddepcontrol.launch_dependents" in ptx) == on


def main() -> int:
    import triton
    import triton.language as tl

    import blockspec.layers.fused_moe as moe
    import blockspec.layers.triton_attention as ta
    import blockspec.layers.triton_kv_store as kv
    import blockspec.layers.triton_mla as mla

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
    for heads, dim, shared_kv in ((8, 128, False), (1, 576, True)):
        store = dict(NUM_KV_HEADS=heads, HEAD_DIM=dim, BLOCK_SIZE=16,
                     H_PAD=heads, D_PAD=triton.next_power_of_2(dim), SHARED_KV=shared_kv)
        assert "cubin" in compile_sm90(kv._store_kv_kernel, store, dict(
            k_ptr="*bf16", v_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16",
            slot_ptr="*i64"))
    compile_mla(mla)
    for per_token, scale in ((True, False), (False, True)):
        consts = dict(TOP_K=8, A_PER_TOKEN=per_token, SCALE=scale, NUM_EXPERTS=384,
                      BLOCK_M=moe.BLOCK_M, BLOCK_N=64, BLOCK_K=64,
                      DOT_PRECISION="tf32")
        assert "cubin" in compile_sm90(moe._grouped_gemm, consts, dict(
            a_ptr="*bf16", w_ptr="*bf16", c_ptr="*bf16", scale_ptr="*fp32", sorted_ptr="*i64",
            tile_expert_ptr="*i64"))
    for experts, block_s in ((64, 128), (384, 16)):
        consts = dict(NUM_EXPERTS=experts, E_PAD=triton.next_power_of_2(experts),
                      BLOCK_M=moe.BLOCK_M, BLOCK_S=block_s, COUNT=True)
        kernel = compile_kernel_sm90(moe._align_kernel, consts, dict(
            ids_ptr="*i64", sorted_ptr="*i64", tile_expert_ptr="*i64", stats_ptr="*i64"),
            num_warps=8)
        assert "cubin" in kernel.asm and kernel.metadata.shared <= SHARED_LIMIT
    import blockspec.layers.moe_router as router

    for e, k, groups in ((64, 6, (1, 1)), (384, 8, (1, 1)), (256, 8, (8, 4))):
        consts = dict(E=e, E_PAD=triton.next_power_of_2(e), TOP_K=k, K_PAD=8,
                      N_GROUP=groups[0], TOPK_GROUP=groups[1], HAS_BIAS=True, NORM=True)
        assert "cubin" in compile_sm90(router._route_kernel, consts, dict(
            logits_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i64",
            scaling="fp32"))
    import blockspec.layers.quant_gemm as qg

    compile_quant_gemm(qg, moe)
    compile_moe_decode()
    import blockspec.layers.mla_fused as mf

    # DeepSeek-V3's 512 + 64 latent, into `entry` or straight into 16-slot cache blocks
    for interleaved, block_size in ((True, 0), (False, 0), (True, 16)):
        consts = dict(LATENT=512, ROPE=64, HALF_BLOCK=32, LATENT_BLOCK=512,
                      INTERLEAVED=interleaved, BLOCK_SIZE=block_size)
        kernel = compile_kernel_sm90(mf._mla_rope_norm_kernel, consts, dict(
            q_ptr="*bf16", kv_ptr="*bf16", pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32",
            w_ptr="*bf16", q_out_ptr="*bf16", entry_ptr="*bf16", slot_ptr="*i64", eps="fp32"),
            num_warps=4, enable_fp_fusion=False)
        assert "cubin" in kernel.asm
    import blockspec.layers.mla_absorb as ma

    for block_n, block_k in ((32, 128), (8, 512)):  # q_nope @ W_UK, out @ W_UV^T (Moonlight)
        assert "cubin" in compile_sm90(ma._absorb_kernel, dict(BLOCK_N=block_n, BLOCK_K=block_k),
                                       dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16"))
    import blockspec.layers.mla_one_token as mo

    # Moonlight's one-token launches: W_UK absorb + rope / latent norm into the cache, W_UV
    # absorb merging 32 splits (mla_one_token.py)
    consts = dict(LATENT=512, ROPE=64, HALF_BLOCK=32, LATENT_BLOCK=512, INTERLEAVED=False,
                  BLOCK_SIZE=16, BLOCK_N=32, BLOCK_K=128)
    assert "cubin" in compile_kernel_sm90(mo._absorb_rope_norm_kernel, consts, dict(
        x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", q_ptr="*bf16", kv_ptr="*bf16",
        pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", nw_ptr="*bf16", q_out_ptr="*bf16",
        entry_ptr="*bf16", slot_ptr="*i64", eps="fp32"), num_warps=4,
        enable_fp_fusion=False).asm
    consts = dict(NUM_SPLITS=32, ACT=tl.bfloat16, BLOCK_N=mo.MERGE_BLOCK_N, BLOCK_K=512)
    assert "cubin" in compile_kernel_sm90(mo._absorb_merge_kernel, consts, dict(
        part_ptr="*fp32", lse_ptr="*fp32", w_ptr="*bf16", y_ptr="*bf16"),
        num_warps=mo.MERGE_WARPS, enable_fp_fusion=False).asm
    compile_pdl()
    import blockspec.layers.split_gemv as sg

    assert "cubin" in compile_sm90(sg._split_gemv_kernel, dict(BLOCK_N=2, BLOCK_K=512), dict(
        x_ptr="*bf16", w_ptr="*fp32", y_ptr="*fp32", part_ptr="*fp32", lock_ptr="*i32"))
    import blockspec.layers.gated_gemv as gg

    assert "cubin" in compile_sm90(gg._gated_gemv_kernel, dict(BLOCK_N=2, BLOCK_K=1024), dict(
        x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16"))
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
