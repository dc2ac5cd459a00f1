"""`blockspec inspect`: the published Kimi K2.6 + DFlash drafter and DeepSeek-V3 configs
(tests/fixtures, no weights) against sizes worked out by hand below, and tiny quantized
folders whose safetensors headers must hold exactly the bytes the config implies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kimi_layout import kimi_k26_folder
from quant_models import fp8_checkpoint, int4_checkpoint

from blockspec.cli import main
from blockspec.sizing.plan import inspect_model
from blockspec.sizing.tensors import model_tensors
from blockspec.tiny import build_tiny_deepseek_v3

FIXTURES = Path(__file__).parent / "fixtures"
KIMI, DRAFT, DSV3 = (str(FIXTURES / n) for n in ("kimi_k2.6", "kimi_k2.6_dflash",
                                                 "deepseek_v3"))
GiB = 1 << 30


def inspect_json(capsys, *args: str) -> dict:
    assert main(["inspect", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def kimi_by_hand() -> dict[str, int]:
    """Kimi K2.6 from its published geometry: MLA q_lora 1536 / kv_lora 512 / rope 64 / nope
    128 / v 128 over 64 heads, 1 dense layer of 18432, 60 MoE layers of 384 experts of 2048
    (INT4: half a byte per value plus a bf16 scale per 32, and a 16-byte weight_shape), 1
    shared expert, vocab 163840, hidden 7168."""
    h, v = 7168, 163840
    attn = (h * 1536 + 1536 + 1536 * 64 * 192 + h * 576 + 512 + 512 * 64 * 256 + 64 * 128 * h
            + 2 * h)
    expert = 3 * h * 2048
    moe_dense = 3 * h * 2048 + 384 * h + 384  # shared expert, router weight and bias
    dense = 61 * attn + 3 * h * 18432 + 60 * moe_dense + 2 * v * h + h
    experts = 60 * 384 * expert
    return {"total": dense + experts, "active": dense + 60 * 8 * expert,
            "bytes": 2 * dense + experts // 2 + experts // 32 * 2 + 60 * 384 * 3 * 16}


def test_kimi_k26_with_its_drafter(capsys):
    out = inspect_json(capsys, KIMI, "--draft", DRAFT, "-tp", "8", "-ep", "8")
    m, d, plan = out["model"], out["draft"], out["plan"]
    want = kimi_by_hand()
    assert (m["params_total"], m["params_active"]) == (want["total"], want["active"])
    assert 1.02e12 < m["params_total"] < 1.04e12 and 32e9 < m["params_active"] < 34e9
    assert m["weights_bytes"] == want["bytes"] and m["weights_source"] == "config"
    assert m["quantization"].startswith("compressed-tensors pack-quantized W4A16 (int4, "
                                        "group 32, symmetric): 69,120 of ")
    assert "(routed experts); 16-bit: attention, dense MLPs, lm_head, shared" in m["quantization"]
    assert m["kv_bytes_per_token"] == 61 * 576 * 2 == 70272  # the latent, bf16
    assert (d["block_size"], d["layers"], d["mask_token_id"]) == (8, 6, 163838)
    assert d["target_layer_ids"] == [1, 12, 24, 35, 47, 58] and d["pairs"]
    assert d["kv_bytes_per_token"] == 6 * 2 * 8 * 128 * 2
    # TP 8: the latent cache whole on every GPU, the drafter's 8 KV heads one per GPU
    assert plan["kv_bytes_per_token_per_gpu"] == 70272 + 6 * 2 * 128 * 2
    assert 65 * GiB < plan["weights_bytes_per_gpu"] < 80 * GiB
    assert plan["fits"] and not plan["problems"] and plan["max_model_len"] == 262144
    assert plan["left_bytes"] == int(141 * GiB * 0.9) - plan["weights_bytes_per_gpu"] - GiB


def test_one_gpu_does_not_hold_kimi_and_the_text_says_what_would(capsys):
    plan = inspect_json(capsys, KIMI, "--max-model-len", "8192")["plan"]
    assert not plan["fits"] and plan["min_tp"] == 8 and plan["left_bytes"] < 0
    assert main(["inspect", KIMI, "--draft", DRAFT]) == 0
    text = capsys.readouterr().out
    assert "does NOT fit one 262,144-token context; TP 8 would" in text
    assert "pairs         yes" in text and "1.03T total, 32.9B activated" in text


@pytest.mark.parametrize("tp, ep, problem", [
    (8, 3, "EP (3) must divide TP (8)"),
    (3, 1, "64 attention heads do not split over TP 3"),
    (64, 1, "an expert's slice of 32 columns"),  # 2048 / 64 = 32 int4 values: one group; ok
    (128, 1, "an expert's slice of 16 columns is not whole quantization groups of 32"),
])
def test_layouts_that_cannot_split_the_model_say_why(capsys, tp, ep, problem):
    plan = inspect_json(capsys, KIMI, "-tp", str(tp), "-ep", str(ep))["plan"]
    if tp == 64:
        assert not any(problem in p for p in plan["problems"])
    else:
        assert any(problem in p for p in plan["problems"]) and not plan["fits"]


def test_deepseek_v3_fp8_and_a_drafter_that_does_not_pair(capsys):
    out = inspect_json(capsys, DSV3, "--draft", DRAFT, "-tp", "8", "--max-model-len", "32768")
    m, d = out["model"], out["draft"]
    assert 670e9 < m["params_total"] < 672e9 and 37e9 < m["params_active"] < 38e9
    assert m["quantization"].startswith("fp8 e4m3 block-quantized [128, 128]")
    assert "16-bit: lm_head" in m["quantization"]
    assert not d["pairs"] and "vocab_size 163840 != target vocab_size 129280" in \
        d["pair_problem"]


@pytest.mark.parametrize("kind", ["int4", "fp8"])
def test_headers_hold_the_bytes_the_config_implies(kind, tmp_path):
    """The config-only sizes are exactly what compressed-tensors' compressor and DeepSeek's FP8
    layout store (fp32 here: scales and dense weights 4 bytes)."""
    dense = build_tiny_deepseek_v3(tmp_path / "dense", q_lora_rank=32, seed=1)
    path = int4_checkpoint(dense, tmp_path / "q") if kind == "int4" else \
        fp8_checkpoint(dense, tmp_path / "q", (8, 32))
    report = inspect_model(str(path), "float32")
    assert report.weights_source == "1 safetensors header"
    assert sorted((t.name, t.nbytes) for t in report.tensors) == \
        sorted((t.name, t.nbytes) for t in model_tensors(report.config, 4))


def test_kimi_layout_folder_reads_headers_and_names_the_mask(capsys, tmp_path, monkeypatch):
    from blockspec.dflash.checkpoint import build_random_drafter

    dense = build_tiny_deepseek_v3(tmp_path / "dense", seed=2)
    kimi = kimi_k26_folder(dense, tmp_path)
    drafter = build_random_drafter(tmp_path / "drafter", kimi, block_size=8,
                                   mask_token_id=510)

    def no_weights(*a, **k):
        raise AssertionError("inspect read a weight")

    monkeypatch.setattr("safetensors.safe_open", no_weights)
    monkeypatch.setattr("blockspec.models.loader.load_weights", no_weights)
    out = inspect_json(capsys, str(kimi), "--draft", str(drafter))
    assert out["model"]["skipped_bytes"]["outside"] == (8 * 3 * 2 * 2 + 64 * 32) * 4
    assert out["draft"]["mask_token"] == "[MASK]" and out["draft"]["pairs"]
