"""Running a step's prefill chunks through the prefill step: buffers filled, the bucket's graph
replayed (or the step run eagerly at the batch's size), and the first token sampled for every
sequence whose prompt the chunk completes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from blockspec.config import EngineConfig
from blockspec.dflash.proposer import DFlashProposer
from blockspec.engine.flat_batch import FlatBatch
from blockspec.engine.kv_cache import BlockManager
from blockspec.engine.prefill_step import (
    PREFILL_GRAPH_SEQS,
    GraphedPrefillStep,
    PrefillBuffers,
    PrefillStep,
    prefill_buckets,
)
from blockspec.engine.row_sampling import SampleRows, row_logprobs, sample_rows
from blockspec.engine.sequence import Sequence
from blockspec.engine.step_result import StepResult
from blockspec.models.qwen3 import CausalLM


class PrefillExecutor:
    def __init__(self, step: PrefillStep, bufs: PrefillBuffers, buckets: list[int],
                 bm: BlockManager, trash_block: int, vocab_size: int,
                 synced: Callable[[torch.Tensor], list]) -> None:
        """`buckets`: the token counts the buffers hold a batch of (graphed or not)."""
        self.step, self.bufs, self.buckets = step, bufs, sorted(buckets)
        self.bm, self.trash_block, self.vocab_size = bm, trash_block, vocab_size
        self.synced = synced
        self.graphs: GraphedPrefillStep | None = None
        # NOTE: the buffers' last lane stays empty: graph padding tokens belong to it.
        self.lanes = bufs.seq_lens.shape[0] - 1

    def capture(self, pool: tuple, stream: torch.cuda.Stream) -> None:
        self._fill([], [], write_context=False)
        self.graphs = GraphedPrefillStep(self.step, self.bufs, self.buckets)
        self.graphs.capture(pool, stream)

    def _fill(self, seqs: list[Sequence], num_new_tokens: list[int],
              write_context: bool) -> tuple[FlatBatch, int]:
        """The chunks as one flat batch (the eager step's builder), into the buffers."""
        batch = FlatBatch.build(seqs, num_new_tokens, [0] * len(seqs), 1, self.bm)
        trash_slot = self.trash_block * self.bm.block_size
        return batch, self.bufs.fill(batch, seqs, trash_slot, self.trash_block, write_context)

    def fits(self, num_new_tokens: list[int]) -> bool:
        """Whether these chunks fit one bucket and the lanes."""
        return 0 < len(num_new_tokens) <= self.lanes and sum(num_new_tokens) <= self.buckets[-1]

    def launch(self, seqs: list[Sequence], num_new_tokens: list[int],
               write_context: bool) -> Callable[[], StepResult]:
        """Enqueues the chunks' forward and their first tokens' sampling; the returned call
        reads the tokens (a host sync: call it after the step's other work is enqueued)."""
        batch, t = self._fill(seqs, num_new_tokens, write_context)
        if self.graphs is not None:
            hidden = self.graphs.replay(next(b for b in self.buckets if b >= t))
        else:
            hidden = self.step(self.bufs, t, len(seqs))
        sampled = batch.last_seqs  # NOTE: the sequences whose chunk ends their prompt
        tokens = logits = None
        if sampled:
            rows = torch.tensor(batch.last_rows, device=hidden.device)
            logits = self.step.model.compute_logits(hidden[rows]).float()
            tokens = sample_rows(logits, SampleRows(sampled, [0] * len(sampled)),
                                 self.vocab_size)

        def finish() -> StepResult:
            advance = list(num_new_tokens)
            if not sampled:
                return StepResult(advance, [], [], [], [], [], [])
            lp = row_logprobs(logits, tokens, sampled)
            host = self.synced(tokens)
            n = len(sampled)
            return StepResult(advance, sampled, [[x] for x in host], [[x] for x in lp],
                              [0] * n, [0] * n, [0] * n)

        return finish


def build_prefill(config: EngineConfig, model: CausalLM, proposer: DFlashProposer | None,
                  bm: BlockManager, trash_block: int, max_model_len: int, max_blocks: int,
                  graphed: bool, synced: Callable[[torch.Tensor], list]
                  ) -> PrefillExecutor | None:
    """The split mixed step's prefill forward (EngineConfig.split_prefill: None = with graphs),
    or None where mixed steps run as one eager forward. Captured with the runner's graphs."""
    buckets = prefill_buckets(config.max_num_batched_tokens)
    if not (graphed if config.split_prefill is None else config.split_prefill) or not buckets:
        return None
    bufs = PrefillBuffers.allocate(buckets[-1], PREFILL_GRAPH_SEQS + 1, max_blocks,
                                   next(model.parameters()).device)
    return PrefillExecutor(PrefillStep(model, proposer, max_model_len), bufs, buckets, bm,
                           trash_block, model.config.vocab_size, synced)
