"""Device-side timing for the GPU benchmark scripts (CUDA only): a function's time as one CUDA
graph, the engine's decode-step graph replay, copy bandwidth, and the bytes floor of a decode
step (what it must read at that bandwidth)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from blockspec import LLM
    from blockspec.engine.decode_step import GraphedDecodeStep

__all__ = ["copy_bandwidth", "event_times", "floor_bytes", "free", "graph_ms", "replay_ms"]


def free() -> None:
    """Call after dropping the last reference to an engine."""
    gc.collect()
    torch.cuda.empty_cache()


def event_times(fn: Callable[[], object], iters: int, warmup: int) -> list[float]:
    """Device ms of each of `iters` calls of `fn` (CUDA events around it), after `warmup`."""
    times = []
    for i in range(iters + warmup):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        if i >= warmup:
            times.append(a.elapsed_time(b))
    return times


def graph_ms(fn: Callable[[], object], iters: int = 20) -> float:
    """Median replay time of `fn` captured in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return float(np.median(event_times(g.replay, iters, warmup=3)))


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s (bytes read + written), median of 20 copies of 2 GiB."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    times = sorted(event_times(partial(y.copy_, x), 20, warmup=3))
    del x, y
    free()
    return 2 * (2 << 30) / (times[len(times) // 2] / 1e3)


def floor_bytes(llm: LLM, context: int) -> int:
    """Bytes an AR decode step must read: the target's weights except the embedding table, plus
    the KV cache of one sequence at `context` (bf16)."""
    model = llm.engine.model
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if "embed_tokens" not in n)
    mc = llm.engine.model_config
    kv = 2 * mc.num_hidden_layers * context * mc.num_key_value_heads * mc.head_dim * 2
    return weights + kv


def replay_ms(llm: LLM, n: int, context: int, iters: int = 50,
              graphs: GraphedDecodeStep | None = None) -> float:
    """Median time of one graph replay of the decode step for `n` sequences at `context`
    (`graphs`: a GraphedDecodeStep over the runner's buffers; default, the runner's own)."""
    runner = llm.engine.runner
    graphs = graphs if graphs is not None else runner.graphs
    bufs = runner.bufs
    bufs.block_tables.fill_(runner.trash_block)
    bufs.ctx_lens[:n].fill_(context)
    times = sorted(event_times(lambda: graphs.replay(n), iters, warmup=5))
    return times[len(times) // 2]
