"""DeepSeek-V3 MoE pieces (issue 21's first slice) against HF transformers' own modules on the
same random weights: the noaux_tc router's picks and weights, and the routed experts' output."""

from __future__ import annotations

import pytest
import torch

from blockspec.layers.moe import experts_reference, select_experts

mod = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
if not hasattr(mod, "DeepseekV3Experts"):  # NOTE: transformers < 5 keeps one module per expert
    pytest.skip("needs transformers 5's DeepseekV3Experts", allow_module_level=True)


def hf_config(**kw):
    from transformers import DeepseekV3Config

    base = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, n_routed_experts=16,
                num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
                routed_scaling_factor=2.5, hidden_act="silu")
    return DeepseekV3Config(**{**base, **kw})


@pytest.mark.parametrize("groups", [(4, 2), (1, 1), (8, 3)],
                         ids=["n_group4", "ungrouped", "n_group8"])
@pytest.mark.parametrize("norm", [True, False])
def test_router_matches_hf(groups, norm):
    cfg = hf_config(n_group=groups[0], topk_group=groups[1], norm_topk_prob=norm)
    router = mod.DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=gen))
    x = torch.randn(40, 32, generator=gen)
    logits, hf_w, hf_ids = router(x)
    w, ids = select_experts(logits, router.e_score_correction_bias, 4, *groups, norm, 2.5)
    order, hf_order = ids.argsort(dim=-1), hf_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(w.gather(1, order), hf_w.gather(1, hf_order))


def test_experts_match_hf():
    cfg = hf_config()
    experts = mod.DeepseekV3Experts(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) / 5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) / 4)
    x = torch.randn(30, 32, generator=gen)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(30)])
    w = torch.rand(30, 4, generator=gen)
    with torch.no_grad():
        ref = experts(x, ids, w)
    got = experts_reference(x, w, ids, experts.gate_up_proj.detach(), experts.down_proj.detach())
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t,e,k,n_group,topk_group,norm,bias", [
    (5, 64, 6, 1, 1, True, True), (3, 384, 8, 1, 1, True, True), (4, 32, 4, 4, 2, True, True),
    (6, 16, 2, 8, 3, False, False), (1, 6, 2, 1, 1, True, False)])
def test_router_kernel_picks_what_torch_picks(t, e, k, n_group, topk_group, norm, bias):
    """The Triton router (one program per token, interpreted here) == the torch reference:
    the same experts in the same order, the same weights."""
    pytest.importorskip("triton")
    from blockspec.layers.moe import select_experts_reference
    from blockspec.layers.moe_router import routable, route

    g = torch.Generator().manual_seed(e + t)
    logits = torch.randn(t, e, generator=g) * 3
    b = torch.randn(e, generator=g) * 0.5 if bias else None
    assert routable(e, k, n_group)
    w, ids = route(logits, b, k, n_group, topk_group, norm, 2.5)
    w0, ids0 = select_experts_reference(logits, b, k, n_group, topk_group, norm, 2.5)
    assert torch.equal(ids, ids0)
    torch.testing.assert_close(w, w0, atol=1e-6, rtol=1e-5)
    assert not routable(384, 8, 8) and not routable(2048, 8, 1)
    # weights rounded in the kernel's store: what `.to(dtype)` of the fp32 weights gives
    w16, ids16 = route(logits, b, k, n_group, topk_group, norm, 2.5, torch.float16)
    assert w16.dtype == torch.float16 and torch.equal(ids16, ids0)
    assert torch.equal(w16, w.to(torch.float16))


@pytest.mark.parametrize("e,k,n_group,topk_group", [(384, 8, 1, 1), (6, 2, 1, 1), (32, 4, 4, 2)])
def test_router_kernel_keeps_nan_rows_in_range(e, k, n_group, topk_group):
    """A graph's padding rows route unwritten attention output, NaN included: their picks stay
    distinct experts in [0, E) (on a GPU a NaN loses every argmax comparison, so a row of NaNs
    picked the padding lanes past E when E is not a power of two: Kimi's 384); a row's finite
    scores still win over its NaNs, and finite rows route as before."""
    pytest.importorskip("triton")
    from blockspec.layers.moe import select_experts_reference
    from blockspec.layers.moe_router import route

    g = torch.Generator().manual_seed(e)
    logits = torch.randn(3, e, generator=g) * 3
    logits[0] = float("nan")
    logits[1, ::2] = float("nan")
    b = torch.randn(e, generator=g) * 0.5
    _, ids = route(logits, b, k, n_group, topk_group, True, 2.5)
    assert ids.min() >= 0 and ids.max() < e
    assert all(len(set(row)) == k for row in ids.tolist())
    assert all(i % 2 == 1 for i in ids[1].tolist())  # the finite half
    _, ids0 = select_experts_reference(logits[2:], b, k, n_group, topk_group, True, 2.5)
    assert torch.equal(ids[2:], ids0)
