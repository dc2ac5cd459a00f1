"""EXPERIMENT: the int4 decode experts (moe_decode.py, "subnormal") with every tile read by TMA
tensor descriptors in a software-pipelined loop (words, scales, inputs), so that a program's
next tiles are in flight while it computes on one."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from blockspec.layers.fused import _cast, _rnd
from blockspec.layers.int4_bits import SUB_ROWS, _subnormal_store, subnormal_inputs
from blockspec.layers.pdl import pdl_args, pdl_sync


@triton.jit
def _x_cols(x_desc, x_ptr, x_row, kw0, j, cols, t_stride, X_TMA: tl.constexpr):
    """Row j of the subnormal inputs at x_row, words kw0.. (a [1, W] tile, or [rows, W])."""
    if X_TMA:
        return x_desc.load([x_row + j, kw0])
    return tl.load(x_ptr + (x_row + j).to(tl.int64) * t_stride + kw0 + cols)


@triton.jit
def _chunk(words, x_desc, x_ptr, x_row, kw0, cols, t_stride, X_TMA: tl.constexpr):
    """The words' unscaled sums against the inputs' words kw0.. [rows, W] (fp32)."""
    hi = words >> 16
    part = tl.zeros(words.shape, dtype=tl.float32)
    for j in tl.static_range(4):
        lo_c = _x_cols(x_desc, x_ptr, x_row, kw0, j, cols, t_stride, X_TMA)
        hi_c = _x_cols(x_desc, x_ptr, x_row, kw0, j + 4, cols, t_stride, X_TMA)
        part = tl.fma((words & (0xF << (4 * j))).to(tl.float32, bitcast=True), lo_c, part)
        part = tl.fma((hi & (0xF << (4 * j))).to(tl.float32, bitcast=True), hi_c, part)
    bias = _x_cols(x_desc, x_ptr, x_row, kw0, 8, cols, t_stride, X_TMA)
    return tl.fma(part, 18446744073709551616.0, -bias)  # SUB_UNIT


@triton.jit
def _scaled(part, s, acc, G: tl.constexpr):
    BLOCK_N: tl.constexpr = part.shape[0]
    W: tl.constexpr = part.shape[1]
    return tl.fma(tl.sum(tl.reshape(part, [BLOCK_N, W // G, G]), 2), s.to(tl.float32), acc)


@triton.jit
def _gate_up_tma_kernel(w_desc, s_desc, x_desc, x_ptr, ids_ptr, act_ptr, inter, K, t_stride,
                        act_words, ACT: tl.constexpr, TOP_K: tl.constexpr,
                        GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        STAGES: tl.constexpr, X_TMA: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
    pdl_sync(USE_PDL)
    slot = tl.program_id(0)
    r0 = tl.program_id(1) * BLOCK_N
    base = tl.load(ids_ptr + slot).to(tl.int32) * 2 * inter + r0
    x_row = (slot // TOP_K) * 9  # SUB_ROWS
    W: tl.constexpr = BLOCK_K // 8
    G: tl.constexpr = GROUP_K // 8
    cols = tl.arange(0, W)[None, :] + tl.zeros([BLOCK_N, 1], dtype=tl.int32)
    acc_g = tl.zeros([BLOCK_N, W // G], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, W // G], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        kw0 = k0 // 8
        wg = w_desc.load([base, kw0])
        wu = w_desc.load([base + inter, kw0])
        sg = s_desc.load([base, k0 // GROUP_K])
        su = s_desc.load([base + inter, k0 // GROUP_K])
        acc_g = _scaled(_chunk(wg, x_desc, x_ptr, x_row, kw0, cols, t_stride, X_TMA), sg, acc_g,
                        G)
        acc_u = _scaled(_chunk(wu, x_desc, x_ptr, x_row, kw0, cols, t_stride, X_TMA), su, acc_u,
                        G)
    gate, up = _rnd(tl.sum(acc_g, 1), ACT), _rnd(tl.sum(acc_u, 1), ACT)
    act = _rnd(gate / (1.0 + tl.exp(-gate)), ACT)
    act = _rnd(act * up, ACT)
    words = tl.program_id(1) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    out = act_ptr + slot.to(tl.int64) * 9 * act_words
    _subnormal_store(out, tl.reshape(act, [BLOCK_N // 8, 8]), words, words < inter // 8,
                     words < act_words, act_words, BLOCK_N // 8)


@triton.jit
def _down_tma_kernel(w_desc, s_desc, x_desc, x_ptr, ids_ptr, wts_ptr, res_ptr, out_ptr, n, inter,
                     t_stride, stride_rm, stride_om, TOP_K: tl.constexpr, HAS_RES: tl.constexpr,
                     GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr, X_TMA: tl.constexpr, USE_PDL: tl.constexpr = False):
    """One pipelined loop over (pick, chunk): each pick's sum weighted and rounded at its end."""
    pdl_sync(USE_PDL)
    tok = tl.program_id(0)
    r0 = tl.program_id(1) * BLOCK_N
    rows = r0 + tl.arange(0, BLOCK_N)
    ok = rows < n
    dtype = out_ptr.dtype.element_ty
    W: tl.constexpr = BLOCK_K // 8
    G: tl.constexpr = GROUP_K // 8
    cols = tl.arange(0, W)[None, :] + tl.zeros([BLOCK_N, 1], dtype=tl.int32)
    chunks = tl.cdiv(inter, BLOCK_K)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N, W // G], dtype=tl.float32)
    for i in tl.range(0, TOP_K * chunks, num_stages=STAGES):
        slot = tok * TOP_K + i // chunks
        c = i % chunks
        base = tl.load(ids_ptr + slot).to(tl.int32) * n + r0
        w = w_desc.load([base, c * W])
        s = s_desc.load([base, c * (BLOCK_K // GROUP_K)])
        acc = _scaled(_chunk(w, x_desc, x_ptr, slot * 9, c * W, cols, t_stride, X_TMA), s, acc,
                      G)
        if c == chunks - 1:
            total += _rnd(tl.sum(acc, 1) * tl.load(wts_ptr + slot).to(tl.float32), dtype)
            acc = tl.zeros([BLOCK_N, W // G], dtype=tl.float32)
    out = _rnd(total, dtype)
    if HAS_RES:
        out += tl.load(res_ptr + tok.to(tl.int64) * stride_rm + rows, mask=ok,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + tok.to(tl.int64) * stride_om + rows, _cast(out, dtype), mask=ok)


def _descs(w, block_n: int, block_k: int):
    e, n, kw = w.data.shape
    wd = TensorDescriptor.from_tensor(w.data.view(e * n, kw), [block_n, block_k // 8])
    sd = TensorDescriptor.from_tensor(w.scale.view(e * n, -1),
                                      [block_n, block_k // w.group[1]])
    return wd, sd


def decode_experts_tma(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up, down,
                       residual: torch.Tensor | None = None, tiles: dict | None = None,
                       stages: int = 3, x_tma: bool = True) -> torch.Tensor:
    """decode_experts(..., dequant="subnormal") for routed int4 experts (no shared fold)."""
    tiles = tiles or {"gate_up": (16, 1024, 2), "down": (8, 1024, 4)}
    (bn_g, bk_g, nw_g), (bn_d, bk_d, nw_d) = tiles["gate_up"], tiles["down"]
    t, top_k = ids.shape
    inter, hidden = gate_up.n // 2, down.n
    flat_ids = ids.reshape(-1).contiguous()
    xs = subnormal_inputs(x, bk_g)  # [T, 9, words]
    xw = xs.shape[2]
    act_words = max(triton.cdiv(inter // 8, bk_d // 8) * (bk_d // 8), 16)
    act = torch.zeros(t * top_k, SUB_ROWS, act_words, dtype=torch.float32, device=x.device)
    wd, sd = _descs(gate_up, bn_g, bk_g)
    xd = TensorDescriptor.from_tensor(xs.view(-1, xw), [1, bk_g // 8])
    pdl = pdl_args(x.device)
    _gate_up_tma_kernel[(t * top_k, triton.cdiv(inter, bn_g))](
        wd, sd, xd, xs, flat_ids, act, inter, gate_up.k, xw, act_words, ACT=tl.bfloat16,
        TOP_K=top_k, GROUP_K=gate_up.group[1], BLOCK_N=bn_g, BLOCK_K=bk_g, STAGES=stages,
        X_TMA=x_tma, num_warps=nw_g, enable_fp_fusion=True, **pdl)
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    wd, sd = _descs(down, bn_d, bk_d)
    ad = TensorDescriptor.from_tensor(act.view(-1, act_words), [1, bk_d // 8])
    res = residual if residual is not None else out
    _down_tma_kernel[(t, triton.cdiv(hidden, bn_d))](
        wd, sd, ad, act, flat_ids, weights.reshape(-1).contiguous(), res, out, hidden, inter,
        act_words, res.stride(0), out.stride(0), TOP_K=top_k, HAS_RES=residual is not None,
        GROUP_K=down.group[1], BLOCK_N=bn_d, BLOCK_K=bk_d, STAGES=stages, X_TMA=x_tma,
        num_warps=nw_d, enable_fp_fusion=True, **pdl)
    return out
