"""EXPERIMENT (issue 23): Kimi K2.6's int4 decode experts a layer at one token, the register
loop (moe_decode.decode_experts, "subnormal") against TMA-pipelined kernels (layers/int4_tma.py)
over stages / tiles / inputs by TMA or pointers; outputs checked equal. One GPU, one run.

Usage: python benchmarks/int4_tma_ab.py --out FILE.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

from blockspec.bench.common import git_commit, recorded_command
from blockspec.bench.gpu_timing import graph_ms
from blockspec.bench.kernel_tune import EXPERT_SHAPES, _experts, _routing
from blockspec.layers.int4_tma import decode_experts_tma
from blockspec.layers.moe_decode import decode_experts

GATE_UP = [(16, 1024, 2), (16, 512, 2), (8, 1024, 2), (16, 1024, 4), (32, 512, 4),
           (32, 1024, 4), (64, 512, 4), (64, 256, 4), (32, 256, 2), (16, 2048, 4)]
DOWN = [(8, 1024, 4), (8, 1024, 2), (16, 1024, 4), (16, 512, 4), (32, 512, 4), (8, 2048, 4),
        (32, 256, 4), (64, 256, 4)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    dev, out = torch.device("cuda"), Path(args.out)
    res: dict = {"command": recorded_command("benchmarks/int4_tma_ab.py"),
                 "commit": git_commit(), "device": torch.cuda.get_device_name(),
                 "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                 "rows": []}
    shape = EXPERT_SHAPES["kimi_int4"]
    e, h, _, k, _ = shape
    weights = _experts(shape, args.layers, dev)
    routes = _routing(1, e, k, args.layers, dev)
    x = torch.randn(1, h, device=dev, dtype=torch.bfloat16)
    calls = [(x, wt, ids, g, d) for (ids, wt), (g, d) in zip(routes, weights)]
    refs = [decode_experts(*c) for c in calls]

    def row(name: str, fn, **kw) -> float:
        t0 = time.time()
        try:
            outs = [fn(*c, **kw) for c in calls]
            equal = all(torch.equal(o, r) for o, r in zip(outs, refs))
            diff = max(((o.float() - r.float()).abs().max() / r.float().abs().max()).item()
                       for o, r in zip(outs, refs))
            ms = graph_ms(lambda: [fn(*c, **kw) for c in calls]) / len(calls)
        except Exception as exc:  # a config that does not compile or launch
            res["rows"].append({"name": name, "error": repr(exc)[:300]})
            print(name, "ERROR", repr(exc)[:300], flush=True)
            return float("inf")
        res["rows"].append({"name": name, "ms": ms, "equal": equal, "rel_diff": diff,
                            "compile_s": round(time.time() - t0, 1)})
        print(f"{name}: {ms:.4f} ms equal={equal} rel_diff={diff:.2e}", flush=True)
        out.write_text(json.dumps(res, indent=2) + "\n")
        return ms

    base = row("register_loop", decode_experts)
    row("register_loop_again", decode_experts)
    best = (float("inf"), None)
    for st in (2, 3, 4, 5):
        for xt in (True,) if st > 2 else (True, False):
            ms = row(f"tma st{st} x_tma={xt}", partial(decode_experts_tma, stages=st, x_tma=xt))
            best = min(best, (ms, (st, xt)), key=lambda b: b[0])
    st, xt = best[1]
    bg = (float("inf"), GATE_UP[0])
    for g in GATE_UP:
        tiles = {"gate_up": g, "down": DOWN[0]}
        ms = row(f"tma st{st} x_tma={xt} gate_up={g}", partial(decode_experts_tma, stages=st,
                                                               x_tma=xt, tiles=tiles))
        bg = min(bg, (ms, g), key=lambda b: b[0])
    for d in DOWN[1:]:
        tiles = {"gate_up": bg[1], "down": d}
        row(f"tma st{st} x_tma={xt} gate_up={bg[1]} down={d}",
            partial(decode_experts_tma, stages=st, x_tma=xt, tiles=tiles))
    row("register_loop_end", decode_experts)
    res["base_ms"] = base
    out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
