"""Replay the speculation policy on a modelled H200 (CPU, seconds). A SIMULATION, not a measurement.

What it is for: checking a change to the policy (policy/policy.py, policy/drain.py,
policy/overhead.py, engine/speculation.py) against the decisions a policy_sweep run faced, before
spending device time on it. What it models, from a policy_sweep JSON (`--from`):
  * step time = the run's start-up cost profile (graph replays, by block length and batch bucket)
    + an overhead term per (bucket, block length): the median of the terms the run's policy had
    learned (wall time beyond the profile, host and longer contexts included) over its adaptive
    runs, times a random factor N(1, --noise) per step;
  * a closed batch of C requests, each decoding --output-len - 1 tokens (the prefill, the same
    work for every config, is left out), synthetic acceptance a per draft position, like the
    benchmark mode.
Plain decoding, fixed blocks 4/8/16 and the engine's own SpecController (cost model, live overhead
learned from the simulated wall times, acceptance tracker, drain) run in rounds per cell, all
five rotated each round (the sweep's order up to run 16), one controller per acceptance kept
across cells. Not modelled: the prefill and the
drafter context writes, the lazy context (no detach, no catch-up), the host's jitter beyond the
noise factor. Reports decode-phase tok/s (simulated) and, for comparison, the run's measured
end-to-end ratios (their prefill dilutes every ratio toward 1). Use it to see what the policy
does with a cost picture (its block lengths, its learning and sampling, the drain), not to
predict the issue's ratios: a few % of modelling error decide the cells where plain decoding
and block 4 are close (e.g. the learned terms of a run that scaled them by the sequences a step
ran, run 12, price tails high).

Usage: python benchmarks/policy_replay.py --from RUN/policy_sweep.json [--noise 0.03]
       [--rounds 3] [--out FILE.json]     (RUN: a benchmarks/results/policy_sweep_* folder)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from blockspec.bench.common import recorded_command
from blockspec.engine.speculation import SpecController
from blockspec.policy.drain import Drain
from blockspec.policy.policy import StepCostModel
from blockspec.policy.step_context import StepContext

CONFIGS = ("plain", "fixed 4", "fixed 8", "fixed 16", "adaptive")


def load_model(res: dict) -> tuple[StepCostModel, dict[tuple[int, int], float], list[int]]:
    """(cost profile, true overhead seconds by (bucket, L), buckets) from a policy_sweep JSON."""
    times = res["cost_profile"]["times"]
    profile = StepCostModel({int(L): {int(b): t for b, t in row.items()}
                             for L, row in times.items()})
    seen: dict[tuple[int, int], list[float]] = {}
    for a_runs in res["spec"].values():
        for cell in a_runs.values():
            for run in cell.get("adaptive", {}).get("runs", []):
                for key, ms in run.get("overhead_ms", {}).items():
                    b, L = (int(x.split("=")[1]) for x in key.split())
                    seen.setdefault((b, L), []).append(ms / 1e3)
    # NOTE: the median over the adaptive runs' tables: one run's table carries the noise of the
    # few steps a rarely chosen candidate was timed in.
    terms = {k: statistics.median(v) for k, v in seen.items()}
    buckets = sorted(int(b) for b in times["1"])
    return profile, terms, buckets


class ModelledH200:
    def __init__(self, profile: StepCostModel, terms: dict, buckets: list[int], noise: float,
                 rng: random.Random) -> None:
        self.profile, self.terms, self.buckets = profile, terms, buckets
        self.noise, self.rng = noise, rng

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def step_time(self, n: int, L: int) -> float:
        b = self.bucket(n)
        extra = self.terms.get((b, L), self.terms.get((b, 1), 0.0))
        return (self.profile.cost(b, L) + extra) * max(0.5, self.rng.gauss(1.0, self.noise))


def run_batch(h200: ModelledH200, ctl: SpecController, config: str, a: float, c: int,
              out_len: int, rng: random.Random) -> dict:
    """One closed batch; the controller observes every step (fixed configs too, as in the
    engine: their steps feed the live overhead and the acceptance statistics)."""
    fixed = None if config == "adaptive" else (1 if config == "plain" else int(config.split()[1]))
    left = [out_len - 1] * c
    seconds, hist = 0.0, {}
    while True:
        active = [i for i in range(c) if left[i] > 0]
        if not active:
            break
        n = len(active)
        if fixed is None:
            L = ctl.choose(n, StepContext(drain=Drain.of(left[i] for i in active)))
        else:
            L = fixed
        wall = h200.step_time(n, L)
        seconds += wall
        hist[L] = hist.get(L, 0) + 1
        if config != "plain":
            ctl.observe_step_time(n, L, wall)
        accepted = []
        for i in active:
            k = 0
            while k < L - 1 and rng.random() < a:
                k += 1
            accepted.append(k)
            left[i] -= min(left[i], k + 1)
        if config != "plain":
            ctl.observe(L, [L - 1] * n if L > 1 else [], accepted if L > 1 else [])
    return {"tok_s": c * (out_len - 1) / seconds, "steps": hist}


def replay(res: dict, noise: float, rounds: int, seed: int, out_len: int | None = None) -> dict:
    profile, terms, buckets = load_model(res)
    rng = random.Random(seed)
    h200 = ModelledH200(profile, terms, buckets, noise, rng)
    out_len = out_len or res["output_len"]
    table: dict = {}
    for a in res["acceptance"]:
        # NOTE: the block lengths the run's profile measured (from run 16 on: 2, 4, 8, 16)
        ctl = SpecController([L for L in profile.block_lens if L > 1], "adaptive", profile,
                             batch_bucket=h200.bucket)
        for c in res["concurrency"]:
            cell: dict = {k: {"tok_s": [], "steps": {}} for k in CONFIGS}
            for r in range(rounds):
                order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
                draws = rng.randrange(1 << 30)
                for config in order:
                    if config != "plain":
                        ctl.set_policy(*(("adaptive",) if config == "adaptive"
                                         else ("fixed", int(config.split()[1]))))
                    # NOTE: common random numbers, as in the sweep: every config of a round sees
                    # the same acceptance draws and step-time factors
                    h200.rng = random.Random(draws + 1)
                    got = run_batch(h200, ctl, config, a, c, out_len, random.Random(draws))
                    cell[config]["tok_s"].append(got["tok_s"])
                    for L, k in got["steps"].items():
                        cell[config]["steps"][L] = cell[config]["steps"].get(L, 0) + k
            mean = {k: sum(v["tok_s"]) / len(v["tok_s"]) for k, v in cell.items()}
            best = max(mean[k] for k in CONFIGS if k != "adaptive")
            table.setdefault(f"a={a}", {})[f"C={c}"] = {
                "tok_s": mean, "vs_plain": mean["adaptive"] / mean["plain"],
                "vs_best": mean["adaptive"] / best if best else None,
                "adaptive_steps": dict(sorted(cell["adaptive"]["steps"].items()))}
    return table


def report(table: dict, res: dict) -> str:
    lines = []
    measured = res.get("ratios", {})
    for a_key, cells in table.items():
        cs = list(cells)
        lines += [f"### {a_key} (SIMULATED decode phase; measured = the source run, end to end)",
                  "", "| | " + " | ".join(cs) + " |", "|---|" + "---|" * len(cs)]
        for k in CONFIGS:
            lines.append(f"| {k} tok/s | " + " | ".join(
                f"{cells[c]['tok_s'][k]:.0f}" for c in cs) + " |")
        for key in ("vs_plain", "vs_best"):
            lines.append(f"| adaptive {key} | " + " | ".join(
                f"{cells[c][key]:.3f}" for c in cs) + " |")
            m = measured.get(a_key, {})
            lines.append(f"| measured {key} | " + " | ".join(
                f"{m[c][key]:.3f}" if c in m else "-" for c in cs) + " |")
        lines.append("| adaptive block lengths | " + " | ".join(
            " ".join(f"{L}:{k}" for L, k in cells[c]["adaptive_steps"].items()) for c in cs)
            + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="source", required=True, help="a policy_sweep.json")
    ap.add_argument("--noise", type=float, default=0.03, help="sd of the per-step time factor")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = json.loads(Path(args.source).read_text())
    table = replay(res, args.noise, args.rounds, args.seed, args.output_len)
    text = report(table, res)
    print("SIMULATION (benchmarks/policy_replay.py): modelled step times, not a measurement\n")
    print(text)
    allr = [r for cells in table.values() for r in cells.values()]
    summary = {"min_vs_plain": min(r["vs_plain"] for r in allr),
               "min_vs_best": min(r["vs_best"] for r in allr)}
    print(f"simulated minima: adaptive / plain {summary['min_vs_plain']:.3f}, "
          f"adaptive / best {summary['min_vs_best']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"kind": "SIMULATION (modelled step times, not a measurement)",
             "command": recorded_command("benchmarks/policy_replay.py"),
             "source": args.source, "noise": args.noise, "rounds": args.rounds,
             "cells": table, **summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
