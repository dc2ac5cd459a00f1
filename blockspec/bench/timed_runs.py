"""Timed `LLM.generate` runs of the GPU benchmark scripts: one greedy fixed-length run's
throughput record (whole run and decode phase), and several runs of one cell pooled into one."""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

import torch

from blockspec import SamplingParams

if TYPE_CHECKING:
    from blockspec import LLM

__all__ = ["decode_phase", "pool_runs", "timed_generate"]


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
