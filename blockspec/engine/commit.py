"""Committing a step: each sequence's tokens appended (stops and limits checked), its computed
tokens advanced and its full blocks published, finished requests ended, the step's outputs
built."""

from __future__ import annotations

import time

from blockspec.dflash.metrics import SpecStats
from blockspec.engine.output_processor import OutputProcessor
from blockspec.engine.scheduler import Scheduler, SchedulerOutput
from blockspec.engine.sequence import Sequence
from blockspec.engine.step_result import StepResult
from blockspec.outputs import RequestOutput


def commit_step(sched: SchedulerOutput, res: StepResult, processor: OutputProcessor,
                scheduler: Scheduler, spec_stats: SpecStats | None
                ) -> tuple[list[RequestOutput], float, int]:
    """(the step's outputs, seconds spent finishing requests, tokens appended: past a stop or
    a limit a block's tokens are dropped). `spec_stats`: the engine's speculation statistics,
    None without a drafter."""
    finishing, appended = _append_tokens(res, processor, spec_stats)
    bm = scheduler.block_manager
    for seq, adv in zip(sched.seqs, res.advance):
        # NOTE: K/V exist for every token but the newest (the target's own pick, or a
        # truncation point when a stop ends the request mid-block), and those in flight.
        seq.num_computed_tokens = min(seq.num_computed_tokens + adv, len(seq.prompt_token_ids)
                                      + len(seq.output_token_ids) + seq.num_in_flight - 1)
        if bm.enable_prefix_caching:
            bm.register_full_blocks(seq)
    outputs: list[RequestOutput] = []
    finish_seconds = 0.0
    if not finishing and not processor.num_reporting:
        return outputs, 0.0, appended  # NOTE: the common step of a batch run: nothing to report
    for seq in res.sampled_seqs:
        req = processor.requests[seq.request_id]
        if id(seq) in finishing:
            t = time.perf_counter()
            scheduler.finish(seq, *finishing[id(seq)])
            outputs.append(processor.output(req))
            finish_seconds += time.perf_counter() - t
        elif seq.is_finished or req.output_kind != "final_only":
            outputs.append(processor.output(req))
    return outputs, finish_seconds, appended


def fail_requests(seqs: list[Sequence], processor: OutputProcessor, scheduler: Scheduler
                  ) -> list[RequestOutput]:
    """Finish the requests of a step that raised ("error"), freeing their KV blocks.
    NOTE: a failed step committed nothing for them (num_computed_tokens did not advance past
    their committed tokens), and the blocks it may have written are theirs alone: blocks
    shared through the prefix cache hold only computed tokens, which no step rewrites."""
    outputs = []
    for seq in seqs:
        req = processor.requests.get(seq.request_id)
        if req is None or seq.is_finished:
            continue
        scheduler.finish(seq, "error")
        outputs.append(processor.output(req))
    return outputs


def _append_tokens(res: StepResult, processor: OutputProcessor, spec_stats: SpecStats | None
                   ) -> tuple[dict[int, tuple[str, str | int | None]], int]:
    """Appends every sampled sequence's tokens; returns why each finishing one finishes, and
    the tokens appended."""
    now = time.monotonic()
    finishing: dict[int, tuple[str, str | int | None]] = {}
    appended = 0
    spec = spec_stats is not None
    if spec:
        spec_stats.record_block_len(res.block_len)
    for seq, toks, lps, drafted, acc, blen in zip(res.sampled_seqs, res.tokens, res.logprobs,
                                                  res.drafted, res.accepted, res.block_lens):
        req = processor.requests[seq.request_id]
        before = len(seq.output_token_ids)
        # NOTE: a request's plain-decode steps (blen 1: one token each) are not counted here,
        # per sequence and step, but from its token counts when its outputs are built
        # (SpecStats.settle_plain_steps): those of its speculative steps (blen >= 2) and of
        # its prefills (blen 0, one token each) are counted here.
        if spec and blen >= 2:
            m = seq.metrics.spec
            m.block_len_steps[blen] += 1
            m.record(drafted, acc)
            spec_stats.record(drafted, acc)
            reason = processor.append(req, toks, lps, now)
            m.num_spec_tokens += len(seq.output_token_ids) - before
        else:
            if spec and blen == 0:
                seq.metrics.spec.num_prefill_tokens += 1
            reason = processor.append(req, toks, lps, now)
        appended += len(seq.output_token_ids) - before
        if reason is not None:
            finishing[id(seq)] = reason
    return finishing, appended
