"""MLA's elementwise work between the projections and attention, in one launch.

`mla_rope_norm` ropes each head's query rope part into the attention query's rope columns,
RMS-normalises the KV latent and ropes the shared rope key into the cache entry: on CUDA one
Triton launch where the eager composition (contiguous copy, norm, de-interleave, rotary, two
concatenations) takes some twenty. Given the paged latent cache and the slot mapping, the
kernel writes the entry straight into its cache slot, so the attention's KV store (one launch
a layer) is skipped. Rounding follows the eager ops exactly, as in fused.py;
the norm's fp32 sum may differ from torch's in reduction order only.
"""

from __future__ import annotations

import torch

from blockspec.layers.fused import _cast, _jit, _rnd, _want_triton
from blockspec.layers.pdl import pdl_args, pdl_sync

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs keep the torch path.
    triton = tl = None


@_jit
def _rope_row(src, dst, cos, sin, offs, mask, half: tl.constexpr, dtype: tl.constexpr,
              INTERLEAVED: tl.constexpr):
    # One head's rope dims from `src` to `dst` in rotate-half layout; an interleaved source
    # pairs (0, 1), (2, 3), ..., so its evens are the first half and its odds the second.
    if INTERLEAVED:
        x1 = tl.load(src + 2 * offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + 2 * offs + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + offs, mask=mask, other=0.0).to(tl.float32)
    # Rotate-half: [x1, x2] * cos + [-x2, x1] * sin, rounded per op as eager torch does.
    o1 = _rnd(_rnd(x1 * cos, dtype) - _rnd(x2 * sin, dtype), dtype)
    o2 = _rnd(_rnd(x2 * cos, dtype) + _rnd(x1 * sin, dtype), dtype)
    tl.store(dst + offs, _cast(o1, dtype), mask=mask)
    tl.store(dst + half + offs, _cast(o2, dtype), mask=mask)


@_jit
def _rope_norm_program(
    q_ptr, kv_ptr, pos_ptr, cos_ptr, sin_ptr, w_ptr, q_out_ptr, entry_ptr, slot_ptr, tok, head,
    q_stride0, q_stride1, kv_stride, qo_stride0, qo_stride1, entry_stride, cos_stride,
    stride_cb, stride_cs, num_heads, eps, LATENT: tl.constexpr, ROPE: tl.constexpr,
    HALF_BLOCK: tl.constexpr, LATENT_BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Token tok's query rope of `head`, or (head == num_heads) its cache entry."""
    tok = tok.to(tl.int64)
    dtype = kv_ptr.dtype.element_ty
    half: tl.constexpr = ROPE // 2
    offs = tl.arange(0, HALF_BLOCK)
    mask = offs < half
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cos = _rnd(tl.load(cos_ptr + pos * cos_stride + offs, mask=mask, other=0.0), dtype)
    sin = _rnd(tl.load(sin_ptr + pos * cos_stride + offs, mask=mask, other=0.0), dtype)
    if head < num_heads:
        _rope_row(q_ptr + tok * q_stride0 + head * q_stride1,
                  q_out_ptr + tok * qo_stride0 + head * qo_stride1, cos, sin, offs, mask, half,
                  dtype, INTERLEAVED)
    else:
        src = kv_ptr + tok * kv_stride
        dst = entry_ptr + tok * entry_stride
        lmask = tl.arange(0, LATENT_BLOCK) < LATENT
        if BLOCK_SIZE:  # entry_ptr is the paged cache: the token's slot, as store_kv finds it
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            # NOTE: slot -1 (padding) is written nowhere, as in store_kv (the slot broadcast
            # first: the interpreter takes only tensor masks)
            mask = mask & (offs * 0 + slot >= 0)
            lmask = lmask & (tl.arange(0, LATENT_BLOCK) * 0 + slot >= 0)
            slot = tl.maximum(slot, 0)
            dst = entry_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        _rope_row(src + LATENT, dst + LATENT, cos, sin, offs, mask, half, dtype, INTERLEAVED)
        loffs = tl.arange(0, LATENT_BLOCK)
        x = tl.load(src + loffs, mask=lmask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / LATENT + eps)
        w = tl.load(w_ptr + loffs, mask=lmask, other=0.0).to(tl.float32)
        # NOTE: HF order: normalise in fp32, cast to the input dtype, then scale by the weight.
        tl.store(dst + loffs, _cast(w * _rnd(x * rstd, dtype), dtype), mask=lmask)


@_jit
def _mla_rope_norm_kernel(
    q_ptr, kv_ptr, pos_ptr, cos_ptr, sin_ptr, w_ptr, q_out_ptr, entry_ptr, slot_ptr,
    q_stride0, q_stride1, kv_stride, qo_stride0, qo_stride1, entry_stride, cos_stride,
    stride_cb, stride_cs, num_heads, eps, LATENT: tl.constexpr, ROPE: tl.constexpr,
    HALF_BLOCK: tl.constexpr, LATENT_BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr = 0, USE_PDL: tl.constexpr = False,
):
    pdl_sync(USE_PDL)
    # One program per (token, head); program `num_heads` of a token is its cache entry's.
    _rope_norm_program(q_ptr, kv_ptr, pos_ptr, cos_ptr, sin_ptr, w_ptr, q_out_ptr, entry_ptr,
                       slot_ptr, tl.program_id(0), tl.program_id(1), q_stride0, q_stride1,
                       kv_stride, qo_stride0, qo_stride1, entry_stride, cos_stride, stride_cb,
                       stride_cs, num_heads, eps, LATENT, ROPE, HALF_BLOCK, LATENT_BLOCK,
                       INTERLEAVED, BLOCK_SIZE)


def _torch_mla_rope_norm(q_pe, kv, positions, cos_cache, sin_cache, norm_weight, eps, q_out,
                         entry, interleaved):
    latent = norm_weight.shape[0]
    k_pe = kv[:, None, latent:]
    if interleaved:
        q_pe = torch.cat([q_pe[..., 0::2], q_pe[..., 1::2]], dim=-1)
        k_pe = torch.cat([k_pe[..., 0::2], k_pe[..., 1::2]], dim=-1)
    cos = cos_cache[positions].to(kv.dtype)
    sin = sin_cache[positions].to(kv.dtype)
    cos, sin = torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((sin, sin), -1).unsqueeze(1)
    for x, out in ((q_pe, q_out), (k_pe, entry[..., latent:])):
        x1, x2 = x.chunk(2, dim=-1)
        torch.add(x * cos, torch.cat((-x2, x1), dim=-1) * sin, out=out)  # rotary.py's _apply
    xf = kv[:, :latent].float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(kv.dtype)
    torch.mul(norm_weight, normed, out=entry[:, 0, :latent])  # fused.py's _torch_rms_norm


def mla_rope_norm(q_pe: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                  cos_cache: torch.Tensor, sin_cache: torch.Tensor, norm_weight: torch.Tensor,
                  eps: float, q_out: torch.Tensor, entry: torch.Tensor, interleaved: bool,
                  use_triton: bool | None = None, cache: torch.Tensor | None = None,
                  slot_mapping: torch.Tensor | None = None) -> bool:
    """q_pe [T, H, R] (each head's query rope part) -> roped into q_out [T, H, R]; kv [T, L + R]
    (kv_a_proj's output: latent, then the rope key) -> entry [T, 1, L + R] = [rms_norm(latent),
    roped key]. `interleaved`: the rope dims pair (0, 1), (2, 3), ... (else rotate-half halves).
    Outputs may be strided views (columns of a wider tensor); the last dim must be dense.

    With the paged latent `cache` [N, block_size, 1, L + R] and `slot_mapping` [T] the Triton
    kernel writes each entry into its cache slot instead (slot -1: nowhere), as store_kv would,
    and returns True; otherwise (the torch path) `entry` holds it and the result is False."""
    t, h, r = q_pe.shape
    latent = norm_weight.shape[0]
    assert kv.shape == (t, latent + r) and q_out.shape == q_pe.shape
    assert entry.shape == (t, 1, latent + r) and entry.dtype == q_out.dtype == kv.dtype
    if not _want_triton(kv, use_triton):
        _torch_mla_rope_norm(q_pe, kv, positions, cos_cache, sin_cache, norm_weight, eps, q_out,
                             entry, interleaved)
        return False
    launch = rope_norm_launch(q_pe, kv, positions, cos_cache, sin_cache, norm_weight, eps,
                              q_out, entry, interleaved, cache, slot_mapping)
    if t > 0:
        args, consts = launch
        _mla_rope_norm_kernel[(t, h + 1)](*args, **consts, num_warps=rope_norm_warps(latent),
                                          enable_fp_fusion=False, **pdl_args(kv.device))
    return cache is not None and slot_mapping is not None


def rope_norm_warps(latent: int) -> int:
    return 1 if triton.next_power_of_2(latent) <= 256 else 4


def rope_norm_launch(q_pe: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, q_out: torch.Tensor, entry: torch.Tensor, interleaved: bool,
                     cache: torch.Tensor | None, slot_mapping: torch.Tensor | None
                     ) -> tuple[tuple, dict]:
    """(arguments, constexprs) of _rope_norm_program for mla_rope_norm's inputs (checked)."""
    t, h, r = q_pe.shape
    latent = norm_weight.shape[0]
    # NOTE: layouts are checked on shapes/strides only (no host sync: graph capture is safe).
    assert q_pe.stride(-1) == kv.stride(-1) == q_out.stride(-1) == entry.stride(-1) == 1
    assert cos_cache.is_contiguous() and sin_cache.is_contiguous() and norm_weight.is_contiguous()
    direct = cache is not None and slot_mapping is not None
    if direct:
        assert cache.shape[2:] == (1, latent + r) and cache.stride(3) == 1
        assert cache.dtype == kv.dtype and slot_mapping.shape == (t,)
    dst = cache if direct else entry
    args = (q_pe, kv, positions, cos_cache, sin_cache, norm_weight, q_out, dst,
            slot_mapping if direct else positions, q_pe.stride(0), q_pe.stride(1), kv.stride(0),
            q_out.stride(0), q_out.stride(1), entry.stride(0), cos_cache.stride(0),
            dst.stride(0), dst.stride(1), h, eps)
    consts = dict(LATENT=latent, ROPE=r, HALF_BLOCK=triton.next_power_of_2(r // 2),
                  LATENT_BLOCK=triton.next_power_of_2(latent), INTERLEAVED=interleaved,
                  BLOCK_SIZE=cache.shape[1] if direct else 0)
    return args, consts
