"""Skinny-batch Triton matmuls (layers/linear.py) vs F.linear, their dispatch, and the engine
with them: greedy output unchanged, speculative greedy still equal to plain greedy. Without a GPU
the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1)."""

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
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n", [40, 96])
def test_skinny_linear_matches_f_linear(dtype, m, n):
    if DEVICE == "cuda" and dtype == torch.float32:
        pytest.skip("fp32 tl.dot runs in tf32 on GPU; the engine sends only bf16/fp16 there")
    g = torch.Generator().manual_seed(m * 1000 + n)
    k = 96  # not a multiple of the default BLOCK_K: the config halves it to 32
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    y = lin.skinny_linear(x, w)
    assert y.dtype == dtype and y.shape == (m, n)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), atol=atol, rtol=rtol)


def test_explicit_configs_and_bad_shapes():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 64, generator=g), torch.randn(48, 64, generator=g)
    for cfg in [(16, 32, 4, 2), (32, 64, 4, 3)]:
        torch.testing.assert_close(lin.skinny_linear(x, w, cfg), x @ w.t())
        torch.testing.assert_close(lin.skinny_linear(x[:1], w, cfg), x[:1] @ w.t())
    with pytest.raises(ValueError, match="unsupported shapes"):
        lin.skinny_linear(x, w, (16, 48, 4, 2))  # BLOCK_K does not divide K
    with pytest.raises(ValueError, match="unsupported shapes"):
        lin.skinny_linear(x, w.t().contiguous().t())  # weight not row-major
    assert lin.skinny_config(1, 8, 24) is None  # no BLOCK_K >= 16 divides 24
    assert lin.skinny_config(1, 32768, 4096)[1] == 256 and lin.skinny_config(4, 8, 4096)


def test_dispatch(monkeypatch):
    calls = []
    real = lin.skinny_linear
    monkeypatch.setattr(lin, "skinny_linear", lambda x, w, c=None: calls.append(x.shape)
                        or real(x, w, c))
    w, b = torch.randn(32, 64), torch.randn(32)
    x3 = torch.randn(2, 3, 64)
    # torch backend, too many rows, a bias: F.linear; otherwise the kernel, any leading shape.
    lin.linear(x3, w, None, "torch")
    lin.linear(torch.randn(lin.SKINNY_MAX_M + 1, 64), w, None, "triton")
    lin.linear(x3, w, b, "triton")
    assert calls == []
    y = lin.linear(x3, w, None, "triton")
    assert calls == [(6, 64)] and y.shape == (2, 3, 32)
    torch.testing.assert_close(y, F.linear(x3, w))
    strided = torch.randn(4, 128)[:, ::2]  # rows not contiguous: copied first
    torch.testing.assert_close(lin.linear(strided, w, None, "triton"), F.linear(strided, w))
    layer = lin.Linear(64, 32, bias=False)
    layer(x3[0])
    assert len(calls) == 2  # "torch" until the engine sets it
    layer.backend = "triton"
    layer(x3[0])
    assert len(calls) == 3


def test_config_and_engine_backend(qwen3_path):
    with pytest.raises(ConfigError, match="linear backend"):
        EngineConfig(model=str(qwen3_path), linear_backend="cublas")
    llm = cpu_llm(qwen3_path, linear_backend="triton")
    layers = [m for m in llm.engine.model.modules() if isinstance(m, lin.Linear)]
    assert layers and all(m.backend == "triton" for m in layers)
    assert all(m.backend == "torch" for m in cpu_llm(qwen3_path).engine.model.modules()
               if isinstance(m, lin.Linear))


def test_engine_outputs_with_triton_matmuls(qwen3_path, drafter16, monkeypatch):
    """Greedy output with the Triton matmuls equals the cuBLAS/torch path's, and DFlash greedy
    with them equals plain greedy (the kernels really run: counted)."""
    calls = []
    real = lin.skinny_linear
    monkeypatch.setattr(lin, "skinny_linear", lambda x, w, c=None: calls.append(x.shape[0])
                        or real(x, w, c))
    prompts = random_prompts([5, 9], seed=3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = cpu_llm(qwen3_path)
    ref = [o.token_ids for o in plain.generate(prompts, params)]
    assert calls == []
    ar = cpu_llm(qwen3_path, linear_backend="triton")
    assert [o.token_ids for o in ar.generate(prompts, params)] == ref and 2 in calls
    one = [o.token_ids for o in ar.generate(prompts[:1], params)]  # batch 1: the GEMV kernel
    assert one == [o.token_ids for o in plain.generate(prompts[:1], params)] and 1 in calls
    calls.clear()
    sp = cpu_llm(qwen3_path, drafter16, linear_backend="triton", speculation_policy="fixed",
                 block_size=16)
    assert [o.token_ids for o in sp.generate(prompts, params)] == ref
    calls.clear()
    assert [o.token_ids for o in sp.generate(prompts[:1], params)] == one
    assert 16 in calls and 15 in calls  # one sequence's speculative step: 16 rows, 15 drafts
