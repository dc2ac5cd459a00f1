"""Triton paged attention with the semantics of `TorchAttentionBackend` (see attention.py).

One kernel serves every query length. A program owns (sequence, query tile, KV head); its BLOCK_M
rows pack the GQA group's query heads (row r = token r // GROUP, head r % GROUP), so each K/V tile
is loaded once per group and even a single decode token fills a tensor-core-sized M. Keys are
walked in BLOCK_N tiles whose block ids are gathered per key from the block table, so any
power-of-two KV block size works. Online softmax runs in fp32, in the exp2 domain.

For short queries over long contexts (decode, verify, drafter blocks) the key range can be split
NUM_SPLITS ways (flash-decoding): each split writes a partial output and its log-sum-exp, and a
second kernel merges them. Launch geometry depends only on shapes and metadata python ints
(num_seqs, max_query_len, max_seq_len), never on tensor values, so both paths are capturable in a
CUDA graph when the host passes a graph bucket's fixed values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockspec.layers.attention import AttentionMetadata
from blockspec.layers.attention_splits import (
    SPLIT_MAX_QUERY_LEN,
    choose_num_splits,
    num_sms,
    split_limits,
)
from blockspec.layers.pdl import pdl_args, pdl_sync
from blockspec.layers.triton_attention_tiles import (
    _key_slots,
    _merge_kernel,
    _program_tile,
    _query_rows,
    _split_keys,
)
from blockspec.layers.triton_kv_store import store_kv

_LOG2E = 1.4426950408889634
_MAX_Q = 2**31 - 1  # no upper bound on a launch's query lengths
_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit(do_not_specialize=["stride_bt", "num_seqs", "q_len_lo", "q_len_hi"])
def _attn_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr,
                 cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, qk_scale, num_seqs,
                 q_len_lo, q_len_hi,
                 stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
                 stride_cb, stride_cs, stride_ch, stride_bt,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 MIN_CHUNK: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 FLAT_GRID: tl.constexpr,
                 USE_PDL: tl.constexpr = False):
    pdl_sync(USE_PDL)
    seq, q_tile = _program_tile(cu_seqlens_q_ptr, num_seqs, BLOCK_Q, FLAT_GRID)
    kv_head, split = tl.program_id(2) // NUM_SPLITS, tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    # The grid covers the longest query in the batch; shorter ones have idle tiles. A launch
    # serves the sequences of q_len_lo < q_len <= q_len_hi (the others are another launch's).
    if q_tile * BLOCK_Q >= q_len or q_len <= q_len_lo or q_len > q_len_hi:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    tok, head, row_ok = _query_rows(q_tile, kv_head, q_len, GROUP, BLOCK_Q, BLOCK_M)
    row = (q_start + tok).to(tl.int64)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
    q_pos = seq_len - q_len + tok  # absolute position of each row's token

    lo, hi, kv_end = _split_keys(seq_len, q_len, q_tile, split, BLOCK_Q, BLOCK_N, CAUSAL,
                                 NUM_SPLITS, MIN_CHUNK)
    # NOTE: a split past the keys writes nothing; the merge reads only the splits that got keys
    # (split 0 always runs, so a sequence without keys still writes its zero rows).
    if split > 0 and lo >= kv_end:
        return

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        pos, kv_ok, block, offset = _key_slots(table, start, hi, BLOCK_N, BLOCK_SIZE)
        kv_off = block * stride_cb + offset * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None],
                    mask=kv_ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * qk_scale
        visible = kv_ok[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; exp2(-inf - -inf) would be NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :],
                    mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                            input_precision=DOT_PRECISION)
        m_i = m_new

    # NOTE: l == 0 only for rows with no visible key (empty split, seq_len 0): they output 0.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    out_ptrs = (out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh
                + split * stride_os + d[None, :])
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if NUM_SPLITS > 1:
        # m = -inf exactly when l = 0, so an empty split's lse is -inf and weighs nothing.
        tl.store(lse_ptr + row * stride_lt + head * stride_lh + split, m_i + tl.log2(l_safe),
                 mask=row_ok)


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, max_block_m: int = 128, block_n: int = 64, num_splits: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None,
                 split_keys: int | None = None, flat_grid: bool = False) -> None:
        """Tuning knobs: `max_block_m` caps the query rows per program, `block_n` is the key
        tile; `num_splits`, `split_keys` (fewest keys per split), `num_warps` and `num_stages`
        override the heuristics / defaults. `flat_grid`: programs over every sequence's query
        tiles in turn (cdiv(tokens, BLOCK_Q) + num_seqs of them) instead of num_seqs x the
        longest query's tiles, for every call (metadata asks for it per call:
        AttentionMetadata.flat_grid)."""
        self.max_block_m, self.block_n, self.num_splits = max_block_m, block_n, num_splits
        self.num_warps, self.num_stages, self.split_keys = num_warps, num_stages, split_keys
        self.flat_grid = flat_grid

    def block_m(self, max_query_len: int, group: int) -> int:
        """Query rows per program. tl.dot needs M >= 16 and a whole GQA group fits in one tile.
        NOTE: a query longer than a split-sized one (prefill chunks, mixed steps) always gets
        the largest tile, so the compiled variants are those of the graphs' short queries plus
        one for all long ones, whatever lengths requests bring."""
        want = triton.next_power_of_2(max_query_len * group)
        if max_query_len > SPLIT_MAX_QUERY_LEN:
            want = self.max_block_m
        return max(16, triton.next_power_of_2(group), min(want, self.max_block_m))

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kv(k, v, k_cache, v_cache, slot_mapping)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # NOTE: rows of tokens that belong to no sequence (graph padding) are left unwritten.
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if q.shape[0] == 0 or meta.num_seqs == 0 or meta.max_query_len == 0:
            return out.zero_()
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
        assert q.stride(2) == 1 and q.shape[1] % k_cache.shape[2] == 0
        short = min(meta.short_query_len, meta.max_query_len)
        if short:
            # Two launches: queries of <= `short` tokens with their own (small) tile, longer
            # ones with the largest; each sequence is served by exactly one.
            self._launch(q, k_cache, v_cache, out, meta, scale, short, (0, short))
        if short < meta.max_query_len:
            self._launch(q, k_cache, v_cache, out, meta, scale, meta.max_query_len,
                         (short, _MAX_Q))
        return out

    def _launch(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                out: torch.Tensor, meta: AttentionMetadata, scale: float, max_q: int,
                q_range: tuple[int, int]) -> None:
        """The kernels over the sequences whose query length is in (q_range[0], q_range[1]],
        tiled for queries of up to `max_q` tokens."""
        num_tokens, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        num_seqs = meta.num_seqs
        group = num_heads // num_kv_heads
        block_m = self.block_m(max_q, group)
        block_q = block_m // group
        # NOTE: queries of split size or less (the short launch) take one tile per lane: the
        # flat grid (its idle programs, each one's search for its sequence) cost them 12 us a
        # layer (H200, a mixed step's 30 verify blocks beside a prompt chunk: 42 against 30
        # us; docs/benchmarks.md).
        flat = (self.flat_grid or meta.flat_grid) and max_q > SPLIT_MAX_QUERY_LEN
        # Axes 0 and 1 of the grid: (every sequence's tiles in turn, 1) or (sequence, tile).
        tiles = (triton.cdiv(num_tokens, block_q) + num_seqs, 1) if flat \
            else (num_seqs, triton.cdiv(max_q, block_q))
        num_programs = tiles[0] * tiles[1] * num_kv_heads
        min_keys, max_splits = split_limits(block_m)
        min_keys = self.split_keys or min_keys
        splits = self.num_splits or choose_num_splits(num_programs, max_q, meta.max_seq_len,
                                                       num_sms(q.device), min_keys, max_splits)
        d_pad = triton.next_power_of_2(max(head_dim, 16))
        # NOTE: 4 warps beat 8 on an H200 for decode, verify and 128-row prefill tiles alike.
        common = dict(GROUP=group, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_Q=block_q,
                      BLOCK_M=block_m, num_warps=self.num_warps or 4)
        if splits > 1:
            part = torch.empty(num_tokens, num_heads, splits, head_dim, dtype=torch.float32,
                               device=q.device)
            lse = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32,
                              device=q.device)
            dst, dst_strides = part, part.stride()[:3]
        else:
            lse, dst, dst_strides = out, out, (*out.stride()[:2], 0)  # lse unused
        dot_dtype = _DOT_DTYPES[q.dtype]
        if q.device.type == "cpu" and q.dtype == torch.bfloat16:
            # NOTE: the interpreter's tl.dot multiplies bf16 as raw int16 bits (numpy has no
            # bf16), so interpreted runs do bf16 products in fp32.
            dot_dtype = tl.float32
        _attn_kernel[(*tiles, num_kv_heads * splits)](
            q, k_cache, v_cache, dst, lse, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
            scale * _LOG2E, num_seqs, *q_range, q.stride(0), q.stride(1), *dst_strides,
            lse.stride(0), lse.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
            BLOCK_SIZE=block_size, BLOCK_N=self.block_n, CAUSAL=meta.causal, NUM_SPLITS=splits,
            MIN_CHUNK=min_keys if splits > 1 else 0, DOT_DTYPE=dot_dtype,
            DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32", FLAT_GRID=flat,
            **({"num_stages": self.num_stages} if self.num_stages else {}), **common,
            **pdl_args(q.device))
        if splits > 1:
            # NOTE: a block's rows (64) merge in 32-column slices for more programs; a decode
            # token's few rows whole (slicing them measured slower).
            d_block = d_pad if block_m <= 16 else min(d_pad, 32)
            _merge_kernel[(*tiles, num_kv_heads * triton.cdiv(head_dim, d_block))](
                part, lse, out, meta.cu_seqlens_q, meta.seq_lens, num_seqs, *q_range,
                *part.stride()[:3], lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
                GROUP=group, HEAD_DIM=head_dim, D_BLOCK=d_block, BLOCK_Q=block_q,
                BLOCK_M=block_m, BLOCK_N=self.block_n, CAUSAL=meta.causal, NUM_SPLITS=splits,
                MIN_CHUNK=min_keys, FLAT_GRID=flat, num_warps=self.num_warps or 4,
                **pdl_args(q.device))
