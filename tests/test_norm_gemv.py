"""layers/norm_gemv.py: the input RMSNorm folded into the GEMV that reads it equals the norm
kernel + linear.gemv bit for bit under the interpreter (fp32 and bf16, with and without a
residual), writes the new residual, refuses what it cannot take; and the tiny DeepSeek-V3 with
the fold on gives the unfolded logits. Its speed is measured on a GPU (benchmarks/step_ab.py
--ab norm_fold)."""

from __future__ import annotations

import pytest
import torch

from blockspec.layers.fused import fused_add_rms_norm, rms_norm
from blockspec.layers.linear import gemv
from blockspec.layers.norm_gemv import NormedInput, folds, norm_gemv

pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("k,n", [(64, 5), (256, 48)])
def test_fold_equals_norm_then_gemv(dtype, with_residual, k, n):
    g = torch.Generator().manual_seed(k + n)
    h = torch.randn(1, k, generator=g).to(dtype)
    res = torch.randn(1, k, generator=g).to(dtype) if with_residual else None
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    if with_residual:
        x, want_res = fused_add_rms_norm(h, res, nw, 1e-6, use_triton=True)
    else:
        x, want_res = rms_norm(h, nw, 1e-6, use_triton=True), h
    want = gemv(x, w)
    inp = NormedInput(h, res, nw, 1e-6, torch.full_like(h, 7.0) if with_residual else h)
    got = norm_gemv(inp, w)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(inp.new_residual, want_res)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_more_rows_a_program(dtype, monkeypatch):
    """ROWS_PER_PROGRAM = 8: the tile keeps its size (BLOCK_K / 4, so the fp32 sums' order, not
    their terms, differs from gemv's) and the rows past a multiple of 8 are masked."""
    import blockspec.layers.norm_gemv as ng

    monkeypatch.setattr(ng, "ROWS_PER_PROGRAM", 8)
    assert ng.norm_gemv_config(3648, 2048)[:2] == (8, 256)
    g = torch.Generator().manual_seed(3)
    h, res = (torch.randn(1, 256, generator=g).to(dtype) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(256, generator=g)).to(dtype)
    w = (torch.randn(45, 256, generator=g) / 16).to(dtype)
    x, want_res = fused_add_rms_norm(h, res, nw, 1e-6, use_triton=True)
    inp = NormedInput(h, res, nw, 1e-6, torch.zeros_like(h))
    got = norm_gemv(inp, w)
    torch.testing.assert_close(got.float(), (x.float() @ w.float().T).to(dtype).float(),
                               atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-5)
    assert torch.equal(inp.new_residual, want_res)


def test_refuses_what_it_cannot_take():
    h, nw = torch.randn(2, 64), torch.ones(64)
    with pytest.raises(ValueError, match="norm_gemv"):  # two rows
        norm_gemv(NormedInput(h, None, nw, 1e-6, h), torch.randn(8, 64))
    big = torch.randn(1, 16384)
    with pytest.raises(ValueError, match="norm_gemv"):  # past one block of squares
        norm_gemv(NormedInput(big, None, torch.ones(16384), 1e-6, big), torch.randn(8, 16384))
    with pytest.raises(ValueError, match="residual"):
        NormedInput(h[:1], torch.randn(1, 32), nw, 1e-6, h[:1])
    one = h[:1]
    assert folds(one, nw, torch.randn(8, 64), "triton")
    assert not folds(one, nw, torch.randn(8, 64), "torch")
    assert not folds(h, nw, torch.randn(8, 64), "triton")
    assert not folds(one, nw.double(), torch.randn(8, 64), "triton")


def test_tiny_deepseek_v3_folded_equals_unfolded(tmp_path, monkeypatch):
    """A prefill, then one-token steps: with the fold on, every decode step's layers project
    through norm_gemv and the logits equal the unfolded ones."""
    from helpers import PagedCache

    import blockspec.models.deepseek_v3 as ds
    from blockspec.config import ModelConfig
    from blockspec.models.loader import load_model
    from blockspec.tiny import build_tiny_deepseek_v3

    path = build_tiny_deepseek_v3(tmp_path / "ds", num_layers=2)
    model = load_model(path, ModelConfig.from_pretrained(path), torch.float32, "cpu")
    model.fuse_projections()
    for m in model.modules():  # NOTE: the fused input projections' backend (kv_a_proj's)
        if isinstance(m, ds.MLAttention):
            m.kv_a_proj_with_mqa.backend = "triton"
    calls = []
    monkeypatch.setattr(ds, "norm_gemv", lambda *a: calls.append(1) or norm_gemv(*a))
    ids = torch.randint(1, 500, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    steps = [[([0, 1], 0, ids[:22])]] + [[([0, 1], i, ids[i:i + 1])] for i in range(22, 24)]
    logits = {}
    for fold in (False, True):
        for m in model.modules():
            if isinstance(m, ds.MLAttention):
                m.fold_input_norm = fold
        cache = PagedCache(model, num_blocks=4)
        logits[fold] = torch.cat([cache.forward(batch)[0][0] for batch in steps])
    assert len(calls) == 2 * len(model.model.layers)  # the 2 decode steps, not the prefill
    torch.testing.assert_close(logits[True], logits[False], atol=1e-5, rtol=1e-5)
    assert logits[False].abs().max() > 1.0
