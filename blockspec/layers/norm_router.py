"""A MoE layer's input RMSNorm (with the residual add) folded into its router's split GEMV, at
one row:

    r = h + residual (rounded),  x = w_norm * round(r * rstd(r)) (rounded),  logits = W x (fp32)

A batch-1 step otherwise runs the post-attention norm as its own kernel (one program) between
o_proj and the router. Here each program of split_gemv's grid (row block, K split) sums the
squares of the whole row r itself (K <= 8192 values, read from L2), normalises its K slice's
chunks as fused._norm_store rounds them and streams its router rows over them; the programs of
row block 0 also write their slice of r (the new residual) and of x (what the experts read).
The last program of a row block to arrive adds the splits' partials in split order, as
split_gemv does. So the logits equal fused_add_rms_norm + split_gemv (bit for bit under the
interpreter) and x, r equal the norm's outputs.
"""

from __future__ import annotations

import os

import torch

from blockspec.layers.arrival import arrival_locks
from blockspec.layers.fused import _cast, _jit, _residual_sum, tl, triton
from blockspec.layers.norm_gemv import MAX_K, NormedInput, _normed_chunk
from blockspec.layers.pdl import pdl_args, pdl_sync
from blockspec.layers.split_gemv import _store_split, split_config


@_jit
def _norm_split_gemv_kernel(h_ptr, res_ptr, nw_ptr, w_ptr, y_ptr, x_ptr, new_res_ptr, part_ptr,
                            lock_ptr, N, K, K_SPLIT, eps, HAS_RES: tl.constexpr,
                            ROW_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    # NOTE: K_SPLIT % BLOCK_K == 0 and K % K_SPLIT == 0 (split_config): no column masks; the
    # first weight tile loads before the PDL wait (no kernel writes weights).
    block, split = tl.program_id(0), tl.program_id(1)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    base = w_ptr + rows[:, None].to(tl.int64) * K
    k_lo = split * K_SPLIT
    cols = k_lo + tl.arange(0, BLOCK_K)
    w = tl.load(base + cols[None, :], mask=rmask[:, None], other=0.0)
    pdl_sync(USE_PDL)
    dtype = h_ptr.dtype.element_ty
    offs = tl.arange(0, ROW_BLOCK)
    r = _residual_sum(h_ptr, res_ptr, new_res_ptr, offs, offs < K, dtype, HAS_RES, False)
    rstd = tl.math.rsqrt(tl.sum(r * r, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_lo, k_lo + K_SPLIT, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        if k0 != k_lo:
            w = tl.load(base + cols[None, :], mask=rmask[:, None], other=0.0)
        x = _normed_chunk(h_ptr, res_ptr, nw_ptr, cols, rstd, dtype, HAS_RES)
        if block == 0:  # NOTE: row block 0's splits cover K once: the outputs, written once
            tl.store(x_ptr + cols, _cast(x, dtype))
            _residual_sum(h_ptr, res_ptr, new_res_ptr, cols, cols >= 0, dtype, HAS_RES, True)
        acc += w.to(tl.float32) * x[None, :]
    _store_split(tl.sum(acc, axis=1), part_ptr, y_ptr, lock_ptr + block, rows, rmask, N,
                 BLOCK_N)


MAX_PROGRAMS = 256  # each program sums the whole row's squares: their L2 reads, bounded
MAX_BLOCK_N = 8


def router_config(n: int, k: int) -> tuple[int, int, int]:
    """split_gemv's (BLOCK_N, BLOCK_K, splits) for the router (its 512-wide chunks from K =
    1024 on; narrower below, so that even a tiny model's router splits), with more rows a
    program where the grid would pass MAX_PROGRAMS: every program reads the whole row pair
    (h, residual) for its sum of squares, which at Kimi's 384 x 7168 and two rows a program
    (1344 programs of 28 KB) would be 3.5x the router's own bytes. NOTE: a row's sum does not
    depend on BLOCK_N (rows are summed apart)."""
    bn, bk, splits = split_config(n, k, block_k=min(512, max(16, triton.next_power_of_2(k) // 2)))
    while bn < MAX_BLOCK_N and triton.cdiv(n, bn) * splits > MAX_PROGRAMS:
        bn *= 2
    return bn, bk, splits


def folds_router(h: torch.Tensor, norm_weight: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether norm_router takes RMSNorm(norm_weight) of h into the router weight w: one row
    (K <= MAX_K) on a GPU or under the interpreter, the norm weight in h's dtype, an fp32
    contiguous router whose K splits over two programs or more."""
    k = h.shape[-1]
    if h.numel() != k or k > MAX_K or norm_weight.dtype != h.dtype or w.dtype != torch.float32 \
            or not w.is_contiguous() or w.shape[1] != k or triton is None:
        return False
    return (h.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") \
        and router_config(w.shape[0], k)[2] >= 2


def norm_router(inp: NormedInput, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(fp32 logits [1, N] of w over x, x [1, K] = rms_norm(inp.h + inp.residual)), writing
    inp.h + inp.residual into inp.new_residual; None where the arrival counters a graph
    capture would allocate are not at hand (the caller runs the norm and the router apart)."""
    k, n = inp.h.shape[-1], w.shape[0]
    if not folds_router(inp.h, inp.weight, w):
        raise ValueError(f"norm_router: unsupported shapes h {tuple(inp.h.shape)}, "
                         f"w {tuple(w.shape)} {w.dtype}")
    bn, bk, splits = router_config(n, k)
    blocks = triton.cdiv(n, bn)
    locks = arrival_locks(inp.h.device, blocks)
    if locks is None:
        return None
    h = inp.h.reshape(1, k).contiguous()
    res = inp.residual.reshape(1, k).contiguous() if inp.residual is not None else h
    part = torch.empty(splits, n, dtype=torch.float32, device=h.device)
    y = torch.empty(1, n, dtype=torch.float32, device=h.device)
    x = torch.empty_like(h)
    _norm_split_gemv_kernel[(blocks, splits)](
        h, res, inp.weight, w, y, x, inp.new_residual, part, locks, n, k, k // splits, inp.eps,
        HAS_RES=inp.residual is not None, ROW_BLOCK=triton.next_power_of_2(k), BLOCK_N=bn,
        BLOCK_K=bk, num_warps=4, enable_fp_fusion=False, **pdl_args(h.device))
    return y, x
