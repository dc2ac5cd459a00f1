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
"""

from __future__ import annotations

import torch

from blockspec.engine.kv_cache import BlockManager
from blockspec.engine.sequence import Sequence
from blockspec.spec.proposer import DFlashProposer

# Staging capacity in full-batch plain steps: the write is then one GEMM over up to
# STAGING_STEPS * max_num_seqs rows, its weight reads amortised over as many steps.
STAGING_STEPS = 8


def staging_rows(max_num_seqs: int) -> int:
    return STAGING_STEPS * max_num_seqs


class ContextStaging:
    """Device rows of staged taps plus, on the host, where each row's context K/V go."""

    def __init__(self, proposer: DFlashProposer, block_manager: BlockManager, trash_block: int,
                 capacity: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.proposer = proposer
        self.bm = block_manager
        self.trash_block = trash_block
        self.taps = torch.zeros(capacity, width, dtype=dtype, device=device)
        self.blocks: list[int] = []
        self.generations: list[int] = []
        self.positions: list[int] = []
        self.num_flushes = 0  # batched writes so far (tests, benchmarks)

    @property
    def capacity(self) -> int:
        return self.taps.shape[0]

    def __len__(self) -> int:
        return len(self.positions)

    def stage(self, taps: torch.Tensor, seqs: list[Sequence]) -> None:
        """Stage the taps of a plain step over `seqs` (row i: seqs[i]'s token at its
        num_computed_tokens, whose target K/V the step wrote). Call before the next replay
        overwrites the graph's output."""
        n = len(seqs)
        if n > self.capacity:
            raise ValueError(f"{n} rows do not fit a staging of {self.capacity}")
        if len(self) + n > self.capacity:
            self.flush()
        start = len(self)
        self.taps[start:start + n].copy_(taps[:n])
        bs = self.bm.block_size
        for seq in seqs:
            pos = seq.num_computed_tokens
            block = seq.block_table[pos // bs]
            self.blocks.append(block)
            self.generations.append(self.bm.generation[block])
            self.positions.append(pos)

    def stage_placeholders(self, blocks: list[int], positions: list[int]) -> None:
        """Stage zero taps at (block, position) pairs, for the cost profile to time a flush
        (at engine start, when every block is free)."""
        if len(self) + len(blocks) > self.capacity:
            raise ValueError(f"{len(blocks)} rows do not fit the staging")
        self.taps[len(self):len(self) + len(blocks)].zero_()
        self.blocks += blocks
        self.generations += [self.bm.generation[b] for b in blocks]
        self.positions += positions

    def flush(self) -> None:
        """Write every staged row's drafter context K/V (trash for rows whose block was handed
        out afresh since), then empty the staging."""
        m = len(self)
        if not m:
            return
        bs, gen = self.bm.block_size, self.bm.generation
        slots = [(b if gen[b] == g else self.trash_block) * bs + p % bs
                 for b, g, p in zip(self.blocks, self.generations, self.positions)]
        dev = self.taps.device
        self.proposer.write_context(
            self.taps[:m], torch.tensor(self.positions, dtype=torch.int64, device=dev),
            torch.tensor(slots, dtype=torch.int64, device=dev))
        self.blocks.clear()
        self.generations.clear()
        self.positions.clear()
        self.num_flushes += 1
