"""The engine's figures that /metrics reads, as one immutable snapshot."""

from __future__ import annotations

from dataclasses import dataclass

from blockspec.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class EngineStats:
    """What /metrics reads; published by the engine thread after each iteration, so the event
    loop never reads the scheduler's or block manager's mutable state."""

    num_running: int = 0
    num_waiting: int = 0
    num_used_blocks: int = 0
    num_blocks: int = 1
    num_preemptions: int = 0
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafted_per_position: tuple[int, ...] = ()
    spec_accepted_per_position: tuple[int, ...] = ()
    spec_block_len_steps: tuple[tuple[int, int], ...] = ()  # (block length, engine steps)
    num_step_failures: int = 0  # engine steps that raised (their requests failed, see _iterate)
    steps_by_path: tuple[tuple[str, int], ...] = ()  # (Plan.path, engine steps)
    num_prompt_tokens: int = 0  # prompt tokens prefilled (prefix-cache hits left out), in all
    num_generation_tokens: int = 0  # tokens generated, in all
    # MoE targets: distinct routed experts selected, summed over MoE layer forwards (and those)
    moe_experts_selected: int = 0
    moe_layer_forwards: int = 0

    @classmethod
    def of(cls, eng: LLMEngine, num_step_failures: int = 0) -> EngineStats:
        """Engine thread: the snapshot after an iteration."""
        spec = eng.spec_stats
        counts = eng.model.expert_counts().tolist() if hasattr(eng.model, "expert_counts") \
            else (0, 0)
        return cls(
            num_running=len(eng.scheduler.running), num_waiting=len(eng.scheduler.waiting),
            num_used_blocks=eng.block_manager.num_used_blocks,
            num_blocks=eng.block_manager.num_blocks,
            num_preemptions=getattr(eng.scheduler, "num_preemptions", 0),
            spec_verify_steps=spec.num_steps, spec_draft_tokens=spec.num_draft_tokens,
            spec_accepted_tokens=spec.num_accepted_tokens,
            spec_drafted_per_position=tuple(spec.drafted_per_position),
            spec_accepted_per_position=tuple(spec.accepted_per_position),
            spec_block_len_steps=tuple(sorted(spec.block_len_steps.items())),
            num_step_failures=num_step_failures,
            steps_by_path=tuple(sorted(eng.runner.path_steps.items())),
            num_prompt_tokens=eng.outputs.num_prompt_tokens,
            num_generation_tokens=eng.outputs.num_generation_tokens,
            moe_experts_selected=counts[0], moe_layer_forwards=counts[1])
