"""Build a model and fill it from an HF folder of safetensors (single file or sharded index)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from blockspec.config import ConfigError, ModelConfig
from blockspec.models.qwen3 import CausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {"qwen3": CausalLM, "llama": CausalLM}

# Present in some checkpoints, recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
        with torch.device(device):
            model = MODEL_CLASSES[cfg.model_type](cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval().requires_grad_(False)


def load_weights(model: nn.Module, path: str | Path, ignore_prefixes: tuple[str, ...] = ()) -> None:
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules", {})
    loaded: set[str] = set()
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or name.startswith(ignore_prefixes):
                    continue
                if name == "lm_head.weight" and name not in params:
                    continue  # tied embeddings: the model has no lm_head of its own
                try:
                    loaded.add(copy_weight(model, name, f.get_tensor(name), params))
                except KeyError:
                    raise ConfigError(f"unexpected weight {name!r} in {file.name}") from None
    expected = set()
    for name in params:
        module = name.split(".")[-2]
        shards = [k for k, (dst, _) in packed.items() if dst == module]
        expected.update(f"{name}#{i}" for i in range(len(shards))) if shards else expected.add(name)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if tied:
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
    target, shard = _map_name(name, getattr(model, "packed_modules", {}))
    param = params[target]
    if shard is None:
        _copy(param.data, tensor, name)
        return target
    sizes = model.shard_sizes(target.split(".")[-2])
    _copy(param.data.narrow(0, sum(sizes[:shard]), sizes[shard]), tensor, name)
    return f"{target}#{shard}"


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
    dst.copy_(src)


def init_dummy_weights(model: nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Random weights of the right shapes (vLLM's `load_format=dummy`), for system benchmarks."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
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
