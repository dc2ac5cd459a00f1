"""Arrival counters for kernels whose programs of one output split its reduction and the last
to arrive sums the others' partials in a fixed order (moe_down.py's per-pick down projection,
split_gemv.py): deterministic sums without a second launch."""

from __future__ import annotations

import torch

from blockspec.layers.fused import _jit, tl

_LOCKS: dict[torch.device, torch.Tensor] = {}


def arrival_locks(device: torch.device, count: int) -> torch.Tensor | None:
    """`count` zeroed int32 arrival counters on `device` (one buffer per device, grown outside
    graph capture; every launch leaves its counters zero again), or None where a capture would
    have to allocate them (the caller takes its unsplit kernel).

    NOTE: one stream per device runs these kernels (the engine's step stream), each touching
    its counters only after pdl_sync, so launches never overlap on them; two concurrent
    streams would share counters (side_stream.py's work beside launches none)."""
    locks = _LOCKS.get(device)
    if locks is None or locks.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        locks = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _LOCKS[device] = locks
    return locks


@_jit
def _last_to_arrive(lock, count):
    """Whether this program is the last of `count` to arrive at counter `lock`, once each has
    stored its partial. NOTE: every thread's stores precede the one thread's release (acq_rel)
    of the counter; the last arrival's acquire orders its reads after every other release, and
    those reads should skip L1 (.cg), which an earlier launch may have filled at the same
    addresses. The last arrival resets the counter (tl.atomic_xchg(lock, 0)) when done."""
    tl.debug_barrier()
    return tl.atomic_add(lock, 1, sem="acq_rel") == count - 1
