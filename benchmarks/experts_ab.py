"""Kimi K2.6's int4 decode experts (moe_decode.decode_experts, default unpacking and tiles; or
Moonlight's bf16 ones, --shape moonlight_bf16) a layer at 1..16 tokens, for an A/B of two
source trees in separate processes: run it with PYTHONPATH set to each tree in turn
(alternating, to see drift), on one GPU; or of L2 prefetch distances within one tree
(--prefetch, rounds alternating). Writes one JSON row a run and configuration (appended to
--out).

Usage: PYTHONPATH=TREE python benchmarks/experts_ab.py --out FILE.json --label NAME
       [--shape moonlight_bf16] [--prefetch GATE_UP:DOWN,... --rounds N]
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
    ap.add_argument("--shape", default="kimi_int4", choices=sorted(EXPERT_SHAPES))
    ap.add_argument("--layers", type=int, default=None,
                    help="layers of weights cycled (default: 2 for kimi_int4, 8 otherwise)")
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--prefetch", default=None,
                    help="gate_up:down chunk distances to compare (GemvTiles.prefetch), e.g. "
                         "0:0,1:1,2:2; default: the tree's default tiles only")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    dev = torch.device("cuda")
    shape = EXPERT_SHAPES[args.shape]
    e, h, _, k, quant = shape
    args.layers = args.layers or (2 if quant else 8)
    args.fmt = md.INT4 if quant else md.DENSE
    weights = _experts(shape, args.layers, dev)
    tokens = list(map(int, args.tokens.split(",")))
    inputs = {t: torch.randn(t, h, device=dev, dtype=torch.bfloat16) for t in tokens}
    routing = {t: _routing(t, e, k, args.layers, dev) for t in tokens}
    configs = [None] if args.prefetch is None else [
        tuple(map(int, c.split(":"))) for c in args.prefetch.split(",")]
    rows = []
    for rnd in range(args.rounds):
        for cfg in configs:
            rows.append(_run(args, cfg, rnd, tokens, inputs, routing, weights))
    path = Path(args.out)
    old = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps(old + rows, indent=2) + "\n")
    return 0


def _tiles(cfg: tuple[int, int] | None, fmt: int) -> dict | None:
    if cfg is None:
        return None
    base = md.DEFAULT_TILES[fmt]
    return {"gate_up": base["gate_up"]._replace(prefetch=cfg[0]),
            "down": base["down"]._replace(prefetch=cfg[1])}


def _run(args, cfg, rnd, tokens, inputs, routing, weights) -> dict:
    tiles = _tiles(cfg, args.fmt)
    label = args.label if cfg is None else f"{args.label} prefetch {cfg[0]}:{cfg[1]}"
    row = {"label": label, "round": rnd, "shape": args.shape, "layers": args.layers,
           "source": md.__file__, "tiles": tiles,
           "device": torch.cuda.get_device_name(), "ms_a_layer": {}, "rel_diff_vs_fp32": {},
           "bit_equal_to_default": {}}
    for t in tokens:
        x = inputs[t]
        calls = [(x, wt, ids, g, d) for (ids, wt), (g, d) in zip(routing[t], weights)]
        out = md.decode_experts(*calls[0], tiles=tiles)
        ref = md.decode_experts(x.float(), calls[0][1].float(), *calls[0][2:], dequant="mask")
        row["rel_diff_vs_fp32"][t] = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        row["bit_equal_to_default"][t] = bool(torch.equal(out, md.decode_experts(*calls[0])))
        row["ms_a_layer"][t] = graph_ms(lambda calls=calls: [md.decode_experts(*c, tiles=tiles)
                                                             for c in calls]) / len(calls)
        print(label, t, f"{row['ms_a_layer'][t]:.4f} ms", flush=True)
    return row


if __name__ == "__main__":
    sys.exit(main())
