"""GPU correctness checks of the fast path (issue 4), before timing anything.

1. Triton paged attention == torch reference on CUDA (bf16, Qwen3-8B heads, decode / verify /
   prefill / mixed / non-causal drafter blocks, long contexts that take the split-KV path; also
   with max_seq_len 40960 as a graph passes it: more splits than short contexts fill); with the
   (sequence, tile) grid and the flat grid, and the flat step's short queries launched apart.
2. Fused kernels == their torch twins, the skinny-batch matmuls == F.linear, the grouped-GEMM
   MoE experts == their torch reference (and replayed from a CUDA graph), on CUDA.
3. Tiny Qwen3 on CUDA, fp32: greedy with CUDA graphs == eager == HF `generate`; DFlash with graphs
   == autoregressive; batches that do not fill their graph bucket; requests finishing mid-batch;
   requests arriving as others finish (mixed steps: one flat-step graph replay, or eager).

Usage: python benchmarks/gpu_checks.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from blockspec import LLM, SamplingParams
from blockspec.bench.async_checks import check_async_speculation
from blockspec.bench.check_runner import check_report, run_checks
from blockspec.dflash.checkpoint import build_random_drafter
from blockspec.layers import fused, linear
from blockspec.layers.attention import AttentionMetadata, TorchAttentionBackend
from blockspec.layers.triton_attention import TritonAttentionBackend
from blockspec.tiny import build_tiny_model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def check_attention(report: dict) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    bs, hkv, hq, d = 16, 8, 32, 128
    nblocks = 2048
    kc = torch.randn(nblocks, bs, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(nblocks, bs, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cases = {"decode": ([1] * 8, [37, 512, 1025, 3000, 16, 1, 700, 4096], True),
             "verify": ([16] * 6, [16, 530, 1100, 2048, 77, 4000], True),
             "prefill": ([300, 1, 64, 512], [300, 900, 64, 512], True),
             "draft": ([16] * 5, [16, 600, 1200, 33, 2500], False),
             "mixed": ([16, 300, 1, 16, 37], [530, 900, 1025, 16, 37], True)}
    torch_b, triton_b = TorchAttentionBackend(), TritonAttentionBackend()
    flat_b = TritonAttentionBackend(flat_grid=True)
    perm = torch.randperm(nblocks, generator=torch.Generator().manual_seed(1)).tolist()
    for name, (qlens, slens, causal) in cases.items():
        tables, used = [], 0
        for s in slens:
            n = -(-s // bs)
            tables.append(perm[used:used + n])
            used += n
        meta = AttentionMetadata.build(qlens, slens, tables, [0] * sum(qlens), "cuda",
                                       causal=causal)
        q = torch.randn(sum(qlens), hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = torch_b.attend(q, kc, vc, meta, d**-0.5)
        for tag, max_len in (("", meta.max_seq_len), ("_maxlen40960", 40960)):
            # NOTE: graphs pass max_model_len as max_seq_len: more splits than the contexts fill
            meta.max_seq_len = max_len
            for grid, backend, short in (("", triton_b, 0), ("_flat_grid", flat_b, 0),
                                         ("_flat_grid_short4", flat_b, 4),
                                         ("_flat_grid_short16", flat_b, 16)):
                meta.short_query_len = short  # the flat step's two launches
                err = rel_err(backend.attend(q, kc, vc, meta, d**-0.5), ref)
                report[f"attention_{name}{tag}{grid}_rel_err"] = err
                print(f"triton attention {name}{tag}{grid}: rel err {err:.2e}")
                assert err < 2e-2, name + tag + grid
            meta.short_query_len = 0


def check_mla(report: dict) -> None:
    """The MLA kernel (layers/triton_mla.py) == the torch backend on a bf16 latent cache of
    512 + 64 values (K = V), 16 and 128 heads, decode / verify / prefill / mixed batches, with
    the graphs' max_seq_len, the flat grid and the short-query launches."""
    from blockspec.layers.triton_mla import TritonMLABackend

    g = torch.Generator(device="cuda").manual_seed(6)
    bs, d, rank, nblocks = 16, 576, 512, 1024
    cache = torch.randn(nblocks, bs, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cases = {"decode": ([1] * 6, [37, 512, 1025, 3000, 1, 4096]),
             "verify": ([8] * 4, [16, 530, 2048, 4000]),
             "prefill": ([300, 1, 64], [300, 900, 64]),
             "mixed": ([16, 300, 1, 8], [530, 900, 1025, 37])}
    perm = torch.randperm(nblocks, generator=torch.Generator().manual_seed(2)).tolist()
    for heads in (16, 128):
        for name, (qlens, slens) in cases.items():
            tables, used = [], 0
            for n in slens:
                tables.append(perm[used:used + -(-n // bs)])
                used += -(-n // bs)
            meta = AttentionMetadata.build(qlens, slens, tables, [0] * sum(qlens), "cuda")
            q = torch.randn(sum(qlens), heads, d, device="cuda", dtype=torch.bfloat16,
                            generator=g)
            ref = TorchAttentionBackend().attend(q, cache, cache, meta, d**-0.5)[..., :rank]
            for tag, max_len, flat, short in (("", meta.max_seq_len, False, 0),
                                              ("_maxlen40960", 40960, False, 0),
                                              ("_flat_short16", 40960, True, 16)):
                meta.max_seq_len, meta.short_query_len = max_len, short
                out = TritonMLABackend(flat_grid=flat).attend(q, cache, cache, meta, d**-0.5)
                err = rel_err(out[..., :rank], ref)
                report[f"mla_h{heads}_{name}{tag}_rel_err"] = err
                print(f"triton MLA H={heads} {name}{tag}: rel err {err:.2e}")
                assert err < 2e-2 and out[..., rank:].abs().max() == 0, f"{heads} {name}{tag}"
    check_mla_one_token(report, cache, perm, g)


def check_mla_one_token(report: dict, cache: torch.Tensor, perm: list[int],
                        g: torch.Generator) -> None:
    """One token's split-KV partials merged in the W_UV absorb (layers/mla_one_token.py)
    against the merge kernel then the absorb, at Moonlight's and Kimi's heads (v 128): whether
    bit-equal, and the relative difference."""
    from blockspec.layers.mla_absorb import absorb
    from blockspec.layers.mla_one_token import absorb_merge
    from blockspec.layers.triton_mla import TritonMLABackend

    d, rank = cache.shape[-1], 512
    for heads in (16, 64):
        for n in (37, 640, 3000):
            meta = AttentionMetadata.build([1], [n], [perm[:-(-n // cache.shape[1])]], [0],
                                           "cuda")
            meta.max_seq_len = 40960  # the graphs' bucket: 32 splits, some without keys
            q = torch.randn(1, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
            w_uv = torch.randn(heads, 128, rank, device="cuda", dtype=torch.bfloat16,
                               generator=g) / rank**0.5
            backend = TritonMLABackend()
            want, got = (torch.empty(1, heads, 128, device="cuda", dtype=torch.bfloat16)
                         for _ in range(2))
            absorb(backend.attend(q, cache, cache, meta, d**-0.5)[..., :rank], w_uv, want,
                   "triton")
            absorb_merge(*backend.attend_partials(q, cache, meta, d**-0.5), w_uv, got)
            err, key = rel_err(got, want), f"mla_one_token_h{heads}_ctx{n}"
            report[f"{key}_rel_err"] = err
            report[f"{key}_bit_equal"] = bool(torch.equal(got, want))
            print(f"MLA one-token merge H={heads} ctx={n}: rel err {err:.2e}, bit-equal "
                  f"{torch.equal(got, want)}")
            assert err < 1e-2, key


def check_linear(report: dict) -> None:
    """The skinny-batch Triton matmuls (layers/linear.py) == F.linear, Qwen3-8B shapes, bf16."""
    g = torch.Generator(device="cuda").manual_seed(4)
    errs = {}
    for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
        for m in (1, 15, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            kernel = linear.gemv if m == 1 else linear.skinny
            if m > 1 and linear.skinny_config(m, n, k) is None:
                continue
            errs[f"{m}x{k}->{n}"] = rel_err(kernel(x, w), torch.nn.functional.linear(x, w))
    report["linear_rel_err"] = errs
    print(f"skinny matmuls: {errs}")
    assert all(e < 1e-2 for e in errs.values())
    check_gated_and_split(report, g)


def check_gated_and_split(report: dict, g: torch.Generator) -> None:
    """gated_gemv == gemv then silu_and_mul bit for bit (Kimi K2.6's shared expert, Qwen3-8B's
    MLP); split_gemv (the routers, fp32) == F.linear to fp32 reduction order."""
    from blockspec.layers.gated_gemv import gated_gemv
    from blockspec.layers.split_gemv import split_gemv

    equal = {}
    for n, k in ((4096, 7168), (24576, 4096)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
        equal[f"{k}->{n}"] = bool(torch.equal(gated_gemv(x, w),
                                              fused.silu_and_mul(linear.gemv(x, w))))
    errs = {}
    for n, k in ((384, 7168), (64, 2048)):
        w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
        y = split_gemv(x, w, torch.float32)
        errs[f"{k}->{n}"] = rel_err(y, torch.nn.functional.linear(x.float(), w))
        equal[f"split {k}->{n} repeat"] = bool(torch.equal(y, split_gemv(x, w, torch.float32)))
    report["gated_split"] = {"equal": equal, "split_rel_err": errs}
    print(f"gated / split GEMVs: equal {equal}, split rel err {errs}")
    assert all(equal.values()) and all(e < 1e-5 for e in errs.values())


def check_fused(report: dict) -> None:
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    r = torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, generator=g)
    y, nr = fused.fused_add_rms_norm(x, r, w, 1e-6)
    y0, nr0 = fused.fused_add_rms_norm(x, r, w, 1e-6, use_triton=False)
    gu = torch.randn(37, 2 * 12288, device="cuda", dtype=torch.bfloat16, generator=g)
    errs = {"add_rms_norm": rel_err(y, y0), "residual": rel_err(nr, nr0),
            "silu_and_mul": rel_err(fused.silu_and_mul(gu),
                                    fused.silu_and_mul(gu, use_triton=False))}
    report["fused_rel_err"] = errs
    print(f"fused kernels: {errs}")
    assert all(e < 1e-2 for e in errs.values())


def random_prompts(n: int, max_len: int, seed: int) -> list[list[int]]:
    """`n` random token-id prompts of 3 to `max_len` tokens."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 500, (int(k),), generator=g).tolist()
            for k in torch.randint(3, max_len, (n,), generator=g)]


def run_variants(target: Path, prompts: list, params: list, kw: dict, report: dict, key: str,
                 variants: tuple) -> dict[str, list]:
    """Each (name, engine args) variant's greedy tokens; its steps by path into the report;
    every KV block back in the pool after its run."""
    runs = {}
    for name, extra in variants:
        llm = LLM(str(target), **{**kw, **extra})
        runs[name] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        report[f"{key}_{name}_steps_by_path"] = dict(llm.engine.runner.path_steps)
        assert llm.engine.block_manager.num_used_blocks == 0, f"{name}: leaked blocks"
        del llm
    return runs


def compare_with_hf(target: Path, prompts: list, params: list, runs: dict, report: dict,
                    key: str, label: str, first_mismatch: bool = False) -> None:
    """Each run's greedy tokens == HF `generate` on the same folder (fp32, on the GPU)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).cuda().eval()
    ref = []
    for p, sp in zip(prompts, params):
        y = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=sp.max_tokens,
                        do_sample=False, eos_token_id=None, pad_token_id=0)
        ref.append(y[0, len(p):].tolist())
    for name, toks in runs.items():
        report[f"{key}_{name}_equals_hf"] = toks == ref
        if first_mismatch:
            report[f"{key}_{name}_first_mismatch"] = [
                next((j for j, (a, b) in enumerate(zip(t, r)) if a != b), None)
                for t, r in zip(toks, ref)]
        print(f"{label} fp32 {name} == HF generate: {toks == ref}")
    assert all(toks == ref for toks in runs.values())


def check_engine(tmp: Path, report: dict) -> None:
    target = build_tiny_model(tmp / "qwen3", arch="qwen3")
    drafter = build_random_drafter(tmp / "drafter", target, num_layers=2, block_size=8)
    prompts = random_prompts(13, 200, seed=3)
    # Different max_tokens: requests finish mid-batch and the batch shrinks across buckets.
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True)
              for i in range(13)]
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=512, max_num_seqs=16)
    # NOTE: max_num_seqs 4: requests arrive as others finish, so steps mix prefills with
    # decodes (one flat-step graph replay, or one eager forward).
    runs = run_variants(target, prompts, params, kw, report, "engine", (
        # NOTE: the default on CUDA is async scheduling; "_sync" runs without it.
        ("graphs", {}), ("graphs_sync", {"async_scheduling": False}),
        ("eager", {"enforce_eager": True}),
        ("torch_backend_eager", {"enforce_eager": True, "attention_backend": "torch"}),
        ("dflash_graphs", {"draft": str(drafter)}),
        ("dflash_graphs_sync", {"draft": str(drafter), "async_scheduling": False}),
        ("dflash_eager", {"draft": str(drafter), "enforce_eager": True}),
        ("graphs_c4", {"max_num_seqs": 4}),
        ("graphs_c4_eager_mixed", {"max_num_seqs": 4, "graph_mixed_steps": False}),
        ("dflash_graphs_c4", {"draft": str(drafter), "max_num_seqs": 4}),
        ("dflash_fixed_graphs_c4", {"draft": str(drafter), "max_num_seqs": 4,
                                    "speculation_policy": "fixed"}),
        ("dflash_graphs_c4_eager_mixed", {"draft": str(drafter), "max_num_seqs": 4,
                                          "graph_mixed_steps": False})))
    assert report["engine_dflash_graphs_c4_steps_by_path"].get("flat", 0) > 0
    assert report["engine_dflash_fixed_graphs_c4_steps_by_path"].get("flat", 0) > 0
    compare_with_hf(target, prompts, params, runs, report, "engine", "tiny qwen3")


def check_engine_deepseek(tmp: Path, report: dict) -> None:
    """A tiny DeepSeek-V3 target (MLA + MoE) through the engine on the GPU, fp32, alone and with
    a DFlash drafter, == HF generate on the same weights."""
    from blockspec.tiny import build_tiny_deepseek_v3

    target = build_tiny_deepseek_v3(tmp / "dsv3", q_lora_rank=24, n_group=4, topk_group=2)
    drafter = build_random_drafter(tmp / "ds_drafter", target, num_layers=2, block_size=8)
    prompts = random_prompts(9, 120, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True)
              for i in range(9)]
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=4)
    # NOTE: graphs by default (the MLA kernel, the grouped-GEMM experts); the torch experts
    # read the router on the host and run eagerly.
    runs = run_variants(target, prompts, params, kw, report, "deepseek", (
        ("ar", {}), ("ar_eager", {"enforce_eager": True}),
        ("ar_torch_experts", {"linear_backend": "torch"}),
        ("dflash", {"draft": str(drafter)}),
        ("dflash_eager", {"draft": str(drafter), "enforce_eager": True})))
    compare_with_hf(target, prompts, params, runs, report, "deepseek", "tiny deepseek_v3",
                    first_mismatch=True)


def check_fused_moe(report: dict) -> None:
    """The grouped-GEMM experts (layers/fused_moe.py) == experts_reference, bf16, Kimi-K2 expert
    shapes (384 experts of 2048, top 8, hidden 7168), decode to prefill sizes; and captured in
    a CUDA graph, replayed on new routing."""
    from blockspec.layers.fused_moe import fused_experts
    from blockspec.layers.moe import experts_reference, select_experts

    g = torch.Generator(device="cuda").manual_seed(5)
    e, k, h, i = 384, 8, 7168, 2048
    gate_up = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g) / h**0.5
    down = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=g) / i**0.5
    errs = {}
    for t in (1, 16, 300):
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
        w, ids = select_experts(torch.randn(t, e, device="cuda", generator=g), None, k, 1, 1,
                                True, 2.8)
        w = w.to(x.dtype)
        errs[t] = rel_err(fused_experts(x, w, ids, gate_up, down),
                          experts_reference(x, w, ids, gate_up, down))
    x = torch.randn(16, h, device="cuda", dtype=torch.bfloat16, generator=g)
    w, ids = select_experts(torch.randn(16, e, device="cuda", generator=g), None, k, 1, 1, True,
                            2.8)
    w = w.to(x.dtype)
    fused_experts(x, w, ids, gate_up, down)  # warm-up: compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w, ids, gate_up, down)
    w2, ids2 = select_experts(torch.randn(16, e, device="cuda", generator=g), None, k, 1, 1,
                              True, 2.8)
    w.copy_(w2)
    ids.copy_(ids2)
    graph.replay()
    errs["graph_t16"] = rel_err(out, experts_reference(x, w, ids, gate_up, down))
    report["fused_moe_rel_err"] = errs
    from blockspec.layers.fused_moe import align_slots_kernel, align_slots_reference

    same = {}
    for t in (1, 16, 128):  # the one-program alignment == the torch sort, slot for slot
        _, ids = select_experts(torch.randn(t, e, device="cuda", generator=g), None, k, 1, 1,
                                True, 2.8)
        got, want = align_slots_kernel(ids, e), align_slots_reference(ids, e)
        same[t] = bool(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
    report["moe_align_kernel_equals_torch"] = same
    from blockspec.layers.moe import select_experts_reference
    from blockspec.layers.moe_router import route

    for name, (experts, top_k, groups) in {"kimi": (384, 8, (1, 1)), "moonlight": (64, 6, (1, 1)),
                                           "deepseek_v3": (256, 8, (8, 4))}.items():
        logits = torch.randn(64, experts, device="cuda", generator=g)
        bias = torch.randn(experts, device="cuda", generator=g) * 0.1
        w, ids = route(logits, bias, top_k, *groups, True, 2.5)
        w0, ids0 = select_experts_reference(logits, bias, top_k, *groups, True, 2.5)
        same[f"router_{name}"] = bool(torch.equal(ids, ids0)) and rel_err(w, w0) < 1e-5
    print(f"MoE alignment kernel == torch sort: {same}")
    assert all(same.values())
    print(f"fused MoE: {errs}")
    assert all(v < 2e-2 for v in errs.values())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_checks.json")
    ap.add_argument("--only", default="", help="comma-separated check names (default: all)")
    args = ap.parse_args()
    report = check_report("benchmarks/gpu_checks.py")
    checks = {c.__name__: (lambda c=c: c(report)) for c in (
        check_attention, check_mla, check_fused, check_linear, check_fused_moe)}
    with tempfile.TemporaryDirectory() as d:
        checks.update({c.__name__: (lambda c=c: c(Path(d), report))
                       for c in (check_engine, check_engine_deepseek, check_async_speculation)})
        only = [x for x in args.only.split(",") if x]
        ok = run_checks({k: v for k, v in checks.items() if not only or k in only}, report)
    report["all_passed"] = ok
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
