"""The Triton grouped-GEMM experts (layers/fused_moe.py) against the torch reference, run by
Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from blockspec.layers.fused_moe import BLOCK_M, align_slots, fused_experts  # noqa: E402
from blockspec.layers.moe import experts_reference, select_experts  # noqa: E402


def case(t: int, e: int = 8, k: int = 2, h: int = 64, i: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    logits = torch.randn(t, e, generator=g)
    weights, ids = select_experts(logits, None, k, 1, 1, True, 2.5)
    gate_up = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    down = torch.randn(e, h, i, generator=g) / i**0.5
    return x, weights, ids, gate_up, down


@pytest.mark.parametrize("t", [1, 5, 37])
def test_fused_experts_match_the_reference(t):
    x, w, ids, gate_up, down = case(t, seed=t)
    torch.testing.assert_close(fused_experts(x, w, ids, gate_up, down),
                               experts_reference(x, w, ids, gate_up, down),
                               atol=1e-4, rtol=1e-4)


def test_one_expert_takes_every_token():
    """More slots than a tile for one expert, none for the others."""
    x, w, _, gate_up, down = case(2 * BLOCK_M + 3, k=1)
    ids = torch.full((x.shape[0], 1), 5)
    torch.testing.assert_close(fused_experts(x, w, ids, gate_up, down),
                               experts_reference(x, w, ids, gate_up, down),
                               atol=1e-4, rtol=1e-4)


def test_alignment_pads_each_expert_to_whole_tiles():
    ids = torch.tensor([[3, 1], [1, 0], [3, 1]])
    slots, tile_expert = align_slots(ids, 4, block_m=4)
    s = ids.numel()
    assert slots.numel() == 4 * ((s + 4 * 3 + 3) // 4)  # fixed by the shapes alone
    for tile, expert in enumerate(tile_expert.tolist()):
        run = slots[tile * 4:(tile + 1) * 4].tolist()
        real = [x for x in run if x < s]
        if expert < 4:
            assert real and all(ids.reshape(-1)[x] == expert for x in real)
        else:
            assert not real
    assert sorted(x for x in slots.tolist() if x < s) == list(range(s))


@pytest.mark.parametrize("t,k,e,block_m", [(1, 6, 64, 16), (3, 2, 4, 4), (37, 8, 384, 16),
                                           (64, 6, 64, 16), (5, 1, 6, 4), (128, 8, 16, 16)])
def test_alignment_kernel_equals_the_torch_sort(t, k, e, block_m):
    """One Triton program (the decode-sized path on a GPU) == the stable torch sort, slot for
    slot; the distinct experts and the forward are added to the counters."""
    from blockspec.layers.fused_moe import align_slots_kernel, align_slots_reference

    g = torch.Generator().manual_seed(t * 31 + e)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if t == 37:
        ids[:, 0] = 7  # one expert with more slots than a tile, most with none
    stats = torch.tensor([5, 2])
    got = align_slots_kernel(ids, e, block_m, stats)
    want = align_slots_reference(ids, e, block_m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert stats.tolist() == [5 + ids.unique().numel(), 3]
