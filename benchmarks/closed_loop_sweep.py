"""Closed-loop sweep (issue 20's judged run): `blockspec bench offline` per config, each in its
own process as a user runs it, then DFlash over AR per concurrency.

- demo pair, benchmarks/prompts/code.jsonl, C = 1, 4, 16, 64: default engine vs `--draft none`;
- Qwen3-8B-shaped target and 5-layer drafter, random bf16 weights (`--load-format dummy`),
  random prompts of 512 tokens: AR vs the default (adaptive) engine with the LABELLED synthetic
  acceptance a = 0.86 and a = 0.6 (a benchmark-only mode: each draft position accepted with
  probability a; the text is not the target's).
Every run: output 256 (`--ignore-eos`), no prefix caching, a new request entering as soon as one
finishes.

    python benchmarks/closed_loop_sweep.py --out-dir DIR [--big-concurrency 1,8,32,64,128,256]
        [--engine-args "--decode-step-prefill-tokens auto"] [--skip-demo] [--acceptance 0.86]

`--engine-args` go to every run (AR and DFlash alike): a what-if beside the defaults (one flag
alone is written `--engine-args=--step-trace`, or argparse takes it for an option).
`--spec-variants "NAME=FLAGS;NAME=FLAGS"`: more DFlash runs of the 8B shape per acceptance, each
with its own extra flags, against the same AR run (files `qwen3_8b_adaptive_a{a}_{NAME}`).
Async scheduling is the default on one CUDA GPU; `--async-ab` and `--async-spec` run their
baseline rows with `--no-async-scheduling`, so "sync" means without it on any device.
`--async-ab`: instead of DFlash, AR with `--async-scheduling` against AR sync (both plain).
`--async-spec`: the runs sync, then AR and DFlash again with `--async-scheduling`: DFlash-async
against AR and AR-async, AR-async against AR. `--async-only`: every run (AR and
DFlash) with `--async-scheduling` and nothing else (files named `*_async_only`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from blockspec.bench.common import git_commit, recorded_command
from blockspec.bench.fullsize import INPUT_LEN, OUTPUT_LEN, write_folders

COMMON = ["--output-len", str(OUTPUT_LEN), "--ignore-eos", "--no-prefix-caching"]


def bench(out: Path, name: str, args: list[str]) -> dict:
    """One `blockspec bench offline` run; returns its result JSON."""
    path = out / f"{name}.json"
    cmd = [sys.executable, "-m", "blockspec.cli", "bench", "offline", *args, *COMMON,
           "--label", name, "--out", str(path)]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(path.read_text())


def by_c(res: dict) -> dict[int, dict]:
    return {lv["concurrency"]: lv for lv in res["levels"]}


def compare(ar: dict, spec: dict, other: str = "dflash") -> dict:
    """Per concurrency: tok/s of both, their ratio, and the latency tails; `other` names the
    run set against AR."""
    a, s = by_c(ar), by_c(spec)
    rows = {}
    for c in sorted(a):
        rows[c] = {"ar_tok_s": a[c]["output_tok_s"], f"{other}_tok_s": s[c]["output_tok_s"],
                   "ratio": s[c]["output_tok_s"] / a[c]["output_tok_s"],
                   "tau": (s[c].get("acceptance") or {}).get("mean_acceptance_length"),
                   "itl_p99_ms": {"ar": a[c]["itl_ms"]["p99"], other: s[c]["itl_ms"]["p99"]},
                   "ttft_p99_ms": {"ar": a[c]["ttft_ms"]["p99"], other: s[c]["ttft_ms"]["p99"]}}
    return {"by_concurrency": rows, "min_ratio": min(r["ratio"] for r in rows.values()),
            "other": other}


def async_rows(out: Path, key: str, ar: dict, ar_args: list[str], spec_args: list[str]
               ) -> dict:
    """`--async-spec`: DFlash with `--async-scheduling` against AR and against AR with
    `--async-scheduling` (run once per set: its file is reused), and that AR against AR."""
    flag = ["--async-scheduling"]
    name = key.split("_a")[0] if key.startswith("qwen3") else key
    ar_async_path = out / f"{name}_ar_async.json"
    ar_async = json.loads(ar_async_path.read_text()) if ar_async_path.exists() \
        else bench(out, f"{name}_ar_async", [*ar_args, *flag])
    spec_async = bench(out, f"{key}_async", [*spec_args, *flag])
    return {f"{key}_async_vs_ar": compare(ar, spec_async, "dflash_async"),
            f"{key}_async_vs_ar_async": compare(ar_async, spec_async, "dflash_async"),
            f"{name}_ar_async_vs_ar": compare(ar, ar_async, "ar_async")}


def variants(text: str) -> list[tuple[str, list[str]]]:
    """`--spec-variants`: (name, flags) per ';'-separated NAME=FLAGS."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(";"))):
        name, sep, flags = item.partition("=")
        if not sep or not name.strip().isidentifier():
            raise SystemExit(f"--spec-variants: {item!r} is not NAME=FLAGS")
        out.append((name.strip(), shlex.split(flags)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--demo-concurrency", default="1,4,16,64")
    ap.add_argument("--big-concurrency", default="1,8,32,64,128,256")
    ap.add_argument("--skip-big", action="store_true", help="the demo pair only")
    ap.add_argument("--skip-demo", action="store_true", help="the Qwen3-8B shape only")
    ap.add_argument("--acceptance", default="0.86,0.6", help="synthetic acceptances (8B shape)")
    ap.add_argument("--engine-args", default="", help="extra engine flags for every run")
    ap.add_argument("--spec-variants", default="",
                    help="'NAME=FLAGS;...': more DFlash runs (8B shape) with extra flags")
    ap.add_argument("--async-ab", action="store_true",
                    help="AR with --async-scheduling against AR, in place of DFlash")
    ap.add_argument("--async-spec", action="store_true",
                    help="AR and DFlash also with --async-scheduling")
    ap.add_argument("--async-only", action="store_true",
                    help="AR and DFlash with --async-scheduling only")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(args.engine_args) + (["--async-scheduling"] if args.async_only else [])
    if args.async_ab or args.async_spec:
        extra.append("--no-async-scheduling")  # NOTE: the baseline rows; async_rows adds the flag
    sfx = "_async_only" if args.async_only else ""
    demo = ["--dataset", "benchmarks/prompts/code.jsonl", "--concurrency", args.demo_concurrency,
            *extra]
    res: dict = {"benchmark": "closed_loop_sweep", "command": recorded_command(
        "benchmarks/closed_loop_sweep.py"), "commit": git_commit()}
    res["engine_args"] = args.engine_args
    if not args.skip_demo:
        ar = bench(out, f"demo_ar{sfx}", [*demo, "--draft", "none"])
        res["demo"] = compare(ar, bench(out, "demo_ar_async", [*demo, "--draft", "none",
                                                               "--async-scheduling"]), "async") \
            if args.async_ab else compare(ar, bench(out, f"demo_default{sfx}", demo))
        if args.async_spec:
            res.update(async_rows(out, "demo", ar, [*demo, "--draft", "none"], demo))
    if not args.skip_big:
        with tempfile.TemporaryDirectory() as d:
            target, drafter = write_folders(Path(d))
            big = ["--model", str(target), "--load-format", "dummy", "--dataset", "random",
                   "--input-len", str(INPUT_LEN), "--concurrency", args.big_concurrency, *extra]
            ar = bench(out, f"qwen3_8b_ar{sfx}", big)
            if args.async_ab:
                res["qwen3_8b_async"] = compare(ar, bench(out, "qwen3_8b_ar_async",
                                                          [*big, "--async-scheduling"]), "async")
            acceptances = [] if args.async_ab else [float(x) for x in args.acceptance.split(",")]
            for a in acceptances:
                spec = bench(out, f"qwen3_8b_adaptive_a{a}{sfx}",
                             [*big, "--draft", str(drafter), "--synthetic-acceptance", str(a)])
                res[f"qwen3_8b_a{a}"] = compare(ar, spec)
                for name, flags in variants(args.spec_variants):
                    res[f"qwen3_8b_a{a}_{name}"] = compare(ar, bench(
                        out, f"qwen3_8b_adaptive_a{a}_{name}",
                        [*big, "--draft", str(drafter), "--synthetic-acceptance", str(a), *flags]))
                if args.async_spec:
                    res.update(async_rows(out, f"qwen3_8b_a{a}", ar, big, [
                        *big, "--draft", str(drafter), "--synthetic-acceptance", str(a)]))
    first = ("qwen3_8b_ar" if args.skip_demo else "demo_ar") + sfx
    res["environment"] = json.loads((out / f"{first}.json").read_text())["environment"]
    (out / "closed_loop_sweep.json").write_text(json.dumps(res, indent=1) + "\n")
    for key in [k for k in res if k.startswith(("demo", "qwen3"))]:
        print(f"{key}: min {res[key]['other']}/AR {res[key]['min_ratio']:.2f}x")
        for c, r in res[key]["by_concurrency"].items():
            print(f"  C={c:<4d} AR {r['ar_tok_s']:9.0f}  {res[key]['other']} "
                  f"{r[res[key]['other'] + '_tok_s']:9.0f} tok/s  "
                  f"{r['ratio']:.2f}x  tau {r['tau']}  ITL p99 {r['itl_p99_ms']}  "
                  f"TTFT p99 {r['ttft_p99_ms']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
