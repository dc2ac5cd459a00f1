"""A GEMV over few output rows split along K: y [1, N] = x [1, K] @ w [N, K]^T for a MoE
router's fp32 weight (64-384 experts), where two rows a program leave most SMs idle (Kimi
K2.6's 384 x 7168: 192 programs, each streaming 57 KB one tile after another).

Programs (row block, split) each sum their K slice; the last of a row block's programs to
arrive (arrival.py's counters) adds the splits' partials in split order and stores the rows,
so the result does not depend on timing and one launch does it all. Products and sums are
fp32 whatever the operands' dtypes, like linear.gemv.
"""

from __future__ import annotations

import torch

from blockspec.layers.arrival import _last_to_arrive, arrival_locks
from blockspec.layers.fused import _cast, _jit, tl, triton
from blockspec.layers.linear import _rows_span_sum
from blockspec.layers.pdl import pdl_args

MAX_SPLITS = 8


@_jit
def _split_gemv_kernel(x_ptr, w_ptr, y_ptr, part_ptr, lock_ptr, N, K, K_SPLIT,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_PDL: tl.constexpr = False):
    # NOTE: K_SPLIT % BLOCK_K == 0 and K % K_SPLIT == 0 (split_config): no column masks.
    block, split = tl.program_id(0), tl.program_id(1)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    part = _rows_span_sum(w_ptr + rows[:, None].to(tl.int64) * K, x_ptr, rmask, split * K_SPLIT,
                          (split + 1) * K_SPLIT, BLOCK_K, USE_PDL)
    tl.store(part_ptr + split * N + rows, part, mask=rmask)
    lock = lock_ptr + block
    splits = tl.num_programs(1)
    if _last_to_arrive(lock, splits):
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for s in range(splits):
            total += tl.load(part_ptr + s * N + rows, mask=rmask, other=0.0, cache_modifier=".cg")
        tl.store(y_ptr + rows, _cast(total, y_ptr.dtype.element_ty), mask=rmask)
        tl.atomic_xchg(lock, 0)


def split_config(n: int, k: int, block_n: int = 2, block_k: int = 512) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, splits): K's block_k-wide chunks shared by the most splits up to
    MAX_SPLITS that divide them evenly (1 where block_k does not divide K)."""
    chunks = k // block_k if k % block_k == 0 else 0
    splits = max([s for s in range(1, MAX_SPLITS + 1) if chunks and chunks % s == 0] or [1])
    return block_n, block_k, splits


def split_gemv(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
               config: tuple[int, int, int] | None = None) -> torch.Tensor | None:
    """x [1, K] @ w [N, K]^T -> [1, N] in `out_dtype` (x's by default), or None where it does
    not apply (K not in whole chunks, one split, or counters a graph capture would allocate):
    the caller takes linear.gemv."""
    m, k = x.shape
    n = w.shape[0]
    bn, bk, splits = config or split_config(n, k)
    blocks = triton.cdiv(n, bn)
    if m != 1 or splits < 2 or k % (splits * bk) or w.shape[1] != k or not w.is_contiguous() \
            or x.stride(1) != 1:
        return None
    locks = arrival_locks(x.device, blocks)
    if locks is None:
        return None
    part = torch.empty(splits, n, dtype=torch.float32, device=x.device)
    y = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    _split_gemv_kernel[(blocks, splits)](x, w, y, part, locks, n, k, k // splits, BLOCK_N=bn,
                                         BLOCK_K=bk, num_warps=4, enable_fp_fusion=False,
                                         **pdl_args(x.device))
    return y
