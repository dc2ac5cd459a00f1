"""Building and filling a model from a quantized checkpoint (quant_config.py's formats).

The model is built on the meta device, its Linear layers and routed experts that the
checkpoint stores quantized are swapped for their quantized twins (layers/quant_linear.py,
models/quant_experts.py), and only then are tensors allocated: a 1T-parameter model never
exists in 16 bits. Modules that the model reads the weight of directly (its
`dense_weight_modules`: MLA's kv_b_proj) stay dense; their quantized tensors are held while the
checkpoint is read and dequantized once all have arrived (`QuantTensors`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from blockspec.config import ConfigError, ModelConfig
from blockspec.layers.linear import Linear
from blockspec.layers.quant_dequant import dequantize_fp8, dequantize_int4
from blockspec.layers.quant_linear import Fp8Linear, Int4Linear, QuantLinear, int4_group
from blockspec.layers.rotary import RotaryEmbedding
from blockspec.models.quant_experts import Fp8Experts, Int4Experts
from blockspec.quant_config import FP8, QuantConfig

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
# What each quantized checkpoint tensor of a module is called, per format.
_PIECES = {"int4": ("weight_packed", "weight_scale", "weight_shape"),
           FP8: ("weight", "weight_scale_inv")}


def build_quantized(cls: type[nn.Module], cfg: ModelConfig, dtype: torch.dtype,
                    device: torch.device | str) -> nn.Module:
    """`cls(cfg)` with its quantized layers swapped in, allocated on `device` (uninitialised
    weights: the loader fills them)."""
    with torch.device("meta"):
        model = cls(cfg)
        for name, module in list(model.named_modules()):
            twin = _quantized_twin(model, cfg, name, module, dtype)
            if twin is not None:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, twin)
    _materialize(model, cfg, torch.device(device))
    return model


def _checkpoint_names(model: nn.Module, cfg: ModelConfig, name: str) -> list[tuple[str, ...]]:
    """The checkpoint modules behind model module `name`, each with and without the wrapper's
    prefix. NOTE: quantization tools name modules in the model they loaded, wrapper or not."""
    parts = name.split(".")
    shards = [k for k, (dst, _) in getattr(model, "packed_modules", {}).items()
              if dst == parts[-1]]
    names = [".".join(parts[:-1] + [s]) for s in shards] or [name]
    return [(cfg.checkpoint_prefix + n, n) for n in names]


def _covered(quant: QuantConfig, names: list[tuple[str, ...]], what: str) -> bool:
    """Whether the checkpoint stores these modules quantized; they must agree (one tensor)."""
    flags = {quant.covers(n) for n in names}
    if len(flags) > 1:
        raise ConfigError(f"quantization_config quantizes some but not all of {what}'s "
                          "checkpoint modules, which are one tensor here")
    return flags.pop()


def _quantized_twin(model: nn.Module, cfg: ModelConfig, name: str, module: nn.Module,
                    dtype: torch.dtype) -> nn.Module | None:
    quant = cfg.quant
    if isinstance(module, Linear) and not isinstance(module, QuantLinear):
        if name.split(".")[-1] in getattr(model, "dense_weight_modules", ()) or \
                (name == "lm_head" and cfg.tie_word_embeddings) or \
                not _covered(quant, _checkpoint_names(model, cfg, name), name):
            return None  # NOTE: a tied lm_head is the embedding, never quantized
        k, n, bias = module.in_features, module.out_features, module.bias is not None
        if quant.method == FP8:
            return Fp8Linear(k, n, bias, quant.block)
        return Int4Linear(k, n, bias, quant.group_size, dtype)
    if type(module).__name__ == "Experts" and cfg.moe is not None:
        names = [(cfg.checkpoint_prefix + f"{name}.{e}.{p}", f"{name}.{e}.{p}")
                 for e in range(cfg.moe.num_experts) for p in EXPERT_PROJS]
        if not _covered(quant, names, name):
            return None
        if quant.method == FP8:
            return Fp8Experts(cfg, quant.block)
        return Int4Experts(cfg, quant.group_size, dtype)
    return None


def _materialize(model: nn.Module, cfg: ModelConfig, device: torch.device) -> None:
    """Allocates every meta parameter on `device` (shared ones stay shared) and recomputes the
    buffers the constructors had computed."""
    params: dict[int, nn.Parameter] = {}
    rotary: list[RotaryEmbedding] = []
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in params:
                params[id(p)] = nn.Parameter(torch.empty_like(p, device=device),
                                             requires_grad=p.requires_grad)
            setattr(module, name, params[id(p)])
        for name, b in list(module.named_buffers(recurse=False)):
            if isinstance(module, RotaryEmbedding):
                if not rotary:
                    with torch.device(device):
                        rotary.append(RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                                      cfg.rope))
                fresh = getattr(rotary[0], name)
                assert fresh.shape == b.shape, f"rotary table {name}: {fresh.shape} != {b.shape}"
                setattr(module, name, fresh.clone())
            elif name == "expert_counts":
                setattr(module, name, torch.zeros_like(b, device=device))
            else:
                # NOTE: a new buffer computed at construction needs its recomputation here.
                raise RuntimeError(f"quantized build: buffer {name!r} of "
                                   f"{type(module).__name__} has no re-initialisation")
        for name, v in list(vars(module).items()):
            if isinstance(v, torch.Tensor) and v.is_meta:  # placeholders (attention's caches)
                if v.numel():
                    raise RuntimeError(f"quantized build: tensor {name!r} of "
                                       f"{type(module).__name__} has no re-initialisation")
                setattr(module, name, torch.empty(0, dtype=v.dtype, device=device))


class QuantTensors:
    """Checkpoint tensors the plain copy cannot place: `weight_shape` (checked against the
    model, then dropped) and the quantized pieces of modules kept dense (held, then
    dequantized into their `weight`)."""

    def __init__(self, model: nn.Module, cfg: ModelConfig) -> None:
        self.model, self.cfg = model, cfg
        self.fmt = "fp8" if cfg.quant.method == FP8 else "int4"
        dense = getattr(model, "dense_weight_modules", ())
        self.dense = {n for n, m in model.named_modules()
                      if n.split(".")[-1] in dense and isinstance(m, Linear)
                      and _covered(cfg.quant, _checkpoint_names(model, cfg, n), n)}
        self.held: dict[str, dict[str, torch.Tensor]] = {}

    def offer(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The (name, tensor) pairs to copy for checkpoint tensor `name` (none while held)."""
        module, _, piece = name.rpartition(".")
        if module in self.dense and piece in _PIECES[self.fmt]:
            got = self.held.setdefault(module, {})
            got[piece] = tensor
            if len(got) < len(_PIECES[self.fmt]):
                return []
            return [(f"{module}.weight", self._dequantize(module, self.held.pop(module)))]
        if piece == "weight_shape":
            _check_shape(self.model, self.cfg, name, tensor)
            return []
        return [(name, tensor)]

    def _dequantize(self, module: str, got: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.fmt == "fp8":
            return dequantize_fp8(got["weight"], got["weight_scale_inv"], self.cfg.quant.block)
        n, k = (int(v) for v in got["weight_shape"])
        group = int4_group(self.cfg.quant.group_size, k, module)
        return dequantize_int4(got["weight_packed"], got["weight_scale"], group, k)

    def finish(self) -> None:
        if self.held:
            name, got = next(iter(self.held.items()))
            missing = sorted(set(_PIECES[self.fmt]) - set(got))
            raise ConfigError(f"quantized weight {name!r} is missing {missing} in the "
                              "checkpoint")


_EXPERT_SHAPE = re.compile(r"^.*\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight_shape$")


def _check_shape(model: nn.Module, cfg: ModelConfig, name: str, tensor: torch.Tensor) -> None:
    """A compressed-tensors `weight_shape` must be the dense shape the config implies."""
    got = tuple(int(v) for v in tensor.reshape(-1))
    m = _EXPERT_SHAPE.match(name)
    if m is not None:
        h, i = cfg.hidden_size, cfg.moe.moe_intermediate_size
        want = (h, i) if m.group(1) == "down_proj" else (i, h)
    else:
        module, parts = name.rpartition(".")[0], name.split(".")
        packed = getattr(model, "packed_modules", {})
        if parts[-2] in packed:
            dst, shard = packed[parts[-2]]
            target = ".".join(parts[:-2] + [dst])
            rows = model.shard_sizes(f"{target}.weight_packed")[shard]
            want = (rows, model.get_submodule(target).in_features)
        else:
            try:
                lin = model.get_submodule(module)
            except AttributeError:
                raise ConfigError(f"unexpected weight {name!r}") from None
            want = (lin.out_features, lin.in_features)
    if got != want:
        raise ConfigError(f"{name} is {list(got)}; the config implies {list(want)}")


def init_dummy_quant(name: str, p: torch.Tensor, std: float, gen: torch.Generator) -> bool:
    """Random quantized weights of roughly `std` (benchmarks' load_format=dummy); False for a
    parameter that is not a quantized one."""
    if p.dtype == torch.int32:
        p.data.random_(-(1 << 31), (1 << 31) - 1, generator=gen)
    elif p.dtype == torch.float8_e4m3fn:
        for row in p.data.view(-1, p.shape[-1]).split(4096):  # NOTE: no fp32 copy of it all
            row.copy_(torch.randn(row.shape, generator=gen, device=p.device))
    elif name.endswith(("_scale", "_scale_inv")):
        # NOTE: int4 values spread ~4.6 around 0, e4m3 ones ~1 (drawn from a unit normal).
        p.data.fill_(std / 4.6 if name.endswith("_scale") else std)
    else:
        return False
    return True
