"""GPU checks of the quantized kernels (layers/quant_gemm.py), bf16 activations, before any
quantized model runs on a GPU:

1. W4A16 int4 (group 32, bf16 scales) and FP8 (128 x 128 blocks) routed experts at Kimi-K2 /
   DeepSeek-V3 expert shapes (384 / 256 experts of 2048, top 8, hidden 7168) == experts_reference
   over the dequantized bf16 weights, decode to prefill sizes; captured in a CUDA graph and
   replayed on new routing.
2. Dense layers (MLA's q_b_proj, o_proj shapes) through quant_linear == F.linear over the
   dequantized weight, at 1, 16 and 300 rows.
3. int4's dequantizations (quant_gemm.DEQUANTS) == "convert"'s, bit for bit, in bf16 with
   random bf16 scales: routed experts at Kimi's shape and a dense layer.
4. `--tune [FORMAT ...]` (all formats if none named): the routed experts' time (CUDA-graph
   replay) and bytes/s at TUNE_TOKENS for each tile shape in TUNE_TILES (int4: also its other
   dequantizations at DEQUANT_TILES), and the bf16 grouped GEMMs' at the same shape and routing;
   int4 ends with the fastest dequantization per token count and the config to make
   quant_gemm.DEFAULT_TILES["int4"].

Usage: python benchmarks/quant_gpu_checks.py [--out FILE] [--tune [int4] [fp8]]
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
from blockspec.layers.quant_gemm import (
    DEFAULT_TILES,
    DEQUANTS,
    Tiles,
    fused_experts_quant,
    quant_linear,
)

H, INTER, TOP_K = 7168, 2048, 8
TUNE_TOKENS = (1, 8, 16, 32, 64)
TUNE_TILES = [Tiles(n, k, w) for n, k, w in ((32, 128, 4), (64, 64, 4), (64, 128, 4),
                                              (64, 256, 4), (64, 256, 8), (128, 128, 4),
                                              (128, 128, 8), (128, 256, 8))]
# NOTE: int4's other dequantizations at four of the fastest "convert" tiles of the 9c019dd run
# (each within 15% of its best at 1, 8 and 64 tokens), to bound the compiles; "magic" (fp32) is
# checked, not timed: for bf16 scales it adds two conversions per value (sm_90 PTX).
MAGIC = [d for d in DEQUANTS if d != "convert"]
DEQUANT_TILES = [Tiles(n, k, w, d) for d in MAGIC if d != "magic"
                 for n, k, w in ((32, 128, 4), (64, 128, 4), (128, 128, 4), (128, 256, 8))]


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


def check_dequants(report: dict) -> None:
    """Each int4 dequantization's output == "convert"'s (same tile shape, so the same dot),
    except the opt-in "*_join" forms, which are recorded: their tl.join assembles the tile in
    another order, which the H200's dot sums differently (~3.5e-3 of max |convert|)."""
    g = torch.Generator(device="cuda").manual_seed(6)

    def weight(shape, k):
        w = random_weight("int4", shape, k, g)
        return w._replace(scale=(torch.rand(w.scale.shape, device="cuda", generator=g) * 2
                                 / k**0.5).to(torch.bfloat16))

    gate_up, down = weight((384, 2 * INTER), H), weight((384, H), INTER)
    dense = weight((H,), 64 * 128)
    base = DEFAULT_TILES["int4"]
    equal, diff = {}, {}

    def same(key: str, got: torch.Tensor, want: torch.Tensor) -> None:
        equal[key] = torch.equal(got, want)
        diff[key] = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()

    for t in (1, 300):  # a decode step's tiles and a prefill's (dense: DENSE_BLOCK_M rows)
        x, w, ids, _ = random_routing(t, H, 384, TOP_K, "cuda", g)
        xd = torch.randn(t, dense.k, device="cuda", dtype=torch.bfloat16, generator=g)
        old = fused_experts_quant(x, w, ids, gate_up, down, tiles=base._replace(dequant="convert"))
        old_dense = quant_linear(xd, dense, base._replace(dequant="convert"))
        for d in MAGIC:
            tiles = base._replace(dequant=d)
            same(f"{d}_experts_t{t}", fused_experts_quant(x, w, ids, gate_up, down, tiles=tiles),
                 old)
            same(f"{d}_linear_m{t}", quant_linear(xd, dense, tiles), old_dense)
    report["int4_dequants_equal"] = equal
    report["int4_dequants_max_rel_diff"] = diff
    print(f"int4 dequantizations == convert: {equal}; max |diff| / max |convert|: {diff}")
    assert all(v for k, v in equal.items() if "_join" not in k)


def weight_bytes(w: QuantWeight) -> int:
    return w.data.numel() * w.data.element_size() + w.scale.numel() * w.scale.element_size()


def config_name(tiles: Tiles) -> str:
    name = f"{tiles.block_n}x{tiles.block_k}w{tiles.num_warps}"
    return name if tiles.dequant == "convert" else f"{name}_{tiles.dequant}"


def tune(fmt: str, num_experts: int, report: dict) -> None:
    g = torch.Generator(device="cuda").manual_seed(5)
    gate_up = random_weight(fmt, (num_experts, 2 * INTER), H, g)
    down = random_weight(fmt, (num_experts, H), INTER, g)
    per_expert = (weight_bytes(gate_up) + weight_bytes(down)) / num_experts
    bf16 = (torch.randn(num_experts, 2 * INTER, H, device="cuda", dtype=torch.bfloat16),
            torch.randn(num_experts, H, INTER, device="cuda", dtype=torch.bfloat16))
    configs = TUNE_TILES + DEQUANT_TILES * (fmt == "int4")
    rows = []
    for t in TUNE_TOKENS:
        x, w, ids, distinct = random_routing(t, H, num_experts, TOP_K, "cuda", g)
        row = {"tokens": t, "experts": distinct,
               "bf16_ms": graph_ms(lambda x=x, w=w, ids=ids, ref=bf16: fused_experts(x, w, ids,
                                                                                    *ref))}
        for tiles in configs:
            try:
                ms = graph_ms(lambda x=x, w=w, ids=ids, tiles=tiles: fused_experts_quant(
                    x, w, ids, gate_up, down, tiles=tiles))
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: not a choice
                row[config_name(tiles)] = {"error": repr(e)[:200]}
                continue
            row[config_name(tiles)] = {"ms": ms, "GBps": distinct * per_expert / (ms * 1e-3)
                                       / 1e9}
        rows.append(row)
        best = min((k for k, v in row.items() if isinstance(v, dict) and "ms" in v),
                   key=lambda k: row[k]["ms"])
        print(f"{fmt} experts, {t} tokens ({distinct} experts): bf16 {row['bf16_ms']:.3f} ms; "
              f"best {best} {row[best]['ms']:.3f} ms ({row[best]['GBps']:.0f} GB/s)", flush=True)
    report[f"{fmt}_experts_tiles"] = rows
    if fmt == "int4":
        report["int4_dequant_choice"] = dequant_choice(rows, configs)
    del bf16
    torch.cuda.empty_cache()


def dequant_choice(rows: list[dict], configs: list[Tiles]) -> dict:
    """Per token count, each dequantization's fastest tile; and the config whose slowest ratio
    to the fastest at each token count is least (the candidate for DEFAULT_TILES["int4"])."""
    ms = {c: [r[config_name(c)].get("ms", float("inf")) for r in rows] for c in configs}
    fastest = [min(v[i] for v in ms.values()) for i in range(len(rows))]
    per_tokens = []
    for i, r in enumerate(rows):
        best = {d: min((c for c in configs if c.dequant == d), key=lambda c: ms[c][i])
                for d in dict.fromkeys(c.dequant for c in configs)}
        per_tokens.append({"tokens": r["tokens"], **{d: {"tiles": config_name(c),
                                                         "ms": ms[c][i]}
                                                     for d, c in best.items()}})
        line = ", ".join(f"{d} {ms[c][i]:.3f} ({config_name(c)})" for d, c in best.items())
        print(f"int4 {r['tokens']} tokens, fastest per dequantization (ms): {line}")
    worst = {c: max(m / f for m, f in zip(ms[c], fastest)) for c in configs}
    pick = min(configs, key=worst.get)
    print(f"int4 candidate default: {pick} (at most {worst[pick]:.2f}x the fastest at "
          f"{TUNE_TOKENS} tokens); convert's best: "
          f"{min((c for c in configs if c.dequant == 'convert'), key=worst.get)}")
    return {"per_tokens": per_tokens, "candidate": pick._asdict(),
            "candidate_worst_ratio": worst[pick]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="quant_gpu_checks.json")
    ap.add_argument("--tune", nargs="*", choices=("int4", "fp8"), default=None,
                    help="also time the experts' tile shapes (of these formats; all if none)")
    args = ap.parse_args()
    report = check_report("benchmarks/quant_gpu_checks.py")
    checks = {"check_0": lambda: check_experts("int4", 384, report),
              "check_1": lambda: check_experts("fp8", 256, report),
              "check_2": lambda: check_dense("int4", report),
              "check_3": lambda: check_dense("fp8", report),
              "check_4": lambda: check_dequants(report)}
    if args.tune is not None:
        for fmt in args.tune or ("int4", "fp8"):
            checks[f"tune_{fmt}"] = lambda fmt=fmt: tune(fmt, 384 if fmt == "int4" else 256,
                                                         report)
    ok = run_checks(checks, report)
    report["all_passed"] = ok
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
