"""Async scheduling of plain decode (vLLM's `--async-scheduling`, SGLang's overlap scheduler): the
next decode step is scheduled and launched while the previous one runs, its input tokens copied
on the device from that step's picks, so the host's scheduling, input filling and output
processing overlap the device instead of waiting for it.

A step launched ahead advances each sequence's `num_computed_tokens` and `num_in_flight` by one;
its picks come back to the host (a non-blocking copy) and are committed after the next step is
launched. A sequence that the committed token finishes (EOS, a stop string) has one more token
in flight, which is dropped. Plain decode only, all-greedy batches without logprobs: a sampled
row's draw or a speculative step's schedule would depend on the tokens still in flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from blockspec.engine.scheduler import SchedulerOutput
from blockspec.engine.sequence import Sequence
from blockspec.engine.step_result import StepResult


def pipelinable(running: list[Sequence]) -> bool:
    """Whether a decode step of these sequences may run ahead of the previous one's tokens."""
    return bool(running) and all(s.plain_greedy and s.params.logprobs is None for s in running)


@dataclass
class PendingDecode:
    """A launched plain-decode step whose picks the host has not read yet."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [n] on the device (a graph's output: read before its next replay)
    host: torch.Tensor  # [n] the picks' host copy, complete once `event` is
    event: torch.cuda.Event | None

    @classmethod
    def start(cls, seqs: list[Sequence], tokens: torch.Tensor) -> PendingDecode:
        """Queues the picks' copy to the host after the step's kernels; marks the step's token
        as in flight for every sequence."""
        cuda = tokens.is_cuda
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=cuda)
        host.copy_(tokens, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        for s in seqs:
            s.num_computed_tokens += 1
            s.num_in_flight += 1
        return cls(list(seqs), tokens, host, event)

    def input_tokens(self, seqs: list[Sequence]) -> torch.Tensor:
        """The picks of `seqs` (each one of this step's sequences), on the device, in order."""
        if len(seqs) == len(self.seqs) and all(a is b for a, b in zip(seqs, self.seqs)):
            return self.tokens
        row = {id(s): i for i, s in enumerate(self.seqs)}
        index = torch.tensor([row[id(s)] for s in seqs], device=self.tokens.device)
        return self.tokens.index_select(0, index)

    def settle(self) -> tuple[SchedulerOutput, StepResult, float]:
        """Waits for the picks; (what to commit, as a step's schedule and result, of the
        sequences still running; seconds blocked). Their in-flight count drops by one."""
        t0 = time.perf_counter()
        if self.event is not None:
            self.event.synchronize()
        waited = time.perf_counter() - t0
        live = [(s, t) for s, t in zip(self.seqs, self.host.tolist()) if not s.is_finished]
        for s, _ in live:
            s.num_in_flight -= 1
        n = len(live)
        seqs = [s for s, _ in live]
        # NOTE: advance 0: the launch advanced num_computed_tokens already.
        result = StepResult([0] * n, seqs, [[t] for _, t in live], [[None] for _ in live], [0] * n,
                            [0] * n, [0] * n)
        return SchedulerOutput(seqs, [1] * n), result, waited
