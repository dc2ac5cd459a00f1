"""Work beside the current CUDA stream, joined where its result is used.

A MoE layer's shared experts depend only on the layer's input, while the routed experts first
route (a router GEMV and a top-k: small latency-bound launches) and then run their gate_up
projection; the shared experts' output is needed only by the routed down projection, which
adds it (its `residual`). On a second stream the shared MLP runs beside that chain instead of
before it, as SGLang overlaps its shared experts; in a CUDA graph the two streams become two
branches, joined before the down projection.

NOTE (memory): the result is allocated on the side stream and freed on the current one; the
caching allocator hands a block back only to the stream it was allocated on, and the side
stream's next work waits for the current stream first (`run_beside`), so a freed result is
never overwritten while still being read. The input is read on the side stream while the
current stream holds it until after the join.

NOTE (joins): side work is joined by the result that needs it (`Pending.wait`) before the
step's end: a graph capture fails on an unjoined stream.

NOTE (counters): work beside must launch no kernel with arrival counters (arrival.py: the
router's split GEMV, the opt-in split down projection), whose one buffer a device's kernels
share one launch at a time; a shared MLP's GEMVs have none.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


class Pending:
    """A tensor computed on the side stream; `wait()` joins the side stream into the stream
    that started it (once) and returns the tensor."""

    def __init__(self, value: torch.Tensor, side: torch.cuda.Stream,
                 main: torch.cuda.Stream) -> None:
        self.value, self.side, self.main = value, side, main
        self.joined = False

    def wait(self) -> torch.Tensor:
        if not self.joined:
            self.main.wait_stream(self.side)
            self.joined = True
        return self.value


# A residual the routed experts add: a tensor, one still being computed beside, or none.
Residual = torch.Tensor | Pending | None


def resolve(value: Residual) -> torch.Tensor | None:
    """The tensor itself, or a Pending's once joined."""
    return value.wait() if isinstance(value, Pending) else value


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """One side stream per device, created outside graph capture (None inside it before the
    first: the caller runs the work inline)."""
    stream = _STREAMS.get(device)
    if stream is None and not torch.cuda.is_current_stream_capturing():
        stream = _STREAMS[device] = torch.cuda.Stream(device)
    return stream


def run_beside(fn: Callable[[torch.Tensor], torch.Tensor],
               x: torch.Tensor) -> torch.Tensor | Pending:
    """fn(x) on the device's side stream, after everything the current stream has queued: a
    Pending whose wait() the caller must reach (a graph capture fails on an unjoined stream).
    Off CUDA, fn(x)."""
    side = _side_stream(x.device) if x.is_cuda else None
    if side is None:
        return fn(x)
    main = torch.cuda.current_stream(x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        value = fn(x)
    return Pending(value, side, main)
