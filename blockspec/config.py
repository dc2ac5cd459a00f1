"""Dataclass configs, validated on construction.

`ModelConfig` is read straight from an HF `config.json` (no hub access, no remote code) so that the
same folder works with transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
}

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


class ConfigError(ValueError):
    """A user-facing configuration problem: the CLI prints it as one line, no traceback."""


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

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "linear", "llama3"):
            raise ConfigError(
                f"unsupported rope_type {self.rope_type!r} (supported: default, linear, llama3)"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ConfigError("rope_theta and rope factor must be positive")

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> RopeConfig:
        params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=params.get("original_max_position_embeddings"),
        )


@dataclass
class ModelConfig:
    """Geometry of a decoder-only target model (Qwen3 or Llama family)."""

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

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ModelConfig:
        raw = read_config_json(path, "model")
        cfg_file = Path(path) / "config.json"
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = raw.get("model_type")
            if not archs and model_type in SUPPORTED_ARCHITECTURES.values():
                arch = next(k for k, v in SUPPORTED_ARCHITECTURES.items() if v == model_type)
            else:
                raise ConfigError(
                    f"unsupported architecture {archs or model_type!r} in {cfg_file}; "
                    f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
                )
        return cls.from_dict(raw, SUPPORTED_ARCHITECTURES[arch])

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
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                rope=RopeConfig.from_hf(raw),
                dtype=parse_dtype(dtype_name),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                bos_token_id=raw.get("bos_token_id"),
            )
        except KeyError as e:
            raise ConfigError(f"model config is missing required key {e.args[0]!r}") from None


@dataclass
class EngineConfig:
    """Everything the engine needs besides the weights. Names follow vLLM's engine args."""

    model: str
    dtype: str = "auto"
    device: str | None = None  # None: cuda when available, else cpu
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # Prefill tokens of a step that also decodes (they delay every running stream): 0, the
    # default, only max_num_batched_tokens bounds them; N at most N; None ("auto") 12 per
    # decoding sequence, at least 256: lower ITL tails, fewer tokens/s (docs/serving.md).
    decode_step_prefill_tokens: int | None = 0
    kv_block_size: int = 16
    kv_cache_memory_gb: float | None = None  # None: 1 GiB on CPU; on CUDA what is left of
    # gpu_memory_utilization x total after weights and a profiled warm-up forward
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # overrides the memory budget (tests, debugging)
    enable_prefix_caching: bool = True
    seed: int = 0
    tokenizer: str | None = None
    load_format: str = "auto"  # "dummy": random weights from config.json (benchmarks only)
    draft: str | None = None  # DFlash drafter folder: enables speculative decoding
    block_size: int | None = None  # speculative block (verified tokens); None: the drafter's
    enforce_eager: bool = False  # CUDA: no graphs
    # Speculation policy (with a drafter): "adaptive" picks plain decode or one of `block_sizes`
    # each step from measured step costs and live acceptance; "fixed" always runs the max block.
    # Without a drafter the policy and the profile are ignored, and `block_sizes` is refused.
    speculation_policy: str = "adaptive"
    # Block lengths the adaptive policy may run (the max block is always one). None: those of
    # 2, 4, 8, 16 below the max block, plus the max block (`block_size`, else the largest given
    # here, else the drafter's trained block size).
    block_sizes: tuple[int, ...] | None = None
    # Step-cost profile file (adaptive mode). None: a cache file under ~/.cache/blockspec
    # (or $BLOCKSPEC_CACHE), keyed by what changes costs; "none" or "": measure every start.
    cost_profile: str | None = None
    # With a drafter: while the policy decodes plainly (a long streak, or a load at which it
    # would), stop writing the drafter's context ("detached" mode) and catch it up with one
    # eager target pass before the drafter next runs. None: on with the adaptive policy.
    lazy_draft_context: bool | None = None
    # A step that mixes prefill chunks with decodes runs the chunks as their own forward (a
    # CUDA graph per token bucket) beside the graphed decode step, not one eager forward of the
    # mixed batch. None: on with CUDA graphs; True elsewhere runs the same path eagerly.
    split_prefill: bool | None = None
    attention_backend: str = "auto"  # auto: triton on CUDA, torch on CPU
    # Matmuls of at most 16 rows (small decode steps): auto = Triton kernels on CUDA (they read
    # the weights faster than cuBLAS there), torch (F.linear / cuBLAS) on CPU and for the rest.
    linear_backend: str = "auto"
    # Benchmark-only: accept each draft position with this probability instead of checking it.
    # Output is then NOT the target's; `benchmark_mode=True` must be set to use it.
    synthetic_acceptance: float | None = None
    benchmark_mode: bool = False

    def __post_init__(self) -> None:
        self._validate_device()
        self._validate_sizes()
        self._validate_speculation()
        self._validate_synthetic()
        for name, value, allowed in (("attention backend", self.attention_backend,
                                      ("auto", "torch", "triton")),
                                     ("linear backend", self.linear_backend,
                                      ("auto", "torch", "triton")),
                                     ("load_format", self.load_format, ("auto", "dummy"))):
            if value not in allowed:
                raise ConfigError(f"{name} must be {', '.join(allowed[:-1])} or {allowed[-1]}, "
                                  f"got {value!r}")

    def _validate_device(self) -> None:
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ConfigError(f"unknown device {self.device!r}; choose cpu or cuda")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device cuda requested but no CUDA GPU is available")
        if self.dtype != "auto":
            parse_dtype(self.dtype)

    def _validate_sizes(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.decode_step_prefill_tokens is not None and self.decode_step_prefill_tokens < 0:
            raise ConfigError("decode_step_prefill_tokens must be >= 0 (0: no cap)")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError("max_model_len must be positive")
        if self.kv_block_size <= 0 or self.kv_block_size & (self.kv_block_size - 1):
            raise ConfigError("kv_block_size must be a positive power of two")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ConfigError("kv cache memory budget must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ConfigError("num_kv_blocks must be positive")

    def _validate_synthetic(self) -> None:
        if self.synthetic_acceptance is None:
            return
        if not self.benchmark_mode:
            raise ConfigError("synthetic acceptance is a benchmark-only mode (its output is "
                              "not the target's); it is refused outside benchmarks")
        if not 0.0 <= self.synthetic_acceptance <= 1.0:
            raise ConfigError("synthetic acceptance must be a probability in [0, 1]")
        if self.draft is None:
            raise ConfigError("synthetic acceptance needs a draft model")

    @property
    def use_lazy_draft_context(self) -> bool:
        """`lazy_draft_context`, resolved: None means on with a drafter and the adaptive policy
        (the policy is what decides to decode plainly)."""
        if self.lazy_draft_context is not None:
            return self.lazy_draft_context
        return self.draft is not None and self.speculation_policy == "adaptive"

    def _validate_speculation(self) -> None:
        if self.block_size is not None and self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2, got {self.block_size}")
        if self.block_size is not None and self.draft is None:
            raise ConfigError("block_size is the speculative block length: it needs a draft model")
        if self.speculation_policy not in ("adaptive", "fixed"):
            raise ConfigError(f"speculation policy must be adaptive or fixed, got "
                              f"{self.speculation_policy!r}")
        if self.lazy_draft_context is not None and not isinstance(self.lazy_draft_context, bool):
            raise ConfigError(f"lazy_draft_context must be true, false or None (auto), got "
                              f"{self.lazy_draft_context!r}")
        if self.lazy_draft_context and self.draft is None:
            raise ConfigError("lazy draft context defers the drafter's context writes: it needs "
                              "a draft model")
        if self.block_sizes is None:
            return
        try:
            sizes = tuple(sorted({int(b) for b in self.block_sizes}))
        except (TypeError, ValueError):
            raise ConfigError(f"block sizes must be integers, got {self.block_sizes!r}") from None
        if not sizes:
            raise ConfigError("block sizes must not be empty")
        if sizes[0] < 2:
            raise ConfigError(f"block sizes must be >= 2 (1 is plain decode, always a choice), "
                              f"got {list(sizes)}")
        if self.draft is None:
            raise ConfigError("block sizes are speculative block lengths: they need a draft model")
        if self.block_size is not None and sizes[-1] > self.block_size:
            raise ConfigError(f"block sizes {list(sizes)} exceed block_size {self.block_size} "
                              "(the max block)")
        self.block_sizes = sizes

    def resolve_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """`auto`: the checkpoint's dtype on CUDA (fp32 checkpoints run in bf16), fp32 on CPU."""
        if self.dtype != "auto":
            return parse_dtype(self.dtype)
        if str(self.device).startswith("cpu"):
            return torch.float32
        return torch.bfloat16 if checkpoint_dtype == torch.float32 else checkpoint_dtype
