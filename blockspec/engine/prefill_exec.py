"""Running a step's prefill chunks through the prefill step: buffers filled, the bucket's graph
replayed (or the step run eagerly at the batch's size), and the first token sampled for every
sequence whose prompt the chunk completes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from blockspec.engine.kv_cache import BlockManager
from blockspec.engine.prefill_step import GraphedPrefillStep, PrefillBuffers, PrefillStep
from blockspec.engine.row_sampling import SampleRows, row_logprobs, sample_rows
from blockspec.engine.sequence import Sequence
from blockspec.engine.step_result import StepResult


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
        self.bufs.fill([], [], self.bm, self.trash_block, write_context=False)
        self.graphs = GraphedPrefillStep(self.step, self.bufs, self.buckets)
        self.graphs.capture(pool, stream)

    def fits(self, num_new_tokens: list[int]) -> bool:
        """Whether these chunks fit one bucket and the lanes."""
        return 0 < len(num_new_tokens) <= self.lanes and sum(num_new_tokens) <= self.buckets[-1]

    def launch(self, seqs: list[Sequence], num_new_tokens: list[int],
               write_context: bool) -> Callable[[], StepResult]:
        """Enqueues the chunks' forward and their first tokens' sampling; the returned call
        reads the tokens (a host sync: call it after the step's other work is enqueued)."""
        t = self.bufs.fill(seqs, num_new_tokens, self.bm, self.trash_block, write_context)
        if self.graphs is not None:
            hidden = self.graphs.replay(next(b for b in self.buckets if b >= t))
        else:
            hidden = self.step(self.bufs, t, len(seqs))
        done = [i for i, (s, n) in enumerate(zip(seqs, num_new_tokens))
                if s.num_computed_tokens + n == s.num_tokens]
        sampled = [seqs[i] for i in done]
        ends = [sum(num_new_tokens[:i + 1]) - 1 for i in done]
        tokens = logits = None
        if sampled:
            rows = torch.tensor(ends, device=hidden.device)
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
