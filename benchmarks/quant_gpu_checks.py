"""GPU checks of the quantized kernels (layers/quant_gemm.py), bf16 activations, before any
quantized model runs on a GPU:

1. W4A16 int4 (group 32, bf16 scales) and FP8 (128 x 128 blocks) routed experts at Kimi-K2 /
   DeepSeek-V3 expert shapes (384 / 256 experts of 2048, top 8, hidden 7168) == experts_reference
   over the dequantized bf16 weights, decode to prefill sizes; captured in a CUDA graph and
   replayed on new routing.
2. Dense layers (MLA's q_b_proj, o_proj shapes) through quant_linear == F.linear over the
   dequantized weight, at 1, 16 and 300 rows.
3. `--tune`: the routed experts' time (CUDA-graph replay) and bytes/s at 1, 8 and 64 tokens for
   each tile shape in TUNE_TILES, and the bf16 grouped GEMMs' at the same shape and routing.

Usage: python benchmarks/quant_gpu_checks.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from blockspec.bench.check_runner import check_report, run_checks
from blockspec.bench.gpu_timing import graph_ms
from blockspec.bench.moe_shapes import random_routing
from blockspec.layers.fused_moe import fused_experts
from blockspec.layers.moe import experts_reference, select_experts
from blockspec.layers.quant_dequant import DequantizedExperts, QuantWeight, dequantize
from blockspec.layers.quant_gemm import Tiles, fused_experts_quant, quant_linear

H, INTER, TOP_K = 7168, 2048, 8
TUNE_TILES = [Tiles(n, k, w) for n, k, w in ((32, 128, 4), (64, 64, 4), (64, 128, 4),
                                              (64, 256, 4), (64, 256, 8), (128, 128, 4),
                                              (128, 128, 8), (128, 256, 8))]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def random_weight(fmt: str, shape: tuple[int, ...], k: int, g: torch.Generator) -> QuantWeight:
    if fmt == "int4":
        data = torch.randint(-(1 << 31), (1 << 31) - 1, (*shape, k // 8), dtype=torch.int32,
                             device="cuda", generator=g)
        scale = torch.full((*shape, k // 32), 0.5 / k**0.5, dtype=torch.bfloat16, device="cuda")
        return QuantWeight("int4", data, scale, (1, 32), k)
    data = torch.randn(*shape, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
    scale = torch.rand(*shape[:-1], -(-shape[-1] // 128), -(-k // 128), device="cuda",
                       generator=g) / k**0.5
    return QuantWeight("fp8", data, scale, (128, 128), k)


def check_experts(fmt: str, num_experts: int, report: dict) -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    gate_up = random_weight(fmt, (num_experts, 2 * INTER), H, g)
    down = random_weight(fmt, (num_experts, H), INTER, g)

    def ref(x, w, ids):
        return experts_reference(x, w, ids, DequantizedExperts(gate_up, x.dtype),
                                 DequantizedExperts(down, x.dtype))

    def routing(t: int):
        w, ids = select_experts(torch.randn(t, num_experts, device="cuda", generator=g), None,
                                TOP_K, 1, 1, True, 2.8)
        return w.to(torch.bfloat16), ids

    errs = {}
    for t in (1, 16, 300):
        x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16, generator=g)
        w, ids = routing(t)
        errs[t] = rel_err(fused_experts_quant(x, w, ids, gate_up, down), ref(x, w, ids))
    x = torch.randn(16, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w, ids = routing(16)
    fused_experts_quant(x, w, ids, gate_up, down)  # warm-up: compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts_quant(x, w, ids, gate_up, down)
    w2, ids2 = routing(16)
    w.copy_(w2)
    ids.copy_(ids2)
    graph.replay()
    errs["graph_t16"] = rel_err(out, ref(x, w, ids))
    report[f"{fmt}_experts_rel_err"] = errs
    print(f"{fmt} experts ({num_experts}): {errs}")
    assert all(v < 2e-2 for v in errs.values())


def check_dense(fmt: str, report: dict) -> None:
    g = torch.Generator(device="cuda").manual_seed(4)
    errs = {}
    for n, k in ((64 * 192, 1536), (H, 64 * 128)):
        w = random_weight(fmt, (n,), k, g)
        dense = dequantize(w).to(torch.bfloat16)
        for m in (1, 16, 300):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            errs[f"{n}x{k}_m{m}"] = rel_err(quant_linear(x, w), F.linear(x, dense))
    report[f"{fmt}_linear_rel_err"] = errs
    print(f"{fmt} linear: {errs}")
    assert all(v < 2e-2 for v in errs.values())


def weight_bytes(w: QuantWeight) -> int:
    return w.data.numel() * w.data.element_size() + w.scale.numel() * w.scale.element_size()


def tune(fmt: str, num_experts: int, report: dict) -> None:
    g = torch.Generator(device="cuda").manual_seed(5)
    gate_up = random_weight(fmt, (num_experts, 2 * INTER), H, g)
    down = random_weight(fmt, (num_experts, H), INTER, g)
    per_expert = (weight_bytes(gate_up) + weight_bytes(down)) / num_experts
    bf16 = (torch.randn(num_experts, 2 * INTER, H, device="cuda", dtype=torch.bfloat16),
            torch.randn(num_experts, H, INTER, device="cuda", dtype=torch.bfloat16))
    rows = []
    for t in (1, 8, 64):
        x, w, ids, distinct = random_routing(t, H, num_experts, TOP_K, "cuda", g)
        row = {"tokens": t, "experts": distinct,
               "bf16_ms": graph_ms(lambda x=x, w=w, ids=ids, ref=bf16: fused_experts(x, w, ids,
                                                                                    *ref))}
        for tiles in TUNE_TILES:
            name = f"{tiles.block_n}x{tiles.block_k}w{tiles.num_warps}"
            try:
                ms = graph_ms(lambda x=x, w=w, ids=ids, tiles=tiles: fused_experts_quant(
                    x, w, ids, gate_up, down, tiles=tiles))
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: not a choice
                row[name] = {"error": repr(e)[:200]}
                continue
            row[name] = {"ms": ms, "GBps": distinct * per_expert / (ms * 1e-3) / 1e9}
        rows.append(row)
        best = min((k for k, v in row.items() if isinstance(v, dict) and "ms" in v),
                   key=lambda k: row[k]["ms"])
        print(f"{fmt} experts, {t} tokens ({distinct} experts): bf16 {row['bf16_ms']:.3f} ms; "
              f"best {best} {row[best]['ms']:.3f} ms ({row[best]['GBps']:.0f} GB/s)", flush=True)
    report[f"{fmt}_experts_tiles"] = rows
    del bf16
    torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="quant_gpu_checks.json")
    ap.add_argument("--tune", action="store_true", help="also time the experts' tile shapes")
    args = ap.parse_args()
    report = check_report("benchmarks/quant_gpu_checks.py")
    checks = {"check_0": lambda: check_experts("int4", 384, report),
              "check_1": lambda: check_experts("fp8", 256, report),
              "check_2": lambda: check_dense("int4", report),
              "check_3": lambda: check_dense("fp8", report)}
    if args.tune:
        checks.update(tune_int4=lambda: tune("int4", 384, report),
                      tune_fp8=lambda: tune("fp8", 256, report))
    ok = run_checks(checks, report)
    report["all_passed"] = ok
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
