"""What a checkpoint holds, from its config alone or from its safetensors headers: every
tensor's name (HF names, experts one by one, without a wrapper's prefix), parameter count,
stored bytes and where a parallel layout puts it. Never reads a weight.

Placement under TP N / EP E (the parallel layout of docs/DESIGN): "experts" (routed experts,
over E groups of N / E GPUs each: 1 / N of them per GPU), "split" (attention heads, MLP columns,
vocab rows: 1 / N per GPU), "replicated" (norms, the router, MLA's down-projections q_a_proj
and kv_a_proj_with_mqa: on every GPU).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from blockspec.config import ModelConfig
from blockspec.dflash.config import DFlashConfig
from blockspec.errors import ConfigError
from blockspec.quant_config import FP8, QuantConfig

_REPLICATED = re.compile(r"norm|\.mlp\.gate\.|q_a_proj|kv_a_proj_with_mqa|correction_bias")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Tensor:
    name: str
    params: int  # dense parameters it stands for (0 for a quantized tensor's scales)
    nbytes: int
    linear: bool = False  # the weight (its first piece) of a Linear layer
    quantized: bool = False

    @property
    def placement(self) -> str:
        if ".mlp.experts." in self.name:
            return "experts"
        return "replicated" if _REPLICATED.search(self.name) else "split"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _is_linear(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and name.endswith(".weight") and "embed_tokens" not in name \
        and "norm" not in name and not name.endswith(".mlp.gate.weight")


def stored(name: str, shape: tuple[int, ...], quant: QuantConfig | None, prefix: str,
           elem: int) -> list[Tensor]:
    """The tensors a dense weight `name` of `shape` is stored as under `quant`."""
    n = _numel(shape)
    module = name.removesuffix(".weight")
    linear = _is_linear(name, shape)
    if quant is None or not linear or not quant.covers((prefix + module, module)):
        return [Tensor(name, n, n * elem, linear)]
    rows, cols = shape
    if quant.method == FP8:
        bn, bk = quant.block
        return [Tensor(name, n, n, True, True), Tensor(f"{module}.weight_scale_inv", 0,
                                                       -(-rows // bn) * -(-cols // bk) * 4)]
    group = cols if quant.group_size > cols else quant.group_size
    return [Tensor(f"{module}.weight_packed", n, rows * -(-cols // 8) * 4, True, True),
            Tensor(f"{module}.weight_scale", 0, rows * -(-cols // group) * elem),
            Tensor(f"{module}.weight_shape", 0, 16)]


def _mla_layer(cfg: ModelConfig, p: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    mla, h, heads = cfg.mla, cfg.hidden_size, cfg.num_attention_heads
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    if mla.q_lora_rank is None:
        yield f"{p}.self_attn.q_proj.weight", (heads * qk, h)
    else:
        yield f"{p}.self_attn.q_a_proj.weight", (mla.q_lora_rank, h)
        yield f"{p}.self_attn.q_a_layernorm.weight", (mla.q_lora_rank,)
        yield f"{p}.self_attn.q_b_proj.weight", (heads * qk, mla.q_lora_rank)
    yield f"{p}.self_attn.kv_a_proj_with_mqa.weight", (mla.latent_dim, h)
    yield f"{p}.self_attn.kv_a_layernorm.weight", (mla.kv_lora_rank,)
    yield f"{p}.self_attn.kv_b_proj.weight", (heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                              mla.kv_lora_rank)
    yield f"{p}.self_attn.o_proj.weight", (h, heads * mla.v_head_dim)


def _gqa_layer(cfg: ModelConfig, p: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, \
        cfg.num_key_value_heads * cfg.head_dim
    for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        yield f"{p}.self_attn.{proj}.weight", (rows, h)
    yield f"{p}.self_attn.o_proj.weight", (h, q)
    if cfg.qk_norm:
        yield f"{p}.self_attn.q_norm.weight", (cfg.head_dim,)
        yield f"{p}.self_attn.k_norm.weight", (cfg.head_dim,)


def _mlp(p: str, h: int, i: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    yield f"{p}.gate_proj.weight", (i, h)
    yield f"{p}.up_proj.weight", (i, h)
    yield f"{p}.down_proj.weight", (h, i)


def _mlp_layer(cfg: ModelConfig, p: str, index: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    moe, h = cfg.moe, cfg.hidden_size
    if moe is None or not moe.is_moe_layer(index):
        yield from _mlp(f"{p}.mlp", h, cfg.intermediate_size)
        return
    yield f"{p}.mlp.gate.weight", (moe.num_experts, h)
    yield f"{p}.mlp.gate.e_score_correction_bias", (moe.num_experts,)
    for e in range(moe.num_experts):
        yield from _mlp(f"{p}.mlp.experts.{e}", h, moe.moe_intermediate_size)
    if moe.n_shared_experts:
        yield from _mlp(f"{p}.mlp.shared_experts", h,
                        moe.moe_intermediate_size * moe.n_shared_experts)


def model_tensors(cfg: ModelConfig, elem: int) -> list[Tensor]:
    """The text model's tensors as its config implies (MTP layers and a wrapper's other
    modules are not served, so not listed), `elem` bytes per 16-bit value."""
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes += [(f"{p}.input_layernorm.weight", (cfg.hidden_size,)),
                   (f"{p}.post_attention_layernorm.weight", (cfg.hidden_size,))]
        shapes += list(_mla_layer(cfg, p) if cfg.mla is not None else _gqa_layer(cfg, p))
        shapes += list(_mlp_layer(cfg, p, i))
    shapes.append(("model.norm.weight", (cfg.hidden_size,)))
    if not cfg.tie_word_embeddings:
        shapes.append(("lm_head.weight", (cfg.vocab_size, cfg.hidden_size)))
    return [t for name, shape in shapes
            for t in stored(name, shape, cfg.quant, cfg.checkpoint_prefix, elem)]


def drafter_tensors(d: DFlashConfig, elem: int) -> list[Tensor]:
    """A DFlash drafter's tensors (no embedding or lm_head: it uses the target's)."""
    g = d.geometry
    h = g.hidden_size
    shapes = [("fc.weight", (h, len(d.target_layer_ids) * h)), ("hidden_norm.weight", (h,)),
              ("norm.weight", (h,))]
    for i in range(g.num_hidden_layers):
        p = f"layers.{i}"
        shapes += [(f"{p}.input_layernorm.weight", (h,)),
                   (f"{p}.post_attention_layernorm.weight", (h,))]
        shapes += list(_gqa_layer(g, p)) + list(_mlp(f"{p}.mlp", h, g.intermediate_size))
    return [Tensor(name, _numel(s), _numel(s) * elem) for name, s in shapes]


def read_header(file: Path) -> dict[str, dict]:
    """A safetensors file's header: {name: {dtype, shape, data_offsets}} (8 + N bytes read).
    NOTE: the file opens with the header's length (u64, little-endian), then the JSON."""
    file = Path(file)
    with open(file, "rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        try:
            if not 0 < size <= file.stat().st_size - 8:
                raise ValueError
            header = json.loads(f.read(size))
        except ValueError:
            raise ConfigError(f"{str(file)!r} is not a safetensors file") from None
    header.pop("__metadata__", None)
    return header


def header_tensors(files: list[Path], cfg: ModelConfig) -> tuple[list[Tensor], dict[str, int]]:
    """(the served text model's tensors, bytes of those not served by kind: "outside" a
    wrapper's text model, "mtp" layers) from the files' headers."""
    served: list[Tensor] = []
    skipped = {"outside": 0, "mtp": 0}
    for file in files:
        for key, info in read_header(file).items():
            start, end = info["data_offsets"]
            if not key.startswith(cfg.checkpoint_prefix):
                skipped["outside"] += end - start
                continue
            name = key[len(cfg.checkpoint_prefix):]
            m = _LAYER.match(name)
            if m is not None and int(m.group(1)) >= cfg.num_hidden_layers:
                skipped["mtp"] += end - start
                continue
            shape = tuple(info["shape"])
            packed = name.endswith("weight_packed")
            params = _numel(shape) * (8 if packed else 1)
            if name.endswith(("_scale", "_scale_inv", "weight_shape")):
                params = 0
            served.append(Tensor(name, params, end - start))
    return served, skipped
