"""Adaptive speculation policy sweep (issue 7), one H200, one run.

Random weights of real shapes (Qwen3-8B target, 5-layer DFlash drafter with block 16, bf16,
`load_format=dummy`, the folders of benchmarks/fast_path.py), input 512 / output --output-len
tokens, C in --concurrency, no prefix caching, fresh prompts per run, two engines loaded side by
side (36 GiB of KV cache each):
  1. plain decoding: the engine WITHOUT a drafter;
  2. ONE speculative engine (the engine's default block sizes 2, 4, 8, 16, graphs for each,
     start-up cost profile) in the LABELLED synthetic-acceptance mode (each draft position
     accepted with probability a; the text is not the target's, this mode exists for system
     timings only): fixed 4, fixed 8, fixed 16 and adaptive, switched at run time
     (`runner.set_policy`, `runner.set_synthetic_acceptance`).
For each a in --acceptance and each C, after an 8-token warm-up of each engine at that C, the
five configs run in rounds (--repeats rounds, --c1-repeats at C=1, --high-c-repeats from
C=128): each round the fixed blocks (their order rotated), then plain and adaptive back to back,
which of the two goes first alternating by round (plain_ab measured adaptive runs ~1% slower
straight after a fixed block's run than without: an even number of rounds gives plain and
adaptive the same share of whatever a predecessor costs); a fixed block under 0.9x the first
round's best runs that round only (it cannot be the best: identical runs lie at most ~7% apart).
Each run records the GPU's temperature, SM clock and power draw just before it (nvidia-smi;
`gpu_before`).
Per C: adaptive / plain (the plain runs of the same a) and adaptive / best of {plain, fixed 4,
8, 16}; their minima over the sweep (`policy_min_vs_plain`, `policy_min_vs_best`) and
adaptive / fixed 16 at C=1, a=0.86. Each run also records its decode phase (after every
request's first token: `decode_phase_s`, `decode_tok_s`), and the table its adaptive / plain and
fixed 4 / plain: the prefill, the same work for every config, dilutes the end-to-end ratios.
Writes policy_sweep.json, policy_sweep.md and policy_sweep.png to --out-dir after every run.

Usage: python benchmarks/policy_sweep.py --out-dir DIR [--concurrency 1,8,32,64,128,256]
       python benchmarks/policy_sweep.py --out-dir DIR --smoke   (CPU, tiny random models, <1 min)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from blockspec import LLM
from blockspec.bench.common import git_commit, recorded_command
from blockspec.bench.headline import merge_latest
from blockspec.bench.policy_report import CONFIGS, plot, summarize
from blockspec.bench.policy_runs import WARMUP_TOKENS, Setup, lazy_counts
from blockspec.bench.timed_runs import pool_runs, timed_generate
from blockspec.engine.cost_profile import (
    measure_costs,
    profile_buckets,
    profile_context,
)

HIGH_C = 128  # from here on --high-c-repeats rounds: where adaptive / plain sits nearest 1.0
DOMINATED = 0.9


class GCPauses:
    """Total time of the garbage collector's passes (gc.callbacks): host stalls in a step."""

    def __init__(self) -> None:
        self.seconds, self._t0 = 0.0, 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0


GC_PAUSES = GCPauses()


def gpu_state() -> dict[str, float] | None:
    """The GPU's temperature (C), SM clock (MHz) and power draw (W) now, from nvidia-smi
    (None without it): the state a run starts in (a hot chip clocks lower under its power cap)."""
    try:
        line = subprocess.run(
            ["nvidia-smi", "--query-gpu=temperature.gpu,clocks.sm,power.draw",
             "--format=csv,noheader,nounits", "--id=0"],
            capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        temp, clock, power = (float(x) for x in line.split(","))
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    return {"temp_c": temp, "sm_mhz": clock, "power_w": power}


def round_order(k: int, fixed: list[str]) -> list[str]:
    """Round k's run order: the fixed blocks, rotated by k, then plain and adaptive back to
    back, plain first in even rounds. NOTE: the pair compared against 1.0x sits together, each
    of the two first (straight after a fixed block's compute-bound run) equally often over an
    even number of rounds."""
    j = k % len(fixed)
    return fixed[j:] + fixed[:j] + (["plain", "adaptive"] if k % 2 == 0 else ["adaptive", "plain"])


def run_generate(setup: Setup, llm: LLM, c: int, out_len: int, seed: int,
                 draws_seed: int | None = None) -> dict:
    """`draws_seed`: reseed the synthetic-acceptance draws first. NOTE: common random numbers:
    every config at one (a, C) sees the same draws, so two configs that run the same block
    lengths accept the same drafts; otherwise one sequence at C=1 (~40 steps) leaves tau a
    +-1 coin toss (measured: 5.14 vs 6.76 for the same block 16)."""
    engine = llm.engine
    if draws_seed is not None:
        engine.runner.default_generator.manual_seed(draws_seed)
    before = Counter(engine.spec_stats.block_len_steps)
    lazy = engine.runner.lazy
    lazy0 = lazy_counts(lazy)
    gc0 = GC_PAUSES.seconds
    gpu = None if setup.smoke else gpu_state()
    r, outs = timed_generate(llm, setup.prompts(c, seed), out_len)
    if gpu is not None:
        r["gpu_before"] = gpu
    r["gc_ms"] = 1e3 * (GC_PAUSES.seconds - gc0)
    ctl = engine.runner.controller
    if ctl is not None and ctl.overhead is not None and ctl.mode == "adaptive":
        # The policy's live per-step overhead after the run, ms by (batch bucket, block length).
        r["overhead_ms"] = {f"B={b} L={L}": round(1e3 * t, 3)
                            for (b, L), t in sorted(ctl.overhead.seconds.items())}
    if lazy is not None:
        r["lazy"] = {k: v - lazy0[k] for k, v in lazy_counts(lazy).items()}
    steps = Counter(engine.spec_stats.block_len_steps)
    steps.subtract(before)
    if engine.runner.proposer is not None:
        specs = [o.metrics.spec for o in outs]
        r["block_len_steps"] = {str(k): v for k, v in sorted(steps.items()) if v}
        decode_steps = sum(sum(s.block_len_steps.values()) for s in specs)
        # Prefill emits each request's first token; the rest come from decode steps.
        r["tokens_per_decode_step"] = ((r["output_tokens"] - c) / decode_steps
                                       if decode_steps else None)
    else:
        del r["tau"]  # plain engine: no acceptance to report
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--concurrency", default=None, help="default 1,8,32,64,128,256 (smoke 1,4)")
    ap.add_argument("--output-len", type=int, default=None, help="default 256 (smoke 32)")
    ap.add_argument("--acceptance", default="0.86,0.6")
    ap.add_argument("--cost-profile", default=None,
                    help="engine --cost-profile (default: the engine's cache file)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed runs per cell (fresh prompts and draws each; pooled)")
    ap.add_argument("--c1-repeats", type=int, default=None,
                    help="timed runs at C=1 (default --repeats): one sequence's ~40 steps "
                         "leave its synthetic tau a coin toss, more runs pool more draws")
    ap.add_argument("--high-c-repeats", type=int, default=None,
                    help=f"rounds at C >= {HIGH_C} (default --repeats): there adaptive decodes "
                         "plainly or nearly, and its ratio to plain sits in the run-to-run noise")
    ap.add_argument("--lazy-draft-context", action=argparse.BooleanOptionalAction, default=None,
                    help="the speculative engine's lazy drafter context (default: the engine's, "
                         "on with the adaptive policy)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random models, < 1 minute")
    args = ap.parse_args()
    if any(v is not None and v < 1
           for v in (args.repeats, args.c1_repeats, args.high_c_repeats)):
        ap.error("--repeats, --c1-repeats and --high-c-repeats must be >= 1")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cs = [int(c) for c in (args.concurrency or ("1,4" if args.smoke else
                                                "1,8,32,64,128,256")).split(",")]
    out_len = args.output_len or (32 if args.smoke else 256)
    accs = [float(a) for a in args.acceptance.split(",")]
    setup = Setup(args.smoke, Path(tempfile.mkdtemp()),
                  args.cost_profile or ("none" if args.smoke else None), args.lazy_draft_context)
    res: dict = {
        "benchmark": "policy_sweep (issue 7): adaptive speculation vs plain and fixed blocks, "
                     + ("SMOKE (CPU, tiny random models)" if args.smoke else
                        "Qwen3-8B-shape target + 5-layer DFlash drafter, random bf16 weights")
                     + ", synthetic acceptance (labelled)",
        "command": recorded_command("benchmarks/policy_sweep.py"),
        "device": "cpu" if args.smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "input_len": setup.input_len, "output_len": out_len, "concurrency": cs,
        "acceptance": accs, "warmup_tokens": WARMUP_TOKENS, "prefix_caching": False,
        "repeats": args.repeats, "c1_repeats": args.c1_repeats or args.repeats,
        "high_c_repeats": args.high_c_repeats or args.repeats, "dominated_below": DOMINATED,
        "lazy_draft_context": "engine default" if args.lazy_draft_context is None
        else args.lazy_draft_context,
    }

    def reps(c: int) -> int:
        if c == 1:
            return args.c1_repeats or args.repeats
        return (args.high_c_repeats or args.repeats) if c >= HIGH_C else args.repeats
    res["commit"] = git_commit()

    def save() -> None:
        summarize(res)
        (out / "policy_sweep.json").write_text(json.dumps(res, indent=2) + "\n")
        (out / "policy_sweep.md").write_text(res["table_md"] + "\n")
        try:
            plot(res, out / "policy_sweep.png")
        except Exception as e:  # noqa: BLE001 - a plot failure must not lose the numbers
            res.setdefault("errors", {})["plot"] = repr(e)

    seed = iter(range(10_000, 10**9, 7919))  # NOTE: fresh prompts for every run
    start = t0 = time.perf_counter()
    plain = setup.llm(draft=False)
    res["plain_startup_s"] = time.perf_counter() - t0
    # The plain engine's decode step timed like the speculative engine's profile, to compare its
    # plain (L = 1, drafter context staged) step with the engine without a drafter.
    r = plain.engine.runner
    res["plain_step_times"] = measure_costs(r, profile_buckets(r), profile_context(r)) \
        .to_json()["times"]["1"]
    t0 = time.perf_counter()
    sp = setup.llm(draft=True, acceptance=accs[0])
    res["spec_startup_s"] = time.perf_counter() - t0
    res["cost_profile"] = sp.engine.runner.cost_profile_info
    # NOTE: as a serving process does after start-up (vLLM freezes its start-up heap too): the
    # collector then skips the engines' long-lived objects (both engines alike).
    gc.collect()
    gc.freeze()
    res["gc_freeze"] = True
    print(f"engines up in {res['plain_startup_s']:.1f} s (plain) and "
          f"{res['spec_startup_s']:.1f} s (speculative)", flush=True)
    res["plain"], res["spec"] = {}, {}
    runner = sp.engine.runner
    plain_runs: dict[str, list] = {}
    names = ["plain"] + [name for name, _, _ in CONFIGS]
    modes = {name: (mode, fixed_len) for name, mode, fixed_len in CONFIGS}
    fixed_names = [name for name in modes if name != "adaptive"]
    for a in accs:
        runner.set_synthetic_acceptance(a)
        cells = res["spec"].setdefault(f"a={a}", {})
        for c in cs:
            # NOTE: both engines stay loaded and the configs of a cell run in rounds (see
            # round_order), so slow drift of the GPU or the host (clocks, other load) falls on
            # every config alike instead of on whichever ran last.
            run_generate(setup, plain, c, WARMUP_TOKENS, next(seed))
            runner.set_policy("adaptive")
            run_generate(setup, sp, c, WARMUP_TOKENS, next(seed))
            n = reps(c)
            runs: dict[str, list] = {name: [] for name in names}
            dominated: set[str] = set()
            for k in range(n):
                for name in round_order(k, fixed_names):
                    if name in dominated:
                        continue
                    if name == "plain":
                        runs[name].append(run_generate(setup, plain, c, out_len, next(seed)))
                        continue
                    runner.set_policy(*modes[name])
                    # NOTE: repeat k uses the same draws for every config (common random
                    # numbers).
                    runs[name].append(run_generate(setup, sp, c, out_len, next(seed),
                                                   1_000_003 * c + round(1000 * a) + 7 * k))
                if k == 0:
                    # NOTE: a fixed block under DOMINATED x the first round's best cannot be the
                    # best (identical runs lie at most ~7% apart): one run of it is enough, and
                    # the time goes to the rounds of the configs the ratios compare.
                    top = max(rs[0]["output_tok_s"] for rs in runs.values())
                    dominated = {name for name in modes if name != "adaptive"
                                 and runs[name][0]["output_tok_s"] < DOMINATED * top}
            cells[f"C={c}"] = {name: pool_runs(rs) for name, rs in runs.items()}
            plain_runs.setdefault(f"C={c}", []).extend(runs["plain"])
            res["plain"][f"C={c}"] = pool_runs(plain_runs[f"C={c}"])
            for name in names:
                r = cells[f"C={c}"][name]
                print(f"a={a} C={c} {name}: {r['output_tok_s']:.1f} tok/s, tau {r.get('tau')}, "
                      f"steps by L {r.get('block_len_steps')}", flush=True)
            save()
    res["total_s"] = time.perf_counter() - start
    save()
    if not args.smoke:
        write_latest(res, out / "latest.json")
    print(res["table_md"])
    gc.unfreeze()  # NOTE: so the interpreter's exit frees the engines (bindings check leaks)
    return 0


def write_latest(res: dict, path: Path) -> None:
    figures = {}
    if "policy_min_vs_plain" in res:
        figures = dict(adaptive_min_ratio_vs_ar=round(res["policy_min_vs_plain"], 3),
                       adaptive_min_ratio_vs_best=round(res["policy_min_vs_best"], 3))
    merge_latest(res, figures, path)


if __name__ == "__main__":
    sys.exit(main())
