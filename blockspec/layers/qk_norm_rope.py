"""Per-head q/k RMSNorm + RoPE + paged K/V store in one Triton kernel (Qwen3 targets and the
DFlash drafter), with its plain-torch twin; rounding as fused.py's kernels round."""

from __future__ import annotations

import torch

from blockspec.layers.fused import _cast, _jit, _rnd, _torch_rms_norm, _want_triton, tl, triton
from blockspec.layers.pdl import pdl_args, pdl_sync


@_jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    slot_ptr, qkv_stride, cos_stride, num_q_heads, num_kv_heads, eps,
    HEAD_DIM: tl.constexpr, HALF_BLOCK: tl.constexpr, HAS_NORM: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_sync(USE_PDL)
    # One program per (token, head); heads [0, Hq) are queries, [Hq, Hq + Hkv) are keys, and a
    # key program also moves the matching value head, so v costs no extra launch.
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dtype = qkv_ptr.dtype.element_ty
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HALF_BLOCK)
    mask = offs < half
    # NOTE: q heads then k heads are contiguous in qkv, so head h starts at column h * HEAD_DIM.
    src = qkv_ptr + tok * qkv_stride + head * HEAD_DIM
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + offs, mask=mask, other=0.0).to(tl.float32)
    is_q = head < num_q_heads
    if HAS_NORM:
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
        if is_q:
            w1 = tl.load(qw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(qw_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            w1 = tl.load(kw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(kw_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = _rnd(w1 * _rnd(x1 * rstd, dtype), dtype)
        x2 = _rnd(w2 * _rnd(x2 * rstd, dtype), dtype)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cos = _rnd(tl.load(cos_ptr + pos * cos_stride + offs, mask=mask, other=0.0), dtype)
    sin = _rnd(tl.load(sin_ptr + pos * cos_stride + offs, mask=mask, other=0.0), dtype)
    # Rotate-half: [x1, x2] * cos + [-x2, x1] * sin, rounded per op as eager torch does.
    o1 = _rnd(_rnd(x1 * cos, dtype) - _rnd(x2 * sin, dtype), dtype)
    o2 = _rnd(_rnd(x2 * cos, dtype) + _rnd(x1 * sin, dtype), dtype)
    # NOTE: dtypes are bound out here and one per statement: the compiler (not the interpreter)
    # rejects dtypes in tuples and as values flowing out of `if` blocks.
    k_ty = k_cache_ptr.dtype.element_ty
    v_ty = v_cache_ptr.dtype.element_ty
    if is_q:
        q_dst = q_out_ptr + (tok * num_q_heads + head) * HEAD_DIM
        tl.store(q_dst + offs, _cast(o1, dtype), mask=mask)
        tl.store(q_dst + half + offs, _cast(o2, dtype), mask=mask)
    else:
        kv_head = head - num_q_heads
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        # NOTE: slot -1 marks a token whose K/V must not be stored (padding, already cached).
        if slot >= 0:
            dst = (slot * num_kv_heads + kv_head) * HEAD_DIM
            tl.store(k_cache_ptr + dst + offs, _cast(o1, k_ty), mask=mask)
            tl.store(k_cache_ptr + dst + half + offs, _cast(o2, k_ty), mask=mask)
            v_src = src + num_kv_heads * HEAD_DIM  # the same kv head's V, one K block on
            v1 = tl.load(v_src + offs, mask=mask, other=0.0).to(tl.float32)
            v2 = tl.load(v_src + half + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(v_cache_ptr + dst + offs, _cast(v1, v_ty), mask=mask)
            tl.store(v_cache_ptr + dst + half + offs, _cast(v2, v_ty), mask=mask)


def _torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * torch.cat((cos, cos), -1) + torch.cat((-x2, x1), -1) * torch.cat((sin, sin), -1)


def _torch_qk_norm_rope_store(qkv, positions, cos_cache, sin_cache, num_heads, num_kv_heads,
                              head_dim, q_w, k_w, eps, k_cache, v_cache, slot_mapping):
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    num_tokens = qkv.shape[0]
    q = q.reshape(num_tokens, num_heads, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    if q_w is not None:
        q = _torch_rms_norm(q, q_w, eps).to(qkv.dtype)
    if k_w is not None:
        k = _torch_rms_norm(k, k_w, eps).to(qkv.dtype)
    cos = cos_cache[positions].to(qkv.dtype).unsqueeze(1)
    sin = sin_cache[positions].to(qkv.dtype).unsqueeze(1)
    q, k = _torch_rope(q, cos, sin), _torch_rope(k, cos, sin)
    # NOTE: boolean indexing syncs with the host; this path is not for CUDA graphs.
    valid = slot_mapping >= 0
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, slot_mapping[valid], k[valid].to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping[valid], v[valid].to(v_cache.dtype))
    return q.contiguous()


def qk_norm_rope_store(
    qkv: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int, q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, use_triton: bool | None = None,
) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) * D] -> roped q [T, Hq, D]; stores roped k and raw v into the paged
    caches [num_blocks, block_size, Hkv, D] at `slot_mapping` (-1: skip). Per-head RMSNorm on q
    and k first when weights are given (Qwen3). One launch."""
    assert (q_norm_weight is None) == (k_norm_weight is None) or num_heads == 0
    assert qkv.shape[-1] == (num_heads + 2 * num_kv_heads) * head_dim and head_dim % 2 == 0
    if not _want_triton(qkv, use_triton):
        return _torch_qk_norm_rope_store(qkv, positions, cos_cache, sin_cache, num_heads,
                                         num_kv_heads, head_dim, q_norm_weight, k_norm_weight,
                                         eps, k_cache, v_cache, slot_mapping)
    # NOTE: contiguity is checked on shapes/strides only (no host sync).
    assert qkv.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert cos_cache.is_contiguous() and sin_cache.is_contiguous()
    assert k_cache.shape[-2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    num_tokens = qkv.shape[0]
    q_out = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    has_norm = k_norm_weight is not None
    k_w = k_norm_weight if has_norm else qkv
    q_w = q_norm_weight if q_norm_weight is not None else k_w
    if num_tokens > 0:
        half_block = triton.next_power_of_2(head_dim // 2)
        _qk_norm_rope_store_kernel[(num_tokens, num_heads + num_kv_heads)](
            qkv, positions, cos_cache, sin_cache, q_w, k_w, q_out, k_cache, v_cache, slot_mapping,
            qkv.stride(0), cos_cache.stride(0), num_heads, num_kv_heads, eps,
            HEAD_DIM=head_dim, HALF_BLOCK=half_block, HAS_NORM=has_norm,
            num_warps=1 if half_block <= 64 else 2, enable_fp_fusion=False,
            **pdl_args(qkv.device))
    return q_out


def k_norm_rope_store(
    kv: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
    num_kv_heads: int, head_dim: int, k_norm_weight: torch.Tensor | None, eps: float,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    use_triton: bool | None = None,
) -> None:
    """The DFlash drafter's context K/V: kv [T, 2 Hkv D] (k then v); k is normed (if a weight is
    given) and roped, then k and v are stored at `slot_mapping`. Same kernel with no query heads."""
    qk_norm_rope_store(kv, positions, cos_cache, sin_cache, 0, num_kv_heads, head_dim, None,
                       k_norm_weight, eps, k_cache, v_cache, slot_mapping, use_triton)
