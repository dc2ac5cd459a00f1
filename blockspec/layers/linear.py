"""Linear layers with Triton kernels for the skinny matmuls of small decode steps.

A decode step at batch 1 does little but stream weights, so its matmuls should read them at copy
bandwidth. cuBLAS does not at M = 1: on one H200 it reads Qwen3-8B's o_proj at 60% of copy
bandwidth, qkv_proj at 73%, down_proj at 78% (split-K plus a reduce kernel), where one program per
tile of output features, streaming its rows of the weight once (`gemv`), reaches 73%, 83% and 89%
(benchmarks/results/fast_path_ceiling_2026-11-30_run2/, its linear_sweep). At 2-16 rows (16: one
sequence's speculative step) a tl.dot version (`skinny`) beat cuBLAS only on the wide weights
(gate_up 1.78 vs 1.83 ms for 36 layers, lm_head 0.295 vs 0.311 ms) and lost on the others, so
only N >= 16384 goes there.

`linear(x, w, b, backend)`: with backend "triton", bf16/fp16 inputs without bias (any float under
the interpreter) that fit those rules go through the kernels; everything else, and backend
"torch", is `F.linear`. Accumulation is fp32 and the result rounds once to the input dtype, like
cuBLAS; only the summation order differs. The kernels never sync with the host and their grids
depend only on shapes, so they are safe inside CUDA graphs.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from blockspec.layers.fused import _cast, _jit, tl, triton
from blockspec.layers.pdl import pdl_args, pdl_sync

SKINNY_MAX_M = 16  # one sequence's speculative step (block 16)
SKINNY_MIN_N = 16384


@_jit
def _rows_span_sum(base, x_ptr, rmask, k_lo, k_hi, BLOCK_K: tl.constexpr,
                   USE_PDL: tl.constexpr):
    """sum over k_lo <= k < k_hi of w[rows, k] x[k] (fp32 [BLOCK_N]) for the rows at base.
    NOTE: (k_hi - k_lo) % BLOCK_K == 0 (the caller picks BLOCK_K): no column mask in the loop;
    the first weight tile loads before the PDL wait (no kernel writes weights), so under PDL
    its latency overlaps the previous kernel's end; x waits."""
    cols = k_lo + tl.arange(0, BLOCK_K)
    w = tl.load(base + cols[None, :], mask=rmask[:, None], other=0.0)
    pdl_sync(USE_PDL)
    acc = w.to(tl.float32) * tl.load(x_ptr + cols)[None, :].to(tl.float32)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(base + cols[None, :], mask=rmask[:, None], other=0.0)
        x = tl.load(x_ptr + cols)
        acc += w.to(tl.float32) * x[None, :].to(tl.float32)
    return tl.sum(acc, axis=1)


@_jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_PDL: tl.constexpr = False):
    # y[n] = sum_k w[n, k] x[k]: one program per BLOCK_N output features, streaming their rows.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    y = _rows_span_sum(w_ptr + rows[:, None].to(tl.int64) * K, x_ptr, rmask, 0, K, BLOCK_K,
                       USE_PDL)
    tl.store(y_ptr + rows, _cast(y, y_ptr.dtype.element_ty), mask=rmask)


@_jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, x_stride, y_stride, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                   USE_PDL: tl.constexpr = False):
    # y[m, n] = sum_k x[m, k] w[n, k] for all M (<= BLOCK_M) rows at once: each weight tile is
    # read once whatever M is. Rows past M are masked (tensor-core tiles need 16 rows).
    pdl_sync(USE_PDL)
    rows_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.arange(0, BLOCK_M)
    nmask, mmask = rows_n < N, rows_m < M
    w_base = w_ptr + rows_n[:, None].to(tl.int64) * K
    x_base = x_ptr + rows_m[:, None].to(tl.int64) * x_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_base + cols[None, :], mask=mmask[:, None], other=0.0)
        w = tl.load(w_base + cols[None, :], mask=nmask[:, None], other=0.0)
        if UPCAST:  # the interpreter multiplies 16-bit floats in tl.dot wrongly (CPU tests)
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc)
    dst = y_ptr + rows_m[:, None].to(tl.int64) * y_stride + rows_n[None, :]
    tl.store(dst, _cast(acc, y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def _fit_block_k(cfg: tuple[int, int, int, int], k: int) -> tuple[int, int, int, int] | None:
    """`cfg` with BLOCK_K halved until it divides k; None when that falls below 16 (the caller
    uses F.linear)."""
    bn, bk, warps, stages = cfg
    while k % bk:
        bk //= 2
    return (bn, bk, warps, stages) if bk >= 16 else None


def gemv_config(n: int, k: int) -> tuple[int, int, int, int] | None:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for w [n, k] (`_fit_block_k` to k): two rows
    a program, the best or within 5% of it for each of 14 projections of Moonlight and Kimi
    K2.6 on one H200 (`benchmarks/kernel_tune.py`; docs/benchmarks.md)."""
    return _fit_block_k((2, 1024, 4, 3), k)


def skinny_config(m: int, n: int, k: int) -> tuple[int, int, int, int] | None:
    """The tl.dot kernel's config for 2..SKINNY_MAX_M rows, or None where cuBLAS measured as
    fast or faster (N < 16384: qkv, o and down projections) or no BLOCK_K >= 16 divides k."""
    if not 2 <= m <= SKINNY_MAX_M or n < SKINNY_MIN_N:
        return None
    return _fit_block_k((64, 128, 4, 4), k)


def skinny(x: torch.Tensor, w: torch.Tensor,
           config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous, M <= 16) @ w [N, K]^T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = w.shape[0]
    cfg = config or skinny_config(m, n, k)
    if cfg is None or m > SKINNY_MAX_M or w.shape[1] != k or not w.is_contiguous() \
            or x.stride(1) != 1 or k % cfg[1]:
        raise ValueError(f"skinny: unsupported shapes x {tuple(x.shape)}, w {tuple(w.shape)} "
                         f"(config {cfg})")
    bn, bk, warps, stages = cfg
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_kernel[(triton.cdiv(n, bn),)](
        x, w, y, m, n, k, x.stride(0), y.stride(0), BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk,
        UPCAST=not x.is_cuda, num_warps=warps, num_stages=stages, enable_fp_fusion=False,
        **pdl_args(x.device))
    return y


def gemv(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int] | None = None,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [1, K] @ w [N, K]^T -> [1, N] in `out_dtype` (x's by default), products and sums in
    fp32 whatever the inputs' dtypes (`config`: benchmarks sweep them). NOTE: `w` is a weight:
    under PDL its first tile is read before the wait for the previous kernel."""
    m, k = x.shape
    n = w.shape[0]
    cfg = config or gemv_config(n, k)
    if m != 1 or cfg is None or w.shape[1] != k or not w.is_contiguous() or x.stride(1) != 1 \
            or k % cfg[1]:
        raise ValueError(f"gemv: unsupported shapes x {tuple(x.shape)}, w {tuple(w.shape)} "
                         f"(config {cfg})")
    bn, bk, warps, stages = cfg
    y = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, bn),)](x, w, y, n, k, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                        num_stages=stages, enable_fp_fusion=False,
                                        **pdl_args(x.device))
    return y


# NOTE: a router's few fp32 rows (64-384 experts) over many programs: 2 rows each.
ROUTER_CONFIG = (2, 512, 4, 3)


def router_logits(x: torch.Tensor, w: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """F.linear(x.float(), w.float()): a MoE router's fp32 logits [T, E], as HF computes them.
    With backend "triton" one row goes through split_gemv (K split over programs, one launch;
    `gemv` where it does not apply), reading x in its own dtype: no cast launch, and one kernel
    where cuBLAS runs an fp32 GEMV as two (split-K and a reduce)."""
    from blockspec.layers.split_gemv import split_gemv  # it builds on this module's row sums

    k = x.shape[-1]
    cfg = _fit_block_k(ROUTER_CONFIG, k)
    if backend == "triton" and x.numel() == k and cfg is not None and w.is_contiguous() \
            and w.dtype == torch.float32 and triton is not None \
            and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        row = x.reshape(1, k).contiguous()
        y = split_gemv(row, w, torch.float32)
        return (y if y is not None else gemv(row, w, cfg, torch.float32)).view(
            *x.shape[:-1], w.shape[0])
    return F.linear(x.float(), w.float())


def _kernel_for(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    """`gemv`, `skinny` or None (F.linear) for this input."""
    if b is not None or triton is None or x.numel() == 0 or not w.is_contiguous():
        return None
    k = x.shape[-1]
    m = x.numel() // k
    if m == 1 and gemv_config(w.shape[0], k) is not None:
        kernel = gemv
    elif skinny_config(m, w.shape[0], k) is not None:
        kernel = skinny
    else:
        return None
    return kernel if _triton_ok(x, w) else None


def _triton_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    if x.is_cuda:
        return x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
    return os.environ.get("TRITON_INTERPRET") == "1"  # CPU: tests, in the interpreter


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           backend: str = "torch") -> torch.Tensor:
    """`F.linear(x, w, b)`; with backend "triton", one-row inputs go through `gemv` and inputs
    of up to 16 rows with a wide weight (gate_up, lm_head) through `skinny`."""
    kernel = _kernel_for(x, w, b) if backend == "triton" else None
    if kernel is None:
        return F.linear(x, w, b)
    return kernel(x.reshape(-1, x.shape[-1]).contiguous(), w).view(*x.shape[:-1], w.shape[0])


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose forward is `linear` with this layer's
    `backend` (the engine sets it; "torch" until then)."""

    backend = "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.backend)
