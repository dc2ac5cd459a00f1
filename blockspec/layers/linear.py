"""Linear layers with a Triton GEMV for one-row inputs: the matmuls of a batch-1 decode step.

A decode step at batch 1 does little but stream weights, so its matmuls should read them at copy
bandwidth. cuBLAS does not at M = 1: on one H200 it reads Qwen3-8B's o_proj at 60% of copy
bandwidth, qkv_proj at 73%, down_proj at 78% (split-K plus a reduce kernel), where one program per
tile of output features, streaming its rows of the weight once, reaches 73%, 83% and 89%
(benchmarks/results/fast_path_ceiling_2026-11-30_run2/, its linear_sweep). At 16 rows (one
sequence's speculative step) a tl.dot version of the same idea measured no better than cuBLAS
(4.43 vs 4.35 ms for every projection once), so only M = 1 is routed here.

`linear(x, w, b, backend)`: with backend "triton", one-row bf16/fp16 inputs without bias (any
float under the interpreter) go through `gemv`; everything else, and backend "torch", is
`F.linear`. Accumulation is fp32 and the result rounds once to the input dtype, like cuBLAS; only
the summation order differs. The kernel never syncs with the host and its grid depends only on
shapes, so it is safe inside CUDA graphs.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from blockspec.layers.fused import _cast, _jit, tl, triton


@_jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # y[n] = sum_k w[n, k] x[k]: one program per BLOCK_N output features, streaming their rows.
    # NOTE: K % BLOCK_K == 0 (the caller picks BLOCK_K): no column mask inside the loop.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    base = w_ptr + rows[:, None].to(tl.int64) * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(base + cols[None, :], mask=rmask[:, None], other=0.0)
        x = tl.load(x_ptr + cols)
        acc += w.to(tl.float32) * x[None, :].to(tl.float32)
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + rows, _cast(y, y_ptr.dtype.element_ty), mask=rmask)


def gemv_config(n: int, k: int) -> tuple[int, int, int, int] | None:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for w [n, k], the best measured on one H200
    per Qwen3-8B projection; BLOCK_K is halved until it divides k, None when that falls below
    16 (the caller uses F.linear)."""
    bn, bk, warps, stages = (32, 256, 8, 3) if n >= 16384 else (8, 512, 4, 3)
    while k % bk:
        bk //= 2
    return (bn, bk, warps, stages) if bk >= 16 else None


def gemv(x: torch.Tensor, w: torch.Tensor,
         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [1, K] @ w [N, K]^T -> [1, N] in x's dtype (`config`: benchmarks sweep them)."""
    m, k = x.shape
    n = w.shape[0]
    cfg = config or gemv_config(n, k)
    if m != 1 or cfg is None or w.shape[1] != k or not w.is_contiguous() or x.stride(1) != 1 \
            or k % cfg[1]:
        raise ValueError(f"gemv: unsupported shapes x {tuple(x.shape)}, w {tuple(w.shape)} "
                         f"(config {cfg})")
    bn, bk, warps, stages = cfg
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, bn),)](x, w, y, n, k, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                        num_stages=stages, enable_fp_fusion=False)
    return y


def _use_gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    if b is not None or triton is None or x.numel() != x.shape[-1] or x.numel() == 0:
        return False
    if not w.is_contiguous() or gemv_config(w.shape[0], x.shape[-1]) is None:
        return False
    if x.is_cuda:
        return x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
    return os.environ.get("TRITON_INTERPRET") == "1"  # CPU: tests, in the interpreter


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           backend: str = "torch") -> torch.Tensor:
    """`F.linear(x, w, b)`; with backend "triton", a one-row input goes through `gemv`."""
    if backend == "triton" and _use_gemv(x, w, b):
        return gemv(x.reshape(1, -1).contiguous(), w).view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w, b)


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose forward is `linear` with this layer's
    `backend` (the engine sets it; "torch" until then)."""

    backend = "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.backend)
