"""Triton paged attention for absorbed multi-head latent attention (MLA: DeepSeek-V3, Kimi-K2).

Every query head attends over the same cached latent per token (deepseek_v3.py): the cache is
`[num_blocks, block_size, 1, KV_RANK + ROPE_DIM]` (512 + 64), bound as both K and V cache, and
q is `[T, H, KV_RANK + ROPE_DIM]`. A score is the no-rope part's dot plus the rope part's,
q[:, :KV_RANK] . c[:, :KV_RANK] + q[:, KV_RANK:] . c[:, KV_RANK:], two tl.dots of their own
widths (the generic kernel would pad 576 to 1024); the output is softmax(scores) @ c[:, :KV_RANK]
from the same latent tile, loaded once per key tile. The returned tensor is shaped like q; its
last ROPE_DIM columns are zeros (the model keeps out[..., :KV_RANK]; the torch reference would
put softmax @ c[:, KV_RANK:] there, which nothing reads).

A program owns (sequence or flat-grid tile, query tile, block of BLOCK_H heads, KV split); its
BLOCK_M rows are (token, head) pairs, row r = token r // BLOCK_H, head r % BLOCK_H, so a decode
token's 16 heads fill a tensor-core M and each latent tile serves BLOCK_M rows. Tile geometry,
the causal key range and the split-KV merge are the generic kernel's (triton_attention_tiles.py):
launch geometry depends only on shapes and metadata python ints, so CUDA graphs can capture it.
"""

from __future__ import annotations

from typing import NamedTuple

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
_MAX_Q = 2**31 - 1
_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
MAX_BLOCK_H = 16  # heads per program: a decode token's rows fill one 16-row tensor-core tile
MERGE_D_BLOCK = 64  # merge columns per program: 8 programs per row block over 512 dims
# NOTE: fewest keys per split for a decode token's rows: 32, not the generic kernel's 64 (one
# H200, `benchmarks/decode_tune.py`: 9.3 against 11.5 us at 16 heads and context 640, 11.0
# against 12.6 at 64 heads, equal at 4096).
MIN_KEYS_PER_SPLIT_DECODE = 32


@triton.jit
def _online_softmax(s, m_i, l_i):
    """One key tile's step of the exp2-domain online softmax over scores `s` (masked -inf):
    (probabilities, rescale of the rows' earlier sums, new running max, new running sum)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; exp2(-inf - -inf) would be NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit(do_not_specialize=["stride_bt", "num_seqs", "q_len_lo", "q_len_hi"])
def _mla_kernel(q_ptr, cache_ptr, out_ptr, part_ptr, lse_ptr,
                cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, qk_scale, num_seqs,
                q_len_lo, q_len_hi, stride_qt, stride_qh, stride_ot, stride_oh,
                stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                stride_cb, stride_cs, stride_bt,
                BLOCK_H: tl.constexpr, KV_RANK: tl.constexpr, ROPE_DIM: tl.constexpr,
                ROPE_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr, DOT_DTYPE: tl.constexpr,
                DOT_PRECISION: tl.constexpr, FLAT_GRID: tl.constexpr,
                USE_PDL: tl.constexpr = False):
    pdl_sync(USE_PDL)
    seq, q_tile = _program_tile(cu_seqlens_q_ptr, num_seqs, BLOCK_Q, FLAT_GRID)
    head_block, split = tl.program_id(2) // NUM_SPLITS, tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    # A launch serves the sequences of q_len_lo < q_len <= q_len_hi (short_query_len).
    if q_tile * BLOCK_Q >= q_len or q_len <= q_len_lo or q_len > q_len_hi:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    tok, head, row_ok = _query_rows(q_tile, head_block, q_len, BLOCK_H, BLOCK_Q, BLOCK_M)
    row = (q_start + tok).to(tl.int64)
    dc = tl.arange(0, KV_RANK)
    dr = tl.arange(0, ROPE_PAD)
    rope_ok = row_ok[:, None] & (dr < ROPE_DIM)[None, :]
    q_row = q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh
    q_c = tl.load(q_row + dc[None, :], mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
    q_r = tl.load(q_row + KV_RANK + dr[None, :], mask=rope_ok, other=0.0).to(DOT_DTYPE)
    if split == 0:  # the rope columns of the output: zeros (nothing reads them)
        tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + KV_RANK
                 + dr[None, :], tl.zeros([BLOCK_M, ROPE_PAD], out_ptr.dtype.element_ty),
                 mask=rope_ok)
    q_pos = seq_len - q_len + tok  # absolute position of each row's token

    lo, hi, kv_end = _split_keys(seq_len, q_len, q_tile, split, BLOCK_Q, BLOCK_N, CAUSAL,
                                 NUM_SPLITS, MIN_CHUNK)
    # NOTE: a split past the keys writes only its lse, -inf (weight 0): the merge kernel reads
    # only the splits that got keys, mla_one_token's merge every split.
    if split > 0 and lo >= kv_end:
        tl.store(lse_ptr + row * stride_lt + head * stride_lh + split,
                 tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
        return

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, KV_RANK], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        pos, kv_ok, block, offset = _key_slots(table, start, hi, BLOCK_N, BLOCK_SIZE)
        latent = cache_ptr + (block * stride_cb + offset * stride_cs)[:, None]
        c = tl.load(latent + dc[None, :], mask=kv_ok[:, None], other=0.0).to(DOT_DTYPE)
        r = tl.load(latent + KV_RANK + dr[None, :], mask=kv_ok[:, None] & (dr < ROPE_DIM)[None, :],
                    other=0.0).to(DOT_DTYPE)
        s = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)
        s = tl.dot(q_r, tl.trans(r), acc=s, input_precision=DOT_PRECISION) * qk_scale
        visible = kv_ok[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        p, alpha, m_i, l_i = _online_softmax(tl.where(visible, s, float("-inf")), m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), c, input_precision=DOT_PRECISION)

    # NOTE: l == 0 only for rows with no visible key (empty split, seq_len 0): they output 0.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    part_ptrs = (part_ptr + row[:, None] * stride_pt + head[:, None] * stride_ph
                 + split * stride_ps + dc[None, :])
    tl.store(part_ptrs, (acc / l_safe[:, None]).to(part_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    if NUM_SPLITS > 1:
        # m = -inf exactly when l = 0, so an empty split's lse is -inf and weighs nothing.
        tl.store(lse_ptr + row * stride_lt + head * stride_lh + split, m_i + tl.log2(l_safe),
                 mask=row_ok)


def head_block(num_heads: int) -> int:
    """Heads per program: the largest divisor of num_heads up to MAX_BLOCK_H (16 for 16, 64 and
    128 heads), so head blocks tile the heads exactly (a block of 12 leaves padding rows)."""
    return max(h for h in range(1, min(num_heads, MAX_BLOCK_H) + 1) if num_heads % h == 0)


def launch_config(block_m: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for programs of `block_m` rows (16: a decode token's
    heads; 32: longer queries). NOTE: q (BLOCK_M x 576) and the latent tile (BLOCK_N x 576) sit
    in shared memory as bf16, the accumulator (BLOCK_M x 512 fp32) in registers, which bounds
    BLOCK_M: 64 rows spill on 4 or 8 warps. 32-key tiles on 8 warps compile for sm_90 without
    spills at 66 KB (16 rows, 167 registers) and 84 KB (32 rows, 225); 64-key tiles spill.
    tests/test_triton_compile.py checks these against an H200's 227 KB."""
    if block_m <= 16:
        return 32, 8, 1
    return 32, 8, 1


class LaunchPlan(NamedTuple):
    block_h: int  # heads per program
    block_q: int  # query tokens per program
    block_m: int  # rows per program: block_q x block_h, rounded up to a power of two
    block_n: int
    num_warps: int
    num_stages: int
    flat: bool
    tiles: tuple[int, int]  # grid axes 0 and 1: (flat tiles, 1) or (sequences, query tiles)
    head_blocks: int
    splits: int
    min_keys: int  # fewest keys per split


class TritonMLABackend:
    """An AttentionBackend for absorbed MLA over a latent cache bound as both K and V cache."""

    name = "triton_mla"
    # NOTE: attend reads only k_cache (V is K's latent), so a fused op may write entries
    # straight into it (PagedAttention.direct_cache; layers/mla_fused.py).
    reads_k_cache_only = True

    def __init__(self, kv_lora_rank: int = 512, max_block_m: int = 32,
                 num_splits: int | None = None, split_keys: int | None = None,
                 block_n: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, flat_grid: bool = False) -> None:
        """`kv_lora_rank`: the latent's no-rope width (the rest of head_dim is the rope part;
        512 for DeepSeek-V3 and Kimi-K2). `max_block_m` caps the (token, head) rows per program;
        `num_splits`, `split_keys` (fewest keys per split), `block_n`, `num_warps` and
        `num_stages` override the heuristics / launch_config; `flat_grid` as in
        TritonAttentionBackend."""
        if kv_lora_rank < 16 or kv_lora_rank & (kv_lora_rank - 1):
            raise ValueError(f"kv_lora_rank must be a power of two >= 16, got {kv_lora_rank}")
        if max_block_m < 16 or max_block_m & (max_block_m - 1):
            raise ValueError(f"max_block_m must be a power of two >= 16, got {max_block_m}")
        self.kv_lora_rank, self.max_block_m = kv_lora_rank, max_block_m
        self.num_splits, self.split_keys = num_splits, split_keys
        self.overrides = (block_n, num_warps, num_stages)
        self.flat_grid = flat_grid

    def tiles(self, max_query_len: int, num_heads: int) -> tuple[int, int, int]:
        """(BLOCK_H, BLOCK_Q, BLOCK_M): heads, tokens and rows per program. NOTE: as in the
        generic kernel, every query longer than a split-sized one gets the largest tile, so
        serving compiles the graphs' short-query variants plus one for all long ones."""
        block_h = head_block(num_heads)
        want = triton.next_power_of_2(max_query_len * block_h)
        if max_query_len > SPLIT_MAX_QUERY_LEN:
            want = self.max_block_m
        block_m = max(16, triton.next_power_of_2(block_h), min(want, self.max_block_m))
        return block_h, block_m // block_h, block_m

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kv(k, v, k_cache, v_cache, slot_mapping)  # K = V = the latent: written once

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, H, D] over the latent cache [N, block_size, 1, D] -> [T, H, D], of which the
        first kv_lora_rank columns are the attention output and the rest zeros."""
        rank = self.kv_lora_rank
        # NOTE: rows of tokens that belong to no sequence (graph padding) are left unwritten.
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if q.shape[0] == 0 or meta.num_seqs == 0 or meta.max_query_len == 0:
            return out.zero_()
        if k_cache.shape[2] != 1 or k_cache.shape[3] != q.shape[2] or q.shape[2] <= rank:
            raise ValueError(f"MLA attention needs q [T, H, D] and a latent cache [N, B, 1, D] "
                             f"with D > kv_lora_rank {rank}; got {tuple(q.shape)} and "
                             f"{tuple(k_cache.shape)}")
        # NOTE: V is K's latent, so only k_cache is read: a v_cache bound apart (the memory
        # profile's throwaway cache) holds the same values, store_kv having written both.
        assert k_cache.stride(3) == 1 and q.stride(2) == 1
        short = min(meta.short_query_len, meta.max_query_len)
        if short:
            self._launch(q, k_cache, out, meta, scale, short, (0, short))
        if short < meta.max_query_len:
            self._launch(q, k_cache, out, meta, scale, meta.max_query_len, (short, _MAX_Q))
        return out

    def plan(self, num_tokens: int, num_heads: int, meta: AttentionMetadata, max_q: int,
             device: torch.device) -> LaunchPlan:
        """A launch's geometry for queries of up to `max_q` tokens: a pure function of shapes
        and metadata ints (never tensor values), so a CUDA-graph bucket gets a fixed one."""
        block_h, block_q, block_m = self.tiles(max_q, num_heads)
        block_n, num_warps, num_stages = (o or c for o, c in zip(self.overrides,
                                                                launch_config(block_m)))
        flat = self.flat_grid or meta.flat_grid
        tiles = (triton.cdiv(num_tokens, block_q) + meta.num_seqs, 1) if flat \
            else (meta.num_seqs, triton.cdiv(max_q, block_q))
        min_keys, max_splits = split_limits(block_m)
        if block_m <= 16:
            min_keys = MIN_KEYS_PER_SPLIT_DECODE
        min_keys = self.split_keys or min_keys
        head_blocks = num_heads // block_h
        splits = self.num_splits or choose_num_splits(
            tiles[0] * tiles[1] * head_blocks, max_q, meta.max_seq_len, num_sms(device),
            min_keys, max_splits)
        return LaunchPlan(block_h, block_q, block_m, block_n, num_warps, num_stages, flat, tiles,
                          head_blocks, splits, min_keys)

    def attend_partials(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For one sequence's one-token step split over its keys: the attention kernel alone,
        returning its per-split outputs part [1, H, S, kv_lora_rank] (fp32, normalised) and
        lse [1, H, S] (log2; -inf for a split without keys), whose merge the caller does
        (mla_one_token.absorb_merge). None (nothing launched) for any other step."""
        if q.shape[0] != 1 or meta.num_seqs != 1 or meta.max_query_len != 1 \
                or k_cache.shape[2:] != (1, q.shape[2]) or q.shape[2] <= self.kv_lora_rank:
            return None
        if self.plan(1, q.shape[1], meta, 1, q.device).splits < 2:
            return None
        assert k_cache.stride(3) == 1 and q.stride(2) == 1
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # its rope zeros: unread
        return self._launch(q, k_cache, out, meta, scale, 1, (0, _MAX_Q), merge=False)

    def _launch(self, q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor,
                meta: AttentionMetadata, scale: float, max_q: int,
                q_range: tuple[int, int], merge: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kernels over the sequences whose query length is in (q_range[0], q_range[1]],
        tiled for queries of up to `max_q` tokens; without `merge` (and split) the split-KV
        merge is left out and (part, lse) returned."""
        num_tokens, num_heads, head_dim = q.shape
        rank, p = self.kv_lora_rank, self.plan(q.shape[0], q.shape[1], meta, max_q, q.device)
        if p.splits > 1:
            part = torch.empty(num_tokens, num_heads, p.splits, rank, dtype=torch.float32,
                               device=q.device)
            lse = torch.empty(num_tokens, num_heads, p.splits, dtype=torch.float32,
                              device=q.device)
            part_strides = part.stride()[:3]
        else:
            part, lse, part_strides = out, out, (*out.stride()[:2], 0)  # lse unused
        dot_dtype = _DOT_DTYPES[q.dtype]
        if q.device.type == "cpu" and q.dtype == torch.bfloat16:
            # NOTE: the interpreter's tl.dot multiplies bf16 as raw int16 bits (numpy has no
            # bf16), so interpreted runs do bf16 products in fp32.
            dot_dtype = tl.float32
        common = dict(BLOCK_Q=p.block_q, BLOCK_M=p.block_m, BLOCK_N=p.block_n,
                      CAUSAL=meta.causal, NUM_SPLITS=p.splits, FLAT_GRID=p.flat)
        _mla_kernel[(*p.tiles, p.head_blocks * p.splits)](
            q, cache, out, part, lse, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
            scale * _LOG2E, meta.num_seqs, *q_range, q.stride(0), q.stride(1), out.stride(0),
            out.stride(1), *part_strides, lse.stride(0), lse.stride(1), cache.stride(0),
            cache.stride(1), meta.block_tables.stride(0),
            BLOCK_H=p.block_h, KV_RANK=rank, ROPE_DIM=head_dim - rank,
            ROPE_PAD=max(16, triton.next_power_of_2(head_dim - rank)), BLOCK_SIZE=cache.shape[1],
            MIN_CHUNK=p.min_keys if p.splits > 1 else 0, DOT_DTYPE=dot_dtype,
            DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
            num_warps=p.num_warps, num_stages=p.num_stages, **common, **pdl_args(q.device))
        if p.splits > 1 and not merge:
            return part, lse
        if p.splits > 1:
            d_block = min(MERGE_D_BLOCK, rank)
            _merge_kernel[(*p.tiles, p.head_blocks * triton.cdiv(rank, d_block))](
                part, lse, out, meta.cu_seqlens_q, meta.seq_lens, meta.num_seqs, *q_range,
                *part.stride()[:3], lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
                GROUP=p.block_h, HEAD_DIM=rank, D_BLOCK=d_block, MIN_CHUNK=p.min_keys,
                num_warps=4, **common, **pdl_args(q.device))
        return None
