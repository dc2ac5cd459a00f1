"""Where an engine's steps go, by kind: steps, wall seconds and committed tokens per (execute
path, block length). Benchmarks report it per level, so a throughput figure comes with the steps
that made it (all-decode against mixed, plain against speculative)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StepMix"]


@dataclass
class StepMix:
    """Sums per (path, block length): path is the step's Plan.path ("decode", "flat", "eager";
    "detached" for a plain decode step while the lazy drafter context is detached), "ahead" for
    an async-scheduled plain decode (its wall time is the host's launch and the previous step's
    commit, its tokens those the previous step appended), or "settle" for the commit of an
    async step before a synchronous one; block length 0 is a step in which nothing decoded
    (prefills alone)."""

    cells: dict[tuple[str, int], list[float]] = field(default_factory=dict)

    def add(self, path: str, block_len: int, seconds: float, tokens: int) -> None:
        cell = self.cells.setdefault((path, block_len), [0, 0.0, 0])
        cell[0] += 1
        cell[1] += seconds
        cell[2] += tokens

    def copy(self) -> StepMix:
        return StepMix({k: list(v) for k, v in self.cells.items()})

    def since(self, before: StepMix) -> dict[str, dict[str, float]]:
        """What was added after the snapshot `before`, keyed "path/L": steps, total and mean
        milliseconds, committed tokens, and the share of the time."""
        diff = {}
        for key, (n, s, t) in self.cells.items():
            n0, s0, t0 = before.cells.get(key, (0, 0.0, 0))
            if n > n0:
                diff[key] = (n - n0, s - s0, t - t0)
        total = sum(s for _, s, _ in diff.values()) or 1.0
        return {f"{path}/{L}": {"steps": n, "ms": round(1e3 * s, 3),
                                "ms_per_step": round(1e3 * s / n, 3), "tokens": t,
                                "time_share": round(s / total, 4)}
                for (path, L), (n, s, t) in sorted(diff.items())}
