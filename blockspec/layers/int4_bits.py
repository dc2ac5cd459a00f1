"""Bit-level int4 pieces shared by the grouped GEMMs (quant_gemm.py) and the decode-step GEMVs
(moe_decode.py). compressed-tensors' pack-quantized words hold eight nibbles, nibble j (value
+ 8) in bits 4j..4j+3."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The 16-bit float whose ulp is 1 (bf16 0x4300 = 128, fp16 0x6400 = 1024): a nibble ORed into
# its mantissa reads as that float + the nibble, with no int -> float conversion.
MAGIC16 = {torch.bfloat16: 0x4300, torch.float16: 0x6400}


@triton.jit
def _nibble(words, j, MAGIC: tl.constexpr):
    """Nibble j of each word: minus 8 (MAGIC 0), or ORed into the bits of the float MAGIC; a
    MAGIC of two 16-bit halves masks nibbles j % 4 and j % 4 + 4 in one op (one per half) and
    takes half j // 4."""
    if MAGIC == 0:
        out = ((words >> (4 * j)) & 0xF) - 8
    elif MAGIC > 0xFFFF and MAGIC != 0x4B000000:
        out = (((words >> (4 * (j % 4))) & 0x000F000F) | MAGIC) >> (16 * (j // 4))
    else:
        out = ((words >> (4 * j)) & 0xF) | MAGIC
    return out


# fp32 2^23: a value ORed into its mantissa's low 23 bits reads as 2^23 + that value, exactly.
MASK32 = 0x4B000000


@triton.jit
def _columns8(v, W: tl.constexpr):
    """The 8 columns of v [W, 8], each [W] (splits in registers: v loads 8 values at a time)."""
    even, odd = tl.split(tl.reshape(v, [W, 4, 2]))
    c04, c26 = tl.split(tl.reshape(even, [W, 2, 2]))
    c15, c37 = tl.split(tl.reshape(odd, [W, 2, 2]))
    c0, c4 = tl.split(c04)
    c2, c6 = tl.split(c26)
    c1, c5 = tl.split(c15)
    c3, c7 = tl.split(c37)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _masked_term(src, S: tl.constexpr, vj):
    """(nibble at bits S..S+3 of src - 8) * vj, exactly: the nibble masked in place (no shift)
    and ORed into 2^23's mantissa reads as 2^23 + nibble * 2^S; minus 2^23 + 8 * 2^S that is
    (nibble - 8) * 2^S, and vj comes scaled by 2^-S (powers of two: exact)."""
    # NOTE: the literal is MASK32 (a jit function reads no module global that is not constexpr)
    f = ((src & (0xF << S)) | 0x4B000000).to(tl.float32, bitcast=True)
    f = f - (8388608.0 + 8.0 * (1 << S))
    return f * (vj * (1.0 / (1 << S)))[None, :]


@triton.jit
def _int4_dot_masked(words, s, v, W: tl.constexpr):
    """sum over each word's 8 values of (nibble - 8) * v, times the word's scale: [BLOCK_N, W]
    fp32 for words / s [BLOCK_N, W] and v [W, 8] (value j of word w at v[w, j]).

    NOTE: per value one masked OR (a LOP3), a subtract and an FMA; the scale multiplies once per
    word. The products are exact (q - 8) * v; the dequantized weight is never rounded to the
    activations' dtype, so results differ from the tile paths' by that rounding (<= 2^-9 of
    each weight in bf16)."""
    c0, c1, c2, c3, c4, c5, c6, c7 = _columns8(v.to(tl.float32), W)
    hi = words >> 16  # nibbles 4..7 in the low half; the sign bits above are masked away
    part = _masked_term(words, 0, c0) + _masked_term(words, 4, c1)
    part += _masked_term(words, 8, c2) + _masked_term(words, 12, c3)
    part += _masked_term(hi, 0, c4) + _masked_term(hi, 4, c5)
    part += _masked_term(hi, 8, c6) + _masked_term(hi, 12, c7)
    return part * s.to(tl.float32)
