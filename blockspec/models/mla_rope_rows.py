"""MLA's rope rows, reordered at load so the forward needs no de-interleave.

DeepSeek-V3 / Kimi-K2 checkpoints (`rope_interleave`) pair their rope dims (0, 1), (2, 3), ...
while the rotary kernels rotate halves. Taking each head's rope rows of the query projection
(q_proj, or q_b_proj under q_lora) and the rope rows of kv_a_proj_with_mqa in the order evens
then odds makes the projections emit the rotate-half layout directly. q and k are reordered
alike, so their dot products (the attention scores) are unchanged.
"""

from __future__ import annotations

import re

import torch

from blockspec.config import ModelConfig
from blockspec.quant_config import FP8

# The checkpoint tensors of one layer's projections that carry rope rows, per output row.
# NOTE: an fp8 `weight_scale_inv` has one row per block of rows and is left as it is, which is
# only right while each head's rope rows stay inside one block (`permutes_rope_at_load`).
_ROPE_TENSOR = re.compile(r"^(?:.*\.)?layers\.\d+\.self_attn\.(q_proj|q_b_proj|kv_a_proj_with_mqa)"
                          r"\.(weight|weight_packed|weight_scale|bias)$")


def rope_row_spans(cfg: ModelConfig) -> dict[str, list[tuple[int, int]]]:
    """[start, end) output rows of the rope dims in each projection of a whole checkpoint."""
    mla, heads = cfg.mla, cfg.num_attention_heads
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    q = [(h * qk + mla.qk_nope_head_dim, (h + 1) * qk) for h in range(heads)]
    kv = [(mla.kv_lora_rank, mla.kv_lora_rank + mla.qk_rope_head_dim)]
    return {"q_proj": q, "q_b_proj": q, "kv_a_proj_with_mqa": kv}


def permutes_rope_at_load(cfg: ModelConfig) -> bool:
    """Whether the loader reorders the rope rows (and the forward skips the de-interleave).
    Block-scaled FP8 rows share a scale per block of `block[0]` rows, so the reorder is safe
    only if no head's rope rows straddle two blocks; otherwise the forward de-interleaves."""
    if cfg.mla is None or not cfg.mla.rope_interleave:
        return False
    if cfg.quant is None or cfg.quant.method != FP8:
        return True  # dense rows, or int4 ones (packed and scaled along the input dim)
    bn = cfg.quant.block[0]
    return all(a // bn == (b - 1) // bn
               for spans in rope_row_spans(cfg).values() for a, b in spans)


def rope_row_order(rows: int, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Source row of each output row: within each span evens first, then odds."""
    order = torch.arange(rows)
    for a, b in spans:
        order[a:b] = torch.cat([torch.arange(a, b, 2), torch.arange(a + 1, b, 2)])
    return order


def permute_rope_rows(cfg: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Checkpoint tensor `name` with its rope rows reordered, if it has any (else as given).
    NOTE: applied to whole checkpoint tensors, before tensor parallelism splits the heads: the
    reorder stays within each head, so it commutes with that split."""
    m = _ROPE_TENSOR.match(name)
    if m is None:
        return tensor
    spans = rope_row_spans(cfg)[m.group(1)]
    rows = spans[-1][1] if m.group(1) != "kv_a_proj_with_mqa" else cfg.mla.latent_dim
    if tensor.dim() == 0 or tensor.shape[0] != rows:
        return tensor  # a wrong shape: the copy reports it
    order = rope_row_order(rows, spans)
    if tensor.element_size() == 1:  # NOTE: e4m3 has no index kernels; its bytes move alike
        return tensor.view(torch.uint8).index_select(0, order).view(tensor.dtype)
    return tensor.index_select(0, order)
