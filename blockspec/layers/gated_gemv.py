"""An MLP's gate_up projection and SiLU-and-mul at one row in one kernel:

    act[i] = silu(gate[i]) * up[i],  gate = W[i] x,  up = W[I + i] x   (W = [gate; up], [2I, K])

At batch 1 the separate activation launch (fused.silu_and_mul) costs as much as a small GEMV's
tail (the shared expert of Kimi K2.6, a dense model's every layer). Each program streams its
BLOCK_N gate rows and the matching up rows together as linear.gemv streams rows (the same
tiles, so the same sums), rounds each to the activations' dtype as the GEMV's store does, then
computes the activation exactly as the silu kernel does: the unfused result bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from blockspec.layers.fused import _cast, _jit, _rnd, silu_and_mul, tl, triton
from blockspec.layers.linear import Linear, _kernel_for, gemv, gemv_config
from blockspec.layers.pdl import pdl_args, pdl_sync


@_jit
def _gated_gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_PDL: tl.constexpr = False):
    # NOTE: K % BLOCK_K == 0 (gemv_config's BLOCK_K): no column mask inside the loop. The gate
    # and up tiles load in the same iteration (as many bytes in flight as the GEMV's two
    # programs), each summed as linear._gemv_kernel sums a [BLOCK_N, BLOCK_K] tile.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows[:, None] < N
    g_base = w_ptr + rows[:, None].to(tl.int64) * K
    u_base = w_ptr + (rows + N)[:, None].to(tl.int64) * K
    cols = tl.arange(0, BLOCK_K)
    wg = tl.load(g_base + cols[None, :], mask=rmask, other=0.0)  # weights: before the wait
    wu = tl.load(u_base + cols[None, :], mask=rmask, other=0.0)
    pdl_sync(USE_PDL)
    x = tl.load(x_ptr + cols)[None, :].to(tl.float32)
    acc_g, acc_u = wg.to(tl.float32) * x, wu.to(tl.float32) * x
    for k0 in range(BLOCK_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        wg = tl.load(g_base + cols[None, :], mask=rmask, other=0.0)
        wu = tl.load(u_base + cols[None, :], mask=rmask, other=0.0)
        x = tl.load(x_ptr + cols)[None, :].to(tl.float32)
        acc_g += wg.to(tl.float32) * x
        acc_u += wu.to(tl.float32) * x
    dtype = y_ptr.dtype.element_ty
    gate, up = _rnd(tl.sum(acc_g, axis=1), dtype), _rnd(tl.sum(acc_u, axis=1), dtype)
    act = _rnd(gate / (1.0 + tl.exp(-gate)), dtype)  # fused._silu_and_mul_kernel's rounding
    tl.store(y_ptr + rows, _cast(act * up, dtype), mask=rows < N)


def gated_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(gemv(x, w)) for x [1, K], w [2I, K] (gate rows then up rows) -> [1, I]."""
    k, n = x.shape[1], w.shape[0] // 2
    cfg = gemv_config(n, k)
    if x.shape[0] != 1 or cfg is None or w.shape != (2 * n, k) or not w.is_contiguous() \
            or x.stride(1) != 1 or k % cfg[1]:
        raise ValueError(f"gated_gemv: unsupported shapes x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)} (config {cfg})")
    bn, bk, warps, stages = cfg
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gated_gemv_kernel[(triton.cdiv(n, bn),)](x, w, y, n, k, BLOCK_N=bn, BLOCK_K=bk,
                                              num_warps=warps, num_stages=stages,
                                              enable_fp_fusion=False, **pdl_args(x.device))
    return y


def silu_gate_up(x: torch.Tensor, gate_up: nn.Module) -> torch.Tensor:
    """silu_and_mul(gate_up(x)); in one kernel (gated_gemv) where gate_up is a bias-free
    Linear whose "triton" backend would take one row through linear.gemv."""
    if type(gate_up) is Linear and gate_up.backend == "triton" \
            and _kernel_for(x, gate_up.weight, gate_up.bias) is gemv \
            and gate_up.weight.shape[0] % 2 == 0:
        k = x.shape[-1]
        return gated_gemv(x.reshape(1, k).contiguous(), gate_up.weight).view(
            *x.shape[:-1], gate_up.weight.shape[0] // 2)
    return silu_and_mul(gate_up(x))
