"""layers/norm_router.py: the post-attention RMSNorm folded into the router's split GEMV gives
fused_add_rms_norm + split_gemv's logits, normed input and residual bit for bit under the
interpreter, refuses what it cannot take; the tiny DeepSeek-V3 with the fold on gives the
unfolded logits. Its speed is measured on a GPU (benchmarks/step_ab.py --ab router_norm)."""

from __future__ import annotations

import pytest
import torch

from blockspec.layers.fused import fused_add_rms_norm
from blockspec.layers.norm_gemv import NormedInput
from blockspec.layers.norm_router import folds_router, norm_router
from blockspec.layers.split_gemv import split_gemv

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n,max_programs", [(1024, 6, 256), (2048, 8, 256), (1024, 6, 4)])
def test_fold_equals_norm_then_split_gemv(dtype, k, n, max_programs, monkeypatch):
    """max_programs 4: 4 rows a program where split_gemv takes 2 (router_config)."""
    import blockspec.layers.norm_router as nr

    monkeypatch.setattr(nr, "MAX_PROGRAMS", max_programs)
    assert nr.router_config(n, k)[0] == (2 if max_programs == 256 else 4)
    g = torch.Generator().manual_seed(k + n)
    h = torch.randn(1, k, generator=g).to(dtype)
    res = torch.randn(1, k, generator=g).to(dtype)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    w = torch.randn(n, k, generator=g) / k**0.5
    x_want, res_want = fused_add_rms_norm(h, res, nw, 1e-6, use_triton=True)
    want = split_gemv(x_want, w, torch.float32)
    inp = NormedInput(h, res, nw, 1e-6, torch.full_like(h, 7.0))
    got, x = norm_router(inp, w)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(x, x_want) and torch.equal(inp.new_residual, res_want)
    got_again, _ = norm_router(inp, w)  # NOTE: the counters were left at zero
    assert torch.equal(got_again, want)


def test_refuses_what_it_cannot_take():
    h, nw, w = torch.randn(1, 1024), torch.ones(1024), torch.randn(8, 1024)
    assert folds_router(h, nw, w)
    assert not folds_router(torch.randn(2, 1024), nw, w)  # two rows
    assert not folds_router(h, nw.double(), w)
    assert not folds_router(h, nw, w.bfloat16())  # routers are fp32
    assert not folds_router(torch.randn(1, 96), torch.ones(96), torch.randn(8, 96))  # 1 split
    with pytest.raises(ValueError, match="norm_router"):
        norm_router(NormedInput(h, None, nw, 1e-6, h), w.t().contiguous()[:8])


def test_tiny_deepseek_v3_folded_equals_unfolded(tmp_path, monkeypatch):
    """A prefill, then one-token steps on the Triton experts: with the fold on, every decode
    step's MoE layers route through norm_router and the logits equal the unfolded ones."""
    from helpers import PagedCache

    import blockspec.models.deepseek_moe as dm
    from blockspec.config import ModelConfig
    from blockspec.models.loader import load_model
    from blockspec.tiny import build_tiny_deepseek_v3

    path = build_tiny_deepseek_v3(tmp_path / "ds", num_layers=2)
    model = load_model(path, ModelConfig.from_pretrained(path), torch.float32, "cpu")
    moes = [m for m in model.modules() if isinstance(m, dm.MoE)]
    assert moes
    calls = []
    monkeypatch.setattr(dm, "norm_router", lambda *a: calls.append(1) or norm_router(*a))
    ids = torch.randint(1, 500, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    steps = [[([0, 1], 0, ids[:22])]] + [[([0, 1], i, ids[i:i + 1])] for i in range(22, 24)]
    logits = {}
    for fold in (False, True):
        for m in moes:
            m.experts_backend, m.fold_input_norm = "triton", fold
        cache = PagedCache(model, num_blocks=4)
        logits[fold] = torch.cat([cache.forward(batch)[0][0] for batch in steps])
    assert len(calls) == 2 * len(moes)  # the 2 decode steps, not the prefill
    torch.testing.assert_close(logits[True], logits[False], atol=1e-5, rtol=1e-5)
    assert logits[False].abs().max() > 1.0
