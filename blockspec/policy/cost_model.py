"""Measured step costs by (block length, batch bucket): the speculation policy's cost model, and
the identity of a stored profile (engine/cost_profile.py measures and caches it)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["PROFILE_VERSION", "StepCostModel", "profile_key"]

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
        self._memo: dict[tuple[int, int], float] = {}  # NOTE: the table never changes

    @property
    def block_lens(self) -> list[int]:
        return sorted(self._table)

    def cost(self, batch_size: int, block_len: int) -> float:
        """Step time for `batch_size` sequences at `block_len`.

        NOTE: linear in batch size between measured buckets; below the smallest bucket the smallest
        bucket's time (a step never gets cheaper than its smallest graph); beyond the largest,
        proportional to batch size (t(B) = t(Bmax) * B / Bmax).
        """
        got = self._memo.get((batch_size, block_len))
        if got is not None:
            return got
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        got = self._memo[batch_size, block_len] = self._interpolate(batch_size, block_len)
        return got

    def _interpolate(self, batch_size: int, block_len: int) -> float:
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

    def min_token_cost(self) -> float:
        """The cheapest measured seconds per verified token (t / (B x L) over the table): a
        lower bound for a token of a large batched forward, such as a prefill."""
        return min(t / (b * L) for L, pts in self._table.items() for b, t in pts)

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
