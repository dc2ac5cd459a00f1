"""The model's configuration, read straight from an HF `config.json` (no hub access, no remote
code), so that the same folder works with transformers 4.x (`rope_theta` + `rope_scaling`) and
5.x (`rope_parameters`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from blockspec.deepseek_config import MLAConfig, MoEConfig, deepseek_fields
from blockspec.errors import ConfigError
from blockspec.quant_config import QuantConfig, parse_quantization

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV2ForCausalLM": "deepseek_v3",
    # Kimi-K2.5/K2.6: a DeepSeek-V3 text model under `language_model.`, served text-only
    "KimiK25ForConditionalGeneration": "deepseek_v3",
}
_WRAPPERS = {"KimiK25ForConditionalGeneration": "language_model.", "kimi_k25": "language_model."}
# model_type values served by an architecture above (Kimi-K2 is DeepSeek-V3's).
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3", "deepseek_v2": "deepseek_v3"}

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown dtype {name!r}; choose one of auto, bfloat16, float16, float32"
        ) from None


def read_config_json(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """The parsed config.json of an HF folder; a missing folder/file or bad JSON is a ConfigError
    naming `what` ("model", "draft")."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"{what} path {str(path)!r} is not a directory")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"no config.json in {what} folder {str(path)!r}")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_file}: invalid JSON ({e})") from None


@dataclass
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # YaRN: the ramp's bounds in rotations over the original context, the attention factor
    # (None: from factor and mscale / mscale_all_dim), whether the ramp's ends are whole dims.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "linear", "llama3", "yarn"):
            raise ConfigError(f"unsupported rope_type {self.rope_type!r} (supported: default, "
                              "linear, llama3, yarn)")
        if self.rope_type == "yarn" and not self.original_max_position_embeddings:
            raise ConfigError("yarn rope scaling needs original_max_position_embeddings")
        if self.theta <= 0 or self.factor <= 0:
            raise ConfigError("rope_theta and rope factor must be positive")

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> RopeConfig:
        params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        original = params.get("original_max_position_embeddings")
        factor = params.get("factor")
        if factor is None and rope_type == "yarn" and original:
            # NOTE: DeepSeek-V3 configs may leave it out: the context's own ratio, as in HF.
            factor = raw.get("max_position_embeddings", original) / original

        def opt(key: str) -> float | None:
            return None if params.get(key) is None else float(params[key])

        return cls(
            theta=float(theta), rope_type=rope_type,
            factor=float(1.0 if factor is None else factor),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"),
            attention_factor=opt("attention_factor"), truncate=bool(params.get("truncate", True)),
        )


@dataclass
class ModelConfig:
    """Geometry of a decoder-only target model (Qwen3, Llama, DeepSeek-V3 / Kimi-K2)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    dtype: torch.dtype = torch.float32
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    mla: MLAConfig | None = None  # None: grouped-query attention
    moe: MoEConfig | None = None  # None: dense MLPs
    # The served model's weights sit under this prefix in the checkpoint (a multimodal
    # wrapper's language model); the wrapper's other modules are not loaded.
    checkpoint_prefix: str = ""
    # DeepSeek-V3's multi-token-prediction layers, stored after the decoder's: not served.
    mtp_layers: int = 0
    quant: QuantConfig | None = None  # a quantized checkpoint's format (quant_config.py)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model config: {name} must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("model config: num_attention_heads must be a multiple of "
                              "num_key_value_heads")
        if self.head_dim % 2:
            raise ConfigError("model config: head_dim must be even for rotary embeddings")

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @property
    def kv_cache_geometry(self) -> tuple[int, int, int]:
        """(cache tensors per layer, heads, dim) of one token's cache entry: K and V of the KV
        heads, or MLA's one latent (K = V)."""
        if self.mla is not None:
            return 1, 1, self.mla.latent_dim
        return 2, self.num_key_value_heads, self.head_dim

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ModelConfig:
        raw = read_config_json(path, "model")
        cfg_file = Path(path) / "config.json"
        quant = parse_quantization(raw.get("quantization_config") or (
            raw.get("text_config") or {}).get("quantization_config"), str(cfg_file))
        archs = raw.get("architectures") or []
        prefix = next((_WRAPPERS[k] for k in [*archs, raw.get("model_type")] if k in _WRAPPERS),
                      None)
        if prefix is not None:
            if not isinstance(raw.get("text_config"), dict):
                raise ConfigError(f"{cfg_file}: a multimodal wrapper without a text_config")
            text = {k: raw[k] for k in ("eos_token_id", "bos_token_id") if k in raw}
            cfg = cls.from_dict({**text, **raw["text_config"]}, "deepseek_v3")
            cfg.checkpoint_prefix, cfg.quant = prefix, quant
            return cfg
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = MODEL_TYPE_ALIASES.get(raw.get("model_type"), raw.get("model_type"))
            if not archs and model_type in SUPPORTED_ARCHITECTURES.values():
                arch = next(k for k, v in SUPPORTED_ARCHITECTURES.items() if v == model_type)
            else:
                raise ConfigError(
                    f"unsupported architecture {archs or model_type!r} in {cfg_file}; "
                    f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
                )
        cfg = cls.from_dict(raw, SUPPORTED_ARCHITECTURES[arch])
        cfg.quant = quant
        return cfg

    @classmethod
    def from_dict(cls, raw: dict[str, Any], model_type: str) -> ModelConfig:
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw["qk_rope_head_dim"] if model_type == "deepseek_v3"
                             else raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                rope=RopeConfig.from_hf(raw),
                dtype=parse_dtype(dtype_name),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                bos_token_id=raw.get("bos_token_id"),
                **(deepseek_fields(raw) if model_type == "deepseek_v3" else {}),
            )
        except KeyError as e:
            raise ConfigError(f"model config is missing required key {e.args[0]!r}") from None

