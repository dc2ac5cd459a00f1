"""Loading a tensor-parallel rank's slice of a checkpoint, one decoder layer at a time.

The model is built on the meta device (no memory); then each unit (the embedding, final norm
and LM head; each decoder layer) is allocated whole on the host, filled from the checkpoint,
sliced for this rank (shard.py) and moved to the device before the next. A rank's host memory
thus peaks at one layer's weights, not the model's, and the device holds only its slices.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from blockspec.config import ConfigError, EngineConfig, ModelConfig
from blockspec.layers.rotary import RotaryEmbedding
from blockspec.models.loader import (
    _check_complete,
    _served_name,
    _whole_experts,
    build_model,
    copy_weight,
    init_dummy_weights,
    safetensors_files,
)
from blockspec.models.quant_loader import QuantTensors
from blockspec.parallel.shard import local_kv_config, shard_layer, shard_vocab
from blockspec.parallel.state import ParallelState, get_state

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
TOP = -1  # the unit of the embedding, final norm and LM head


def _build_on_meta(cfg: ModelConfig, dtype: torch.dtype) -> nn.Module:
    """The one-device build (quantized modules included) on the meta device."""
    model = build_model(cfg, dtype, "meta")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        _fix_buffers(model, cfg)  # NOTE: under the same default dtype as the one-GPU build
    finally:
        torch.set_default_dtype(prev)
    return model


def _allocate(unit: nn.Module) -> None:
    """The unit's meta parameters as uninitialised host tensors (the checkpoint fills them)."""
    for module in unit.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(module, name, nn.Parameter(torch.empty_like(p, device="cpu"),
                                                   requires_grad=False))


def _fix_buffers(model: nn.Module, cfg: ModelConfig) -> None:
    """Recomputes the buffers the constructors computed (on meta: lost): the shared rotary
    tables and the MoE counters."""
    fresh = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            for name, b in fresh.named_buffers():
                setattr(module, name, b.clone())
        elif hasattr(module, "expert_counts"):
            module.expert_counts = torch.zeros(2, dtype=torch.int64)


def _keys_by_unit(path: str | Path, cfg: ModelConfig) -> dict[int, list[tuple[Path, str, str]]]:
    """(file, checkpoint key, model name) of every served tensor, by unit."""
    units: dict[int, list] = defaultdict(list)
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name, _ = _served_name(key, cfg, ())
                if name is None or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue
                m = _LAYER.match(name)
                units[int(m.group(1)) if m else TOP].append((file, key, name))
    return units


def _fill(model: nn.Module, unit: nn.Module, prefix: str, entries: list, path: str | Path,
          quant: QuantTensors | None) -> None:
    """Copies the unit's checkpoint tensors into it (`quant`: a quantized checkpoint's pieces
    placed as the one-device loader places them); refuses a checkpoint that lacks some."""
    params = {n: p for n, p in model.named_parameters()
              if n.startswith(prefix) and any(p is q for q in unit.parameters())}
    loaded: set[str] = set()
    by_file: dict[Path, list] = defaultdict(list)
    for file, key, name in entries:
        by_file[file].append((key, name))
    for file, items in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for key, name in items:
                tensor = f.get_tensor(key)
                try:
                    for n, t in quant.offer(name, tensor) if quant else [(name, tensor)]:
                        loaded.add(copy_weight(model, n, t, params))
                except KeyError:
                    raise ConfigError(f"unexpected weight {name!r} in {file.name}") from None
    _check_complete(model, params, loaded | _whole_experts(loaded, params), path)


def _top_unit(model: nn.Module, cfg: ModelConfig) -> nn.ModuleList:
    parts = [model.model.embed_tokens, model.model.norm]
    if not cfg.tie_word_embeddings:
        parts.append(model.lm_head)
    return nn.ModuleList(parts)


def _load_unit(model: nn.Module, unit: nn.Module, prefix: str, entries: list,
               config: EngineConfig, seed: int, quant: QuantTensors | None) -> None:
    _allocate(unit)
    if config.load_format == "dummy":
        # NOTE: one seed per unit, the same on every rank: the ranks slice the same weights
        # (not the single-GPU engine's; dummy weights serve timings only).
        init_dummy_weights(unit, seed=seed)
    else:
        _fill(model, unit, prefix, entries, config.model_path, quant)


def load_sharded(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device, ps: ParallelState | None = None
                 ) -> tuple[nn.Module, ModelConfig]:
    """This rank's slice of the target on `device`, and the model config its KV cache sees."""
    ps = ps or get_state()
    model = _build_on_meta(cfg, dtype)
    quant = QuantTensors(model, cfg) if cfg.quant is not None else None
    units = _keys_by_unit(config.model_path, cfg) if config.load_format != "dummy" else {}
    _load_unit(model, _top_unit(model, cfg), "", units.get(TOP, []), config, seed=0,
               quant=quant)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    shard_vocab(model, cfg.vocab_size, ps, cfg.tie_word_embeddings)
    for part in (model.model.embed_tokens, model.model.norm, model.lm_head):
        part.to(device)
    local_kv = None
    for i, layer in enumerate(model.model.layers):
        _load_unit(model, layer, f"model.layers.{i}.", units.get(i, []), config, seed=i + 1,
                   quant=quant)
        local_kv = shard_layer(layer, ps)
        layer.to(device)
    if quant is not None:
        quant.finish()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # NOTE: a new parameter or computed buffer needs its unit or recomputation here
        raise RuntimeError(f"tensor-parallel load left meta tensors: {left[:3]}")
    return model, local_kv_config(cfg, local_kv)
