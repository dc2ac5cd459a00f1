"""Speculation policy: pick the block length per step from measured step costs and live acceptance.

A speculative step of block length L verifies L tokens (the last committed token's successor plus
L - 1 drafts) and commits 1 + (accepted drafts) tokens; plain decode (L = 1) commits exactly one.
The policy maximises expected committed tokens per second for the current batch:
    rate(L) = B * E[committed | L] / cost(B, L).
Pure Python (no torch) so it can be unit-tested and profiled on any host.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PROFILE_VERSION = 1


def profile_key(model: str, device: str, dtype: Any, kv_block_size: int,
                block_lens: Sequence[int]) -> dict[str, Any]:
    """Identity of a cost profile; a profile measured under another key is stale."""
    return {"model": str(model), "device": str(device), "dtype": str(dtype),
            "kv_block_size": int(kv_block_size), "block_lens": sorted({int(x) for x in block_lens})}


class StepCostModel:
    """Measured step time (seconds) by block length and batch bucket.

    `times[L][bucket]`: L = 1 is plain decode, L > 1 one whole speculative step (draft + verify).
    NOTE: L = 1 must be measured (it is the baseline every policy compares against), and every
    block length needs at least one bucket; times must be finite and > 0.
    """

    def __init__(self, times: Mapping[int, Mapping[int, float]]) -> None:
        if not times:
            raise ValueError("empty cost table")
        table: dict[int, list[tuple[int, float]]] = {}
        for L, row in times.items():
            if int(L) != L or L < 1:
                raise ValueError(f"invalid block length {L!r}")
            if not row:
                raise ValueError(f"block length {L} has no measured bucket")
            pts = []
            for b, t in row.items():
                if int(b) != b or b < 1:
                    raise ValueError(f"invalid batch bucket {b!r} for block length {L}")
                if not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
                    raise ValueError(f"step time for (B={b}, L={L}) must be finite and > 0: {t!r}")
                pts.append((int(b), float(t)))
            table[int(L)] = sorted(pts)
        if 1 not in table:
            raise ValueError("plain decode (block length 1) must be measured")
        self._table = table

    @property
    def block_lens(self) -> list[int]:
        return sorted(self._table)

    def cost(self, batch_size: int, block_len: int) -> float:
        """Step time for `batch_size` sequences at `block_len`.

        NOTE: linear in batch size between measured buckets; below the smallest bucket the smallest
        bucket's time (a step never gets cheaper than its smallest graph); beyond the largest,
        proportional to batch size (t(B) = t(Bmax) * B / Bmax).
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        pts = self._table.get(block_len)
        if pts is None:
            raise KeyError(f"block length {block_len} was not measured ({self.block_lens})")
        if batch_size <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if batch_size <= b1:
                return t0 + (t1 - t0) * (batch_size - b0) / (b1 - b0)
        bmax, tmax = pts[-1]
        return tmax * batch_size / bmax

    def to_json(self, key: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, "key": dict(key) if key is not None else None,
                "times": {str(L): {str(b): t for b, t in pts} for L, pts in self._table.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepCostModel:
        try:
            times = {int(L): {int(b): float(t) for b, t in row.items()}
                     for L, row in data["times"].items()}
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed cost profile: {e!r}") from e
        return cls(times)

    def save(self, path: str | os.PathLike, key: Mapping[str, Any]) -> None:
        # NOTE: write-then-rename, so a crash never leaves a half-written profile behind.
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(key), indent=1, sort_keys=True))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike, key: Mapping[str, Any]) -> StepCostModel | None:
        """The stored profile, or None if there is none or it was measured under another key."""
        path = Path(path)
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        if data.get("version") != PROFILE_VERSION or data.get("key") != dict(key):
            return None
        return cls.from_json(data)


class AcceptanceTracker:
    """Exponentially decayed per-position acceptance counts (positions j = 1, 2, ...).

    NOTE: acceptance is prefix-wise: in a step with `accepted` = k of `drafted` = d, positions
    1..min(k+1, d) were reached and positions 1..k accepted. Each observation (and each `tick`)
    first multiplies all counts by 0.5 ** (1 / half_life), so evidence `half_life` verify steps
    old weighs half as much as fresh evidence.
    """

    def __init__(self, half_life: float = 64.0, prior_mean: float = 0.5,
                 prior_weight: float = 2.0) -> None:
        if not half_life > 0:
            raise ValueError("half_life must be > 0")
        if not 0.0 < prior_mean < 1.0:
            raise ValueError("prior_mean must be in (0, 1)")
        if not prior_weight > 0:
            raise ValueError("prior_weight must be > 0")
        self.half_life = float(half_life)
        self.decay = 0.5 ** (1.0 / half_life)
        self.prior_mean = float(prior_mean)
        self.prior_weight = float(prior_weight)
        self.reached: list[float] = []
        self.accepted: list[float] = []

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
    if block_len < 1 or len(rates) < block_len - 1:
        raise ValueError(f"need block_len >= 1 and {block_len - 1} rates, got {len(rates)}")
    total, reach = 1.0, 1.0
    for p in rates[:block_len - 1]:
        reach *= p
        total += reach
    return total


class SpeculationPolicy:
    """Chooses plain decode (1) or one of `block_lens` for each step.

    NOTE: deterministic given (batch_size, tracker state, call history); ties go to the smaller
    block length. Speculation is chosen only if its best rate exceeds min_gain * the plain rate.
    `probe_every` > 0: after that many consecutive plain-decode choices in adaptive mode, the next
    choice is the smallest block, so acceptance statistics can recover (plain steps observe none).
    """

    def __init__(self, cost_model: StepCostModel, block_lens: Sequence[int] = (4, 8, 16),
                 mode: str = "adaptive", fixed_len: int = 16, min_gain: float = 1.0,
                 probe_every: int = 0) -> None:
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
        if min_gain <= 0 or probe_every < 0:
            raise ValueError("min_gain must be > 0 and probe_every >= 0")
        self.cost_model = cost_model
        self.mode = mode
        self.fixed_len = fixed_len
        self.min_gain = float(min_gain)
        self.probe_every = probe_every
        self._plain_streak = 0

    def rates(self, batch_size: int, tracker: AcceptanceTracker) -> dict[int, float]:
        """Expected committed tokens/s for each candidate (1 and every block length)."""
        p = tracker.conditional_rates(max(self.block_lens) - 1)
        out = {1: batch_size / self.cost_model.cost(batch_size, 1)}
        for L in self.block_lens:
            tau = expected_committed_from_rates(p, L)
            out[L] = batch_size * tau / self.cost_model.cost(batch_size, L)
        return out

    def _best(self, rates: Mapping[int, float]) -> int:
        best = self.block_lens[0]
        for L in self.block_lens[1:]:
            if rates[L] > rates[best]:  # strict: ties keep the smaller block
                best = L
        return best if rates[best] > self.min_gain * rates[1] else 1

    def choose(self, batch_size: int, tracker: AcceptanceTracker) -> int:
        if self.mode == "fixed":
            return self.fixed_len
        choice = self._best(self.rates(batch_size, tracker))
        if choice == 1:
            self._plain_streak += 1
            if self.probe_every and self._plain_streak > self.probe_every:
                self._plain_streak = 0
                return self.block_lens[0]
        else:
            self._plain_streak = 0
        return choice

    def explain(self, batch_size: int, tracker: AcceptanceTracker) -> dict[str, Any]:
        """Per-candidate expected rate and tau, plus the argmax (side-effect free)."""
        if self.mode == "fixed":
            return {"mode": "fixed", "choice": self.fixed_len, "batch_size": batch_size}
        rates = self.rates(batch_size, tracker)
        return {"mode": self.mode, "batch_size": batch_size, "choice": self._best(rates),
                "rates": rates,
                "tau": {L: tracker.expected_committed(L) for L in [1, *self.block_lens]},
                "acceptance": tracker.conditional_rates(max(self.block_lens) - 1)}
