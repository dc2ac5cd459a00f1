"""MoE target shapes for GPU benchmarks (issue 21): Moonlight-16B-A3B (Moonshot's DeepSeek-V3-
architecture model) with a 4-layer DFlash drafter, and a Kimi-K2.6-width slice that fits one GPU;
written as HF folders whose weights `load_format=dummy` fills at random. Plus the bytes a step
of a MoE target must read (its floor) and per-layer forward timings of a slice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from blockspec.config import ModelConfig
from blockspec.dflash.checkpoint import new_drafter_config
from blockspec.layers.attention import AttentionMetadata
from blockspec.tiny import build_tokenizer

__all__ = ["KIMI_DRAFTER", "KIMI_INT4", "KIMI_MASK_TOKEN", "MOONLIGHT", "distinct_experts",
           "expert_bytes", "kimi_k26", "kimi_slice", "layer_times", "step_floor_bytes",
           "write_moe_folders"]

_DEEPSEEK = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                 hidden_act="silu", topk_method="noaux_tc", scoring_func="sigmoid",
                 norm_topk_prob=True, moe_layer_freq=1, n_group=1, topk_group=1,
                 attention_bias=False, tie_word_embeddings=False, dtype="bfloat16",
                 qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512,
                 vocab_size=163840, rope_theta=50000.0, bos_token_id=163584,
                 eos_token_id=163585)
MOONLIGHT: dict[str, Any] = dict(
    _DEEPSEEK, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
    n_routed_experts=64, num_experts_per_tok=6, routed_scaling_factor=2.446, q_lora_rank=None,
    first_k_dense_replace=1, max_position_embeddings=8192, rms_norm_eps=1e-5)
KIMI_MASK_TOKEN = 163838  # Kimi K2.6's published drafter's mask token (DESIGN.md)
# Kimi K2.6's quantization_config: compressed-tensors W4A16 (int4, group 32, symmetric) on the
# routed experts only.
KIMI_INT4: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                  "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                              "strategy": "group", "group_size": 32,
                                              "dynamic": False, "actorder": None}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}


def kimi_slice(num_moe_layers: int) -> dict[str, Any]:
    """Kimi K2.6's text model at full width (MLA 1536 / 512 / 128 + 64 / 128, 384 experts of
    2048, top 8, one shared) with its one dense layer and `num_moe_layers` MoE layers."""
    return dict(_DEEPSEEK, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                num_hidden_layers=1 + num_moe_layers, num_attention_heads=64,
                num_key_value_heads=64, n_shared_experts=1, n_routed_experts=384,
                num_experts_per_tok=8, routed_scaling_factor=2.827, q_lora_rank=1536,
                first_k_dense_replace=1, max_position_embeddings=8192, rms_norm_eps=1e-5)


# Kimi K2.6's published DFlash drafter (DESIGN.md): 6 layers, block 8, these target layers.
KIMI_DRAFTER: dict[str, Any] = dict(draft_layers=6, block_size=8,
                                    target_layer_ids=[1, 12, 24, 35, 47, 58])


def kimi_k26() -> dict[str, Any]:
    """Kimi K2.6's whole text model (61 layers, the first dense) with INT4 routed experts."""
    return {**kimi_slice(60), "quantization_config": KIMI_INT4}


def distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Experts `tokens` tokens select in one layer under uniform routing: E(1 - (1 - k/E)^T)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def write_moe_folders(root: Path, name: str, shape: dict[str, Any], draft_layers: int = 0,
                      block_size: int = 16, target_layer_ids: list[int] | None = None
                      ) -> tuple[Path, Path | None]:
    """(target, drafter or None) folders under `root`: config.json and a tokenizer (only for
    the engine's tokenizer slot: prompts are token ids), no weights. `target_layer_ids`: the
    drafter's (default: spread over the target, the published recipe)."""
    target = root / name
    target.mkdir(parents=True, exist_ok=True)
    build_tokenizer(target)
    (target / "config.json").write_text(json.dumps(shape))
    if not draft_layers:
        return target, None
    drafter = root / f"{name}-dflash-b{block_size}"
    drafter.mkdir(parents=True, exist_ok=True)
    build_tokenizer(drafter)
    cfg = new_drafter_config(ModelConfig.from_dict(shape, "deepseek_v3"), draft_layers,
                             block_size, KIMI_MASK_TOKEN, target_layer_ids)
    (drafter / "config.json").write_text(json.dumps(cfg.to_dict()))
    return target, drafter


def expert_bytes(model: torch.nn.Module) -> dict[str, int]:
    """A MoE target's bytes by kind: `dense` (every weight a step reads whatever it routes:
    attention, dense and shared MLPs, routers, norms, lm_head; not the embedding table, which a
    step gathers a row of), `per_expert` (one routed expert of one layer), `moe_layers`."""
    dense = routed = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        if ".experts." in name:
            routed += p.numel() * p.element_size()
        else:
            dense += p.numel() * p.element_size()
    layers = model.moe_layers
    per_expert = routed // (len(layers) * layers[0].moe.num_experts) if layers else 0
    return {"dense": dense, "per_expert": per_expert, "moe_layers": len(layers)}


def step_floor_bytes(parts: dict[str, int], experts_per_layer: float, kv_tokens: int,
                     cfg: ModelConfig, extra: int = 0) -> float:
    """Bytes a step must read: the dense weights, the distinct experts its tokens select in each
    MoE layer, the latent KV cache of `kv_tokens` cached tokens (bf16) and `extra` (a drafter's
    weights)."""
    _, _, dim = cfg.kv_cache_geometry
    kv = kv_tokens * cfg.num_hidden_layers * dim * 2
    return parts["dense"] + experts_per_layer * parts["per_expert"] * parts["moe_layers"] \
        + kv + extra


def _forward_fn(model, n: int, q: int, context: int, stop_after: int | None):
    """A closure running the target forward for `n` sequences of `q` new tokens at `context`
    keys each (sharing one block table: the cache is only read), for graph timing."""
    dev = next(model.parameters()).device
    block = 16
    table = list(range(-(-context // block)))
    meta = AttentionMetadata.build([q] * n, [context] * n, [table] * n,
                                   [table[-1] * block] * (n * q), dev)
    ids = torch.randint(0, model.config.vocab_size, (n * q,), device=dev)
    pos = torch.arange(context - q, context, device=dev).repeat(n)
    taps = (stop_after,) if stop_after is not None else ()
    return lambda: model(ids, pos, meta, taps, stop_after is not None)


def layer_times(model, batches: list[int], block_lens: list[int], context: int,
                graph_ms) -> list[dict[str, Any]]:
    """Per (batch, tokens per sequence): the whole forward's time (CUDA graph replay), the dense
    prefix's (embedding + the first_k_dense_replace layers), the mean MoE layer's
    ((whole - prefix) / MoE layers) and the distinct experts a MoE layer's forward selected."""
    k_dense = model.config.moe.first_k_dense_replace
    n_moe = len(model.moe_layers)
    rows = []
    for n in batches:
        for q in block_lens:
            whole = _forward_fn(model, n, q, context, None)
            model.reset_expert_counts()
            whole()
            selected, forwards = model.expert_counts().tolist()
            t_all = graph_ms(whole)
            t_pre = graph_ms(_forward_fn(model, n, q, context, k_dense - 1))
            rows.append({"batch": n, "tokens_per_seq": q, "context": context,
                         "forward_ms": t_all, "dense_prefix_ms": t_pre,
                         "moe_layer_ms": (t_all - t_pre) / n_moe,
                         "experts_per_moe_layer": selected / max(forwards, 1)})
    return rows


def random_routing(tokens: int, hidden: int, num_experts: int, top_k: int, device,
                   generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(x bf16 [tokens, hidden], weights bf16 / ids [tokens, top_k], distinct experts picked)
    from random router logits: the inputs of a routed-experts timing."""
    from blockspec.layers.moe import select_experts

    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=generator)
    w, ids = select_experts(torch.randn(tokens, num_experts, device=device, generator=generator),
                            None, top_k, 1, 1, True, 1.0)
    return x, w.to(x.dtype), ids, ids.unique().numel()


def expert_kernel_times(model, tokens: list[int], graph_ms, reference=None) -> list[dict]:
    """One MoE layer's routed experts at `tokens` tokens (random routing): the grouped GEMMs'
    time (CUDA graph replay), the distinct experts read and their bytes per second; with
    `reference` ((gate_up, down) bf16 tensors of the same shape), the bf16 kernels' time too."""
    from blockspec.layers.fused_moe import fused_experts

    moe = model.moe_layers[0]
    cfg = moe.moe
    dev = next(model.parameters()).device
    per_expert = sum(p.numel() * p.element_size() for p in moe.experts.parameters()) \
        // cfg.num_experts
    rows = []
    for t in tokens:
        x, w, ids, distinct = random_routing(t, model.config.hidden_size, cfg.num_experts,
                                             cfg.num_experts_per_tok, dev)
        ms = graph_ms(lambda x=x, w=w, ids=ids: moe.experts(x, w, ids, moe.experts_backend,
                                                              moe.expert_counts))
        row = {"tokens": t, "experts": distinct, "ms": ms,
               "GBps": distinct * per_expert / (ms * 1e-3) / 1e9}
        if reference is not None:
            row["bf16_ms"] = graph_ms(lambda x=x, w=w, ids=ids: fused_experts(x, w, ids,
                                                                              *reference))
        rows.append(row)
    return rows
