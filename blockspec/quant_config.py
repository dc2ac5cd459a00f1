"""Quantized checkpoints, read from config.json's `quantization_config`.

Two formats are served:
- compressed-tensors "pack-quantized" W4A16 (Kimi K2.x's INT4 routed experts): symmetric int4
  weights, eight to an int32 (`weight_packed`), one scale per `group_size` input columns
  (`weight_scale`), the dense shape in `weight_shape`; activations stay 16-bit. Which Linear
  layers it covers comes from each config group's `targets` minus `ignore`.
- block-scaled FP8 (`quant_method: fp8`: DeepSeek-V3, Kimi-K2-Instruct): e4m3 `weight` and one
  fp32 `weight_scale_inv` per `weight_block_size` block; every Linear except `lm_head` and
  `modules_to_not_convert`. Served as W8A16: the weight is dequantized in the kernel.
Anything else is refused by name, with what is supported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from blockspec.errors import ConfigError

INT4 = "compressed-tensors"
FP8 = "fp8"
_SUPPORTED = ("compressed-tensors pack-quantized W4A16 (int4, symmetric, group or channel "
              "scales) and fp8 block-quantized (e4m3, weight_block_size)")


@dataclass(frozen=True)
class QuantConfig:
    """One checkpoint's quantization. `group_size` (int4): input columns per scale;
    `block` (fp8): the (rows, columns) of weight each scale covers."""

    method: str
    group_size: int = 0
    block: tuple[int, int] = (0, 0)
    targets: tuple[str, ...] = ()  # int4: compressed-tensors targets ("Linear", names, re:...)
    ignore: tuple[str, ...] = ()  # int4: `ignore`; fp8: `modules_to_not_convert`

    def __post_init__(self) -> None:
        if self.method == INT4:
            if self.group_size <= 0 or self.group_size % 8:
                raise ConfigError(f"int4 group_size must be a positive multiple of 8, got "
                                  f"{self.group_size}")
            if not self.targets:
                raise ConfigError("compressed-tensors config: no targets")
        elif self.method == FP8:
            if min(self.block) <= 0:
                raise ConfigError(f"fp8 weight_block_size must be positive, got {self.block}")
        else:
            raise ConfigError(f"unknown quantization method {self.method!r}")

    def covers(self, names: tuple[str, ...]) -> bool:
        """Whether the Linear layer known by any of `names` (its checkpoint name, with and
        without a wrapper's prefix) is stored quantized."""
        if self.method == FP8:
            # NOTE: HF's FP8 format converts every nn.Linear but lm_head and the listed ones.
            skip = ("lm_head", *self.ignore)
            return not any(s in n for s in skip for n in names)
        return any(_match(t, n) for t in self.targets for n in names) and \
            not any(_match(i, n) for i in self.ignore for n in names)

    def describe(self) -> str:
        if self.method == INT4:
            scales = ("per channel" if self.group_size == CHANNEL else
                      f"group {self.group_size}")
            return f"compressed-tensors pack-quantized W4A16 (int4, {scales}, symmetric)"
        return (f"fp8 e4m3 block-quantized {list(self.block)} (served W8A16: activations stay "
                "16-bit)")


# NOTE: a per-channel int4 scheme is a group as wide as the layer; the module takes its width.
CHANNEL = 1 << 30


def _match(target: str, name: str) -> bool:
    """compressed-tensors' rule: `re:` prefix = re.match, a class name "Linear" matches every
    Linear, anything else the exact module name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == "Linear" or target == name


def parse_quantization(raw: dict[str, Any] | None, where: str) -> QuantConfig | None:
    """The QuantConfig of a `quantization_config` (None for none); ConfigError naming `where`
    for a method or scheme that is not served."""
    if not raw:
        return None
    method = raw.get("quant_method")
    if method == INT4:
        return _compressed_tensors(raw, where)
    if method == FP8:
        return _fp8(raw, where)
    raise ConfigError(f"{where}: quantization {method or 'of unknown method'!r} is not "
                      f"supported (supported: {_SUPPORTED}); use one of those or a bf16 "
                      "checkpoint")


def _refuse(where: str, what: str) -> ConfigError:
    return ConfigError(f"{where}: {what} is not supported (supported: {_SUPPORTED})")


def _compressed_tensors(raw: dict[str, Any], where: str) -> QuantConfig:
    groups = raw.get("config_groups") or {}
    if not groups:
        raise _refuse(where, "a compressed-tensors config without config_groups")
    if raw.get("kv_cache_scheme"):
        raise _refuse(where, "a quantized KV cache (kv_cache_scheme)")
    sizes, targets = set(), []
    for name, group in groups.items():
        sizes.add(_w4a16_group_size(group, raw.get("format"), f"{where}: config group {name!r}"))
        targets += list(group.get("targets") or [])
    if len(sizes) > 1:
        raise _refuse(where, f"config groups with different group sizes {sorted(sizes)}")
    return QuantConfig(method=INT4, group_size=sizes.pop(), targets=tuple(targets),
                       ignore=tuple(raw.get("ignore") or ()))


def _w4a16_group_size(group: dict[str, Any], top_format: str | None, where: str) -> int:
    """A config group's group size, if it is W4A16 pack-quantized; ConfigError otherwise."""
    fmt = group.get("format") or top_format
    if fmt != "pack-quantized":
        raise _refuse(where, f"compressed-tensors format {fmt!r}")
    if group.get("input_activations") or group.get("output_activations"):
        raise _refuse(where, "quantized activations (only W4A16: weights int4, activations "
                             "16-bit)")
    w = group.get("weights") or {}
    checks = [(w.get("num_bits") == 4, f"{w.get('num_bits')}-bit weights"),
              (w.get("type", "int") == "int", f"{w.get('type')!r} weights"),
              (w.get("symmetric", True), "asymmetric weights (zero points)"),
              (w.get("actorder") in (None, "static"), f"actorder {w.get('actorder')!r} (g_idx)"),
              (not w.get("dynamic"), "dynamic weight scales"),
              (w.get("strategy") in ("group", "channel"), f"strategy {w.get('strategy')!r}")]
    for ok, what in checks:
        if not ok:
            raise _refuse(where, what)
    return CHANNEL if w["strategy"] == "channel" else int(w.get("group_size") or 0)


def _fp8(raw: dict[str, Any], where: str) -> QuantConfig:
    if raw.get("fmt", "e4m3") != "e4m3":
        raise _refuse(where, f"fp8 format {raw.get('fmt')!r}")
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse(where, f"fp8 activation_scheme {raw.get('activation_scheme')!r} (static "
                             "input scales)")
    block = raw.get("weight_block_size")
    if not block or len(block) != 2:
        raise _refuse(where, "fp8 without weight_block_size (per-tensor scales)")
    skip = raw.get("modules_to_not_convert") or raw.get("ignored_layers") or ()
    return QuantConfig(method=FP8, block=(int(block[0]), int(block[1])), ignore=tuple(skip))
