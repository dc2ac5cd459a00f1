"""DeepSeek-V3 / Kimi-K2 (and DeepSeek-V2) decoder: multi-head latent attention (MLA) and
mixture-of-experts MLPs (models/deepseek_moe.py).

MLA caches one latent per token and layer: the normed `kv_lora_rank` compression of the keys and
values and the roped `qk_rope_head_dim` key shared by all heads (576 values for DeepSeek-V3 and
Kimi-K2). Attention runs absorbed: each head's query no-rope part is mapped into the latent space
(q_nope @ W_UK), so every head attends over the same cached latents (one KV head, K = V = the
latent; the rope part of the value is dropped), and the output leaves the latent space through
W_UV. That serves prefill, decode and verify alike from the paged latent cache. Between the
projections and attention one fused op (layers/mla_fused.py) ropes and normalises into the
attention query's and the cache entry's columns; DeepSeek's interleaved rope rows are put in
rotate-half order at load (models/mla_rope_rows.py), where the checkpoint's format allows.
"""

from __future__ import annotations

import torch
from torch import nn

from blockspec.config import ModelConfig
from blockspec.layers.attention import AttentionMetadata, PagedAttention
from blockspec.layers.fused import rms_norm
from blockspec.layers.linear import Linear, linear
from blockspec.layers.mla_absorb import absorb
from blockspec.layers.mla_one_token import absorb_merge, absorb_rope_norm
from blockspec.layers.norm import RMSNorm
from blockspec.layers.rotary import RotaryEmbedding, yarn_mscale
from blockspec.models.deepseek_moe import Experts, MoE, TopkRouter  # noqa: F401 - re-exported
from blockspec.models.mla_rope_rows import permute_rope_rows, permutes_rope_at_load
from blockspec.models.qwen3 import MLP, CausalLM, DecoderModel

# NOTE: the latent norms' epsilon is DeepSeek's RMSNorm default, not config.rms_norm_eps (which
# only the decoder layers' norms read), in DeepSeek's model.py and HF transformers alike.
LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's rule)."""
    mla, rope = cfg.mla, cfg.rope
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        mla = cfg.mla
        self.num_heads, self.mla = cfg.num_attention_heads, mla
        self.qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        q_out = self.num_heads * self.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, mla.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, mla.kv_lora_rank + mla.qk_rope_head_dim,
                                         bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(mla.kv_lora_rank,
                                self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                bias=False)
        self.o_proj = Linear(self.num_heads * mla.v_head_dim, cfg.hidden_size,
                             bias=cfg.attention_bias)
        self.rotary = rotary
        # NOTE: set from the load plan, which the loader follows (models/mla_rope_rows.py):
        # rope rows already in rotate-half order skip the forward's de-interleave.
        self.rope_rows_permuted = permutes_rope_at_load(cfg)
        # NOTE: one latent "KV head"; the runner binds the same tensor as K and V cache.
        self.attn = PagedAttention(self.num_heads, 1, mla.latent_dim, mla_softmax_scale(cfg))
        self.input_weight: torch.Tensor | None = None  # fuse_input_projections'

    def _input_projections(self) -> tuple[nn.Module, nn.Module]:
        """The two projections of the layer's input: (q_proj or q_a_proj, kv_a_proj)."""
        q = self.q_proj if self.mla.q_lora_rank is None else self.q_a_proj
        return q, self.kv_a_proj_with_mqa

    def fuse_input_projections(self) -> bool:
        """Moves both input projections' weights into one tensor, each keeping its rows as a
        view, so the forward runs one GEMV (or GEMM) where it ran two, as vLLM's
        fused_qkv_a_proj does. Plain bias-free Linears of one dtype only (a quantized or biased
        one stays apart); returns whether it fused. Call it after loading and sharding: a
        weight replaced later (a view no more) takes the two projections again."""
        q, kv = self._input_projections()
        if type(q) is not Linear or type(kv) is not Linear or q.bias is not None \
                or kv.bias is not None or q.weight.dtype != kv.weight.dtype:
            return False
        fused = torch.cat([q.weight.detach(), kv.weight.detach()])
        q.weight = nn.Parameter(fused[:q.out_features], requires_grad=False)
        kv.weight = nn.Parameter(fused[q.out_features:], requires_grad=False)
        self.input_weight = fused
        return True

    def _project_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_proj(x) or q_a_proj(x), kv_a_proj(x)): one product where they are fused."""
        q, kv = self._input_projections()
        w = self.input_weight
        if w is not None and q.weight.data_ptr() == w.data_ptr() \
                and kv.weight.data_ptr() == w[q.out_features:].data_ptr():
            return linear(x, w, None, kv.backend).split([q.out_features, kv.out_features], 1)
        return q(x), kv(x)

    def _queries(self, q: torch.Tensor) -> torch.Tensor:
        """The query heads from q_proj's output (or q_a_proj's, under q_lora)."""
        if self.mla.q_lora_rank is not None:
            norm = self.q_a_layernorm
            q = self.q_b_proj(rms_norm(q, norm.weight, norm.eps))
        return q.view(-1, self.num_heads, self.qk_head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        mla, h, t = self.mla, self.num_heads, x.shape[0]
        nope, rank = mla.qk_nope_head_dim, mla.kv_lora_rank
        q, kv = self._project_input(x)
        q = self._queries(q)
        w_uk, w_uv = self.kv_b_proj.weight.view(h, -1, rank).split([nope, mla.v_head_dim], dim=1)
        # NOTE: the attention query [absorbed q_nope, roped q_pe] and the cache entry [normed
        # latent, roped k_pe] are written in place into their column slices (no concatenation).
        q_attn = x.new_empty(t, h, mla.latent_dim)
        entry = x.new_empty(t, 1, mla.latent_dim)
        # NOTE: the absorbs follow the linear backend (kv_b_proj's: "triton" on a GPU); with
        # the Triton MLA attention the fused op writes the entry into the cache itself (one
        # launch a layer fewer; else the attention's store_kv does), and at one token it runs in
        # the W_UK absorb's launch (layers/mla_one_token.py)
        norm, backend = self.kv_a_layernorm, self.kv_b_proj.backend
        stored = absorb_rope_norm(
            q[..., :nope], w_uk.transpose(1, 2), q_attn[..., :rank], backend, q_pe=q[..., nope:],
            kv=kv, positions=positions, cos_cache=self.rotary.cos_cache,
            sin_cache=self.rotary.sin_cache, norm_weight=norm.weight, eps=norm.eps,
            q_out=q_attn[..., rank:], entry=entry,
            interleaved=mla.rope_interleave and not self.rope_rows_permuted,
            cache=self.attn.direct_cache(), slot_mapping=meta.slot_mapping)
        o = x.new_empty(t, h, mla.v_head_dim)
        # NOTE: a one-token step's split-KV partials are merged by the W_UV absorb's programs
        partials = self.attn.partials(q_attn, meta) if stored and backend == "triton" else None
        if partials is not None:
            absorb_merge(*partials, w_uv, o)
        else:
            kv_in = None if stored else entry
            absorb(self.attn(q_attn, kv_in, kv_in, meta)[..., :rank], w_uv, o, backend)
        return self.o_proj(o.view(t, h * mla.v_head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, index: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg, rotary)
        self.mlp = MoE(cfg) if cfg.moe.is_moe_layer(index) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(CausalLM):
    """DeepseekV3ForCausalLM (also Kimi-K2's) with HF parameter names (after gate/up fusion)."""

    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    # NOTE: MLAttention reads kv_b_proj's weight itself (absorbed W_UK / W_UV): a quantized
    # checkpoint's kv_b_proj is dequantized at load.
    dense_weight_modules = ("kv_b_proj",)

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.model = DecoderModel(cfg, DecoderLayer)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope_rows_permuted = permutes_rope_at_load(cfg)  # the layers' plan, too
        # NOTE: a plain list (the layers own them): read after every engine step, not walked.
        self.moe_layers = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def prepare_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Checkpoint tensor `name` as the model stores it (the loader's hook): the rope rows of
        the q and kv_a projections in rotate-half order when the load plan reorders them."""
        if not self.rope_rows_permuted:
            return tensor
        return permute_rope_rows(self.config, name, tensor)

    def fuse_projections(self) -> int:
        """Fuses every layer's input projections (MLAttention.fuse_input_projections); the
        engine calls it once the weights are loaded and sharded. Returns the layers fused."""
        return sum(m.fuse_input_projections() for m in self.modules()
                   if isinstance(m, MLAttention))  # NOTE: wrapped under tensor parallelism

    def expert_counts(self) -> torch.Tensor:
        """[distinct routed experts selected, MoE layer forwards], summed over every MoE layer
        (distinct experts per layer per forward = the first over the second)."""
        if not self.moe_layers:  # every layer dense (first_k_dense_replace)
            return torch.zeros(2, dtype=torch.int64)
        return torch.stack([m.expert_counts for m in self.moe_layers]).sum(0)

    def reset_expert_counts(self) -> None:
        for m in self.moe_layers:
            m.expert_counts.zero_()
