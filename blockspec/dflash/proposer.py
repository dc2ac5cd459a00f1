"""DFlash proposer: owns the drafter and its paged KV pool, drafts blocks for decoding sequences.

NOTE: the drafter's KV pool shares block ids and slots with the target's, so one block manager
(with its prefix cache and free rollback) serves both. Slot p of the drafter's pool holds the
context K/V of committed token p; while drafting, the block's own K/V occupy the slots past the
committed tokens and are overwritten when the verified tokens' features are written.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from blockspec.config import ConfigError, ModelConfig
from blockspec.dflash.config import DFlashConfig
from blockspec.dflash.dflash import DFlashDrafter
from blockspec.layers.attention import AttentionMetadata, PagedAttention
from blockspec.models.loader import init_dummy_weights, load_weights
from blockspec.models.qwen3 import CausalLM


def load_drafter(path: str, target_cfg: ModelConfig, max_model_len: int, dtype: torch.dtype,
                 device: torch.device, load_format: str = "auto") -> DFlashDrafter:
    cfg = DFlashConfig.from_pretrained(path)
    cfg.validate_pair(target_cfg)
    # NOTE: the drafter's rotary table must cover every position the target can reach.
    g = cfg.geometry
    cfg.geometry = replace(g, max_position_embeddings=max(g.max_position_embeddings,
                                                          max_model_len))
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            drafter = DFlashDrafter(cfg)
    finally:
        torch.set_default_dtype(prev)
    drafter.eval().requires_grad_(False)
    if load_format == "dummy":
        init_dummy_weights(drafter, seed=1)
    else:
        load_weights(drafter, path, ignore_prefixes=("embed_tokens.", "lm_head.", "model."))
    return drafter


class DFlashProposer:
    def __init__(self, drafter: DFlashDrafter, target: CausalLM, block_size: int,
                 num_blocks: int, kv_block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        cfg = drafter.config
        if not 2 <= block_size <= cfg.block_size:
            raise ConfigError(f"block size {block_size} must be in [2, {cfg.block_size}] "
                              f"(the drafter was trained with block_size {cfg.block_size})")
        self.drafter = drafter
        self.target = target
        self.block_size = block_size
        self.mask_token_id = cfg.mask_token_id
        self.target_layer_ids = tuple(cfg.target_layer_ids)
        self.device = device
        layers = [m for m in drafter.modules() if isinstance(m, PagedAttention)]
        g = cfg.geometry
        self.kv_cache = torch.zeros(2, len(layers), num_blocks, kv_block_size,
                                    g.num_key_value_heads, g.head_dim, dtype=dtype, device=device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def write_context(self, taps: list[torch.Tensor] | torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        """Fuse the target's tapped hidden states (a list, or concatenated [T, n_taps * H]) and
        store the drafter's context K/V."""
        self.drafter.write_context(self.drafter.fuse(taps), positions, slot_mapping)

    def draft(self, block_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              rows: torch.Tensor | None = None, q: int = 0) -> torch.Tensor:
        """The one drafting pass of every step, eager or graphed: the drafter over DFlash
        blocks (`block_ids`: each block's last committed token, then mask tokens; `meta`
        non-causal), then the target's LM head's greedy pick at the rows that predict drafts:
        `rows` (flat indices), or rows 1..q-1 of every block when all have `q` tokens.
        Returns [rows] int64 token ids."""
        hidden = self.drafter(self.target.model.embed_tokens(block_ids), positions, meta)
        if rows is None:
            # NOTE: a contiguous 2-D input: a strided 3-D one makes cuBLAS run one batched GEMM
            # per sequence, re-reading the whole lm_head each time (measured: 9.5 ms at C=32).
            hidden = hidden.view(-1, q, hidden.shape[-1])[:, 1:].reshape(-1, hidden.shape[-1])
        else:
            hidden = hidden[rows]
        return self.target.greedy_tokens(hidden)

    def propose(self, last_tokens: list[int], block_lens: list[int], context_lens: list[int],
                block_tables: list[list[int]], slots: list[list[int]],
                width: int | None = None) -> torch.Tensor:
        """Drafts `block_lens[i] - 1` tokens after each sequence's last committed token.

        Sequence i's block sits at positions [context_lens[i], context_lens[i] + block_lens[i]),
        writing its K/V to `slots[i]`; a block shorter than the max is the same drafter pass on
        [last, mask * (block_lens[i] - 1)]. Returns [S, width - 1] int64 (default width: the max
        block), padded with -1.
        """
        ids, positions, flat_slots = [], [], []
        for tok, b, ctx, s in zip(last_tokens, block_lens, context_lens, slots):
            ids += [tok] + [self.mask_token_id] * (b - 1)
            positions += range(ctx, ctx + b)
            flat_slots += s
        meta = AttentionMetadata.build(
            block_lens, [c + b for c, b in zip(context_lens, block_lens)], block_tables,
            flat_slots, self.device, causal=False)
        dev = self.device
        # Rows 1..b-1 of each block predict the draft tokens; pad to a fixed width.
        width = (width or self.block_size) - 1
        if max(block_lens) - 1 > width:
            raise ValueError(f"blocks {block_lens} do not fit in width {width + 1}")
        rows, valid = [], []
        start = 0
        for b in block_lens:
            rows += [start + 1 + j if j < b - 1 else start for j in range(width)]
            valid += [j < b - 1 for j in range(width)]
            start += b
        drafts = self.draft(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
                            meta, rows=torch.tensor(rows, device=dev))
        drafts = drafts.view(len(block_lens), width)
        return drafts.masked_fill(~torch.tensor(valid, device=dev).view_as(drafts), -1)
