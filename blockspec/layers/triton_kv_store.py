"""Writing new tokens' K/V into a paged cache (`[num_blocks, block_size, Hkv, D]`) at flat
slots, one program per token. A K cache that is the V cache (MLA's latent) is written once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockspec.layers.pdl import pdl_args, pdl_sync


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
                     SHARED_KV: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    pdl_sync(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # NOTE: slot -1 marks a token whose K/V must not be written (e.g. padding).
    if slot < 0:
        return
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    t64 = t.to(tl.int64)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
    k = tl.load(k_ptr + t64 * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    if not SHARED_KV:
        v = tl.load(v_ptr + t64 * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k/v [T, Hkv, D] into the caches at `slot_mapping` (slot -1: not written). Caches that
    share storage (K = V, MLA's latent) are written once, from k, which must then be v."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert k.stride(2) == 1 and v.stride(2) == 1
    shared = k_cache.data_ptr() == v_cache.data_ptr()
    assert not shared or (k.data_ptr() == v.data_ptr() and k.stride() == v.stride()), \
        "a cache bound as both K and V takes the same tensor as k and v"
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        H_PAD=triton.next_power_of_2(num_kv_heads), D_PAD=triton.next_power_of_2(head_dim),
        SHARED_KV=shared, **pdl_args(k.device))
