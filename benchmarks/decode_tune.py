"""Wider tiles for the decode-step experts and launch configs for MLA decode attention, one GPU,
one run (issues 21 and 23): blockspec/bench/kernel_tune.py's `sweep_wide` (Kimi K2.6's int4
experts unpacked "mask" and "subnormal"; Moonlight's bf16 ones), its `sweep_tokens` (int4's
unpackings against the grouped GEMMs at 1..16 tokens), its `sweep_split` (the down kernel one
program per pick, both) and blockspec/bench/mla_tune.py's `sweep_mla` (16 heads at
contexts 640 and 4096, 64 heads at 640).

Usage: python benchmarks/decode_tune.py --out FILE.json [--skip mla,kimi,moonlight,tokens,split]
    [--int4-dequants subnormal,mask]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from blockspec.bench.common import git_commit, recorded_command
from blockspec.bench.kernel_tune import sweep_split, sweep_tokens, sweep_wide
from blockspec.bench.mla_tune import sweep_mla


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip", default="", help="mla,kimi,moonlight,tokens,split")
    ap.add_argument("--int4-dequants", default="mask,subnormal",
                    help="int4 unpackings the kimi and tokens sections sweep")
    args = ap.parse_args()
    dequants = tuple(filter(None, args.int4_dequants.split(",")))
    skip = set(filter(None, args.skip.split(",")))
    dev, out = torch.device("cuda"), Path(args.out)
    res: dict = {"command": recorded_command("benchmarks/decode_tune.py"),
                 "commit": git_commit(), "device": torch.cuda.get_device_name(),
                 "torch": torch.__version__, "date": datetime.date.today().isoformat()}

    def save() -> None:
        out.write_text(json.dumps(res, indent=2) + "\n")

    if "mla" not in skip:
        res["mla_16_heads"] = sweep_mla(16, (640, 4096), dev)
        save()
        res["mla_64_heads"] = sweep_mla(64, (640,), dev)
        save()
    if "kimi" not in skip:
        res["experts_kimi_int4"] = sweep_wide("kimi_int4", 2, dev, dequants)
        save()
        torch.cuda.empty_cache()
    if "moonlight" not in skip:
        res["experts_moonlight_bf16"] = sweep_wide("moonlight_bf16", 4, dev, ("magic",))
        save()
    if "tokens" not in skip:
        res["tokens_kimi_int4"] = sweep_tokens("kimi_int4", 2, dev, dequants)
        save()
        torch.cuda.empty_cache()
    if "split" not in skip:
        for name, layers in (("kimi_int4", 2), ("moonlight_bf16", 4)):
            res[f"split_down_{name}"] = sweep_split(name, layers, dev)
            save()
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
