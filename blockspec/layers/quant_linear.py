"""Linear layers over quantized weights, named as the checkpoints store them so the loader
copies tensors straight in: `weight_packed` + `weight_scale` (compressed-tensors int4) or
`weight` (e4m3) + `weight_scale_inv` (block-scaled FP8).

With backend "triton" (the engine's linear backend; CUDA, or Triton's interpreter on CPU) the
matmul runs in quant_gemm's kernel, which dequantizes each weight tile; otherwise (the CPU
path) the weight is dequantized whole and multiplied by F.linear.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.errors import ConfigError
from blockspec.layers.linear import Linear
from blockspec.layers.quant_dequant import INT4_PER_WORD, QuantWeight, dequantize
from blockspec.layers.quant_gemm import quant_linear
from blockspec.quant_config import CHANNEL


def kernel_ok(x: torch.Tensor, backend: str) -> bool:
    """Whether quant_gemm's kernels serve this input (else the dequantizing torch path)."""
    if backend != "triton":
        return False
    if x.is_cuda:
        return x.dtype in (torch.bfloat16, torch.float16)
    return os.environ.get("TRITON_INTERPRET") == "1"  # CPU: tests, in the interpreter


def int4_group(group_size: int, k: int, what: str) -> int:
    """The int4 group along an input dim of k (the whole dim for per-channel scales)."""
    group = k if group_size == CHANNEL else group_size
    if k % INT4_PER_WORD or k % group:
        raise ConfigError(f"{what}: {k} input features are not a multiple of the int4 "
                          f"packing (8) and group size ({group})")
    return group


def fp8_block_rows(rows: int, block: tuple[int, int]) -> int:
    return -(-rows // block[0])


class QuantLinear(Linear):
    """A Linear (the engine sets its `backend` like any other) whose weight is quantized;
    `quant_weight()` gives it as the kernels take it."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        nn.Module.__init__(self)  # NOTE: no dense `weight`: subclasses register theirs
        self.in_features, self.out_features = in_features, out_features
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def quant_weight(self) -> QuantWeight:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernel_ok(x, self.backend):
            y = quant_linear(x, self.quant_weight())
            return y if self.bias is None else y + self.bias
        return F.linear(x, dequantize(self.quant_weight()).to(x.dtype), self.bias)


class Int4Linear(QuantLinear):
    """compressed-tensors pack-quantized W4A16: weight_packed int32 [N, K / 8], weight_scale
    [N, K / group] (the model's dtype)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int,
                 scale_dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, bias)
        self.group = int4_group(group_size, in_features, f"int4 Linear {out_features}x"
                                                         f"{in_features}")
        self.weight_packed = nn.Parameter(torch.empty(
            out_features, in_features // INT4_PER_WORD, dtype=torch.int32), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(
            out_features, in_features // self.group, dtype=scale_dtype), requires_grad=False)

    def quant_weight(self) -> QuantWeight:
        return QuantWeight("int4", self.weight_packed, self.weight_scale, (1, self.group),
                           self.in_features)


class Fp8Linear(QuantLinear):
    """Block-scaled FP8: weight e4m3 [N, K], weight_scale_inv fp32 [ceil(N / bn),
    ceil(K / bk)]."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 block: tuple[int, int]) -> None:
        super().__init__(in_features, out_features, bias)
        self.block = block
        self.weight = nn.Parameter(torch.empty(out_features, in_features,
                                               dtype=torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(
            fp8_block_rows(out_features, block), -(-in_features // block[1]),
            dtype=torch.float32), requires_grad=False)

    def quant_weight(self) -> QuantWeight:
        return QuantWeight("fp8", self.weight, self.weight_scale_inv, self.block,
                           self.in_features)
