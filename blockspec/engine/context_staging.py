"""Deferred drafter-context writes for plain decode steps.

A plain step (L = 1) of an engine with a drafter does not write the drafter's context K/V of the
token it verifies (that write re-reads the drafter's fc and K/V weights every step); it hands
back the target's taps, which are staged here, and `flush` writes all staged rows in one batched
pass. The runner flushes before any step that runs the drafter and when the staging is full, so
the drafter always attends to a complete context.

Each staged row remembers the KV block it belongs to and that block's generation (see
`BlockManager.generation`). NOTE: a row is written to its block only if the block still has that
generation, i.e. it was not handed out afresh since: its tokens (and target K/V) are still the
ones the row was computed from, whether its sequence is still running, finished (a prefix-cache
block may be revived later) or preempted. Otherwise the block may belong to another sequence
now, and the row goes to the trash block. A flush therefore never writes into another
sequence's context, and never leaves a hole in a block that still holds the row's tokens.

With lazy_draft_context the runner also hands over each staged step's sequences: a flush then
advances their `num_draft_ctx_tokens` over the rows it really wrote (`_count_written`).
"""

from __future__ import annotations

import numpy as np
import torch

from blockspec.dflash.proposer import DFlashProposer
from blockspec.engine.kv_cache import BlockManager
from blockspec.engine.sequence import Sequence

# Staging capacity in full-batch plain steps: the write is then one GEMM over up to
# STAGING_STEPS * max_num_seqs rows, its weight reads amortised over as many steps.
STAGING_STEPS = 8


def staging_rows(max_num_seqs: int) -> int:
    return STAGING_STEPS * max_num_seqs


class ContextStaging:
    """Device rows of staged taps plus, on the host, where each row's context K/V go.

    NOTE: the host side is numpy arrays, one chunk per staged step: a plain step at a large
    batch must add ~no host time (the engine syncs every step, so host time is step time)."""

    def __init__(self, proposer: DFlashProposer, block_manager: BlockManager, trash_block: int,
                 capacity: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.proposer = proposer
        self.bm = block_manager
        self.trash_block = trash_block
        self.taps = torch.zeros(capacity, width, dtype=dtype, device=device)
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # blocks, gens, pos
        self._rows = 0
        # Per staged chunk, its sequences (lazy_draft_context only; None: not tracked).
        self._seqs: list[list[Sequence] | None] = []
        self.num_flushes = 0  # batched writes so far (tests, benchmarks)

    @property
    def capacity(self) -> int:
        return self.taps.shape[0]

    def __len__(self) -> int:
        return self._rows

    @property
    def num_staged_steps(self) -> int:
        """Plain steps staged since the last flush (a sequence has at most one row in each)."""
        return len(self._chunks)

    def _column(self, i: int) -> np.ndarray:
        if not self._chunks:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([c[i] for c in self._chunks])

    @property
    def blocks(self) -> np.ndarray:
        return self._column(0)

    @property
    def generations(self) -> np.ndarray:
        return self._column(1)

    @property
    def positions(self) -> np.ndarray:
        return self._column(2)

    def stage(self, taps: torch.Tensor, positions: np.ndarray, blocks: np.ndarray,
              seqs: list[Sequence] | None = None) -> None:
        """Stage the taps of a plain step: row i is the token at `positions[i]` (its sequence's
        num_computed_tokens, whose target K/V the step wrote), in KV block `blocks[i]`; `seqs`
        (optional): row i's sequence, whose drafter-context count the flush advances. Call
        before the next replay overwrites the graph's output."""
        n = len(positions)
        if n > self.capacity:
            raise ValueError(f"{n} rows do not fit a staging of {self.capacity}")
        if len(self) + n > self.capacity:
            self.flush()
        self.taps[self._rows:self._rows + n].copy_(taps[:n])
        self._push(blocks, positions, list(seqs) if seqs is not None else None)

    def stage_placeholders(self, blocks: list[int], positions: list[int]) -> None:
        """Stage zero taps at (block, position) pairs, for the cost profile to time a flush
        (at engine start, when every block is free)."""
        if len(self) + len(blocks) > self.capacity:
            raise ValueError(f"{len(blocks)} rows do not fit the staging")
        self.taps[self._rows:self._rows + len(blocks)].zero_()
        self._push(np.asarray(blocks, dtype=np.int64), np.asarray(positions, dtype=np.int64))

    def _push(self, blocks: np.ndarray, positions: np.ndarray,
              seqs: list[Sequence] | None = None) -> None:
        blocks = blocks.astype(np.int64, copy=False)
        self._chunks.append((blocks, self.bm.generation[blocks], positions))
        self._seqs.append(seqs)
        self._rows += len(blocks)

    def flush(self) -> None:
        """Write every staged row's drafter context K/V (trash for rows whose block was handed
        out afresh since), then empty the staging."""
        m = len(self)
        if not m:
            return
        bs = self.bm.block_size
        blocks, gens, positions = self.blocks, self.generations, self.positions
        live = self.bm.generation[blocks] == gens
        slots = np.where(live, blocks, self.trash_block) * bs + positions % bs
        dev = self.taps.device
        self.proposer.write_context(self.taps[:m], torch.from_numpy(positions).to(dev),
                                    torch.from_numpy(slots).to(dev))
        if any(s is not None for s in self._seqs):
            self._count_written(live)
        self._chunks.clear()
        self._seqs.clear()
        self._rows = 0
        self.num_flushes += 1

    def _count_written(self, live: np.ndarray) -> None:
        """Advance each tracked sequence's num_draft_ctx_tokens over its rows just written.

        NOTE: exact only because the runner (lazy mode) flushes before any other write of
        drafter context: chunks are in step order, so a sequence's rows come in position order,
        and a row counts only where it extends the sequence's written prefix, in the block the
        sequence holds there now (not a stale row of a preempted, re-admitted sequence)."""
        bs, start = self.bm.block_size, 0
        for (blocks, _, positions), seqs in zip(self._chunks, self._seqs):
            n = len(blocks)
            if seqs is not None:
                for seq, blk, p, ok in zip(seqs, blocks.tolist(), positions.tolist(),
                                           live[start:start + n].tolist()):
                    if ok and seq.num_draft_ctx_tokens == p \
                            and p // bs < len(seq.block_table) \
                            and seq.block_table[p // bs] == blk:
                        seq.num_draft_ctx_tokens = p + 1
            start += n
