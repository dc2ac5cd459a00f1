"""The gate_up GEMV with SiLU-and-mul fused (layers/gated_gemv.py) under Triton's interpreter:
the unfused GEMV and activation kernels' output bit for bit, and the MLP's fallbacks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from blockspec.layers.fused import silu_and_mul  # noqa: E402
from blockspec.layers.gated_gemv import gated_gemv, silu_gate_up  # noqa: E402
from blockspec.layers.linear import Linear, gemv  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [8, 13])  # whole row blocks of 2, and a partial last one
def test_gated_gemv_equals_gemv_then_silu_and_mul(dtype, inter):
    g = torch.Generator().manual_seed(inter)
    x = torch.randn(1, 2048, generator=g).to(dtype)
    w = (torch.randn(2 * inter, 2048, generator=g) / 16).to(dtype)
    got = gated_gemv(x, w)
    assert got.shape == (1, inter) and got.dtype == dtype
    assert torch.equal(got, silu_and_mul(gemv(x, w), use_triton=True))
    ref = torch.nn.functional.silu((x.float() @ w.float().T)[:, :inter]) \
        * (x.float() @ w.float().T)[:, inter:]
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


def test_silu_gate_up_fuses_only_what_gemv_would_take(monkeypatch):
    import blockspec.layers.gated_gemv as gg

    calls = []
    monkeypatch.setattr(gg, "gated_gemv", lambda x, w: calls.append(x.shape) or gated_gemv(x, w))
    g = torch.Generator().manual_seed(0)
    layer = Linear(1024, 16, bias=False).to(torch.bfloat16)
    layer.weight.data = (torch.randn(16, 1024, generator=g) / 32).to(torch.bfloat16)
    x = torch.randn(1, 1, 1024, generator=g).to(torch.bfloat16)
    layer.backend = "torch"  # F.linear then silu_and_mul
    eager = silu_gate_up(x, layer)
    assert torch.equal(eager, silu_and_mul(layer(x), use_triton=False)) and calls == []
    layer.backend = "triton"
    fused = silu_gate_up(x, layer)
    assert fused.shape == (1, 1, 8) and calls == [(1, 1024)]
    assert torch.equal(fused, silu_and_mul(layer(x), use_triton=True))
    two = torch.randn(2, 1024, generator=g).to(torch.bfloat16)  # two rows: not a GEMV
    assert torch.equal(silu_gate_up(two, layer), silu_and_mul(layer(two))) and len(calls) == 1
