"""EXPERIMENT (issue 23): Kimi K2.6's int4 decode experts a layer at one token, the register
loop (moe_decode.decode_experts, "subnormal") against int8-tensor-core kernels with the
activations as int8 digits (layers/int4_mma.py), over tiles / warps / stages; the gate_up
launches alone too. Outputs checked against the register loop. One GPU, one run.

Usage: python benchmarks/int4_mma_ab.py --out FILE.json
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

import blockspec.layers.moe_decode as md
from blockspec.bench.common import git_commit, recorded_command
from blockspec.bench.gpu_timing import graph_ms
from blockspec.bench.kernel_tune import EXPERT_SHAPES, _experts, _routing
from blockspec.layers.int4_mma import decode_experts_mma

CONFIGS = [((bg, bd), (wg, wd), (st, st)) for bg, bd in ((128, 64), (64, 64), (128, 128),
                                                         (64, 32))
           for wg, wd in ((4, 4), (8, 4)) for st in (2, 1, 3)]


def _register_gate_up(*args):
    """decode_experts up to its gate_up launch (its _down a no-op)."""
    down = md._down
    md._down = lambda *a, **k: None
    try:
        return md.decode_experts(*args)
    finally:
        md._down = down


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    dev, out = torch.device("cuda"), Path(args.out)
    res: dict = {"command": recorded_command("benchmarks/int4_mma_ab.py"),
                 "commit": git_commit(), "device": torch.cuda.get_device_name(),
                 "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                 "rows": []}
    shape = EXPERT_SHAPES["kimi_int4"]
    e, h, _, k, _ = shape
    weights = _experts(shape, args.layers, dev)
    routes = _routing(1, e, k, args.layers, dev)
    x = torch.randn(1, h, device=dev, dtype=torch.bfloat16)
    calls = [(x, wt, ids, g, d) for (ids, wt), (g, d) in zip(routes, weights)]
    refs = [md.decode_experts(*c) for c in calls]

    def row(name: str, fn, check: bool = True) -> float:
        t0 = time.time()
        try:
            outs = [fn(*c) for c in calls]
            diff = None
            if check:
                diff = max(((o.float() - r.float()).abs().max() / r.float().abs().max()).item()
                           for o, r in zip(outs, refs))
            ms = graph_ms(lambda: [fn(*c) for c in calls]) / len(calls)
        except Exception as exc:  # a config that does not compile or launch
            res["rows"].append({"name": name, "error": repr(exc)[:300]})
            print(name, "ERROR", repr(exc)[:300], flush=True)
            return float("inf")
        res["rows"].append({"name": name, "ms": ms, "rel_diff": diff,
                            "compile_s": round(time.time() - t0, 1)})
        print(f"{name}: {ms:.4f} ms rel_diff={diff}", flush=True)
        out.write_text(json.dumps(res, indent=2) + "\n")
        return ms

    row("register_loop", md.decode_experts)
    row("register_loop gate_up only", _register_gate_up, check=False)
    for bn, nw, ns in CONFIGS:
        row(f"mma block_n={bn} warps={nw} stages={ns}",
            partial(decode_experts_mma, block_n=bn, num_warps=nw, num_stages=ns))
        row(f"mma gate_up only block_n={bn[0]} warps={nw[0]} stages={ns[0]}",
            partial(decode_experts_mma, block_n=bn, num_warps=nw, num_stages=ns,
                    gate_up_only=True), check=False)
    row("register_loop_end", md.decode_experts)
    out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
