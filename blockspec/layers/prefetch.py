"""L2 prefetch hints for the decode GEMVs: bytes a program reads a few iterations later,
requested now without holding registers (`cp.async.bulk.prefetch.L2`, sm_90).

The int4 expert loops wait on global loads more than half the time with the register file
full (docs/benchmarks.md, "MoE targets"): a register prefetch halves the programs an SM and a
shared-memory pipeline caps them too, while a prefetch into L2 holds nothing in the SM and
turns the next loads into L2 hits. A hint changes no value, so the interpreter, CPUs and GPUs
before sm_90 skip it (`prefetch_distance` returns 0 there).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: no Triton kernels
    triton = tl = None

_jit = triton.jit if triton is not None else (lambda fn: fn)


def prefetch_distance(device: torch.device, chunks: int, row_bytes: int) -> int:
    """The chunks a GEMV loop prefetches ahead on `device`: `chunks` where the hint exists
    (CUDA sm90+, not the interpreter, rows 16-byte aligned as the bulk prefetch needs; off with
    BLOCKSPEC_PREFETCH=0), else 0."""
    if chunks <= 0 or device.type != "cuda" or row_bytes % 16:
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("BLOCKSPEC_PREFETCH") == "0":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return chunks if torch.cuda.get_device_capability(index)[0] >= 9 else 0


@_jit
def _prefetch_line(addr, ok):
    """Asks L2 for the line holding each address of addr (int64) where ok."""
    tl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        constraints="=r,l,r", args=[addr, ok.to(tl.int32)], dtype=tl.int32, is_pure=False,
        pack=1)


@_jit
def _prefetch_chunks(row_ptrs, ok, first, COUNT: tl.constexpr, row_bytes,
                     CHUNK_BYTES: tl.constexpr, PF: tl.constexpr):
    """Prefetches chunks first..first+COUNT-1 of CHUNK_BYTES each (cut at row_bytes) from the
    rows that start at row_ptrs [R, 1] (pointers of any type) where ok [R, 1]: one 128-byte
    line an element of [R, lines]; nothing where PF is 0."""
    if PF > 0:
        LINES: tl.constexpr = (COUNT * CHUNK_BYTES + 127) // 128
        offs = first * CHUNK_BYTES + tl.arange(0, LINES) * 128
        _prefetch_line(row_ptrs.to(tl.int64) + offs[None, :].to(tl.int64),
                       ok & (offs < row_bytes)[None, :])
