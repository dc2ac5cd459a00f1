"""EXPERIMENT (issue 23): the int4 decode experts on int8 tensor cores.

The register loop (moe_decode.py, "subnormal") spends an AND and an FMA on every weight value.
Here a weight tile's nibbles become int8 (two masks a 32-bit register: eight values), the
products run as int8 MMAs with int32 accumulation, and the activations enter as int8 *digits*:

    x_k = sum_d digit_d(x_k) * 2^(u_g - 7 d),   d < DIGITS, |digit| <= 127

with u_g from the largest |x| of x_k's scale group g (32 values), digits by truncation. A value
within 2^-(7 DIGITS - 8) of its group's largest is exact (bf16's 8 significant bits); smaller
ones are cut at 2^(u_g - 7 DIGITS + 7). The B operand of a K chunk of 128 values (4 groups) is
block-diagonal [128, 16]: column 4 g + d holds digit d of group g's values, so one MMA gives
every (row, group, digit) sum, exact in int32, and each column's scale (the row's group scale
times 2^(u_g - 7 d)) applies once per 128 values in fp32. Nibbles enter unsigned (0..15); the
bias 8 * sum(digits) comes off each column's int32 sum.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from blockspec.layers.fused import _rnd

CHUNK = 128  # K values per MMA: 4 scale groups of 32
DIGITS = 4
COLS = 16  # 4 groups x 4 digits
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _nibbles(b, ASM: tl.constexpr):
    """Bytes b (uint8, two nibbles each) -> (low nibbles, high nibbles) as int8 0..15."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            asm="{ .reg .b32 t; and.b32 $0, $2, 0x0F0F0F0F; shr.u32 t, $2, 4; "
                "and.b32 $1, t, 0x0F0F0F0F; }",
            constraints="=r,=r,r", args=[b], dtype=(tl.int8, tl.int8), is_pure=True, pack=4)
    else:
        lo = (b & 0xF).to(tl.int8)
        hi = (b >> 4).to(tl.int8)
    return lo, hi


@triton.jit
def _tile_dot(w_rows, kb, xe, xo, ASM: tl.constexpr, SWAP: tl.constexpr = False,
              TRANS: tl.constexpr = True):
    """int32 [BLOCK_N, 16]: the nibbles of bytes kb of each row (unsigned) against the digits
    of the even (xe [64, 16]) and odd (xo) input columns."""
    if TRANS:
        bt = tl.load(w_rows[None, :] + kb[:, None])
        lo, hi = _nibbles(bt, ASM)
        lo, hi = tl.trans(lo), tl.trans(hi)
    else:
        b = tl.load(w_rows[:, None] + kb[None, :])
        lo, hi = _nibbles(b, ASM)
    if SWAP:
        out = tl.trans(tl.dot(tl.trans(xe), tl.trans(lo), out_dtype=tl.int32)
                       + tl.dot(tl.trans(xo), tl.trans(hi), out_dtype=tl.int32))
    else:
        out = tl.dot(lo, xe, out_dtype=tl.int32) + tl.dot(hi, xo, out_dtype=tl.int32)
    return out


@triton.jit
def _rows_mma(w_rows, s_rows, b_tok, f_tok, c_tok, K, ASM: tl.constexpr, BLOCK_N: tl.constexpr):
    """sum_k (q - 8) s x_k for int4 rows (bytes at w_rows, group scales at s_rows) against one
    token's digits (b_tok [K / 128, 128, 16] int8, f_tok column factors, c_tok 8 * column
    sums): fp32 [BLOCK_N]."""
    kb = tl.arange(0, 64)
    cols = tl.arange(0, 16)
    xoff = tl.arange(0, 64)[:, None] * 32 + cols[None, :]
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for c in range(0, K // 128):
        xe = tl.load(b_tok + c * 2048 + xoff)
        xo = tl.load(b_tok + c * 2048 + 16 + xoff)
        d = _tile_dot(w_rows, c * 64 + kb, xe, xo, ASM)
        f = tl.load(f_tok + c * 16 + cols)
        bias = tl.load(c_tok + c * 16 + cols)
        s = tl.load(s_rows[:, None] + c * 4 + tl.arange(0, 4)[None, :]).to(tl.float32)
        s16 = tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_N, 4, 4]), [BLOCK_N, 16])
        acc += (d - bias[None, :]).to(tl.float32) * (s16 * f[None, :])
    return tl.sum(acc, 1)


@triton.jit
def _digits_kernel(x_ptr, b_ptr, f_ptr, c_ptr, stride_x, K):
    """One (row, chunk): x's 128 values -> B [128, 16] int8 block-diagonal, f [16], c [16]."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    nchunks = K // 128
    x = tl.load(x_ptr + row * stride_x + c * 128 + tl.arange(0, 128)).to(tl.float32)
    x = tl.reshape(x, [4, 32])
    m = tl.max(tl.abs(x), 1)
    e = ((m.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    u = tl.where(m > 0, tl.minimum(tl.maximum(e - 6, -120), 120), 0)  # |x| < 2^(u + 7)
    r = x * ((127 - u) << 23).to(tl.float32, bitcast=True)[:, None]
    base = (row * nchunks + c) * 2048
    k = tl.arange(0, 128)
    g = tl.arange(0, 4)
    for dd in tl.static_range(4):  # DIGITS
        dig = r.to(tl.int32)  # toward zero: |digit| <= 127, the rest in (-1, 1)
        r = (r - dig.to(tl.float32)) * 128.0
        # column 4 g' + dd: this digit where g' is the value's group, else 0
        val = tl.reshape(dig, [128])
        for gg in tl.static_range(4):
            col = tl.where((k // 32) == gg, val, 0).to(tl.int8)
            tl.store(b_ptr + base + k * 16 + 4 * gg + dd, col)
        f = ((u - 7 * dd + 127) << 23).to(tl.float32, bitcast=True)
        tl.store(f_ptr + (row * nchunks + c) * 16 + 4 * g + dd, f)
        tl.store(c_ptr + (row * nchunks + c) * 16 + 4 * g + dd, 8 * tl.sum(dig, 1))


def digits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K] (K % 128 == 0) -> (B [T, K/128, 128, 16] int8, f [T, K/128, 16] fp32,
    c [T, K/128, 16] int32): the MMA operand, each column's factor, 8 * each column's sum."""
    t, k = x.shape
    assert k % CHUNK == 0 and x.stride(1) == 1
    b = torch.empty(t, k // CHUNK, CHUNK, COLS, dtype=torch.int8, device=x.device)
    f = torch.empty(t, k // CHUNK, COLS, dtype=torch.float32, device=x.device)
    c = torch.empty(t, k // CHUNK, COLS, dtype=torch.int32, device=x.device)
    if t:
        _digits_kernel[(t, k // CHUNK)](x, b, f, c, x.stride(0), k)
    return b, f, c


@triton.jit
def _gate_up_kernel(b_ptr, f_ptr, c_ptr, ids_ptr, w_ptr, s_ptr, act_ptr, inter, K, stride_we,
                    stride_wn, stride_se, stride_sn, TOP_K: tl.constexpr, ASM: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    slot = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    tok = (slot // TOP_K).to(tl.int64)
    nch = K // 128
    b_tok, f_tok, c_tok = b_ptr + tok * nch * 2048, f_ptr + tok * nch * 16, c_ptr + tok * nch * 16
    w_e, s_e = w_ptr + expert * stride_we, s_ptr + expert * stride_se
    gate = _rows_mma(w_e + rows.to(tl.int64) * stride_wn, s_e + rows.to(tl.int64) * stride_sn,
                     b_tok, f_tok, c_tok, K, ASM, BLOCK_N)
    up = _rows_mma(w_e + (rows + inter).to(tl.int64) * stride_wn,
                   s_e + (rows + inter).to(tl.int64) * stride_sn, b_tok, f_tok, c_tok, K, ASM,
                   BLOCK_N)
    act_dtype = act_ptr.dtype.element_ty
    gate, up = _rnd(gate, act_dtype), _rnd(up, act_dtype)
    act = _rnd(gate / (1.0 + tl.exp(-gate)), act_dtype)
    act = _rnd(act * up, act_dtype)
    tl.store(act_ptr + slot.to(tl.int64) * inter + rows, act.to(act_dtype))


@triton.jit
def _down_part_kernel(b_ptr, f_ptr, c_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, part_ptr, n, K,
                      stride_we, stride_wn, stride_se, stride_sn, ASM: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """part[slot, rows] = weight[slot] W_down[e_slot][rows] act[slot], rounded once."""
    slot = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dtype = wts_ptr.dtype.element_ty
    nch = K // 128
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    acc = _rows_mma(w_ptr + expert * stride_we + rows.to(tl.int64) * stride_wn,
                    s_ptr + expert * stride_se + rows.to(tl.int64) * stride_sn,
                    b_ptr + slot * nch * 2048, f_ptr + slot * nch * 16, c_ptr + slot * nch * 16,
                    K, ASM, BLOCK_N)
    tl.store(part_ptr + slot * n + rows, _rnd(acc * tl.load(wts_ptr + slot).to(tl.float32), dtype))


@triton.jit
def _sum_kernel(part_ptr, res_ptr, out_ptr, n, TOP_K: tl.constexpr, HAS_RES: tl.constexpr,
                BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for p in range(TOP_K):
        total += tl.load(part_ptr + (tok * TOP_K + p) * n + rows, mask=ok, other=0.0)
    out = _rnd(total, dtype)
    if HAS_RES:
        out += tl.load(res_ptr + tok * n + rows, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + tok * n + rows, out.to(dtype), mask=ok)


def decode_experts_mma(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up,
                       down, residual: torch.Tensor | None = None, block_n: tuple = (64, 64),
                       num_warps: tuple = (4, 4), num_stages: tuple = (2, 2),
                       asm: bool | None = None, gate_up_only: bool = False) -> torch.Tensor:
    """decode_experts' result for int4 experts (QuantWeight, group (1, 32)) on int8 MMAs."""
    t, top_k = ids.shape
    inter, hidden = gate_up.n // 2, down.n
    asm = (not _INTERPRET) if asm is None else asm
    flat = ids.reshape(-1).contiguous()
    gw, dw = gate_up.data.view(torch.uint8), down.data.view(torch.uint8)
    bx, fx, cx = digits(x)
    act = torch.empty(t * top_k, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(t * top_k, inter // block_n[0])](
        bx, fx, cx, flat, gw, gate_up.scale, act, inter, gate_up.k, gw.stride(0), gw.stride(1),
        gate_up.scale.stride(0), gate_up.scale.stride(1), TOP_K=top_k, ASM=asm,
        BLOCK_N=block_n[0], num_warps=num_warps[0], num_stages=num_stages[0])
    if gate_up_only:
        return act
    ba, fa, ca = digits(act)
    part = torch.empty(t * top_k, hidden, dtype=torch.float32, device=x.device)
    _down_part_kernel[(t * top_k, hidden // block_n[1])](
        ba, fa, ca, flat, weights.reshape(-1).contiguous(), dw, down.scale, part, hidden, inter,
        dw.stride(0), dw.stride(1), down.scale.stride(0), down.scale.stride(1), ASM=asm,
        BLOCK_N=block_n[1], num_warps=num_warps[1], num_stages=num_stages[1])
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    res = residual if residual is not None else out
    _sum_kernel[(t, triton.cdiv(hidden, 1024))](part, res, out, hidden, TOP_K=top_k,
                                                HAS_RES=residual is not None, BLOCK=1024)
    return out
