"""Where a mixed step's time goes (issue 20's ITL tail): a step of decoding sequences verifying
blocks beside an arriving prompt's chunk, taken apart into its drafts, its flat forward (graph
replay per token bucket, extra buckets captured here) and the rest, with a kernel profile of the
forward. The sequences are brought to that state through the engine itself; the step is then
run repeatedly without committing (the same K/V slots are rewritten each time)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from blockspec import LLM, SamplingParams
from blockspec.bench.gpu_timing import event_times
from blockspec.engine.flat_batch import FlatBatch
from blockspec.engine.flat_step import GraphedFlatStep, flat_buckets, short_query_len
from blockspec.engine.kv_cache import BlockManager
from blockspec.engine.scheduler import Scheduler
from blockspec.engine.sequence import Sequence

__all__ = ["MixedState", "host_state", "kernel_table", "launch_floor_us", "mixed_state",
           "time_ms"]

BLOCK, PROMPT = 8, 512


def host_state(decoding: int, waiting: int, seed: int = 0) -> tuple[Scheduler, BlockManager]:
    """A scheduler (no model) with `decoding` sequences past their PROMPT-token prompts and
    `waiting` new prompts, its token budget 8192 and the engine's flat buckets."""
    rng = np.random.default_rng(seed)
    bm = BlockManager(8192, 16, enable_prefix_caching=False)
    sched = Scheduler(bm, 256, 1 << 20, BLOCK - 1, None, flat_buckets(8192))
    params = SamplingParams(max_tokens=256, ignore_eos=True)
    for i in range(decoding):
        sched.add(Sequence(f"d{i}", rng.integers(5, 1000, PROMPT).tolist(), params, 256))
    out = sched.schedule()  # every prompt at once (a budget of 1M tokens)
    for s, n in zip(out.seqs, out.num_new_tokens):
        s.num_computed_tokens += n
        s.output_token_ids.append(7)
    sched.max_num_batched_tokens = 8192
    for i in range(waiting):
        sched.add(Sequence(f"w{i}", rng.integers(5, 1000, PROMPT).tolist(), params, 256))
    return sched, bm


class MixedState:
    """`decoding` sequences past their prompts and one arriving prompt, as the scheduler puts
    them in one step."""

    def __init__(self, llm: LLM, seqs: list[Sequence], num_new: list[int]) -> None:
        self.llm, self.seqs, self.num_new = llm, seqs, num_new
        self.runner = llm.engine.runner
        self.decoding = [s for s, n in zip(seqs, num_new) if n == 1]

    def batch(self, width: int, prefill: int | None = None) -> tuple[FlatBatch, list[int]]:
        """The flat batch at blocks of `width`, its prompt chunk cut to `prefill` tokens."""
        num_new = [n if n == 1 or prefill is None else min(n, prefill) for n in self.num_new]
        blens = [width if n == 1 else 0 for n in self.num_new]
        return FlatBatch.build(self.seqs, num_new, blens, width, self.runner.bm), blens

    def drafts(self, width: int) -> torch.Tensor:
        return self.runner.block_drafts(self.decoding, width)

    def whole_step(self, width: int, synthetic: float) -> None:
        blens = [width if n == 1 else 0 for n in self.num_new]
        r = self.runner
        r.mixed(self.seqs, self.num_new, blens, True, synthetic, r.flat, r.block_drafts)

    def decode_step(self, width: int, synthetic: float) -> None:
        r = self.runner
        r.decoder(self.decoding, r.steps[width], r.graphs_by_len.get(width), synthetic, False)


def mixed_state(llm: LLM, prompts: list[list[int]], decoding: int) -> MixedState:
    """The first `decoding` prompts prefilled and decoding (the engine's own steps), the next
    one waiting; the step the scheduler then makes (a prefill chunk beside the decodes)."""
    eng = llm.engine
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    for ids in prompts[:decoding]:
        eng.add_request(ids, params, stream=False, output_kind="final_only")
    while eng.scheduler.waiting or any(not s.output_token_ids for s in eng.scheduler.running):
        eng.step()
    eng.add_request(prompts[decoding], params, stream=False, output_kind="final_only")
    out = eng.scheduler.schedule()
    return MixedState(llm, out.seqs, out.num_new_tokens)


def time_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median wall time of `fn` followed by a device sync."""
    times = []
    for i in range(iters + warmup):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def replay_ms(graphs: GraphedFlatStep, bucket: int, short: int, iters: int = 20) -> float:
    """Median device time of one replay of the flat step's graph (buffers as filled)."""
    return float(np.median(event_times(lambda: graphs.replay(bucket, short), iters, warmup=3)))


def bucket_curve(state: MixedState, width: int, buckets: list[int],
                 extra: GraphedFlatStep | None) -> dict[int, float]:
    """Replay ms of each bucket, its prompt chunk cut so the batch fills it."""
    flat = state.runner.flat
    out = {}
    for b in buckets:
        verify = width * len(state.decoding)
        batch, _ = state.batch(width, prefill=max(b - verify, 1))
        flat.bufs.fill(batch, flat.trash_slot, write_context=True)
        flat.bufs.place_drafts(batch, state.drafts(width))
        graphs = flat.graphs if b in flat.graphs.buckets else extra
        out[b] = replay_ms(graphs, b, short_query_len(width))
    return out


def kernel_table(fn: Callable[[], object], iters: int = 5, top: int = 30) -> dict:
    """Device time per kernel name per call of `fn` (run eagerly: a graph's kernels are the
    same), largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key[:90], e.device_time_total / iters, e.count // iters)
            for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    return {"us_per_call": sum(r[1] for r in rows),
            "top": [{"kernel": k, "us": round(t, 1), "calls": c} for k, t, c in rows[:top]]}


def launch_floor_us(n: int = 500) -> float:
    """Device time per kernel of a graph of `n` dependent one-element kernels: what each
    kernel of a step costs before it moves a byte."""
    x = torch.zeros(1, device="cuda")

    def chain() -> None:
        for _ in range(n):
            x.add_(1.0)

    from blockspec.bench.gpu_timing import graph_ms

    return 1e3 * graph_ms(chain) / n


def attention_variants(variants: dict[str, dict], decoding: int = 30, width: int = BLOCK,
                       bucket: int = 768, layers: int = 36) -> dict[str, dict[str, float]]:
    """Device ms per layer of the flat step's two attention launches (the verify blocks' short
    one and the prefill chunk's long one) for the C=32 mixed step's metadata, per variant:
    TritonAttentionBackend keyword arguments, plus "short_flat": False for a grid of one tile
    per lane for the short launch ("long_flat" likewise). Random K/V in 4 caches rotated over
    `layers` calls."""
    import dataclasses

    from blockspec.bench.gpu_timing import graph_ms
    from blockspec.engine.flat_step import FlatBuffers, flat_metadata
    from blockspec.layers.triton_attention import _MAX_Q, TritonAttentionBackend

    sched, bm = host_state(decoding, 1)
    out = sched.schedule(budget_lookahead=width - 1)
    blens = [width if n == 1 else 0 for n in out.num_new_tokens]
    batch = FlatBatch.build(out.seqs, out.num_new_tokens, blens, width, bm)
    dev = torch.device("cuda")
    bufs = FlatBuffers.allocate(2048, 257, 64, dev)
    bufs.fill(batch, bm.num_blocks * bm.block_size, write_context=True)
    short = short_query_len(width)
    meta = flat_metadata(bufs, bucket, 257, short, 1024)
    shape = (bm.num_blocks + 1, bm.block_size, 8, 128)
    caches = [(torch.randn(shape, dtype=torch.bfloat16, device=dev),
               torch.randn(shape, dtype=torch.bfloat16, device=dev)) for _ in range(4)]
    q = torch.randn(bucket, 32, 128, dtype=torch.bfloat16, device=dev)
    o = torch.empty_like(q)
    res = {}
    for name, kw in variants.items():
        kw = dict(kw)
        m_short = dataclasses.replace(meta, flat_grid=kw.pop("short_flat", True))
        m_long = dataclasses.replace(meta, flat_grid=kw.pop("long_flat", True))
        be = TritonAttentionBackend(**kw)

        def run(m, max_q: int, q_range: tuple[int, int], be=be) -> None:
            for i in range(layers):
                k, v = caches[i % len(caches)]
                be._launch(q, k, v, o, m, 128 ** -0.5, max_q, q_range)

        res[name] = {
            "short_ms": graph_ms(lambda m=m_short: run(m, short, (0, short))) / layers,
            "long_ms": graph_ms(lambda m=m_long: run(m, bucket, (short, _MAX_Q))) / layers}
        print(f"attention {name}: {res[name]}")
    return res
