"""A decode step's chain of batch-1 GEMVs (linear.gemv) in one CUDA graph, as the model runs
them (PDL between kernels on sm_90), for several L2 prefetch distances before the PDL wait
(`prefetch`, linear.GEMV_PREFETCH): Moonlight's or Kimi K2.6's projections a layer (kernel_tune
GEMV_SHAPES, lm_head left out), each layer its own weights. Rounds alternate the distances to
show drift. Prints and writes ms a chain and GB/s; checks that each distance's outputs equal
the first's bit for bit (a prefetch changes no value).

Usage: python benchmarks/gemv_chain.py --out FILE.json [--shapes kimi] [--layers 6]
       [--prefetch 0,2,4,8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from blockspec.bench.gpu_timing import graph_ms
from blockspec.bench.kernel_tune import GEMV_SHAPES
from blockspec.layers.linear import gemv


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="kimi", choices=sorted(GEMV_SHAPES))
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--prefetch", default="0,2,4,8")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    dev = torch.device("cuda")
    shapes = [(n, k) for n, k in GEMV_SHAPES[args.shapes] if n < 100_000]  # no lm_head
    chain = [(torch.randn(1, k, device=dev, dtype=torch.bfloat16),
              torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02)
             for _ in range(args.layers) for n, k in shapes]
    nbytes = sum(w.numel() * w.element_size() for _, w in chain)
    distances = list(map(int, args.prefetch.split(",")))
    ref = [gemv(x, w, prefetch=distances[0]) for x, w in chain]
    rows = []
    for rnd in range(args.rounds):
        for pf in distances:
            equal = all(torch.equal(gemv(x, w, prefetch=pf), r) for (x, w), r in zip(chain, ref))
            ms = graph_ms(lambda pf=pf: [gemv(x, w, prefetch=pf) for x, w in chain])
            rows.append({"round": rnd, "prefetch": pf, "ms": ms, "GBps": nbytes / ms / 1e6,
                         "bit_equal": equal})
            print(f"round {rnd} prefetch {pf}: {ms:.4f} ms, {nbytes / ms / 1e6:.0f} GB/s, "
                  f"equal {equal}", flush=True)
    result = {"benchmark": "gemv_chain", "device": torch.cuda.get_device_name(),
              "shapes": args.shapes, "gemvs": len(chain), "bytes": nbytes,
              "command": " ".join(sys.argv), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
