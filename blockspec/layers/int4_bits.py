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
