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
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from blockspec import LLM, SamplingParams
from blockspec.bench.common import recorded_command
from blockspec.bench.offline import run_requests
from blockspec.config import ModelConfig
from blockspec.dflash.checkpoint import new_drafter_config
from blockspec.tiny import build_tokenizer

QWEN3_8B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
    intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1000000.0,
    tie_word_embeddings=False, dtype="bfloat16", eos_token_id=151645,
)
MASK_TOKEN = 151669
INPUT_LEN, OUTPUT_LEN = 512, 256


def git_commit() -> str:
    """HEAD, marked when the working tree differs from it (then HEAD alone does not say what ran;
    the device tool's copy of the tree may also carry a stale .git). A snapshot made with
    `git archive` has no .git: write `git rev-parse HEAD` to its SNAPSHOT_COMMIT file."""
    snap = Path(__file__).resolve().parents[1] / "SNAPSHOT_COMMIT"
    if snap.is_file():
        return snap.read_text().strip() + " (git archive snapshot)"
    try:
        run = dict(text=True, stderr=subprocess.DEVNULL)
        head = subprocess.check_output(["git", "rev-parse", "HEAD"], **run).strip()
        dirty = subprocess.check_output(["git", "status", "--porcelain", "-uno"], **run).strip()
    except Exception:
        return "unknown"
    return head + (" + uncommitted changes" if dirty else "")


def write_folders(root: Path) -> tuple[Path, Path]:
    target, drafter = root / "qwen3-8b-shape", root / "dflash-b16-shape"
    for d in (target, drafter):
        d.mkdir(parents=True, exist_ok=True)
        build_tokenizer(d)  # only for the engine's tokenizer slot: prompts are token ids
    (target / "config.json").write_text(json.dumps(QWEN3_8B))
    cfg = new_drafter_config(ModelConfig.from_dict(QWEN3_8B, "qwen3"), num_layers=5,
                             block_size=16, mask_token_id=MASK_TOKEN)
    (drafter / "config.json").write_text(json.dumps(cfg.to_dict()))
    return target, drafter


def make_llm(target: Path, drafter: Path | None, **kw) -> LLM:
    # NOTE: no prefix caching: every timed request must pay its full 512-token prefill.
    args = dict(device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=1024,
                kv_cache_memory_gb=36, max_num_seqs=256, enable_prefix_caching=False)
    args.update(kw)
    if drafter is not None:
        # NOTE: the "DFlash block 16" figures: a fixed block, not the adaptive policy.
        args.update(draft=str(drafter), block_size=16, speculation_policy="fixed")
    return LLM(str(target), **args)


def free() -> None:
    """Call after dropping the last reference to an engine."""
    gc.collect()
    torch.cuda.empty_cache()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 151000, (n, INPUT_LEN), generator=g).tolist()


def copy_bandwidth() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    del x, y
    free()
    return 2 * (2 << 30) / times[len(times) // 2]


def floor_bytes(llm: LLM, context: int) -> int:
    model = llm.engine.model
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if "embed_tokens" not in n)
    mc = llm.engine.model_config
    kv = 2 * mc.num_hidden_layers * context * mc.num_key_value_heads * mc.head_dim * 2
    return weights + kv


def replay_ms(llm: LLM, n: int, context: int, iters: int = 50) -> float:
    """Median time of one graph replay of the decode step for `n` sequences at `context`."""
    runner = llm.engine.runner
    bufs = runner.bufs
    bufs.block_tables.fill_(runner.trash_block)
    bufs.ctx_lens[:n].fill_(context)
    times = []
    for i in range(iters + 5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        runner.graphs.replay(n)
        b.record()
        b.synchronize()
        if i >= 5:
            times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def timed_generate(llm: LLM, prompts: list, out_len: int) -> tuple[dict, list]:
    """Greedy, `out_len` tokens per prompt (ignore_eos): the throughput record every benchmark
    here reports (output tok/s over the whole run, prefill included), and the outputs."""
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    before = llm.engine.timings.copy()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    timings = llm.engine.timings.copy()
    timings.add(before, sign=-1)
    tokens = sum(len(o.token_ids) for o in outs)
    taus = [o.metrics.spec.mean_acceptance_length for o in outs
            if o.metrics.spec and o.metrics.spec.num_steps]
    return ({"output_tok_s": tokens / dt, "elapsed_s": dt, "output_tokens": tokens,
             "mean_tpot_ms": 1e3 * sum(o.metrics.tpot for o in outs) / len(outs),
             "mean_ttft_ms": 1e3 * sum(o.metrics.ttft for o in outs) / len(outs),
             "tau": sum(taus) / len(taus) if taus else None,
             # NOTE: where the run's engine steps spent wall time (host vs device wait)
             "engine_steps": timings.steps, "step_ms": timings.per_step_ms(),
             **decode_phase(outs)}, outs)


def decode_phase(outs: list) -> dict:
    """The run's decode phase: from the last request's first token (every request has then
    prefilled) to the last token. The prefill, the same work for every config, dilutes output
    tok/s over the whole run; this is what speculation changes. Its tokens are estimated per
    request as the share of its decode time after that moment (requests that prefilled first
    decoded a few steps during the prefill phase)."""
    m = [o.metrics for o in outs]
    start = max(x.first_token_time for x in m)
    decode_s = max(x.finished_time for x in m) - start
    tokens = sum((x.num_generated_tokens - 1) * (x.finished_time - start)
                 / (x.finished_time - x.first_token_time)
                 for x in m if x.finished_time > x.first_token_time)
    return {"decode_phase_s": decode_s, "decode_tok_s": tokens / decode_s if decode_s > 0
            else None}


def pool_runs(runs: list[dict]) -> dict:
    """Several timed runs of one cell as one record: throughput over all of them together
    (total output tokens / total time), tau and latencies averaged, steps by block length
    summed; the runs kept under "runs". One run is returned as it is."""
    if len(runs) == 1:
        return runs[0]
    out = {"output_tokens": sum(r["output_tokens"] for r in runs),
           "elapsed_s": sum(r["elapsed_s"] for r in runs), "repeats": len(runs)}
    out["output_tok_s"] = out["output_tokens"] / out["elapsed_s"]
    for k in ("mean_tpot_ms", "mean_ttft_ms", "tau", "tokens_per_decode_step"):
        if k in runs[0]:
            vals = [r[k] for r in runs if r.get(k) is not None]
            out[k] = sum(vals) / len(vals) if vals else None
    if all(r.get("decode_tok_s") is not None for r in runs):  # see decode_phase
        out["decode_phase_s"] = sum(r["decode_phase_s"] for r in runs)
        out["decode_tok_s"] = sum(r["decode_tok_s"] * r["decode_phase_s"] for r in runs) \
            / out["decode_phase_s"]
    if "step_ms" in runs[0]:
        out["engine_steps"] = sum(r["engine_steps"] for r in runs)
        out["step_ms"] = {k: sum(r["step_ms"].get(k, 0.0) * r["engine_steps"] for r in runs)
                          / max(1, out["engine_steps"]) for k in runs[0]["step_ms"]}
    if "block_len_steps" in runs[0]:
        steps: Counter = Counter()
        for r in runs:
            steps.update(r["block_len_steps"])
        out["block_len_steps"] = dict(sorted(steps.items(), key=lambda kv: int(kv[0])))
    out["runs"] = runs
    return out


def run_generate(llm: LLM, c: int, out_len: int, seed: int = 0) -> dict:
    return timed_generate(llm, prompts(c, seed), out_len)[0]


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


def merge_latest(res: dict, figures: dict, path: Path) -> None:
    """Headline figures (DESIGN.md) merged into the committed latest.json and written to `path`;
    measured ones only, each with its run recorded under "sources" (a figure from an older run
    keeps its own source)."""
    committed = Path(__file__).parent / "results" / "latest.json"
    latest = json.loads(committed.read_text()) if committed.is_file() else {}
    if figures:
        latest.update(device=res["device"], date=res["date"], commit=res["commit"], **figures)
        run = f"{res['command']} ({res['device']}, {res['date']})"
        latest.setdefault("sources", {}).update({k: run for k in figures})
    path.write_text(json.dumps(latest, indent=2) + "\n")


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
