"""The target forward of any step's flat batch (prefill chunks, plain decodes, verify blocks of
any length) from static buffers, with the drafter context of its tokens, so the same function
runs eagerly at the batch's exact size and as one CUDA graph per token bucket.

A step that is not all-decode (MixedStep) replays the bucket that holds its tokens: one forward
reads the weights once for the chunks and the decodes alike, where an eager forward launches
every kernel of every layer from the host.

NOTE: a graph replays its bucket's T tokens and all S sequence lanes. Tokens past the batch write
their K/V (target and drafter) into the trash block and belong to no sequence (the attention
kernel leaves their rows unwritten; they are never read); lanes past the batch have no query and
no keys (their block tables are never read). Attention runs a flat grid (programs from the token
count, AttentionMetadata.flat_grid) and long queries one tile shape
(TritonAttentionBackend.block_m), so a bucket's graph serves any mix of query lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from blockspec.dflash.proposer import DFlashProposer
from blockspec.engine.flat_batch import FlatBatch
from blockspec.layers.attention import AttentionMetadata
from blockspec.models.qwen3 import CausalLM

# The fewest and most tokens of a graph bucket: the smallest is above the split-KV query length,
# the largest is where an eager forward's launches no longer matter next to its compute.
MIN_FLAT_BUCKET, MAX_FLAT_BUCKET = 32, 2048
# Query lengths whose attention launch is tiled apart from the prefill chunks' (a graph per
# bucket and class): plain decodes and blocks of <= 4 get a decode step's small tile, longer
# blocks one tile per 16-token block, so decode rows beside a prefill chunk do not pay the
# prefill tile's rows (16x the work of a plain decode's at a GQA group of 4).
SHORT_QUERY_LENS = (4, 16)


def short_query_len(width: int) -> int:
    """The short-query class of a step whose decoding sequences verify `width` tokens each."""
    return next((s for s in SHORT_QUERY_LENS if width <= s), SHORT_QUERY_LENS[-1])


def flat_buckets(max_num_batched_tokens: int) -> list[int]:
    """Token counts that get a graph: powers of two, and from 256 up also 1.25 and 1.5 x each
    (a replay computes its whole bucket; a mixed step of 30 blocks of 4 beside a 512-token
    prompt fills 640), up to the step's token budget."""
    cap = min(max_num_batched_tokens, MAX_FLAT_BUCKET)
    out, t = [], MIN_FLAT_BUCKET
    while t < cap:
        out += [t] if t < 256 else [t, t * 5 // 4, t * 3 // 2]
        t *= 2
    out = [b for b in out if b < cap]
    return [*out, cap] if cap >= MIN_FLAT_BUCKET else []


@dataclass
class FlatBuffers:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: the target's K/V slots
    context_slots: torch.Tensor  # [T] int64: the drafter context's (trash: not written)
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32

    @classmethod
    def allocate(cls, max_tokens: int, max_seqs: int, max_blocks: int,
                 device: torch.device) -> FlatBuffers:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(zeros(max_tokens), zeros(max_tokens), zeros(max_tokens), zeros(max_tokens),
                   zeros(max_seqs + 1, dtype=torch.int32), zeros(max_seqs, dtype=torch.int32),
                   zeros(max_seqs, max_blocks, dtype=torch.int32))

    def fill(self, batch: FlatBatch, trash_slot: int, write_context: bool) -> int:
        """Writes `batch` into the buffers, every token row and sequence lane included; returns
        the number of tokens. Drafts are not in `batch.input_ids` yet (see `place_drafts`)."""
        t, s = len(batch.input_ids), len(batch.query_lens)
        self._copy(self.input_ids, batch.input_ids, 0)
        self._copy(self.positions, batch.positions, 0)
        self._copy(self.slot_mapping, batch.slot_mapping, trash_slot)
        self._copy(self.context_slots, batch.slot_mapping if write_context
                   else np.zeros(0, dtype=np.int64), trash_slot)
        self._copy(self.cu_seqlens_q, batch.cu_seqlens_q, t)
        self._copy(self.seq_lens, batch.seq_lens, 0)
        if s:
            width = batch.block_tables.shape[1]
            self.block_tables[:s, :width].copy_(torch.from_numpy(batch.block_tables),
                                                non_blocking=True)
        return t

    def place_drafts(self, batch: FlatBatch, drafts: torch.Tensor | None) -> None:
        """The drafter's tokens into their verify rows (on the device: no host sync)."""
        if len(batch.draft_dst):
            dev = self.input_ids.device
            # NOTE: non_blocking: a blocking copy would wait for the draft step to finish
            self.input_ids[torch.from_numpy(batch.draft_dst).to(dev, non_blocking=True)] = \
                drafts.reshape(-1)[torch.from_numpy(batch.draft_src).to(dev, non_blocking=True)]

    @staticmethod
    def _copy(dst: torch.Tensor, values: np.ndarray, pad: int) -> None:
        """`values`, then `pad` up to the buffer's end."""
        full = np.full(dst.shape[0], pad, dtype=np.int64)
        full[:len(values)] = values
        dst.copy_(torch.from_numpy(full), non_blocking=True)


def flat_metadata(bufs: FlatBuffers, t: int, s: int, short: int,
                  max_seq_len: int) -> AttentionMetadata:
    """Attention metadata of the first `t` tokens and `s` lanes of the buffers, computed on the
    device from them (so a graph replays it for any batch the buffers hold)."""
    cu = bufs.cu_seqlens_q[:s + 1]
    rows = torch.arange(t, device=bufs.input_ids.device)
    # NOTE: a graph's padding tokens (past the batch's) fall in its last lane, which holds no
    # sequence: a lane of no keys whose rows nobody reads.
    seq_idx = torch.searchsorted(cu[1:], rows.to(cu.dtype), right=True).clamp(max=s - 1)
    return AttentionMetadata(
        slot_mapping=bufs.slot_mapping[:t], cu_seqlens_q=cu, seq_lens=bufs.seq_lens[:s],
        block_tables=bufs.block_tables[:s], max_query_len=t, max_seq_len=max_seq_len,
        token_seq_idx=seq_idx, token_q_idx=(rows - cu[seq_idx]).clamp(min=0),
        flat_grid=True, short_query_len=short)


class FlatStep:
    """Target forward over the first `t` tokens and `s` lanes of the buffers, then the drafter
    context of those tokens (at `context_slots`). Returns the final hidden states [t, H].
    `short`: queries of up to this many tokens get an attention launch of their own."""

    def __init__(self, model: CausalLM, proposer: DFlashProposer | None,
                 max_seq_len: int) -> None:
        self.model, self.proposer, self.max_seq_len = model, proposer, max_seq_len

    def __call__(self, bufs: FlatBuffers, t: int, s: int, short: int) -> torch.Tensor:
        meta = flat_metadata(bufs, t, s, short, self.max_seq_len)
        positions = bufs.positions[:t]
        tap_ids = self.proposer.target_layer_ids if self.proposer is not None else ()
        hidden, taps = self.model(bufs.input_ids[:t], positions, meta, tap_ids)
        if self.proposer is not None:
            self.proposer.write_context(taps, positions, bufs.context_slots[:t])
        return hidden


class GraphedFlatStep:
    """One CUDA graph per (token bucket, short-query class), every one over all the buffers'
    lanes."""

    def __init__(self, step: FlatStep, bufs: FlatBuffers, buckets: list[int],
                 shorts: list[int]) -> None:
        self.step, self.bufs, self.buckets = step, bufs, sorted(buckets)
        self.shorts = sorted(shorts)
        self.lanes = bufs.seq_lens.shape[0]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}

    def capture(self, pool: tuple, stream: torch.cuda.Stream) -> None:
        """NOTE: the buffers must hold a valid (all-padding) batch: the runner fills them."""
        for key in [(t, short) for t in reversed(self.buckets) for short in self.shorts]:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.step(self.bufs, key[0], self.lanes, key[1])
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self.step(self.bufs, key[0], self.lanes, key[1])
            self.graphs[key] = graph
        torch.cuda.synchronize()

    def replay(self, bucket: int, short: int) -> torch.Tensor:
        self.graphs[bucket, short].replay()
        return self.outputs[bucket, short]
