"""Programmatic dependent launch (PDL, Hopper and newer) for the decode step's Triton kernels.

A batch-1 step is a chain of a few hundred small kernels; in a CUDA graph each dependent
boundary costs ~1.3 us on an H200 (docs/benchmarks.md, "MoE targets"): the next grid launches
and its programs reach the GPU only once the previous grid has drained. Launched with PDL, a
kernel's programs start while the previous kernel finishes and wait at `griddepcontrol.wait`
until its writes are visible.

NOTE (the invariant every kernel that takes USE_PDL keeps): `pdl_sync` runs before the
program's first store and its first load of anything a kernel writes (only weights, which no
kernel writes, may load before it: the GEMV's first tile, the absorbs' weight tiles), so a
kernel never races its predecessor; and since a kernel's wait returns only once its predecessor
has completed, whose own wait returned only once *its* predecessor had, the order is transitive
along the stream. Kernels without PDL (cuBLAS, torch ops) run in plain stream order.

`BLOCKSPEC_PDL=0` turns it off (on by default on compute capability 9.0 and up, with a Triton
that has it).
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: no Triton kernels, nothing to launch
    triton = tl = None

_jit = triton.jit if triton is not None else (lambda fn: fn)


@functools.cache
def _capable(index: int) -> bool:
    """sm90+, and a Triton with grid-dependency control (3.3 and later: older ones would
    refuse the `launch_pdl` keyword)."""
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    return hasattr(cuda, "gdc_wait") and torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA, sm90+ (and Triton 3.3+), not turned
    off by BLOCKSPEC_PDL=0."""
    if device.type != "cuda" or os.environ.get("BLOCKSPEC_PDL", "1") == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(device: torch.device) -> dict:
    """Launch keywords for a kernel with a USE_PDL constexpr: the flag, and Triton's
    `launch_pdl` where it is on (CPU and the interpreter never see that keyword)."""
    if pdl_enabled(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@_jit
def pdl_sync(USE_PDL: tl.constexpr):
    """Wait for the previous kernel's writes, then let the next kernel's programs launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
