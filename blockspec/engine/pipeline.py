"""Async scheduling (vLLM's `--async-scheduling`, SGLang's overlap scheduler): the next decode
step is scheduled and launched while the previous one runs, its inputs computed on the device from
that step's outputs, so the host's scheduling, input filling and output processing overlap the
device instead of waiting for it. All-greedy batches without logprobs only: a sampled row's draw
would depend on the tokens still in flight.

Plain decode (`PendingDecode`): a step launched ahead advances each sequence's
`num_computed_tokens` and `num_in_flight` by one; its picks come back to the host (a non-blocking
copy) and are committed after the next step is launched. A sequence that the committed token
finishes (EOS, a stop string) has one more token in flight, which is dropped.

Speculative decode (`PendingSpec`): the host does not know how many tokens the step in flight
commits (1 to its block length), so the next step's newest token (the target's pick after the
accepted drafts) and context length (+ accepted + 1) are computed on the device, and the host
reserves KV blocks for the worst case (every draft accepted). `num_computed_tokens` advances
when the step is committed, by what it accepted. A sequence that the step in flight ends (EOS, a
stop, max_tokens) has its next block computed too, which is dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from blockspec.engine.scheduler import SchedulerOutput
from blockspec.engine.sequence import Sequence
from blockspec.engine.step_plan import Plan
from blockspec.engine.step_result import StepResult


def pipelinable(running: list[Sequence]) -> bool:
    """Whether a decode step of these sequences may run ahead of the previous one's tokens."""
    return bool(running) and all(s.plain_greedy and s.params.logprobs is None for s in running)


def block_tokens(row: list[int], q: int, synthetic: bool) -> tuple[list[int], int]:
    """(committed tokens, accepted drafts) of one sequence's verified block, from its host row
    [q target picks, q - 1 drafts, accepted count]: the accepted drafts and the target's pick
    after them. NOTE: the benchmark-only synthetic mode commits the drafts themselves (their K/V
    are in the cache); greedy acceptance makes them equal to the target's picks anyway."""
    a = row[-1]
    if synthetic:
        return row[q:q + a] + [row[a]], a
    return row[:a + 1], a


def _to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A non-blocking copy of `t` to the host, and the event that marks it complete."""
    cuda = t.is_cuda
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
    host.copy_(t, non_blocking=cuda)
    event = None
    if cuda:
        event = torch.cuda.Event()
        event.record()
    return host, event


def _rows(own: list[Sequence], seqs: list[Sequence], *tensors: torch.Tensor
          ) -> tuple[torch.Tensor, ...]:
    """The rows of `tensors` (one row per sequence of `own`) for `seqs`, each one of `own`, in
    order: the tensors themselves where the batch is unchanged."""
    if len(seqs) == len(own) and all(a is b for a, b in zip(seqs, own)):
        return tensors
    row = {id(s): i for i, s in enumerate(own)}
    index = torch.tensor([row[id(s)] for s in seqs], device=tensors[0].device)
    return tuple(t.index_select(0, index) for t in tensors)


def _wait(event: torch.cuda.Event | None) -> float:
    """Blocks until `event`; the seconds it waited."""
    t0 = time.perf_counter()
    if event is not None:
        event.synchronize()
    return time.perf_counter() - t0


@dataclass
class PendingDecode:
    """A launched plain-decode step whose picks the host has not read yet."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [n] on the device (a graph's output: read before its next replay)
    host: torch.Tensor  # [n] the picks' host copy, complete once `event` is
    event: torch.cuda.Event | None
    block_len = 1

    @classmethod
    def start(cls, seqs: list[Sequence], tokens: torch.Tensor) -> PendingDecode:
        """Queues the picks' copy to the host after the step's kernels; marks the step's token
        as in flight for every sequence."""
        host, event = _to_host(tokens)
        for s in seqs:
            s.num_computed_tokens += 1
            s.num_in_flight += 1
        return cls(list(seqs), tokens, host, event)

    def input_tokens(self, seqs: list[Sequence]) -> torch.Tensor:
        """The picks of `seqs` (each one of this step's sequences), on the device, in order."""
        return _rows(self.seqs, seqs, self.tokens)[0]

    def settle(self) -> tuple[SchedulerOutput, StepResult, float]:
        """Waits for the picks; (what to commit, as a step's schedule and result, of the
        sequences still running; seconds blocked). Their in-flight count drops by one."""
        waited = _wait(self.event)
        live = [(s, t) for s, t in zip(self.seqs, self.host.tolist()) if not s.is_finished]
        for s, _ in live:
            s.num_in_flight -= 1
        n = len(live)
        seqs = [s for s, _ in live]
        # NOTE: advance 0: the launch advanced num_computed_tokens already.
        result = StepResult([0] * n, seqs, [[t] for _, t in live], [[None] for _ in live], [0] * n,
                            [0] * n, [0] * n)
        return SchedulerOutput(seqs, [1] * n), result, waited


@dataclass
class PendingSpec:
    """A launched speculative decode step (whole blocks, greedy or synthetic acceptance) whose
    tokens the host has not read yet."""

    seqs: list[Sequence]
    plan: Plan  # the step's decision (block length, path "decode")
    next_last: torch.Tensor  # [n] on the device: each sequence's newest token after the step
    next_ctx: torch.Tensor  # [n] on the device: its context length after the step
    host: torch.Tensor  # [n, 2q] picks, drafts, accepted count; complete once `event` is
    event: torch.cuda.Event | None
    synthetic: bool

    @property
    def block_len(self) -> int:
        return self.plan.block_len

    @classmethod
    def start(cls, seqs: list[Sequence], plan: Plan, target: torch.Tensor, drafts: torch.Tensor,
              accepted: torch.Tensor, ctx: torch.Tensor, synthetic: bool) -> PendingSpec:
        """From the step's [n, q] picks, [n, q - 1] drafts, [n] accepted counts and the [n]
        context lengths it ran at (graph outputs and static buffers: read here, before the
        next replay)."""
        acc = accepted.to(torch.int64)
        next_last = target.gather(1, acc[:, None]).squeeze(1)
        host, event = _to_host(torch.cat([target, drafts, acc[:, None]], dim=1))
        return cls(list(seqs), plan, next_last, ctx + acc + 1, host, event, synthetic)

    def next_inputs(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """(newest tokens, context lengths) of `seqs` (each one of this step's), on the device."""
        last, ctx = _rows(self.seqs, seqs, self.next_last, self.next_ctx)
        return last, ctx

    def settle(self) -> tuple[SchedulerOutput, StepResult, float]:
        """Waits for the step; (what to commit, as a step's schedule and result, of the
        sequences still running; seconds blocked)."""
        waited = _wait(self.event)
        q = self.block_len
        live = [(s, r) for s, r in zip(self.seqs, self.host.tolist()) if not s.is_finished]
        tokens, accepted = [], []
        for _, row in live:
            toks, a = block_tokens(row, q, self.synthetic)
            tokens.append(toks)
            accepted.append(a)
        seqs, n = [s for s, _ in live], len(live)
        result = StepResult([len(t) for t in tokens], seqs, tokens, [[None] * len(t)
                                                                      for t in tokens],
                            [q - 1] * n, accepted, [q] * n, block_len=q, path="ahead")
        return SchedulerOutput(seqs, [1] * n), result, waited
