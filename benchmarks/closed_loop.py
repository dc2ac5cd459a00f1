"""Closed-loop step breakdown (issue 20): where an engine's time goes when requests arrive as
others finish, as in serving.

Runs `blockspec.bench.offline.run_requests` (the code behind `blockspec bench offline`) per
config and classes every `ModelRunner.execute` as "decode" (every sequence decoding) or "mixed"
(some sequence prefilling), by the block length it ran, timed with a device sync on both sides.

    python benchmarks/closed_loop.py --out-dir DIR                 # one GPU, the demo pair
    python benchmarks/closed_loop.py --out-dir DIR --smoke         # CPU, tiny lengths
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import time
from collections import defaultdict

import torch

from blockspec.bench.common import git_commit, recorded_command, write_json
from blockspec.bench.datasets import load_jsonl, token_ids
from blockspec.bench.diagnose import CompileLog, allocator_counters, profiled
from blockspec.bench.offline import run_requests
from blockspec.config import EngineConfig
from blockspec.demo import demo_drafter, demo_target
from blockspec.engine.detokenizer import load_tokenizer
from blockspec.engine.llm_engine import LLMEngine
from blockspec.sampling_params import SamplingParams

CONFIGS = {
    "ar": dict(draft=None),
    "adaptive": dict(),
    "adaptive-no-lazy": dict(lazy_draft_context=False),
    "fixed-16": dict(speculation_policy="fixed"),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def instrument(engine: LLMEngine) -> dict:
    """Wraps the runner's execute; returns the breakdown it fills."""
    runner, execute = engine.runner, engine.runner.execute
    steps: dict = defaultdict(lambda: [0, 0.0, 0, []])  # (kind, L) -> [n, s, tokens, each s]

    def timed(seqs, num_new_tokens, *rest):
        decoding = all(n == 1 and s.num_computed_tokens == s.num_tokens - 1
                       for s, n in zip(seqs, num_new_tokens))
        sync(runner.device)
        t0 = time.perf_counter()
        res = execute(seqs, num_new_tokens, *rest)
        sync(runner.device)
        cell = steps[("decode" if decoding else "mixed", res.block_len)]
        dt = time.perf_counter() - t0
        cell[0] += 1
        cell[1] += dt
        cell[2] += sum(num_new_tokens)
        cell[3].append(dt)
        return res

    runner.execute = timed
    return steps


def step_stats(steps: dict) -> dict:
    out = {}
    for (kind, L), (n, s, t, each) in sorted(steps.items()):
        slow = sorted(each, reverse=True)
        out[f"{kind} L={L}"] = {"n": n, "mean_ms": 1e3 * s / n, "tokens_mean": t / n,
                                "median_ms": 1e3 * slow[n // 2],
                                "slowest_ms": [round(1e3 * x, 2) for x in slow[:5]]}
    return out


def run_config(name: str, overrides: dict, prompts: list, params: SamplingParams, c: int,
               device: str, compiles: CompileLog | None) -> dict:
    kw = {"model": str(demo_target()), "draft": str(demo_drafter()), "device": device,
          "enable_prefix_caching": False, **overrides}
    kw.update(num_kv_blocks=1024) if device == "cpu" else kw.update(kv_cache_memory_gb=8.0)
    engine = LLMEngine(EngineConfig(**kw))
    # NOTE: a warm-up with arrivals (staggered lengths), like bench offline's: steps that mix
    # prefills with speculative decodes compile kernel variants of their own
    warm = [SamplingParams(temperature=0, max_tokens=16 + i % c, ignore_eos=True)
            for i in range(2 * c)]
    run_requests(engine, prompts[:2 * c], warm, c, "warm", show=False)
    steps = instrument(engine)
    diag: dict = {}
    if compiles is not None:
        compiles.events.clear()
        compiles.active, diag["alloc_before"] = True, allocator_counters()
    with profiled() if compiles is not None else contextlib.nullcontext({}) as prof:
        t0 = time.perf_counter()
        records, seconds, spec = run_requests(engine, prompts, params, c, "run", show=False)
        wall = time.perf_counter() - t0
    if compiles is not None:
        compiles.active = False
        diag.update(alloc_after=allocator_counters(), triton=compiles.summary(), **prof)
    out_tokens = sum(r.output_tokens for r in records)
    lazy = engine.runner.lazy
    res = {"config": name, "concurrency": c, "requests": len(records),
           "output_tok_s": out_tokens / wall, "wall_s": wall,
           "tau": spec.mean_acceptance_length if spec.num_steps else None,
           "steps": step_stats(steps), "diagnose": diag or None,
           "lazy": None if lazy is None else {
               "catchups": lazy.num_catchups, "catchup_tokens": lazy.num_catchup_tokens,
               "catchup_s": lazy.catchup_seconds, "detached_steps": lazy.num_detached_steps,
               "reattaches": lazy.num_reattaches}}
    del engine
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="configs in run order (Triton compiles a kernel variant once per "
                         "process, in whichever config first needs it)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--diagnose", action="store_true",
                    help="log Triton compiles, allocator growth and a Python profile per run")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    out_len = 16 if args.smoke else args.output_len
    n = 8 if args.smoke else args.num_requests
    c = 4 if args.smoke else args.concurrency
    tok = load_tokenizer(str(demo_target()))
    samples = load_jsonl("benchmarks/prompts/code.jsonl")
    prompts = [token_ids(samples[i % len(samples)], tok) for i in range(n)]
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    res = {"benchmark": "closed_loop: step breakdown under arriving requests (demo pair)",
           "command": recorded_command("benchmarks/closed_loop.py"),
           "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__, "commit": git_commit(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "output_len": out_len, "runs": []}
    compiles = CompileLog() if args.diagnose else None
    for name in (x.strip() for x in args.configs.split(",")):
        r = run_config(name, CONFIGS[name], prompts, params, c, device, compiles)
        res["runs"].append(r)
        print(f"{name:28s} {r['output_tok_s']:9.0f} tok/s  tau {r['tau']}  lazy {r['lazy']}",
              flush=True)
        for k, v in r["steps"].items():
            print(f"    {k:12s} n={v['n']:5d} mean {v['mean_ms']:7.2f} ms  median "
                  f"{v['median_ms']:7.2f}  slowest {v['slowest_ms']}  "
                  f"tokens {v['tokens_mean']:7.1f}", flush=True)
        if r["diagnose"]:
            d = r["diagnose"]
            print(f"    triton {d['triton']['compiles']} compiles "
                  f"{d['triton']['seconds']:.2f} s {d['triton']['per_kernel']}\n"
                  f"    alloc {d['alloc_before']} -> {d['alloc_after']}", flush=True)
            print("\n".join(d["profile"].splitlines()[:45]), flush=True)
    write_json(args.out_dir, "closed_loop.json", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
