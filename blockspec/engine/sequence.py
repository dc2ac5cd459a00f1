"""A request's state as it moves through the scheduler."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from blockspec.dflash.metrics import SpecStats
from blockspec.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule)
    num_preemptions: int = 0
    spec: SpecStats | None = None  # a speculative engine's requests only

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finished_time is None or self.first_token_time is None:
            return None
        if self.num_generated_tokens < 2:
            return 0.0
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclass(eq=False)  # NOTE: identity: the scheduler's `in` / `remove` never compare fields
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against the context length
    eos_token_ids: tuple[int, ...] = ()
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # NOTE: tokens [0, num_computed_tokens) have their K/V in the cache (or being written by a
    # launched step); never past the committed tokens plus those in flight.
    num_computed_tokens: int = 0
    # Tokens a decode step launched ahead (engine/pipeline.py) has picked but the host has not
    # committed yet: 0 outside async scheduling.
    num_in_flight: int = 0
    # NOTE: positions [0, num_draft_ctx_tokens) hold valid drafter context K/V (a contiguous
    # prefix; rows still staged do not count). Kept by the runner with lazy_draft_context only;
    # 0 after preemption, and 0 on admission even with prefix-cache hits (a revived block may
    # have been filled while the drafter's context was detached).
    num_draft_ctx_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks of block_table registered in the prefix cache
    block_hashes: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # NOTE: the request's seed (its own, or one derived from the engine seed): with the output
    # position it fixes every random draw of the request (layers/counter_rng).
    sampling_seed: int = 0
    # NOTE: params.greedy and no logits processors, fixed at admission: the decode step asks it
    # of every sequence every step (a graph's own argmax then serves)
    plain_greedy: bool = False
    logprobs: list[dict[int, float]] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))

    def __post_init__(self) -> None:
        self.metrics.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens_left(self) -> int:
        """Tokens it may still generate (`max_tokens`; an end-of-sequence token may come sooner)."""
        return self.max_tokens - len(self.output_token_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens_in(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[max(start - n, 0):end - n]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
