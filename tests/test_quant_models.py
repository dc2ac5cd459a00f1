"""Quantized DeepSeek-V3 checkpoints (compressed-tensors W4A16 as Kimi K2.x ship, block-scaled
FP8 as DeepSeek-V3 ship) against HF transformers' own model of the same folder, dequantized at
load by transformers and compressed-tensors: our logits on the torch (dequantizing) path and
through the Triton kernels (interpreted here) must be theirs, fp32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import PagedCache
from quant_models import fp8_checkpoint, hf_dequantized, int4_checkpoint
from safetensors.torch import load_file, save_file

from blockspec.config import ModelConfig
from blockspec.errors import ConfigError
from blockspec.layers.linear import Linear
from blockspec.layers.quant_linear import Fp8Linear, Int4Linear
from blockspec.models.loader import load_model
from blockspec.models.quant_experts import Fp8Experts, Int4Experts
from blockspec.tiny import build_tiny_deepseek_v3

TOL = dict(atol=1e-4, rtol=1e-4)
CASES = {
    # Kimi K2.x: routed experts int4, everything else dense
    "int4_experts": lambda src, dst: int4_checkpoint(src, dst),
    # every Linear but lm_head: fused gate_up shards, kv_b_proj dequantized at load
    "int4_all": lambda src, dst: int4_checkpoint(src, dst, ignore=["lm_head"]),
    # DeepSeek-V3's layout; non-square blocks (HF needs whole blocks: kv_a_proj has 40 rows)
    "fp8": lambda src, dst: fp8_checkpoint(src, dst, (8, 32)),
}


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory) -> Path:
    return build_tiny_deepseek_v3(tmp_path_factory.mktemp("dense"), q_lora_rank=32, seed=5)


@pytest.fixture(scope="module", params=sorted(CASES))
def quant_path(request, dense_path, tmp_path_factory) -> Path:
    return CASES[request.param](dense_path, tmp_path_factory.mktemp("q") / request.param)


@pytest.fixture(scope="module")
def hf(quant_path):
    return hf_dequantized(quant_path)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def set_backend(model: torch.nn.Module, backend: str) -> None:
    for m in model.modules():
        if isinstance(m, Linear):
            m.backend = backend
        elif hasattr(m, "experts_backend"):
            m.experts_backend = backend


def test_quantized_modules_are_the_checkpoints(quant_path):
    cfg = ModelConfig.from_pretrained(quant_path)
    model = load_model(quant_path, cfg, torch.float32, "cpu")
    layers = model.model.layers
    experts = layers[1].mlp.experts
    attn, dense_mlp, shared = layers[1].self_attn, layers[0].mlp, layers[1].mlp.shared_experts
    assert type(model.lm_head) is Linear and type(attn.kv_b_proj) is Linear  # dense
    if cfg.quant.method == "fp8":
        assert isinstance(experts, Fp8Experts) and experts.gate_up_proj.dtype == torch.float8_e4m3fn
        assert all(isinstance(m, Fp8Linear) for m in (attn.q_b_proj, dense_mlp.gate_up_proj))
    else:
        assert isinstance(experts, Int4Experts) and cfg.quant.group_size == 32
        want = Int4Linear if "all" in quant_path.name else Linear
        assert all(type(m) is want for m in (attn.q_b_proj, dense_mlp.gate_up_proj,
                                            shared.down_proj))


@torch.no_grad()
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_logits_match_hf_dequantized(quant_path, hf, backend):
    model = load_model(quant_path, ModelConfig.from_pretrained(quant_path), torch.float32, "cpu")
    set_backend(model, backend)
    # NOTE: fewer tokens through the interpreted kernels (their int4 experts run slowly there);
    # both lengths take the decode-step experts (up to 128 slots of top 2)
    n, cut = (45, 30) if backend == "torch" else (20, 12)
    ids = prompt(n, seed=len(backend))
    ref = hf(torch.tensor([ids])).logits[0]
    cache = PagedCache(model)
    (first,), _ = cache.forward([([3, 1, 6], 0, ids[:cut])])
    (rest,), _ = cache.forward([([3, 1, 6], cut, ids[cut:])])
    torch.testing.assert_close(torch.cat([first, rest]), ref, **TOL)


@torch.no_grad()
def test_quantization_changes_the_logits(dense_path, quant_path, hf):
    """The comparison above can fail: the quantized model is not the dense one."""
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(str(dense_path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt(20)])
    assert (dense(ids).logits - hf(ids).logits).abs().max() > 1e-2


@torch.no_grad()
def test_dummy_weights_fill_the_quantized_tensors(quant_path):
    """load_format=dummy (benchmarks at real shapes): random quantized weights of a sane scale,
    on both paths alike."""
    model = load_model(quant_path, ModelConfig.from_pretrained(quant_path), torch.float32, "cpu",
                       load_format="dummy")
    ids = prompt(6)
    outs = []
    for backend in ("torch", "triton"):
        set_backend(model, backend)
        (logits,), _ = PagedCache(model).forward([([1], 0, ids)])
        outs.append(logits)
    assert torch.isfinite(outs[0]).all() and 1e-3 < outs[0].std() < 1e3
    torch.testing.assert_close(outs[0], outs[1], **TOL)


def _edit(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_checkpoint_that_disagrees_with_its_config_is_refused(dense_path, tmp_path):
    int4 = int4_checkpoint(dense_path, tmp_path / "int4")
    cfg = ModelConfig.from_pretrained(int4)
    key = "model.layers.1.mlp.experts.3.up_proj.weight_shape"
    bad = _edit(int4, tmp_path / "shape", lambda t: t.__setitem__(key, torch.tensor([64, 64])))
    with pytest.raises(ConfigError, match="up_proj.weight_shape is \\[64, 64\\]"):
        load_model(bad, cfg, torch.float32, "cpu")
    key = "model.layers.1.self_attn.kv_b_proj.weight_scale_inv"
    fp8 = fp8_checkpoint(dense_path, tmp_path / "fp8", (8, 32))
    gone = _edit(fp8, tmp_path / "gone", lambda t: t.pop(key))
    with pytest.raises(ConfigError, match="kv_b_proj' is missing \\['weight_scale_inv'\\]"):
        load_model(gone, ModelConfig.from_pretrained(fp8), torch.float32, "cpu")


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "awq"}, "quantization 'awq' is not supported"),
    ({"format": "float-quantized"}, "format 'float-quantized' is not supported"),
    ({"w": {"symmetric": False}}, "asymmetric weights"),
    ({"w": {"num_bits": 8}}, "8-bit weights"),
    ({"w": {"actorder": "group"}}, "actorder 'group'"),
    ({"a": {"num_bits": 8, "type": "int"}}, "quantized activations"),
])
def test_unserved_quantization_is_refused_by_name(dense_path, tmp_path, change, message):
    path = int4_checkpoint(dense_path, tmp_path / "q")
    raw = json.loads((path / "config.json").read_text())
    qc = raw["quantization_config"]
    group = qc["config_groups"]["group_0"]
    group["weights"].update(change.pop("w", {}))
    group["input_activations"] = change.pop("a", None)
    qc.update(change)
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_pretrained(path)
