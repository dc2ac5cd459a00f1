"""The flat token batch of an eager step: prefill chunks, decodes and verify blocks of any length
in one `[T]` row of tokens, with the metadata attention reads (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blockspec.engine.kv_cache import BlockManager
from blockspec.engine.sequence import Sequence
from blockspec.layers.attention import AttentionMetadata


@dataclass
class FlatBatch:
    """Host lists of one step; `tensors` makes the tensors the forward reads.

    A sequence with a block (blens[i] >= 1) feeds its last committed token and the drafts after
    it (`draft_dst` <- `draft_src` fills them once the drafter ran); every other sequence feeds
    its scheduled chunk and samples after it when the chunk reaches its end (`last_rows`)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    draft_dst: list[int] = field(default_factory=list)  # flat token rows that take a draft
    draft_src: list[int] = field(default_factory=list)  # ... the draft's flat index
    last_rows: list[int] = field(default_factory=list)  # rows sampled by non-block sequences
    last_seqs: list[Sequence] = field(default_factory=list)
    verify_rows: list[list[int]] = field(default_factory=list)  # per block: its width's rows

    @classmethod
    def build(cls, seqs: list[Sequence], num_new_tokens: list[int], blens: list[int],
              width: int, bm: BlockManager) -> FlatBatch:
        """NOTE: every block is padded to `width` (the step's widest) in `verify_rows`: a short
        block repeats its last row, whose drafts are -1, so nothing past it is accepted."""
        b = cls()
        for seq, n, blen in zip(seqs, num_new_tokens, blens):
            start = seq.num_computed_tokens
            q = blen or n
            base = len(b.input_ids)
            for p in range(start, start + q):
                b.input_ids.append(seq.token_at(p) if p < seq.num_tokens else 0)
                b.positions.append(p)
                b.slot_mapping.append(bm.slot(seq, p))
            if blen:
                k = len(b.verify_rows)
                b.draft_dst += range(base + 1, base + q)
                b.draft_src += range(k * (width - 1), k * (width - 1) + q - 1)
                b.verify_rows.append([base + min(j, q - 1) for j in range(width)])
            elif start + n == seq.num_tokens:
                b.last_rows.append(len(b.input_ids) - 1)
                b.last_seqs.append(seq)
            b.query_lens.append(q)
            b.seq_lens.append(start + q)
        return b

    def tensors(self, seqs: list[Sequence], drafts: torch.Tensor | None, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids with the drafts in place, positions, attention metadata)."""
        input_ids = torch.tensor(self.input_ids, dtype=torch.int64, device=device)
        if self.draft_dst:
            input_ids[torch.tensor(self.draft_dst, device=device)] = drafts.view(-1)[
                torch.tensor(self.draft_src, device=device)]
        positions = torch.tensor(self.positions, dtype=torch.int64, device=device)
        meta = AttentionMetadata.build(self.query_lens, self.seq_lens,
                                       [s.block_table for s in seqs], self.slot_mapping, device)
        return input_ids, positions, meta

    @property
    def sampled_rows(self) -> list[int]:
        """Logits rows: the non-block sequences' last rows, then every block's rows."""
        return self.last_rows + [r for rows in self.verify_rows for r in rows]
