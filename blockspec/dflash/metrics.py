"""Acceptance statistics, per request and aggregated over the engine's life."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_steps: int = 0  # verify steps that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # NOTE: histograms, O(1) per step and sequence (per-position counts derive from them; they
    # were a loop over the drafts, for every sequence, in every speculative step's host time).
    drafted_hist: Counter = field(default_factory=Counter)  # drafts in a step -> steps
    acceptance_length_hist: Counter = field(default_factory=Counter)  # tau -> steps
    # Decode steps by block length run (1 = plain decode, no drafts). Engine-wide: one count per
    # engine step (the policy's choice); per request: one count per step of that request (its
    # block, which may be shorter than the choice near the end of the context).
    block_len_steps: Counter = field(default_factory=Counter)
    # Per request: tokens its prefills emitted and tokens its speculative steps committed; the
    # rest came one per plain decode step (settle_plain_steps).
    num_prefill_tokens: int = 0
    num_spec_tokens: int = 0

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.num_steps += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.drafted_hist[drafted] += 1
        self.acceptance_length_hist[accepted + 1] += 1

    @property
    def drafted_per_position(self) -> list[int]:
        """Steps that drafted position j (j = 1..max drafts)."""
        return _tail_counts(self.drafted_hist, 0)

    @property
    def accepted_per_position(self) -> list[int]:
        """Steps that accepted position j (acceptance is prefix-wise: accepted >= j)."""
        got = _tail_counts(self.acceptance_length_hist, 1)
        return got + [0] * (len(self.drafted_per_position) - len(got))

    def record_block_len(self, block_len: int) -> None:
        if block_len >= 1:
            self.block_len_steps[block_len] += 1

    def settle_plain_steps(self, num_output_tokens: int) -> None:
        """Per request: its plain decode steps (block length 1) from its token counts, each such
        step committing exactly one token. NOTE: counted this way, not per sequence and step,
        since at large batches that count was a measurable part of a plain step's host time."""
        plain = num_output_tokens - self.num_prefill_tokens - self.num_spec_tokens
        if plain > 0:
            self.block_len_steps[1] = plain
        else:
            self.block_len_steps.pop(1, None)

    def merge(self, other: SpecStats) -> None:
        self.drafted_hist.update(other.drafted_hist)
        self.num_steps += other.num_steps
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.acceptance_length_hist.update(other.acceptance_length_hist)
        self.block_len_steps.update(other.block_len_steps)
        self.num_prefill_tokens += other.num_prefill_tokens
        self.num_spec_tokens += other.num_spec_tokens

    @property
    def mean_acceptance_length(self) -> float:
        """tau: tokens committed per verify step (accepted drafts + the target's bonus)."""
        return (self.num_accepted_tokens + self.num_steps) / self.num_steps if self.num_steps \
            else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """P(draft j accepted | drafted), j = 1..B-1 (acceptance is prefix-wise)."""
        return [a / d if d else 0.0
                for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def block_len_summary(self) -> str:
        """`{1:12 4:3 16:40}`: decode steps by block length (1 = plain decode)."""
        return "{" + " ".join(f"{k}:{v}" for k, v in sorted(self.block_len_steps.items())) + "}"

    def summary(self) -> str:
        rates = " ".join(f"{r:.2f}" for r in self.acceptance_rate_per_position)
        return (f"acceptance length {self.mean_acceptance_length:.2f} over {self.num_steps} "
                f"steps; accepted {self.num_accepted_tokens}/{self.num_draft_tokens} drafts; "
                f"per position: {rates}")


def _tail_counts(hist: Counter, offset: int) -> list[int]:
    """[#(k - offset > j) for j = 0..max - offset - 1] over a histogram of k."""
    top = max((k for k, v in hist.items() if v), default=offset) - offset
    out = [0] * max(top, 0)
    for k, v in hist.items():
        for j in range(min(k - offset, top)):
            out[j] += v
    return out
