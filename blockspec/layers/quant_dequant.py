"""Quantized weights back to dense, in plain PyTorch: the CPU path, load-time dequantization of
weights a model reads directly, and the references the Triton kernels are tested against.

int4 (compressed-tensors pack-quantized): eight 4-bit values per int32 along the input dim,
value j of a word in bits 4j..4j+3, each stored plus 8 (so [-8, 7] -> [0, 15]); one scale per
`group` input columns. Dense = value * scale, computed in the scale's dtype as
compressed-tensors' own `dequantize` does.
fp8 (block-scaled): dense = weight * weight_scale_inv of its (rows, cols) block; blocks at the
right and bottom edges may be partial (DeepSeek's ceil-divided scale grid).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

INT4_PER_WORD = 8


class QuantWeight(NamedTuple):
    """A quantized [..., N, K] weight as its kernels take it. `fmt` "int4": `data` int32
    [..., N, K / 8], `scale` [..., N, K / group], group (1, group); "fp8": `data` e4m3 [..., N,
    K], `scale` fp32 [..., ceil(N / bn), ceil(K / bk)], group (bn, bk)."""

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor
    group: tuple[int, int]
    k: int  # input features

    @property
    def n(self) -> int:
        return self.data.shape[-2]


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [..., ceil(k / 8)] -> int8 [..., k] in [-8, 7]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    # NOTE: >> on int32 sign-extends; the mask keeps the nibble either way.
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles.reshape(*packed.shape[:-1], -1)[..., :k] - 8).to(torch.int8)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, group: int, k: int
                    ) -> torch.Tensor:
    """Dense [..., N, k] in the scale's dtype."""
    q = unpack_int4(packed, k)
    return q.to(scale.dtype) * scale.repeat_interleave(group, dim=-1)[..., :k]


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
                   ) -> torch.Tensor:
    """Dense fp32 [..., N, K] of an e4m3 weight and its per-block scales."""
    n, k = weight.shape[-2:]
    s = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :n, :]
    return weight.float() * s.repeat_interleave(block[1], dim=-1)[..., :k]


def dequantize(w: QuantWeight) -> torch.Tensor:
    if w.fmt == "int4":
        return dequantize_int4(w.data, w.scale, w.group[1], w.k)
    return dequantize_fp8(w.data, w.scale, w.group)


class DequantizedExperts:
    """`experts[e]` is expert e's dense weight: experts_reference indexes its weights by the
    experts the tokens chose, so the CPU path dequantizes only those."""

    def __init__(self, w: QuantWeight, dtype: torch.dtype) -> None:
        self.w, self.dtype = w, dtype

    def __getitem__(self, e: int) -> torch.Tensor:
        w = self.w
        return dequantize(w._replace(data=w.data[e], scale=w.scale[e])).to(self.dtype)
