"""Running the fixed-shape decode step for a batch of sequences that all decode with one block
length: static buffers filled from the host, the bucket's CUDA graph replayed (or the step run
eagerly), a plain step's drafter taps staged, the target's picks sampled and accepted, then the
step's one host sync."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from blockspec.dflash.verify import accepted_counts
from blockspec.engine.context_staging import ContextStaging
from blockspec.engine.decode_step import (
    DecodeStep,
    DraftStep,
    GraphedDecodeStep,
    StepBuffers,
    StepOutputs,
)
from blockspec.engine.kv_cache import padded_block_tables
from blockspec.engine.pipeline import PendingDecode, PendingSpec, block_tokens
from blockspec.engine.row_sampling import SampleRows, plain_greedy, row_logprobs, sample_rows
from blockspec.engine.sequence import Sequence
from blockspec.engine.step_plan import Plan
from blockspec.engine.step_result import Logprobs, StepResult


def fill_buffers(bufs: StepBuffers, seqs: list[Sequence], trash_block: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The step's inputs into the static buffers; returns (block tables, context lengths)."""
    n = len(seqs)
    tables = padded_block_tables(seqs, n, bufs.block_tables.shape[1], trash_block)
    bufs.last_tokens[:n].copy_(
        torch.tensor([(s.output_token_ids or s.prompt_token_ids)[-1] for s in seqs]),
        non_blocking=True)
    ctx = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=n)
    bufs.ctx_lens[:n].copy_(torch.from_numpy(ctx), non_blocking=True)
    bufs.block_tables[:n].copy_(torch.from_numpy(tables), non_blocking=True)
    return tables, ctx


def run_step(step: DecodeStep | DraftStep, graphs: GraphedDecodeStep | None, bufs: StepBuffers,
             n: int, trash_block: int) -> StepOutputs | torch.Tensor:
    """Replays the smallest bucket that holds `n` (padded lanes: trash block, empty context), or
    runs the step eagerly where no graph fits."""
    bucket = graphs.bucket_for(n) if graphs is not None else None
    if bucket is None:
        return step(bufs, n)
    bufs.block_tables[n:bucket].fill_(trash_block)
    bufs.ctx_lens[n:bucket].zero_()
    return graphs.replay(n)


class DecodeExecutor:
    def __init__(self, bufs: StepBuffers, trash_block: int, block_size: int, vocab_size: int,
                 staging: ContextStaging | None, generator: torch.Generator,
                 synced: Callable[[torch.Tensor], list], speculative: bool) -> None:
        self.bufs, self.trash_block, self.block_size = bufs, trash_block, block_size
        self.vocab_size = vocab_size
        self.staging = staging
        self.generator = generator
        self.synced = synced
        self.speculative = speculative  # a drafter exists: results carry block lengths

    def __call__(self, seqs: list[Sequence], step: DecodeStep, graphs: GraphedDecodeStep | None,
                 synthetic: float | None, count_staged: bool) -> StepResult:
        """`count_staged`: the staging counts the rows it writes into their sequences (lazy
        drafter context)."""
        n, q, bufs = len(seqs), step.q, self.bufs
        tables, ctx = fill_buffers(bufs, seqs, self.trash_block)
        if synthetic is not None and q > 1:
            bufs.uniforms.uniform_(generator=self.generator)
        out = run_step(step, graphs, bufs, n, self.trash_block)
        if out.taps is not None:
            # NOTE: now, before the next replay overwrites the graph's output.
            self.staging.stage(out.taps, ctx, tables[np.arange(n), ctx // self.block_size],
                               seqs if count_staged else None)
        target, logits = out.target_tokens[:n], out.logits[:n * q]
        row_seqs = [s for s in seqs for _ in range(q)]
        greedy = plain_greedy(seqs)
        if not greedy:
            rows = SampleRows(row_seqs, list(range(q)) * n,
                              out.drafts[:n] if out.drafts is not None else None,
                              [i for i in range(n) for _ in range(q)])
            target = sample_rows(logits, rows, self.vocab_size).view(n, q)
        acc = None
        if out.drafts is not None:
            # NOTE: the graph's own acceptance compares drafts with the raw argmax.
            acc = out.num_accepted[:n] if synthetic is not None or greedy \
                else accepted_counts(out.drafts[:n], target)
        lp = row_logprobs(logits.float(), target.reshape(-1), row_seqs) if any(
            s.params.logprobs is not None for s in seqs) else [None] * (n * q)
        return self._emit(seqs, target, out.drafts, acc, lp, q, synthetic is not None)

    def launch(self, seqs: list[Sequence], step: DecodeStep, graphs: GraphedDecodeStep | None,
               prev: PendingDecode | None) -> PendingDecode:
        """A plain, all-greedy decode step launched without a host sync (async scheduling): the
        inputs of sequences whose newest token is still in flight come from `prev`'s picks on
        the device."""
        n, bufs = len(seqs), self.bufs
        fill_buffers(bufs, seqs, self.trash_block)
        if prev is not None:
            # NOTE: queued before this step's replay overwrites the graph output it reads.
            bufs.last_tokens[:n].copy_(prev.input_tokens(seqs))
        out = run_step(step, graphs, bufs, n, self.trash_block)
        return PendingDecode.start(seqs, out.target_tokens[:n].reshape(n))

    def launch_spec(self, seqs: list[Sequence], plan: Plan, step: DecodeStep,
                    graphs: GraphedDecodeStep | None, prev: PendingSpec | None,
                    synthetic: float | None) -> PendingSpec:
        """A whole speculative step (greedy or synthetic acceptance) launched without a host
        sync (async scheduling): the newest token and context length of sequences whose last
        step is still in flight come from `prev`'s outputs on the device; their block tables
        hold the worst case's blocks (Scheduler.reserve_ahead)."""
        n, bufs = len(seqs), self.bufs
        fill_buffers(bufs, seqs, self.trash_block)
        if prev is not None:
            last, ctx = prev.next_inputs(seqs)
            # NOTE: queued before this step's replay overwrites the graph outputs they read.
            bufs.last_tokens[:n].copy_(last)
            bufs.ctx_lens[:n].copy_(ctx)
        if synthetic is not None:
            bufs.uniforms.uniform_(generator=self.generator)
        out = run_step(step, graphs, bufs, n, self.trash_block)
        return PendingSpec.start(seqs, plan, out.target_tokens[:n], out.drafts[:n],
                                 out.num_accepted[:n], bufs.ctx_lens[:n], synthetic is not None)

    def _emit(self, seqs: list[Sequence], target: torch.Tensor, drafts: torch.Tensor | None,
              acc: torch.Tensor | None, lp: list[Logprobs], q: int,
              synthetic: bool) -> StepResult:
        """One host sync, then each sequence's committed tokens: accepted drafts + bonus."""
        n = len(seqs)
        spec = 1 if self.speculative else 0
        if acc is None and q == 1:  # plain decode: one token per sequence, no drafts
            host = self.synced(target.reshape(n))
            return StepResult([1] * n, list(seqs), [[t] for t in host], [[x] for x in lp],
                              [0] * n, [0] * n, [spec] * n)
        parts = [target.reshape(n, -1)]
        if acc is not None:
            parts += [drafts[:n], acc[:n, None]]
        host = self.synced(torch.cat(parts, dim=1))  # NOTE: the step's one host sync
        tokens, lps, drafted, accepted = [], [], [], []
        for i, row in enumerate(host):
            if acc is not None:
                toks, a = block_tokens(row, q, synthetic)
            else:  # a sampled plain step's row: its pick alone
                toks, a = row[:1], 0
            tokens.append(toks)
            lps.append(lp[i * q:i * q + a + 1])
            drafted.append(q - 1 if acc is not None else 0)
            accepted.append(a)
        return StepResult([len(t) for t in tokens], list(seqs), tokens, lps, drafted, accepted,
                          [q * spec] * n)


class BlockDrafts:
    """A mixed step's drafts for decoding sequences whose blocks are all L: the draft step over
    the decode step's static buffers, its graph replayed where one was captured (else eagerly),
    so drafting beside prefill chunks costs what it costs in a decode step."""

    def __init__(self, bufs: StepBuffers, steps: dict[int, DraftStep], trash_block: int) -> None:
        self.bufs, self.steps, self.trash_block = bufs, steps, trash_block
        self.graphs: dict[int, GraphedDecodeStep] = {}

    def capture(self, lens: list[int], buckets: list[int], pool: tuple,
                stream: torch.cuda.Stream) -> None:
        for L in sorted((x for x in lens if x in self.steps), reverse=True):
            self.graphs[L] = GraphedDecodeStep(self.steps[L], self.bufs, buckets)
            self.graphs[L].capture(pool, stream)

    def holds(self, L: int) -> bool:
        """NOTE: any batch fits: the buffers have max_num_seqs rows, a step at most that many."""
        return L in self.steps

    def __call__(self, seqs: list[Sequence], L: int) -> torch.Tensor:
        """[len(seqs), L - 1] drafts. NOTE: a graph's output: read it before the next replay."""
        n = len(seqs)
        fill_buffers(self.bufs, seqs, self.trash_block)
        return run_step(self.steps[L], self.graphs.get(L), self.bufs, n, self.trash_block)[:n]
