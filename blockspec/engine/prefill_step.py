"""The prefill forward of a step: the target over a flat batch of prefill chunks (and the drafter
context of their tokens), from static buffers, so the same function runs eagerly at the batch's
exact size and as one CUDA graph per token bucket.

A step that mixes prefill chunks with decoding sequences runs this for the chunks and the
graphed decode step for the rest (`ModelRunner`): both replays, where one eager forward over the
mixed batch launches every kernel of every layer from the host.

NOTE: a graph replays its bucket's T tokens and S sequence lanes. Tokens past the batch write
their K/V (target and drafter) into the trash block and belong to no sequence (the attention
kernel leaves their rows unwritten; they are never read); lanes past the batch have no query
and no keys. Long queries all launch one attention tile shape (TritonAttentionBackend.block_m),
so a bucket's graph serves any mix of chunk lengths.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from blockspec.dflash.proposer import DFlashProposer
from blockspec.engine.flat_batch import FlatBatch
from blockspec.engine.kv_cache import padded_block_tables
from blockspec.engine.sequence import Sequence
from blockspec.layers.attention import AttentionMetadata
from blockspec.models.qwen3 import CausalLM

# Prefill chunks a graphed prefill holds (steps with more run eagerly), and the fewest and most
# tokens of a graph bucket: the smallest bucket is above the split-KV query length, the largest
# is where an eager forward's launches no longer matter next to its compute.
PREFILL_GRAPH_SEQS = 16
MIN_PREFILL_BUCKET, MAX_PREFILL_BUCKET = 32, 2048


def prefill_buckets(max_num_batched_tokens: int) -> list[int]:
    """Token counts that get a prefill graph: powers of two, and from 256 up also 1.5 x each
    (a replay computes its whole bucket), up to the step's token budget."""
    cap = min(max_num_batched_tokens, MAX_PREFILL_BUCKET)
    out, t = [], MIN_PREFILL_BUCKET
    while t < cap:
        out += [t] if t < 256 else [t, t * 3 // 2]
        t *= 2
    out = [b for b in out if b < cap]
    return [*out, cap] if cap >= MIN_PREFILL_BUCKET else []


@dataclass
class PrefillBuffers:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: the target's K/V slots
    context_slots: torch.Tensor  # [T] int64: the drafter context's (trash: not written)
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32

    @classmethod
    def allocate(cls, max_tokens: int, max_seqs: int, max_blocks: int,
                 device: torch.device) -> PrefillBuffers:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(zeros(max_tokens), zeros(max_tokens), zeros(max_tokens), zeros(max_tokens),
                   zeros(max_seqs + 1, dtype=torch.int32), zeros(max_seqs, dtype=torch.int32),
                   zeros(max_seqs, max_blocks, dtype=torch.int32))

    def fill(self, batch: FlatBatch, seqs: list[Sequence], trash_slot: int, trash_block: int,
             write_context: bool) -> int:
        """Writes the prefill chunks of `batch` (built for `seqs`) into every row of the
        buffers, padding included; returns the number of tokens."""
        t, s = len(batch.input_ids), len(seqs)
        pad, lanes = self.input_ids.shape[0] - t, self.seq_lens.shape[0]
        slots = batch.slot_mapping + [trash_slot] * pad
        self._copy(self.input_ids, batch.input_ids + [0] * pad)
        self._copy(self.positions, batch.positions + [0] * pad)
        self._copy(self.slot_mapping, slots)
        self._copy(self.context_slots, slots if write_context else [trash_slot] * (t + pad))
        self._copy(self.cu_seqlens_q, [0, *itertools.accumulate(batch.query_lens)]
                   + [t] * (lanes - s))
        self._copy(self.seq_lens, batch.seq_lens + [0] * (lanes - s))
        tables = padded_block_tables(seqs, lanes, self.block_tables.shape[1], trash_block)
        self.block_tables.copy_(torch.from_numpy(tables), non_blocking=True)
        return t

    @staticmethod
    def _copy(dst: torch.Tensor, values: list[int]) -> None:
        dst.copy_(torch.tensor(values, dtype=dst.dtype), non_blocking=True)


class PrefillStep:
    """Target forward over the first `t` tokens and `s` lanes of the buffers, then the drafter
    context of those tokens (at `context_slots`). Returns the final hidden states [t, H]."""

    def __init__(self, model: CausalLM, proposer: DFlashProposer | None,
                 max_seq_len: int) -> None:
        self.model, self.proposer, self.max_seq_len = model, proposer, max_seq_len

    def __call__(self, bufs: PrefillBuffers, t: int, s: int) -> torch.Tensor:
        dev = bufs.input_ids.device
        cu = bufs.cu_seqlens_q[:s + 1]
        rows = torch.arange(t, device=dev)
        # NOTE: a graph's padding tokens (past the batch's) fall in its last lane, which holds
        # no sequence: a lane of no keys whose rows nobody reads.
        seq_idx = torch.searchsorted(cu[1:], rows.to(cu.dtype), right=True).clamp(max=s - 1)
        meta = AttentionMetadata(
            slot_mapping=bufs.slot_mapping[:t], cu_seqlens_q=cu, seq_lens=bufs.seq_lens[:s],
            block_tables=bufs.block_tables[:s], max_query_len=t, max_seq_len=self.max_seq_len,
            token_seq_idx=seq_idx, token_q_idx=(rows - cu[seq_idx]).clamp(min=0))
        positions = bufs.positions[:t]
        tap_ids = self.proposer.target_layer_ids if self.proposer is not None else ()
        hidden, taps = self.model(bufs.input_ids[:t], positions, meta, tap_ids)
        if self.proposer is not None:
            self.proposer.write_context(taps, positions, bufs.context_slots[:t])
        return hidden


class GraphedPrefillStep:
    """One CUDA graph per token bucket, every one over all the buffers' lanes."""

    def __init__(self, step: PrefillStep, bufs: PrefillBuffers, buckets: list[int]) -> None:
        self.step, self.bufs, self.buckets = step, bufs, sorted(buckets)
        self.lanes = bufs.seq_lens.shape[0]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def capture(self, pool: tuple, stream: torch.cuda.Stream) -> None:
        """NOTE: the buffers must hold a valid (all-padding) batch: the runner fills them."""
        for t in reversed(self.buckets):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.step(self.bufs, t, self.lanes)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[t] = self.step(self.bufs, t, self.lanes)
            self.graphs[t] = graph
        torch.cuda.synchronize()

    def replay(self, bucket: int) -> torch.Tensor:
        self.graphs[bucket].replay()
        return self.outputs[bucket]
