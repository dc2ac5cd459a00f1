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
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M = 16  # slots per tile: a decode step's few tokens per expert waste little of it


def align_slots(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (slots sorted by expert, each expert's run padded to whole tiles with the
    sentinel T * k [P]; the expert of each tile, num_experts past the last one [P / block_m]).
    P = T * k + E * (block_m - 1) rounded up to block_m: fixed by the shapes alone."""
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
    p = -(-(s + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_slots = torch.full((p,), s, dtype=torch.int64, device=dev)
    sorted_slots[starts[expert_of] + rank] = order
    tile_starts = torch.arange(0, p, block_m, device=dev)
    tile_expert = torch.searchsorted(padded.cumsum(0), tile_starts, right=True)
    return sorted_slots, tile_expert


@triton.jit
def _grouped_gemm(a_ptr, w_ptr, c_ptr, scale_ptr, sorted_ptr, tile_expert_ptr, num_slots, n, k,
                  stride_am, stride_we, stride_wn, stride_cm, TOP_K: tl.constexpr,
                  A_PER_TOKEN: tl.constexpr, SCALE: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """C[slot, :] = A[row of slot] @ W[expert].T (times scale[slot]) for one tile of slots."""
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= NUM_EXPERTS:
        return
    slots = tl.load(sorted_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    rows = slots // TOP_K if A_PER_TOKEN else slots
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
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
                gemm: GroupedGemm) -> torch.Tensor:
    """The routed experts around two grouped GEMMs (bf16 here, quantized in quant_gemm.py):
    x [T, H], weights / ids [T, k] -> [T, H]."""
    t, top_k = ids.shape
    slots = Slots(*align_slots(ids, num_experts), t * top_k, top_k)
    h = gemm(x.contiguous(), 0, slots, True, None)
    gate, up = h.chunk(2, dim=-1)
    act = (F.silu(gate.float()) * up.float()).to(x.dtype)
    y = gemm(act, 1, slots, False, weights.reshape(-1).float().contiguous())
    return y.view(t, top_k, -1).float().sum(dim=1).to(x.dtype)


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


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """experts_reference's result through the grouped GEMMs: x [T, H], weights / ids [T, k],
    gate_up [E, 2I, H], down [E, H, I] -> [T, H]."""
    layers = (gate_up, down)
    return run_experts(x, weights, ids, gate_up.shape[0],
                       lambda a, layer, slots, per_token, scale:
                       _grouped(a, layers[layer], slots, per_token, scale))
