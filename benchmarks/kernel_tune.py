"""Tile sweeps of MoE targets' batch-1 kernels on one GPU (blockspec/bench/kernel_tune.py): the
decode-step experts against the grouped GEMMs (Moonlight bf16, Kimi K2.6 INT4) and the dense
GEMV per projection (Moonlight, Kimi K2.6).

Usage: python benchmarks/kernel_tune.py --out FILE.json [--skip experts,gemv] [--experts kimi_int4]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from blockspec.bench.common import git_commit, recorded_command
from blockspec.bench.kernel_tune import EXPERT_SHAPES, GEMV_SHAPES, sweep_decode_experts, sweep_gemv


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip", default="", help="experts,gemv")
    ap.add_argument("--experts", default=",".join(EXPERT_SHAPES),
                    help="expert shapes to sweep: " + ",".join(EXPERT_SHAPES))
    ap.add_argument("--layers", default="moonlight_bf16=4,kimi_int4=2",
                    help="layers of expert weights per timing, per shape")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    layers = dict(kv.split("=") for kv in args.layers.split(","))
    dev = torch.device("cuda")
    res: dict = {"command": recorded_command("benchmarks/kernel_tune.py"),
                 "commit": git_commit(), "device": torch.cuda.get_device_name(),
                 "torch": torch.__version__, "date": datetime.date.today().isoformat()}
    out = Path(args.out)
    if "experts" not in skip:
        for name in args.experts.split(","):
            res[f"experts_{name}"] = sweep_decode_experts(name, int(layers.get(name, 2)), dev)
            out.write_text(json.dumps(res, indent=2) + "\n")
            torch.cuda.empty_cache()
    if "gemv" not in skip:
        for name in GEMV_SHAPES:
            res[f"gemv_{name}"] = sweep_gemv(name, dev)
            out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
