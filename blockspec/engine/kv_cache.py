"""Paged KV block manager with reference counts and prefix caching by block hash.

One manager (one slot space) serves every KV pool of the engine: the target's layers and, with
speculation, the drafter's layers. A block's hash chains its parent's hash with its token ids, so
equal hashes mean equal prefixes. Freed blocks keep their hash and sit in an LRU free list: a later
request with the same prefix revives them; allocation evicts from the least recently freed end.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import numpy as np

from blockspec.engine.sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    pass


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated [start, start + length) of each pair (int64)."""
    begins = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + np.arange(int(lengths.sum())) - begins


def padded_block_tables(seqs: list[Sequence], rows: int, width: int, pad: int) -> np.ndarray:
    """[rows, width] int32 block tables of `seqs` (then empty rows), padded with block `pad`
    (a step's static buffers pad with the trash block, a real one). Filled in one scatter, not
    a row at a time: a step's batch has up to max_num_seqs tables."""
    lens = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=len(seqs))
    tables = np.full((rows, width), pad, dtype=np.int32)
    tables[np.repeat(np.arange(len(seqs)), lens),
           concat_ranges(np.zeros(len(seqs), dtype=np.int64), lens)] = np.fromiter(
        itertools.chain.from_iterable(s.block_table for s in seqs), dtype=np.int32,
        count=int(lens.sum()))
    return tables


def hash_block(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # NOTE: bumped each time `allocate` hands a block out afresh (its old content is dead); a
        # block revived from the prefix cache keeps it (same tokens, same K/V). Deferred writes
        # for a block are valid only while its generation is the one they were staged under.
        self.generation = np.zeros(num_blocks, dtype=np.int64)
        self.num_prefix_hits = 0  # blocks reused from the cache, for metrics

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ---------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """On a sequence's first schedule, take every cached leading full block. Returns the number
        of tokens whose K/V are already in the cache."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        tokens = seq.token_ids()
        # NOTE: the last token is always recomputed: its logits are needed to sample.
        max_blocks = (len(tokens) - 1) // self.block_size
        parent: int | None = None
        for i in range(max_blocks):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = hash_block(parent, chunk)
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens[block] != chunk:
                break
            self._take(block)
            seq.block_table.append(block)
            if len(seq.block_hashes) <= i:
                seq.block_hashes.append(h)
            parent = h
        seq.num_hashed_blocks = len(seq.block_table)
        self.num_prefix_hits += len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_computed_tokens

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish blocks that committed tokens have filled, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i in range(seq.num_hashed_blocks, num_full):
            chunk = tuple(seq.token_at(j) for j in range(i * self.block_size,
                                                         (i + 1) * self.block_size))
            parent = seq.block_hashes[i - 1] if i > 0 else None
            h = hash_block(parent, chunk)
            if len(seq.block_hashes) > i:
                seq.block_hashes[i] = h
            else:
                seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h not in self.hash_to_block:
                self.hash_to_block[h] = block
                self.block_hash[block] = h
                self.block_tokens[block] = chunk
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    # -- allocation -----------------------------------------------------------------------------
    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens)
                   - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for `num_new_tokens` more K/V slots after the computed ones."""
        needed = self.num_blocks_needed(seq, num_new_tokens)
        if needed > len(self.free_blocks):
            raise NoFreeBlocksError(f"need {needed} blocks, {len(self.free_blocks)} free")
        for _ in range(needed):
            block, _ = self.free_blocks.popitem(last=False)
            self._evict_hash(block)
            self.generation[block] += 1
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        # NOTE: tail blocks first, so the LRU evicts a prefix's tail before its head.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, "block freed twice"
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0
        seq.num_draft_ctx_tokens = 0  # NOTE: a recompute prefill rewrites everything

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1

    def _evict_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None and self.hash_to_block.get(h) == block:
            del self.hash_to_block[h]
        self.block_hash[block] = None
        self.block_tokens[block] = None

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + (
            position % self.block_size)
