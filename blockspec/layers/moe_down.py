"""The decode experts' down projection (moe_decode.py): one program per (token, rows) looping
over the picks (`_down_sum_kernel`), or one per (token, pick, rows) (`_down_split_kernel`):

    part[t, u, rows] = weight[t, u] W_down[e_tu][rows] act[t k + u]     (rounded once), u < k
    part[t, k + j, rows] = W_shared_down[rows, part j] act_shared[t, j]   (the folded shared MLP)
    out[t, rows] = the last of the token's programs over those rows to finish: the sums of
                   _down_sum_kernel, in its order (so its result bit for bit)

A program that loops over the picks streams them one after another, its loads waiting on the
pick before; here every pick's rows stream at once. The programs of one (token, rows) count
their arrivals in `locks` (arrival.py; int32, zero between launches: the last resets its
counter); the last to arrive reads the others' fp32 partials, so the sum is in pick order
whatever the timing.
On an H200 it measured no faster than the loop for int4 and faster for bf16 at one token only
(docs/benchmarks.md, "MoE targets"): opt-in, GemvTiles.split.
"""

from __future__ import annotations

import triton
import triton.language as tl

from blockspec.layers.arrival import _last_to_arrive
from blockspec.layers.fused import _cast, _rnd
from blockspec.layers.gemv_rows import _dot_rows
from blockspec.layers.pdl import pdl_sync


@triton.jit
def _routed_part(act_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, tok, u, rows, ok, inter, k_words,
                 stride_act, stride_we, stride_wn, stride_se, stride_sn, dtype: tl.constexpr,
                 TOP_K: tl.constexpr, FORMAT: tl.constexpr, GROUP_N: tl.constexpr,
                 GROUP_K: tl.constexpr, MAGIC: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN: tl.constexpr = False):
    """Pick u of token tok over rows, times its weight, rounded once (fp32)."""
    slot = tok * TOP_K + u
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    acc = _dot_rows(w_ptr + expert * stride_we, s_ptr + expert * stride_se,
                    act_ptr + slot * stride_act, rows, ok, inter, k_words, stride_wn, stride_sn,
                    FORMAT, GROUP_N, GROUP_K, MAGIC, dtype, BLOCK_N, BLOCK_K, EVEN)
    return _rnd(acc * tl.load(wts_ptr + slot).to(tl.float32), dtype)


@triton.jit
def _shared_part(act_ptr, sd_ptr, tok, j, rows, ok, inter, k_words, num_slots, shared_n, parts,
                 stride_act, stride_sdn, dtype: tl.constexpr, FORMAT: tl.constexpr,
                 GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, MAGIC: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The shared experts' down projection of rows over their part j's columns (fp32)."""
    act = act_ptr + (num_slots + tok * parts + j) * stride_act
    return _dot_rows(sd_ptr + j * inter, sd_ptr, act, rows, ok,
                     tl.minimum(inter, shared_n - j * inter), k_words, stride_sdn, 0, FORMAT,
                     GROUP_N, GROUP_K, MAGIC, dtype, BLOCK_N, BLOCK_K)


@triton.jit
def _store_out(out_ptr, res_ptr, tok, rows, ok, total, shared, stride_rm, stride_om,
               dtype: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_RES: tl.constexpr):
    """out[tok, rows] = total rounded (the picks' sum), + shared rounded (once, as the shared
    MLP's output, then added like a residual), + res."""
    out = _rnd(total, dtype)
    if HAS_SHARED:
        out += _rnd(shared, dtype)
    if HAS_RES:
        out += tl.load(res_ptr + tok * stride_rm + rows, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + tok * stride_om + rows, _cast(out, dtype), mask=ok)


@triton.jit
def _down_split_kernel(act_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, sd_ptr, res_ptr, out_ptr,
                       part_ptr, lock_ptr, n, inter, k_words, num_slots, shared_n, units,
                       stride_act, stride_we, stride_wn, stride_se, stride_sn, stride_sdn,
                       stride_rm, stride_om, TOP_K: tl.constexpr, HAS_RES: tl.constexpr,
                       FORMAT: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                       MAGIC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       HAS_SHARED: tl.constexpr = False, EVEN: tl.constexpr = False,
                       USE_PDL: tl.constexpr = False):
    pdl_sync(USE_PDL)
    unit = tl.program_id(0).to(tl.int64)  # token * units + u: a token's units side by side
    tok, u = unit // units, unit % units
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < n
    dtype = out_ptr.dtype.element_ty
    if HAS_SHARED and u >= TOP_K:
        val = _shared_part(act_ptr, sd_ptr, tok, u - TOP_K, rows, ok, inter, k_words, num_slots,
                           shared_n, units - TOP_K, stride_act, stride_sdn, dtype, FORMAT,
                           GROUP_N, GROUP_K, MAGIC, BLOCK_N, BLOCK_K)
    else:
        val = _routed_part(act_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, tok, u, rows, ok, inter,
                           k_words, stride_act, stride_we, stride_wn, stride_se, stride_sn, dtype,
                           TOP_K, FORMAT, GROUP_N, GROUP_K, MAGIC, BLOCK_N, BLOCK_K, EVEN)
    tl.store(part_ptr + unit * n + rows, val, mask=ok)
    lock = lock_ptr + tok * tl.num_programs(1) + tl.program_id(1)
    if _last_to_arrive(lock, units):  # reads past L1 (.cg), then resets the counter
        base = part_ptr + tok * units * n + rows
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for p in range(TOP_K):
            total += tl.load(base + p * n, mask=ok, other=0.0, cache_modifier=".cg")
        shared = tl.zeros([BLOCK_N], dtype=tl.float32)
        if HAS_SHARED:
            for j in range(units - TOP_K):
                shared += tl.load(base + (TOP_K + j) * n, mask=ok, other=0.0,
                                  cache_modifier=".cg")
        _store_out(out_ptr, res_ptr, tok, rows, ok, total, shared, stride_rm, stride_om, dtype,
                   HAS_SHARED, HAS_RES)
        tl.atomic_xchg(lock, 0)


@triton.jit
def _down_sum_kernel(act_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, sd_ptr, res_ptr, out_ptr, n, inter,
                     k_words, num_slots, shared_n, parts, stride_act, stride_we, stride_wn,
                     stride_se, stride_sn, stride_sdn, stride_rm, stride_om,
                     TOP_K: tl.constexpr, HAS_RES: tl.constexpr, FORMAT: tl.constexpr,
                     GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, MAGIC: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     HAS_SHARED: tl.constexpr = False, EVEN: tl.constexpr = False,
                     USE_PDL: tl.constexpr = False):
    pdl_sync(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < n
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for p in range(TOP_K):
        # NOTE: each weighted pick rounds once, the sum over picks once (run_experts' order).
        total += _routed_part(act_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, tok, p, rows, ok, inter,
                              k_words, stride_act, stride_we, stride_wn, stride_se, stride_sn,
                              dtype, TOP_K, FORMAT, GROUP_N, GROUP_K, MAGIC, BLOCK_N, BLOCK_K,
                              EVEN)
    shared = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_SHARED:  # the shared experts' down projection over their parts' columns
        for j in range(parts):
            shared += _shared_part(act_ptr, sd_ptr, tok, j, rows, ok, inter, k_words, num_slots,
                                   shared_n, parts, stride_act, stride_sdn, dtype, FORMAT,
                                   GROUP_N, GROUP_K, MAGIC, BLOCK_N, BLOCK_K)
    _store_out(out_ptr, res_ptr, tok, rows, ok, total, shared, stride_rm, stride_om, dtype,
               HAS_SHARED, HAS_RES)
