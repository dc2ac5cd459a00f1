"""Start-up step-cost profile for the adaptive speculation policy.

For every block length L (1 = plain decode, plus the speculative ones) and batch size, times the
engine's fixed-shape decode step: CUDA-graph replays timed with CUDA events, or eager calls timed
with perf_counter (CPU, `--enforce-eager`). The batch reads a realistic context
(`profile_context` tokens per sequence) through distinct KV blocks, so attention streams as much
KV as a real batch. A plain step with a drafter also pays its share of the batched
drafter-context write that it defers (`_time_flush`).
NOTE: it runs at engine start, before any request: the blocks it writes are all free, and the
KV written there is overwritten when they are first allocated.

The result is cached in a JSON file keyed by everything that changes step costs: model and
drafter shapes (a hash of their config.json; weights do not change costs), device name, dtype,
KV block size, block lengths, batch buckets, graphs or eager, attention backend, profiled
context, torch version, and the version of the steps themselves (`STEP_VERSION`). A matching
file is loaded instead of measured.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from blockspec.config import EngineConfig
from blockspec.engine.context_staging import STAGING_STEPS
from blockspec.layers.attention import PagedAttention
from blockspec.layers.linear import Linear
from blockspec.policy.cost_model import StepCostModel, profile_key

if TYPE_CHECKING:
    from blockspec.engine.decode_step import GraphedDecodeStep
    from blockspec.engine.model_runner import ModelRunner

GRAPH_WARMUP, GRAPH_ITERS = 2, 8
EAGER_WARMUP, EAGER_ITERS = 1, 3
# NOTE: bump whenever what a profiled step computes changes, so profiles cached with the old
# steps are re-measured. 2: the plain step stages its drafter context, written in batches (its
# share of a batched write is timed with it).
STEP_VERSION = 3
# Eager CPU steps (tests, development): a coarse grid; beyond 16 the model extrapolates.
CPU_BUCKETS = (1, 4, 16)


def model_id(path: str | None) -> str | None:
    """Folder name + hash of its config.json: same shapes, same costs, wherever it lives."""
    if path is None:
        return None
    cfg = Path(path) / "config.json"
    digest = hashlib.sha1(cfg.read_bytes()).hexdigest()[:12] if cfg.is_file() else "?"
    return f"{Path(path).name}@{digest}"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.machine()} {torch.get_num_threads()} threads"


def profile_context(runner: ModelRunner) -> int:
    """Context length the profile times: min(512, max_model_len / 2) on CUDA (64 on CPU, where
    the profile only has to be cheap), leaving room for the max block."""
    cap = 512 if runner.device.type == "cuda" else 64
    return max(0, min(cap, runner.max_model_len // 2, runner.max_model_len - runner.max_block))


def profile_buckets(runner: ModelRunner) -> list[int]:
    if runner.device.type == "cuda":
        return list(runner.buckets)
    top = runner.config.max_num_seqs
    return sorted({b for b in CPU_BUCKETS if b < top} | {min(top, CPU_BUCKETS[-1])})


def cost_key(runner: ModelRunner, config: EngineConfig) -> dict[str, Any]:
    lens = [1, *runner.spec_lens]
    key = profile_key(model_id(config.model_path), device_name(runner.device), runner.dtype,
                      runner.bm.block_size, lens)
    attn = next(m for m in runner.model.modules() if isinstance(m, PagedAttention))
    key.update(draft=model_id(config.draft_path), buckets=profile_buckets(runner),
               graphs=bool(runner.graphs_by_len), attention_backend=attn.backend.name,
               linear_backend=next(m.backend for m in runner.model.modules()
                                   if isinstance(m, Linear)),
               context=profile_context(runner), max_model_len=runner.max_model_len,
               torch=torch.__version__, steps=STEP_VERSION)
    if config.tensor_parallel_size > 1:
        key.update(tensor_parallel_size=config.tensor_parallel_size,
                   expert_parallel_size=config.expert_parallel_size)
    return key


def default_profile_path(key: dict[str, Any]) -> Path:
    cache = Path(os.environ.get("BLOCKSPEC_CACHE", Path.home() / ".cache" / "blockspec"))
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache / "cost_profiles" / f"{digest}.json"


def resolve_profile_path(config: EngineConfig, key: dict[str, Any]) -> Path | None:
    """None: measure and keep in memory only."""
    if config.cost_profile is None:
        # NOTE: cached on CPU too: eager profiling of even the 15.7M demo pair takes seconds,
        # which every `blockspec generate` would pay again.
        return default_profile_path(key)
    if config.cost_profile.strip().lower() in ("", "none"):
        return None
    return Path(config.cost_profile).expanduser()


def _fill_buffers(runner: ModelRunner, n: int, ctx: int) -> None:
    """`n` sequences of `ctx` tokens, each on its own run of KV blocks (wrapping if the cache
    is smaller than the batch's need)."""
    bufs, bs = runner.bufs, runner.bm.block_size
    per_seq = -(-(ctx + runner.max_block) // bs)
    ids = torch.arange(n * per_seq, dtype=torch.int64) % runner.bm.num_blocks
    bufs.block_tables.fill_(runner.trash_block)
    bufs.block_tables[:n, :per_seq].copy_(ids.view(n, per_seq).to(torch.int32))
    bufs.ctx_lens.zero_()
    bufs.ctx_lens[:n].fill_(ctx)
    bufs.last_tokens.fill_(1)
    bufs.uniforms.fill_(1.0)  # synthetic mode: accept nothing (costs do not depend on it)


def replay_seconds(graphs: GraphedDecodeStep, n: int, warmup: int = GRAPH_WARMUP,
                   iters: int = GRAPH_ITERS) -> list[float]:
    """Device seconds (CUDA events) of `iters` replays of `graphs` at batch `n`, after `warmup`."""
    times = []
    for i in range(warmup + iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.replay(n)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return times


def _time_graph(runner: ModelRunner, L: int, n: int) -> float:
    times = replay_seconds(runner.graphs_by_len[L], n)
    return sorted(times)[len(times) // 2]


def _median_seconds(fn: Callable[[], None], cuda: bool,
                    setup: Callable[[], None] | None = None) -> float:
    """Median wall time of `fn` over EAGER_ITERS calls after EAGER_WARMUP (device synchronised
    around each call; `setup` runs before each, untimed)."""
    times = []
    for i in range(EAGER_WARMUP + EAGER_ITERS):
        if setup is not None:
            setup()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i >= EAGER_WARMUP:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _time_eager(runner: ModelRunner, L: int, n: int) -> float:
    return _median_seconds(lambda: runner.steps[L](runner.bufs, n), runner.device.type == "cuda")


def _time_flush(runner: ModelRunner, n: int, ctx: int) -> float:
    """A plain step's share of the batched drafter-context write it defers: one flush of
    STAGING_STEPS * n rows (the staging's refill period at batch n), per step."""
    staging = runner.staging
    rows = min(STAGING_STEPS * n, staging.capacity)
    blocks = [i % runner.bm.num_blocks for i in range(rows)]
    seconds = _median_seconds(staging.flush, runner.device.type == "cuda",
                              setup=lambda: staging.stage_placeholders(blocks, [ctx] * rows))
    return seconds * n / rows


@torch.inference_mode()
def measure_costs(runner: ModelRunner, buckets: list[int], ctx: int) -> StepCostModel:
    """Step time for every (block length, bucket): graph replay where graphs exist."""
    times: dict[int, dict[int, float]] = {}
    try:
        for L in sorted([1, *runner.spec_lens], reverse=True):
            row = times.setdefault(L, {})
            for n in buckets:
                _fill_buffers(runner, n, ctx)
                timer = _time_graph if L in runner.graphs_by_len else _time_eager
                row[n] = timer(runner, L, n)
                if L == 1 and runner.staging is not None:
                    # NOTE: a plain step's drafter context is written later, batched with other
                    # steps' (ContextStaging): its share is part of what the step costs.
                    row[n] += _time_flush(runner, n, ctx)
    finally:
        runner.bufs.block_tables.fill_(runner.trash_block)
        runner.bufs.ctx_lens.zero_()
    return StepCostModel(times)


def _writes_profiles(config: EngineConfig) -> bool:
    """One process writes a profile: rank 0 of a parallel group."""
    if config.tensor_parallel_size == 1:
        return True
    from blockspec.parallel.state import get_state

    return get_state().rank == 0


def load_or_measure_costs(runner: ModelRunner, config: EngineConfig
                          ) -> tuple[StepCostModel, dict[str, Any]]:
    """The cost model and a record of where it came from (for logs and benchmarks)."""
    key = cost_key(runner, config)
    path = resolve_profile_path(config, key)
    info: dict[str, Any] = {"path": str(path) if path else None, "key": key}
    if path is not None:
        try:
            loaded = StepCostModel.load(path, key)
        except (ValueError, OSError, TypeError, AttributeError, KeyError) as e:
            print(f"[blockspec] ignoring unreadable cost profile {path}: {e}", file=sys.stderr)
            loaded = None
        if config.tensor_parallel_size > 1:
            # NOTE: measuring runs collectives: every rank measures, or none does
            from blockspec.parallel.state import broadcast_command, every_rank

            loaded = broadcast_command(loaded) if every_rank(loaded is not None) else None
        if loaded is not None:
            info.update(measured=False, seconds=0.0, times=loaded.to_json()["times"])
            print(f"[blockspec] step-cost profile loaded from {path}", file=sys.stderr)
            return loaded, info
    t0 = time.perf_counter()
    model = measure_costs(runner, key["buckets"], key["context"])
    if config.tensor_parallel_size > 1:  # NOTE: every rank's policy prices by rank 0's times
        from blockspec.parallel.state import broadcast_command

        model = broadcast_command(model)
    secs = time.perf_counter() - t0
    info.update(measured=True, seconds=secs, times=model.to_json()["times"])
    where = "not saved"
    if path is not None and _writes_profiles(config):
        try:
            model.save(path, key)
            where = f"saved to {path}"
        except OSError as e:
            where = f"not saved ({e})"
    print(f"[blockspec] step-cost profile measured in {secs:.1f} s ({len(key['block_lens'])} "
          f"block lengths x {len(key['buckets'])} batch sizes, context {key['context']}); "
          f"{where}", file=sys.stderr)
    return model, info
