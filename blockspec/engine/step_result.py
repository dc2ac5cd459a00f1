"""What one model-runner step hands back to the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

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
