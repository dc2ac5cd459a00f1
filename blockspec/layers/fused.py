"""Fused Triton kernels for the decoder's elementwise work, each with a plain-torch twin.

A batch-1 decode step is bound by kernel count, so each layer's elementwise ops collapse into:
`fused_add_rms_norm` (residual add + RMSNorm), `silu_and_mul` and `qk_norm_rope_store` (per-head
q/k RMSNorm + RoPE + paged K/V store). Every op rounds to the activation dtype at the same points
as the HF eager composition (norm.py, rotary.py, `act(gate) * up`), so bf16/fp16 results agree
with it up to fp32 reduction order, and fp32 results to ~1e-6.

`use_triton=None` means "Triton iff the tensor is on CUDA"; True forces Triton (tests run it on CPU
under TRITON_INTERPRET=1, which must be set before triton is first imported). The CUDA paths never
sync with the host and their grids depend only on shapes, so they are safe inside CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockspec.layers.pdl import pdl_args, pdl_sync

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs keep the torch paths.
    triton = tl = None

# NOTE: annotations are strings (future import), which Triton accepts for `tl.constexpr`; that
# keeps this module importable without Triton.
_jit = triton.jit if triton is not None else (lambda fn: fn)

_MAX_ROW_BLOCK = 4096
# NOTE: every launch passes enable_fp_fusion=False. LLVM narrows `round16(a * b)` to a native
# f16 multiply, and contraction would then fuse `a * b - c * d` into one f16 FMA, skipping the
# rounding of the product that eager torch (and our bit-exactness) depends on.


def _want_triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    if use_triton is None:
        return x.is_cuda and triton is not None
    if use_triton and triton is None:
        raise RuntimeError("use_triton=True but triton is not installed")
    return use_triton


def _row_launch(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for one program per row of `n` elements, looping past 4096."""
    block = min(triton.next_power_of_2(n), _MAX_ROW_BLOCK)
    return block, min(max(block // 256, 1), 8)


@_jit
def _rnd(x, dtype: tl.constexpr):
    # Round an fp32 value to `dtype` and back: reproduces eager torch's per-op rounding.
    if dtype == tl.bfloat16:
        # NOTE: explicit round-to-nearest-even, what the GPU's cvt does; Triton's interpreter
        # truncates instead, which would make CPU tests disagree with torch by an ulp.
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(dtype).to(tl.float32)


@_jit
def _cast(x, dtype: tl.constexpr):
    # Every store goes through _rnd, so the final narrowing cast is exact on any backend.
    return _rnd(x, dtype).to(dtype)


@_jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, new_res_ptr, n_cols, x_stride, res_stride,
                         eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    pdl_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    x_row, res_row = x_ptr + row * x_stride, res_ptr + row * res_stride
    # Pass 1: sum of squares of the (rounded) residual sum; also writes the new residual.
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        mask = start + offs < n_cols
        h = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            h = _rnd(h + tl.load(res_row + start + offs, mask=mask, other=0.0).to(tl.float32),
                     dtype)
            tl.store(new_res_ptr + row * n_cols + start + offs, _cast(h, dtype), mask=mask)
        acc += h * h
    rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
    # Pass 2 recomputes the sum from the inputs instead of re-reading new_res: no cross-thread
    # read-after-write within the program, and long rows need no register-resident copy.
    for start in range(0, n_cols, BLOCK):
        mask = start + offs < n_cols
        h = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            h = _rnd(h + tl.load(res_row + start + offs, mask=mask, other=0.0).to(tl.float32),
                     dtype)
        w = tl.load(w_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
        # NOTE: HF order: normalise in fp32, cast to the input dtype, then scale by the weight.
        y = w * _rnd(h * rstd, dtype)
        tl.store(y_ptr + row * n_cols + start + offs, _cast(y, y_ptr.dtype.element_ty), mask=mask)


@_jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, n_cols, gu_stride, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    pdl_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    dtype = gu_ptr.dtype.element_ty
    gate = tl.load(gu_ptr + row * gu_stride + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * gu_stride + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    # fp32 math, rounded after silu and after the product, exactly like `F.silu(gate) * up`.
    act = _rnd(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row * n_cols + offs, _cast(act * up, dtype), mask=mask)


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


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _launch_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    res2 = residual.reshape(-1, n) if residual is not None else x2
    assert x2.stride(-1) == 1 and res2.stride(-1) == 1 and weight.is_contiguous()
    y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    new_res = torch.empty_like(x, memory_format=torch.contiguous_format) \
        if residual is not None else y
    if x2.shape[0] > 0:
        block, warps = _row_launch(n)
        _add_rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, y, new_res, n, x2.stride(0), res2.stride(0), eps,
            HAS_RES=residual is not None, BLOCK=block, num_warps=warps, enable_fp_fusion=False,
            **pdl_args(x.device))
    return y, (new_res if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             use_triton: bool | None = None) -> torch.Tensor:
    """RMSNorm over the last dim, HF-exact: fp32 normalise, cast to x.dtype, scale by weight."""
    if not _want_triton(x, use_triton):
        return _torch_rms_norm(x, weight, eps)
    return _launch_add_rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(residual + x), residual + x); the sum is rounded to the activation dtype
    first, as `h = h + x` is. Outputs are new tensors: inputs are never written (the caller may
    still hold `residual`, e.g. as a tapped hidden state)."""
    assert x.shape == residual.shape and x.dtype == residual.dtype
    if not _want_triton(x, use_triton):
        new_res = residual + x
        return _torch_rms_norm(new_res, weight, eps), new_res
    return _launch_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """[..., 2I] (gate then up) -> [..., I] = silu(gate) * up, rounded like the eager ops."""
    if not _want_triton(gate_up, use_triton):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    n = gate_up.shape[-1] // 2
    gu = gate_up.reshape(-1, 2 * n)
    assert gu.stride(-1) == 1
    out = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype, device=gate_up.device)
    if gu.shape[0] > 0:
        block = min(triton.next_power_of_2(n), 1024)
        _silu_and_mul_kernel[(gu.shape[0], triton.cdiv(n, block))](
            gu, out, n, gu.stride(0), BLOCK=block, num_warps=4, enable_fp_fusion=False,
            **pdl_args(gu.device))
    return out


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
