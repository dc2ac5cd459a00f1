"""Kimi K2.6's int4 decode experts (moe_decode.decode_experts, default unpacking and tiles) a
layer at 1..16 tokens, for an A/B of two source trees in separate processes: run it with
PYTHONPATH set to each tree in turn (alternating, to see drift), on one GPU. Writes one JSON
row a run (appended to --out).

Usage: PYTHONPATH=TREE python benchmarks/experts_ab.py --out FILE.json --label NAME
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import blockspec.layers.moe_decode as md
from blockspec.bench.gpu_timing import graph_ms
from blockspec.bench.kernel_tune import EXPERT_SHAPES, _experts, _routing


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", default="1,2,4,8,16")
    args = ap.parse_args()
    dev = torch.device("cuda")
    shape = EXPERT_SHAPES["kimi_int4"]
    e, h, _, k, _ = shape
    weights = _experts(shape, args.layers, dev)
    row = {"label": args.label, "source": md.__file__, "device": torch.cuda.get_device_name(),
           "ms_a_layer": {}, "rel_diff_vs_fp32": {}}
    for t in map(int, args.tokens.split(",")):
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        calls = [(x, wt, ids, g, d) for (ids, wt), (g, d) in
                 zip(_routing(t, e, k, args.layers, dev), weights)]
        out = md.decode_experts(*calls[0])
        ref = md.decode_experts(x.float(), calls[0][1].float(), *calls[0][2:], dequant="mask")
        row["rel_diff_vs_fp32"][t] = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        row["ms_a_layer"][t] = graph_ms(lambda calls=calls: [md.decode_experts(*c)
                                                             for c in calls]) / len(calls)
        print(args.label, t, f"{row['ms_a_layer'][t]:.4f} ms", flush=True)
    path = Path(args.out)
    rows = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps(rows + [row], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
