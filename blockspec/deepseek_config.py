"""The DeepSeek-V3 / Kimi-K2 parts of a model's configuration: multi-head latent attention and
the mixture of experts, read from the HF config.json keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blockspec.errors import ConfigError


@dataclass
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: one q_proj
    rope_interleave: bool = True  # the rope dims' weights pair (0, 1), (2, 3), ...

    def __post_init__(self) -> None:
        if min(self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim,
               self.v_head_dim) <= 0 or self.qk_rope_head_dim % 2:
            raise ConfigError("MLA config: ranks and head dims must be positive, the rope "
                              "dim even")

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: the KV compression and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


_ROUTERS = (("sigmoid", "noaux_tc"), ("softmax", "greedy"), ("softmax", "group_limited_greedy"))


@dataclass
class MoEConfig:
    """DeepSeek-V2/V3 mixture of experts: routing over `num_experts`, shared experts, the first
    `first_k_dense_replace` layers dense."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    # "sigmoid" with topk_method "noaux_tc" (DeepSeek-V3, Kimi-K2: a correction bias picks), or
    # "softmax" with "greedy" / "group_limited_greedy" (DeepSeek-V2: groups ranked by their best
    # score).
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"

    def __post_init__(self) -> None:
        if (self.scoring_func, self.topk_method) not in _ROUTERS:
            raise ConfigError(f"MoE config: unsupported routing {self.scoring_func!r} / "
                              f"{self.topk_method!r}; supported: "
                              + ", ".join(f"{a} / {b}" for a, b in _ROUTERS))
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError("MoE config: num_experts_per_tok must be in [1, n_routed_experts]")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ConfigError("MoE config: n_group must divide the experts, topk_group in "
                              "[1, n_group]")

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense_replace


def deepseek_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2/V3's MLA and MoE geometry (its head_dim, the rotary dim, is the rope part).
    NOTE: V2's configs name no scoring function (softmax) and default to unnormalised picks."""
    v2 = raw.get("model_type") == "deepseek_v2"
    q_lora = raw.get("q_lora_rank")
    mla = MLAConfig(kv_lora_rank=int(raw["kv_lora_rank"]),
                    qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
                    qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                    v_head_dim=int(raw["v_head_dim"]),
                    q_lora_rank=None if q_lora is None else int(q_lora),
                    rope_interleave=bool(raw.get("rope_interleave", True)))
    moe = MoEConfig(num_experts=int(raw["n_routed_experts"]),
                    num_experts_per_tok=int(raw["num_experts_per_tok"]),
                    moe_intermediate_size=int(raw["moe_intermediate_size"]),
                    n_shared_experts=int(raw.get("n_shared_experts") or 0),
                    n_group=int(raw.get("n_group") or 1),
                    topk_group=int(raw.get("topk_group") or 1),
                    norm_topk_prob=bool(raw.get("norm_topk_prob", not v2)),
                    routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
                    first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
                    scoring_func=raw.get("scoring_func") or ("softmax" if v2 else "sigmoid"),
                    topk_method=raw.get("topk_method") or ("greedy" if v2 else "noaux_tc"))
    return {"mla": mla, "moe": moe, "mtp_layers": int(raw.get("num_nextn_predict_layers") or 0)}
