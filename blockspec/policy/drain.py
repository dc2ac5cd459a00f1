"""A draining batch's stragglers: what a block length really commits per step when the batch lasts
until its slowest sequence is done (no later request takes a finished one's slot)."""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from statistics import NormalDist

__all__ = ["Drain", "drained_tau", "expected_max_normal"]


@functools.lru_cache(maxsize=1024)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (Blom's approximation; 0 for n <= 1)."""
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) if n > 1 else 0.0


def drained_tau(mean: float, var: float, num_seqs: int, horizon: float) -> float:
    """Tokens per sequence per step that a draining batch really gets from a block whose steps
    commit `mean` tokens (variance `var`), when `num_seqs` sequences each have up to `horizon`
    tokens left and the batch lasts until the slowest is done.

    A sequence needs S steps: E[S] ~ (horizon + overshoot) / mean, where the last step
    overshoots the horizon by ((var + mean^2) / mean - 1) / 2 tokens on average, and sd(S) ~
    sqrt(horizon * var / mean^3) (renewal theory); the batch needs E[max S] ~ E[S] +
    expected_max_normal(num_seqs) sd(S). Plain decode (var 0) needs exactly `horizon`.
    NOTE: measured on a closed batch at fixed lengths (H200, a=0.6, block 4, 128 sequences of
    256 tokens): ~118 steps by the mean alone, 134-143 measured, 133 by this; per step block 4
    beat plain decoding by ~6%, over the run it lost 5%."""
    if horizon <= 0:
        return mean
    overshoot = ((var + mean * mean) / mean - 1.0) / 2.0
    steps = (horizon + overshoot) / mean \
        + expected_max_normal(num_seqs) * math.sqrt(horizon * var / mean ** 3)
    return horizon / max(1.0, steps)


@dataclass(frozen=True)
class Drain:
    """A draining batch: the tokens each unfinished request has left (`max_tokens`; an
    end-of-sequence token may come sooner), ascending."""

    left: tuple[int, ...]

    @classmethod
    def of(cls, left: Iterable[int]) -> Drain:
        got = tuple(sorted(left))
        if not got:
            raise ValueError("a draining batch needs at least one request")
        return cls(got)

    def tau(self, mean: float, var: float) -> float:
        """drained_tau for the request with the most tokens left, racing the requests that could
        still finish after it: those within one sd of its tokens over its remaining steps (at
        the start of a closed batch of equal lengths, all of them; later, those that fell
        behind, as a request's progress is a random walk)."""
        horizon = self.left[-1]
        spread = math.sqrt(horizon * var / mean)
        racing = len(self.left) - bisect.bisect_left(self.left, horizon - spread)
        return drained_tau(mean, var, racing, horizon)
