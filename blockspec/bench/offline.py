"""`blockspec bench offline`: the same concurrency sweep with no HTTP, driving the engine.

Concurrency C means at most C requests in the engine: C are submitted, and a new one is added
as soon as one finishes (closed loop, like `bench serve` with C clients). Every level is preceded
by a short warm-up at the same concurrency (Triton JIT variants and CUDA graphs are per batch
bucket; timing them at their first use would charge compilation to the level).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from blockspec.bench.common import (
    check_lengths,
    level_line,
    new_result,
    parse_concurrency,
    requests_per_level,
    save_result,
)
from blockspec.bench.datasets import load_samples, random_samples, token_ids
from blockspec.bench.stats import RequestRecord, acceptance_from_spec, summarize_level
from blockspec.bench.step_trace import StepTrace
from blockspec.config import ConfigError, EngineConfig
from blockspec.dflash.metrics import SpecStats
from blockspec.engine.llm_engine import LLMEngine
from blockspec.parallel.driver import make_engine
from blockspec.parallel.launch import layout_label
from blockspec.sampling_params import SamplingParams


def default_label(model: str, draft: str | None, block: int, synthetic: float | None,
                  policy: str = "fixed", block_lens: list[int] | None = None) -> str:
    label = Path(model).name or model
    if draft:
        how = (f"adaptive, blocks {'/'.join(map(str, block_lens))}"
               if policy == "adaptive" and block_lens and len(block_lens) > 1 else f"block {block}")
        label += f" + DFlash {Path(draft).name or draft} ({how})"
    else:
        label += " (autoregressive)"
    if synthetic is not None:
        label += f" [SYNTHETIC acceptance a={synthetic:g}]"
    return label


def warmup_params(args: argparse.Namespace, concurrency: int) -> list[SamplingParams]:
    """A level's warm-up: 2 x C requests of staggered lengths, so they finish at different steps
    and new ones arrive while others decode, as in the level itself. NOTE: steps that mix
    prefills with decodes compile kernel variants that all-at-once batches never need (measured
    on an H200: ~50 ms more per mixed speculative step until they exist), so a warm-up without
    arrivals charged that to the first level's timing."""
    base = max(args.warmup_tokens, 1)
    return [SamplingParams(temperature=args.temperature, max_tokens=base + i % concurrency,
                           ignore_eos=True) for i in range(2 * concurrency)]


def warmup_prompts(prompts: list[list[int]], n: int, random_dataset: bool, seed: int,
                   vocab: int, special: set[int]) -> list[list[int]]:
    """`n` warm-up prompts of at most 32 tokens: random ones for a random dataset, else the
    dataset's own prompts cut short (cycled). NOTE: a drafter's acceptance tracker carries the
    warm-up's evidence into the level, and random tokens are drafted far worse than the
    dataset's text (the adaptive policy then starts the level decoding plainly)."""
    warm_len = min(32, max(len(p) for p in prompts))
    if random_dataset:
        return [s.prompt for s in random_samples(n, warm_len, seed, vocab, special)]
    return [prompts[i % len(prompts)][:warm_len] for i in range(n)]


def run_requests(engine: LLMEngine, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams], concurrency: int, tag: str,
                 show: bool = True, trace: StepTrace | None = None
                 ) -> tuple[list[RequestRecord], float, SpecStats]:
    """Closed loop: keep `concurrency` requests in the engine until all prompts are done.
    `params`: one for every request, or one per prompt. `trace`: records every step."""
    pending = deque(enumerate(prompts))
    in_flight: dict[str, tuple[float, float | None, list[float]]] = {}  # rid -> start, last, itl
    records: list[RequestRecord] = []
    spec = SpecStats()

    def top_up() -> None:
        while pending and len(in_flight) < concurrency:
            i, p = pending.popleft()
            # NOTE: "delta": a per-step output (for inter-token latency) without per-step copies
            # of everything generated so far.
            sp = params[i] if isinstance(params, list) else params
            rid = engine.add_request(p, sp, request_id=f"bench-{tag}-{i}", stream=False,
                                     output_kind="delta")
            in_flight[rid] = (time.monotonic(), None, [])

    bar = tqdm(total=len(prompts), desc=f"C={concurrency}", unit="req", leave=False,
               disable=not show)
    start = time.monotonic()
    top_up()
    try:
        while in_flight:
            # NOTE: the last wave drains: the speculation policy prices its stragglers
            engine.closed_batch = not pending
            if not engine.has_unfinished():
                # NOTE: an engine bug, not bad input
                raise RuntimeError("engine idle with requests in flight")
            if trace is not None:
                trace.before(engine, time.monotonic())
            outs = engine.step()
            now = time.monotonic()
            if trace is not None:
                trace.after(engine, now)
            for out in outs:
                t0, last, itl = in_flight[out.request_id]
                if out.delta_token_ids:
                    if last is not None:
                        itl.append(now - last)
                        if trace is not None:
                            trace.gap(last, now)
                    in_flight[out.request_id] = (t0, now, itl)
                if not out.finished:
                    continue
                del in_flight[out.request_id]
                m = out.metrics
                # NOTE: engine timestamps (time.monotonic) for TTFT/latency: arrival is
                # add_request.
                records.append(RequestRecord(
                    ok=out.finish_reason != "abort", prompt_tokens=len(out.prompt_token_ids),
                    output_tokens=len(out.token_ids), ttft=m.ttft,
                    latency=(m.finished_time - m.arrival_time) if m.finished_time else None,
                    itl=itl, error=None if out.finish_reason != "abort" else "aborted"))
                if m.spec is not None:
                    spec.merge(m.spec)
                bar.update(1)
            top_up()
    finally:
        engine.closed_batch = False  # NOTE: also when a step raises
    bar.close()
    return records, time.monotonic() - start, spec


def build_engine(args: argparse.Namespace, model: str, kwargs: dict[str, Any]) -> LLMEngine:
    kw = dict(kwargs)
    kw["load_format"] = args.load_format
    if args.synthetic_acceptance is not None:
        # NOTE: the labelled benchmark-only mode: drafts are accepted at random, the text is not
        # the target's. EngineConfig refuses it without benchmark_mode.
        kw.update(synthetic_acceptance=args.synthetic_acceptance, benchmark_mode=True)
    return make_engine(EngineConfig(model=model, **kw))


def engine_facts(engine: LLMEngine) -> dict[str, Any]:
    mc = engine.model_config
    return {
        "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
        "attention_backend": engine.attention_backend, "max_model_len": engine.max_model_len,
        "num_kv_blocks": engine.block_manager.num_blocks,
        "kv_block_size": engine.config.kv_block_size, "max_num_seqs": engine.config.max_num_seqs,
        "spec_block_size": engine.spec_block_size or None,
        "async_scheduling": engine.async_scheduling,
        "decode_step_prefill_tokens": "auto" if (cap := engine.config.prefill_cap_setting)
        is None else cap,
        "load_format": engine.config.load_format,
        "parallel": {"tensor_parallel_size": engine.config.tensor_parallel_size,
                     "expert_parallel_size": engine.config.expert_parallel_size,
                     "layout": layout_label(engine.config.tensor_parallel_size,
                                            engine.config.expert_parallel_size) or "1 GPU"},
        "model_shape": {"layers": mc.num_hidden_layers, "hidden": mc.hidden_size,
                        "heads": mc.num_attention_heads, "kv_heads": mc.num_key_value_heads,
                        "vocab": mc.vocab_size},
    }


def policy_view(engine: LLMEngine, concurrency: int) -> dict[str, Any] | None:
    """The adaptive policy's view at the level's end for a batch of `concurrency` (its modelled
    rates, live overhead terms, tau and acceptance; SpeculationPolicy.explain), None without
    one: what the level's choices were priced from."""
    ctl = getattr(engine.runner, "controller", None)
    if ctl is None or ctl.policy is None:
        return None
    return ctl.explain(min(concurrency, engine.config.max_num_seqs))


def context_counters(engine: LLMEngine) -> dict[str, float]:
    """The drafter context's counters so far (empty without a drafter): batched writes of
    staged plain steps, and the lazy context's detached steps, re-attachments and catch-ups."""
    runner = engine.runner
    staging, lazy = getattr(runner, "staging", None), getattr(runner, "lazy", None)
    out: dict[str, float] = {}
    if staging is not None:
        out["staged_flushes"] = staging.num_flushes
    if lazy is not None:
        out.update(detached_steps=lazy.num_detached_steps, reattaches=lazy.num_reattaches,
                   catchups=lazy.num_catchups, catchup_tokens=lazy.num_catchup_tokens,
                   catchup_seconds=lazy.catchup_seconds)
    return out


def run_offline(args: argparse.Namespace, engine_kwargs: Callable[[argparse.Namespace], dict],
                resolve_model: Callable[[argparse.Namespace], str]) -> dict[str, Any]:
    levels = parse_concurrency(args.concurrency)
    check_lengths(args.input_len, args.output_len)
    if args.warmup_tokens < 0:
        raise ConfigError("--warmup-tokens must be >= 0")
    counts = [requests_per_level(args.num_prompts, c) for c in levels]
    if args.dataset != "random":  # fail on a bad file before spending minutes on loading
        load_samples(args.dataset, 1, None)
    model = resolve_model(args)
    engine = build_engine(args, model, engine_kwargs(args))
    tok = engine.tokenizer
    if args.chat and not getattr(tok, "chat_template", None):
        raise ConfigError("--chat given but the model's tokenizer has no chat template")
    vocab = min(engine.model_config.vocab_size, len(tok))
    special = set(getattr(tok, "all_special_ids", [])) | set(engine.eos_token_ids)
    samples = load_samples(args.dataset, sum(counts), args.input_len, args.dataset_seed,
                           vocab, special)
    trunc = args.input_len if args.dataset != "random" else None
    prompts = [token_ids(s, tok, args.chat, trunc) for s in samples]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len,
                            ignore_eos=args.ignore_eos)
    synthetic = args.synthetic_acceptance
    label = args.label or default_label(model, engine.config.draft, engine.spec_block_size,
                                        synthetic, engine.config.speculation_policy,
                                        engine.spec_block_lens)
    if synthetic is not None and "synthetic" not in label.lower():
        label += f" [SYNTHETIC acceptance a={synthetic:g}]"
    layout = layout_label(engine.config.tensor_parallel_size, engine.config.expert_parallel_size)
    if layout and layout not in label:
        label = f"{layout} {label}"
    result = new_result("offline", args, label, synthetic)
    result["config"].update(model=model, concurrency_levels=levels, engine=engine_facts(engine))
    if max(levels) > engine.config.max_num_seqs:
        print(f"[blockspec] note: --max-num-seqs {engine.config.max_num_seqs} caps the running "
              f"batch below C={max(levels)}", file=sys.stderr)
    warm = warmup_prompts(prompts, 2 * max(levels), args.dataset == "random",
                          10_000 + args.dataset_seed, vocab, special)
    run_requests(engine, warm[:1], warmup_params(args, 1)[0], 1, "warmup", show=False)
    start = 0
    for c, n in zip(levels, counts):
        if args.warmup_tokens:
            run_requests(engine, warm[:2 * c], warmup_params(args, c), c, f"warmup{c}",
                         show=False)
        mix, context = engine.step_mix.copy(), context_counters(engine)
        trace = StepTrace() if args.step_trace else None
        records, duration, spec = run_requests(engine, prompts[start:start + n], params, c,
                                               f"c{c}", trace=trace)
        start += n
        level = summarize_level(c, records, duration)
        level["acceptance"] = acceptance_from_spec(spec)
        level["step_mix"] = engine.step_mix.since(mix)
        level["policy_view"] = policy_view(engine, c)
        level["drafter_context"] = {k: round(v - context[k], 6)
                                    for k, v in context_counters(engine).items()}
        if trace is not None:
            level["step_trace"] = trace.summary()
        result["levels"].append(level)
        save_result(args.out, result)
        print(level_line(level), flush=True)
    return result
