"""Dot products of a few weight rows with one activation vector, in one Triton program: the
inner loop of the decode-step experts (moe_decode.py), for bf16/fp16, int4 and fp8 weights."""

from __future__ import annotations

import triton
import triton.language as tl

from blockspec.layers.int4_bits import _int4_dot_masked, _int4_dot_subnormal, _nibble


@triton.jit
def _int4_weights(words, s, MAGIC: tl.constexpr, ACT: tl.constexpr):
    """The nibbles of words [BLOCK_N, W] as [BLOCK_N, W, 8] (nibble j at [., ., j]) minus 8,
    times their scales s [BLOCK_N, W], rounded once to ACT, in fp32. Both ways give the same
    values ((q - 8) * scale is exact in fp32)."""
    q = _nibble(words[:, :, None], tl.arange(0, 8)[None, None, :], MAGIC)
    if MAGIC:
        # NOTE: the nibble ORed into the mantissa of a 16-bit float whose ulp is 1, minus that
        # float + 8, times the scale in ACT: int and packed 16-bit float ops, no conversions
        # (i2f and f2bf run at a fraction of the fp32 rate and bound the GEMV otherwise).
        bias: tl.constexpr = 136.0 if ACT == tl.bfloat16 else 1032.0
        q = q.to(tl.int16).to(ACT, bitcast=True) - tl.full([1, 1, 1], bias, ACT)
        w = (q * s.to(ACT)[:, :, None]).to(tl.float32)
    else:
        w = (q.to(tl.float32) * s.to(tl.float32)[:, :, None]).to(ACT).to(tl.float32)
    return w


@triton.jit
def _int4_chunk(w_rows, s_rows, v_ptr, row_ok, k0, k_words, GROUP_K: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """The packed words [rows, W] of columns k0.. (W = BLOCK_K / 8), their scales [rows, W] and
    v's values [W, 8] (value j of word w at [w, j])."""
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    # NOTE: K's words as an argument (K % 8 == 0 for int4), not cdiv(K, 8): Triton knows an
    # argument divisible by 16, so the mask is constant along 16 words and the loads vectorize.
    ok = row_ok[:, None] & (kw < k_words)[None, :]
    words = tl.load(w_rows + kw[None, :], mask=ok, other=0)
    s = tl.load(s_rows + (kw // (GROUP_K // 8))[None, :], mask=ok, other=0.0)
    v = tl.load(v_ptr + kw[:, None] * 8 + tl.arange(0, 8)[None, :], mask=(kw < k_words)[:, None],
                other=0.0)
    return words, s, v


@triton.jit
def _int4_rows_subnormal(w_rows, s_base, s_offs, v_ptr, row_ok, K, k_words,
                         GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN: tl.constexpr = False):
    """sum_k W[rows, k] v[k] [BLOCK_N] fp32 for int4 rows against subnormal inputs at v_ptr;
    the rows' scales start at s_base + s_offs [BLOCK_N]. EVEN: every row valid and K whole
    tiles (loads unmasked).

    The words' sums add up per scale group (G words; one where a group is not a power of two
    within the tile) in registers, and each group's scale loads once and multiplies once.

    NOTE: with a scale per word (a 2-byte gather of repeated addresses) gate_up's default tiles
    compiled to 127 registers a thread and 424 instructions a loop iteration for sm_90; this way
    80 and 405. Loading the next chunk's words while computing one (a register prefetch)
    measured slower on an H200 (0.130 against 0.096 ms a layer at one token;
    docs/benchmarks.md)."""
    W: tl.constexpr = BLOCK_K // 8
    GROUPED: tl.constexpr = (BLOCK_K % GROUP_K == 0) & (GROUP_K & (GROUP_K - 1) == 0)
    G: tl.constexpr = GROUP_K // 8 if GROUPED else 1
    t_stride = tl.cdiv(k_words, W) * W  # subnormal_words
    # NOTE: the word columns as [rows, W] (each row the same): subnormal inputs load in the
    # words' layout, not converted to it through shared memory
    cols = tl.arange(0, W)[None, :] + tl.zeros([BLOCK_N, 1], dtype=tl.int32)
    acc = tl.zeros([BLOCK_N, W // G], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kw = k0 // 8 + cols
        ok = row_ok[:, None] & (kw < k_words)
        # NOTE: unmasked where EVEN: gate_up's loop compiled to 8% fewer sm_90 instructions
        # (no zeroed registers or predicates, the scales in 16-byte loads); ~1% faster on an
        # H100 at one token (docs/benchmarks.md)
        words = tl.load(w_rows + kw) if EVEN else tl.load(w_rows + kw, mask=ok, other=0)
        part = _int4_dot_subnormal(words, v_ptr, kw, t_stride)
        if GROUPED:
            part = tl.sum(tl.reshape(part, [BLOCK_N, W // G, G]), 2)  # in each thread
            g = k0 // GROUP_K + tl.arange(0, W // G)
            s_ptrs = s_base + s_offs[:, None] + g[None, :]
            s = tl.load(s_ptrs) if EVEN else tl.load(
                s_ptrs, mask=row_ok[:, None] & (g < tl.cdiv(k_words, G))[None, :], other=0.0)
        else:
            s = tl.load(s_base + s_offs[:, None] + kw // (GROUP_K // 8), mask=ok, other=0.0)
        acc = tl.fma(part, s.to(tl.float32), acc)
    return tl.sum(acc, 1)


@triton.jit
def _dot_rows(w_base, s_base, v_ptr, rows, row_ok, K, k_words, stride_wn, stride_sn,
              FORMAT: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
              MAGIC: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, EVEN: tl.constexpr = False):
    """sum_k W[rows, k] v[k] in fp32 [BLOCK_N]: W as stored, int4 masked in place (MAGIC
    MASK32: exact products), or dequantized to exactly quant_gemm's tile values (rounded to ACT)
    before the products. EVEN (int4 "subnormal" only): every row valid, K whole tiles.

    NOTE: "magic" int4 as a [rows, words, 8] tile against v's [words, 8] chunk, loaded 8 values
    at a time: 10% faster on an H200 than a [rows, words] tile against eight strided slices of
    v, which loads v one value at a time (docs/benchmarks.md, "MoE targets")."""
    w_rows = w_base + rows[:, None].to(tl.int64) * stride_wn
    if FORMAT == 1:  # INT4
        s_rows = s_base + rows[:, None].to(tl.int64) * stride_sn
        if MAGIC == 1:  # subnormal (int4_bits.SUBNORMAL): v_ptr holds subnormal_inputs' rows
            out = _int4_rows_subnormal(w_rows, s_base, rows.to(tl.int64) * stride_sn, v_ptr,
                                       row_ok, K, k_words, GROUP_K, BLOCK_N, BLOCK_K, EVEN)
        elif MAGIC == 0x4B000000:  # masked in place (int4_bits.MASK32): a [rows, words] sum
            acc = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                words, s, v = _int4_chunk(w_rows, s_rows, v_ptr, row_ok, k0, k_words, GROUP_K,
                                          BLOCK_K)
                acc += _int4_dot_masked(words, s, v, BLOCK_K // 8)
            out = tl.sum(acc, 1)
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_K // 8, 8], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                words, s, v = _int4_chunk(w_rows, s_rows, v_ptr, row_ok, k0, k_words, GROUP_K,
                                          BLOCK_K)
                acc += _int4_weights(words, s, MAGIC, ACT) * v.to(tl.float32)[None, :, :]
            out = tl.sum(tl.sum(acc, 2), 1)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            ok = row_ok[:, None] & (kk < K)[None, :]
            w = tl.load(w_rows + kk[None, :], mask=ok, other=0.0).to(tl.float32)
            if FORMAT == 2:  # FP8: the e4m3 value times its block's scale, rounded to ACT
                s = tl.load(s_base + (rows // GROUP_N)[:, None].to(tl.int64) * stride_sn
                            + (kk // GROUP_K)[None, :], mask=ok, other=0.0)
                w = (w * s).to(ACT).to(tl.float32)
            v = tl.load(v_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            acc += w * v[None, :]
        out = tl.sum(acc, 1)
    return out
