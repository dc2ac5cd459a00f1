"""The DFlash drafter: Qwen3 layers whose K/V come from [target context features ; block states].

Context features are the target's hidden states at `target_layer_ids`, concatenated and fused by
`fc` + `hidden_norm`. In every layer the context K/V are `k_norm(k_proj(ctx))` (roped) and
`v_proj(ctx)`; they depend only on the fused features, so `write_context` computes them once per
committed token into the drafter's paged cache, at the same slots as the target's K/V. The block
(last committed token, then mask tokens) is embedded with the target's embedding and attends
non-causally to the cached context and to itself; the target's `lm_head` turns the block's final
states into draft tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from blockspec.dflash.config import DFlashConfig
from blockspec.layers.attention import AttentionMetadata, PagedAttention
from blockspec.layers.fused import fused_add_rms_norm, rms_norm
from blockspec.layers.linear import Linear, linear
from blockspec.layers.norm import RMSNorm
from blockspec.layers.qk_norm_rope import k_norm_rope_store, qk_norm_rope_store
from blockspec.layers.rotary import RotaryEmbedding
from blockspec.models.qwen3 import MLP, CausalLM


class DraftAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        g = cfg.geometry
        self.num_heads, self.num_kv_heads, self.head_dim = (
            g.num_attention_heads, g.num_key_value_heads, g.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(g.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=g.attention_bias)
        self.o_proj = Linear(self.q_size, g.hidden_size, bias=g.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, g.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, g.rms_norm_eps)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   scale=self.head_dim**-0.5)

    def write_context(self, ctx: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        """K/V of fused context features [T, H] at their absolute positions, into the cache."""
        w = self.qkv_proj.weight[self.q_size:]
        b = None if self.qkv_proj.bias is None else self.qkv_proj.bias[self.q_size:]
        kv = linear(ctx, w, b, self.qkv_proj.backend)
        k_norm_rope_store(kv, positions, self.rotary.cos_cache, self.rotary.sin_cache,
                          self.num_kv_heads, self.head_dim, self.k_norm.weight, self.k_norm.eps,
                          self.attn.k_cache, self.attn.v_cache, slot_mapping)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q = qk_norm_rope_store(
            self.qkv_proj(x), positions, self.rotary.cos_cache, self.rotary.sin_cache,
            self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm.weight,
            self.k_norm.weight, self.q_norm.eps, self.attn.k_cache, self.attn.v_cache,
            meta.slot_mapping)
        out = self.attn(q, None, None, meta)
        return self.o_proj(out.reshape(-1, self.q_size))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        g = cfg.geometry
        self.self_attn = DraftAttention(cfg, rotary)
        self.mlp = MLP(g)
        self.input_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)
    # NOTE: no forward: DFlashDrafter runs the layers with the residual add fused into each norm.


class DFlashDrafter(nn.Module):
    """Parameter names follow the published checkpoints (no `model.` prefix)."""

    packed_modules = CausalLM.packed_modules

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        g = cfg.geometry
        self.config = cfg
        rotary = RotaryEmbedding(g.head_dim, g.max_position_embeddings, g.rope)
        self.layers = nn.ModuleList(DraftLayer(cfg, rotary) for _ in range(g.num_hidden_layers))
        self.fc = Linear(len(cfg.target_layer_ids) * g.hidden_size, g.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.norm = RMSNorm(g.hidden_size, g.rms_norm_eps)

    def shard_sizes(self, param: str) -> list[int]:
        """Rows of each checkpoint tensor packed into parameter `param` (a full name)."""
        g = self.config.geometry
        if param.split(".")[-2] == "qkv_proj":
            kv = g.num_key_value_heads * g.head_dim
            return [g.num_attention_heads * g.head_dim, kv, kv]
        return [g.intermediate_size, g.intermediate_size]

    def fuse(self, taps: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """Target hidden states at target_layer_ids (config order), as a list of [T, H_target]
        or already concatenated [T, n_taps * H_target] -> context features [T, H]."""
        x = taps if isinstance(taps, torch.Tensor) else torch.cat(taps, dim=-1)
        return rms_norm(self.fc(x), self.hidden_norm.weight, self.hidden_norm.eps)

    def write_context(self, ctx: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        """Stores every layer's context K/V for committed tokens' features."""
        for layer in self.layers:
            layer.self_attn.write_context(ctx, positions, slot_mapping)

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Block states [T, H] (embedded tokens) -> final-normed states [T, H]. `meta` must be
        non-causal, with seq_len = context length + block length for each sequence."""
        h, residual = block_embeds, None
        for layer in self.layers:
            norm = layer.input_layernorm
            if residual is None:
                x, residual = rms_norm(h, norm.weight, norm.eps), h
            else:
                x, residual = fused_add_rms_norm(h, residual, norm.weight, norm.eps)
            x = layer.self_attn(positions, x, meta)
            norm = layer.post_attention_layernorm
            x, residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
            h = layer.mlp(x)
        return fused_add_rms_norm(h, residual, self.norm.weight, self.norm.eps)[0]
