"""Why a level's inter-token gaps are long: every engine step of the level (its kind, wall time,
the prefill tokens it computed, the sequences decoding beside them), and each gap between two
outputs of a stream over a threshold attributed to the steps that ended inside it. Benchmark
diagnostics only (`blockspec bench offline --step-trace`); nothing here runs while serving."""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from blockspec.engine.llm_engine import LLMEngine
from blockspec.engine.step_result import StepTimings

__all__ = ["StepTrace"]

# Raw steps kept per level in the result (a C = 32 level of the 8B shape has ~300).
MAX_RAW_STEPS = 4000


@dataclass
class TraceStep:
    end: float  # time.monotonic() when engine.step() returned
    kinds: tuple[str, ...]  # StepMix keys ("path/L") the call added: a settle and a step, say
    ms: float  # the call's wall time
    prefill_tokens: int  # prompt tokens the call computed
    num_decoding: int  # running sequences past their prompts when it began
    host_ms: float  # StepTimings.runner_host of the call: the runner's host work
    wait_ms: float  # StepTimings.device_wait: blocked on the device at the step's sync


@dataclass
class StepTrace:
    threshold_ms: float = 25.0
    steps: list[TraceStep] = field(default_factory=list)
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (previous output, this one)
    _counts: dict[tuple[str, int], int] = field(default_factory=dict)
    _prefilling: list[tuple[Any, int]] = field(default_factory=list)
    _decoding: int = 0
    _start: float = 0.0
    _timings: StepTimings | None = None

    def before(self, engine: LLMEngine, now: float) -> None:
        """Called just before `engine.step()`."""
        sched = engine.scheduler
        # NOTE: prompt positions only: a decoding sequence's computed count moves with steps
        # in flight (async scheduling), its prompt's never after it is prefilled.
        self._prefilling = [(s, s.num_computed_tokens) for s in (*sched.running, *sched.waiting)
                            if s.num_computed_tokens < len(s.prompt_token_ids)]
        self._decoding = sum(1 for s in sched.running
                             if s.num_computed_tokens >= len(s.prompt_token_ids))
        self._counts = {k: v[0] for k, v in engine.step_mix.cells.items()}
        self._timings = engine.timings.copy()
        self._start = now

    def after(self, engine: LLMEngine, now: float) -> None:
        """Called just after `engine.step()` returned."""
        kinds = tuple(f"{p}/{L}" for (p, L), v in sorted(engine.step_mix.cells.items())
                      if v[0] > self._counts.get((p, L), 0))
        prefill = sum(min(s.num_computed_tokens, len(s.prompt_token_ids)) - n
                      for s, n in self._prefilling)
        t = engine.timings
        self.steps.append(TraceStep(
            now, kinds, 1e3 * (now - self._start), prefill, self._decoding,
            1e3 * (t.runner_host - self._timings.runner_host),
            1e3 * (t.device_wait - self._timings.device_wait)))

    def gap(self, start: float, end: float) -> None:
        self.gaps.append((start, end))

    def summary(self) -> dict[str, Any]:
        """The slow gaps grouped by what ran inside them, and the raw steps."""
        slow = [(a, b) for a, b in self.gaps if 1e3 * (b - a) > self.threshold_ms]
        ends = [s.end for s in self.steps]  # NOTE: ascending: steps are recorded in order
        groups: Counter[str] = Counter()
        for a, b in slow:
            inside = self.steps[bisect_right(ends, a):bisect_right(ends, b)]
            groups[" + ".join(self._label(s) for s in inside) or "(no step)"] += 1
        t0 = self.steps[0].end - self.steps[0].ms / 1e3 if self.steps else 0.0
        return {
            "threshold_ms": self.threshold_ms, "gaps": len(self.gaps), "slow_gaps": len(slow),
            "slow_share": round(len(slow) / max(1, len(self.gaps)), 4),
            "slow_by_steps_inside": dict(groups.most_common(20)),
            "steps": [[round(1e3 * (s.end - t0), 2), "+".join(s.kinds), round(s.ms, 2),
                       s.prefill_tokens, s.num_decoding, round(s.host_ms, 2),
                       round(s.wait_ms, 2)] for s in self.steps[:MAX_RAW_STEPS]],
            "steps_columns": ["end_ms", "kinds", "ms", "prefill_tokens", "num_decoding",
                              "host_ms", "wait_ms"],
        }

    @staticmethod
    def _label(s: TraceStep) -> str:
        """A step's kinds, with its prefill in buckets of 256 tokens (so gaps group)."""
        kinds = "+".join(s.kinds) or "idle"
        if not s.prefill_tokens:
            return kinds
        return f"{kinds}[prefill<={-(-s.prefill_tokens // 256) * 256}]"
