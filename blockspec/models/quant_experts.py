"""Routed experts over quantized weights: the twins of deepseek_v3.Experts (gate_up [E, 2I, H]
with gate rows first, down [E, H, I]) for compressed-tensors int4 and block-scaled FP8
checkpoints, with the same forward call. Parameters are named after the fused tensor plus the
checkpoint's suffix (gate_up_proj_packed <- experts.{e}.gate_proj.weight_packed, ...), so the
loader places each expert's tensors as it does the dense ones.

backend "triton" (CUDA, or the interpreter on CPU): quant_gemm's grouped GEMMs, which
dequantize in the kernel; otherwise experts_reference over the experts the tokens chose,
dequantized one by one (the CPU path).
"""

from __future__ import annotations

import torch
from torch import nn

from blockspec.config import ModelConfig
from blockspec.errors import ConfigError
from blockspec.layers.moe import count_experts, experts_reference
from blockspec.layers.quant_dequant import INT4_PER_WORD, DequantizedExperts, QuantWeight
from blockspec.layers.quant_gemm import fused_experts_quant
from blockspec.layers.quant_linear import int4_group, kernel_ok
from blockspec.layers.side_stream import Residual


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class QuantExperts(nn.Module):
    def weights(self) -> tuple[QuantWeight, QuantWeight]:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                backend: str, stats: torch.Tensor,
                residual: Residual = None) -> torch.Tensor:
        gate_up, down = self.weights()
        if kernel_ok(x, backend):
            return fused_experts_quant(x, weights, ids, gate_up, down, stats,
                                       residual=residual)
        count_experts(ids, gate_up.data.shape[0], stats)
        return experts_reference(x, weights, ids, DequantizedExperts(gate_up, x.dtype),
                                 DequantizedExperts(down, x.dtype), residual)


class Int4Experts(QuantExperts):
    """compressed-tensors W4A16: *_packed int32 [E, N, K / 8], *_scale [E, N, K / group]."""

    def __init__(self, cfg: ModelConfig, group_size: int, scale_dtype: torch.dtype) -> None:
        super().__init__()
        e, h, i = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.moe_intermediate_size
        self.hidden, self.inter = h, i
        self.group_h = int4_group(group_size, h, "int4 experts' gate/up")
        self.group_i = int4_group(group_size, i, "int4 experts' down")
        self.gate_up_proj_packed = _param(e, 2 * i, h // INT4_PER_WORD, dtype=torch.int32)
        self.gate_up_proj_scale = _param(e, 2 * i, h // self.group_h, dtype=scale_dtype)
        self.down_proj_packed = _param(e, h, i // INT4_PER_WORD, dtype=torch.int32)
        self.down_proj_scale = _param(e, h, i // self.group_i, dtype=scale_dtype)

    def sliced(self, first: int, count: int, part: int, parts: int) -> Int4Experts:
        """Experts [first, first + count), each keeping part `part` of `parts` of its
        intermediate size (gate/up rows, down's packed columns and their scale groups): an
        expert-parallel rank's share. The slice must hold whole scale groups and words."""
        i, full = self.inter // parts, self.inter
        if self.inter % parts or i % self.group_i or i % INT4_PER_WORD:
            raise ConfigError(f"int4 experts: intermediate size {full} does not split into "
                              f"{parts} parts of whole {self.group_i}-column scale groups")
        rows = torch.cat([torch.arange(part * i, (part + 1) * i),
                          torch.arange(full + part * i, full + (part + 1) * i)])
        e = slice(first, first + count)
        out = Int4Experts.__new__(Int4Experts)
        nn.Module.__init__(out)
        out.hidden, out.inter, out.group_h, out.group_i = self.hidden, i, self.group_h, self.group_i

        def keep(t: torch.Tensor, cols: int | None = None) -> nn.Parameter:
            t = t.data[e]
            t = t[:, rows] if cols is None else t[..., part * cols:(part + 1) * cols]
            return nn.Parameter(t.contiguous(), requires_grad=False)

        out.gate_up_proj_packed, out.gate_up_proj_scale = keep(self.gate_up_proj_packed), \
            keep(self.gate_up_proj_scale)
        out.down_proj_packed = keep(self.down_proj_packed, i // INT4_PER_WORD)
        out.down_proj_scale = keep(self.down_proj_scale, i // self.group_i)
        return out

    def weights(self) -> tuple[QuantWeight, QuantWeight]:
        return (QuantWeight("int4", self.gate_up_proj_packed, self.gate_up_proj_scale,
                            (1, self.group_h), self.hidden),
                QuantWeight("int4", self.down_proj_packed, self.down_proj_scale,
                            (1, self.group_i), self.inter))


class Fp8Experts(QuantExperts):
    """Block-scaled FP8: gate_up_proj / down_proj e4m3 [E, N, K], *_scale_inv fp32
    [E, ceil(N / bn), ceil(K / bk)]."""

    def __init__(self, cfg: ModelConfig, block: tuple[int, int]) -> None:
        super().__init__()
        e, h, i = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.moe_intermediate_size
        bn, bk = block
        if i % bn:
            # NOTE: gate and up are stacked into one tensor; their scale rows must not share
            # a block.
            raise ConfigError(f"fp8 experts: moe_intermediate_size {i} is not a multiple of "
                              f"the scale block's {bn} rows")
        self.block, self.hidden, self.inter = block, h, i
        self.gate_up_proj = _param(e, 2 * i, h, dtype=torch.float8_e4m3fn)
        self.gate_up_proj_scale_inv = _param(e, 2 * i // bn, -(-h // bk), dtype=torch.float32)
        self.down_proj = _param(e, h, i, dtype=torch.float8_e4m3fn)
        self.down_proj_scale_inv = _param(e, -(-h // bn), -(-i // bk), dtype=torch.float32)

    def weights(self) -> tuple[QuantWeight, QuantWeight]:
        return (QuantWeight("fp8", self.gate_up_proj, self.gate_up_proj_scale_inv, self.block,
                            self.hidden),
                QuantWeight("fp8", self.down_proj, self.down_proj_scale_inv, self.block,
                            self.inter))
