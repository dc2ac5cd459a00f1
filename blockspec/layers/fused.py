"""Fused Triton kernels for the decoder's elementwise work, each with a plain-torch twin.

A batch-1 decode step is bound by kernel count, so each layer's elementwise ops collapse into:
`fused_add_rms_norm` (residual add + RMSNorm), `silu_and_mul` and qk_norm_rope.py's
`qk_norm_rope_store` (per-head q/k RMSNorm + RoPE + paged K/V store). Every op rounds to the
activation dtype at the same points as the HF eager composition (norm.py, rotary.py,
`act(gate) * up`), so bf16/fp16 results agree with it up to fp32 reduction order, and fp32
results to ~1e-6.

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

_MAX_ROW_BLOCK = 8192
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
    """(BLOCK, num_warps) for one program per row of `n` elements, looping past 8192: 8 values
    a thread up to 8 warps, 16 warps for rows past 4096 (Kimi K2's 7168 in one pass)."""
    block = min(triton.next_power_of_2(n), _MAX_ROW_BLOCK)
    return block, min(max(block // 256, 1), 8 if block <= 4096 else 16)


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
def _residual_sum(x_row, res_row, new_res_row, cols, mask, dtype: tl.constexpr,
                  HAS_RES: tl.constexpr, STORE: tl.constexpr):
    """x (+ res, rounded to dtype) at cols in fp32; with STORE also written to new_res."""
    h = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h = _rnd(h + tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32), dtype)
        if STORE:
            tl.store(new_res_row + cols, _cast(h, dtype), mask=mask)
    return h


@_jit
def _norm_store(y_row, w_ptr, h, rstd, cols, mask, dtype: tl.constexpr):
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # NOTE: HF order: normalise in fp32, cast to the input dtype, then scale by the weight.
    tl.store(y_row + cols, _cast(w * _rnd(h * rstd, dtype), y_row.dtype.element_ty), mask=mask)


@_jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, new_res_ptr, n_cols, x_stride, res_stride,
                         eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                         ONE_PASS: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    pdl_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    x_row, res_row = x_ptr + row * x_stride, res_ptr + row * res_stride
    new_res_row, y_row = new_res_ptr + row * n_cols, y_ptr + row * n_cols
    if ONE_PASS:  # the row fits one block: summed once, kept in registers
        mask = offs < n_cols
        h = _residual_sum(x_row, res_row, new_res_row, offs, mask, dtype, HAS_RES, True)
        rstd = tl.math.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
        _norm_store(y_row, w_ptr, h, rstd, offs, mask, dtype)
    else:
        # Pass 1: sum of squares of the (rounded) residual sum; also writes the new residual.
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            h = _residual_sum(x_row, res_row, new_res_row, start + offs,
                              start + offs < n_cols, dtype, HAS_RES, True)
            acc += h * h
        rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
        # Pass 2 recomputes the sum from the inputs instead of re-reading new_res: no
        # cross-thread read-after-write within the program, no register-resident long row.
        for start in range(0, n_cols, BLOCK):
            mask = start + offs < n_cols
            h = _residual_sum(x_row, res_row, new_res_row, start + offs, mask, dtype, HAS_RES,
                              False)
            _norm_store(y_row, w_ptr, h, rstd, start + offs, mask, dtype)


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
            HAS_RES=residual is not None, BLOCK=block, ONE_PASS=n <= block, num_warps=warps,
            enable_fp_fusion=False, **pdl_args(x.device))
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
