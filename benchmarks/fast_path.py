"""Full-size system benchmark of the GPU fast path (issue 4), one H200, one run.

Random weights of real shapes (Qwen3-8B target, 5-layer DFlash drafter with block 16), bf16,
`load_format=dummy`. Measures, in this order, writing partial results after every stage:
  1. device copy bandwidth (bytes read + written) -> the bytes floor of an AR decode step
     (target weights except the embedding table, plus the KV read at the benchmark context);
  2. AR decode step at batch 1: CUDA-graph replay time, and the engine's end-to-end TPOT;
  3. greedy outputs with graphs == without graphs (AR and DFlash with real acceptance);
  4. offline sweep, input 512 / output 256 tokens, C in --concurrency: AR and DFlash with the
     LABELLED synthetic acceptance a (each draft position accepted with probability a; the text
     is not the target's, this mode exists for system timings only);
  5. eager (no graphs) AR and DFlash at C=1 and C=32 for comparison;
  6. HF transformers `generate` at C=1 on the same weights (outside reference).

Usage: python benchmarks/fast_path.py --out-dir DIR [--concurrency 1,8,32,64,128,256]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from blockspec import LLM, SamplingParams
from blockspec.bench.common import git_commit, recorded_command
from blockspec.bench.fullsize import (
    INPUT_LEN,
    OUTPUT_LEN,
    make_llm,
    prompts,
    run_generate,
    write_folders,
)
from blockspec.bench.gpu_timing import copy_bandwidth, floor_bytes, replay_ms
from blockspec.bench.headline import merge_latest
from blockspec.bench.offline import run_requests
from blockspec.bench.timed_runs import pool_runs
from blockspec.config import ModelConfig


def timed_closed_loop(llm: LLM, prompt_ids: list, out_len: int, c: int) -> dict:
    """Like `timed_generate`, but `len(prompt_ids)` requests through a closed loop that keeps
    `c` in the engine (`blockspec bench offline`'s loop; vLLM's --max-concurrency): the
    throughput of a sustained concurrency, where one batch's slowest sequence (speculation's
    acceptance varies per sequence) no longer sets the end of the run."""
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    torch.cuda.synchronize()
    before = llm.engine.timings.copy()
    records, dt, spec = run_requests(llm.engine, prompt_ids, params, c, "fp", show=False)
    timings = llm.engine.timings.copy()
    timings.add(before, sign=-1)
    tokens = sum(r.output_tokens for r in records)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in records
             if r.latency is not None and r.ttft is not None and r.output_tokens > 1]
    return {"output_tok_s": tokens / dt, "elapsed_s": dt, "output_tokens": tokens,
            "requests": len(records), "closed_loop_concurrency": c,
            "mean_tpot_ms": 1e3 * sum(tpots) / max(1, len(tpots)),
            "mean_ttft_ms": 1e3 * sum(r.ttft or 0.0 for r in records) / max(1, len(records)),
            "tau": spec.mean_acceptance_length if spec.num_steps else None,
            "engine_steps": timings.steps, "step_ms": timings.per_step_ms()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--concurrency", default="1,8,32,64,128,256")
    ap.add_argument("--acceptance", type=float, default=0.86)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-eager", action="store_true", help="skip stages 3 and 5")
    ap.add_argument("--waves", type=int, default=1,
                    help="requests per level = waves x C, kept C at a time in a closed loop "
                         "(default 1: C requests at once, the run ends with its slowest one)")
    ap.add_argument("--c1-repeats", type=int, default=1,
                    help="timed runs at C=1, pooled (one sequence's ~40 speculative steps leave "
                         "its synthetic tau a coin toss; more runs pool more draws)")
    args = ap.parse_args()
    if args.c1_repeats < 1 or args.waves < 1:
        ap.error("--c1-repeats and --waves must be >= 1")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cs = [int(c) for c in args.concurrency.split(",")]
    res: dict = {
        "benchmark": "fast_path (issue 4): Qwen3-8B-shape target + 5-layer DFlash drafter, "
                     "random bf16 weights, synthetic acceptance (labelled)",
        "command": recorded_command("benchmarks/fast_path.py"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "synthetic_acceptance": args.acceptance,
        "c1_repeats": args.c1_repeats, "waves": args.waves,
    }

    def timed(llm: LLM, c: int) -> dict:
        """The timed run(s) of one cell: fresh prompts per run, the same prompts for AR and
        DFlash."""
        if args.waves > 1 and c > 1:
            return timed_closed_loop(llm, prompts(args.waves * c, seed=1000 + c), OUTPUT_LEN, c)
        n = args.c1_repeats if c == 1 else 1
        return pool_runs([run_generate(llm, c, OUTPUT_LEN, seed=1000 + c + 7919 * k)
                          for k in range(n)])
    res["commit"] = git_commit()

    def save() -> None:
        (out / "fast_path.json").write_text(json.dumps(res, indent=2) + "\n")

    tmp = Path(tempfile.mkdtemp())
    target, drafter = write_folders(tmp)
    bw = copy_bandwidth()
    res["copy_bandwidth_GBps"] = bw / 1e9
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    tokens: dict[str, list] = {}

    def stage(name, fn) -> None:
        """Run one stage; a failure is recorded and the remaining stages still run."""
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the benchmark must report what it could
            res.setdefault("errors", {})[name] = repr(e)
            print(f"stage {name} FAILED: {e!r}", flush=True)
        res.setdefault("stage_seconds", {})[name] = time.perf_counter() - t0
        gc.collect()
        torch.cuda.empty_cache()
        save()

    def ar_stage() -> None:
        t0 = time.perf_counter()
        ar = make_llm(target, None)
        res["ar_startup_s"] = time.perf_counter() - t0
        run_generate(ar, 2, 8)  # warm-up
        ctx = INPUT_LEN + OUTPUT_LEN // 2
        floor_ms = floor_bytes(ar, ctx) / bw * 1e3
        step_ms = replay_ms(ar, 1, ctx)
        res["ar_b1"] = {"context": ctx, "bytes_floor_ms": floor_ms, "graph_replay_ms": step_ms,
                        "floor_ratio_replay": step_ms / floor_ms}
        print(f"AR b1: floor {floor_ms:.3f} ms, replay {step_ms:.3f} ms "
              f"({step_ms / floor_ms:.3f}x)", flush=True)
        res["ar"] = {}
        for c in cs:
            run_generate(ar, c, 16, seed=99)  # warm-up at this batch: JIT variants, allocator
            r = timed(ar, c)
            res["ar"][f"C={c}"] = r
            print(f"AR C={c}: {r['output_tok_s']:.1f} tok/s, TPOT {r['mean_tpot_ms']:.2f} ms",
                  flush=True)
            save()
        tpot = res["ar"].get("C=1", {}).get("mean_tpot_ms")
        if tpot:
            res["ar_b1"]["engine_tpot_ms"] = tpot
            res["ar_b1"]["floor_ratio_engine"] = tpot / floor_ms
        tokens["ar_graph"] = [o.token_ids for o in ar.generate(prompts(8, 1), greedy,
                                                               use_tqdm=False)]

    def dflash_stage() -> None:
        sp = make_llm(target, drafter, synthetic_acceptance=args.acceptance,
                      benchmark_mode=True)
        run_generate(sp, 2, 8)
        ctx = INPUT_LEN + OUTPUT_LEN // 2
        res["dflash_b1_step_replay_ms"] = replay_ms(sp, 1, ctx)
        print(f"DFlash b1 whole-step replay {res['dflash_b1_step_replay_ms']:.3f} ms",
              flush=True)
        res["dflash"] = {}
        for c in cs:
            run_generate(sp, c, 16, seed=99)
            r = timed(sp, c)
            res["dflash"][f"C={c}"] = r
            ar_c = res.get("ar", {}).get(f"C={c}", {}).get("output_tok_s")
            r["speedup_vs_ar"] = r["output_tok_s"] / ar_c if ar_c else None
            print(f"DFlash a={args.acceptance} C={c}: {r['output_tok_s']:.1f} tok/s, "
                  f"tau {r['tau']:.2f}, speedup {r['speedup_vs_ar']}", flush=True)
            save()

    def equality_stage() -> None:
        real = make_llm(target, drafter)
        tokens["dflash_graph"] = [o.token_ids for o in real.generate(prompts(8, 1), greedy,
                                                                     use_tqdm=False)]
        del real
        gc.collect()
        torch.cuda.empty_cache()
        eager = make_llm(target, drafter, enforce_eager=True)
        tokens["dflash_eager"] = [o.token_ids for o in eager.generate(prompts(8, 1), greedy,
                                                                      use_tqdm=False)]
        res["graphs_equal_eager"] = {
            "dflash_real_acceptance": tokens["dflash_graph"] == tokens["dflash_eager"],
            "dflash_equals_ar": tokens["dflash_graph"] == tokens.get("ar_graph")}

    def eager_stage() -> None:
        eager_ar = make_llm(target, None, enforce_eager=True)
        ar_eager = [o.token_ids for o in eager_ar.generate(prompts(8, 1), greedy,
                                                           use_tqdm=False)]
        res.setdefault("graphs_equal_eager", {})["ar"] = ar_eager == tokens.get("ar_graph")
        print(f"graphs == eager: {res['graphs_equal_eager']}", flush=True)
        res["eager"] = {}
        for c in (1, 32):
            r = run_generate(eager_ar, c, 64)
            res["eager"][f"AR C={c}"] = r
            print(f"eager AR C={c}: {r['output_tok_s']:.1f} tok/s", flush=True)
        del eager_ar
        gc.collect()
        torch.cuda.empty_cache()
        eager_sp = make_llm(target, drafter, enforce_eager=True,
                            synthetic_acceptance=args.acceptance, benchmark_mode=True)
        for c in (1, 32):
            r = run_generate(eager_sp, c, 64)
            res["eager"][f"DFlash C={c}"] = r
            print(f"eager DFlash C={c}: {r['output_tok_s']:.1f} tok/s", flush=True)

    stage("ar", ar_stage)
    stage("dflash", dflash_stage)
    if not args.skip_eager:
        stage("graphs_vs_eager_equality", equality_stage)
        stage("eager_speed", eager_stage)
    if not args.skip_hf:
        def hf_stage() -> None:
            res["hf_generate_c1"] = hf_generate(target)
            print(f"HF generate C=1: {res['hf_generate_c1']['output_tok_s']:.1f} tok/s",
                  flush=True)
        stage("hf_generate", hf_stage)
    summarize(res)
    save()
    write_latest(res, out / "latest.json")
    return 0


def write_latest(res: dict, path: Path) -> None:
    ar, sp = res.get("ar", {}), res.get("dflash", {})
    figures = {}
    if "ar_b1" in res:
        figures["ar_b1_floor_ratio"] = round(res["ar_b1"].get("floor_ratio_engine")
                                             or res["ar_b1"]["floor_ratio_replay"], 3)
    for c in (1, 32):
        if f"C={c}" in sp and f"C={c}" in ar:
            figures[f"dflash_speedup_c{c}"] = round(
                sp[f"C={c}"]["output_tok_s"] / ar[f"C={c}"]["output_tok_s"], 3)
    if "hf_generate_c1" in res and "C=1" in ar:
        figures["hf_generate_ratio_c1"] = round(
            ar["C=1"]["output_tok_s"] / res["hf_generate_c1"]["output_tok_s"], 2)
    merge_latest(res, figures, path)


def hf_generate(target: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from blockspec.dflash.checkpoint import unfused_state_dict
    from blockspec.models.loader import build_model, init_dummy_weights

    cfg = ModelConfig.from_pretrained(target)
    ours = build_model(cfg, torch.bfloat16, "cuda")
    init_dummy_weights(ours)
    state = unfused_state_dict(ours)
    del ours
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(_hf_config(target), dtype=torch.bfloat16)
    hf.load_state_dict(state, strict=False)
    del state
    x = torch.tensor(prompts(1), device="cuda")
    hf.generate(x, max_new_tokens=4, do_sample=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    y = hf.generate(x, max_new_tokens=64, min_new_tokens=64, do_sample=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = y.shape[1] - x.shape[1]
    return {"output_tok_s": n / dt, "output_tokens": n, "elapsed_s": dt}


def _hf_config(target: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(target))


def summarize(res: dict) -> None:
    ar, sp = res.get("ar", {}), res.get("dflash", {})
    if not ar:
        return
    rows = ["| Config | " + " | ".join(ar) + " | Peak |",
            "|---|" + "---|" * (len(ar) + 1)]
    for name, d in (("AR (graphs)", ar), (f"DFlash a={res['synthetic_acceptance']}", sp)):
        vals = [d[c]["output_tok_s"] for c in ar if c in d]
        rows.append(f"| {name} | " + " | ".join(f"{v:.0f}" for v in vals)
                    + f" | {max(vals):.0f} |")
    speed = [sp[c]["output_tok_s"] / ar[c]["output_tok_s"] for c in ar if c in sp]
    rows.append("| DFlash / AR | " + " | ".join(f"{v:.2f}x" for v in speed) + " | |")
    if all(d[c].get("decode_tok_s") for d in (ar, sp) for c in ar if c in sp):
        # NOTE: labelled apart: the figure is output tok/s over the whole run
        dec = [sp[c]["decode_tok_s"] / ar[c]["decode_tok_s"] for c in ar if c in sp]
        rows.append("| DFlash / AR, decode phase only | " + " | ".join(
            f"{v:.2f}x" for v in dec) + " | |")
    res["table_md"] = "\n".join(rows)
    print(res["table_md"])


if __name__ == "__main__":
    sys.exit(main())
