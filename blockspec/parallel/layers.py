"""The modules that carry a collective: one all-reduce after each attention and MLP/MoE block,
the vocab-parallel embedding and LM head, and the routed experts of one expert group.

Column-split projections need no module of their own (a Linear holding its rows); a row-split
projection is a Linear holding its columns whose partial sums the block's `ReduceOutput` adds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers.linear import Linear
from blockspec.layers.side_stream import Residual
from blockspec.parallel.state import all_gather_last, all_reduce


class ReduceOutput(nn.Module):
    """`block`'s output summed over the ranks: each rank's row-split projection (o_proj,
    down_proj, the experts) leaves a partial sum, so a block costs one all-reduce."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.block(*args))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + weight.shape[0]) of the embedding; ids outside them embed to zero
    here and come from their owner through the all-reduce."""

    def __init__(self, weight: torch.Tensor, start: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return all_reduce(out * mine[:, None].to(out.dtype))


class ParallelLMHead(nn.Module):
    """Logits for rows [start, start + n) of the vocabulary on each rank, gathered into the
    full [T, vocab_size] (every rank then samples the same tokens from the same logits).
    NOTE: the shards are padded to one size (the gather needs it); the padding is cut off."""

    def __init__(self, head: Linear, vocab_size: int, start: int) -> None:
        super().__init__()
        self.head = head
        self.vocab_size, self.start = vocab_size, start
        self.valid = max(min(head.out_features, vocab_size - start), 0)  # rows before padding

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather_last(self.head(x))[..., :self.vocab_size]

    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        """argmax of forward(x) [T] without gathering the logits: each rank's best value and
        its global index, then one small all-gather of those. NOTE: ties go to the lowest
        index, as torch.argmax's first maximum (ranks hold ascending vocabulary rows)."""
        logits = self.head(x)[..., :self.valid].float()
        best, idx = logits.max(dim=-1)
        best = all_gather_last(best[..., None])  # [T, ranks]
        idx = all_gather_last((idx + self.start)[..., None])
        return idx.gather(-1, best.argmax(dim=-1, keepdim=True)).squeeze(-1)


class GroupExperts(nn.Module):
    """The routed experts [first, first + count) of this rank's expert group, each holding its
    slice of the intermediate size (Experts' layout and names). The router's picks of other
    groups' experts weigh zero here: they are summed in by the MoE block's all-reduce.
    NOTE: dispatch by all-reduce: every rank sees every token (simple, graph-capturable)."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, first: int,
                 num_experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj, requires_grad=False)
        self.down_proj = nn.Parameter(down_proj, requires_grad=False)
        self.first, self.num_experts = first, num_experts

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                backend: str, stats: torch.Tensor,
                residual: Residual = None) -> torch.Tensor:
        """Experts.forward's call; `stats` counts the distinct experts of all groups."""
        from blockspec.layers.fused_moe import fused_experts
        from blockspec.layers.moe import count_experts, experts_reference

        count_experts(ids, self.num_experts, stats)
        local = ids - self.first
        mine = (local >= 0) & (local < self.gate_up_proj.shape[0])
        local = torch.where(mine, local, torch.zeros_like(local))
        weights = weights * mine.to(weights.dtype)
        experts = fused_experts if backend == "triton" else experts_reference
        return experts(x, weights, local, self.gate_up_proj, self.down_proj, residual=residual)


class GroupQuantExperts(nn.Module):
    """GroupExperts over quantized weights: `local` (a QuantExperts holding this rank's slice
    of the experts [first, first + count)) runs the picks of its experts; the others weigh zero
    here and are summed in by the MoE block's all-reduce."""

    def __init__(self, local: nn.Module, first: int, count: int, num_experts: int) -> None:
        super().__init__()
        self.local = local
        self.first, self.count, self.num_experts = first, count, num_experts
        # NOTE: the local experts count their own picks; the layer's stats count all groups'
        self.register_buffer("local_stats", torch.zeros(2, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                backend: str, stats: torch.Tensor,
                residual: Residual = None) -> torch.Tensor:
        from blockspec.layers.moe import count_experts

        count_experts(ids, self.num_experts, stats)
        local = ids - self.first
        mine = (local >= 0) & (local < self.count)
        local = torch.where(mine, local, torch.zeros_like(local))
        weights = weights * mine.to(weights.dtype)
        return self.local(x, weights, local, backend, self.local_stats, residual)
