"""Speculation policy: pick the block length per step from measured step costs and live acceptance.

A speculative step of block length L verifies L tokens (the last committed token's successor plus
L - 1 drafts) and commits 1 + (accepted drafts) tokens; plain decode (L = 1) commits exactly one.
The policy maximises expected committed tokens per second for the current batch:
    rate(L) = B * E[committed | L] / cost(B, L).
In a draining batch (every request known, all of them running) it prices the stragglers too
(policy/drain.py).
Pure Python (no torch) so it can be unit-tested and profiled on any host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from blockspec.policy.acceptance import (
    AcceptanceTracker,
    committed_moments_from_rates,
    expected_committed_from_rates,
)
from blockspec.policy.cost_model import PROFILE_VERSION, StepCostModel, profile_key
from blockspec.policy.drain import Drain, drained_tau, expected_max_normal
from blockspec.policy.overhead import StepOverhead
from blockspec.policy.step_context import DrainArg, SwitchCost

__all__ = ["PROFILE_VERSION", "AcceptanceTracker", "SpeculationPolicy", "StepCostModel",
           "StepOverhead", "Drain", "DrainArg", "drained_tau", "expected_max_normal",
           "expected_committed_from_rates", "profile_key"]

# Plain decode is sampled for its live overhead (StepOverhead.plain_needs_samples) only where the
# choice's modelled rate is under this multiple of plain decode's: above it no plausible term
# for plain decode could change the choice.
EXPLORE_BELOW = 1.5
# ... and, in a draining batch, only while its last request has this many tokens left: near the
# end a term measured by plain steps would serve few steps more, and those steps mostly sample
# the small buckets the tail drains through (measured: docs/benchmarks.md, the policy sweeps).
EXPLORE_MIN_LEFT = 128
# After plain decode wins a step on its merits, the next RECHECK_PLAIN - 1 choices at the same
# batch size and acceptance evidence stay plain without re-pricing: in a plain streak the inputs
# drift slowly (the tracker's decay, one token less per request), and pricing walks the batch
# (drain, catch-up) on the host of the cheapest step there is, which then runs slower than a
# plain decoding engine's (docs/benchmarks.md, the policy sweeps).
RECHECK_PLAIN = 8


class SpeculationPolicy:
    """Chooses plain decode (1) or one of `block_lens` for each step.

    NOTE: deterministic given (batch_size, tracker state, call history); ties go to the smaller
    block length. Speculation is chosen only if its best rate exceeds min_gain * the plain rate.
    `probe_every` > 0: after that many consecutive plain-decode choices in adaptive mode, the next
    choice is the smallest block, so acceptance statistics can recover (plain steps observe none);
    `probe_overhead` > 0 additionally bounds the probes' modelled cost (see `_probe_affordable`).
    """

    def __init__(self, cost_model: StepCostModel, block_lens: Sequence[int] = (4, 8, 16),
                 mode: str = "adaptive", fixed_len: int = 16, min_gain: float = 1.0,
                 probe_every: int = 0, probe_overhead: float = 0.0) -> None:
        if mode not in ("adaptive", "fixed"):
            raise ValueError(f"mode must be 'adaptive' or 'fixed', got {mode!r}")
        self.block_lens = sorted({int(L) for L in block_lens})
        if not self.block_lens or self.block_lens[0] < 2:
            raise ValueError(f"block_lens must be non-empty and > 1, got {list(block_lens)}")
        missing = [L for L in [1, *self.block_lens] if L not in cost_model.block_lens]
        if mode == "fixed" and fixed_len != 1 and fixed_len not in self.block_lens:
            raise ValueError(f"fixed_len {fixed_len} not in block_lens {self.block_lens}")
        if mode == "adaptive" and missing:
            raise ValueError(f"cost model lacks block lengths {missing}")
        if min_gain <= 0 or probe_every < 0 or probe_overhead < 0:
            raise ValueError("min_gain must be > 0, probe_every and probe_overhead >= 0")
        self.cost_model = cost_model
        self.mode = mode
        self.fixed_len = fixed_len
        self.min_gain = float(min_gain)
        self.probe_every = probe_every
        self.probe_overhead = float(probe_overhead)
        self._plain_streak = 0
        self._plain_time = 0.0  # modelled seconds spent in the current plain streak
        # The live per-step overhead added to a candidate's modelled step.
        self.overhead: StepOverhead | None = None
        # Plain choices left before re-pricing, and what they hold for (see RECHECK_PLAIN).
        self._memo_left = 0
        self._memo_key: tuple[int, AcceptanceTracker, int] | None = None
        # (plain streak, seconds) of the probe's last switch_cost (see _probe_affordable).
        self._probe_switch: tuple[int | None, float] = (None, 0.0)
        # Whether the last choice was a probe, and per batch size the wall time the last
        # measured probe took beyond a plain step (observe_probe).
        self.probing = False
        self._probe_excess: dict[int, float] = {}

    def step_cost(self, batch_size: int, block_len: int) -> float:
        """The modelled step time plus the live per-step overhead (see StepOverhead)."""
        extra = self.overhead(batch_size, block_len) if self.overhead is not None else 0.0
        return self.cost_model.cost(batch_size, block_len) + extra

    def rates(self, batch_size: int, tracker: AcceptanceTracker, switch_s: float = 0.0,
              horizon: float = 1.0, drain: Drain | None = None) -> dict[int, float]:
        """Expected committed tokens/s for each candidate (1 and every block length).

        `switch_s` > 0: a one-time cost of speculating, spread over the `horizon / tau` steps
        that would commit the `horizon` tokens left (all of it on one step if fewer).
        `drain`: the batch drains (see Drain.tau)."""
        return self._rates(batch_size, self._candidates(batch_size, tracker), switch_s, horizon,
                           drain)

    def _candidates(self, batch_size: int, tracker: AcceptanceTracker
                    ) -> tuple[dict[int, tuple[float, float]], dict[int, float]]:
        """(mean, variance) of the tokens each block length commits, and every candidate's step
        time: what one choice prices, computed once (the host pays for every step's choice)."""
        p = tracker.conditional_rates(self.block_lens[-1] - 1)
        moments = committed_moments_from_rates(p, self.block_lens)
        return moments, {L: self.step_cost(batch_size, L) for L in (1, *self.block_lens)}

    def _rates(self, batch_size: int, cands: tuple[dict[int, tuple[float, float]],
                                                   dict[int, float]],
               switch_s: float = 0.0, horizon: float = 1.0, drain: Drain | None = None
               ) -> dict[int, float]:
        moments, costs = cands
        out = {1: batch_size / costs[1]}
        for L in self.block_lens:
            tau, var = moments[L]
            step = costs[L] + switch_s * tau / max(horizon, tau)
            if drain is not None:
                tau = drain.tau(tau, var)
            out[L] = batch_size * tau / step
        return out

    def gain(self, rates: Mapping[int, float]) -> float:
        """The best speculative rate over plain decode's."""
        return max(rates[L] for L in self.block_lens) / rates[1]

    def _priced(self, batch_size: int, cands: tuple, drain: DrainArg
                ) -> tuple[dict[int, float], Drain | None]:
        """The rates, with the drain priced where it could matter. NOTE: a drain only lowers
        speculative rates, so where plain decode wins without it, it is not built (that walks
        every request: host time in each plain step of a large batch)."""
        rates = self._rates(batch_size, cands)
        if drain is None or self.gain(rates) <= min(1.0, self.min_gain):
            return rates, None
        if callable(drain):
            drain = drain()
            if drain is None:
                return rates, None
        return self._rates(batch_size, cands, drain=drain), drain

    def _best(self, rates: Mapping[int, float]) -> int:
        best = self.block_lens[0]
        for L in self.block_lens[1:]:
            if rates[L] > rates[best]:  # strict: ties keep the smaller block
                best = L
        return best if rates[best] > self.min_gain * rates[1] else 1

    def choose(self, batch_size: int, tracker: AcceptanceTracker, drain: DrainArg = None,
               switch_cost: SwitchCost | None = None) -> int:
        """`drain`: the draining batch (see Drain.tau), or a function that builds it on demand
        (or returns None), else None. `switch_cost`: what speculating this step would pay once
        first ((batch size, this cost model) -> (seconds, horizon)), e.g. the drafter-context
        catch-up when the engine skipped those writes; `horizon`: tokens per sequence left to
        amortise it."""
        self.probing = False
        if self.mode == "fixed":
            return self.fixed_len
        # NOTE: the tracker itself is kept (compared by identity), not its id(), which a new
        # tracker could reuse once the old one is gone.
        key = (batch_size, tracker, tracker.num_updates)
        if self._memo_left and key == self._memo_key:
            self._memo_left -= 1
            return self._plain(batch_size, switch_cost)
        self._memo_left = 0
        cands = self._candidates(batch_size, tracker)
        rates, drain = self._priced(batch_size, cands, drain)
        choice = self._best(rates)
        if choice != 1 and switch_cost is not None:
            switch_s, horizon = switch_cost(batch_size, self.cost_model)
            if switch_s > 0:
                rates = self._rates(batch_size, cands, switch_s, horizon, drain)
                choice = self._best(rates)
        if choice == 1:
            self._memo_left, self._memo_key = RECHECK_PLAIN - 1, key
        elif self.overhead is not None and self.overhead.plain_needs_samples(batch_size) \
                and rates[choice] < EXPLORE_BELOW * rates[1] \
                and (drain is None or drain.left[-1] >= EXPLORE_MIN_LEFT):
            choice = 1  # NOTE: measures plain decode's term (see StepOverhead); not memoised
        if choice == 1:
            return self._plain(batch_size, switch_cost)
        self._end_plain_streak()
        return choice

    def _plain(self, batch_size: int, switch_cost: SwitchCost | None) -> int:
        """A plain-decode choice: extends the plain streak, which may end in a probe."""
        self._plain_streak += 1
        self._plain_time += self.step_cost(batch_size, 1)
        if self.probe_every and self._plain_streak > self.probe_every \
                and self._probe_affordable(batch_size, switch_cost):
            self._end_plain_streak()
            self.probing = True
            return self.block_lens[0]
        return 1

    def observe_probe(self, batch_size: int, excess: float) -> None:
        """The wall time a probe step took beyond a plain step at `batch_size` (its verify, its
        drafting and its catch-up, host included): later probes there are budgeted at no less.
        NOTE: the modelled price leaves out what the profile does not time (the catch-up's
        host work, the drafter's first run after a detached stretch), which can be several
        times the modelled extra at large batches (docs/benchmarks.md, "Where the steps go")."""
        self._probe_excess[batch_size] = max(0.0, excess)

    def _end_plain_streak(self) -> None:
        """A speculative choice (or a probe): the streak, its held choice and its probe's
        catch-up price start over."""
        self._plain_streak, self._plain_time, self._memo_left = 0, 0.0, 0
        self._probe_switch = (None, 0.0)

    def _probe_affordable(self, batch_size: int, switch_cost: SwitchCost | None) -> bool:
        """With `probe_overhead` > 0, a probe also waits until its worst-case extra time (a probe
        that commits one token per sequence, like a plain step) is at most that fraction of the
        time spent in the plain streak: at large batches verification costs several plain steps,
        so probes there are rarer. A probe also pays the whole `switch_cost` (asked only once
        the step's own extra fits the budget). The extra is at least what the last probe at
        this batch size measured (observe_probe)."""
        if not self.probe_overhead:
            return True
        budget = self.probe_overhead * self._plain_time
        measured = self._probe_excess.get(batch_size, 0.0)
        extra = self.cost_model.cost(batch_size, self.block_lens[0]) \
            - self.cost_model.cost(batch_size, 1)
        if max(extra, measured) > budget:
            return False
        if switch_cost is not None:
            # NOTE: re-asked every RECHECK_PLAIN streak steps only (it can walk the batch): a
            # catch-up grows with the streak, so the probe may come those few steps early.
            at, switch_s = self._probe_switch
            if at is None or self._plain_streak - at >= RECHECK_PLAIN:
                switch_s = switch_cost(batch_size, self.cost_model)[0]
                self._probe_switch = (self._plain_streak, switch_s)
            extra += switch_s
        return max(extra, measured) <= budget

    def explain(self, batch_size: int, tracker: AcceptanceTracker, drain: DrainArg = None
                ) -> dict[str, Any]:
        """Per-candidate expected rate and tau, plus the argmax and the best speculative gain
        (side-effect free; without the switch cost and plain decode's sampling steps; the drain
        priced only where plain decode does not already win)."""
        if self.mode == "fixed":
            return {"mode": "fixed", "choice": self.fixed_len, "batch_size": batch_size}
        moments, costs = cands = self._candidates(batch_size, tracker)
        rates, drain = self._priced(batch_size, cands, drain)
        return {"mode": self.mode, "batch_size": batch_size, "choice": self._best(rates),
                "gain": self.gain(rates), "rates": rates,
                "drain": None if drain is None else {"requests": len(drain.left),
                                                     "most_left": drain.left[-1]},
                "overhead_s": {L: costs[L] - self.cost_model.cost(batch_size, L) for L in rates},
                "tau": {1: 1.0, **{L: mean for L, (mean, _) in moments.items()}},
                "acceptance": tracker.conditional_rates(max(self.block_lens) - 1)}
