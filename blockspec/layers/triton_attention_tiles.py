"""The tile geometry the paged-attention kernels share (which sequence and query tile a program
owns, its rows, the keys it attends to) and the split-KV merge kernel (triton_attention.py)."""

from __future__ import annotations

import triton
import triton.language as tl

from blockspec.layers.pdl import pdl_sync


@triton.jit
def _program_tile(cu_seqlens_q_ptr, num_seqs, BLOCK_Q: tl.constexpr, FLAT_GRID: tl.constexpr):
    """(sequence, query tile) of this program. A flat grid walks every sequence's tiles in turn
    on axis 0: sequence s starts at program cu[s] // BLOCK_Q + s (a start off a tile boundary
    costs it at most one tile), so the grid is cdiv(tokens, BLOCK_Q) + num_seqs whatever the
    longest query, and a binary search over the starts finds the sequence."""
    pid = tl.program_id(0)
    seq, q_tile = pid, tl.program_id(1)
    if FLAT_GRID:
        lo = pid * 0  # NOTE: invariant start(lo) <= pid < start(hi); start(0) = 0
        hi = lo + num_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= pid:
                lo = mid
            else:
                hi = mid
        seq, q_tile = lo, pid - (tl.load(cu_seqlens_q_ptr + lo) // BLOCK_Q + lo)
    return seq, q_tile


@triton.jit
def _query_rows(q_tile, kv_head, q_len, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """Token (within the sequence's query), query head and validity of each of a tile's rows."""
    r = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + r // GROUP
    head = kv_head * GROUP + r % GROUP
    # NOTE: BLOCK_M is a power of two, BLOCK_Q * GROUP need not be: the rows past it are padding.
    return tok, head, (r < BLOCK_Q * GROUP) & (tok < q_len)


@triton.jit
def _split_range(seq_len, q_len, q_tile, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr):
    """(keys a query tile attends to, keys per split): whole BLOCK_N tiles per split, and at
    least MIN_CHUNK keys, so a short context uses fewer splits than the launch has (graphs fix
    NUM_SPLITS from max_seq_len; the context is what it is)."""
    kv_end = seq_len
    if CAUSAL:  # keys past the tile's last token are masked for every row: skip them
        kv_end = tl.minimum(seq_len, seq_len - q_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len))
    # NOTE: cdiv spelled out: tl.cdiv fails under triton 3.6's interpreter.
    chunk = ((kv_end + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    return kv_end, tl.maximum(chunk, MIN_CHUNK)


@triton.jit
def _split_keys(seq_len, q_len, q_tile, split, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr):
    """(first key, end of keys, keys the tile attends to) of KV split `split`: the
    `_split_range` chunk it owns; lo >= kv_end for a split past the keys."""
    kv_end, chunk = _split_range(seq_len, q_len, q_tile, BLOCK_Q, BLOCK_N, CAUSAL, NUM_SPLITS,
                                 MIN_CHUNK)
    lo = split * chunk
    return lo, tl.minimum(lo + chunk, kv_end), kv_end


@triton.jit
def _key_slots(table, start, hi, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The key tile at `start`: (positions, which are below `hi`, each key's cache block id from
    the block table, its offset in that block). NOTE: masked-off keys are never loaded, so
    unwritten cache slots may hold anything."""
    pos = start + tl.arange(0, BLOCK_N)
    kv_ok = pos < hi
    block = tl.load(table + pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
    return pos, kv_ok, block, pos % BLOCK_SIZE


# NOTE: the block table's row stride is the batch's widest table in eager steps, so it changes
# step to step; specialising on its value (== 1, divisible by 16) would compile new variants
# mid-serving (~1 s each on an H200) for a scalar gather that gains nothing from them.


@triton.jit
def _merge_splits(lse_ptrs, part_ptrs, stride_ps, row_ok, num_active, mask,
                  NUM_SPLITS: tl.constexpr):
    """Rows' split-KV partials merged, fp32 [R, D]: sum_s w_s part_s / sum_s w_s with
    w_s = exp2(lse_s - max lse) over the splits s < num_active of each row in row_ok; lse at
    lse_ptrs [R] + s, partials at part_ptrs [R, D] + s * stride_ps, `mask` [R, D] the columns.

    NOTE: unrolled over every split, reading only those that ran (masked loads move no bytes):
    a loop bounded by num_active would serialize the loads' latency. A split with lse -inf
    weighs 0 and its partial is not loaded (mla_one_token reads splits that never wrote one).
    The weighted sum is an explicit fma, so every kernel that merges (whatever its launch's
    fp fusion) rounds alike: mla_one_token's merge equals this kernel's bit for bit."""
    zero = tl.zeros_like(row_ok).to(tl.int32)  # NOTE: splits as row vectors: masks are tensors
    m = tl.full(row_ok.shape, float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        ran = row_ok & (zero + s < num_active)
        m = tl.maximum(m, tl.load(lse_ptrs + s, mask=ran, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.zeros(row_ok.shape, tl.float32)
    acc = tl.zeros(mask.shape, tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        ran = row_ok & (zero + s < num_active)
        lse = tl.load(lse_ptrs + s, mask=ran, other=float("-inf"))
        w = tl.exp2(lse - m)
        denom += w
        part = tl.load(part_ptrs + s * stride_ps,
                       mask=mask & (ran & (lse > float("-inf")))[:, None], other=0.0)
        acc = tl.fma(w[:, None], part, acc)
    return acc / tl.where(denom == 0.0, 1.0, denom)[:, None]


@triton.jit(do_not_specialize=["num_seqs", "q_len_lo", "q_len_hi"])
def _merge_kernel(part_ptr, lse_ptr, out_ptr, cu_seqlens_q_ptr, seq_lens_ptr, num_seqs,
                  q_len_lo, q_len_hi,
                  stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_BLOCK: tl.constexpr,
                  BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr,
                  FLAT_GRID: tl.constexpr,
                  USE_PDL: tl.constexpr = False):
    pdl_sync(USE_PDL)
    # NOTE: _attn_kernel's grid and row mapping, each (seq, tile, kv head) cut into D_BLOCK-wide
    # column slices for parallelism; it reads only the splits that got keys (_split_range).
    seq, q_tile = _program_tile(cu_seqlens_q_ptr, num_seqs, BLOCK_Q, FLAT_GRID)
    d_slices: tl.constexpr = (HEAD_DIM + D_BLOCK - 1) // D_BLOCK
    kv_head, d_slice = tl.program_id(2) // d_slices, tl.program_id(2) % d_slices
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len or q_len <= q_len_lo or q_len > q_len_hi:
        return
    kv_end, chunk = _split_range(tl.load(seq_lens_ptr + seq), q_len, q_tile, BLOCK_Q, BLOCK_N,
                                 CAUSAL, NUM_SPLITS, MIN_CHUNK)
    num_active = tl.maximum((kv_end + chunk - 1) // chunk, 1)
    tok, head, row_ok = _query_rows(q_tile, kv_head, q_len, GROUP, BLOCK_Q, BLOCK_M)
    row = (q_start + tok).to(tl.int64)
    d = d_slice * D_BLOCK + tl.arange(0, D_BLOCK)
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    lse_ptrs = lse_ptr + row * stride_lt + head * stride_lh
    part_ptrs = part_ptr + row[:, None] * stride_pt + head[:, None] * stride_ph + d[None, :]

    out = _merge_splits(lse_ptrs, part_ptrs, stride_ps, row_ok, num_active, mask, NUM_SPLITS)
    tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)
