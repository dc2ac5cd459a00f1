"""How far can the fast path go? Matmul-only lower bounds for issue 4's two unmet bars, one GPU,
one run (the Qwen3-8B-shape target and 5-layer drafter of blockspec/bench/fullsize.py).

A step cannot be faster than its matrix multiplies: this script captures exactly the GEMMs a
step runs (the models' own weights, the same `x @ W.T` calls as their Linear layers, nothing
else: no attention, norms, RoPE, argmax, host work) in one CUDA graph and times it.
  1. AR batch 1: the matmul-only step against the bytes floor (copy bandwidth measured here),
     with cuBLAS and with the Triton GEMV (layers/linear.py), next to the engine's graph
     replay; and blockspec.bench.linear_sweep's per-projection cuBLAS vs GEMV configs.
  2. C=32 (input 512, output 256): AR and DFlash (block 16, LABELLED synthetic acceptance a)
     engine runs, each step traced (sequences decoding, prefill tokens, wall time). DFlash's
     lower bound replaces every step by its matmuls alone: decode steps by the matmul-only
     graph at the exact batch (no bucket padding), prefill tokens by the best per-token matmul
     time (8192-token chunks). The ceiling is AR's measured time over that bound: no kernel,
     fusion or host work on DFlash's side can beat it, and a faster AR only lowers it.

Usage: python benchmarks/fast_path_ceiling.py --out-dir DIR [--acceptance 0.86]
       [--linear-backend auto|torch|triton]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from blockspec.bench.common import git_commit, recorded_command
from blockspec.bench.fullsize import INPUT_LEN, OUTPUT_LEN, make_llm, run_generate, write_folders
from blockspec.bench.gpu_timing import copy_bandwidth, floor_bytes, free, graph_ms, replay_ms
from blockspec.bench.linear_sweep import sweep
from blockspec.layers.linear import linear

C, BLOCK = 32, 16
Call = tuple[torch.Tensor, int]  # (weight [N, K], rows M)


def target_calls(model: nn.Module, m: int, m_logits: int) -> list[Call]:
    calls: list[Call] = []
    for layer in model.model.layers:
        a, f = layer.self_attn, layer.mlp
        calls += [(a.qkv_proj.weight, m), (a.o_proj.weight, m), (f.gate_up_proj.weight, m),
                  (f.down_proj.weight, m)]
    return calls + ([(model.lm_head.weight, m_logits)] if m_logits else [])


def drafter_context_calls(drafter: nn.Module, m: int) -> list[Call]:
    """fc over the tapped target states, then each layer's K/V projection (write_context)."""
    calls: list[Call] = [(drafter.fc.weight, m)]
    for layer in drafter.layers:
        calls.append((layer.self_attn.qkv_proj.weight[layer.self_attn.q_size:], m))
    return calls


def dflash_step_calls(model: nn.Module, drafter: nn.Module, b: int) -> list[Call]:
    """One whole speculative step for b sequences (DecodeStep, q = BLOCK): draft, verify,
    write the drafter context of the verified tokens."""
    m = b * BLOCK
    draft: list[Call] = []
    for layer in drafter.layers:
        a, f = layer.self_attn, layer.mlp
        draft += [(a.qkv_proj.weight, m), (a.o_proj.weight, m), (f.gate_up_proj.weight, m),
                  (f.down_proj.weight, m)]
    draft.append((model.lm_head.weight, b * (BLOCK - 1)))
    return draft + target_calls(model, m, m) + drafter_context_calls(drafter, m)


def gemm_ms(calls: list[Call], backend: str = "torch") -> float:
    """`calls` back to back as one CUDA graph (gpu_timing.graph_ms): a replay's median ms.
    Inputs are static random tensors per K; with backend "torch" the outputs are too (F.linear's
    cuBLAS call, `out=`), else `linear` with that backend."""
    dev, dt = calls[0][0].device, calls[0][0].dtype
    max_m = max(m for _, m in calls)
    xs = {k: torch.randn(max_m, k, device=dev, dtype=dt) for k in {w.shape[1] for w, _ in calls}}
    outs = {n: torch.empty(max_m, n, device=dev, dtype=dt) for n in {w.shape[0] for w, _ in calls}}

    def run() -> None:
        for w, m in calls:
            if backend == "torch":
                torch.mm(xs[w.shape[1]][:m], w.t(), out=outs[w.shape[0]][:m])
            else:
                linear(xs[w.shape[1]][:m], w, None, backend)

    return graph_ms(run)


def traced_run(llm, c: int, seed: int) -> tuple[dict, list[dict]]:
    """One timed run (fullsize.run_generate) with a record per engine step."""
    eng, runner = llm.engine, llm.engine.runner
    trace: list[dict] = []
    execute, step = runner.execute, eng.step

    def traced_execute(seqs, num_new_tokens, *rest):
        dec = sum(n == 1 and s.num_computed_tokens == s.num_tokens - 1
                  for s, n in zip(seqs, num_new_tokens))
        pre = sum(n for s, n in zip(seqs, num_new_tokens)
                  if not (n == 1 and s.num_computed_tokens == s.num_tokens - 1))
        trace.append({"seqs": len(seqs), "decoding": dec, "prefill_tokens": pre})
        return execute(seqs, num_new_tokens, *rest)

    def traced_step():
        t0 = time.perf_counter()
        out = step()
        if trace and "wall_ms" not in trace[-1]:
            trace[-1]["wall_ms"] = 1e3 * (time.perf_counter() - t0)
        return out

    runner.execute, eng.step = traced_execute, traced_step
    try:
        r = run_generate(llm, c, OUTPUT_LEN, seed=seed)
    finally:
        del runner.execute, eng.step  # back to the class methods
    return r, trace


def simulate_schedules(a: float, runs: int = 2000, seed: int = 0) -> list[list[int]]:
    """Per simulated run of a batch of C, the number of sequences still decoding at each step
    (the first token comes from the prefill; a step commits its accepted drafts + 1, each draft
    position accepted with probability a while the ones before it were)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(runs):
        left = np.full(C, OUTPUT_LEN - 1)
        steps = []
        while (left > 0).any():
            live = left > 0
            steps.append(int(live.sum()))
            hits = rng.random((C, BLOCK - 1)) < a
            left = np.where(live, left - np.cumprod(hits, axis=1).sum(axis=1) - 1, left)
        out.append(steps)
    return out


def expected_schedule(a: float, runs: int = 2000, seed: int = 0) -> list[float]:
    """Mean number of sequences decoding at each step (0 once a run has ended)."""
    scheds = simulate_schedules(a, runs, seed)
    width = max(len(s) for s in scheds)
    return [float(np.mean([s[k] if k < len(s) else 0 for s in scheds])) for k in range(width)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--acceptance", type=float, default=0.86)
    ap.add_argument("--linear-backend", default="auto", choices=["auto", "torch", "triton"],
                    help="the engines' (matmul-only graphs time both)")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {
        "benchmark": "fast_path_ceiling (issue 4): matmul-only lower bounds, Qwen3-8B-shape "
                     "target + 5-layer DFlash drafter, random bf16 weights, synthetic acceptance "
                     "(labelled)",
        "command": recorded_command("benchmarks/fast_path_ceiling.py"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(), "acceptance": args.acceptance, "concurrency": C,
        "input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "linear_backend": args.linear_backend,
    }

    def save() -> None:
        (out / "fast_path_ceiling.json").write_text(json.dumps(res, indent=2) + "\n")

    target, drafter_dir = write_folders(Path(tempfile.mkdtemp()))
    bw = copy_bandwidth()
    res["copy_bandwidth_GBps"] = bw / 1e9
    ctx = INPUT_LEN + OUTPUT_LEN // 2

    # --- AR: batch 1 floor, matmul-only step, engine replay; C=32 traced run.
    ar = make_llm(target, None, linear_backend=args.linear_backend)
    run_generate(ar, 2, 8)
    model = ar.engine.model
    floor = floor_bytes(ar, ctx) / bw * 1e3
    res["ar_b1"] = {"context": ctx, "bytes_floor_ms": floor,
                    "graph_replay_ms": replay_ms(ar, 1, ctx),
                    "matmul_only_ms": gemm_ms(target_calls(model, 1, 1)),
                    "matmul_only_triton_ms": gemm_ms(target_calls(model, 1, 1), "triton")}
    res["ar_b1"].update({k.replace("_ms", "_floor_ratio"): v / floor
                         for k, v in list(res["ar_b1"].items()) if k.endswith("_ms")
                         and k != "bytes_floor_ms"})
    print(json.dumps(res["ar_b1"], indent=1), flush=True)
    res["ar_b32"] = {"graph_replay_ms": replay_ms(ar, C, ctx),
                     "matmul_only_ms": gemm_ms(target_calls(model, C, C))}
    # Prefill: the best per-token matmul time (8192-token chunk), lm_head left out.
    res["prefill_us_per_token_target"] = 1e3 * gemm_ms(target_calls(model, 8192, 0)) / 8192
    run_generate(ar, C, 16, seed=99)
    res["ar_c32"], res["ar_c32_trace"] = traced_run(ar, C, seed=1000 + C)
    save()
    del ar, model
    free()

    # --- DFlash: per-batch matmul-only step vs the engine's replay; C=32 traced run.
    sp = make_llm(target, drafter_dir, synthetic_acceptance=args.acceptance,
                  benchmark_mode=True, linear_backend=args.linear_backend)
    run_generate(sp, 2, 8)
    model, drafter = sp.engine.model, sp.engine.runner.proposer.drafter
    res["linear_sweep"] = sweep(model, drafter, bw)
    for m, rows in res["linear_sweep"].items():
        print(m, {k: (round(r["cublas_ms"], 3), r["best_config"], round(r["best_ms"], 3),
                      round(r.get("default_ms") or 0, 3)) for k, r in rows.items()
                  if k != "total"}, rows["total"], flush=True)
    save()
    res["prefill_us_per_token_drafter_context"] = \
        1e3 * gemm_ms(drafter_context_calls(drafter, 8192)) / 8192
    res["dflash_step_matmul_only_ms"] = {b: gemm_ms(dflash_step_calls(model, drafter, b))
                                         for b in range(1, C + 1)}
    res["dflash_step_replay_ms"] = {b: replay_ms(sp, b, ctx)
                                    for b in sp.engine.runner.graphs.buckets if b <= C}
    print("DFlash step matmul-only / replay (ms):",
          {b: (round(res["dflash_step_matmul_only_ms"][b], 2), round(t, 2))
           for b, t in res["dflash_step_replay_ms"].items()}, flush=True)
    save()
    run_generate(sp, C, 16, seed=99)
    res["dflash_c32"], res["dflash_c32_trace"] = traced_run(sp, C, seed=1000 + C)
    del sp, model, drafter
    free()
    ceilings(res, args.acceptance)
    save()
    return 0


def ceilings(res: dict, a: float) -> None:
    mm = {int(b): t for b, t in res["dflash_step_matmul_only_ms"].items()}
    per_tok = res["prefill_us_per_token_target"] + res["prefill_us_per_token_drafter_context"]
    bound, decode_bound = 0.0, 0.0
    for st in res["dflash_c32_trace"]:
        t = st["prefill_tokens"] * per_tok / 1e3 + (mm[st["decoding"]] if st["decoding"] else 0)
        bound += t
        if not st["prefill_tokens"]:
            decode_bound += t
        st["matmul_bound_ms"] = t
    ar_s, sp_s = res["ar_c32"]["elapsed_s"], res["dflash_c32"]["elapsed_s"]
    prefill_ms = C * INPUT_LEN * per_tok / 1e3
    scheds = simulate_schedules(a)
    expected_ms = prefill_ms + float(np.mean([sum(mm[n] for n in s) for s in scheds]))
    res["c32"] = {
        "ar_elapsed_s": ar_s, "dflash_elapsed_s": sp_s, "measured_ratio": ar_s / sp_s,
        "dflash_matmul_bound_s": bound / 1e3, "ceiling_ratio_this_run": ar_s / (bound / 1e3),
        "dflash_decode_steps": sum(1 for st in res["dflash_c32_trace"]
                                   if not st["prefill_tokens"]),
        "dflash_decode_matmul_bound_s": decode_bound / 1e3,
        "expected_decode_steps": float(np.mean([len(s) for s in scheds])),
        "expected_matmul_bound_s": expected_ms / 1e3,
        "ceiling_ratio_expected": ar_s / (expected_ms / 1e3),
        "prefill_matmul_bound_s": prefill_ms / 1e3,
    }
    print(json.dumps(res["c32"], indent=1), flush=True)


if __name__ == "__main__":
    sys.exit(main())
