"""Block-scaled FP8 weights: W8A16 (our Triton kernel, layers/quant_gemm.py) against W8A8 (the
activations quantized to e4m3 too, fp8 tensor cores), one GPU, one run (issue 23: "W8A8 with
per-token activation scales, or W8A16; measure which").

For DeepSeek-V3's dense shapes (random e4m3 weights with 128 x 128 block scales, bf16
activations) at M = 1..8192 rows, each timed as one CUDA graph (gpu_timing.graph_ms):
  - bf16: cuBLAS over the dequantized weight (F.linear), the reference;
  - W8A16: quant_linear (the kernel dequantizes each weight tile to bf16 and multiplies in bf16);
  - W8A8 GEMM: torch._scaled_mm (cuBLASLt's fp8 GEMM) with per-row activation scales and
    per-output-row weight scales, over e4m3 activations, the GEMM alone; then with the
    activations' quantization (amax per row, scale, cast: torch ops) in front. Its weight
    scales are per row, not DeepSeek's 128 x 128 blocks (the blocks would multiply inside the
    K loop, as DeepGEMM does; cuBLASLt's row-wise scaling is the fast path torch exposes here),
    so the W8A8 rows are the speed such a kernel could reach, not a numerically equal
    replacement; each row's relative error against bf16 is recorded.

Usage: python benchmarks/fp8_a8_ab.py --out FILE.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

# NOTE: this script's folder is on sys.path when run as a script: quant_gpu_checks' weights
from quant_gpu_checks import random_weight, rel_err

from blockspec.bench.common import git_commit, recorded_command
from blockspec.bench.gpu_timing import graph_ms
from blockspec.layers.quant_dequant import dequantize
from blockspec.layers.quant_gemm import quant_linear

# (name, N, K): DeepSeek-V3's dense MLP gate_up / down, MLA's q_b_proj and o_proj
SHAPES = (("gate_up", 2 * 18432, 7168), ("down", 7168, 18432), ("q_b", 128 * 192, 1536),
          ("o_proj", 7168, 128 * 128))
ROWS = (1, 16, 128, 512, 2048, 8192)
E4M3_MAX = 448.0


def row_scaled(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dequantized weight [N, K] as e4m3 with one fp32 scale per row ([1, N])."""
    s = dense.float().abs().amax(1).clamp_min(1e-12) / E4M3_MAX
    return (dense.float() / s[:, None]).to(torch.float8_e4m3fn), s[None, :].contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16 -> (e4m3 [M, K], fp32 scales [M, 1]): per-token scales."""
    s = x.float().abs().amax(1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    return (x.float() / s).to(torch.float8_e4m3fn), s


def shape_rows(n: int, k: int, g: torch.Generator) -> list[dict]:
    w = random_weight("fp8", (n,), k, g)
    dense = dequantize(w).to(torch.bfloat16)
    w8, ws = row_scaled(dense)
    w8t = w8.t()  # column-major [K, N]: what _scaled_mm takes as its second operand
    rows = []
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        # NOTE: _scaled_mm wants M a multiple of 16 on some builds: pad the one-row case
        mp = max(m, 16)
        xp = torch.zeros(mp, k, device="cuda", dtype=torch.bfloat16)
        xp[:m] = x
        x8, xs = quantize_rows(xp)
        ref = F.linear(x, dense)

        def a8(x8=x8, xs=xs):
            return torch._scaled_mm(x8, w8t, scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)

        def a8_quant(xp=xp):
            q, s = quantize_rows(xp)
            return torch._scaled_mm(q, w8t, scale_a=s, scale_b=ws, out_dtype=torch.bfloat16)

        row = {"m": m, "bf16_ms": graph_ms(lambda x=x: F.linear(x, dense)),
               "w8a16_ms": graph_ms(lambda x=x: quant_linear(x, w)),
               "w8a16_rel_err": rel_err(quant_linear(x, w), ref)}
        try:
            row.update(w8a8_gemm_ms=graph_ms(a8), w8a8_with_quant_ms=graph_ms(a8_quant),
                       w8a8_rel_err=rel_err(a8()[:m], ref))
        except RuntimeError as exc:  # an unsupported _scaled_mm configuration: recorded
            row["w8a8_error"] = repr(exc)
        flops = 2 * m * n * k
        for key in ("bf16_ms", "w8a16_ms", "w8a8_gemm_ms", "w8a8_with_quant_ms"):
            if key in row:
                row[key.replace("_ms", "_tflops")] = flops / row[key] / 1e9
        print(f"{n}x{k} M={m}: bf16 {row['bf16_ms']:.4f} ms, W8A16 {row['w8a16_ms']:.4f}, "
              f"W8A8 {row.get('w8a8_gemm_ms', float('nan')):.4f} "
              f"(+quant {row.get('w8a8_with_quant_ms', float('nan')):.4f})", flush=True)
        rows.append(row)
    return rows


def run_shapes(script: str, doc: str, rows_of: Callable[[int, int, torch.Generator], list]
               ) -> int:
    """`script`'s main (benchmarks/fp8_tune.py's too): `rows_of(n, k, generator)` for each of
    SHAPES, the JSON rewritten to --out after each shape with the run's provenance."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    res: dict = {"command": recorded_command(script), "commit": git_commit(),
                 "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "date": datetime.date.today().isoformat(), "shapes": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in SHAPES:
        res["shapes"][name] = {"n": n, "k": k, "rows": rows_of(n, k, g)}
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


def main() -> int:
    return run_shapes("benchmarks/fp8_a8_ab.py", __doc__, shape_rows)


if __name__ == "__main__":
    sys.exit(main())
