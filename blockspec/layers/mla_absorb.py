"""MLA's absorbed per-head projections of a decode step's few tokens as one Triton launch:

    y[t, h, n] = sum_k x[t, h, k] * w[h, n, k]

q_nope @ W_UK (w = W_UK[h] transposed: a strided view, k = the no-rope dims) and
out @ W_UV^T (w = W_UV[h], k = the latent). At a decode step's token cuBLAS runs each as a
batched GEMM of ~3.3 us for Moonlight's 2 MB (H200, docs/benchmarks.md "MoE targets"), and as a
non-Triton kernel it also ends the chain of programmatically launched kernels (layers/pdl.py).
Here one program per (head, BLOCK_N outputs) loads its weight tile once (before the PDL wait:
weights) and serves every token; products and sums in fp32, one rounding to y's dtype, like
cuBLAS's bf16 GEMM up to summation order. More tokens than MAX_TOKENS go to torch.bmm."""

from __future__ import annotations

import os

import torch

from blockspec.layers.fused import _cast, _jit, tl, triton
from blockspec.layers.pdl import pdl_args, pdl_sync

# NOTE: tokens up to which the kernel runs: one (a decode step's token at batch 1), where it
# measured 2.6 against cuBLAS's 3.3 us (Moonlight, H200). With it up to 16, Moonlight's DFlash
# at C=1 ran 4% slower (fixed blocks 8 / 16: 665 / 740 against 690 / 772 tok/s,
# benchmarks/results/moe_2026-12-04/): its verify blocks of 8 and 16 tokens are cuBLAS's.
MAX_TOKENS = 1
_TILE = 4096  # weight values a program holds: BLOCK_N = _TILE / BLOCK_K


@_jit
def _head_weights(w_ptr, h, n, k, N, K, stride_wh, stride_wn, stride_wk):
    """w[h, n, k] in fp32 [len(n), len(k)] (zeros past N, K): a program's weight tile, which
    it loads before its PDL wait (no kernel writes weights)."""
    return tl.load(w_ptr + h * stride_wh + n[:, None] * stride_wn + k[None, :] * stride_wk,
                   mask=(n < N)[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)


@_jit
def _absorb_program(x_ptr, w_ptr, y_ptr, h, n_block, T, N, K, stride_xt, stride_xh, stride_wh,
                    stride_wn, stride_wk, stride_yt, stride_yh, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """Head h's outputs n_block * BLOCK_N.. for every token (one program's work)."""
    h = h.to(tl.int64)
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    w = _head_weights(w_ptr, h, n, k, N, K, stride_wh, stride_wn, stride_wk)
    pdl_sync(USE_PDL)
    for t in range(T):
        x = tl.load(x_ptr + t * stride_xt + h * stride_xh + k, mask=k < K, other=0.0)
        y = tl.sum(w * x.to(tl.float32)[None, :], 1)
        tl.store(y_ptr + t * stride_yt + h * stride_yh + n, _cast(y, y_ptr.dtype.element_ty),
                 mask=n < N)


@_jit
def _absorb_kernel(x_ptr, w_ptr, y_ptr, T, N, K, stride_xt, stride_xh, stride_wh, stride_wn,
                   stride_wk, stride_yt, stride_yh, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    _absorb_program(x_ptr, w_ptr, y_ptr, tl.program_id(0), tl.program_id(1), T, N, K, stride_xt,
                    stride_xh, stride_wh, stride_wn, stride_wk, stride_yt, stride_yh, BLOCK_N,
                    BLOCK_K, USE_PDL)


def _use_triton(x: torch.Tensor, backend: str, max_tokens: int) -> bool:
    if backend != "triton" or triton is None or x.shape[0] > max_tokens:
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def absorb(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, backend: str = "torch",
           max_tokens: int = MAX_TOKENS) -> None:
    """out[t, h, :] = w[h] @ x[t, h, :] for x [T, H, K], w [H, N, K] and out [T, H, N] (views
    of any strides whose last dims of x and out are dense). Backend "triton" takes up to
    `max_tokens` tokens into the kernel; otherwise torch.bmm."""
    t, h, k = x.shape
    n = w.shape[1]
    assert w.shape == (h, n, k) and out.shape == (t, h, n)
    if not _use_triton(x, backend, max_tokens):
        torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
        return
    assert x.stride(2) == 1 and out.stride(2) == 1
    if t == 0:
        return
    block_n, block_k = absorb_tiles(n, k)
    _absorb_kernel[(h, triton.cdiv(n, block_n))](
        x, w, out, t, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        enable_fp_fusion=False, **pdl_args(x.device))


def absorb_tiles(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of an absorb program: all of K, and _TILE weight values."""
    block_k = triton.next_power_of_2(k)
    return min(triton.next_power_of_2(n), max(1, _TILE // block_k)), block_k
