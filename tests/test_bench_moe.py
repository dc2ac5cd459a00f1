"""The MoE benchmark's pieces on CPU (benchmarks/moe_bench.py runs them on a GPU): the shapes'
configs, the bytes accounting of a step's floor and the per-layer timing rows."""

from __future__ import annotations

import torch

from blockspec import LLM
from blockspec.bench.moe_shapes import (
    MOONLIGHT,
    expert_bytes,
    kimi_slice,
    layer_times,
    step_floor_bytes,
    write_moe_folders,
)
from blockspec.config import ModelConfig
from blockspec.dflash.config import DFlashConfig
from blockspec.tiny import build_tiny_deepseek_v3


def test_shapes_parse_as_the_published_geometry(tmp_path):
    target, drafter = write_moe_folders(tmp_path, "moonlight", MOONLIGHT, draft_layers=4)
    cfg = ModelConfig.from_pretrained(target)
    assert cfg.kv_cache_geometry == (1, 1, 576) and cfg.mla.q_lora_rank is None
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.n_shared_experts) \
        == (64, 6, 2)
    d = DFlashConfig.from_pretrained(drafter)
    assert d.block_size == 16 and d.geometry.num_hidden_layers == 4
    assert d.geometry.hidden_size == 2048 and max(d.target_layer_ids) < 27
    kimi = ModelConfig.from_dict(kimi_slice(3), "deepseek_v3")
    assert kimi.num_hidden_layers == 4 and kimi.mla.q_lora_rank == 1536
    assert kimi.moe.num_experts == 384 and kimi.moe.is_moe_layer(1)


def test_floor_bytes_and_layer_rows(tmp_path):
    path = build_tiny_deepseek_v3(tmp_path / "ds", num_layers=3)
    llm = LLM(str(path), device="cpu", num_kv_blocks=64)
    model, cfg = llm.engine.model, llm.engine.model_config
    parts = expert_bytes(model)
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if "embed_tokens" not in n)
    assert parts["moe_layers"] == 2
    assert parts["dense"] + parts["per_expert"] * cfg.moe.num_experts * 2 == total
    kv = 100 * cfg.num_hidden_layers * cfg.mla.latent_dim * 2
    assert step_floor_bytes(parts, 2, 100, cfg) == parts["dense"] + 4 * parts["per_expert"] + kv
    calls = []
    rows = layer_times(model, [1, 4], [1, 3], 40, lambda fn: (calls.append(fn()), 2.0)[1])
    assert [(r["batch"], r["tokens_per_seq"]) for r in rows] == [(1, 1), (1, 3), (4, 1), (4, 3)]
    assert rows[0]["experts_per_moe_layer"] == cfg.moe.num_experts_per_tok  # one token: top k
    assert all(2 <= r["experts_per_moe_layer"] <= 8 for r in rows)
    assert rows[-1]["experts_per_moe_layer"] > rows[0]["experts_per_moe_layer"]
    hidden, taps = calls[1]  # the dense prefix: stops after layer 0, its output tapped
    assert hidden is None and taps[0].shape == (1, cfg.hidden_size)
    assert torch.isfinite(calls[0][0]).all()


def test_int4_kimi_slice_bytes_and_kernel_rows(tmp_path):
    """The INT4 Kimi-layout slice the GPU benchmark builds (tiny here): its quantized experts
    count as expert bytes at half a byte per weight (+ scales), and the kernel rows come out."""
    from blockspec.bench.moe_shapes import KIMI_INT4, expert_kernel_times

    shape = {**kimi_slice(1), "hidden_size": 64, "intermediate_size": 128,
             "moe_intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
             "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
             "v_head_dim": 8, "n_routed_experts": 16, "vocab_size": 512,
             "quantization_config": KIMI_INT4}
    target, _ = write_moe_folders(tmp_path, "int4", shape)
    llm = LLM(str(target), device="cpu", dtype="bfloat16", load_format="dummy", num_kv_blocks=8)
    parts = expert_bytes(llm.engine.model)
    weights = 3 * 64 * 64  # gate, up, down of one expert
    assert parts["per_expert"] == weights // 2 + (weights // 32) * 2  # int4 + bf16 scales
    rows = expert_kernel_times(llm.engine.model, [1, 4], lambda fn: (fn(), 1.0)[1])
    assert [r["tokens"] for r in rows] == [1, 4] and rows[0]["experts"] == 8
