"""A layer's input RMSNorm (with the residual add) folded into the GEMV that is its only reader,
at one row:

    r = h + residual (rounded),  x = w_norm * round(r * rstd(r)) (rounded),  y = W x

A batch-1 step otherwise launches the norm as its own kernel (one program, ~2 us on an H200,
plus a kernel boundary) before the layer's first projection. Here every GEMV program first sums
the squares of the whole row r (K <= 8192 values in one block, read from L2; program 0 also
writes r, the new residual), then streams its weight rows as linear.gemv does, normalising each
input chunk as fused._norm_store rounds it. So y equals fused_add_rms_norm + gemv up to the
fp32 order of the sum of squares (bit for bit under the interpreter).

`NormedInput` carries the unnormalised input to the projection (models pass it where the
attention says `folds_input_norm`); `norm_gemv` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.layers.fused import _cast, _jit, _norm_value, _residual_sum, _rnd, tl, triton
from blockspec.layers.linear import _fit_block_k, _kernel_for, gemv, gemv_config
from blockspec.layers.pdl import pdl_args, pdl_sync

MAX_K = 8192  # the row's squares summed in one block (fused._MAX_ROW_BLOCK)
# Rows a program (None: gemv_config's two). NOTE: every program reads the whole row pair from
# L2 for its sum of squares: at two rows, Moonlight's fused q / kv_a projection (3648 rows, 1824
# programs) reads ~15 MB a layer, as much as its weights; more rows a program read less of it
# (benchmarks/step_ab.py --ab norm_fold compares both).
ROWS_PER_PROGRAM: int | None = None


@dataclass
class NormedInput:
    """rms_norm(h + residual) (residual None: rms_norm(h)) before it is computed; the fold
    writes h + residual into `new_residual` (where there is a residual)."""

    h: torch.Tensor
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    new_residual: torch.Tensor

    def __post_init__(self) -> None:
        if self.residual is not None and (self.residual.shape != self.h.shape
                                          or self.residual.dtype != self.h.dtype):
            raise ValueError("NormedInput: residual must match h's shape and dtype")


def folds(h: torch.Tensor, weight: torch.Tensor, w: torch.Tensor, backend: str) -> bool:
    """Whether norm_gemv takes RMSNorm(weight) of h into w: one row that the "triton" linear
    backend sends through linear.gemv, K <= MAX_K, the norm weight in h's dtype."""
    return backend == "triton" and h.numel() == h.shape[-1] <= MAX_K \
        and weight.dtype == h.dtype and _kernel_for(h, w, None) is gemv


@_jit
def _normed_chunk(h_ptr, res_ptr, nw_ptr, cols, rstd, dtype: tl.constexpr,
                  HAS_RES: tl.constexpr):
    """The normed input at cols (fp32 of dtype values), rounded as fused._norm_store does."""
    ok = cols >= 0
    r = _residual_sum(h_ptr, res_ptr, res_ptr, cols, ok, dtype, HAS_RES, False)
    return _rnd(_norm_value(nw_ptr, r, rstd, cols, ok, dtype), dtype)


@_jit
def _norm_gemv_kernel(h_ptr, res_ptr, nw_ptr, w_ptr, y_ptr, new_res_ptr, N, K, eps,
                      HAS_RES: tl.constexpr, ROW_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    # NOTE: K % BLOCK_K == 0 (gemv_config's BLOCK_K): no column mask in the loop; the first
    # weight tile loads before the PDL wait (no kernel writes weights), as linear.gemv's.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows[:, None] < N
    base = w_ptr + rows[:, None].to(tl.int64) * K
    cols = tl.arange(0, BLOCK_K)
    w = tl.load(base + cols[None, :], mask=rmask, other=0.0)
    pdl_sync(USE_PDL)
    dtype = h_ptr.dtype.element_ty
    offs = tl.arange(0, ROW_BLOCK)
    r = _residual_sum(h_ptr, res_ptr, new_res_ptr, offs, offs < K, dtype, HAS_RES, False)
    if HAS_RES and tl.program_id(0) == 0:
        tl.store(new_res_ptr + offs, _cast(r, dtype), mask=offs < K)
    rstd = tl.math.rsqrt(tl.sum(r * r, axis=0) / K + eps)
    x = _normed_chunk(h_ptr, res_ptr, nw_ptr, cols, rstd, dtype, HAS_RES)
    acc = w.to(tl.float32) * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(base + cols[None, :], mask=rmask, other=0.0)
        x = _normed_chunk(h_ptr, res_ptr, nw_ptr, cols, rstd, dtype, HAS_RES)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(y_ptr + rows, _cast(tl.sum(acc, axis=1), y_ptr.dtype.element_ty), mask=rows < N)


def norm_gemv_config(n: int, k: int) -> tuple[int, int, int, int] | None:
    """gemv_config's, or ROWS_PER_PROGRAM rows a program with BLOCK_K scaled down to keep the
    tile's size (at least 16 wide)."""
    cfg = gemv_config(n, k)
    if cfg is None or ROWS_PER_PROGRAM is None:
        return cfg
    bn, bk, warps, stages = cfg
    return _fit_block_k((ROWS_PER_PROGRAM, max(16, bn * bk // ROWS_PER_PROGRAM), warps, stages),
                        k)


def norm_gemv(inp: NormedInput, w: torch.Tensor) -> torch.Tensor:
    """gemv(rms_norm(inp.h + inp.residual), w) for one row -> [1, N] in h's dtype, writing
    inp.h + inp.residual into inp.new_residual (where there is a residual)."""
    k, n = inp.h.shape[-1], w.shape[0]
    cfg = norm_gemv_config(n, k)
    if inp.h.numel() != k or k > MAX_K or cfg is None or k % cfg[1] or w.shape[1] != k \
            or not w.is_contiguous() or inp.weight.dtype != inp.h.dtype:
        raise ValueError(f"norm_gemv: unsupported shapes h {tuple(inp.h.shape)}, "
                         f"w {tuple(w.shape)} (config {cfg})")
    h = inp.h.reshape(1, k)
    res = inp.residual.reshape(1, k) if inp.residual is not None else h
    bn, bk, warps, stages = cfg
    y = torch.empty(1, n, dtype=inp.h.dtype, device=inp.h.device)
    _norm_gemv_kernel[(triton.cdiv(n, bn),)](
        h.contiguous(), res.contiguous(), inp.weight, w, y, inp.new_residual, n, k, inp.eps,
        HAS_RES=inp.residual is not None, ROW_BLOCK=triton.next_power_of_2(k), BLOCK_N=bn,
        BLOCK_K=bk, num_warps=warps, num_stages=stages, enable_fp_fusion=False,
        **pdl_args(inp.h.device))
    return y
