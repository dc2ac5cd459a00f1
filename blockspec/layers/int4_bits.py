"""Bit-level int4 pieces shared by the grouped GEMMs (quant_gemm.py) and the decode-step GEMVs
(moe_decode.py). compressed-tensors' pack-quantized words hold eight nibbles, nibble j (value
+ 8) in bits 4j..4j+3."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockspec.layers.pdl import pdl_args, pdl_sync

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


# "subnormal" unpacking: a nibble masked in place (bits S..S+3, S <= 12) under a zero exponent
# reads as the fp32 subnormal nibble * 2^(S - 149), exactly; against v * 2^(SUB_BIAS - S) the
# product is nibble * v * 2^(SUB_BIAS - 149) = nibble * v * 2^-64. One AND and one FMA a value.
SUBNORMAL = 1
SUB_BIAS = 85
SUB_UNIT = 2.0**64  # what a word's sum of such products is scaled by
SUB_ROWS = 9  # subnormal inputs per token: 8 scaled columns and the words' 8 * sum(v)


@triton.jit
def _pow2(e):
    """2^e in fp32, exactly, for integer e in the normal range (the exponent field built)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _subnormal_columns(v, W: tl.constexpr):
    """v [W, 8] (value j of word w at [w, j], fp32) -> (its columns scaled for the subnormal
    unpacking [W, 8]: value j times 2^(SUB_BIAS - 4 (j % 4)); each word's 8 * sum [W])."""
    j = tl.arange(0, 8)
    # NOTE: the literal is SUB_BIAS (a jit function reads no module global that is not constexpr)
    return v * _pow2(85 - 4 * (j % 4))[None, :], 8.0 * tl.sum(v, 1)


@triton.jit
def _sub_term(src, S: tl.constexpr, col, acc):
    """acc + (the nibble at bits S..S+3 of src) * col, the nibble as its fp32 subnormal."""
    return tl.fma((src & (0xF << S)).to(tl.float32, bitcast=True), col, acc)


@triton.jit
def _int4_dot_subnormal(words, t_ptr, kw, t_stride):
    """sum over each word's 8 values of (nibble - 8) * v, unscaled: [BLOCK_N, W] fp32 for words
    [BLOCK_N, W] of word columns kw [BLOCK_N, W] (each row the same), against subnormal inputs
    at t_ptr (subnormal_inputs' rows, t_stride apart, padded: read unmasked).

    NOTE: the nibbles' products sum to (sum nibble * v) * 2^-64, exact but for fp32 rounding;
    the bias 8 * sum(v) comes off once per word. v must stay below 2^43 in magnitude (v scaled by
    up to 2^85 is fp32); products below 2^-126 (|v| < 2^-62) lose bits as subnormals."""
    hi = words >> 16  # nibbles 4..7 in the low half; the sign bits above are masked away
    part = tl.zeros(words.shape, dtype=tl.float32)
    for j in tl.static_range(4):
        part = _sub_term(words, 4 * j, tl.load(t_ptr + j * t_stride + kw), part)
        part = _sub_term(hi, 4 * j, tl.load(t_ptr + (j + 4) * t_stride + kw), part)
    bias = tl.load(t_ptr + 8 * t_stride + kw)
    return tl.fma(part, 18446744073709551616.0, -bias)  # SUB_UNIT


@triton.jit
def _subnormal_store(out, v, kw, ok, keep, t_stride, W: tl.constexpr):
    """Stores v [W, 8] (words kw [W], fp32) as subnormal inputs' columns at out (rows t_stride
    apart), the words where `keep`; words not `ok` as zeros (the padding)."""
    cols, bias = _subnormal_columns(tl.where(ok[:, None], v, 0.0), W)
    tl.store(out + tl.arange(0, 8)[None, :] * t_stride + kw[:, None], cols, mask=keep[:, None])
    tl.store(out + 8 * t_stride + kw, bias, mask=keep)


@triton.jit
def _subnormal_inputs_kernel(x_ptr, out_ptr, k_words, t_stride, stride_xm, stride_om,
                             BLOCK_W: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_sync(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    kw = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    ok = kw < k_words
    v = tl.load(x_ptr + tok * stride_xm + kw[:, None] * 8 + tl.arange(0, 8)[None, :],
                mask=ok[:, None], other=0.0).to(tl.float32)
    _subnormal_store(out_ptr + tok * stride_om, v, kw, ok, kw < t_stride, t_stride, BLOCK_W)


def subnormal_words(k: int, block_k: int) -> int:
    """Words a row of subnormal inputs for K values holds: K / 8 padded to whole tiles of
    block_k values (the kernels read them unmasked)."""
    return triton.cdiv(k // 8, block_k // 8) * (block_k // 8)


def subnormal_inputs(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """x [T, K] (K % 8 == 0) -> [T, SUB_ROWS, subnormal_words(K, block_k)] fp32: for each word
    of 8 values, value j times 2^(SUB_BIAS - 4 (j % 4)) in row j and 8 * their sum in row 8;
    zeros in the padding. What _int4_dot_subnormal reads."""
    t, k = x.shape
    words = subnormal_words(k, block_k)
    out = torch.empty(t, SUB_ROWS, words, dtype=torch.float32, device=x.device)
    if t:
        block = min(256, triton.next_power_of_2(words))
        _subnormal_inputs_kernel[(t, triton.cdiv(words, block))](
            x, out, k // 8, words, x.stride(0), out.stride(0), BLOCK_W=block,
            **pdl_args(x.device))
    return out
