"""benchmarks/step_ab.py (a GPU benchmark) on CPU: each option's `default` is what the library
does untouched, and every setter, after trying its values, leaves the model and the modules as
they were, so the options measured after it in one run start from the engine's defaults."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")


def _state(model) -> tuple:
    from blockspec.layers import mla_one_token, moe_decode
    from blockspec.layers.attention import PagedAttention
    from blockspec.models import deepseek_v3 as ds

    beside = [m.shared_beside for m in model.modules() if isinstance(m, ds.MoE)]
    return (beside, moe_decode.DEFAULT_TILES[moe_decode.DENSE]["down"],
            mla_one_token._one_token_triton, PagedAttention.partials,
            os.environ.get("BLOCKSPEC_PDL", "1"))


def test_setters_return_to_the_library_defaults(tmp_path, monkeypatch):
    from helpers import load_script

    from blockspec.config import ModelConfig
    from blockspec.models.loader import load_model
    from blockspec.tiny import build_tiny_deepseek_v3

    mod = load_script("step_ab")
    path = build_tiny_deepseek_v3(tmp_path / "ds", num_layers=2)
    model = load_model(path, ModelConfig.from_pretrained(path), torch.float32, "cpu")
    llm = SimpleNamespace(engine=SimpleNamespace(model=model))
    monkeypatch.setenv("BLOCKSPEC_PDL", "1")  # NOTE: the setters turn PDL on (the default)
    before = _state(model)
    assert before[0]  # NOTE: a MoE layer whose shared_beside the setters flip
    for name, (setter, values, default) in mod.OPTIONS.items():
        for value in values:
            setter(llm, value)
        if name != "pdl":  # NOTE: every value differs from the default somewhere
            assert _state(model) != before or values[-1] == default, name
        setter(llm, default)
        assert _state(model) == before, name
