"""Grouped GEMMs over quantized weights in Triton, dequantizing each weight tile in the kernel
(16-bit activations, fp32 accumulation): compressed-tensors W4A16 int4 and block-scaled FP8
(W8A16). One kernel serves the routed experts (fused_moe.py's slot tiles, one expert's weight per
tile) and dense Linear layers (one "expert", the rows in order).

Per weight tile [BLOCK_N, BLOCK_K] (transposed for tl.dot):
    int4: nibble (k % 8) of word k // 8, minus 8, times scale[n, k // group]
    fp8:  the e4m3 value times scale_inv[n // block_n, k // block_k]
exact in fp32, then rounded once to the activations' dtype for tl.dot. With 16-bit
activations and scales of the same dtype (Kimi's bf16) that is quant_dequant's dense weight in
that dtype, which rounds in the scale's dtype. Launch shapes depend on tensor shapes only and
nothing reads back to the host, so CUDA graphs capture these launches.

int4 has bit-identical dequantizations (Tiles.dequant, DEFAULT_TILES picks one): "convert"
(int -> fp32 conversions, an fp32 multiply, a cast); "magic" (each nibble ORed into an fp32
mantissa, FasterTransformer's and Marlin's trick: no int -> float conversion); "magic16" (the
same in the 16-bit activations' dtype, the scale multiply in that dtype where the scales share
it: one rounding of a product exact in fp32, as above); "*_join" (the tile assembled by tl.join,
see _unpacked; not bit-identical to "convert" on an H200), "magic16x2_join" masking two
nibbles per int op.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from blockspec.layers.fused_moe import BLOCK_M, Slots, run_experts, tile_slots
from blockspec.layers.int4_bits import MAGIC16, _nibble
from blockspec.layers.moe_decode import decode_experts, takes_decode_path
from blockspec.layers.quant_dequant import QuantWeight
from blockspec.layers.side_stream import Residual

FORMATS = {"int4": 0, "fp8": 1}
DENSE_BLOCK_M = 64  # rows per tile for dense layers past a decode step's few rows
# int4's dequantizations (_int4_values); the GPU check run times them (quant_gpu_checks --tune)
DEQUANTS = {"convert": 0, "magic": 1, "magic16": 2, "convert_join": 3, "magic16_join": 4,
            "magic16x2_join": 5}


class Tiles(NamedTuple):
    """A weight tile's shape, the warps of a program, int4's dequantization (a DEQUANTS key;
    fp8 ignores it) and the K loop's pipeline stages (Triton's default 3)."""

    block_n: int
    block_k: int
    num_warps: int
    dequant: str = "convert"
    num_stages: int = 3


# NOTE: the fastest tiles of `benchmarks/quant_gpu_checks.py --tune` on an H200 at 64 tokens
# (within 13% of the best at 1 and 8; docs/benchmarks.md). int4's "magic16" is the fastest
# dequantization whose output equals "convert"'s bit for bit there (8-15% faster); the "*_join"
# ones ran 1.3-1.4x faster than "convert" but their outputs differed from it on the H200 (not
# in the interpreter), so they stay opt-in until that is understood.
DEFAULT_TILES = {"int4": Tiles(64, 128, 4, "magic16"), "fp8": Tiles(64, 128, 4)}
# NOTE: dense FP8 layers' (most rows, rows a tile, Tiles), the fastest of
# `benchmarks/fp8_tune.py` on an H200 at DeepSeek-V3's gate_up, down, q_b and o_proj
# (2026-12-07; docs/benchmarks.md): at 1-16 rows, 64 x 256 tiles within 6% of the best on each
# (17% less time over the four than DEFAULT_TILES'); at 128 rows, 128-row tiles of 64 x 128 on
# 8 warps (best, or within 7%); from 512 rows, 128 x 256 x 128 (best on all four, 1.6-2.0x
# faster than 64-row tiles of DEFAULT_TILES). int4 dense layers keep the grouped GEMM's tiles.
FP8_DENSE_TILES = ((16, 16, Tiles(64, 256, 4, num_stages=4)),
                   (256, 128, Tiles(64, 128, 8, num_stages=4)),
                   (None, 128, Tiles(256, 128, 8)))


@triton.jit
def _scaled(q, s_rows, k0, k, col_ok, GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """The tile q [BLOCK_N, BLOCK_K] at input column k0 times its weight scales, in q's dtype:
    one scale per row where the tile lies in one group along k, else (SPLIT: whole groups of a
    power-of-two size in the tile) one per (row, group).

    NOTE: one load per (row, group), broadcast in registers: a load per weight value (a gather
    of repeated addresses) bounds the kernel by its load instructions, not its bytes, whatever
    the tile shape (docs/benchmarks.md, "MoE targets")."""
    if SPLIT:
        g = k0 // GROUP_K + tl.arange(0, BLOCK_K // GROUP_K)
        s = tl.load(s_rows[:, None] + g[None, :],
                    mask=col_ok[:, None] & (g < tl.cdiv(k, GROUP_K))[None, :], other=0.0)
        s = tl.broadcast_to(s.to(q.dtype)[:, :, None], [BLOCK_N, BLOCK_K // GROUP_K, GROUP_K])
        out = q * tl.reshape(s, [BLOCK_N, BLOCK_K])
    else:
        out = q * tl.load(s_rows + k0 // GROUP_K, mask=col_ok, other=0.0).to(q.dtype)[:, None]
    return out


@triton.jit
def _unpacked(words, MAGIC: tl.constexpr, JOIN: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """_nibble of each nibble of the words [BLOCK_N, BLOCK_K / 8], [BLOCK_N, BLOCK_K] int32 in
    column order (nibble j of word w is column 8w + j).

    NOTE: JOIN assembles the tile by tl.join, whose new dim lies in each thread ([.., i, j, c]
    is nibble 4i + 2j + c), so each word's values stay in its thread in column order and reach
    shared memory for tl.dot in 16-byte stores; the broadcast over 8 shifts and its reshape
    compile to one 2-byte store per value (sm_90 PTX of the 64 x 128 tile)."""
    if JOIN:
        even = tl.join(tl.join(_nibble(words, 0, MAGIC), _nibble(words, 4, MAGIC)),
                       tl.join(_nibble(words, 2, MAGIC), _nibble(words, 6, MAGIC)))
        odd = tl.join(tl.join(_nibble(words, 1, MAGIC), _nibble(words, 5, MAGIC)),
                      tl.join(_nibble(words, 3, MAGIC), _nibble(words, 7, MAGIC)))
        out = tl.reshape(tl.join(even, odd), [BLOCK_N, BLOCK_K])
    else:
        q = _nibble(words[:, :, None], tl.arange(0, 8)[None, None, :], MAGIC)
        out = tl.reshape(q, [BLOCK_N, BLOCK_K])
    return out


@triton.jit
def _int4_values(words, DEQUANT: tl.constexpr, MAGIC: tl.constexpr, VALUE_DTYPE: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """nibble - 8 of the words [BLOCK_N, BLOCK_K / 8], [BLOCK_N, BLOCK_K] in VALUE_DTYPE, exact
    in every dequantization (DEQUANTS; MAGIC as _dequant sets it).

    The magic ones OR each nibble into the mantissa of a float whose ulp is 1 (fp32 0x4B000000
    = 2^23, bf16 0x4300 = 128, fp16 0x6400 = 1024) and subtract that float + 8: int ops and a
    float subtraction, no int -> float conversion."""
    q = _unpacked(words, MAGIC, DEQUANT >= 3, BLOCK_N, BLOCK_K)
    if MAGIC == 0:
        out = q.to(tl.float32)
    elif VALUE_DTYPE == tl.float32:
        out = q.to(tl.float32, bitcast=True) - 8388616.0
    else:
        bias: tl.constexpr = 136.0 if VALUE_DTYPE == tl.bfloat16 else 1032.0
        # the int16 cast keeps the low half, where _nibble put the value
        out = q.to(tl.int16).to(VALUE_DTYPE, bitcast=True) - tl.full([1, 1], bias, VALUE_DTYPE)
    return out


@triton.jit
def _weight_tile(w_rows, k0, k, col_ok, FORMAT: tl.constexpr, DEQUANT: tl.constexpr,
                 MAGIC: tl.constexpr, VALUE_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """The quantized values of the [BLOCK_N, BLOCK_K] tile at input column k0: int4 in
    VALUE_DTYPE (_int4_values), fp8 in fp32.

    NOTE: read along k, the rows' contiguous dimension, so the loads coalesce; int4 words are
    read once ([BLOCK_N, BLOCK_K / 8]) and unpacked in registers: a [BLOCK_K, BLOCK_N] gather
    reads each word once per value, across rows, and does not coalesce."""
    if FORMAT == 0:
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(w_rows[:, None] + kw[None, :],
                        mask=col_ok[:, None] & (kw < tl.cdiv(k, 8))[None, :], other=0)
        out = _int4_values(words, DEQUANT, MAGIC, VALUE_DTYPE, BLOCK_N, BLOCK_K)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(w_rows[:, None] + kk[None, :], mask=col_ok[:, None] & (kk < k)[None, :],
                    other=0.0)
        out = q.to(tl.float32)
    return out


@triton.jit
def _quant_grouped_gemm(a_ptr, w_ptr, s_ptr, c_ptr, scale_ptr, sorted_ptr, tile_expert_ptr,
                        num_slots, n, k, stride_am, stride_we, stride_wn, stride_se, stride_sn,
                        stride_cm, FORMAT: tl.constexpr, GROUP_N: tl.constexpr,
                        GROUP_K: tl.constexpr, TOP_K: tl.constexpr, A_PER_TOKEN: tl.constexpr,
                        SCALE: tl.constexpr, NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                        DEQUANT: tl.constexpr, MAGIC: tl.constexpr,
                        VALUE_DTYPE: tl.constexpr):
    """C[slot, :] = A[row of slot] @ dequant(W[expert]).T (times scale[slot]), one tile."""
    expert = tl.load(tile_expert_ptr + tl.program_id(0))
    if expert >= NUM_EXPERTS:
        return
    slots, valid, rows, cols, col_ok = tile_slots(sorted_ptr, num_slots, n, TOP_K, A_PER_TOKEN,
                                                  BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64) * stride_wn
    s_rows = s_ptr + expert.to(tl.int64) * stride_se + (cols // GROUP_N) * stride_sn
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + kk[None, :],
                    mask=valid[:, None] & (kk < k)[None, :], other=0.0)
        w = _scaled(_weight_tile(w_rows, k0, k, col_ok, FORMAT, DEQUANT, MAGIC, VALUE_DTYPE,
                                 BLOCK_N, BLOCK_K), s_rows, k0, k, col_ok, GROUP_K, BLOCK_N,
                    BLOCK_K, SPLIT)
        acc += tl.dot(a, tl.trans(w.to(a.dtype)), out_dtype=tl.float32)
    if SCALE:
        acc *= tl.load(scale_ptr + slots, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + slots[:, None].to(tl.int64) * stride_cm + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def _k_tile(block_k: int, group_k: int) -> tuple[int, bool]:
    """(BLOCK_K, SPLIT) for a scale group of `group_k` input columns: a tile inside one group,
    or whole power-of-two groups in a tile (see _scaled)."""
    if group_k & (group_k - 1) == 0:
        return block_k, group_k < block_k
    while block_k > 16 and group_k % block_k:
        block_k //= 2
    if group_k % block_k:
        raise NotImplementedError(f"quantization groups of {group_k} input columns: the kernel "
                                  "takes powers of two or multiples of 16")
    return block_k, False


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _dequant(w: QuantWeight, a_dtype: torch.dtype, dequant: str) -> dict:
    """The kernel's DEQUANT, MAGIC (0: "convert*", else the float whose mantissa takes the
    nibble) and VALUE_DTYPE (the values' and the scale multiply's dtype): for "magic16*" the
    activations' where they and the scales share a 16-bit dtype, where one rounding equals
    quant_dequant's (the product is exact in fp32); fp32 otherwise and for fp8."""
    number = DEQUANTS[dequant] if w.fmt == "int4" else 0
    value_dtype = tl.float32
    if number and "magic16" in dequant and a_dtype in _TL_DTYPES and w.scale.dtype == a_dtype:
        value_dtype = _TL_DTYPES[a_dtype]
    magic = 0 if number in (0, 3) else 0x4B000000
    if value_dtype != tl.float32:
        magic = MAGIC16[a_dtype] * (0x10001 if number == 5 else 1)
    return dict(DEQUANT=number, MAGIC=magic, VALUE_DTYPE=value_dtype)


def quant_grouped(a: torch.Tensor, w: QuantWeight, slots: Slots, per_token: bool,
                  scale: torch.Tensor | None, block_m: int = BLOCK_M,
                  tiles: Tiles | None = None) -> torch.Tensor:
    """[num_slots, N]: each slot's row of `a` times its expert's dequantized weight. `w`'s data
    and scale are [E, N, ...] (experts) or [N, ...] (one dense weight); `tiles` overrides
    DEFAULT_TILES (a tuning run)."""
    data, s = w.data, w.scale
    experts = data.shape[0] if data.dim() == 3 else 1
    n, k = w.n, w.k
    assert a.stride(1) == 1 and data.stride(-1) == 1 and s.stride(-1) == 1 and a.shape[1] == k
    out = torch.empty(slots.num_slots, n, dtype=a.dtype, device=a.device)
    tiles = tiles or DEFAULT_TILES[w.fmt]
    block_n = min(tiles.block_n, max(16, triton.next_power_of_2(n)))
    block_k, split = _k_tile(min(tiles.block_k, max(16, triton.next_power_of_2(k))), w.group[1])
    grid = (slots.tile_expert.numel(), triton.cdiv(n, block_n))
    _quant_grouped_gemm[grid](
        a, data, s, out, scale if scale is not None else out, slots.sorted, slots.tile_expert,
        slots.num_slots, n, k, a.stride(0), data.stride(0) if experts > 1 else 0,
        data.stride(-2), s.stride(0) if experts > 1 else 0, s.stride(-2), out.stride(0),
        FORMAT=FORMATS[w.fmt], GROUP_N=w.group[0], GROUP_K=w.group[1], TOP_K=slots.top_k,
        A_PER_TOKEN=per_token, SCALE=scale is not None, NUM_EXPERTS=experts, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **_dequant(w, a.dtype, tiles.dequant))
    return out


def fused_experts_quant(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                        gate_up: QuantWeight, down: QuantWeight,
                        stats: torch.Tensor | None = None, tiles: Tiles | None = None,
                        residual: Residual = None) -> torch.Tensor:
    """experts_reference over the dequantized experts (+ residual), as two quantized grouped
    GEMMs, or for a decode step's few slots the GEMV kernels (moe_decode.py): x [T, H],
    weights / ids [T, k], gate_up [E, 2I, H], down [E, H, I] -> [T, H]; `stats` as in
    fused_moe.align_slots, `tiles` as in quant_grouped (the grouped GEMMs only)."""
    if tiles is None and takes_decode_path(ids.numel(), gate_up):
        return decode_experts(x.contiguous(), weights, ids, gate_up, down, stats, residual)
    layers = (gate_up, down)
    return run_experts(x, weights, ids, gate_up.data.shape[0],
                       lambda a, layer, slots, per_token, scale:
                       quant_grouped(a, layers[layer], slots, per_token, scale, tiles=tiles),
                       stats, residual)


def dense_tiles(m: int, fmt: str) -> tuple[int, Tiles]:
    """(rows a tile, Tiles) for a dense layer of weight format `fmt` at m rows."""
    if fmt == "fp8":
        for most, block_m, tiles in FP8_DENSE_TILES:
            if most is None or m <= most:
                return block_m, tiles
    return (BLOCK_M if m <= BLOCK_M else DENSE_BLOCK_M), DEFAULT_TILES[fmt]


def quant_linear(x: torch.Tensor, w: QuantWeight, tiles: Tiles | None = None,
                 block_m: int | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(w).T -> [..., N] in x's dtype (no bias); `tiles` and `block_m` (the
    rows of a tile) override dense_tiles' (a tuning run)."""
    a = x.reshape(-1, x.shape[-1]).contiguous()
    m = a.shape[0]
    default_m, default_tiles = dense_tiles(m, w.fmt)
    tiles, block_m = tiles or default_tiles, block_m or default_m
    p = triton.cdiv(max(m, 1), block_m) * block_m
    # NOTE: the rows in order, padded to whole tiles with the sentinel m; one "expert".
    rows = torch.arange(p, device=a.device)
    slots = Slots(torch.where(rows < m, rows, m),
                  torch.zeros(p // block_m, dtype=torch.int64, device=a.device), m, 1)
    return quant_grouped(a, w, slots, True, None, block_m, tiles).view(*x.shape[:-1], w.n)

