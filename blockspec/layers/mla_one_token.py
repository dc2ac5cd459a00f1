"""MLA's one-token step (a batch-1 decode) in two launches fewer a layer.

At one token the work around MLA's attention is a chain of small launches, each moving next to
no bytes: the query's absorb into the latent space (q_nope @ W_UK), the rope and latent norm
(mla_fused.py), the attention, its split-KV merge and the absorb out of the latent space
(out @ W_UV^T). In a CUDA graph each launch costs its dependency on the previous one
(layers/pdl.py), so two of them fold into their neighbours here:

- `absorb_rope_norm`: the W_UK absorb's programs and mla_rope_norm's (one per head's query rope,
  one for the cache entry) in one grid;
- `absorb_merge`: each W_UV absorb program merges its head's split-KV partials
  (TritonMLABackend.attend_partials) itself, in the merge kernel's order and rounding, where a
  merge launch wrote them to memory for it to read.

Both take the unfused path's values: the absorbs', rope's and norm's programs are theirs, and
the merge is the merge kernel's own (triton_attention_tiles._merge_splits), rounded to the
activation dtype as its store rounds, before the same dot.
"""

from __future__ import annotations

import os

import torch

from blockspec.layers.fused import _cast, _jit, _want_triton, tl, triton
from blockspec.layers.mla_absorb import _absorb_program, _head_weights, absorb, absorb_tiles
from blockspec.layers.mla_fused import (
    _rope_norm_program,
    mla_rope_norm,
    rope_norm_launch,
    rope_norm_warps,
)
from blockspec.layers.pdl import pdl_args, pdl_sync
from blockspec.layers.triton_attention_tiles import _merge_splits

# NOTE: W_UV output rows an absorb_merge program takes: each program merges its head's partials
# (S x 512 fp32) once, so fewer, wider programs read fewer of them (4 a head for v_head_dim 128).
MERGE_BLOCK_N = 32
MERGE_WARPS = 8


@_jit
def _absorb_rope_norm_kernel(
    x_ptr, w_ptr, y_ptr, N, K, stride_xh, stride_wh, stride_wn, stride_wk, stride_yh,
    q_ptr, kv_ptr, pos_ptr, cos_ptr, sin_ptr, nw_ptr, q_out_ptr, entry_ptr, slot_ptr,
    q_stride0, q_stride1, kv_stride, qo_stride0, qo_stride1, entry_stride, cos_stride,
    stride_cb, stride_cs, num_heads, eps, LATENT: tl.constexpr, ROPE: tl.constexpr,
    HALF_BLOCK: tl.constexpr, LATENT_BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    # Programs [0, H * NB): the absorb's (head, output block); then one per head's query rope
    # and one for the cache entry (mla_rope_norm's programs of token 0).
    pid = tl.program_id(0)
    blocks = tl.cdiv(N, BLOCK_N)
    if pid < num_heads * blocks:
        _absorb_program(x_ptr, w_ptr, y_ptr, pid // blocks, pid % blocks, 1, N, K, 0,
                        stride_xh, stride_wh, stride_wn, stride_wk, 0, stride_yh, BLOCK_N,
                        BLOCK_K, USE_PDL)
    else:
        pdl_sync(USE_PDL)
        _rope_norm_program(q_ptr, kv_ptr, pos_ptr, cos_ptr, sin_ptr, nw_ptr, q_out_ptr,
                           entry_ptr, slot_ptr, pid * 0, pid - num_heads * blocks, q_stride0,
                           q_stride1, kv_stride, qo_stride0, qo_stride1, entry_stride,
                           cos_stride, stride_cb, stride_cs, num_heads, eps, LATENT, ROPE,
                           HALF_BLOCK, LATENT_BLOCK, INTERLEAVED, BLOCK_SIZE)


@_jit
def _absorb_merge_kernel(part_ptr, lse_ptr, w_ptr, y_ptr, N, K, stride_ph, stride_ps,
                         stride_lh, stride_wh, stride_wn, stride_wk, stride_yh,
                         NUM_SPLITS: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    h = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    w = _head_weights(w_ptr, h, n, k, N, K, stride_wh, stride_wn, stride_wk)
    pdl_sync(USE_PDL)
    # NOTE: the merge kernel's own merge (_merge_splits) over one row, all splits read (one
    # without keys weighs 0, its partial never written nor loaded), rounded as its store does
    merged = _merge_splits(lse_ptr + h * stride_lh + tl.zeros([1], tl.int32),
                           (part_ptr + h * stride_ph + k)[None, :], stride_ps,
                           tl.full([1], 1, tl.int1), NUM_SPLITS, (k < K)[None, :], NUM_SPLITS)
    x = tl.reshape(merged, [BLOCK_K]).to(ACT).to(tl.float32)
    y = tl.sum(w * x[None, :], 1)
    tl.store(y_ptr + h * stride_yh + n, _cast(y, y_ptr.dtype.element_ty), mask=n < N)


def _one_token_triton(x: torch.Tensor, backend: str) -> bool:
    if backend != "triton" or triton is None or x.shape[0] != 1:
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def absorb_rope_norm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, backend: str,
                     **rope) -> bool:
    """absorb(x, w, out, backend), then mla_rope_norm(**rope) (its result returned): one
    launch for a one-token step whose cache entry goes straight into the cache (rope's `cache`
    and `slot_mapping` given, its kernel chosen), else the two calls."""
    t, h, k = x.shape
    n = w.shape[1]
    use_triton = rope.pop("use_triton", None)
    direct = rope.get("cache") is not None and rope.get("slot_mapping") is not None
    if not (direct and _one_token_triton(x, backend) and _want_triton(rope["kv"], use_triton)):
        absorb(x, w, out, backend)
        return mla_rope_norm(**rope, use_triton=use_triton)
    assert w.shape == (h, n, k) and out.shape == (t, h, n)
    assert x.stride(2) == 1 and out.stride(2) == 1
    args, consts = rope_norm_launch(**rope)
    block_n, block_k = absorb_tiles(n, k)
    _absorb_rope_norm_kernel[(h * triton.cdiv(n, block_n) + h + 1,)](
        x, w, out, n, k, x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(1),
        *args, **consts, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=max(4, rope_norm_warps(consts["LATENT"])), enable_fp_fusion=False,
        **pdl_args(x.device))
    return True


def absorb_merge(part: torch.Tensor, lse: torch.Tensor, w: torch.Tensor,
                 out: torch.Tensor) -> None:
    """out[0, h, :] = w[h] @ merge(part[0, h], lse[0, h]) for one token's split-KV partials
    part [1, H, S, K] (fp32) and lse [1, H, S] (TritonMLABackend.attend_partials), w [H, N, K]
    and out [1, H, N]: the merge kernel's output, rounded to out's dtype, then absorb's
    product, in one launch."""
    _, h, splits, k = part.shape
    n = w.shape[1]
    assert part.shape[0] == 1 and lse.shape == (1, h, splits) and w.shape == (h, n, k)
    assert out.shape == (1, h, n) and part.stride(3) == 1 and out.stride(2) == 1
    block_n = min(MERGE_BLOCK_N, triton.next_power_of_2(n))
    act = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(out.dtype, tl.float32)
    _absorb_merge_kernel[(h, triton.cdiv(n, block_n))](
        part, lse, w, out, n, k, part.stride(1), part.stride(2), lse.stride(1), w.stride(0),
        w.stride(1), w.stride(2), out.stride(1), NUM_SPLITS=splits, ACT=act, BLOCK_N=block_n,
        BLOCK_K=triton.next_power_of_2(k), num_warps=MERGE_WARPS, enable_fp_fusion=False,
        **pdl_args(out.device))
