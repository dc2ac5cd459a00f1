"""MLA's absorbed projections (layers/mla_absorb.py) by the Triton kernel, under the
interpreter, against torch.bmm: W_UK's strided (transposed) view and W_UV as stored."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import blockspec.layers.mla_absorb as ma  # noqa: E402


def kv_b(h: int, nope: int, v: int, rank: int, dtype: torch.dtype, g: torch.Generator):
    """w_uk [h, nope, rank] and w_uv [h, v, rank]: views of one kv_b_proj weight, as the model
    takes them."""
    w = (torch.randn(h * (nope + v), rank, generator=g) / rank**0.5).to(dtype)
    return w.view(h, -1, rank).split([nope, v], dim=1)


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbs_match_bmm(t, dtype):
    g = torch.Generator().manual_seed(t)
    h, nope, v, rank = 4, 16, 24, 64
    w_uk, w_uv = kv_b(h, nope, v, rank, dtype, g)
    q = torch.randn(t, h, nope + 8, generator=g).to(dtype)  # the rope columns follow
    q_attn = torch.zeros(t, h, rank + 8, dtype=dtype)
    ma.absorb(q[..., :nope], w_uk.transpose(1, 2), q_attn[..., :rank], "triton", max_tokens=t)
    want = torch.bmm(q[..., :nope].float().transpose(0, 1), w_uk.float()).transpose(0, 1)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q_attn[..., :rank].float(), want, **tol)
    assert not q_attn[..., rank:].any()  # columns past the view untouched
    out = torch.randn(t, h, rank + 8, generator=g).to(dtype)[..., :rank]
    o = torch.empty(t, h, v, dtype=dtype)
    ma.absorb(out, w_uv, o, "triton", max_tokens=t)
    want = torch.bmm(out.float().transpose(0, 1), w_uv.float().transpose(1, 2)).transpose(0, 1)
    torch.testing.assert_close(o.float(), want, **tol)


def test_many_tokens_and_the_torch_backend_take_bmm(monkeypatch):
    launched = []
    monkeypatch.setattr(ma, "_absorb_kernel", type("K", (), {
        "__getitem__": lambda self, grid: lambda *a, **k: launched.append(grid)})())
    g = torch.Generator().manual_seed(0)
    _, w_uv = kv_b(2, 8, 8, 32, torch.float32, g)
    for t, backend in ((ma.MAX_TOKENS + 1, "triton"), (2, "torch")):
        x, o = torch.randn(t, 2, 32, generator=g), torch.empty(t, 2, 8)
        ma.absorb(x, w_uv, o, backend)
        torch.testing.assert_close(o, torch.einsum("thr,hvr->thv", x, w_uv))
    assert launched == []
    ma.absorb(torch.randn(1, 2, 32), w_uv, torch.empty(1, 2, 8), "triton")
    assert launched == [(2, 1)]
