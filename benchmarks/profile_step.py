"""Where does a decode step's time go? Kernel-level profile of the fixed-shape step on one GPU.

Runs the decode step eagerly under torch.profiler (kernel durations are those of the graphed
step; only launch gaps differ) for: AR at batch 1, DFlash (block 16) at batch 1 and at batch 32,
on the Qwen3-8B-shaped random-weight model of blockspec/bench/fullsize.py. Prints the top kernels by
total GPU time and the per-step sums, and times the engine's host work per step.

Usage: python benchmarks/profile_step.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from blockspec.bench.fullsize import INPUT_LEN, make_llm, write_folders


def profile_step(llm, n: int, ctx: int, iters: int = 10) -> dict:
    runner = llm.engine.runner
    bufs = runner.bufs
    bufs.block_tables.fill_(runner.trash_block)
    bufs.ctx_lens[:n].fill_(ctx)
    with torch.inference_mode():
        for _ in range(3):
            runner.decode(bufs, n)
        torch.cuda.synchronize()
        acts = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
        with profile(activities=acts) as prof:
            for _ in range(iters):
                runner.decode(bufs, n)
            torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", 0) if torch.cuda.is_available() else \
            evt.self_cpu_time_total
        if t > 0:
            rows.append((evt.key[:90], t / iters, evt.count // iters))
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    return {"n": n, "ctx": ctx, "gpu_us_per_step": total,
            "top": [{"kernel": k, "us_per_step": round(t, 1), "calls_per_step": c}
                    for k, t, c in rows[:40]]}


def profile_moe(tmp: Path, out: Path, kimi_int4: bool) -> int:
    """AR at batch 1 on the Moonlight shape, and with `kimi_int4` on the Kimi-K2.6-width slice
    with INT4 experts (benchmarks/moe_bench.py's stage of that name)."""
    from blockspec import LLM
    from blockspec.bench.moe_shapes import KIMI_INT4, MOONLIGHT, kimi_slice, write_moe_folders

    shapes = {"moonlight_ar_b1": ("moonlight", MOONLIGHT)}
    if kimi_int4:
        shapes["kimi_int4_ar_b1"] = ("kimi-int4", {**kimi_slice(6),
                                                   "quantization_config": KIMI_INT4})
    res: dict = {"device": torch.cuda.get_device_name()}
    for key, (name, shape) in shapes.items():
        target, _ = write_moe_folders(tmp, name, shape)
        llm = LLM(str(target), device="cuda", dtype="bfloat16", load_format="dummy",
                  max_model_len=2048, kv_cache_memory_gb=4, max_num_seqs=32,
                  enforce_eager=True, enable_prefix_caching=False)
        r = res[key] = profile_step(llm, 1, INPUT_LEN + 128)
        print(f"== {key}: {r['gpu_us_per_step']:.0f} us of kernels per step")
        for row in r["top"]:
            print(f"  {row['us_per_step']:8.1f} us  x{row['calls_per_step']:4d}  {row['kernel']}")
        del llm
        torch.cuda.empty_cache()
    out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--moonlight", action="store_true",
                    help="AR at batch 1 on the Moonlight-16B-A3B shape (MLA + MoE) only")
    ap.add_argument("--kimi-int4", action="store_true",
                    help="with --moonlight: also the Kimi-K2.6-width slice with INT4 experts")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    if args.moonlight:
        return profile_moe(tmp, Path(args.out), args.kimi_int4)
    target, drafter = write_folders(tmp)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    ctx = INPUT_LEN + 128
    ar = make_llm(target, None, enforce_eager=True, max_num_seqs=32, kv_cache_memory_gb=8)
    res["ar_b1"] = profile_step(ar, 1, ctx)
    del ar
    torch.cuda.empty_cache()
    sp = make_llm(target, drafter, enforce_eager=True, max_num_seqs=32, kv_cache_memory_gb=8,
                  synthetic_acceptance=0.86, benchmark_mode=True)
    res["dflash_b1"] = profile_step(sp, 1, ctx)
    res["dflash_b32"] = profile_step(sp, 32, ctx)
    # Host-side cost of one engine step around the device work (C=32, DFlash, eager).
    from blockspec import SamplingParams

    p = [[1] * INPUT_LEN for _ in range(32)]
    eng = sp.engine
    for i, ids in enumerate(p):
        eng.add_request(ids, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                        request_id=f"h{i}", stream=False)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or \
            eng.scheduler.waiting:
        eng.step()
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    res["dflash_b32_engine_step_ms_eager"] = sorted(times)[2] * 1e3
    for key in ("ar_b1", "dflash_b1", "dflash_b32"):
        r = res[key]
        print(f"== {key}: {r['gpu_us_per_step']:.0f} us of kernels per step")
        for row in r["top"][:12]:
            print(f"  {row['us_per_step']:9.1f} us  x{row['calls_per_step']:<4} {row['kernel']}")
    print(f"DFlash C=32 eager engine step: {res['dflash_b32_engine_step_ms_eager']:.1f} ms")
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
