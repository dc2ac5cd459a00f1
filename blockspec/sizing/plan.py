"""What `blockspec inspect` reports: a model's (and drafter's) geometry, parameters, storage and
KV bytes, and the memory plan per GPU for a parallel layout. Configs and safetensors headers
only: nothing here loads a weight or needs a GPU."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from blockspec.config import ConfigError, ModelConfig, read_config_json
from blockspec.dflash.config import DFlashConfig
from blockspec.sizing.tensors import Tensor, drafter_tensors, header_tensors, model_tensors

GiB = 1 << 30
RESERVE_BYTES = GiB  # the engine's allowance for CUDA graphs and allocator slack
TP_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class ModelReport:
    path: str
    architecture: str
    config: ModelConfig
    params_total: int
    params_active: int
    quantization: str
    weights_bytes: int
    weights_source: str  # "config" or "N safetensors headers"
    skipped_bytes: dict[str, int]
    kv_bytes_per_token: int
    tensors: list[Tensor] = field(repr=False)


@dataclass
class DraftReport:
    path: str
    config: DFlashConfig
    mask_token: str | None  # the mask id's text in the target's tokenizer files, if listed
    pairs: bool
    pair_problem: str | None
    params: int
    weights_bytes: int
    kv_bytes_per_token: int
    tensors: list[Tensor] = field(repr=False)


@dataclass
class GpuPlan:
    tp: int
    ep: int
    gpu_bytes: int
    usable_bytes: int  # gpu_bytes x gpu_memory_utilization
    max_model_len: int
    weights_bytes: int  # target + drafter, per GPU
    kv_bytes_per_token: int  # target + drafter, per GPU
    context_bytes: int  # the KV cache of one max_model_len context
    left_bytes: int  # usable - weights - reserve: KV cache and activations
    problems: list[str]
    min_tp: int | None  # the smallest TP at which one context fits (None: none up to 64)

    @property
    def contexts(self) -> float:
        return max(self.left_bytes, 0) / self.context_bytes

    @property
    def fits(self) -> bool:
        return not self.problems and self.contexts >= 1


def _elem_bytes(cfg: ModelConfig, dtype: str) -> int:
    """Bytes of a 16-bit (or the chosen) activation/cache value: auto = the checkpoint's
    dtype, fp32 served as bf16 (CUDA's rule)."""
    if dtype != "auto":
        return 4 if dtype == "float32" else 2
    return 2 if cfg.dtype.itemsize == 4 else cfg.dtype.itemsize


def _quant_text(cfg: ModelConfig, tensors: list[Tensor]) -> str:
    if cfg.quant is None:
        return f"none ({str(cfg.dtype).removeprefix('torch.')})"
    linear = [t for t in tensors if t.linear]
    quantized = [t for t in linear if t.quantized]
    kinds = sorted({_kind(t.name) for t in quantized})
    rest = sorted({_kind(t.name) for t in linear if not t.quantized})
    return (f"{cfg.quant.describe()}: {len(quantized):,} of {len(linear):,} Linear weights "
            f"({', '.join(kinds) or 'none'}); 16-bit: {', '.join(rest) or 'none'}")


def _kind(name: str) -> str:
    for key, kind in ((".mlp.experts.", "routed experts"), ("shared_experts", "shared experts"),
                      ("self_attn", "attention"), ("lm_head", "lm_head")):
        if key in name:
            return kind
    return "dense MLPs"


def _architecture(raw: dict, cfg: ModelConfig) -> str:
    archs = raw.get("architectures") or [raw.get("model_type")]
    parts = [f"{archs[0]} -> {cfg.model_type}"]
    if cfg.checkpoint_prefix:
        parts.append(f"text model under {cfg.checkpoint_prefix!r}, served text-only")
    parts.append("MLA" if cfg.mla is not None else "GQA")
    if cfg.moe is not None:
        parts.append("MoE")
    return ", ".join(parts)


def inspect_model(path: str, dtype: str = "auto") -> ModelReport:
    from blockspec.models.loader import safetensors_files

    cfg = ModelConfig.from_pretrained(path)
    elem = _elem_bytes(cfg, dtype)
    # NOTE: counts and what is quantized come from the config; bytes from the headers if the
    # folder has weights (a config-only folder: from the config too).
    analytic = model_tensors(cfg, elem)
    tensors, skipped, source = analytic, {}, "config"
    try:
        files = safetensors_files(path)
    except ConfigError:
        files = []
    if files:
        tensors, skipped = header_tensors(files, cfg)
        source = f"{len(files)} safetensors header{'s' * (len(files) > 1)}"
    total = sum(t.params for t in analytic)
    experts = sum(t.params for t in analytic if t.placement == "experts")
    moe = cfg.moe
    active = total - experts + (experts * moe.num_experts_per_tok // moe.num_experts
                                if moe else 0)
    n, heads, dim = cfg.kv_cache_geometry
    return ModelReport(path=str(path), architecture=_architecture(
        read_config_json(path, "model"), cfg), config=cfg, params_total=total,
        params_active=active, quantization=_quant_text(cfg, analytic),
        weights_bytes=sum(t.nbytes for t in tensors), weights_source=source,
        skipped_bytes={k: v for k, v in skipped.items() if v},
        kv_bytes_per_token=n * heads * dim * cfg.num_hidden_layers * elem, tensors=tensors)


def _mask_text(target_path: str, token_id: int) -> str | None:
    """The mask id's text from the target's tokenizer files (no tokenizer code runs)."""
    folder = Path(target_path)
    try:
        added = json.loads((folder / "tokenizer_config.json").read_text()).get(
            "added_tokens_decoder") or {}
        if str(token_id) in added:
            return added[str(token_id)].get("content")
        for t in json.loads((folder / "tokenizer.json").read_text()).get("added_tokens", []):
            if t.get("id") == token_id:
                return t.get("content")
    except (OSError, json.JSONDecodeError, AttributeError):
        pass
    return None


def inspect_drafter(path: str, target: ModelReport, dtype: str = "auto") -> DraftReport:
    cfg = DFlashConfig.from_pretrained(path)
    problem = None
    try:
        cfg.validate_pair(target.config)
    except ConfigError as e:
        problem = str(e)
    elem = _elem_bytes(target.config, dtype)
    tensors = drafter_tensors(cfg, elem)
    n, heads, dim = cfg.geometry.kv_cache_geometry
    return DraftReport(path=str(path), config=cfg,
                       mask_token=_mask_text(target.path, cfg.mask_token_id),
                       pairs=problem is None, pair_problem=problem,
                       params=sum(t.params for t in tensors),
                       weights_bytes=sum(t.nbytes for t in tensors),
                       kv_bytes_per_token=n * heads * dim * cfg.num_layers * elem, tensors=tensors)


def _per_gpu_bytes(tensors: list[Tensor], tp: int) -> int:
    return sum(t.nbytes if t.placement == "replicated" else -(-t.nbytes // tp) for t in tensors)


def _kv_per_gpu(cfg: ModelConfig, per_token: int, tp: int) -> int:
    """MLA keeps its whole latent cache on every rank; GQA splits the KV heads (each rank
    keeps at least one)."""
    _, heads, _ = cfg.kv_cache_geometry
    return per_token if cfg.mla is not None else per_token * max(1, heads // tp) // heads


def layout_problems(cfg: ModelConfig, tp: int, ep: int) -> list[str]:
    """Why TP `tp` x EP `ep` cannot split this model (empty: it can)."""
    if tp < 1 or ep < 1 or tp % ep:
        return [f"EP ({ep}) must divide TP ({tp}), both >= 1"]
    out = []
    if cfg.num_attention_heads % tp:
        out.append(f"{cfg.num_attention_heads} attention heads do not split over TP {tp}")
    if cfg.mla is None and cfg.num_key_value_heads % tp and tp % cfg.num_key_value_heads:
        out.append(f"{cfg.num_key_value_heads} KV heads neither split over nor replicate to "
                   f"TP {tp}")
    moe, quant = cfg.moe, cfg.quant
    if moe is not None:
        if moe.num_experts % ep:
            out.append(f"{moe.num_experts} experts do not split into {ep} expert groups")
        share, per_expert = tp // ep, moe.moe_intermediate_size
        if per_expert % share:
            out.append(f"an expert's {per_expert} columns do not split over {share} GPUs")
        elif quant is not None:
            align = quant.group_size if quant.method != "fp8" else max(quant.block)
            if (per_expert // share) % min(align, per_expert):
                out.append(f"an expert's slice of {per_expert // share} columns is not whole "
                           f"quantization groups of {align}")
    return out


def plan_layout(model: ModelReport, draft: DraftReport | None, tp: int, ep: int,
                gpu_memory_gib: float, utilization: float, max_model_len: int | None) -> GpuPlan:
    cfg = model.config
    length = max_model_len or cfg.max_position_embeddings
    usable = int(gpu_memory_gib * GiB * utilization)

    def per_gpu(t: int) -> tuple[int, int]:
        weights = _per_gpu_bytes(model.tensors, t)
        kv = _kv_per_gpu(cfg, model.kv_bytes_per_token, t)
        if draft is not None:
            weights += _per_gpu_bytes(draft.tensors, t)
            kv += _kv_per_gpu(draft.config.geometry, draft.kv_bytes_per_token, t)
        return weights, kv

    def fits(t: int) -> bool:
        weights, kv = per_gpu(t)
        return not layout_problems(cfg, t, 1) and usable - weights - RESERVE_BYTES >= kv * length

    weights, kv = per_gpu(max(tp, 1))
    problems = layout_problems(cfg, tp, ep)
    if length > cfg.max_position_embeddings:
        problems.append(f"max_model_len {length} exceeds the model's max_position_embeddings "
                        f"{cfg.max_position_embeddings}")
    return GpuPlan(tp=tp, ep=ep, gpu_bytes=int(gpu_memory_gib * GiB), usable_bytes=usable,
                   max_model_len=length, weights_bytes=weights, kv_bytes_per_token=kv,
                   context_bytes=kv * length, left_bytes=usable - weights - RESERVE_BYTES,
                   problems=problems, min_tp=next((t for t in TP_SIZES if fits(t)), None))
