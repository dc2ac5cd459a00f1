"""A decode token's noaux_tc routing in one launch: the router's fp32 logits by split_gemv's
split-K GEMV, then the picks of moe_router.py's routing, by the last program to finish.

Programs (row block, split) sum their K slices; the last of a row block's programs to arrive
adds the splits in split order and stores the block's logits (split_gemv.py's sums, bit for
bit); the last row block to be stored routes the whole row (moe_router._route_row), so the
picks equal split_gemv + route's exactly, one launch and its latency fewer (a MoE layer's
router GEMV and routing at batch 1: ~2.7 us each on an H200 in Moonlight's step profile).
"""

from __future__ import annotations

import os

import torch

from blockspec.layers.arrival import _last_to_arrive, arrival_locks
from blockspec.layers.fused import _jit, tl, triton
from blockspec.layers.linear import _rows_span_sum
from blockspec.layers.moe_router import _route_row, routable
from blockspec.layers.pdl import pdl_args
from blockspec.layers.split_gemv import split_config


@_jit
def _router_gemv_kernel(x_ptr, w_ptr, logits_ptr, part_ptr, lock_ptr, bias_ptr, weights_ptr,
                        ids_ptr, K, K_SPLIT, scaling, E: tl.constexpr, E_PAD: tl.constexpr,
                        TOP_K: tl.constexpr, K_PAD: tl.constexpr, N_GROUP: tl.constexpr,
                        TOPK_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
    # NOTE: K_SPLIT % BLOCK_K == 0 and K % K_SPLIT == 0 (split_gemv.split_config).
    block, split = tl.program_id(0), tl.program_id(1)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < E
    part = _rows_span_sum(w_ptr + rows[:, None].to(tl.int64) * K, x_ptr, rmask, split * K_SPLIT,
                          (split + 1) * K_SPLIT, BLOCK_K, USE_PDL)
    tl.store(part_ptr + split * E + rows, part, mask=rmask)
    lock = lock_ptr + block
    if _last_to_arrive(lock, tl.num_programs(1)):
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for s in range(tl.num_programs(1)):
            total += tl.load(part_ptr + s * E + rows, mask=rmask, other=0.0, cache_modifier=".cg")
        tl.store(logits_ptr + rows, total, mask=rmask)
        tl.atomic_xchg(lock, 0)
        # NOTE: the row counter after the blocks' ones (route_gemv takes blocks + 1)
        done = lock_ptr + tl.num_programs(0)
        if _last_to_arrive(done, tl.num_programs(0)):
            e = tl.arange(0, E_PAD)
            x = tl.load(logits_ptr + e, mask=e < E, other=0.0, cache_modifier=".cg")
            _route_row(x, bias_ptr, weights_ptr, ids_ptr, scaling, E, E_PAD, TOP_K, K_PAD,
                       N_GROUP, TOPK_GROUP, HAS_BIAS, NORM)
            tl.atomic_xchg(done, 0)


def route_gemv(x: torch.Tensor, w: torch.Tensor, correction_bias: torch.Tensor | None,
               top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
               routed_scaling_factor: float, weights_dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """moe_router.route(x [1, K] @ w [E, K]^T in fp32, ...) in one launch: (weights [1, top_k]
    in `weights_dtype`, ids [1, top_k] int64), or None where it does not apply (not one row
    on the GPU or the interpreter, K not in split_gemv's whole chunks, shapes moe_router does
    not route, or counters a graph capture would allocate): the caller routes apart."""
    k = x.shape[-1]
    e = w.shape[0]
    bn, bk, splits = split_config(e, k)
    if triton is None or x.numel() != k or splits < 2 or k % (splits * bk) \
            or not routable(e, top_k, n_group) or w.shape[1] != k or not w.is_contiguous() \
            or w.dtype != torch.float32 or x.stride(-1) != 1 \
            or not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    blocks = triton.cdiv(e, bn)
    locks = arrival_locks(x.device, blocks + 1)
    if locks is None:
        return None
    logits = torch.empty(e, dtype=torch.float32, device=x.device)
    part = torch.empty(splits, e, dtype=torch.float32, device=x.device)
    weights = torch.empty(1, top_k, dtype=weights_dtype, device=x.device)
    ids = torch.empty(1, top_k, dtype=torch.int64, device=x.device)
    bias = correction_bias if correction_bias is not None else logits
    _router_gemv_kernel[(blocks, splits)](
        x, w, logits, part, locks, bias, weights, ids, k, k // splits,
        float(routed_scaling_factor), E=e, E_PAD=triton.next_power_of_2(e), TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k), N_GROUP=n_group, TOPK_GROUP=topk_group,
        HAS_BIAS=correction_bias is not None, NORM=norm_topk_prob, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=4, enable_fp_fusion=False, **pdl_args(x.device))
    return weights, ids
