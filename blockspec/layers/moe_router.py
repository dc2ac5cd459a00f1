"""DeepSeek-V3's `noaux_tc` router in one Triton program per token: sigmoid scores, the correction
bias for selection, group-limited top-k (each group's two best biased scores summed, the best
`topk_group` groups kept), then the top_k picks by repeated argmax, weighted by their unbiased
scores (renormalised, scaled). The same picks as layers/moe.select_experts_reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockspec.layers.fused import _cast
from blockspec.layers.pdl import pdl_args, pdl_sync

MAX_EXPERTS = 1024  # one row of scores in registers
# NOTE: one warp: the top-k's argmaxes and sums reduce by shuffles alone, not through shared
# memory and barriers across warps (2 x top_k reductions a token, in sequence)
ROUTE_WARPS = 1
_NAN_RANK = tl.constexpr(-1e30)  # a NaN score's rank: below any score, above -inf


def routable(num_experts: int, top_k: int, n_group: int) -> bool:
    """Whether the kernel serves these shapes: groups need a power-of-two expert count (a row
    reshaped into groups) of at least two per group."""
    if num_experts > MAX_EXPERTS or top_k > num_experts:
        return False
    if n_group == 1:
        return True
    per = num_experts // n_group
    return num_experts & (num_experts - 1) == 0 and num_experts % n_group == 0 and per >= 2


@triton.jit
def _keep_groups(biased, E_PAD: tl.constexpr, N_GROUP: tl.constexpr,
                 TOPK_GROUP: tl.constexpr):
    """`biased` with every expert outside the TOPK_GROUP best groups set to -inf."""
    g = tl.reshape(biased, [N_GROUP, E_PAD // N_GROUP])
    col = tl.arange(0, E_PAD // N_GROUP)[None, :]
    first = tl.argmax(g, 1)
    best = tl.max(g, 1) + tl.max(tl.where(col == first[:, None], float("-inf"), g), 1)
    groups = tl.arange(0, N_GROUP)
    keep = groups < 0
    for _ in tl.static_range(TOPK_GROUP):
        j = tl.argmax(best, 0)
        keep = keep | (groups == j)
        best = tl.where(groups == j, float("-inf"), best)
    mask = tl.reshape(tl.broadcast_to(keep[:, None], [N_GROUP, E_PAD // N_GROUP]), [E_PAD])
    return tl.where(mask, biased, float("-inf"))


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_l, scaling,
                  E: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr,
                  K_PAD: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                  HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                  USE_PDL: tl.constexpr = False):
    pdl_sync(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    ok = e < E
    x = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=0.0).to(tl.float32)
    score = 1.0 / (1.0 + tl.exp(-x))
    biased = score
    if HAS_BIAS:
        biased = score + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
    # NOTE: a graph's padding tokens route whatever their unwritten attention rows held, NaN
    # included. A NaN never wins argmax's comparison, so a row of NaNs would pick a padding lane
    # past E (an out-of-range expert downstream); NaN ranks below every score instead.
    biased = tl.where(ok, tl.where(biased == biased, biased, _NAN_RANK), float("-inf"))
    if N_GROUP > 1:
        biased = _keep_groups(biased, E_PAD, N_GROUP, TOPK_GROUP)
    k = tl.arange(0, K_PAD)
    ids = tl.zeros([K_PAD], tl.int64)
    w = tl.zeros([K_PAD], tl.float32)
    for i in tl.static_range(TOP_K):
        j = tl.argmax(biased, 0)
        ids = tl.where(k == i, j.to(tl.int64), ids)
        w = tl.where(k == i, tl.sum(tl.where(e == j, score, 0.0), 0), w)
        biased = tl.where(e == j, float("-inf"), biased)
    if NORM:
        w = w / (tl.sum(w, 0) + 1e-20)
    tl.store(weights_ptr + t * TOP_K + k, _cast(w * scaling, weights_ptr.dtype.element_ty),
             mask=k < TOP_K)
    tl.store(ids_ptr + t * TOP_K + k, ids, mask=k < TOP_K)


def route(router_logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int,
          n_group: int, topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
          weights_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts_reference's (weights [T, top_k] fp32, ids [T, top_k] int64), the weights
    rounded to `weights_dtype` in the kernel's store (no cast launch)."""
    t, e = router_logits.shape
    assert router_logits.stride(1) == 1 and routable(e, top_k, n_group)
    weights = torch.empty(t, top_k, dtype=weights_dtype, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=router_logits.device)
    if t:
        bias = correction_bias if correction_bias is not None else weights
        _route_kernel[(t,)](router_logits, bias, weights, ids, router_logits.stride(0),
                            float(routed_scaling_factor), E=e, E_PAD=triton.next_power_of_2(e),
                            TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), N_GROUP=n_group,
                            TOPK_GROUP=topk_group, HAS_BIAS=correction_bias is not None,
                            NORM=norm_topk_prob, num_warps=ROUTE_WARPS,
                            **pdl_args(router_logits.device))
    return weights, ids
