"""One step's decision: the block length of its decoding sequences (the policy's choice at the
load it prices, cut to the token budget), each sequence's verified tokens, and which execute path
runs the step."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from blockspec.engine.flat_exec import FlatForward
from blockspec.engine.lazy_context import LazyDraftContext
from blockspec.engine.scheduler import Scheduler
from blockspec.engine.sequence import Sequence
from blockspec.engine.speculation import SpecController
from blockspec.policy.drain import Drain
from blockspec.policy.step_context import StepContext


@dataclass(frozen=True)
class Plan:
    decoding: list[bool]  # per scheduled sequence: it decodes (one uncomputed token)
    block_len: int  # the decoding sequences' block (1: plain decode, also with none decoding)
    # Tokens verified per sequence at block_len >= 2 (0: it prefills); None at block_len 1.
    blens: list[int] | None
    # "decode": every sequence decodes with whole blocks (the graphed decode step); "flat": the
    # flat batch through the flat step's bucket graph (MixedStep); "eager": the same step with
    # one eager forward (no graphs, or no bucket holds the batch).
    path: str

    @property
    def num_decoding(self) -> int:
        return sum(self.decoding)

    @property
    def drafting(self) -> bool:
        return self.blens is not None and max(self.blens) >= 2


class StepPlanner:
    def __init__(self, controller: SpecController | None, lazy: LazyDraftContext | None,
                 spec_lens: list[int], max_block: int, max_model_len: int,
                 max_num_batched_tokens: int, flat: FlatForward | None) -> None:
        self.controller, self.lazy, self.flat = controller, lazy, flat
        self.spec_lens, self.max_model_len = spec_lens, max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        # The policy's last choice, and the block length the scheduler budgeted this step for
        # (see next_budget_lookahead).
        self.last_block_len = self.budget_block_len = max_block

    def decide(self, seqs: list[Sequence], num_new_tokens: list[int], ctx: StepContext,
               decoding: list[bool] | None = None) -> Plan:
        """`decoding` given: which sequences decode, where their state cannot tell (a plain
        step in flight has computed a token the host does not hold yet)."""
        if decoding is None:
            decoding = [n == 1 and s.num_computed_tokens == s.num_tokens - 1
                        for s, n in zip(seqs, num_new_tokens)]
        L = self._choose(seqs, decoding, ctx)
        blens = self._blocks(seqs, decoding, L)
        whole = blens is None or all(b == L for b, d in zip(blens, decoding) if d)
        if whole and all(decoding):
            path = "decode"
        elif self.flat is not None and self.flat.fits(
                sum(b or n for b, n in zip(blens or num_new_tokens, num_new_tokens)), len(seqs)):
            path = "flat"
        else:
            path = "eager"
        return Plan(decoding, L, blens, path)

    def plan_ahead(self, seqs: list[Sequence], ctx: StepContext) -> Plan:
        """The decision for a step of `seqs`, all decoding, made before the step in flight is
        committed (async scheduling): the one decision of that step, run ahead or not."""
        n = len(seqs)
        return self.decide(seqs, [1] * n, ctx, decoding=[True] * n)

    def runs_ahead(self, seqs: list[Sequence], plan: Plan) -> str | None:
        """How `plan` may run ahead of the step in flight: "spec" (whole blocks on the decode
        path, the drafter context complete), "plain" (a plain decode while the context is
        detached: the target alone), else None. Never a probe: a synchronous step measures
        its price."""
        policy = self.controller.policy if self.controller is not None else None
        if plan.path != "decode" or (policy is not None and policy.probing):
            return None
        lazy = self.lazy
        if plan.block_len >= 2:
            complete = lazy is None or (not lazy.detached and not lazy.pending_tokens(
                seqs, plan.decoding))
            return "spec" if complete else None
        return "plain" if lazy is not None and lazy.detached else None

    def next_budget_lookahead(self, num_decoding: int = 0, prefill_tokens: int = 0) -> int:
        """Lookahead tokens per decoding sequence for the next step's token budget (the
        scheduler's budget_lookahead): the policy's last choice - 1, since a policy that just
        chose plain decode will likely again, and a prefill chunk then keeps the tokens; where
        the step takes `prefill_tokens` prompt tokens beside `num_decoding` decoding sequences
        (Scheduler.mixed_load), that choice cut for a mixed step (SpecController)."""
        L = self.last_block_len
        if self.controller is not None and num_decoding and prefill_tokens:
            L = self.controller.mixed_block_len(num_decoding, L, prefill_tokens)
        self.budget_block_len = L
        return L - 1

    def _choose(self, seqs: list[Sequence], decoding: list[bool], ctx: StepContext) -> int:
        """The policy's choice at the batch it prices (the load, while the lazy context is
        detached), cut to the token budget."""
        if self.controller is None:
            return 1
        n_dec = sum(decoding)
        # NOTE: a choice made already (StepContext.chosen_block_len) is not made twice.
        L = ctx.chosen_block_len if ctx.chosen_block_len is not None \
            else self._policy_choice(seqs, decoding, n_dec, ctx)
        if not n_dec:
            return 1
        return self._fit_budget(L, n_dec, len(seqs)) if L > self.budget_block_len else L

    def _policy_choice(self, seqs: list[Sequence], decoding: list[bool], n_dec: int,
                       ctx: StepContext) -> int:
        n_policy = n_dec
        if self.lazy is not None:
            # NOTE: also in a step that only prefills: the load rule detaches before prefills
            # write drafter context the policy would not use
            n_policy = self.lazy.policy_batch(n_dec, ctx, self.controller)
            ctx = dataclasses.replace(ctx, switch_cost=self.lazy.switch_cost(seqs, decoding))
        if not n_dec:
            return 1
        self.last_block_len = self.controller.choose(n_policy, ctx)
        return self.last_block_len

    def _blocks(self, seqs: list[Sequence], decoding: list[bool], L: int) -> list[int] | None:
        """Tokens verified per decoding sequence at L >= 2: its last token plus L - 1 drafts,
        cut at the end of the context."""
        if L < 2:
            return None
        return [min(L, self.max_model_len - s.num_computed_tokens) if d else 0
                for s, d in zip(seqs, decoding)]

    def _fit_budget(self, L: int, num_decoding: int, num_seqs: int) -> int:
        """The chosen block cut to what the step's token budget holds. NOTE: a step that also
        prefills has room for the budgeted block only; an all-decode step for any block that
        keeps num_decoding x L within max_num_batched_tokens (the forward the engine profiled),
        rounded down to a block length with graphs."""
        limit = self.budget_block_len if num_decoding < num_seqs else max(
            self.budget_block_len, self.max_num_batched_tokens // num_decoding)
        return max([1, *(x for x in self.spec_lens if x <= min(L, limit))])


def step_context(scheduler: Scheduler, max_num_seqs: int, drains: bool) -> StepContext:
    """The engine's side of a step's decision: the load, and, where `drains` (a closed batch
    with an adaptive policy) and every unfinished request fits in the running batch (no later
    one takes a finished one's slot), the draining batch, built when the policy asks."""
    n = len(scheduler.running) + len(scheduler.waiting)

    def drain() -> Drain | None:
        left = [s.num_tokens_left for s in itertools.chain(scheduler.running, scheduler.waiting)]
        return Drain.of(left) if left else None

    return StepContext(num_unfinished=n, drain=drain if drains and n <= max_num_seqs else None)
