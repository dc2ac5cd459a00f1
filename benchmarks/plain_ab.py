"""Adaptive speculation deciding plain decode vs the engine without a drafter (or vs a fixed block):
paired runs at one cell (issue 7's all-plain cells), one H200.

Where the policy decodes plainly (a=0.6 from C=128 in policy_sweep), the speculative engine runs
the plain engine's device work (its detached plain step, lazy drafter context), so any gap
between the two is host time. This measures it: --pairs rounds of one closed batch on each
engine (the order alternating), the same shapes and setup as policy_sweep, and for every
all-decode step its wall time by part (schedule, runner host, device wait, postprocess), so the
prefill, which dominates the runs' per-step averages, stays out (the other steps, prefill chunks
with or without decodes, are reported apart, in all per run). One more run of each engine
under cProfile lists the functions with the most own time in its all-decode steps. Before it,
the plain step's graph replay alone (CUDA events) on each engine, on consecutive KV blocks, on
the block tables its last timed run used, and on block ids scattered over the cache: device work
vs host time, and what the allocator's KV layout costs.
`--between L` runs an untimed fixed-L batch on the speculative engine before each adaptive run
(policy_sweep switches configs between runs; whether that matters is what it tests).
`--reference fixed:L` pairs adaptive with the same engine at fixed block L instead (the cells
where adaptive trails the best fixed block: its pricing's host time, or its choices), each pair
on the same synthetic draws.
Writes plain_ab.json to --out-dir.

Usage: python benchmarks/plain_ab.py --out-dir DIR [--concurrency 128] [--acceptance 0.6]
       python benchmarks/plain_ab.py --out-dir DIR --smoke   (CPU, tiny random models)
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import io
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from blockspec import LLM
from blockspec.bench.common import git_commit, recorded_command
from blockspec.bench.policy_runs import WARMUP_TOKENS, Setup, lazy_counts
from blockspec.bench.timed_runs import timed_generate
from blockspec.engine.cost_profile import _fill_buffers, replay_seconds

PARTS = ("schedule", "runner_host", "device_wait", "postprocess")


class DecodeStepClock:
    """Per all-decode step: wall time and the engine's timings by part (ms)."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.rows: list[dict[str, float]] = []
        self.profile: cProfile.Profile | None = None
        self._all_decode = self._prev_all_decode = False
        # Block tables of the first all-decode step at full batch of the latest run (what the
        # replay probe runs as "real"); set in timed_execute.
        self.tables: torch.Tensor | None = None
        self._full = 0
        runner = self.engine.runner
        execute, step = runner.execute, self.engine.step

        def timed_execute(seqs, num_new_tokens, *rest):
            self._all_decode = all(n == 1 and s.num_computed_tokens == s.num_tokens - 1
                                   for s, n in zip(seqs, num_new_tokens))
            if self._all_decode and len(seqs) > self._full:
                self._full = len(seqs)
                width = max(len(s.block_table) for s in seqs)
                self.tables = torch.tensor([s.block_table + [-1] * (width - len(s.block_table))
                                            for s in seqs], dtype=torch.int32)
            return execute(seqs, num_new_tokens, *rest)

        def timed_step():
            t = self.engine.timings
            before = [getattr(t, k) for k in PARTS]
            self._all_decode = False
            # NOTE: a closed batch decodes to its end once every request has prefilled: the
            # step after an all-decode step is one too (the profile then sees decode steps only).
            profiled = self.profile is not None and self._prev_all_decode
            if profiled:
                self.profile.enable()
            t0 = time.perf_counter()
            out = step()
            wall = time.perf_counter() - t0
            if profiled:
                self.profile.disable()
            self._prev_all_decode = self._all_decode
            row = {k: 1e3 * (getattr(t, k) - b) for k, b in zip(PARTS, before)}
            row["wall"] = 1e3 * wall
            row["all_decode"] = self._all_decode
            self.rows.append(row)
            return out

        runner.execute = timed_execute
        self.engine.step = timed_step

    def take(self) -> list[dict[str, float]]:
        """The rows since the last call; called between runs (the next run starts prefilling)."""
        rows, self.rows = self.rows, []
        self._prev_all_decode = False
        self._full = 0
        return rows


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    """Median ms per all-decode step by part (the medians leave out a run's odd stalls) and the
    mean wall."""
    rows = [r for r in rows if r["all_decode"]]
    out = {k: statistics.median(r[k] for r in rows) for k in (*PARTS, "wall")}
    out["mean_wall"] = statistics.fmean(r["wall"] for r in rows)
    out["steps"] = len(rows)
    return out


def prefill_summary(rows: list[dict[str, float]]) -> dict[str, float]:
    """The run's other steps (prefill chunks, alone or with decodes): total ms by part."""
    rows = [r for r in rows if not r["all_decode"]]
    out = {k: sum(r[k] for r in rows) for k in (*PARTS, "wall")}
    out["steps"] = len(rows)
    return out


def allocator_counts() -> dict[str, int]:
    """The CUDA caching allocator's cudaMalloc/cudaFree calls and out-of-memory retries so far
    (a retry frees the cache and synchronizes: an eager step that triggers them stalls)."""
    if not torch.cuda.is_available():
        return {}
    st = torch.cuda.memory_stats()
    return {k: int(st.get(k, 0)) for k in ("num_device_alloc", "num_device_free",
                                           "num_alloc_retries")}


def plain_graphs(llm: LLM):
    """The CUDA graphs an all-decode plain step replays: the detached step's where the engine
    has a drafter (lazy context), else the plain engine's (None without graphs: CPU, eager)."""
    runner = llm.engine.runner
    if runner.lazy is not None:
        return runner.lazy.graphs
    return runner.graphs_by_len.get(1)


def replay_ms(llm: LLM, n: int, ctx: int, layout: str = "contiguous",
              tables: torch.Tensor | None = None, iters: int = 30) -> float | None:
    """Median device time (CUDA events) of the plain step's graph replay at batch `n`, every
    sequence at `ctx` tokens: the device half of a decode step, without the host around it.
    `layout`: each sequence's KV blocks consecutive ("contiguous", as the cost profile times
    them), `tables` (block tables an engine really ran, "real"), or block ids drawn at random
    over the whole cache ("scattered", an allocator's worst case)."""
    graphs, runner = plain_graphs(llm), llm.engine.runner
    if graphs is None or not torch.cuda.is_available():
        return None
    _fill_buffers(runner, n, ctx)
    bt = runner.bufs.block_tables
    if layout == "real":
        # NOTE: -1 pads a shorter table, and a run whose fullest decode step had fewer than n
        # sequences leaves rows out: those entries keep the contiguous fill (valid blocks).
        rows, w = min(n, tables.shape[0]), min(tables.shape[1], bt.shape[1])
        real = tables[:rows, :w].to(bt.device)
        bt[:rows, :w] = torch.where(real >= 0, real, bt[:rows, :w])
    elif layout == "scattered":
        per_seq = -(-(ctx + runner.max_block) // runner.bm.block_size)
        g = torch.Generator().manual_seed(0)
        ids = torch.randperm(runner.bm.num_blocks, generator=g)[:n * per_seq]
        bt[:n, :per_seq].copy_(ids.view(n, per_seq).to(torch.int32))
    try:
        times = replay_seconds(graphs, n, warmup=3, iters=iters)
    finally:
        runner.bufs.block_tables.fill_(runner.trash_block)
        runner.bufs.ctx_lens.zero_()
    return 1e3 * statistics.median(times)


def adjacency(tables: torch.Tensor) -> float:
    """Share of a block table's neighbouring entries that are neighbouring block ids (1 for
    a sequence's blocks in one run, ~0 for ids spread at random): the KV layout's locality."""
    live = tables[:, 1:] >= 0
    steps = (tables[:, 1:] - tables[:, :-1]).abs() == 1
    return float((steps & live).sum() / max(1, int(live.sum())))


def called(prof: cProfile.Profile, names: tuple[str, ...]) -> list[str]:
    """Which of `names` (function names) the profile saw called at all: unlike the top-N
    listing, this does not depend on how long anything took."""
    seen = {func for _, _, func in pstats.Stats(prof).stats}
    return sorted(n for n in names if n in seen)


def top_functions(prof: cProfile.Profile, n: int = 25) -> list[str]:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(n)
    return [line.rstrip() for line in s.getvalue().splitlines() if "(" in line]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--acceptance", type=float, default=0.6)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--reference", default="plain", metavar="plain|fixed:L",
                    help="what adaptive is paired with: plain (the engine without a drafter) "
                         "or fixed:L (the same speculative engine at fixed block L; each pair "
                         "shares its synthetic draws)")
    ap.add_argument("--between", type=int, default=0, metavar="L",
                    help="before each timed adaptive run, an untimed closed batch on the same "
                         "engine at fixed block L, then back to adaptive (as policy_sweep "
                         "switches its configs between runs); 0: none")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    ref_len = None
    if args.reference != "plain":
        kind, _, num = args.reference.partition(":")
        if kind != "fixed" or not num.isdigit():
            ap.error(f"--reference must be plain or fixed:L, got {args.reference!r}")
        ref_len = int(num)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    c, out_len = args.concurrency, args.output_len
    if args.smoke:
        c, out_len = min(c, 8), min(out_len, 16)
    setup = Setup(args.smoke, Path(tempfile.mkdtemp()), None)
    spec = setup.llm(draft=True, acceptance=args.acceptance)
    spec.engine.runner.set_policy("adaptive")
    ref = "plain" if ref_len is None else f"fixed {ref_len}"
    engines = {ref: setup.llm(draft=False) if ref_len is None else spec, "adaptive": spec}
    clock_of = {id(llm): DecodeStepClock(llm) for llm in engines.values()}
    clocks = {name: clock_of[id(llm)] for name, llm in engines.items()}

    def use(name: str, draws: int) -> LLM:
        """The config's engine, switched to it where the two share one engine; the synthetic
        draws reseeded (common random numbers within a pair)."""
        llm = engines[name]
        if llm is spec:
            if ref_len is not None:
                spec.engine.runner.set_policy(*(("adaptive",) if name == "adaptive"
                                                 else ("fixed", ref_len)))
            spec.engine.runner.default_generator.manual_seed(draws)
        return llm

    gc.collect()
    gc.freeze()  # NOTE: as policy_sweep does (a serving process after start-up)
    seeds = iter(range(20_000, 10**9, 7919))
    res = {"benchmark": f"plain_ab: adaptive vs {ref}, paired runs",
           "command": recorded_command("benchmarks/plain_ab.py"),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "commit": git_commit(),
           "date": datetime.date.today().isoformat(), "concurrency": c,
           "acceptance": args.acceptance, "output_len": out_len, "reference": ref,
           "between": args.between, "between_runs": 0, "pairs": []}
    for name in engines:
        timed_generate(use(name, 1), setup.prompts(c, next(seeds)), WARMUP_TOKENS)
        clocks[name].take()
    for k in range(args.pairs):
        pair = {}
        for name in ([ref, "adaptive"] if k % 2 == 0 else ["adaptive", ref]):
            if name == "adaptive" and args.between:
                spec.engine.runner.set_policy("fixed", args.between)
                timed_generate(spec, setup.prompts(c, next(seeds)), out_len)
                spec.engine.runner.set_policy("adaptive")
                clocks[name].take()
                res["between_runs"] += 1
            llm = use(name, 1_000_003 * c + 7 * k)
            lazy = spec.engine.runner.lazy
            mem0, lazy0 = allocator_counts(), lazy_counts(lazy)
            r, _ = timed_generate(llm, setup.prompts(c, next(seeds)), out_len)
            rows = clocks[name].take()
            pair[name] = {"output_tok_s": r["output_tok_s"], "elapsed_s": r["elapsed_s"],
                          "decode_phase_s": r["decode_phase_s"], "steps": summary(rows),
                          "prefill_steps": prefill_summary(rows),
                          "allocator": {key: v - mem0[key]
                                        for key, v in allocator_counts().items()}}
            if llm is spec:
                pair[name]["detached"] = lazy.detached if lazy is not None else None
                # NOTE: detached_steps as many as the run's steps: detached from its first
                # prefill on (no drafter context written); fewer: attached for a while.
                pair[name]["lazy"] = {key: v - lazy0[key]
                                      for key, v in lazy_counts(lazy).items()}
        ad, other = pair["adaptive"], pair[ref]
        pair["decode_phase_ratio"] = ad["decode_phase_s"] / other["decode_phase_s"]
        pair["median_wall_diff_ms"] = ad["steps"]["wall"] - other["steps"]["wall"]
        pair["prefill_wall_diff_ms"] = ad["prefill_steps"]["wall"] - other["prefill_steps"]["wall"]
        res["pairs"].append(pair)
        print(f"pair {k}: decode phase adaptive / {ref} {pair['decode_phase_ratio']:.3f}, "
              f"median all-decode step {pair[ref]['steps']['wall']:.3f} -> "
              f"{pair['adaptive']['steps']['wall']:.3f} ms, other steps (prefill) "
              f"{pair[ref]['prefill_steps']['wall']:.1f} -> "
              f"{pair['adaptive']['prefill_steps']['wall']:.1f} ms in all", flush=True)
    diffs = [p["median_wall_diff_ms"] for p in res["pairs"]]
    res["median_wall_diff_ms"] = statistics.median(diffs)

    def median_diff(steps: str) -> dict[str, float]:
        return {k: statistics.median(p["adaptive"][steps][k] - p[ref][steps][k]
                                     for p in res["pairs"]) for k in (*PARTS, "wall")}

    res["parts_diff_ms"] = median_diff("steps")
    # The prefill steps (in all, per run): the other place a run's time can differ.
    res["prefill_parts_diff_ms"] = median_diff("prefill_steps")
    # Engine steps by block length over the whole run (the --between batches' included).
    res["adaptive_engine_block_len_steps"] = {
        str(L): n for L, n in sorted(spec.engine.spec_stats.block_len_steps.items())}
    # The plain step's graph replay alone on each engine (rounds alternating): whether a gap in
    # the all-decode steps is device work (the detached step's graphs, or the KV layout the
    # engine's allocator left: "real" replays the block tables of its last timed run) or host.
    ctx = setup.input_len + out_len // 2
    layouts = ("contiguous", "real", "scattered")
    replays: dict[str, dict[str, list]] = {name: {lay: [] for lay in layouts} for name in engines}
    tables = {name: clocks[name].tables for name in engines}
    for k in range(5):
        for name in (list(engines) if k % 2 == 0 else list(engines)[::-1]):
            for lay in layouts:
                if lay == "real" and tables[name] is None:
                    continue
                # NOTE: where the real tables hold fewer blocks than ctx needs (the last run's
                # first full decode step), its trailing columns keep the contiguous fill.
                replays[name][lay].append(replay_ms(engines[name], c, ctx, lay, tables[name]))
    res["replay_ms"] = {name: {lay: statistics.median(v) if v and None not in v else None
                               for lay, v in by.items()} for name, by in replays.items()}
    res["replay_ms_runs"], res["replay_context"] = replays, ctx
    res["table_adjacency"] = {name: adjacency(t) if t is not None else None
                              for name, t in tables.items()}
    for name, by in res["replay_ms"].items():
        print(f"plain-step graph replay at B={c}, context {ctx}, {name}: " + ", ".join(
            f"{lay} {v:.3f} ms" if v is not None else f"{lay} -" for lay, v in by.items())
            + f"; its last run's block-table adjacency {res['table_adjacency'][name]}",
            flush=True)
    res["profiles"], res["profiled_steps"] = {}, {}
    for name in engines:
        llm = use(name, 2)
        clocks[name].profile = cProfile.Profile()
        timed_generate(llm, setup.prompts(c, next(seeds)), out_len)
        res["profiles"][name] = top_functions(clocks[name].profile)
        res["profiled_steps"][name] = called(clocks[name].profile,
                                             ("_execute_decode", "_execute_mixed"))
        clocks[name].profile = None
        clocks[name].take()
    gc.unfreeze()
    (out / "plain_ab.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in ("median_wall_diff_ms", "parts_diff_ms",
                                          "prefill_parts_diff_ms")}, indent=1))
    for name, lines in res["profiles"].items():
        print(f"== {name}: own time in all-decode steps (cProfile)")
        print("\n".join(lines[:20]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
