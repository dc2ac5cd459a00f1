"""Decayed per-position acceptance statistics of speculative steps, and the expected number of
tokens a block commits. Pure Python (no torch)."""

from __future__ import annotations

from collections.abc import Sequence


class AcceptanceTracker:
    """Exponentially decayed per-position acceptance counts (positions j = 1, 2, ...).

    NOTE: acceptance is prefix-wise: in a step with `accepted` = k of `drafted` = d, positions
    1..min(k+1, d) were reached and positions 1..k accepted. Each observation (and each `tick`)
    first multiplies all counts by 0.5 ** (1 / half_life), so evidence `half_life` verify steps
    old weighs half as much as fresh evidence; `observe_many` takes one step's observations of
    a whole batch as one unit of time. `max_weight` (optional) caps the evidence (see `_cap`).
    """

    def __init__(self, half_life: float = 64.0, prior_mean: float = 0.5,
                 prior_weight: float = 2.0, max_weight: float | None = None) -> None:
        if not half_life > 0:
            raise ValueError("half_life must be > 0")
        if not 0.0 < prior_mean < 1.0:
            raise ValueError("prior_mean must be in (0, 1)")
        if not prior_weight > 0:
            raise ValueError("prior_weight must be > 0")
        if max_weight is not None and not max_weight > 0:
            raise ValueError("max_weight must be > 0")
        self.max_weight = max_weight
        self.half_life = float(half_life)
        self.decay = 0.5 ** (1.0 / half_life)
        self.prior_mean = float(prior_mean)
        self.prior_weight = float(prior_weight)
        self.reached: list[float] = []
        self.accepted: list[float] = []
        self.num_updates = 0  # observations taken (not ticks): a policy's memo checks it

    def tick(self) -> None:
        """Decay without an observation (e.g. a plain-decode step), so stale evidence fades."""
        self.reached = [x * self.decay for x in self.reached]
        self.accepted = [x * self.decay for x in self.accepted]

    def observe(self, drafted: int, accepted: int) -> None:
        if not 0 <= accepted <= drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got {accepted}/{drafted}")
        if drafted == 0:
            return
        self.tick()
        if drafted > len(self.reached):
            grow = drafted - len(self.reached)
            self.reached += [0.0] * grow
            self.accepted += [0.0] * grow
        for j in range(min(accepted + 1, drafted)):  # index j is position j + 1
            self.reached[j] += 1.0
            self.accepted[j] += j < accepted
        self.num_updates += 1
        self._cap()

    def observe_many(self, drafted: Sequence[int], accepted: Sequence[int]) -> None:
        """One engine step's observations (one per sequence), as one unit of time.

        NOTE: decays once, then adds every observation at full weight, so `half_life` counts
        steps, not sequences: a batch of 256 is 256 fresh samples, not 256 decay periods.
        O(observations + positions), no per-position loop per observation.
        """
        if len(drafted) != len(accepted):
            raise ValueError("drafted and accepted must have the same length")
        pairs = [(d, a) for d, a in zip(drafted, accepted) if d > 0]
        for d, a in pairs:
            if not 0 <= a <= d:
                raise ValueError(f"need 0 <= accepted <= drafted, got {a}/{d}")
        if not pairs:
            return
        self.tick()
        n = max(d for d, _ in pairs)
        if n > len(self.reached):
            grow = n - len(self.reached)
            self.reached += [0.0] * grow
            self.accepted += [0.0] * grow
        # Difference arrays: each observation reaches positions [0, min(a+1, d)) and accepts
        # positions [0, a).
        reach_end = [0] * (n + 1)
        acc_end = [0] * (n + 1)
        for d, a in pairs:
            reach_end[min(a + 1, d)] += 1
            acc_end[a] += 1
        reach = acc = len(pairs)
        for j in range(n):
            reach -= reach_end[j]
            acc -= acc_end[j]
            self.reached[j] += reach
            self.accepted[j] += acc
        self.num_updates += 1
        self._cap()

    def _cap(self) -> None:
        """NOTE: with `max_weight`, the evidence is scaled down (ratios kept) to at most that many
        observations at position 1: after a long stretch at a large batch, its hundreds of
        thousands of samples would otherwise outweigh fresh small-batch evidence for hundreds of
        steps."""
        if self.max_weight is not None and self.reached and self.reached[0] > self.max_weight:
            f = self.max_weight / self.reached[0]
            self.reached = [x * f for x in self.reached]
            self.accepted = [x * f for x in self.accepted]

    def conditional_rates(self, n: int | None = None) -> list[float]:
        """p_j = P(accept j | reached j), j = 1..n (default: positions observed so far).

        NOTE: Beta prior with weight `prior_weight`; position 1's prior mean is `prior_mean`, and
        position j's is p_{j-1}, so a position never reached (e.g. beyond the block lengths run
        so far) extrapolates its predecessor instead of snapping back to `prior_mean`.
        """
        n = len(self.reached) if n is None else n
        rates: list[float] = []
        mean = self.prior_mean
        w = self.prior_weight
        for j in range(n):
            r = self.reached[j] if j < len(self.reached) else 0.0
            a = self.accepted[j] if j < len(self.accepted) else 0.0
            mean = (a + w * mean) / (r + w)
            rates.append(mean)
        return rates

    def expected_committed(self, block_len: int) -> float:
        """E[tokens committed per verify step of length L] = 1 + sum_{k<L} prod_{j<=k} p_j."""
        return expected_committed_from_rates(self.conditional_rates(block_len - 1), block_len)


def expected_committed_from_rates(rates: Sequence[float], block_len: int) -> float:
    """E[tokens committed per verify step of length L]: committed_moments_from_rates' mean."""
    return committed_moments_from_rates(rates, block_len)[0]


def committed_moments_from_rates(rates: Sequence[float], block_len: int | Sequence[int]
                                 ) -> tuple[float, float] | dict[int, tuple[float, float]]:
    """(mean, variance) of the tokens k one verify step of length L commits; for a sequence of
    block lengths, a dict of them by length (one pass over the positions).

    P(k >= j) = prod_{i<j} p_i (k >= 1 always); E[k] = sum_j P(k >= j) and
    E[k^2] = sum_j (2j - 1) P(k >= j), for j = 1..L."""
    lens = [block_len] if isinstance(block_len, int) else sorted(block_len)
    if not lens or lens[0] < 1 or len(rates) < lens[-1] - 1:
        raise ValueError(f"need block lengths >= 1 and {lens[-1] - 1 if lens else 0} rates, "
                         f"got {len(rates)}")
    out: dict[int, tuple[float, float]] = {}
    mean, square, reach = 1.0, 1.0, 1.0
    want = iter(lens)
    L = next(want)
    for j in range(1, lens[-1] + 1):
        if j > 1:
            reach *= rates[j - 2]
            mean += reach
            square += (2 * j - 1) * reach
        while L == j:
            out[L] = (mean, max(0.0, square - mean * mean))
            L = next(want, None)
    return out[block_len] if isinstance(block_len, int) else out
