"""The batch-1 Triton GEMV (layers/linear.py) vs F.linear, its dispatch, and the engine with it:
greedy output unchanged, speculative greedy still equal to plain greedy. Without a GPU the kernel
runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import cpu_llm, random_prompts

from blockspec import SamplingParams
from blockspec.config import ConfigError, EngineConfig
from blockspec.layers import linear as lin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1e-2), torch.float16: (2e-3, 1e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [40, 96, 1001])  # 1001: the last program's row masked
def test_gemv_matches_f_linear(dtype, n):
    g = torch.Generator().manual_seed(n)
    k = 96  # not a multiple of the default BLOCK_K: the config halves it to 32
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    y = lin.gemv(x, w)
    assert y.dtype == dtype and y.shape == (1, n)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [2, 15, 16])
def test_skinny_matches_f_linear(dtype, m):
    if DEVICE == "cuda" and dtype == torch.float32:
        pytest.skip("fp32 tl.dot runs in tf32 on GPU; the engine sends only bf16/fp16 there")
    g = torch.Generator().manual_seed(m)
    n, k = lin.SKINNY_MIN_N, 96
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    y = lin.skinny(x, w)
    assert y.dtype == dtype and y.shape == (m, n)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), atol=atol, rtol=rtol)


def test_explicit_configs_and_bad_shapes():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 64, generator=g), torch.randn(48, 64, generator=g)
    for cfg in [(16, 32, 4, 2), (32, 64, 4, 3), (4, 16, 1, 1)]:
        torch.testing.assert_close(lin.gemv(x, w, cfg), x @ w.t())
    for bad in [dict(config=(16, 48, 4, 2)),  # BLOCK_K does not divide K
                dict(w=w.t().contiguous().t()),  # weight not row-major
                dict(x=torch.randn(2, 64))]:  # two rows
        with pytest.raises(ValueError, match="unsupported shapes"):
            lin.gemv(**{"x": x, "w": w, **bad})
    x3 = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(lin.skinny(x3, w, (16, 32, 4, 2)), x3 @ w.t())
    with pytest.raises(ValueError, match="unsupported shapes"):
        lin.skinny(torch.randn(17, 64), w, (16, 32, 4, 2))  # more rows than a tile
    assert lin.gemv_config(8, 24) is None  # no BLOCK_K >= 16 divides 24
    # the tl.dot kernel only where it beat cuBLAS: 2..16 rows, wide weights
    assert lin.skinny_config(16, 24576, 4096) == (64, 128, 4, 4)
    assert lin.skinny_config(16, 12288, 4096) is None and lin.skinny_config(1, 24576, 64) is None
    assert lin.skinny_config(17, 24576, 4096) is None
    assert lin.gemv_config(32768, 4096)[:2] == lin.gemv_config(576, 2048)[:2] == (2, 1024)
    assert lin.gemv_config(2048, 2816)[:2] == (2, 256)  # BLOCK_K halved until it divides K


def test_dispatch(monkeypatch):
    calls = []
    real, real_skinny = lin.gemv, lin.skinny
    monkeypatch.setattr(lin, "gemv", lambda x, w, c=None: calls.append(x.shape) or real(x, w, c))
    w, b = torch.randn(32, 64), torch.randn(32)
    x3 = torch.randn(1, 1, 64)
    # torch backend, two rows, a bias: F.linear; otherwise the kernel, any leading shape.
    lin.linear(x3, w, None, "torch")
    lin.linear(torch.randn(2, 64), w, None, "triton")
    lin.linear(x3, w, b, "triton")
    assert calls == []
    y = lin.linear(x3, w, None, "triton")
    assert calls == [(1, 64)] and y.shape == (1, 1, 32)
    torch.testing.assert_close(y, F.linear(x3, w))
    strided = torch.randn(1, 128)[:, ::2]  # not contiguous: copied first
    torch.testing.assert_close(lin.linear(strided, w, None, "triton"), F.linear(strided, w))
    layer = lin.Linear(64, 32, bias=False)
    layer(x3[0])
    assert len(calls) == 2  # "torch" until the engine sets it
    layer.backend = "triton"
    layer(x3[0])
    assert len(calls) == 3
    # 2..16 rows: the tl.dot kernel for a wide weight only
    wide = torch.randn(lin.SKINNY_MIN_N, 64) / 8
    monkeypatch.setattr(lin, "skinny", lambda x, w, c=None: calls.append(("dot", x.shape[0]))
                        or real_skinny(x, w, c))
    x4 = torch.randn(2, 2, 64)
    torch.testing.assert_close(lin.linear(x4, wide, None, "triton"), F.linear(x4, wide),
                               atol=1e-5, rtol=1e-5)
    lin.linear(x4, w, None, "triton")  # narrow: F.linear
    lin.linear(torch.randn(17, 64), wide, None, "triton")  # too many rows: F.linear
    assert calls[3:] == [("dot", 4)]


def test_config_and_engine_backend(qwen3_path):
    with pytest.raises(ConfigError, match="linear backend"):
        EngineConfig(model=str(qwen3_path), linear_backend="cublas")
    llm = cpu_llm(qwen3_path, linear_backend="triton")
    layers = [m for m in llm.engine.model.modules() if isinstance(m, lin.Linear)]
    assert layers and all(m.backend == "triton" for m in layers)
    assert all(m.backend == "torch" for m in cpu_llm(qwen3_path).engine.model.modules()
               if isinstance(m, lin.Linear))


def test_engine_outputs_with_triton_matmuls(qwen3_path, drafter16, monkeypatch):
    """Greedy output with the Triton matmuls equals the torch path's, for plain and DFlash
    decoding (the kernels really run: counted; the tiny model's weights are all narrow, so the
    tl.dot kernel is opened to every width here)."""
    calls = []
    real, real_skinny = lin.gemv, lin.skinny
    monkeypatch.setattr(lin, "gemv", lambda x, w, c=None: calls.append(1) or real(x, w, c))
    monkeypatch.setattr(lin, "skinny", lambda x, w, c=None: calls.append(x.shape[0])
                        or real_skinny(x, w, c))
    prompts = random_prompts([7], seed=3)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ref = [o.token_ids for o in cpu_llm(qwen3_path).generate(prompts, params)]
    assert calls == []
    ar = cpu_llm(qwen3_path, linear_backend="triton")
    assert [o.token_ids for o in ar.generate(prompts, params)] == ref
    n_layers = ar.engine.model_config.num_hidden_layers
    assert calls.count(1) >= 3 * (4 * n_layers + 1)  # every decode step's matmuls
    calls.clear()
    monkeypatch.setattr(lin, "SKINNY_MIN_N", 1)
    sp = cpu_llm(qwen3_path, drafter16, linear_backend="triton", speculation_policy="fixed",
                 block_size=16)
    assert [o.token_ids for o in sp.generate(prompts, params)] == ref
    assert 16 in calls and 15 in calls  # a speculative step: 16 verify rows, 15 drafts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_logits_are_fp32_of_the_inputs_as_given(dtype, monkeypatch):
    """One row: the split GEMV (K in whole chunks) or else the GEMV reads x in its dtype and
    the fp32 router weight, sums in fp32 (== F.linear(x.float(), w) to fp32 reduction order);
    other shapes and the torch backend are F.linear itself."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1024, generator=g).to(DEVICE, dtype)
    w = (torch.randn(64, 1024, generator=g) / 32).to(DEVICE)
    calls = []
    real = lin.gemv
    monkeypatch.setattr(lin, "gemv", lambda *a: calls.append(a[2]) or real(*a))
    ref = F.linear(x.float(), w)
    got = lin.router_logits(x, w, "triton")  # 1024 columns: two chunks of 512, two splits
    assert got.dtype == torch.float32 and calls == []
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    x7 = torch.randn(1, 768, generator=g).to(DEVICE, dtype)  # no whole chunk of 512: gemv
    w7 = (torch.randn(64, 768, generator=g) / 32).to(DEVICE)
    torch.testing.assert_close(lin.router_logits(x7, w7, "triton"), F.linear(x7.float(), w7),
                               atol=1e-5, rtol=1e-5)
    assert calls == [(2, 256, 4, 3)]
    calls.clear()
    x3 = torch.randn(3, 1024, generator=g).to(DEVICE, dtype)
    assert torch.equal(lin.router_logits(x3, w, "triton"), F.linear(x3.float(), w))
    assert torch.equal(lin.router_logits(x, w, "torch"), ref) and calls == []
