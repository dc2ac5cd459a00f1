"""DeepSeek-V3's mixture-of-experts MLP (also Kimi-K2's and DeepSeek-V2's): the router, the routed
experts in transformers 5's layout, the shared experts beside them (layers/side_stream.py)."""

from __future__ import annotations

import torch
from torch import nn

from blockspec.config import ModelConfig
from blockspec.layers.fused_moe import fused_experts
from blockspec.layers.linear import Linear
from blockspec.layers.moe import count_experts, experts_reference, route_tokens
from blockspec.layers.moe_decode import folds_shared
from blockspec.layers.side_stream import Residual, resolve, run_beside
from blockspec.models.qwen3 import MLP


class TopkRouter(nn.Module):
    """HF's parameter names: `weight` [E, H] (fp32 in HF), `e_score_correction_bias` [E]
    (noaux_tc routers only)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e = cfg.moe.num_experts
        self.weight = nn.Parameter(torch.empty(e, cfg.hidden_size, dtype=torch.float32))
        # NOTE: noaux_tc's selection bias; DeepSeek-V2's softmax router has none.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32)) \
            if cfg.moe.scoring_func == "sigmoid" else None


class Experts(nn.Module):
    """Every routed expert's weights in two tensors (transformers 5's layout): gate_up_proj
    [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts,
                                                     2 * moe.moe_intermediate_size,
                                                     cfg.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, cfg.hidden_size,
                                                  moe.moe_intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                backend: str, stats: torch.Tensor, residual: Residual = None,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) (+ residual, in x's dtype): the
        Triton kernels ("triton") or the torch reference; (distinct experts selected, 1) added
        to `stats`; `shared`: the shared experts' weights, folded into the Triton kernels
        (MoE.shared_fold). Quantized twins (models/quant_experts.py) take the same call
        without `shared`."""
        if backend == "triton":
            return fused_experts(x, weights, ids, self.gate_up_proj, self.down_proj, stats,
                                 residual, shared)
        count_experts(ids, self.gate_up_proj.shape[0], stats)
        return experts_reference(x, weights, ids, self.gate_up_proj, self.down_proj, residual)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.moe = cfg.moe
        self.gate = TopkRouter(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg, cfg.moe.moe_intermediate_size * cfg.moe.n_shared_experts) \
            if cfg.moe.n_shared_experts else None
        # "torch" (experts_reference) or "triton" (the grouped GEMMs); the engine sets it.
        self.experts_backend = "torch"
        # NOTE: shared experts on a CUDA side stream with the Triton experts, unfolded
        # (runs_shared_beside); off, they fold into the routed launches where they can;
        # benchmarks/step_ab.py turns it off for its A/B.
        self.shared_beside = True
        # [distinct experts the forwards' tokens selected, forwards], summed on the device (no
        # host sync; a graph captures the adds) and read by the engine after a step.
        self.register_buffer("expert_counts", torch.zeros(2, dtype=torch.int64),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        beside = self.runs_shared_beside(x)
        fold = None if beside else self.shared_fold(x.shape[0] * self.moe.num_experts_per_tok)
        shared = None
        if fold is None and self.shared_experts is not None:
            # NOTE: beside the routing and the routed gate_up (layers/side_stream.py), joined
            # by the routed down projection, which adds it (one launch fewer), in x's dtype as
            # `routed + shared` rounds.
            shared = run_beside(self.shared_experts, x) if beside else self.shared_experts(x)
        weights, ids = route_tokens(x, self.gate.weight, self.gate.e_score_correction_bias,
                                    self.moe, self.experts_backend)
        if fold is not None:
            return self.experts(x, weights, ids, self.experts_backend, self.expert_counts,
                                shared=fold)
        out = self.experts(x, weights, ids, self.experts_backend, self.expert_counts, shared)
        resolve(shared)  # NOTE: joined already where the experts added it; a no-op then
        return out

    def runs_shared_beside(self, x: torch.Tensor) -> bool:
        """Whether the shared experts run on a side stream (CUDA, the Triton experts): beside
        the routing and the routed gate_up they cost less than folded into the routed launches
        (Moonlight's batch-1 step on an H200: 2.054 against 2.163 ms, docs/benchmarks.md)."""
        return self.shared_experts is not None and self.shared_beside and x.is_cuda \
            and self.experts_backend == "triton"

    def shared_fold(self, num_slots: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared experts' (gate_up, down) weights where the routed experts' decode kernels
        compute them too at `num_slots` routed slots (moe_decode.folds_shared: a decode step's
        few slots, dense experts, one GPU's whole MLP); else None (the MLP runs its own
        launches)."""
        mlp = self.shared_experts
        if mlp is None or self.experts_backend != "triton" or type(self.experts) is not Experts \
                or type(mlp) is not MLP:
            return None
        gu, dn = mlp.gate_up_proj, mlp.down_proj
        if type(gu) is not Linear or type(dn) is not Linear or gu.bias is not None \
                or dn.bias is not None:
            return None
        if not folds_shared(num_slots, self.experts.gate_up_proj, gu.weight):
            return None
        return gu.weight, dn.weight
