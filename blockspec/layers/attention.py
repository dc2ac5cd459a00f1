"""Paged attention: metadata, the backend interface and the torch reference backend.

KV cache layout per layer: `[num_blocks, block_size, num_kv_heads, head_dim]`, addressed by a flat
slot = block_id * block_size + offset. Every backend serves any number of query tokens per sequence:
prefill chunks, single-token decode and multi-token verify are all "the last `q_len` tokens of a
sequence of `seq_len` tokens". Causal attention lets query i see keys up to
`seq_len - q_len + i`; non-causal (the DFlash drafter's block) sees all `seq_len` keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, where each new token's K/V is written
    cu_seqlens_q: torch.Tensor  # [B+1] int32, query tokens of sequence b: [cu[b], cu[b+1])
    seq_lens: torch.Tensor  # [B] int32, keys visible to sequence b (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    causal: bool = True
    # Per-token (sequence index, index within its query) for the padded torch reference path.
    token_seq_idx: torch.Tensor | None = None
    token_q_idx: torch.Tensor | None = None
    # Kernels walk every sequence's query tiles in turn (a grid from the token count) instead
    # of num_seqs x the longest query's: a graph's token bucket, many lanes, any query lengths.
    flat_grid: bool = False
    # > 0: queries of at most this many tokens (decodes, verify blocks) get a launch of their
    # own, tiled for that length, beside the largest tile's for the longer ones (prefill chunks).
    short_query_len: int = 0

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        device: torch.device | str,
        causal: bool = True,
    ) -> AttentionMetadata:
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)
        width = max((len(b) for b in block_tables), default=0) or 1
        tables = [b + [0] * (width - len(b)) for b in block_tables]
        seq_idx = [i for i, n in enumerate(query_lens) for _ in range(n)]
        q_idx = [j for n in query_lens for j in range(n)]

        def t(x: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

        return cls(
            slot_mapping=t(slot_mapping, torch.int64),
            cu_seqlens_q=t(cu, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            block_tables=t(tables, torch.int32),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            causal=causal,
            token_seq_idx=t(seq_idx, torch.int64),
            token_q_idx=t(q_idx, torch.int64),
        )


class AttentionBackend(Protocol):
    """What a paged attention implementation provides. Triton backends plug in here."""

    name: str

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


class TorchAttentionBackend:
    """Reference backend in plain PyTorch: gathers each sequence's blocks, pads, masks, SDPA."""

    name = "torch"

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        # NOTE: every slot must be valid (padded lanes point at the trash block): no host sync.
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def attend(self, q, k_cache, v_cache, meta, scale) -> torch.Tensor:
        num_seqs, max_q = meta.num_seqs, meta.max_query_len
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        # Gather only as many blocks as the longest sequence needs.
        num_blocks = -(-meta.max_seq_len // block_size)
        tables = meta.block_tables[:, :num_blocks].long()
        keys = k_cache[tables].reshape(num_seqs, -1, num_kv_heads, head_dim)
        values = v_cache[tables].reshape(num_seqs, -1, num_kv_heads, head_dim)
        max_kv = keys.shape[1]

        q_pad = q.new_zeros(num_seqs, max_q, q.shape[1], head_dim)
        q_pad[meta.token_seq_idx, meta.token_q_idx] = q

        seq_lens = meta.seq_lens.long()[:, None, None]
        q_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).long()[:, None, None]
        kv_pos = torch.arange(max_kv, device=q.device)[None, None, :]
        mask = kv_pos < seq_lens
        if meta.causal:
            q_pos = seq_lens - q_lens + torch.arange(max_q, device=q.device)[None, :, None]
            mask = mask & (kv_pos <= q_pos)
        # NOTE: padded query rows would be fully masked (NaN in SDPA); let them see key 0.
        mask = mask | (kv_pos == 0)

        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),
            keys.transpose(1, 2).to(q.dtype),
            values.transpose(1, 2).to(q.dtype),
            attn_mask=mask[:, None],
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)
        return out[meta.token_seq_idx, meta.token_q_idx]


_BACKENDS: dict[str, AttentionBackend] = {"torch": TorchAttentionBackend()}


def get_backend(name: str) -> AttentionBackend:
    if name == "triton" and name not in _BACKENDS:
        # NOTE: imported on first use so that blockspec itself does not need triton.
        from blockspec.layers.triton_attention import TritonAttentionBackend

        _BACKENDS[name] = TritonAttentionBackend()
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; have {sorted(_BACKENDS)}") from None


class PagedAttention(nn.Module):
    """Writes this layer's new K/V into its paged cache, then attends over the cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: str = "torch") -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = get_backend(backend)
        # Bound by the model runner once the cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def direct_cache(self) -> torch.Tensor | None:
        """The cache a fused op may write this step's K (= V) into itself, calling forward
        with k = v = None: k_cache where the backend attends over k_cache alone (an MLA latent
        bound as both caches), else None (forward's store_kv writes both)."""
        return self.k_cache if getattr(self.backend, "reads_k_cache_only", False) else None

    def partials(self, q: torch.Tensor, meta: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """forward(q, None, None, meta) without its split-KV merge, where the backend offers
        that for this step (TritonMLABackend.attend_partials: the caller merges), else None."""
        attend_partials = getattr(self.backend, "attend_partials", None)
        return None if attend_partials is None else attend_partials(q, self.k_cache, meta,
                                                                    self.scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] (None: already in the cache) -> [T, Hq, D]."""
        if k is not None:
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.backend.attend(q, self.k_cache, self.v_cache, meta, self.scale)


def bind_kv_cache(model: nn.Module, num_blocks: int, block_size: int,
                  geometry: tuple[int, int, int], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """One zeroed cache tensor [tensors, layers, num_blocks, block_size, heads, dim] for the
    model's PagedAttention layers, each bound to its slices. NOTE: an MLA layer's one latent
    cache is its K and its V cache (tensors == 1)."""
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    tensors, heads, dim = geometry
    cache = torch.zeros(tensors, len(layers), num_blocks, block_size, heads, dim, dtype=dtype,
                        device=device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[tensors - 1, i]
    return cache
