"""The router GEMV and routing in one launch (layers/router_gemv.py) under Triton's
interpreter: the same logits as split_gemv and the same picks and weights as route, bit for bit,
its counters left zero."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from blockspec.layers.arrival import arrival_locks  # noqa: E402
from blockspec.layers.moe import select_experts_reference  # noqa: E402
from blockspec.layers.moe_router import route  # noqa: E402
from blockspec.layers.router_gemv import route_gemv  # noqa: E402
from blockspec.layers.split_gemv import split_gemv  # noqa: E402


@pytest.mark.parametrize("e,k,top_k,groups,bias,norm", [
    (64, 1024, 6, (1, 1), True, True),  # Moonlight-like: 32 row blocks x 2 splits
    (16, 1536, 4, (4, 2), True, False),  # group-limited, 3 splits
    (12, 1024, 3, (1, 1), False, True),  # no correction bias, odd experts
])
def test_one_launch_equals_split_gemv_then_route(e, k, top_k, groups, bias, norm):
    g = torch.Generator().manual_seed(e + k)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    w = torch.randn(e, k, generator=g) / k**0.5
    b = torch.randn(e, generator=g) * 0.1 if bias else None
    args = (top_k, *groups, norm, 2.5)
    weights, ids = route_gemv(x, w, b, *args, torch.bfloat16)
    logits = split_gemv(x, w, torch.float32)
    ref_w, ref_ids = route(logits, b, *args, torch.bfloat16)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)
    hf_w, hf_ids = select_experts_reference(x.float() @ w.T, b, *args)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights.float(), hf_w, atol=1e-2, rtol=1e-2)
    assert not arrival_locks(x.device, 64).any()


def test_declines_what_it_does_not_cover():
    w = torch.randn(64, 1024)
    assert route_gemv(torch.randn(2, 1024), w, None, 6, 1, 1, True, 1.0, torch.float32) is None
    assert route_gemv(torch.randn(1, 768), torch.randn(64, 768), None, 6, 1, 1, True, 1.0,
                      torch.float32) is None  # no whole chunks of 512
    assert route_gemv(torch.randn(1, 1024), w.half(), None, 6, 1, 1, True, 1.0,
                      torch.float32) is None  # an fp32 router only
