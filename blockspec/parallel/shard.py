"""Slices a loaded model in place for one rank of a tensor/expert-parallel group.

Attention splits by heads (GQA: KV heads split, or replicated when there are fewer than ranks;
MLA: query heads split, the latent projection and cache whole on every rank), dense MLPs split
their intermediate size (gate/up by rows, down by columns), the embedding and LM head split the
vocabulary, and routed experts go to `expert_parallel_size` groups, each expert's intermediate
size split over the group's ranks. Each attention and MLP/MoE block then ends in one all-reduce.
loading.py slices each decoder layer as it is loaded; `shard_model` slices a whole model.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from blockspec.config import ConfigError, ModelConfig
from blockspec.layers.attention import PagedAttention
from blockspec.layers.linear import Linear
from blockspec.models.deepseek_moe import Experts, MoE
from blockspec.models.deepseek_v3 import MLAttention
from blockspec.models.quant_experts import Int4Experts
from blockspec.models.qwen3 import MLP, Attention
from blockspec.parallel.layers import (
    GroupExperts,
    GroupQuantExperts,
    ParallelLMHead,
    ReduceOutput,
    VocabParallelEmbedding,
)
from blockspec.parallel.state import ParallelState


def _part(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ConfigError(f"tensor parallelism: {what} ({n}) is not divisible by {parts}")
    return n // parts


def _rows(w: torch.Tensor, spans: list[tuple[int, int]], dim: int = 0) -> torch.Tensor:
    """The concatenation of `w`'s [start, end) spans along `dim`, as a tensor of its own (the
    whole one is then freed)."""
    return torch.cat([w.narrow(dim, a, b - a) for a, b in spans], dim=dim).contiguous()


def _set(lin: nn.Module, spans: list[tuple[int, int]], dim: int, keep_bias: bool) -> None:
    """`lin` (a Linear) keeps the spans of its output rows (dim 0) or input columns (dim 1);
    a column split keeps its bias on one rank (the all-reduce adds it once)."""
    if type(lin) is not Linear:
        raise ConfigError(f"tensor parallelism supports quantized routed experts only (int4, "
                          f"as Kimi K2.x ship), not a quantized {type(lin).__name__}")
    lin.weight = nn.Parameter(_rows(lin.weight.data, spans, dim), requires_grad=False)
    if lin.bias is not None:
        bias = _rows(lin.bias.data, spans) if dim == 0 else \
            lin.bias.data * float(keep_bias)
        lin.bias = nn.Parameter(bias, requires_grad=False)
    lin.out_features, lin.in_features = lin.weight.shape


def _head_spans(first: int, count: int, width: int, offset: int = 0) -> list[tuple[int, int]]:
    return [(offset + first * width, offset + (first + count) * width)]


def _shard_gqa(attn: Attention, ps: ParallelState) -> int:
    """Splits q heads over the ranks; KV heads too, or each rank keeps the one its q heads
    read when there are fewer KV heads than ranks. Returns the local KV heads."""
    n, r, d = ps.world_size, ps.rank, attn.head_dim
    h = _part(attn.num_heads, n, "attention heads")
    kv_heads = attn.num_kv_heads
    if kv_heads % n == 0:
        kv, kv_first = kv_heads // n, r * (kv_heads // n)
    elif n % kv_heads == 0:
        kv, kv_first = 1, r // (n // kv_heads)  # NOTE: replicated over n // kv_heads ranks
    else:
        raise ConfigError(f"tensor parallelism: {kv_heads} KV heads do not split over, nor "
                          f"replicate onto, {n} ranks")
    q_size = attn.q_size
    spans = _head_spans(r * h, h, d) + _head_spans(kv_first, kv, d, q_size) \
        + _head_spans(kv_first, kv, d, q_size + attn.kv_size)
    _set(attn.qkv_proj, spans, 0, True)
    _set(attn.o_proj, _head_spans(r * h, h, d), 1, r == 0)
    attn.num_heads, attn.num_kv_heads = h, kv
    attn.q_size, attn.kv_size = h * d, kv * d
    attn.attn = PagedAttention(h, kv, d, scale=attn.attn.scale)
    return kv


def _shard_mla(attn: MLAttention, ps: ParallelState) -> None:
    """Query heads split; kv_a_proj (the latent) whole on every rank."""
    mla, r = attn.mla, ps.rank
    h = _part(attn.num_heads, ps.world_size, "attention heads")
    q = attn.q_proj if mla.q_lora_rank is None else attn.q_b_proj
    _set(q, _head_spans(r * h, h, attn.qk_head_dim), 0, True)
    _set(attn.kv_b_proj, _head_spans(r * h, h, mla.qk_nope_head_dim + mla.v_head_dim), 0, True)
    _set(attn.o_proj, _head_spans(r * h, h, mla.v_head_dim), 1, r == 0)
    old = attn.attn
    attn.num_heads = h
    attn.attn = PagedAttention(h, 1, mla.latent_dim, old.scale)


def _shard_mlp(mlp: MLP, rank: int, parts: int) -> None:
    i = _part(mlp.intermediate_size, parts, "MLP intermediate size")
    full = mlp.intermediate_size
    _set(mlp.gate_up_proj, [(rank * i, (rank + 1) * i), (full + rank * i, full + (rank + 1) * i)],
         0, True)
    _set(mlp.down_proj, [(rank * i, (rank + 1) * i)], 1, rank == 0)
    mlp.intermediate_size = i


def _shard_experts(moe: MoE, ps: ParallelState) -> None:
    ex = moe.experts
    if isinstance(ex, Int4Experts):
        e = _part(ex.gate_up_proj_packed.shape[0], ps.expert_parallel_size, "routed experts")
        first = ps.expert_group * e
        local = ex.sliced(first, e, ps.expert_tp_rank, ps.expert_tp_size)
        moe.experts = GroupQuantExperts(local, first, e, moe.moe.num_experts)
        if moe.shared_experts is not None:
            _shard_mlp(moe.shared_experts, ps.rank, ps.world_size)
        return
    if type(ex) is not Experts:
        raise ConfigError(f"tensor/expert parallelism supports bf16 and int4 routed experts, "
                          f"not {type(ex).__name__}")
    e = _part(ex.gate_up_proj.shape[0], ps.expert_parallel_size, "routed experts")
    full = ex.down_proj.shape[2]
    i = _part(full, ps.expert_tp_size, "expert intermediate size")
    first, t = ps.expert_group * e, ps.expert_tp_rank
    gate_up = ex.gate_up_proj.data[first:first + e]
    gate_up = _rows(gate_up, [(t * i, (t + 1) * i), (full + t * i, full + (t + 1) * i)], 1)
    down = ex.down_proj.data[first:first + e, :, t * i:(t + 1) * i].contiguous()
    moe.experts = GroupExperts(gate_up, down, first, moe.moe.num_experts)
    if moe.shared_experts is not None:
        _shard_mlp(moe.shared_experts, ps.rank, ps.world_size)


def shard_vocab(model: nn.Module, vocab: int, ps: ParallelState, tied: bool) -> None:
    per = -(-vocab // ps.world_size)
    start = ps.rank * per
    emb = model.model.embed_tokens.weight.data
    w = torch.zeros(per, emb.shape[1], dtype=emb.dtype)
    w[:max(min(per, vocab - start), 0)] = emb[start:start + per]
    model.model.embed_tokens = VocabParallelEmbedding(w, start)
    head = Linear(emb.shape[1], per, bias=False, dtype=emb.dtype)
    if tied:
        head.weight = model.model.embed_tokens.weight
    else:
        lm = model.lm_head.weight.data
        head.weight.data.zero_()
        head.weight.data[:max(min(per, vocab - start), 0)] = lm[start:start + per]
    head.requires_grad_(False)
    model.lm_head = ParallelLMHead(head, vocab, start)


def shard_layer(layer: nn.Module, ps: ParallelState) -> int | None:
    """Slices one decoder layer for rank `ps.rank` and ends its attention and MLP blocks in an
    all-reduce; returns its local KV heads (None for MLA: the latent is whole)."""
    attn, local_kv = layer.self_attn, None
    if isinstance(attn, MLAttention):
        _shard_mla(attn, ps)
    else:
        local_kv = _shard_gqa(attn, ps)
    if isinstance(layer.mlp, MoE):
        _shard_experts(layer.mlp, ps)
    else:
        _shard_mlp(layer.mlp, ps.rank, ps.world_size)
    layer.self_attn, layer.mlp = ReduceOutput(attn), ReduceOutput(layer.mlp)
    return local_kv


def local_kv_config(mc: ModelConfig, local_kv: int | None) -> ModelConfig:
    """The model config as a rank's KV cache sees it (its local KV heads)."""
    if mc.mla is not None or local_kv is None:
        return mc
    return dataclasses.replace(mc, num_key_value_heads=local_kv)


def shard_model(model: nn.Module, mc: ModelConfig, ps: ParallelState) -> ModelConfig:
    """Slices `model` (loaded whole, on the host) for rank `ps.rank`; returns the model config
    as this rank's KV cache sees it."""
    local_kv = None
    for layer in model.model.layers:
        local_kv = shard_layer(layer, ps)
    shard_vocab(model, mc.vocab_size, ps, mc.tie_word_embeddings)
    return local_kv_config(mc, local_kv)

