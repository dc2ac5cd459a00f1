"""The routed experts as two grouped GEMMs in Triton (vLLM's fused-MoE scheme): every (token,
pick) slot is sorted by its expert and each expert's slots padded to whole BLOCK_M tiles, so a
program multiplies one tile of one expert's rows by that expert's weights. The sort runs in torch
with fixed-size outputs (no host sync: a CUDA graph captures it), the GEMMs in `_grouped_gemm`.

    gate_up = grouped(x[token of slot], W_gate_up[e])   [S, 2I]
    act = silu(gate) * up                                [S, I]
    y = grouped(act, W_down[e]) * weight[slot]           [S, H]
    out[t] = sum over t's picks of y                     [T, H]

`experts_reference` (layers/moe.py) is the torch twin the tests compare against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from blockspec.layers.fused import silu_and_mul
from blockspec.layers.moe import count_experts
from blockspec.layers.moe_decode import decode_experts, takes_decode_path
from blockspec.layers.side_stream import Residual, resolve

BLOCK_M = 16  # slots per tile: a decode step's few tokens per expert waste little of it


# Slots up to which one Triton program aligns them (decode and small verify steps: one launch
# instead of the ~17 small torch kernels below); larger steps sort in torch.
ALIGN_KERNEL_MAX_SLOTS = 1024


def align_slots(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M,
                stats: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (slots sorted by expert, each expert's run padded to whole tiles with the
    sentinel T * k [P]; the expert of each tile, num_experts past the last one [P / block_m]).
    P = T * k + E * (block_m - 1) rounded up to block_m: fixed by the shapes alone. `stats`
    (int64 [2]): the distinct experts selected and 1 are added to it (MoE.expert_counts)."""
    if ids.is_cuda and ids.numel() <= ALIGN_KERNEL_MAX_SLOTS:
        return align_slots_kernel(ids, num_experts, block_m, stats)
    if stats is not None:
        count_experts(ids, num_experts, stats)
    return align_slots_reference(ids, num_experts, block_m)


def _padded_size(num_slots: int, num_experts: int, block_m: int) -> int:
    return -(-(num_slots + num_experts * (block_m - 1)) // block_m) * block_m


def align_slots_reference(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """align_slots in torch (a stable sort by expert)."""
    flat = ids.reshape(-1)
    s = flat.numel()
    dev = flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    starts = padded.cumsum(0) - padded
    expert_of = flat[order]
    rank = torch.arange(s, device=dev) - (counts.cumsum(0) - counts)[expert_of]
    p = _padded_size(s, num_experts, block_m)
    sorted_slots = torch.full((p,), s, dtype=torch.int64, device=dev)
    sorted_slots[starts[expert_of] + rank] = order
    tile_starts = torch.arange(0, p, block_m, device=dev)
    tile_expert = torch.searchsorted(padded.cumsum(0), tile_starts, right=True)
    return sorted_slots, tile_expert


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, tile_expert_ptr, stats_ptr, num_slots, num_padded,
                  NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_S: tl.constexpr, COUNT: tl.constexpr):
    """align_slots_reference's outputs from one program: the experts' slot counts, their
    tile-padded runs, then each slot at its run's next place (stable: a chunk's slots of one
    expert are ranked by a cumulative sum down the chunk's one-hot rows)."""
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], tl.int32)
    for s0 in range(0, num_slots, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        e = tl.load(ids_ptr + s, mask=s < num_slots, other=E_PAD)  # E_PAD matches no expert
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    for p0 in range(0, num_padded, BLOCK_S):
        p = p0 + tl.arange(0, BLOCK_S)
        tl.store(sorted_ptr + p, tl.zeros([BLOCK_S], tl.int64) + num_slots, mask=p < num_padded)
    # NOTE: the sentinels above and the slots below may share addresses across threads.
    tl.debug_barrier()
    nxt = ends - padded
    for s0 in range(0, num_slots, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        e = tl.load(ids_ptr + s, mask=s < num_slots, other=E_PAD)
        hot = (e[:, None] == experts[None, :]).to(tl.int32)
        place = tl.sum(hot * (tl.cumsum(hot, 0) - hot + nxt[None, :]), 1)
        tl.store(sorted_ptr + place, s.to(tl.int64), mask=s < num_slots)
        nxt += tl.sum(hot, 0)
    for t0 in range(0, num_padded // BLOCK_M, BLOCK_S):
        t = t0 + tl.arange(0, BLOCK_S)
        # searchsorted(ends, tile start, right=True); padding experts end at the total
        done = tl.sum((ends[None, :] <= (t * BLOCK_M)[:, None]).to(tl.int32), 1)
        tl.store(tile_expert_ptr + t, tl.minimum(done, NUM_EXPERTS).to(tl.int64),
                 mask=t < num_padded // BLOCK_M)
    if COUNT:
        tl.atomic_add(stats_ptr, tl.sum((counts > 0).to(tl.int64), 0))
        tl.atomic_add(stats_ptr + 1, 1)


def align_slots_kernel(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M,
                       stats: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """align_slots as one Triton launch (any device; the interpreter on CPU)."""
    flat = ids.reshape(-1).contiguous()
    s = flat.numel()
    p = _padded_size(s, num_experts, block_m)
    sorted_slots = torch.empty(p, dtype=torch.int64, device=flat.device)
    tile_expert = torch.empty(p // block_m, dtype=torch.int64, device=flat.device)
    e_pad = triton.next_power_of_2(num_experts)
    # NOTE: a chunk's one-hot rows are BLOCK_S x E_PAD values in registers: ~8K keeps 384
    # experts (512 padded) at 16 slots per chunk.
    block_s = max(16, min(256, 8192 // e_pad))
    _align_kernel[(1,)](flat, sorted_slots, tile_expert, stats if stats is not None else flat,
                        s, p, NUM_EXPERTS=num_experts, E_PAD=e_pad, BLOCK_M=block_m,
                        BLOCK_S=block_s, COUNT=stats is not None, num_warps=8)
    return sorted_slots, tile_expert


@triton.jit
def tile_slots(sorted_ptr, num_slots, n, TOP_K: tl.constexpr, A_PER_TOKEN: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A grouped-GEMM program's (slots, valid slots, A rows, output columns, valid columns):
    program (tile of one expert's slots, block of BLOCK_N columns); A's rows are tokens
    (A_PER_TOKEN: a slot's token) or slots."""
    slots = tl.load(sorted_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = slots // TOP_K if A_PER_TOKEN else slots
    return slots, slots < num_slots, rows, cols, cols < n


@triton.jit
def _grouped_gemm(a_ptr, w_ptr, c_ptr, scale_ptr, sorted_ptr, tile_expert_ptr, num_slots, n, k,
                  stride_am, stride_we, stride_wn, stride_cm, TOP_K: tl.constexpr,
                  A_PER_TOKEN: tl.constexpr, SCALE: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """C[slot, :] = A[row of slot] @ W[expert].T (times scale[slot]) for one tile of slots."""
    expert = tl.load(tile_expert_ptr + tl.program_id(0))
    if expert >= NUM_EXPERTS:
        return
    slots, valid, rows, cols, col_ok = tile_slots(sorted_ptr, num_slots, n, TOP_K, A_PER_TOKEN,
                                                  BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + kk[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + kk[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(a.to(w.dtype), w, out_dtype=tl.float32, input_precision=DOT_PRECISION)
    if SCALE:
        acc *= tl.load(scale_ptr + slots, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + slots[:, None].to(tl.int64) * stride_cm + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


class Slots(NamedTuple):
    """Every (token, pick) slot sorted by expert into tiles (`align_slots`)."""

    sorted: torch.Tensor  # [P] slot ids, the sentinel num_slots in padding
    tile_expert: torch.Tensor  # [P / BLOCK_M] each tile's expert, num_experts past the last
    num_slots: int  # T * top_k
    top_k: int


# gemm(a, layer, slots, per_token, scale) -> [num_slots, N]: layer 0 (gate_up) or 1 (down) for
# every slot; a's rows are tokens (per_token) or slots; scale: a factor per slot or None.
GroupedGemm = Callable[[torch.Tensor, int, Slots, bool, "torch.Tensor | None"], torch.Tensor]


def run_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                gemm: GroupedGemm, stats: torch.Tensor | None = None,
                residual: Residual = None) -> torch.Tensor:
    """The routed experts around two grouped GEMMs (bf16 here, quantized in quant_gemm.py):
    x [T, H], weights / ids [T, k] -> [T, H] (+ residual, in x's dtype); `stats` as in
    align_slots."""
    t, top_k = ids.shape
    slots = Slots(*align_slots(ids, num_experts, stats=stats), t * top_k, top_k)
    h = gemm(x.contiguous(), 0, slots, True, None)
    # NOTE: rounded like experts_reference's (and HF's) eager silu(gate) * up; one kernel on a
    # GPU. The sum over a token's picks accumulates in fp32 and rounds once.
    y = gemm(silu_and_mul(h), 1, slots, False, weights.reshape(-1).float().contiguous())
    out = y.view(t, top_k, -1).sum(dim=1)
    return out if residual is None else out + resolve(residual)


def _grouped(a: torch.Tensor, w: torch.Tensor, slots: Slots, per_token: bool,
             scale: torch.Tensor | None) -> torch.Tensor:
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(slots.num_slots, n, dtype=a.dtype, device=a.device)
    assert a.stride(1) == 1 and w.stride(2) == 1
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (slots.tile_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm[grid](a, w, out, scale if scale is not None else out, slots.sorted,
                        slots.tile_expert, slots.num_slots, n, k, a.stride(0), w.stride(0),
                        w.stride(1), out.stride(0), TOP_K=slots.top_k, A_PER_TOKEN=per_token,
                        SCALE=scale is not None, NUM_EXPERTS=w.shape[0], BLOCK_M=BLOCK_M,
                        BLOCK_N=block_n, BLOCK_K=block_k,
                        # NOTE: fp32 weights mean a reference run: full fp32 products, not tf32.
                        DOT_PRECISION="ieee" if w.dtype == torch.float32 else "tf32")
    return out


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor,
                    stats: torch.Tensor | None = None,
                    residual: Residual = None) -> torch.Tensor:
    """experts_reference's result (+ residual) through the grouped GEMMs, at any number of
    slots."""
    layers = (gate_up, down)
    return run_experts(x, weights, ids, gate_up.shape[0],
                       lambda a, layer, slots, per_token, scale:
                       _grouped(a, layers[layer], slots, per_token, scale), stats, residual)


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor,
                  stats: torch.Tensor | None = None,
                  residual: Residual = None,
                  shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """experts_reference's result (+ residual, in x's dtype): for a decode step's few slots the
    GEMV kernels (moe_decode.py), else the grouped GEMMs. x [T, H], weights / ids [T, k],
    gate_up [E, 2I, H], down [E, H, I] -> [T, H]; `stats` as in align_slots; `shared` (the
    shared experts' weights, where moe_decode.folds_shared) as decode_experts takes it."""
    if takes_decode_path(ids.numel(), gate_up):
        return decode_experts(x.contiguous(), weights, ids, gate_up, down, stats, residual,
                              shared=shared)
    assert shared is None, "shared experts fold only into the decode path"
    return grouped_experts(x, weights, ids, gate_up, down, stats, residual)
