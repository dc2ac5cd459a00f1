"""Block-scaled FP8 dense layers: quant_linear's tiles at decode and prefill sizes, against
cuBLAS over the weight dequantized first and cuBLAS's block-scaled W8A8, one GPU, one run
(issue 23; benchmarks/fp8_a8_ab.py measured the row-scaled W8A8 GEMM).

For DeepSeek-V3's dense shapes (fp8_a8_ab.SHAPES: random e4m3 weights, 128 x 128 block scales,
bf16 activations) at M = 1..8192 rows, each timed as one CUDA graph (gpu_timing.graph_ms):
  - w8a16: quant_linear at its defaults and at every tile of the sweep (TILES_DECODE at M <= 16,
    TILES_PREFILL above: rows a tile, weight rows, K a step, warps, pipeline stages); each
    tile's output is checked against the defaults' (relative error, recorded);
  - dequant_bf16: the weight dequantized to bf16 (quant_dequant.dequantize) then F.linear, in
    the graph: what a layer costs that keeps the FP8 weight and dequantizes per call;
  - bf16: F.linear over a dequantized copy made once (the reference, twice the weight bytes);
  - w8a8_block: torch.nn.functional.scaled_mm with 1 x 128 activation groups and the weight's
    own 128 x 128 blocks (DeepSeek-V3's recipe), the activations' quantization (torch ops) in
    the graph, where this torch and cuBLAS take it (the scale layouts tried are recorded).

Usage: python benchmarks/fp8_tune.py --out FILE.json
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F

# NOTE: this script's folder is on sys.path when run as a script
from fp8_a8_ab import E4M3_MAX, ROWS, run_shapes
from quant_gpu_checks import random_weight, rel_err

from blockspec.bench.gpu_timing import graph_ms
from blockspec.layers.quant_dequant import dequantize
from blockspec.layers.quant_gemm import Tiles, quant_linear

# (block_m, block_n, block_k, num_warps, num_stages)
TILES_DECODE = [(16, bn, bk, 4, st) for bn, bk, st in
                itertools.product((16, 32, 64), (128, 256), (3, 4))]
TILES_PREFILL = [(bm, bn, 128, w, st) for bm, bn, w, st in
                 itertools.product((64, 128), (64, 128, 256), (4, 8), (3, 4))]


def w8a16_rows(x: torch.Tensor, w, default: torch.Tensor) -> dict:
    """{str(tile): ms or error} for the sweep that fits x's rows."""
    out: dict = {}
    for bm, bn, bk, warps, stages in TILES_DECODE if x.shape[0] <= 16 else TILES_PREFILL:
        tiles = Tiles(bn, bk, warps, num_stages=stages)
        try:
            err = rel_err(quant_linear(x, w, tiles, bm), default)
            out[str([bm, bn, bk, warps, stages])] = {
                "ms": graph_ms(lambda t=tiles, b=bm: quant_linear(x, w, t, b)), "rel_err": err}
        except Exception as exc:  # noqa: BLE001 - out of shared memory or registers: recorded
            out[str([bm, bn, bk, warps, stages])] = {"error": repr(exc)[:200]}
    return out


def act_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, K / 128]): one scale a 128-column group."""
    m, k = x.shape
    g = x.float().view(m, k // 128, 128)
    s = g.abs().amax(-1).clamp_min(1e-12) / E4M3_MAX
    return (g / s[..., None]).to(torch.float8_e4m3fn).view(m, k), s


def block_w8a8(x: torch.Tensor, w, ref: torch.Tensor) -> dict:
    """F.scaled_mm's blockwise recipe: the first scale layout that runs and matches `ref`."""
    st = F.ScalingType
    m = x.shape[0]
    mp = -(-m // 16) * 16
    xp = torch.zeros(mp, x.shape[1], device=x.device, dtype=x.dtype)
    xp[:m] = x
    tried = []
    layouts = {"a_col_b_row": (lambda s: s.t().contiguous().t(), lambda s: s),
               "a_col_b_t": (lambda s: s.t().contiguous().t(), lambda s: s.t()),
               "a_row_b_row": (lambda s: s, lambda s: s),
               "a_row_b_t": (lambda s: s, lambda s: s.t())}
    for name, (fa, fb) in layouts.items():
        def run(fa=fa, fb=fb):
            q, s = act_groups(xp)
            return F.scaled_mm(q, w.data.t(), fa(s), st.BlockWise1x128, fb(w.scale),
                               st.BlockWise128x128, output_dtype=torch.bfloat16)
        try:
            err = rel_err(run()[:m], ref)
            if err > 0.1:
                tried.append(f"{name}: rel_err {err:.3g}")
                continue
            return {"layout": name, "ms": graph_ms(run), "rel_err": err, "tried": tried}
        except Exception as exc:  # noqa: BLE001 - this torch / cuBLAS may not take it
            tried.append(f"{name}: {exc!r}"[:300])
    return {"error": "no layout ran", "tried": tried}


def shape_rows(n: int, k: int, g: torch.Generator) -> list[dict]:
    w = random_weight("fp8", (n,), k, g)
    dense = dequantize(w).to(torch.bfloat16)
    rows = []
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        default = quant_linear(x, w)
        ref = F.linear(x, dense)
        row = {"m": m, "bf16_ms": graph_ms(lambda x=x: F.linear(x, dense)),
               "w8a16_default_ms": graph_ms(lambda x=x: quant_linear(x, w)),
               "w8a16_rel_err": rel_err(default, ref),
               "dequant_bf16_ms": graph_ms(
                   lambda x=x: F.linear(x, dequantize(w).to(torch.bfloat16))),
               "w8a8_block": block_w8a8(x, w, ref), "w8a16_tiles": w8a16_rows(x, w, default)}
        timed = {t: v["ms"] for t, v in row["w8a16_tiles"].items() if "ms" in v}
        row["w8a16_best_tile"] = min(timed, key=timed.get) if timed else None
        row["w8a16_best_ms"] = timed[row["w8a16_best_tile"]] if timed else None
        print(f"{n}x{k} M={m}: bf16 {row['bf16_ms']:.4f} ms, w8a16 default "
              f"{row['w8a16_default_ms']:.4f}, best {row['w8a16_best_ms']} at "
              f"{row['w8a16_best_tile']}, dequant+bf16 {row['dequant_bf16_ms']:.4f}, w8a8 block "
              f"{row['w8a8_block'].get('ms', row['w8a8_block'].get('error'))}", flush=True)
        rows.append(row)
    return rows


def main() -> int:
    return run_shapes("benchmarks/fp8_tune.py", __doc__, shape_rows)


if __name__ == "__main__":
    sys.exit(main())
