"""MLA's rope rows reordered at load (models/mla_rope_rows.py) and the fused rope + latent norm
(layers/mla_fused.py): the Triton kernel against its torch twin, the load plan's FP8 rule, and
whole models (reordered or de-interleaved at run time, torch or Triton) against HF."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch
from helpers import PagedCache

import blockspec.models.deepseek_v3 as ds
from blockspec.config import ModelConfig
from blockspec.layers.mla_fused import mla_rope_norm
from blockspec.layers.mla_one_token import absorb_rope_norm
from blockspec.layers.rotary import RotaryEmbedding
from blockspec.model_config import RopeConfig
from blockspec.models.loader import load_model
from blockspec.models.mla_rope_rows import (
    permute_rope_rows,
    permutes_rope_at_load,
    rope_row_spans,
)
from blockspec.quant_config import FP8, QuantConfig
from blockspec.tiny import build_tiny_deepseek_v3

TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory) -> Path:
    return build_tiny_deepseek_v3(tmp_path_factory.mktemp("rope_rows"), q_lora_rank=24, seed=3)


@pytest.fixture(scope="module")
def hf_logits(ds_path) -> tuple[list[int], torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(ds_path), dtype=torch.float32).eval()
    ids = torch.randint(1, 500, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        return ids, hf(torch.tensor([ids])).logits[0]


def _inputs(t: int, h: int, latent: int, r: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(t + h)
    q = torch.randn(t, h, 16 + r, generator=g).to(dtype)  # [nope | rope] like a q projection
    kv = torch.randn(t, latent + r, generator=g).to(dtype)
    w = (1 + torch.randn(latent, generator=g) * 0.3).to(dtype)
    return q[..., 16:], kv, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
def test_kernel_matches_the_torch_twin(dtype, interleaved):
    t, h, latent, r = 5, 3, 40, 8
    q_pe, kv, w = _inputs(t, h, latent, r, dtype)
    rotary = RotaryEmbedding(r, 64, RopeConfig())
    positions = torch.tensor([0, 7, 3, 63, 12])
    outs = []
    for use_triton in (False, True):
        # NOTE: outputs are column slices of wider tensors, as the model passes them
        q_wide = torch.full((t, h, latent + r), float("nan"), dtype=dtype)
        entry = torch.full((t, 1, latent + r), float("nan"), dtype=dtype)
        mla_rope_norm(q_pe, kv, positions, rotary.cos_cache, rotary.sin_cache, w, 1e-6,
                      q_wide[..., latent:], entry, interleaved, use_triton=use_triton)
        assert q_wide[..., :latent].isnan().all()  # the absorbed-query columns untouched
        outs.append((q_wide[..., latent:], entry))
    (q_ref, e_ref), (q_tri, e_tri) = outs
    assert torch.equal(q_tri, q_ref) and torch.equal(e_tri[..., latent:], e_ref[..., latent:])
    torch.testing.assert_close(e_tri[..., :latent], e_ref[..., :latent])  # fp32 sum order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_writes_entries_into_their_cache_slots(dtype):
    """Given the paged cache and slot mapping the kernel writes each entry where store_kv would
    (slot -1 nowhere, every other slot untouched) and leaves `entry` alone."""
    t, h, latent, r = 5, 3, 40, 8
    q_pe, kv, w = _inputs(t, h, latent, r, dtype)
    rotary = RotaryEmbedding(r, 64, RopeConfig())
    positions = torch.tensor([0, 7, 3, 63, 12])
    slots = torch.tensor([17, -1, 0, 31, 9])
    cache = torch.randn(3, 16, 1, latent + r, generator=torch.Generator().manual_seed(5)).to(dtype)
    ref_cache = cache.clone()
    q_ref = torch.empty(t, h, r, dtype=dtype)
    entry = torch.empty(t, 1, latent + r, dtype=dtype)
    assert not mla_rope_norm(q_pe, kv, positions, rotary.cos_cache, rotary.sin_cache, w, 1e-6,
                             q_ref, entry, True, use_triton=True)
    keep = slots >= 0
    ref_cache.view(-1, 1, latent + r)[slots[keep]] = entry[keep]
    q_got = torch.empty_like(q_ref)
    untouched = torch.full_like(entry, float("nan"))
    assert mla_rope_norm(q_pe, kv, positions, rotary.cos_cache, rotary.sin_cache, w, 1e-6,
                         q_got, untouched, True, use_triton=True, cache=cache, slot_mapping=slots)
    assert torch.equal(q_got, q_ref) and torch.equal(cache, ref_cache)
    assert untouched.isnan().all()
    # the torch path has no cache write of its own: the caller's store_kv does it
    assert not mla_rope_norm(q_pe, kv, positions, rotary.cos_cache, rotary.sin_cache, w, 1e-6,
                             q_got, entry, True, use_triton=False, cache=cache,
                             slot_mapping=slots)


def test_reorder_is_the_runtime_deinterleave(ds_path):
    """A reordered projection's output is the original output with each rope span's evens
    first, then its odds (what the forward would otherwise do), for bf16 and e4m3 bytes."""
    cfg = ModelConfig.from_pretrained(ds_path)
    rows = cfg.num_attention_heads * (cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim)
    name = "model.layers.1.self_attn.q_b_proj.weight"
    w = torch.randn(rows, 24)
    got = permute_rope_rows(cfg, name, w)
    for a, b in rope_row_spans(cfg)["q_b_proj"]:
        assert torch.equal(got[a:b], torch.cat([w[a:b:2], w[a + 1:b:2]]))
    assert torch.equal(got[:16], w[:16])  # head 0's no-rope rows
    fp8 = w.to(torch.float8_e4m3fn)
    assert torch.equal(permute_rope_rows(cfg, name, fp8).float(), got.to(fp8.dtype).float())
    kv = torch.randn(cfg.mla.latent_dim)  # a bias: one row per output
    got = permute_rope_rows(cfg, "model.layers.0.self_attn.kv_a_proj_with_mqa.bias", kv)
    assert torch.equal(got[32:], torch.cat([kv[32::2], kv[33::2]]))
    for other in ("model.layers.0.self_attn.kv_b_proj.weight",
                  "model.layers.0.self_attn.q_b_proj.weight_scale_inv"):
        assert permute_rope_rows(cfg, other, w) is w


def test_fp8_blocks_that_split_a_rope_span_keep_the_runtime_path(ds_path):
    cfg = ModelConfig.from_pretrained(ds_path)
    assert permutes_rope_at_load(cfg)
    # kv_a_proj's rope rows are 32..39: whole in 8-row blocks, split by 12-row ones
    fp8 = functools.partial(QuantConfig, FP8)
    assert permutes_rope_at_load(dataclasses.replace(cfg, quant=fp8(block=(8, 32))))
    assert not permutes_rope_at_load(dataclasses.replace(cfg, quant=fp8(block=(12, 32))))
    plain = dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, rope_interleave=False))
    assert not permutes_rope_at_load(plain)


@torch.no_grad()
@pytest.mark.parametrize("reorder", [True, False])
@pytest.mark.parametrize("use_triton", [False, True])
def test_logits_match_hf(ds_path, hf_logits, monkeypatch, reorder, use_triton):
    """Reordered at load or de-interleaved at run time, by the torch twin or the kernel."""
    if not reorder:
        monkeypatch.setattr(ds, "permutes_rope_at_load", lambda cfg: False)
    if use_triton:
        monkeypatch.setattr(ds, "absorb_rope_norm",
                            functools.partial(absorb_rope_norm, use_triton=True))
    model = load_model(ds_path, ModelConfig.from_pretrained(ds_path), torch.float32, "cpu")
    assert model.rope_rows_permuted == reorder
    assert all(layer.self_attn.rope_rows_permuted == reorder for layer in model.model.layers)
    ids, ref = hf_logits
    (got,), _ = PagedCache(model).forward([([2, 0, 3], 0, ids)])
    torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot", [9, -1])
def test_one_token_absorb_and_rope_norm_in_one_launch(dtype, slot):
    """mla_one_token.absorb_rope_norm at one token (the W_UK absorb's programs and the rope /
    latent norm's in one grid) writes exactly what absorb then mla_rope_norm write: the
    absorbed and roped query columns and the cache slot (none for slot -1)."""
    from blockspec.layers import mla_one_token
    from blockspec.layers.mla_absorb import absorb

    h, nope, latent, r = 3, 16, 40, 8
    q_pe, kv, w = _inputs(1, h, latent, r, dtype)
    q_nope = torch.randn(1, h, nope, generator=torch.Generator().manual_seed(2)).to(dtype)
    w_uk = torch.randn(h, nope, latent, generator=torch.Generator().manual_seed(3)).to(dtype)
    rotary = RotaryEmbedding(r, 64, RopeConfig())
    cache = torch.randn(2, 16, 1, latent + r, generator=torch.Generator().manual_seed(5))
    cache = cache.to(dtype)
    outs = []
    for fused in (False, True):
        q_attn = torch.full((1, h, latent + r), float("nan"), dtype=dtype)
        c = cache.clone()
        rope = dict(q_pe=q_pe, kv=kv, positions=torch.tensor([13]), cos_cache=rotary.cos_cache,
                    sin_cache=rotary.sin_cache, norm_weight=w, eps=1e-6,
                    q_out=q_attn[..., latent:], entry=torch.empty(1, 1, latent + r, dtype=dtype),
                    interleaved=True, use_triton=True, cache=c,
                    slot_mapping=torch.tensor([slot]))
        if fused:
            assert mla_one_token.absorb_rope_norm(q_nope, w_uk.transpose(1, 2),
                                                  q_attn[..., :latent], "triton", **rope)
        else:
            absorb(q_nope, w_uk.transpose(1, 2), q_attn[..., :latent], "triton")
            assert mla_rope_norm(**rope)
        outs.append((q_attn, c))
    (q_ref, c_ref), (q_got, c_got) = outs
    assert torch.equal(q_got, q_ref) and torch.equal(c_got, c_ref)
    assert torch.equal(c_got, cache) == (slot < 0)


def test_absorb_rope_norm_takes_two_launches_off_its_one_token_path(monkeypatch):
    """More tokens, the torch absorb, or no cache to write into: the two calls as before."""
    from blockspec.layers import mla_one_token

    calls = []
    monkeypatch.setattr(mla_one_token, "absorb", lambda *a: calls.append("absorb"))
    monkeypatch.setattr(mla_one_token, "mla_rope_norm",
                        lambda **k: calls.append(("rope", k["use_triton"])) or False)
    two, w = torch.zeros(2, 3, 16), torch.zeros(3, 40, 16)
    cache = dict(cache=torch.zeros(2, 16, 1, 48), slot_mapping=torch.zeros(2, dtype=torch.long))
    for x, backend, more in ((two, "triton", cache), (two[:1], "torch", cache),
                             (two[:1], "triton", dict(cache=None, slot_mapping=None))):
        calls.clear()
        assert not mla_one_token.absorb_rope_norm(x, w, None, backend, kv=torch.zeros(1, 48),
                                                  use_triton=True, **more)
        assert calls == ["absorb", ("rope", True)]
