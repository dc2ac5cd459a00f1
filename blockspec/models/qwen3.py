"""Qwen3 / Llama decoder (they differ only by Qwen3's per-head q/k RMSNorm).

Inputs are flat token batches (`[T]` ids and positions) with paged-attention metadata, so one
forward serves prefill chunks, decode and multi-token verify at once. q/k/v and gate/up are fused
into single matmuls; the loader splits HF's separate weights into them.
"""

from __future__ import annotations

import torch
from torch import nn

from blockspec.config import ModelConfig
from blockspec.layers.attention import AttentionMetadata, PagedAttention
from blockspec.layers.fused import fused_add_rms_norm, rms_norm
from blockspec.layers.gated_gemv import silu_gate_up
from blockspec.layers.linear import Linear
from blockspec.layers.norm import RMSNorm
from blockspec.layers.qk_norm_rope import qk_norm_rope_store
from blockspec.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   scale=self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        attn = self.attn
        # One fused pass: q/k norm, rotary, K/V into the paged cache; q comes back roped.
        q = qk_norm_rope_store(
            self.qkv_proj(x), positions, self.rotary.cos_cache, self.rotary.sin_cache,
            self.num_heads, self.num_kv_heads, self.head_dim,
            self.q_norm.weight if self.qk_norm else None,
            self.k_norm.weight if self.qk_norm else None,
            self.q_norm.eps if self.qk_norm else 0.0, attn.k_cache, attn.v_cache,
            meta.slot_mapping)
        out = attn(q, None, None, meta)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate_size,
                                   bias=cfg.mlp_bias)
        self.down_proj = Linear(self.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_gate_up(x, self.gate_up_proj))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, rotary)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    # NOTE: no forward here: DecoderModel runs the layers with the residual add fused into
    # each RMSNorm.


class DecoderModel(nn.Module):
    """The layers of `layer_cls(cfg, rotary, index)`; each has input_layernorm, self_attn,
    post_attention_layernorm and mlp."""

    def __init__(self, cfg: ModelConfig, layer_cls: type[nn.Module] = DecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # NOTE: one rotary table shared by all layers (it is a buffer, not a weight).
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.layers = nn.ModuleList(layer_cls(cfg, rotary, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden_layer_ids: tuple[int, ...] = (), taps_only: bool = False
                ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        h = self.embed_tokens(input_ids)
        # `taps_only`: the caller needs the taps alone, so the layers after the last tap are
        # skipped (its output exists right after layer `stop`'s input add).
        stop = max(hidden_layer_ids) + 1 if taps_only and hidden_layer_ids else len(self.layers)
        taps: dict[int, torch.Tensor] = {}
        residual = None
        # NOTE: the residual add is fused into the next RMSNorm, so the output of layer i - 1
        # (h + residual) only exists inside layer i, right after that add.
        for i, layer in enumerate(self.layers):
            norm = layer.input_layernorm
            if residual is None:
                x, residual = rms_norm(h, norm.weight, norm.eps), h
            else:
                x, residual = fused_add_rms_norm(h, residual, norm.weight, norm.eps)
            if i - 1 in hidden_layer_ids:
                taps[i - 1] = residual
            if i == stop:
                return None, [taps[j] for j in hidden_layer_ids]
            x = layer.self_attn(positions, x, meta)
            norm = layer.post_attention_layernorm
            x, residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
            h = layer.mlp(x)
        out, _ = fused_add_rms_norm(h, residual, self.norm.weight, self.norm.eps)
        # NOTE: HF's last hidden_states entry is after the final norm.
        taps[len(self.layers) - 1] = out
        return out, [taps[i] for i in hidden_layer_ids]


class CausalLM(nn.Module):
    """Qwen3ForCausalLM / LlamaForCausalLM with HF parameter names (after q/k/v, gate/up fusion)."""

    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden_layer_ids: tuple[int, ...] = (), taps_only: bool = False
                ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Returns the final-normed hidden states [T, H] and, for each id in `hidden_layer_ids`
        (in that order), the output of that decoder layer (HF `hidden_states[id + 1]`).
        `taps_only`: stop after the last tapped layer; the hidden states are then None unless that
        is the last layer (the lazy drafter-context catch-up needs the taps alone)."""
        return self.model(input_ids, positions, meta, hidden_layer_ids, taps_only)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """compute_logits(hidden).argmax(-1); a vocab-parallel head (parallel/layers.py) picks
        it without gathering the logits."""
        if hasattr(self.lm_head, "greedy"):
            return self.lm_head.greedy(hidden)
        return self.compute_logits(hidden).argmax(dim=-1)

    def shard_sizes(self, param: str) -> list[int]:
        """Rows of each checkpoint tensor packed into parameter `param` (a full name)."""
        cfg = self.config
        if param.split(".")[-2] == "qkv_proj":
            q = cfg.num_attention_heads * cfg.head_dim
            kv = cfg.num_key_value_heads * cfg.head_dim
            return [q, kv, kv]
        rows = self.get_parameter(param).shape[0]
        return [rows // 2, rows // 2]  # gate_up_proj
