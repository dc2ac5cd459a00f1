"""The engine side of the speculation policy: which block length each step runs.

One controller per engine (per-batch policy): a decayed acceptance tracker fed after every
decode step, and either the adaptive `SpeculationPolicy` (maximise expected committed tokens per
second from the measured step costs) or a fixed block length.

Tracker feeding (NOTE, the contract the policy relies on):
- after a speculative step, every decoding sequence that drafted contributes one observation
  (drafted, accepted); the whole step counts as one unit of time (`observe_many`), so the
  half-life is in engine steps at any batch size, and the evidence is capped (`MAX_EVIDENCE`)
  so a long stretch at a large batch does not drown what a small batch then sees.
  Synthetic-acceptance benchmark runs feed the synthetic counts exactly the same way.
- after a plain step (L = 1) the tracker only ticks: its evidence ages with engine time, so
  after a long plain streak the periodic probe (the smallest block) outweighs stale evidence.
- every mode feeds it, so a run switched from fixed to adaptive starts with fresh statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from blockspec.config import ConfigError, EngineConfig
from blockspec.policy.mixed_block import mixed_block_len
from blockspec.policy.policy import (
    AcceptanceTracker,
    SpeculationPolicy,
    StepCostModel,
    StepOverhead,
)
from blockspec.policy.step_context import NO_CONTEXT, DrainArg, StepContext

# NOTE: block 2 (one draft) for large batches, where the verify is compute-bound: L=2 commits
# 1 + p1 tokens per sequence (1.6 at a=0.6, 1.86 at a=0.86). Measured on the H200 (policy runs
# 16-17): a block-2 step costs 1.44x a plain one at B=128 and 1.72x at B=256, so the policy
# rarely picks it; it cost the best fixed block nothing measurable, so it stays.
DEFAULT_BLOCK_SIZES = (2, 4, 8, 16)
HALF_LIFE_STEPS = 64.0
# NOTE: optimistic prior (trained DFlash drafters accept ~0.8-0.9 per position): a new engine
# speculates where that would pay, so the tracker gets evidence at once; with prior weight 2 one
# step of a poor drafter's rejections already outweighs it.
PRIOR_ACCEPTANCE = 0.8
# Evidence cap (observations at position 1): a few steps at C=256, plenty for +-0.02 estimates.
MAX_EVIDENCE = 1024.0
# NOTE: speculate only when its modelled rate beats plain decode by 3%: at the margin a wrong
# "speculate" costs more than a missed one, since the step model leaves out the drafter context
# a speculating engine writes (a draining batch's stragglers it prices: policy/drain.py).
MIN_GAIN = 1.03
# After 32 plain steps, probe with the smallest block once its worst-case extra time is at most
# 0.5% of the plain streak's (at large batches, where a verify costs several plain steps, that is
# every few hundred steps).
PROBE_EVERY = 32
PROBE_OVERHEAD = 0.005


def resolve_block_lens(config: EngineConfig, trained_block_size: int) -> tuple[int, list[int]]:
    """(max block, every speculative block length the policy may run, max included).

    The max block is `block_size`, else the largest of `block_sizes`, else the drafter's trained
    block size; default lengths are those of 2, 4, 8, 16 below it.
    """
    sizes = config.block_sizes
    max_block = config.block_size or (max(sizes) if sizes else trained_block_size)
    if max_block > trained_block_size:
        what = "block size" if config.block_size else "block sizes"
        raise ConfigError(f"{what} {max_block} must be in [2, {trained_block_size}] (the "
                          f"drafter was trained with block_size {trained_block_size})")
    if config.max_num_batched_tokens < max_block:
        raise ConfigError(f"max_num_batched_tokens ({config.max_num_batched_tokens}) "
                          f"must be >= the block size ({max_block})")
    if sizes is None:
        sizes = tuple(s for s in DEFAULT_BLOCK_SIZES if s < max_block)
    return max_block, sorted(set(sizes) | {max_block})


class SpecController:
    def __init__(self, block_lens: Sequence[int], mode: str, cost_model: StepCostModel | None,
                 batch_bucket: Callable[[int], int] | None = None) -> None:
        """`batch_bucket`: the batch size a step of n sequences really runs at (its CUDA graph
        bucket); the policy then prices the step at the measured bucket, not between buckets."""
        self.batch_bucket = batch_bucket
        self.block_lens = sorted(block_lens)
        self.max_block = self.block_lens[-1]
        self.tracker = self.new_tracker()
        self.cost_model = cost_model
        self.mode = "fixed"
        self.fixed_len = self.max_block
        self.policy: SpeculationPolicy | None = None
        # Live per-step overhead over the cost model (StepOverhead), fed by observe_step_time;
        # kept across set_policy, off for a cost model installed by set_cost_model.
        self.overhead: StepOverhead | None = StepOverhead()
        self.set_policy(mode)

    @staticmethod
    def new_tracker() -> AcceptanceTracker:
        return AcceptanceTracker(half_life=HALF_LIFE_STEPS, prior_mean=PRIOR_ACCEPTANCE,
                                 max_weight=MAX_EVIDENCE)

    def reset_acceptance(self) -> None:
        """Forget the acceptance statistics (a new workload or drafter)."""
        self.tracker = self.new_tracker()

    def set_policy(self, mode: str, fixed_len: int | None = None) -> None:
        if mode == "fixed":
            L = self.max_block if fixed_len is None else int(fixed_len)
            if L != 1 and L not in self.block_lens:
                raise ConfigError(f"fixed block length {L} is not 1 or one of the engine's "
                                  f"block lengths {self.block_lens}")
            self.mode, self.fixed_len, self.policy = "fixed", L, None
        elif mode == "adaptive":
            if self.cost_model is None:
                raise ConfigError("the adaptive policy needs a step-cost profile: build the "
                                  "engine with speculation_policy='adaptive'")
            self.mode, self.fixed_len = "adaptive", self.max_block
            self.policy = SpeculationPolicy(
                self.cost_model, self.block_lens, mode="adaptive", fixed_len=self.max_block,
                min_gain=MIN_GAIN, probe_every=PROBE_EVERY, probe_overhead=PROBE_OVERHEAD)
            self.policy.overhead = self.overhead
        else:
            raise ConfigError(f"speculation policy must be adaptive or fixed, got {mode!r}")

    def set_cost_model(self, cost_model: StepCostModel) -> None:
        """Replace the cost model (tests, what-if runs). NOTE: it is then taken as the whole
        step cost: the live overhead correction is off, so a made-up table means what it says."""
        self.cost_model = cost_model
        self.overhead = None
        if self.mode == "adaptive":
            self.set_policy("adaptive")

    def _bucket(self, num_decoding: int) -> int:
        """The batch size a step of `num_decoding` sequences is priced at (its graph bucket)."""
        return self.batch_bucket(num_decoding) if self.batch_bucket is not None else num_decoding

    def choose(self, num_decoding: int, ctx: StepContext = NO_CONTEXT) -> int:
        """Block length for a step with `num_decoding` decoding sequences (called once per step
        that has any: the policy counts its plain streak in calls)."""
        if self.policy is None:
            return self.fixed_len
        return self.policy.choose(self._bucket(num_decoding), self.tracker, ctx.drain,
                                  ctx.switch_cost)

    def mixed_block_len(self, num_decoding: int, block_len: int, prefill_tokens: int) -> int:
        """The block of a step that prefills `prefill_tokens` prompt tokens beside
        `num_decoding` decoding sequences (policy/mixed_block.py); a fixed block is not cut."""
        if self.policy is None or self.cost_model is None:
            return block_len
        return mixed_block_len(self.cost_model, self._bucket(num_decoding), block_len,
                               self.block_lens, prefill_tokens)

    def observe(self, block_len: int, drafted: Sequence[int], accepted: Sequence[int]) -> None:
        if block_len > 1:
            self.tracker.observe_many(drafted, accepted)
        else:
            self.tracker.tick()

    def observe_step_time(self, num_decoding: int, block_len: int, seconds: float,
                          caught_up: bool = False) -> None:
        """The wall time of an all-decode step at `block_len`: against its modelled time at the
        step's graph bucket (StepOverhead) where it paid no catch-up (`caught_up`: the
        switch cost prices that), and as a probe's price where the policy probed."""
        if self.overhead is None or self.cost_model is None \
                or block_len not in self.cost_model.block_lens:
            return
        b = self._bucket(num_decoding)
        if self.policy is not None and self.policy.probing:
            self.policy.observe_probe(b, seconds - self.policy.step_cost(b, 1))
        if not caught_up:
            self.overhead.observe(b, block_len, self.cost_model.cost(b, block_len), seconds)

    def explain(self, num_decoding: int, drain: DrainArg = None) -> dict[str, Any]:
        """The policy's view for a batch size (side-effect free): rates, tau, acceptance."""
        if self.policy is None:
            return {"mode": "fixed", "choice": self.fixed_len, "batch_size": num_decoding}
        return self.policy.explain(self._bucket(num_decoding), self.tracker, drain)
