"""Weights asked of L2 ahead of their kernels, from a side stream, while the step's latency-bound
kernels leave HBM idle.

A MoE layer's batch-1 step alternates between kernels that stream weights (the input
projections, o_proj, the experts) and kernels that read next to nothing and wait on latency
(the rope / latent norm, attention over a short latent cache, the absorbs, the norms, the
router, the top-k): ~20 us a Moonlight layer in which HBM is idle. The weights read after that
window but known before it (o_proj, the router, the shared experts) can be read into L2 during
it, so that their kernels read L2 and the shared experts no longer take HBM bandwidth from the
routed ones. One kernel on the side stream (layers/side_stream.py: `start_beside`) asks for them
(`prefetch.global.L2`, one 128-byte line an element: "lines"; or `cp.async.bulk.prefetch.L2`,
one 16 KB chunk an element: "bulk"), holds no registers for the data and writes nothing.

`BLOCKSPEC_L2_PREFETCH=off|lines|bulk` picks the form (off by default); `lines+next` /
`bulk+next` also ask for the next layer's input projections once the shared experts are done
(`prefetch_next`, on the side stream, while the routed experts' down projection reads below
copy bandwidth). CUDA sm90+ only (the interpreter and CPUs cannot run the PTX). The hint
changes no value.

NOTE (what keeps it useful): the prefetched bytes must still be in L2 when read, so only a
layer's own weights read within the same window are asked for, and only as many as fit
`l2_budget` (60% of L2: Moonlight's 26 MB a layer on an H200's 50 MB; of the Kimi width's
o_proj, router and shared experts, 216 MB, only the router); none would last across the routed
experts' ~100 MB that stream after.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from blockspec.layers.fused import _jit, tl, triton
from blockspec.layers.side_stream import start_beside

MODES = ("off", "lines", "bulk", "lines+next", "bulk+next")
LINE_BYTES = 128
BULK_BYTES = 16384
# per mode: (bytes a piece, pieces a program asks for at once: 4 lines or 1 chunk a thread)
PIECES = {"lines": (LINE_BYTES, 512), "bulk": (BULK_BYTES, 128)}
SEGMENTS = 4  # tensors a launch covers (a layer asks for up to four)
_PROGRAMS = 16  # programs a tensor: enough to issue the requests, few enough to sit beside
L2_FRACTION = 0.6


def l2_budget(device: torch.device) -> int:
    """Bytes a layer may ask L2 for on `device`: L2_FRACTION of its L2 (CUDA), else 0."""
    if device.type != "cuda":
        return 0
    return int(L2_FRACTION * torch.cuda.get_device_properties(device).L2_cache_size)


def _askable(t: torch.Tensor) -> bool:
    """Whether a launch can ask for t: contiguous, 16-byte aligned (the bulk form's rule)."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def plan_prefetch(weights: Sequence, budget: int) -> tuple[torch.Tensor, ...]:
    """The tensors among `weights` (anything else, None, is skipped) a launch can ask for, in
    order, each kept while the kept ones' bytes stay within `budget`. NOTE: a quantized
    module's weight is its packed values (its scales are not asked for)."""
    kept, total = [], 0
    for t in weights:
        if not isinstance(t, torch.Tensor) or not _askable(t):
            continue
        size = t.numel() * t.element_size()
        if total + size <= budget:
            kept.append(t.detach())
            total += size
    return tuple(kept)


def l2_prefetch_mode(device: torch.device) -> str:
    """The form in use on `device`: BLOCKSPEC_L2_PREFETCH where CUDA sm90+ can run it, else
    "off". Raises on an unknown value."""
    mode = os.environ.get("BLOCKSPEC_L2_PREFETCH", "off")
    if mode not in MODES:
        raise ValueError(f"BLOCKSPEC_L2_PREFETCH={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "off" or device.type != "cuda" or triton is None:
        return "off"
    return mode if _sm90(device.index if device.index is not None else
                         torch.cuda.current_device()) else "off"


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@_jit
def _ask_lines(addr, ok):
    """L2, fetch the 128-byte line holding each address where ok (no value comes back)."""
    tl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        constraints="=r,l,r", args=[addr, ok.to(tl.int32)], dtype=tl.int32, is_pure=False,
        pack=1)


@_jit
def _ask_bulk(addr, nbytes):
    """L2, fetch nbytes (a multiple of 16; none where <= 0) from each 16-byte aligned address."""
    tl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.gt.s32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        constraints="=r,l,r", args=[addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@_jit
def _span(base, size, record_ptr, UNIT: tl.constexpr, BULK: tl.constexpr, EACH: tl.constexpr,
          RECORD: tl.constexpr):
    """Every UNIT-byte piece of [base, base + size) asked for by one of this axis's programs
    (or, with RECORD, marked 1 in record_ptr's [size / UNIT] bytes: the tests' stand-in)."""
    step = tl.num_programs(0) * EACH * UNIT
    for start in range(tl.program_id(0) * EACH * UNIT, size, step):
        offs = start + tl.arange(0, EACH).to(tl.int64) * UNIT
        ok = offs < size
        if RECORD:
            tl.store(record_ptr + offs // UNIT, tl.full([EACH], 1, tl.int8), mask=ok)
        elif BULK:
            _ask_bulk(base + offs, tl.where(ok, tl.minimum(size - offs, UNIT), 0).to(tl.int32))
        else:
            _ask_lines(base + offs, ok)


@_jit
def _l2_prefetch_kernel(a0, n0, a1, n1, a2, n2, a3, n3, r0, r1, r2, r3, UNIT: tl.constexpr,
                        BULK: tl.constexpr, EACH: tl.constexpr, RECORD: tl.constexpr = False):
    # NOTE: no PDL wait: nothing here reads what a kernel writes, and the launch is the side
    # stream's, ordered after the main stream's work by an event.
    seg = tl.program_id(1)
    if seg == 0:
        _span(a0, n0, r0, UNIT, BULK, EACH, RECORD)
    elif seg == 1:
        _span(a1, n1, r1, UNIT, BULK, EACH, RECORD)
    elif seg == 2:
        _span(a2, n2, r2, UNIT, BULK, EACH, RECORD)
    else:
        _span(a3, n3, r3, UNIT, BULK, EACH, RECORD)


def _launch_args(tensors: Sequence[torch.Tensor]) -> list[int]:
    """(address, bytes) of each tensor (whole 16-byte multiples), padded with empty spans."""
    if len(tensors) > SEGMENTS:
        raise ValueError(f"l2_prefetch: at most {SEGMENTS} tensors a launch, got {len(tensors)}")
    args: list[int] = []
    for t in tensors:
        if not _askable(t):
            raise ValueError("l2_prefetch: tensors must be contiguous and 16-byte aligned")
        args += [t.data_ptr(), t.numel() * t.element_size() // 16 * 16]
    return args + [0, 0] * (SEGMENTS - len(tensors))


def launch_l2_prefetch(tensors: Sequence[torch.Tensor], mode: str,
                       record: list[torch.Tensor] | None = None) -> None:
    """One launch asking L2 for `tensors` (up to four) on the current stream. `record` (tests,
    the interpreter): int8 buffers of ceil(bytes / unit) each, set to 1 where a piece would be
    asked for, instead of asking."""
    if mode not in PIECES:
        raise ValueError(f"l2_prefetch: mode {mode!r}")
    unit, each = PIECES[mode]
    args = _launch_args(tensors)
    recs = list(record or [])
    # NOTE: never written (RECORD off, or a segment without a tensor); int8 as the records,
    # so one compiled kernel serves every dtype
    recs += [tensors[0].reshape(-1).view(torch.int8)] * (SEGMENTS - len(recs))
    _l2_prefetch_kernel[(_PROGRAMS, SEGMENTS)](*args, *recs, UNIT=unit, BULK=mode == "bulk",
                                               EACH=each, RECORD=record is not None,
                                               num_warps=4)


def prefetch_beside(tensors: Sequence[torch.Tensor], like: torch.Tensor) -> None:
    """Asks L2 for `tensors` from the side stream of `like`'s device, after what the current
    stream has queued (a no-op where the mode is off or there are none); joined with the side
    stream's next join (side_stream.join_beside at the latest)."""
    mode = l2_prefetch_mode(like.device) if tensors else "off"
    if mode != "off":
        form = mode.split("+")[0]
        start_beside(lambda: launch_l2_prefetch(tensors, form), like.device)


def prefetch_next(tensors: Sequence[torch.Tensor], like: torch.Tensor) -> None:
    """Asks L2 for `tensors` (the next layer's weights) on the current stream, where the mode
    says `+next`; called from work already beside (MoE's shared experts)."""
    mode = l2_prefetch_mode(like.device) if tensors else "off"
    if mode.endswith("+next"):
        launch_l2_prefetch(tensors, mode.split("+")[0])
