"""Mixture-of-experts pieces of DeepSeek-V3 / Kimi-K2 targets, in plain PyTorch: the router
(`noaux_tc`: sigmoid scores, a correction bias for selection only, group-limited top-k) and the
routed experts' reference forward (the CPU path and the reference for a fused kernel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockspec.layers.linear import router_logits
from blockspec.layers.side_stream import Residual, resolve


def select_experts_reference(router_logits: torch.Tensor,
                             correction_bias: torch.Tensor | None,
                             top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                             routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, top_k] fp32, expert ids [T, top_k] int64).

    Experts are picked by sigmoid score + correction bias, among the `topk_group` groups (of
    E / n_group experts) whose two best biased scores sum highest; each pick is weighted by its
    unbiased score, renormalised over the picks when `norm_topk_prob`, times
    `routed_scaling_factor`."""
    scores = router_logits.float().sigmoid()
    biased = scores if correction_bias is None else scores + correction_bias.float()
    t, e = biased.shape
    if n_group > 1:
        groups = biased.view(t, n_group, e // n_group)
        group_scores = groups.topk(min(2, e // n_group), dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        biased = biased.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = biased.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def select_experts(router_logits: torch.Tensor, correction_bias: torch.Tensor | None,
                   top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                   routed_scaling_factor: float, weights_dtype: torch.dtype = torch.float32
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts_reference's picks, the weights rounded to `weights_dtype`; on a GPU one
    Triton program per token (layers/moe_router.py) where its shapes allow, in place of ~10
    small torch kernels and the cast."""
    args = (router_logits, correction_bias, top_k, n_group, topk_group, norm_topk_prob,
            routed_scaling_factor)
    if router_logits.is_cuda:
        from blockspec.layers.moe_router import routable, route

        if routable(router_logits.shape[1], top_k, n_group):
            return route(*args, weights_dtype)
    weights, ids = select_experts_reference(*args)
    return weights.to(weights_dtype), ids


def select_experts_softmax(router_logits: torch.Tensor, top_k: int, n_group: int,
                           topk_group: int, group_limited: bool,
                           routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's router: softmax scores; with `group_limited` only the experts of the
    `topk_group` groups whose best score is highest compete; the top_k scores times
    `routed_scaling_factor` are the weights. NOTE: never renormalised, whatever the config's
    norm_topk_prob, as HF transformers computes it (the published V2 configs set it false)."""
    scores = router_logits.float().softmax(dim=-1)
    t, e = scores.shape
    if group_limited and n_group > 1:
        best = scores.view(t, n_group, e // n_group).max(dim=-1).values
        keep = torch.zeros_like(best, dtype=torch.bool)
        keep.scatter_(1, best.topk(topk_group, dim=-1).indices, True)
        scores = scores.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), 0.0)
    weights, ids = scores.topk(top_k, dim=-1)
    return weights * routed_scaling_factor, ids


def experts_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor,
                      residual: Residual = None) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) (+ residual, in x's dtype), each expert
    a SiLU-gated MLP: gate_up [E, 2I, H] (gate rows first), down [E, H, I]. x [T, H] -> [T, H]."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for expert in ids.unique().tolist():
        rows, slot = (ids == expert).nonzero(as_tuple=True)
        gate, up = F.linear(x[rows], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, rows, (y * weights[rows, slot, None]).float())
    return out.to(x.dtype) if residual is None else out.to(x.dtype) + resolve(residual)


def count_experts(ids: torch.Tensor, num_experts: int, stats: torch.Tensor) -> None:
    """Adds (distinct experts in `ids`, 1) to `stats` (int64 [2]) on the device: no host sync,
    a graph captures it. NOTE: the grouped-GEMM path counts inside its alignment kernel."""
    hit = torch.zeros(num_experts, dtype=torch.bool, device=ids.device)
    stats += torch.stack([hit.index_fill_(0, ids.reshape(-1), True).sum(),
                          torch.ones((), dtype=torch.int64, device=ids.device)])


def route_tokens(x: torch.Tensor, gate_weight: torch.Tensor,
                 correction_bias: torch.Tensor | None, moe, backend: str = "torch"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE layer's picks for x [T, H] through its router (gate_weight [E, H], fp32 logits as
    HF computes them: bf16 logits would change the picks) under the config `moe`
    (deepseek_config.MoEConfig): (weights [T, top_k] in x's dtype, ids [T, top_k] int64).

    NOTE: the router GEMV and the routing stay two launches: one kernel whose last program
    routed the row measured 3% slower on Moonlight's batch-1 step (H100, 2.78 against 2.70 ms;
    docs/benchmarks.md, "MoE targets")."""
    logits = router_logits(x, gate_weight, backend)
    if moe.scoring_func == "softmax":
        weights, ids = select_experts_softmax(
            logits, moe.num_experts_per_tok, moe.n_group, moe.topk_group,
            moe.topk_method == "group_limited_greedy", moe.routed_scaling_factor)
    else:
        weights, ids = select_experts(logits, correction_bias, moe.num_experts_per_tok,
                                      moe.n_group, moe.topk_group, moe.norm_topk_prob,
                                      moe.routed_scaling_factor, x.dtype)
    return weights.to(x.dtype), ids
