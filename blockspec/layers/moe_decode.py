"""The routed experts of a decode step's few tokens as two GEMV kernels, without sorting:

    act[s] = silu(W_gate[e_s] x[t_s]) * (W_up[e_s] x[t_s])       one program per (slot, rows)
    out[t] = sum_j weight[t, j] * W_down[e_tj] act[t k + j] (+ residual[t])
                                                                 one program per (token, rows)

At a few (token, pick) slots the grouped GEMMs (fused_moe.py) are launch- and latency-bound:
an alignment program, tensor-core tiles of 16 rows holding one, a silu launch and a sum over the
picks. Here each slot streams its expert's rows once (the slot is the fastest grid axis, so
slots that share an expert read the same rows at about the same time, from L2), the silu and
the weighted sum over picks (and the shared experts' output, `residual`) are fused, and the
distinct-expert count of MoE.expert_counts is taken by the first program. Weights are bf16/fp16
tensors [E, N, K] or quant_dequant.QuantWeight (int4 / fp8); fp8 (and int4 unpacked "magic" or
"convert") is dequantized to exactly quant_gemm's tile values (rounded to the activations'
dtype) before the products; int4 unpacked "subnormal" (the default) or "mask" multiplies the
exact (q - 8) * v in fp32 and scales each word's sum (int4_bits.py). The down kernels are in
moe_down.py. Products and sums are fp32 and round where the grouped path rounds
(after silu, after the product, per weighted pick, once for the sum). Grids depend on shapes
only and nothing reads back to the host: CUDA graphs capture it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from blockspec.layers.arrival import arrival_locks
from blockspec.layers.fused import _rnd
from blockspec.layers.gemv_rows import _dot_rows
from blockspec.layers.int4_bits import (
    MAGIC16,
    MASK32,
    SUB_ROWS,
    SUBNORMAL,
    _subnormal_store,
    subnormal_inputs,
    subnormal_words,
)
from blockspec.layers.moe_down import _down_split_kernel, _down_sum_kernel
from blockspec.layers.pdl import pdl_args, pdl_sync
from blockspec.layers.quant_dequant import QuantWeight
from blockspec.layers.side_stream import Residual, resolve

DENSE, INT4, FP8 = 0, 1, 2
DEFAULT_DEQUANT = "subnormal"  # int4's unpacking (_magic); other formats ignore it
# int4 unpackings that mask nibbles in place (no conversions): their MAGIC codes
_INT4_MASKED = {"mask": MASK32, "subnormal": SUBNORMAL}
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
# NOTE: slots (tokens x top_k) up to which the experts take this path, per weight format: where
# it measured faster than the grouped GEMMs on an H200 (`benchmarks/kernel_tune.py`,
# `benchmarks/decode_tune.py`): bf16 at one token (even at two); int4 unpacked as subnormals
# 3.0x faster at 16 tokens of top 8, the most measured (fp8 untimed: bf16's).
MAX_DECODE_SLOTS = {DENSE: 8, FP8: 8, INT4: 128}


class GemvTiles(NamedTuple):
    """(rows per program, input columns per iteration, warps) of one kernel; `split` (down
    only): one program per pick (moe_down.py), not one looping over the picks."""

    block_n: int
    block_k: int
    num_warps: int
    split: bool = False


# NOTE: per weight format, the fastest tiles at one token: Moonlight's bf16 experts on an H200
# (`benchmarks/kernel_tune.py`: within 3% of the best; fp8 takes them, untimed) and Kimi K2.6's
# int4 ones unpacked as subnormals with a scale a group (`benchmarks/decode_tune.py`, so far on
# an H100 only: 0.093-0.096 ms a layer against 0.099-0.103 for a scale a word at its H200-best
# 8 x 1024 on 2 warps; docs/benchmarks.md, "MoE targets"). Wide tiles, 1024 columns an
# iteration, keep more packed words in flight.
_DENSE_TILES = {"gate_up": GemvTiles(4, 256, 4), "down": GemvTiles(4, 512, 8)}
DEFAULT_TILES = {DENSE: _DENSE_TILES, FP8: _DENSE_TILES,
                 INT4: {"gate_up": GemvTiles(16, 1024, 2), "down": GemvTiles(8, 1024, 4)}}


@triton.jit
def _count_distinct(ids_ptr, stats_ptr, num_slots, S_PAD: tl.constexpr):
    """stats += (distinct experts among the slots, 1)."""
    i = tl.arange(0, S_PAD)
    ok = i < num_slots
    e = tl.load(ids_ptr + i, mask=ok, other=-1)
    seen = (e[:, None] == e[None, :]) & (i[None, :] < i[:, None]) & ok[None, :]
    first = ok & (tl.sum(seen.to(tl.int32), 1) == 0)
    tl.atomic_add(stats_ptr, tl.sum(first.to(tl.int64), 0))
    tl.atomic_add(stats_ptr + 1, 1)


@triton.jit
def _gate_up_rows(w_base, s_base, x_row, rows, ok, n, K, k_words, stride_wn, stride_sn,
                  FORMAT: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                  MAGIC: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, EVEN: tl.constexpr = False):
    """(gate, up) of `rows` (< n) of a [2n, K] gate_up weight, each rounded to ACT."""
    ok = ok & (rows < n)
    gate = _dot_rows(w_base, s_base, x_row, rows, ok, K, k_words, stride_wn, stride_sn, FORMAT,
                     GROUP_N, GROUP_K, MAGIC, ACT, BLOCK_N, BLOCK_K, EVEN)
    up = _dot_rows(w_base, s_base, x_row, rows + n, ok, K, k_words, stride_wn, stride_sn,
                   FORMAT, GROUP_N, GROUP_K, MAGIC, ACT, BLOCK_N, BLOCK_K, EVEN)
    return _rnd(gate, ACT), _rnd(up, ACT)


@triton.jit
def _routed_gate_up(x_ptr, ids_ptr, w_ptr, s_ptr, slot, rows, ok, inter, K, k_words, stride_xm,
                    stride_we, stride_wn, stride_se, stride_sn, TOP_K: tl.constexpr,
                    FORMAT: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                    MAGIC: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN: tl.constexpr = False):
    """(gate, up) of routed slot `slot`: its token's row through its expert's rows."""
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    x_row = x_ptr + (slot // TOP_K).to(tl.int64) * stride_xm
    return _gate_up_rows(w_ptr + expert * stride_we, s_ptr + expert * stride_se, x_row, rows, ok,
                         inter, K, k_words, stride_wn, stride_sn, FORMAT, GROUP_N, GROUP_K,
                         MAGIC, ACT, BLOCK_N, BLOCK_K, EVEN)


@triton.jit
def _gate_up_act_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, sw_ptr, act_ptr, stats_ptr, num_slots,
                        inter, K, k_words, shared_n, parts, stride_xm, stride_we, stride_wn,
                        stride_se, stride_sn, stride_swn, stride_act, ACT: tl.constexpr,
                        TOP_K: tl.constexpr, COUNT: tl.constexpr, S_PAD: tl.constexpr,
                        FORMAT: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                        MAGIC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        HAS_SHARED: tl.constexpr = False, ACT_T: tl.constexpr = False,
                        EVEN: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    pdl_sync(USE_PDL)
    slot = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < inter
    act_dtype: tl.constexpr = ACT
    # NOTE: with HAS_SHARED (dense formats only), slot num_slots + t * parts + j computes rows
    # j * inter.. of token t's shared experts' intermediate (shared_n rows; up at + shared_n).
    if HAS_SHARED:
        j = slot - num_slots
        if j >= 0:
            x_row = x_ptr + (j // parts).to(tl.int64) * stride_xm
            gate, up = _gate_up_rows(sw_ptr, sw_ptr, x_row, (j % parts) * inter + rows, ok,
                                     shared_n, K, k_words, stride_swn, 0, FORMAT, GROUP_N,
                                     GROUP_K, MAGIC, act_dtype, BLOCK_N, BLOCK_K)
        else:
            gate, up = _routed_gate_up(x_ptr, ids_ptr, w_ptr, s_ptr, slot, rows, ok, inter, K,
                                       k_words, stride_xm, stride_we, stride_wn, stride_se,
                                       stride_sn, TOP_K, FORMAT, GROUP_N, GROUP_K, MAGIC,
                                       act_dtype, BLOCK_N, BLOCK_K, EVEN)
    else:
        gate, up = _routed_gate_up(x_ptr, ids_ptr, w_ptr, s_ptr, slot, rows, ok, inter, K,
                                   k_words, stride_xm, stride_we, stride_wn, stride_se,
                                   stride_sn, TOP_K, FORMAT, GROUP_N, GROUP_K, MAGIC, act_dtype,
                                   BLOCK_N, BLOCK_K, EVEN)
    # rounded after silu and after the product, like `F.silu(gate) * up` (fused.silu_and_mul)
    act = _rnd(gate / (1.0 + tl.exp(-gate)), act_dtype)
    act = _rnd(act * up, act_dtype)
    out = act_ptr + slot.to(tl.int64) * stride_act
    if ACT_T:  # as the down kernel's subnormal inputs (rows: BLOCK_N / 8 whole words)
        words = tl.program_id(1) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
        t_stride = stride_act // 9  # int4_bits.SUB_ROWS rows a slot
        _subnormal_store(out, tl.reshape(act, [BLOCK_N // 8, 8]), words, words < inter // 8,
                         words < t_stride, t_stride, BLOCK_N // 8)
    else:
        tl.store(out + rows, act.to(act_dtype), mask=ok)
    if COUNT:
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            _count_distinct(ids_ptr, stats_ptr, num_slots, S_PAD)


class _Weight(NamedTuple):
    data: torch.Tensor  # [E, N, K] values, or packed int4 words [E, N, K / 8]
    scale: torch.Tensor  # [E, N / group_n, K / group_k] (a dummy for DENSE)
    fmt: int
    group: tuple[int, int]
    n: int
    k: int


def _format(w: torch.Tensor | QuantWeight) -> int:
    if not isinstance(w, QuantWeight):
        return DENSE
    return INT4 if w.fmt == "int4" else FP8


def _weight(w: torch.Tensor | QuantWeight) -> _Weight:
    if isinstance(w, QuantWeight):
        fmt = _format(w)
        if fmt == INT4 and (w.group[1] % 8 or w.k % 8):
            raise NotImplementedError(f"int4 over {w.k} columns in groups of {w.group[1]}: "
                                      "whole words only")
        return _Weight(w.data, w.scale, fmt, w.group, w.n, w.k)
    return _Weight(w, w, DENSE, (1, 1), w.shape[1], w.shape[2])


def takes_decode_path(num_slots: int, w: torch.Tensor | QuantWeight) -> bool:
    """Whether the experts of weights like `w` run `decode_experts` at `num_slots` slots."""
    return num_slots <= MAX_DECODE_SLOTS[_format(w)]


def folds_shared(num_slots: int, w: torch.Tensor | QuantWeight, shared_w: torch.Tensor) -> bool:
    """Whether `decode_experts` takes shared experts of weight `shared_w` (gate_up [2S, H]) with
    routed experts like `w` at `num_slots` routed slots: on the decode path, both dense in one
    dtype. NOTE: the fold costs no launch of its own; the shared MLP's three do (GEMV, silu,
    GEMV)."""
    return takes_decode_path(num_slots, w) and _format(w) == DENSE and shared_w.dtype == w.dtype


def _magic(w: _Weight, act: torch.dtype, dequant: str) -> int:
    """int4's unpacking: SUBNORMAL for "subnormal" (nibbles masked in place as fp32
    subnormals, against inputs scaled to match), MASK32 for "mask" (nibbles masked in place
    into fp32's mantissa, any dtypes);
    for "magic" the 16-bit float whose mantissa takes a nibble, where the activations and the
    scales share a 16-bit dtype; 0: int -> fp32 conversions ("convert", any dtypes)."""
    if w.fmt == INT4 and dequant in _INT4_MASKED:
        return _INT4_MASKED[dequant]
    if w.fmt != INT4 or dequant == "convert" or w.scale.dtype != act:
        return 0
    return MAGIC16.get(act, 0)


def _strides(w: _Weight) -> tuple[int, int, int, int]:
    return w.data.stride(0), w.data.stride(1), w.scale.stride(0), w.scale.stride(1)


def _block_k(tiles: GemvTiles, w: _Weight) -> int:
    """tiles.block_k, at most K rounded up to a power of two (scales are read per int4 word
    or per fp8 value, so any tile width serves any group)."""
    return min(tiles.block_k, max(16, triton.next_power_of_2(w.k)))


def decode_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   gate_up: torch.Tensor | QuantWeight, down: torch.Tensor | QuantWeight,
                   stats: torch.Tensor | None = None, residual: Residual = None,
                   tiles: dict[str, GemvTiles] | None = None, dequant: str = DEFAULT_DEQUANT,
                   shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """experts_reference's result (+ residual) for a few slots: x [T, H] (rows contiguous),
    weights / ids [T, k], gate_up [E, 2I, H], down [E, H, I] -> [T, H] in x's dtype; `stats`
    as in fused_moe.align_slots; `tiles` overrides the format's DEFAULT_TILES and `dequant`
    int4's unpacking: "subnormal" (the default: exact weights, fp32 products; inputs below
    2^43), "mask" (exact products, int4_bits.MASK32), or "magic" / "convert" (each weight
    rounded to x's dtype first, as the grouped GEMMs do; the same values).

    `shared` = the shared experts' MLP weights (gate_up [2S, H], down [H, S], like the routed
    ones in a dense format), instead of `residual`: computed by the same two launches as
    ceil(S / I) more slots a token, added as its output would be (folds_shared)."""
    # NOTE: fp fusion on (products and sums as FMAs): every rounding to the activations' dtype
    # goes through fused._rnd's integer ops, which no contraction crosses.
    t, top_k = ids.shape
    gu, dn = _weight(gate_up), _weight(down)
    tiles = {**DEFAULT_TILES[gu.fmt], **(tiles or {})}
    inter, hidden = gu.n // 2, dn.n
    assert x.stride(1) == 1 and x.shape[1] == gu.k and dn.k == inter
    s_gu, s_dn = shared if shared is not None else (x, x)
    shared_n = s_dn.shape[1] if shared is not None else 0
    parts = triton.cdiv(shared_n, inter)
    if shared is not None:
        assert gu.fmt == DENSE and residual is None and s_gu.shape == (2 * shared_n, gu.k)
        assert s_dn.shape == (hidden, shared_n) and s_gu.stride(1) == s_dn.stride(1) == 1
    flat_ids = ids.reshape(-1).contiguous()
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    tg, td = tiles["gate_up"], tiles["down"]
    magic_gu, magic_dn = _magic(gu, x.dtype, dequant), _magic(dn, x.dtype, dequant)
    sub_gu, sub_dn = magic_gu == SUBNORMAL, magic_dn == SUBNORMAL
    act = _act_buffer(t * (top_k + parts), inter, x, sub_dn, tg, _block_k(td, dn))
    x_in = subnormal_inputs(x, _block_k(tg, gu)) if sub_gu else x
    _gate_up_act_kernel[(t * (top_k + parts), triton.cdiv(inter, tg.block_n))](
        x_in, flat_ids, gu.data, gu.scale, s_gu, act, stats if stats is not None else flat_ids,
        t * top_k, inter, gu.k, gu.k // 8, shared_n, max(parts, 1), x_in.stride(0),
        *_strides(gu), s_gu.stride(0), act.stride(0), ACT=_TL_DTYPES[x.dtype], TOP_K=top_k,
        HAS_SHARED=shared is not None, ACT_T=sub_dn, COUNT=stats is not None,
        S_PAD=max(2, triton.next_power_of_2(t * top_k)), FORMAT=gu.fmt, GROUP_N=gu.group[0],
        GROUP_K=gu.group[1], MAGIC=magic_gu, BLOCK_N=tg.block_n, BLOCK_K=_block_k(tg, gu),
        EVEN=_even(gu, magic_gu, inter, tg), num_warps=tg.num_warps, enable_fp_fusion=True,
        **pdl_args(x.device))
    # NOTE: a Pending residual (shared experts beside, layers/side_stream.py) joins here, so
    # it ran beside the routing, the inputs' scaling and the gate_up launch
    residual = resolve(residual)
    res = residual if residual is not None else out
    _down(act, flat_ids, weights.reshape(-1).contiguous(), dn, s_dn, res, out, parts,
          residual is not None, td, magic_dn)
    return out


def _even(w: _Weight, magic: int, rows: int, tiles: GemvTiles) -> bool:
    """Whether the subnormal loop's loads go unmasked: int4 unpacked as subnormals, every
    program's rows valid (rows: the output rows the tiles cover) and K whole tiles."""
    return magic == SUBNORMAL and rows % tiles.block_n == 0 and w.k % _block_k(tiles, w) == 0


def _act_buffer(slots: int, inter: int, x: torch.Tensor, subnormal: bool, tg: GemvTiles,
                block_k_down: int) -> torch.Tensor:
    """The gate_up kernel's output: [slots, inter] in x's dtype, or for a subnormal down the
    down kernel's inputs [slots, SUB_ROWS, words] fp32 (zeroed where the words are padded)."""
    if not subnormal:
        return torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    if tg.block_n % 8:
        raise ValueError(f"int4 'subnormal' down projections take gate_up tiles of whole words "
                         f"(block_n a multiple of 8), not {tg.block_n}")
    words = subnormal_words(inter, block_k_down)
    alloc = torch.empty if words * 8 == inter else torch.zeros
    return alloc(slots, SUB_ROWS, words, dtype=torch.float32, device=x.device)


def _down(act: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, dn: _Weight,
          s_dn: torch.Tensor, res: torch.Tensor, out: torch.Tensor, parts: int, has_res: bool,
          tiles: GemvTiles, magic: int) -> None:
    """out = the down kernel's weighted sum over picks (+ shared parts, + res): one program
    per (token, rows) looping over the picks, or with tiles.split one per (token, pick, rows)
    where arrival counters are at hand (moe_down.py: the same sums, bit for bit)."""
    t, hidden = out.shape
    top_k, inter = ids.numel() // t, dn.k
    shared_n = s_dn.shape[1] if parts else 0
    blocks = triton.cdiv(hidden, tiles.block_n)
    locks = arrival_locks(out.device, t * blocks) if tiles.split else None
    meta = dict(TOP_K=top_k, HAS_SHARED=parts > 0, HAS_RES=has_res, FORMAT=dn.fmt,
                GROUP_N=dn.group[0], GROUP_K=dn.group[1], MAGIC=magic, BLOCK_N=tiles.block_n,
                BLOCK_K=_block_k(tiles, dn), EVEN=_even(dn, magic, hidden, tiles),
                num_warps=tiles.num_warps, enable_fp_fusion=True, **pdl_args(out.device))
    strides = (*_strides(dn), s_dn.stride(0), res.stride(0), out.stride(0))
    if locks is None:
        _down_sum_kernel[(t, blocks)](act, ids, weights, dn.data, dn.scale, s_dn, res, out,
                                      hidden, inter, inter // 8, t * top_k, shared_n, parts,
                                      act.stride(0), *strides, **meta)
        return
    units = top_k + parts
    part = torch.empty(t * units, hidden, dtype=torch.float32, device=out.device)
    _down_split_kernel[(t * units, blocks)](act, ids, weights, dn.data, dn.scale, s_dn, res, out,
                                            part, locks, hidden, inter, inter // 8, t * top_k,
                                            shared_n, units, act.stride(0), *strides, **meta)
