"""Continuous batching with chunked prefill and recompute preemption.

Every step has a token budget (`max_num_batched_tokens`). Running sequences are served first, oldest
first, each asking for the tokens it has not computed yet (1 for decode, the rest of its prompt for
a partially prefilled one, capped by the budget). Waiting sequences then take what budget is left as
(chunked) prefills. When the cache is full the newest running sequence is preempted: its blocks are
freed and it re-enters the front of the waiting queue to be recomputed later (the prefix cache
usually makes that cheap).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from blockspec.engine.kv_cache import BlockManager
from blockspec.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens computed this step per seq
    num_preempted: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


# The "auto" prefill budget of a step with decoding sequences: at least FLOOR, PER_DECODE per
# decoding sequence, and the prompt tokens waiting over DRAIN_STEPS (a backlog drains within
# that many steps), then rounded up so the step fills its graph bucket. NOTE: PER_DECODE keeps a
# closed loop of 512-token prompts for 256-token outputs fed at tau up to ~6; FLOOR beside 32
# verify blocks of 8 makes the 768-token bucket, a mixed step of ~2.5 decode steps on the 8B
# shape (docs/benchmarks.md, "Closed loop"); the backlog term replaces a cliff (the whole step
# budget beside every stream) with steps that grow with the queue.
# NOTE: the cap holds only where its step (decodes + FLOOR or PER_DECODE's term) fits MAX_STEP
# tokens, up to ~80 decoding sequences; past it the step prefills as a plain engine's does:
# there a decode step already takes over 10 ms, and a large eager chunk prefills ~10% cheaper
# per token than 2048-token graphs (a=0.6, C=128 / 256 on the 8B shape: the capped engine ran
# 0.98x / 0.95x AR, its mixed steps 25-27 us a token against AR's 23; docs/benchmarks.md).
DECODE_PREFILL_FLOOR, DECODE_PREFILL_PER_DECODE, DECODE_PREFILL_DRAIN_STEPS = 512, 12, 16
DECODE_PREFILL_MAX_STEP = 1024


def decode_prefill_budget(setting: int | None, num_decoding: int, step_budget: int,
                          pending_prefill_tokens: int = 0, decode_tokens: int = 0,
                          buckets: Seq[int] = ()) -> int:
    """Prefill tokens a step may take beside `num_decoding` decoding sequences (computing
    `decode_tokens` tokens) while `pending_prefill_tokens` prompt tokens wait. `setting`:
    EngineConfig.decode_step_prefill_tokens (0: no cap, N: at most N, None: the "auto" rule
    above, no cap past MAX_STEP); `buckets`: the token counts mixed steps are padded to
    (ascending; none: eager)."""
    if not num_decoding or setting == 0:
        return step_budget
    if setting is None:
        setting = max(DECODE_PREFILL_FLOOR, DECODE_PREFILL_PER_DECODE * num_decoding)
        if decode_tokens + setting > DECODE_PREFILL_MAX_STEP:
            return step_budget
        setting = max(setting, -(-pending_prefill_tokens // DECODE_PREFILL_DRAIN_STEPS))
        total = decode_tokens + setting
        setting = next((b for b in buckets if b >= total), total) - decode_tokens
    return min(setting, step_budget)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, num_lookahead_slots: int = 0,
                 decode_step_prefill_tokens: int | None = 0,
                 step_token_buckets: Seq[int] = ()) -> None:
        """`decode_step_prefill_tokens`: see decode_prefill_budget (default 0: no cap);
        `step_token_buckets`: the token counts a mixed step's graph pads it to."""
        self.decode_step_prefill_tokens = decode_step_prefill_tokens
        self.step_token_buckets = sorted(step_token_buckets)
        self.block_manager = block_manager
        self.num_lookahead_slots = num_lookahead_slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def lookahead(self, remaining: int) -> int:
        """Extra K/V slots a decoding sequence (one uncomputed token) needs for its drafts."""
        return self.num_lookahead_slots if remaining == 1 else 0

    def schedule(self, budget_lookahead: int | None = None,
                 load: tuple[int, int] | None = None) -> SchedulerOutput:
        """`budget_lookahead`: lookahead tokens a decoding sequence counts against the step's
        token budget (at most num_lookahead_slots, the default, whose K/V blocks are allocated
        regardless): the engine lowers it when the next step will likely decode plainly, so
        prefill chunks are not cut for drafts that will not run. NOTE: the runner then verifies
        at most budget_lookahead + 1 tokens per sequence in a step that also prefills
        (StepPlanner.budget_block_len). `load`: `self.load()` if the caller took it already."""
        if budget_lookahead is None:
            budget_lookahead = self.num_lookahead_slots
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        prefill = budget  # NOTE: prefill chunks beside decodes delay every stream
        if self.decode_step_prefill_tokens != 0:
            decoding, pending = load or self.load()
            decode_tokens = decoding * self._decode_cost(budget_lookahead)
            prefill = decode_prefill_budget(self.decode_step_prefill_tokens, decoding, budget,
                                            pending, decode_tokens, self.step_token_buckets)
        budget, prefill = self._schedule_running(out, budget, prefill, budget_lookahead)
        # NOTE: admit nothing new in a step that had to preempt: the cache is under pressure.
        if not out.num_preempted:
            self._admit_waiting(out, budget, prefill)
        return out

    def mixed_load(self, load: tuple[int, int] | None = None) -> tuple[int, int]:
        """(decoding sequences, prompt tokens the next step takes beside them) where the auto
        prefill cap shapes that step (before its graph bucket is filled: the block length is
        not chosen yet), else (0, 0): nothing prefills beside a decode, or the cap is not auto.
        `load`: `self.load()` if the caller took it already."""
        if self.decode_step_prefill_tokens is not None:
            return 0, 0
        decoding, pending = load or self.load()
        if not decoding or not pending:
            return 0, 0
        cap = decode_prefill_budget(None, decoding, self.max_num_batched_tokens, pending)
        return decoding, min(cap, pending)

    def load(self) -> tuple[int, int]:
        """(decoding sequences, prompt tokens left to prefill, running and waiting), what the
        prefill cap reads ((0, 0) without a cap: no walk): one walk of both lists, which
        `mixed_load` and `schedule` take from a caller that needs both."""
        if self.decode_step_prefill_tokens == 0:
            return 0, 0
        left = [s.num_tokens - s.num_computed_tokens for s in self.running]
        pending = sum(n for n in left if n > 1) \
            + sum(s.num_tokens - s.num_computed_tokens for s in self.waiting)
        return left.count(1), pending

    def schedule_ahead(self, max_model_len: int) -> list[Sequence] | None:
        """The next plain-decode step of every running sequence, scheduled before the tokens of
        the step in flight are known (async scheduling, engine/pipeline.py): each sequence's
        input is its newest token, committed or in flight. None where that step cannot run
        ahead: a request waits, a sequence prefills or has a step in flight already, the step's
        token would pass its max_tokens or the context, or the cache lacks a block (the normal
        step then decides what to do: admit, preempt)."""
        if self.waiting:
            return None
        bm = self.block_manager
        needy = []
        for s in self.running:
            ahead = s.num_in_flight
            if ahead > 1 or s.num_computed_tokens != s.num_tokens + ahead - 1 \
                    or len(s.output_token_ids) + ahead >= s.max_tokens \
                    or s.num_tokens + ahead >= max_model_len:
                return None
            if bm.num_blocks_needed(s, 1):
                needy.append(s)
        if len(needy) > len(bm.free_blocks):
            return None
        for s in needy:
            bm.allocate(s, 1)
        return list(self.running)

    def reserve_ahead(self, in_flight: int, block_len: int, max_model_len: int) -> bool:
        """KV blocks for a speculative step of block `block_len` of every running sequence,
        launched before the step in flight (block `in_flight`, 0 if none) is committed: for the
        worst case, where that step accepts every draft. False, reserving nothing, where the
        step cannot run ahead: a request waits, the context would pass max_model_len, or the
        cache lacks blocks (the synchronous step then preempts).
        NOTE: a sequence that the step in flight ends (max_tokens, EOS, a stop) computes one
        block more, which is dropped: its K/V lands past its committed tokens, in blocks that
        no later step reads before this one has run (one stream)."""
        if self.waiting:
            return False
        bm, need = self.block_manager, 0
        for s in self.running:
            if s.num_computed_tokens + in_flight + block_len > max_model_len:
                return False
            need += bm.num_blocks_needed(s, in_flight + block_len)
        if need > len(bm.free_blocks):
            return False
        for s in self.running:
            bm.allocate(s, in_flight + block_len)
        return True

    def _decode_cost(self, budget_lookahead: int) -> int:
        """Step-budget tokens a decoding sequence counts: its token and the lookahead."""
        return 1 + min(self.num_lookahead_slots, budget_lookahead)

    def _schedule_running(self, out: SchedulerOutput, budget: int, prefill: int,
                          budget_lookahead: int) -> tuple[int, int]:
        """Running sequences, oldest first, into `out` (preempting the newest when the cache is
        full); returns the (step, prefill) budgets left."""
        bm, block_size = self.block_manager, self.block_manager.block_size
        decode_slots = 1 + self.num_lookahead_slots
        decode_cost = self._decode_cost(budget_lookahead)
        i = 0
        # NOTE: the loop runs for every running sequence every step: its decode case is inlined
        # (lookahead(), num_blocks_needed()), the host's share of a large batch's step.
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = len(seq.prompt_token_ids) + len(seq.output_token_ids) \
                - seq.num_computed_tokens
            if remaining == 1:
                n, slots, cost = 1, decode_slots, decode_cost
            elif prefill <= 0:  # NOTE: its next chunk waits; the decodes after it still run
                i += 1
                continue
            else:
                n = min(remaining, budget, prefill)
                slots = cost = n
            if cost > budget:
                break
            # NOTE: a decoding sequence needs a new block only every block_size tokens, so the
            # common case is needed <= 0 (no allocation call at all).
            needed = -(-(seq.num_computed_tokens + slots) // block_size) - len(seq.block_table)
            if needed > len(bm.free_blocks) and not self._make_room(seq, needed, out):
                break
            if needed > 0:
                bm.allocate(seq, slots)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= cost
            prefill -= n if remaining != 1 else 0
            i += 1
        return budget, prefill

    def _make_room(self, seq: Sequence, needed: int, out: SchedulerOutput) -> bool:
        """Preempts the newest running sequences until `needed` blocks are free; False if
        `seq` itself had to go."""
        while needed > len(self.block_manager.free_blocks):
            victim = self.running[-1]
            self._preempt(victim)
            out.num_preempted += 1
            if victim is seq:
                return False
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int, prefill: int) -> None:
        """Waiting sequences, in order, take what the budgets leave as (chunked) prefills."""
        while self.waiting and min(budget, prefill) > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.waiting[0]
            fresh = not seq.block_table
            if fresh:
                cached = self.block_manager.match_prefix(seq)
                if seq.metrics.first_scheduled_time is None:
                    seq.metrics.num_cached_tokens = cached
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget, prefill)
            slots = n + self.lookahead(remaining)
            if slots > budget or not self.block_manager.can_allocate(seq, slots):
                if fresh:
                    self.block_manager.free(seq)
                break
            self.block_manager.allocate(seq, slots)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= slots
            prefill -= n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.metrics.finished_time = time.monotonic()
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
