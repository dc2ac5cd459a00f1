"""Launch sweeps of the MLA decode attention (layers/triton_mla.py) on one GPU: one token of
one sequence over its latent cache (576 values a token, bf16, 16-token KV blocks scattered
over the cache), as a graph bucket launches it (max_seq_len = the bucket's), under split
sizes, key tiles and warps. Each timing is one CUDA graph of `copies` launches over as many
caches."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from functools import partial

import torch

from blockspec.bench.gpu_timing import graph_ms
from blockspec.layers.attention import AttentionMetadata
from blockspec.layers.triton_mla import TritonMLABackend

__all__ = ["MLA_GRID", "sweep_mla"]

RANK, ROPE, BLOCK = 512, 64, 16
# (fewest keys per split, key tile, warps); None: the backend's defaults
MLA_GRID = [None] + list(itertools.product((16, 32, 64), (16, 32), (4, 8)))


def _case(heads: int, ctx: int, copies: int, bucket_len: int, dev: torch.device):
    """q, one cache, and `copies` metadata of one sequence each over its own shuffled blocks."""
    blocks = -(-ctx // BLOCK)
    perm = torch.randperm(blocks * copies).tolist()
    cache = torch.randn(blocks * copies, BLOCK, 1, RANK + ROPE, device=dev, dtype=torch.bfloat16)
    metas = []
    for c in range(copies):
        table = perm[c * blocks:(c + 1) * blocks]
        meta = AttentionMetadata.build([1], [ctx], [table], [table[-1] * BLOCK], dev)
        metas.append(dataclasses.replace(meta, max_seq_len=max(bucket_len, ctx)))
    q = torch.randn(1, heads, RANK + ROPE, device=dev, dtype=torch.bfloat16)
    return q, cache, metas


def _attend_all(backend: TritonMLABackend, q, cache, metas) -> list:
    return [backend.attend(q, cache, cache, m, 0.1) for m in metas]


def sweep_mla(heads: int, contexts: tuple[int, ...], dev: torch.device, bucket_len: int = 2048,
              copies: int = 8, log: Callable[[str], None] = print) -> dict:
    """ms per launch (attention + split-KV merge) for each MLA_GRID entry at each context, and
    each output's max |diff| from the defaults'."""
    rows = []
    for ctx in contexts:
        q, cache, metas = _case(heads, ctx, copies, bucket_len, dev)
        ref = None
        for cfg in MLA_GRID:
            backend = TritonMLABackend() if cfg is None else TritonMLABackend(
                split_keys=cfg[0], block_n=cfg[1], num_warps=cfg[2])
            ms = graph_ms(partial(_attend_all, backend, q, cache, metas)) / copies
            out = backend.attend(q, cache, cache, metas[0], 0.1)[..., :RANK].float()
            ref = out if ref is None else ref
            rows.append({"heads": heads, "context": ctx, "config": cfg or "default", "ms": ms,
                         "max_abs_diff_default": (out - ref).abs().max().item()})
            log(f"MLA {heads} heads, ctx {ctx}, {cfg or 'default'}: {ms * 1e3:.1f} us")
    return {"bucket_len": bucket_len, "copies": copies, "rows": rows}
