"""Arrival counters for kernels whose programs of one output split its reduction and the last
to arrive sums the others' partials in a fixed order (moe_down.py's per-pick down projection,
split_gemv.py): deterministic sums without a second launch."""

from __future__ import annotations

import torch

_LOCKS: dict[torch.device, torch.Tensor] = {}


def arrival_locks(device: torch.device, count: int) -> torch.Tensor | None:
    """`count` zeroed int32 arrival counters on `device` (one buffer per device, grown outside
    graph capture; every launch leaves its counters zero again), or None where a capture would
    have to allocate them (the caller takes its unsplit kernel).

    NOTE: one stream per device runs these kernels (the engine's step stream), each touching
    its counters only after pdl_sync, so launches never overlap on them; two concurrent
    streams would share counters."""
    locks = _LOCKS.get(device)
    if locks is None or locks.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        locks = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _LOCKS[device] = locks
    return locks
