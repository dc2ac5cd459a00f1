"""The live correction of the step-cost model: what a decode step takes beyond its profile."""

from __future__ import annotations

__all__ = ["MIN_SAMPLES", "STALE_AFTER", "StepOverhead"]

# Plain decode's term at a batch size counts as known after this many observations since it was
# last (re)started; the policy takes plain steps to get them (SpeculationPolicy.choose).
MIN_SAMPLES = 3
# A term not observed during this many observed steps (at any batch size) is stale: its next
# observation restarts it, and plain decode's is sampled again.
STALE_AFTER = 512


class StepOverhead:
    """Per (batch size, block length), a moving average of what a decode step really took (wall
    time, host included) beyond its modelled device time.

    The start-up profile times graph replays at one context length; a served step also pays the
    host (scheduling, input copies, output processing: ~4 ms at B=256 on an H200 host) and the
    attention over longer contexts. That makes a plain step dearer relative to a speculative step
    that commits several tokens (H200, a=0.86, B=256: block 4 commits ~1.2x plain's tokens/s
    measured, 1.02x by the profile alone).

    Unobserved terms borrow, so that the policy's first guess errs towards a step it can check
    cheaply: a speculative block length borrows plain decode's term at that batch size, and
    plain decode borrows the smallest speculative term there (a speculative step does at least
    a plain step's host work). A borrowed or stale plain term is then measured at once: while
    `plain_needs_samples`, the policy decodes plainly for a step wherever plain decode is not
    far behind (H200 runs: left at the profile alone (+0), plain decode looked best and the run
    fell 10% behind block 4 at a=0.86, B=256; borrowed and never checked, block 4 ran at 0.94x
    plain at a=0.6, B=128; a term learned in a batch's tail (+3.6 ms) and never refreshed did
    the same).
    NOTE: one term per graph bucket, whatever the sequences in the step: a batch's tail runs
    fewer than its bucket and may pay another overhead, but an error there corrects itself where
    it matters: a term read low makes its candidate chosen, and so observed at full load (H200,
    a=0.86, bucket 256: plain decode's term read 2.7 ms after a tail, 4.2 ms at full load), while
    a term read high (as scaling by the sequences a tail ran makes it) keeps its candidate
    unchosen until it goes stale.
    NOTE: an observation is clipped to [0, modelled]: the profile stays a lower bound, and one
    outlier step (a GC pause) moves the estimate by at most one modelled step over the samples
    averaged (the first 1 / alpha are averaged equally, then `alpha` per observation).
    """

    def __init__(self, alpha: float = 0.1, min_samples: int = MIN_SAMPLES,
                 stale_after: int = STALE_AFTER) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if min_samples < 1 or stale_after < 1:
            raise ValueError("min_samples and stale_after must be >= 1")
        self.alpha = alpha
        self.min_samples = min_samples
        self.stale_after = stale_after
        self.seconds: dict[tuple[int, int], float] = {}
        self.samples: dict[tuple[int, int], int] = {}  # since the term was (re)started
        self._seen: dict[tuple[int, int], int] = {}  # clock at the last observation
        self.clock = 0  # observed steps

    def observe(self, batch_size: int, block_len: int, modelled: float, wall: float) -> None:
        key = (batch_size, block_len)
        x = min(max(wall - modelled, 0.0), modelled)
        n = 1 if self._stale(key) else self.samples[key] + 1
        self.clock += 1
        prev = self.seconds.get(key, x)
        self.seconds[key] = prev + max(self.alpha, 1.0 / n) * (x - prev)
        self.samples[key] = n
        self._seen[key] = self.clock

    def _stale(self, key: tuple[int, int]) -> bool:
        return key not in self._seen or self.clock - self._seen[key] > self.stale_after

    def plain_needs_samples(self, batch_size: int) -> bool:
        """Plain decode's term at `batch_size` is unobserved, stale or under `min_samples`."""
        key = (batch_size, 1)
        return self._stale(key) or self.samples[key] < self.min_samples

    def __call__(self, batch_size: int, block_len: int) -> float:
        """Seconds to add to a step of `block_len` at `batch_size`."""
        got = self.seconds.get((batch_size, block_len))
        if got is not None:
            return got
        if block_len != 1:
            return self(batch_size, 1)
        spec = [s for (b, L), s in self.seconds.items() if b == batch_size and L != 1]
        return min(spec, default=0.0)
