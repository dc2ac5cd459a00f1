"""Tiny random HF checkpoints (config.json + safetensors + tokenizer), built offline.

Tests use them, and so does `blockspec generate` when no model is given (until the trained demo
pair ships). Weights come from HF transformers' own model classes, so these are genuine HF folders.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import torch

_CORPUS_MODULES = ("json", "textwrap", "string", "heapq", "bisect", "functools")


def corpus_text() -> str:
    """Some Python source that ships with every interpreter: enough for a small BPE."""
    import importlib

    return "\n".join(inspect.getsource(importlib.import_module(m)) for m in _CORPUS_MODULES)


def build_tokenizer(out: str | os.PathLike, vocab_size: int = 512) -> int:
    """Trains a byte-level BPE, saves it as an HF fast tokenizer, returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([corpus_text()], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(str(out))
    return tok.get_vocab_size()


def build_tiny_model(
    out: str | os.PathLike,
    arch: str = "qwen3",
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    init_std: float = 0.25,
    seed: int = 0,
    vocab_size: int = 512,
    rope_scaling: dict | None = None,
) -> Path:
    """Writes a random Qwen3ForCausalLM / LlamaForCausalLM folder. A large `init_std` makes the
    logits peaked, so greedy decoding has clear winners and comparisons are not decided by ties."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out, vocab_size)
    common = dict(
        vocab_size=vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings, initializer_range=init_std,
        eos_token_id=0, bos_token_id=None, pad_token_id=0,
    )
    if rope_scaling is not None:
        common["rope_scaling"] = rope_scaling
    if arch == "qwen3":
        cfg, cls = Qwen3Config(**common), Qwen3ForCausalLM
    elif arch == "llama":
        cfg, cls = LlamaConfig(**common), LlamaForCausalLM
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32)
    _perturb_norms(model)
    model.save_pretrained(str(out))
    return out


@torch.no_grad()
def _perturb_norms(model: torch.nn.Module) -> None:
    """RMSNorm weights init to 1; perturb them so the tests see them."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.add_(torch.randn_like(p) * 0.1)


def default_demo_model() -> Path:
    """A cached tiny random Qwen3 for running the CLI with no model at hand."""
    cache = Path(os.environ.get("BLOCKSPEC_CACHE", Path.home() / ".cache" / "blockspec"))
    path = cache / "tiny-random-qwen3"
    if not (path / "config.json").is_file():
        build_tiny_model(path)
    return path


def _deepseek_geometry(vocab: int, num_layers: int, q_lora_rank: int | None, n_group: int,
                       topk_group: int, first_k_dense_replace: int,
                       rms_norm_eps: float) -> dict:
    """A tiny DeepSeek-V2/V3 shape: MLA, 8 routed experts (top 2), one shared."""
    return dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32,
        q_lora_rank=q_lora_rank, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
        n_group=n_group, topk_group=topk_group, num_experts_per_tok=2,
        first_k_dense_replace=first_k_dense_replace, max_position_embeddings=1024,
        rms_norm_eps=rms_norm_eps, initializer_range=0.25, eos_token_id=0, bos_token_id=None,
        pad_token_id=0, tie_word_embeddings=False)


def build_tiny_deepseek_v3(out: str | os.PathLike, q_lora_rank: int | None = None,
                           n_group: int = 1, topk_group: int = 1,
                           first_k_dense_replace: int = 1, rope_scaling: dict | None = None,
                           num_layers: int = 3, seed: int = 0, vocab_size: int = 512,
                           rms_norm_eps: float = 1e-6) -> Path:
    """Writes a random DeepseekV3ForCausalLM folder (MLA + MoE: 8 routed experts, top 2, one
    shared) with transformers' own class, which saves the experts one by one as published
    DeepSeek-V3 / Kimi-K2 checkpoints do. Router correction biases are random, so selection and
    weighting differ."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out, vocab_size)
    cfg = DeepseekV3Config(
        **_deepseek_geometry(vocab, num_layers, q_lora_rank, n_group, topk_group,
                             first_k_dense_replace, rms_norm_eps), norm_topk_prob=True,
        **({"rope_scaling": rope_scaling} if rope_scaling is not None else {}))
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).to(torch.float32)
    _perturb_norms(model)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.5)
    model.save_pretrained(str(out))
    return out


def build_tiny_deepseek_v2(out: str | os.PathLike, topk_method: str = "greedy",
                           n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = False,
                           num_layers: int = 3, seed: int = 0) -> Path:
    """A random DeepseekV2ForCausalLM folder (softmax routing) by transformers' own class."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    cfg = DeepseekV2Config(**_deepseek_geometry(vocab, num_layers, None, n_group, topk_group, 1,
                                                1e-6),
                           topk_method=topk_method, norm_topk_prob=norm_topk_prob)
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(cfg).to(torch.float32)
    _perturb_norms(model)
    model.save_pretrained(str(out))
    return out
