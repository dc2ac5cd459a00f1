"""Build a model and fill it from an HF folder of safetensors (single file or sharded index)."""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from blockspec.config import ConfigError, ModelConfig
from blockspec.models.deepseek_v3 import DeepseekV3ForCausalLM
from blockspec.models.quant_loader import QuantTensors, build_quantized, init_dummy_quant
from blockspec.models.qwen3 import CausalLM

log = logging.getLogger("blockspec")

MODEL_CLASSES: dict[str, type[CausalLM]] = {"qwen3": CausalLM, "llama": CausalLM,
                                            "deepseek_v3": DeepseekV3ForCausalLM}

# Present in some checkpoints, recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# One routed expert's matrix, as published checkpoints store them (transformers 5 fuses them
# into experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I], as the model does), or
# a quantized one's pieces (models/quant_experts.py names the fused tensors after them).
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                     r"weight(|_packed|_scale|_scale_inv)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def safetensors_files(path: str | Path) -> list[Path]:
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / f for f in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors weights in {str(folder)!r}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"weight shards listed in the index are missing: {missing}")
    return files


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """An uninitialised-weights model on `device` (random init; the loader overwrites it)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if cfg.quant is not None:
            model = build_quantized(MODEL_CLASSES[cfg.model_type], cfg, dtype, device)
        else:
            with torch.device(device):
                model = MODEL_CLASSES[cfg.model_type](cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval().requires_grad_(False)


def _served_name(key: str, cfg: ModelConfig | None, ignore_prefixes: tuple[str, ...]
                 ) -> tuple[str | None, str]:
    """(the model's name for checkpoint tensor `key`, or None, why it is skipped)."""
    prefix = cfg.checkpoint_prefix if cfg is not None else ""
    if not key.startswith(prefix):
        return None, "outside"  # a multimodal wrapper's vision tower and projector
    name = key[len(prefix):]
    if name.endswith(_IGNORED_SUFFIXES) or name.startswith(ignore_prefixes):
        return None, "ignored"
    m = _LAYER.match(name)
    if cfg is not None and m is not None and \
            cfg.num_hidden_layers <= int(m.group(1)) < cfg.num_hidden_layers + cfg.mtp_layers:
        return None, "mtp"  # DeepSeek-V3's multi-token-prediction layers: not served
    return name, ""


def load_weights(model: nn.Module, path: str | Path, ignore_prefixes: tuple[str, ...] = ()) -> None:
    params = dict(model.named_parameters())
    cfg = getattr(model, "config", None)
    cfg = cfg if isinstance(cfg, ModelConfig) else None
    loaded: set[str] = set()
    skipped: Counter[str] = Counter()
    quant = QuantTensors(model, cfg) if cfg is not None and cfg.quant is not None else None
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name, why = _served_name(key, cfg, ignore_prefixes)
                if name is None:
                    skipped[why] += 1
                    continue
                if name == "lm_head.weight" and name not in params:
                    continue  # tied embeddings: the model has no lm_head of its own
                tensor = f.get_tensor(key)
                try:
                    for n, t in quant.offer(name, tensor) if quant else [(name, tensor)]:
                        loaded.add(copy_weight(model, n, t, params))
                except KeyError:
                    raise ConfigError(f"unexpected weight {name!r} in {file.name}") from None
    if quant is not None:
        quant.finish()
    if skipped["outside"]:
        log.info("text-only: skipped %d weights outside %r (the wrapper's other modules)",
                 skipped["outside"], cfg.checkpoint_prefix)
    if skipped["mtp"]:
        log.info("skipped %d weights of the multi-token-prediction layers (not served)",
                 skipped["mtp"])
    _check_complete(model, params, loaded | _whole_experts(loaded, params), path)


def _check_complete(model: nn.Module, params: dict[str, nn.Parameter], loaded: set[str],
                    path: str | Path) -> None:
    packed = getattr(model, "packed_modules", {})
    expected = set()
    for name in params:
        module = name.split(".")[-2]
        shards = [k for k, (dst, _) in packed.items() if dst == module]
        expected.update(f"{name}#{i}" for i in range(len(shards))) if shards else expected.add(name)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        expected.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise ConfigError(f"checkpoint at {str(path)!r} is missing weights: {missing[:5]}"
                          + (" ..." if len(missing) > 5 else ""))


def copy_weight(model: nn.Module, name: str, tensor: torch.Tensor,
                params: dict[str, nn.Parameter] | None = None) -> str:
    """Copies one checkpoint tensor (HF name) into `model`, into its shard of a packed module
    (qkv_proj, gate_up_proj). Returns the loaded key (`param#shard` for a shard); KeyError if the
    model has no such parameter, ConfigError on a shape mismatch."""
    params = dict(model.named_parameters()) if params is None else params
    expert = _EXPERT.match(name)
    if expert is not None:
        return _copy_expert(expert, tensor, params)
    prepare = getattr(model, "prepare_checkpoint_tensor", None)
    if prepare is not None:  # NOTE: a model's own load-time reordering (MLA's rope rows)
        tensor = prepare(name, tensor)
    target, shard = _map_name(name, getattr(model, "packed_modules", {}))
    param = params[target]
    if shard is None:
        _copy(param.data, tensor, name)
        return target
    sizes = _shard_rows(model, target)
    _copy(param.data.narrow(0, sum(sizes[:shard]), sizes[shard]), tensor, name)
    return f"{target}#{shard}"


def _shard_rows(model: nn.Module, target: str) -> list[int]:
    """Rows of each shard of packed parameter `target`; a block-scaled FP8 scale has one row
    per block of weight rows, so every shard must fill whole blocks."""
    module, _, param = target.rpartition(".")
    if param != "weight_scale_inv":
        return model.shard_sizes(target)
    rows, bn = model.shard_sizes(f"{module}.weight"), model.get_submodule(module).block[0]
    if any(r % bn for r in rows):
        raise ConfigError(f"{module}: fp8 shards of {rows} rows do not fill whole {bn}-row "
                          "scale blocks, so they cannot share one tensor")
    return [r // bn for r in rows]


def _copy_expert(m: re.Match, tensor: torch.Tensor, params: dict[str, nn.Parameter]) -> str:
    """One expert's gate/up/down matrix into its row of the fused expert tensors."""
    prefix, e, proj, suffix = m.group(1), int(m.group(2)), m.group(3), m.group(4)
    target = f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}{suffix}"
    dst = params[target].data[e]
    if proj != "down_proj":
        half = dst.shape[0] // 2
        dst = dst.narrow(0, 0 if proj == "gate_proj" else half, half)
    _copy(dst, tensor, m.group(0))
    return f"{target}#{e}.{proj}"


def _whole_experts(loaded: set[str], params: dict[str, nn.Parameter]) -> set[str]:
    """Fused expert tensors every one of whose experts' matrices was loaded."""
    whole = set()
    for name, p in params.items():
        module, _, fused = name.rpartition(".")
        base = re.sub(r"_(packed|scale|scale_inv)$", "", fused)
        parts = {"gate_up_proj": ("gate_proj", "up_proj"),
                 "down_proj": ("down_proj",)}.get(base) if module.endswith("experts") else None
        if parts and all(f"{name}#{e}.{q}" in loaded for e in range(p.shape[0]) for q in parts):
            whole.add(name)
    return whole


def _map_name(name: str, packed: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in packed:
        dst, shard = packed[parts[-2]]
        return ".".join(parts[:-2] + [dst, parts[-1]]), shard
    return name, None


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ConfigError(f"weight {name!r} has shape {tuple(src.shape)}, "
                          f"the config implies {tuple(dst.shape)}")
    if dst.dtype != src.dtype and torch.float8_e4m3fn in (dst.dtype, src.dtype):
        raise ConfigError(f"weight {name!r} is {src.dtype} in the checkpoint where its "
                          f"quantization_config implies {dst.dtype}")
    dst.copy_(src)


def init_dummy_weights(model: nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Random weights of the right shapes (vLLM's `load_format=dummy`), for system benchmarks."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if init_dummy_quant(name, p, std, gen):
            continue
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif name.endswith("bias"):
            p.data.zero_()
        else:
            p.data.normal_(0.0, std, generator=gen)


def load_model(path: str | Path, cfg: ModelConfig, dtype: torch.dtype,
               device: torch.device | str, load_format: str = "auto") -> CausalLM:
    model = build_model(cfg, dtype, device)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        load_weights(model, path)
    return model
