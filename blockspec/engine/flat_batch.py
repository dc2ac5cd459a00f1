"""The flat token batch of a mixed step: prefill chunks, decodes and verify blocks of any length
in one `[T]` row of tokens, with the metadata attention reads (vLLM's names). Built with numpy
over whole arrays (a Python loop runs per sequence, never per token): at a few hundred sequences
the batch is host time on every mixed step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from blockspec.engine.kv_cache import BlockManager, concat_ranges, padded_block_tables
from blockspec.engine.sequence import Sequence
from blockspec.layers.attention import AttentionMetadata


def _empty(dtype: type = np.int64) -> np.ndarray:
    return np.zeros(0, dtype=dtype)


@dataclass
class FlatBatch:
    """One step's host arrays; `tensors` makes the tensors the forward reads.

    A sequence with a block (blens[i] >= 1) feeds its last committed token and the drafts after
    it (`draft_dst` <- `draft_src` fills them once the drafter ran); every other sequence feeds
    its scheduled chunk and samples after it when the chunk reaches its end (`last_rows`)."""

    input_ids: np.ndarray = field(default_factory=_empty)  # [T]
    positions: np.ndarray = field(default_factory=_empty)  # [T]
    slot_mapping: np.ndarray = field(default_factory=_empty)  # [T]
    query_lens: np.ndarray = field(default_factory=_empty)  # [S]
    seq_lens: np.ndarray = field(default_factory=_empty)  # [S]
    block_tables: np.ndarray = field(default_factory=lambda: np.zeros((0, 1), np.int32))
    draft_dst: np.ndarray = field(default_factory=_empty)  # flat token rows that take a draft
    draft_src: np.ndarray = field(default_factory=_empty)  # ... the draft's flat index
    last_rows: list[int] = field(default_factory=list)  # rows sampled by non-block sequences
    last_seqs: list[Sequence] = field(default_factory=list)
    verify_rows: np.ndarray = field(default_factory=lambda: np.zeros((0, 1), np.int64))

    @classmethod
    def build(cls, seqs: list[Sequence], num_new_tokens: list[int], blens: list[int],
              width: int, bm: BlockManager) -> FlatBatch:
        """NOTE: every block is padded to `width` (the step's widest) in `verify_rows`: a short
        block repeats its last row, whose drafts are -1, so nothing past it is accepted."""
        n_seqs, bs = len(seqs), bm.block_size
        start = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=n_seqs)
        blen = np.asarray(blens, dtype=np.int64).reshape(n_seqs)
        q = np.where(blen > 0, blen, np.asarray(num_new_tokens, dtype=np.int64).reshape(n_seqs))
        cu = np.concatenate([[0], np.cumsum(q)])
        positions = concat_ranges(start, q)
        table_lens = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64,
                                 count=n_seqs)
        tables = padded_block_tables(seqs, n_seqs, max(int(table_lens.max(initial=0)), 1), 0)
        seq_idx = np.repeat(np.arange(n_seqs), q)
        # NOTE: the scheduler allocated every fed position's block (lookahead included).
        assert (positions // bs < table_lens[seq_idx]).all(), "a fed position has no KV block"
        slots = tables[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs
        ids = np.zeros(int(cu[-1]), dtype=np.int64)
        blocks = np.flatnonzero(blen > 0)
        # a block feeds its last committed token, then drafts
        ids[cu[blocks]] = np.fromiter((seqs[i].token_at(seqs[i].num_computed_tokens)
                                       for i in blocks.tolist()), dtype=np.int64,
                                      count=len(blocks))
        last_rows, last_seqs = [], []
        cu_list, q_list = cu.tolist(), q.tolist()
        for i in np.flatnonzero(blen == 0).tolist():
            seq = seqs[i]
            a = seq.num_computed_tokens
            b = a + q_list[i]
            ids[cu_list[i]:cu_list[i + 1]] = seq.tokens_in(a, b)
            if b == seq.num_tokens:
                last_rows.append(cu_list[i + 1] - 1)
                last_seqs.append(seq)
        drafted = q[blocks] - 1
        verify = cu[blocks][:, None] + np.minimum(np.arange(width)[None, :], drafted[:, None])
        return cls(ids, positions, slots, q, start + q, tables,
                   concat_ranges(cu[blocks] + 1, drafted),
                   concat_ranges(np.arange(len(blocks), dtype=np.int64) * (width - 1), drafted),
                   last_rows, last_seqs, verify)

    def tensors(self, drafts: torch.Tensor | None, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids with the drafts in place, positions, attention metadata)."""
        def t(x: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(x).to(device, non_blocking=True)

        input_ids = t(self.input_ids)
        if len(self.draft_dst):
            input_ids[t(self.draft_dst)] = drafts.reshape(-1)[t(self.draft_src)]
        cu = self.cu_seqlens_q
        seq_idx = np.repeat(np.arange(len(self.query_lens)), self.query_lens)
        meta = AttentionMetadata(
            slot_mapping=t(self.slot_mapping), cu_seqlens_q=t(cu.astype(np.int32)),
            seq_lens=t(self.seq_lens.astype(np.int32)), block_tables=t(self.block_tables),
            max_query_len=int(self.query_lens.max(initial=0)),
            max_seq_len=int(self.seq_lens.max(initial=0)), token_seq_idx=t(seq_idx),
            token_q_idx=t(np.arange(len(self.input_ids)) - cu[seq_idx]))
        return input_ids, t(self.positions), meta

    @property
    def cu_seqlens_q(self) -> np.ndarray:
        """[S + 1]: sequence b's tokens are rows [cu[b], cu[b + 1])."""
        return np.concatenate([[0], np.cumsum(self.query_lens)])

    @property
    def sampled_rows(self) -> np.ndarray:
        """Logits rows: the non-block sequences' last rows, then every block's rows."""
        return np.concatenate([np.asarray(self.last_rows, dtype=np.int64),
                               self.verify_rows.reshape(-1)])
