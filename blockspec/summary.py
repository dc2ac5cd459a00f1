"""A short description of a model folder, from its config.json and its safetensors headers
(no weights are read): what `blockspec download` prints, and where a `blockspec inspect` can
grow from."""

from __future__ import annotations

import json
from collections import Counter
from math import prod
from pathlib import Path
from typing import Any

from blockspec.errors import ConfigError
from blockspec.sizing.tensors import read_header


def tensor_stats(folder: Path) -> tuple[int, Counter[str]]:
    """(parameter count, parameters per safetensors dtype) of the weights the loader reads."""
    from blockspec.models.loader import safetensors_files

    total, by_dtype = 0, Counter()
    for file in safetensors_files(folder):
        for meta in read_header(file).values():
            n = prod(meta["shape"])
            total += n
            by_dtype[meta["dtype"]] += n
    return total, by_dtype


def summarize(folder: str | Path) -> dict[str, Any]:
    """architecture, model_type, params (None without weights), dtype (the config's), the
    weights' dtypes, and the shape fields an engine sizes itself by."""
    folder = Path(folder)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {str(folder / 'config.json')!r}: {e}") from None
    text = cfg.get("text_config") or cfg  # NOTE: multimodal wrappers keep the LM's fields here
    params, by_dtype = None, Counter()
    if any(folder.glob("*.safetensors")):  # NOTE: a download without weights has none
        params, by_dtype = tensor_stats(folder)
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "max_position_embeddings")
    out = {"architecture": ", ".join(cfg.get("architectures") or ["?"]),
           "model_type": cfg.get("model_type"), "params": params,
           "dtype": cfg.get("dtype") or cfg.get("torch_dtype") or text.get("torch_dtype"),
           "weight_dtypes": dict(by_dtype.most_common()),
           **{k: text.get(k) for k in keys}}
    if "dflash_config" in cfg:
        out["dflash_block_size"] = cfg.get("block_size")
        out["target_layer_ids"] = cfg["dflash_config"].get("target_layer_ids")
    return out


def summary_line(folder: str | Path) -> str:
    s = summarize(folder)
    params = "no weights" if s["params"] is None else f"{_count(s['params'])} params"
    stored = "/".join(s["weight_dtypes"]) or "-"
    line = (f"{s['architecture']} ({s['model_type']}), {params}, dtype {s['dtype']} (stored "
            f"{stored}); {s['num_hidden_layers']} layers, hidden {s['hidden_size']}, "
            f"{s['num_attention_heads']} heads ({s['num_key_value_heads']} KV), vocab "
            f"{s['vocab_size']}, context {s['max_position_embeddings']}")
    if "dflash_block_size" in s:
        line += (f"; DFlash drafter, block {s['dflash_block_size']}, target layers "
                 f"{s['target_layer_ids']}")
    return line


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)
