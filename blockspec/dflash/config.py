"""DFlash drafter checkpoint config (the published z-lab format) and target pairing checks."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from blockspec.config import ConfigError, ModelConfig, read_config_json


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced from 1 to L-3, rounded (the reference's rule)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1)))
            for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    geometry: ModelConfig  # the drafter's Qwen3 layer geometry (no embedding / lm_head of its own)
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ConfigError(f"drafter block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ConfigError("drafter target_layer_ids is empty")

    @property
    def num_layers(self) -> int:
        return self.geometry.num_hidden_layers

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> DFlashConfig:
        return cls.from_dict(read_config_json(path, "draft"), str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "draft config") -> DFlashConfig:
        archs = raw.get("architectures") or []
        if "DFlashDraftModel" not in archs:
            raise ConfigError(f"{where}: not a DFlash drafter (architectures {archs!r}; "
                              "expected ['DFlashDraftModel'])")
        dflash = dict(raw.get("dflash_config") or {})
        mask = dflash.get("mask_token_id", raw.get("mask_token_id"))
        if mask is None:
            raise ConfigError(f"{where}: missing dflash_config.mask_token_id")
        if "block_size" not in raw:
            raise ConfigError(f"{where}: missing block_size")
        geometry = ModelConfig.from_dict(raw, "qwen3")
        num_target = int(raw.get("num_target_layers", 0))
        ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
        if ids is None:
            if num_target <= 0:
                raise ConfigError(f"{where}: needs target_layer_ids or num_target_layers")
            ids = default_target_layer_ids(num_target, geometry.num_hidden_layers)
        return cls(geometry=geometry, block_size=int(raw["block_size"]),
                   mask_token_id=int(mask), target_layer_ids=[int(i) for i in ids],
                   num_target_layers=num_target)

    def validate_pair(self, target: ModelConfig) -> None:
        g = self.geometry
        if g.hidden_size != target.hidden_size:
            raise ConfigError(f"drafter hidden_size {g.hidden_size} != target hidden_size "
                              f"{target.hidden_size}: the drafter uses the target's embeddings")
        if g.vocab_size != target.vocab_size:
            raise ConfigError(f"drafter vocab_size {g.vocab_size} != target vocab_size "
                              f"{target.vocab_size}")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is outside the target vocab "
                              f"(size {target.vocab_size})")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ConfigError(f"drafter target_layer_ids {bad} are not layers of the target "
                              f"(it has {target.num_hidden_layers})")
        if self.num_target_layers and self.num_target_layers != target.num_hidden_layers:
            raise ConfigError(f"drafter was trained for a {self.num_target_layers}-layer target; "
                              f"this target has {target.num_hidden_layers} layers")

    def to_dict(self) -> dict[str, Any]:
        g = self.geometry
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "block_size": self.block_size, "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.target_layer_ids)},
            "hidden_size": g.hidden_size, "intermediate_size": g.intermediate_size,
            "num_hidden_layers": g.num_hidden_layers, "num_attention_heads": g.num_attention_heads,
            "num_key_value_heads": g.num_key_value_heads, "head_dim": g.head_dim,
            "rms_norm_eps": g.rms_norm_eps, "rope_theta": g.rope.theta,
            "rope_scaling": None if g.rope.rope_type == "default" else {
                "rope_type": g.rope.rope_type, "factor": g.rope.factor,
                "low_freq_factor": g.rope.low_freq_factor,
                "high_freq_factor": g.rope.high_freq_factor,
                "original_max_position_embeddings": g.rope.original_max_position_embeddings},
            "max_position_embeddings": g.max_position_embeddings, "vocab_size": g.vocab_size,
            "attention_bias": g.attention_bias, "hidden_act": "silu",
            "tie_word_embeddings": False, "torch_dtype": str(g.dtype).removeprefix("torch."),
        }
