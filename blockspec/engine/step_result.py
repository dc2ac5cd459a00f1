"""What one model-runner step hands back to the engine."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from blockspec.engine.sequence import Sequence

Logprobs = dict[int, float] | None


@dataclass
class StepResult:
    advance: list[int]  # per scheduled seq: tokens whose K/V this step committed
    sampled_seqs: list[Sequence]
    tokens: list[list[int]]  # per sampled seq: emitted tokens, in order
    logprobs: list[list[Logprobs]]
    drafted: list[int]  # per sampled seq: draft tokens verified this step (0 without a draft)
    accepted: list[int]  # per sampled seq: of which accepted
    # Per sampled seq: its decode block length (1 = plain), 0 if it sampled after a prefill.
    block_lens: list[int] = field(default_factory=list)
    block_len: int = 0  # the step's chosen block length (0: no sequence was decoding)
    path: str = ""  # the execute path that ran it (Plan.path)


@dataclass
class StepTimings:
    """Where engine steps spend wall time, summed over steps (seconds).

    NOTE: the engine syncs with the device once per step, so host time is not hidden behind the
    device: at large batches `schedule + runner_host + postprocess` is what a faster host would
    win. `device_wait` is the time the host blocked at the step's one sync (on a GPU: the device
    still running the step; on CPU ~0, the work is in `runner_host`). In an eager (prefill or
    mixed) step a host-to-device copy issued mid-step waits for the stream, so there
    `runner_host` holds device time too; graphed decode steps split cleanly."""

    steps: int = 0
    schedule: float = 0.0  # scheduler: admission, preemption, block allocation
    runner_host: float = 0.0  # runner outside the sync: inputs, launches, eager ops, results
    device_wait: float = 0.0  # runner: blocked at the host sync
    postprocess: float = 0.0  # engine: tokens appended, stops, metrics, outputs

    def add(self, other: StepTimings, sign: int = 1) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + sign * getattr(other, f.name))

    def copy(self) -> StepTimings:
        return replace(self)

    def per_step_ms(self) -> dict[str, float]:
        """Mean milliseconds per step for each part (empty before the first step)."""
        if not self.steps:
            return {}
        return {f.name: 1e3 * getattr(self, f.name) / self.steps
                for f in fields(self) if f.name != "steps"}

