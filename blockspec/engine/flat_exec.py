"""Running a step's flat batch through the flat step: buffers filled, the drafts placed, the
bucket's graph replayed (or the step run eagerly at the batch's size)."""

from __future__ import annotations

import torch

from blockspec.config import EngineConfig
from blockspec.dflash.proposer import DFlashProposer
from blockspec.engine.flat_batch import FlatBatch
from blockspec.engine.flat_step import (
    FlatBuffers,
    FlatStep,
    GraphedFlatStep,
    flat_buckets,
    short_query_len,
)
from blockspec.models.qwen3 import CausalLM


class FlatForward:
    def __init__(self, step: FlatStep, bufs: FlatBuffers, buckets: list[int],
                 trash_slot: int) -> None:
        """`buckets`: the token counts the buffers hold a batch of (graphed or not)."""
        self.step, self.bufs, self.buckets = step, bufs, sorted(buckets)
        self.trash_slot = trash_slot
        self.graphs: GraphedFlatStep | None = None
        # NOTE: the buffers' last lane stays empty: graph padding tokens belong to it.
        self.lanes = bufs.seq_lens.shape[0] - 1

    def capture(self, widths: list[int], pool: tuple, stream: torch.cuda.Stream) -> None:
        """Graphs for steps whose decoding sequences verify any of `widths` tokens."""
        self.bufs.fill(FlatBatch(), self.trash_slot, write_context=False)
        shorts = sorted({short_query_len(w) for w in widths})
        self.graphs = GraphedFlatStep(self.step, self.bufs, self.buckets, shorts)
        self.graphs.capture(pool, stream)

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        """Whether a batch of this size fits one bucket and the lanes."""
        return 0 < num_tokens <= self.buckets[-1] and num_seqs <= self.lanes

    def __call__(self, batch: FlatBatch, drafts: torch.Tensor | None, write_context: bool,
                 width: int) -> torch.Tensor:
        """The batch's final hidden states (rows past its tokens are padding); `width`: the
        tokens each decoding sequence verifies (1: plain decode)."""
        t = self.bufs.fill(batch, self.trash_slot, write_context)
        self.bufs.place_drafts(batch, drafts)
        short = short_query_len(width)
        if self.graphs is not None:
            return self.graphs.replay(next(b for b in self.buckets if b >= t), short)
        return self.step(self.bufs, t, len(batch.query_lens), short)


def build_flat(config: EngineConfig, model: CausalLM, proposer: DFlashProposer | None,
               trash_slot: int, max_model_len: int, max_blocks: int,
               graphed: bool) -> FlatForward | None:
    """The flat forward of steps that are not all-decode (EngineConfig.graph_mixed_steps: None
    = with graphs), or None where those run the eager flat batch. Captured with the runner's
    graphs."""
    buckets = flat_buckets(config.max_num_batched_tokens)
    on = graphed if config.graph_mixed_steps is None else config.graph_mixed_steps
    if not on or not buckets:
        return None
    bufs = FlatBuffers.allocate(buckets[-1], config.max_num_seqs + 1, max_blocks,
                                next(model.parameters()).device)
    return FlatForward(FlatStep(model, proposer, max_model_len), bufs, buckets, trash_slot)
