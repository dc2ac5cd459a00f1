"""Owns the models and KV caches on the device; runs one step (draft -> verify/prefill/decode ->
write draft context -> sample -> accept) and returns what each sequence committed. The host syncs
once per step, to read the tokens.

A step runs its plan (`StepPlanner`): the block length L of its decoding sequences (1 = plain
decode, or one of the speculative block lengths, the speculation controller's choice; all
decoding sequences of a step share it) and the path: the graphed decode step when every sequence
decodes; else the mixed step over the flat batch, its forward one replay of the flat step's
token bucket (eager without graphs or where no bucket holds it).
NOTE: every committed token gets the drafter's context K/V, so the next step may run any L:
speculative and mixed steps write it at their verified positions; an all-plain step (L = 1) only
stages its taps (`ContextStaging`), written in one batched pass before the drafter next runs (or
when the staging fills). Whenever the drafter runs, both KV pools hold valid entries for every
committed token of its sequences. With lazy_draft_context, long plain streaks skip the drafter's
context altogether and it is caught up before the drafter next runs (see `lazy_context`).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import torch

from blockspec.config import ConfigError, EngineConfig, ModelConfig
from blockspec.dflash.proposer import DFlashProposer
from blockspec.engine.cost_profile import load_or_measure_costs
from blockspec.engine.decode_exec import BlockDrafts, DecodeExecutor
from blockspec.engine.decode_step import (
    DecodeStep,
    DraftStep,
    GraphedDecodeStep,
    StepBuffers,
    graph_buckets,
    graphed_block_lens,
)
from blockspec.engine.draft_context import DraftContext
from blockspec.engine.flat_exec import build_flat
from blockspec.engine.kv_cache import BlockManager
from blockspec.engine.mixed_step import MixedStep
from blockspec.engine.pipeline import PendingDecode, PendingSpec
from blockspec.engine.scheduler import SchedulerOutput
from blockspec.engine.sequence import Sequence
from blockspec.engine.speculation import SpecController
from blockspec.engine.step_plan import Plan, StepPlanner
from blockspec.engine.step_result import StepResult, StepTimings
from blockspec.layers.attention import bind_kv_cache
from blockspec.models.qwen3 import CausalLM
from blockspec.policy.cost_model import StepCostModel
from blockspec.policy.step_context import NO_CONTEXT, StepContext

__all__ = ["ModelRunner", "StepResult"]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model: CausalLM,
                 block_manager: BlockManager, dtype: torch.dtype, max_model_len: int,
                 proposer: DFlashProposer | None = None,
                 block_lens: list[int] | None = None) -> None:
        """`block_lens`: the speculative block lengths the policy may run (default: only the
        proposer's block size, the max block)."""
        self.config = config
        self.model_cfg = model_cfg
        self.model = model
        self.device = torch.device(config.device)
        self.dtype = dtype
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.proposer = proposer
        self.synthetic = config.synthetic_acceptance
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.manual_seed(config.seed)
        # NOTE: one block more than the manager hands out: the trash block for padded lanes.
        self.trash_block = block_manager.num_blocks
        self.kv_cache = bind_kv_cache(model, block_manager.num_blocks + 1,
                                      block_manager.block_size, model_cfg.kv_cache_geometry,
                                      dtype, self.device)
        self.max_block = proposer.block_size if proposer is not None else 1
        self.spec_lens = sorted(set(block_lens or []) | {self.max_block}) \
            if proposer is not None else []
        if self.spec_lens and (self.spec_lens[0] < 2 or self.spec_lens[-1] > self.max_block):
            raise ConfigError(f"block lengths {self.spec_lens} must be in [2, {self.max_block}]")
        adaptive = proposer is not None and config.speculation_policy == "adaptive"
        # NOTE: with a drafter the plain step defers its context write to `self.staging`.
        self.steps = {L: DecodeStep(model, proposer, L, block_manager.block_size, max_model_len,
                                    synthetic=self.synthetic is not None,
                                    defer_context=proposer is not None and L == 1)
                      for L in [1, *self.spec_lens]}
        self.context = DraftContext.build(config, model_cfg.hidden_size, model, proposer,
                                          block_manager, self.trash_block, max_model_len, dtype)
        self.staging, self.lazy = self.context.staging, self.context.lazy
        self.decode = self.steps[self.max_block]  # the fixed policy's step (and the AR step)
        max_blocks = -(-(max_model_len + self.max_block) // block_manager.block_size)
        self.bufs = StepBuffers.allocate(config.max_num_seqs, max_blocks, self.max_block,
                                         self.device, self.synthetic or 0.0)
        self.bufs.block_tables.fill_(self.trash_block)
        self.buckets = graph_buckets(config.max_num_seqs)
        self.mixed = MixedStep(model, proposer, block_manager, model_cfg.vocab_size, self.device,
                               self.default_generator, self.synced)
        self.decoder = DecodeExecutor(self.bufs, self.trash_block, block_manager.block_size,
                                      model_cfg.vocab_size, self.staging, self.default_generator,
                                      self.synced, proposer is not None)
        graphed = self.device.type == "cuda" and not config.enforce_eager
        self.flat = build_flat(config, model, proposer, self.trash_block * block_manager.block_size,
                               max_model_len, max_blocks, graphed)
        # NOTE: with the flat step, a mixed step drafts through the decode steps' buffers too.
        self.block_drafts = BlockDrafts(self.bufs, {L: DraftStep(self.steps[L])
                                                    for L in self.spec_lens}, self.trash_block) \
            if self.flat is not None and proposer is not None else None
        self.graphs_by_len: dict[int, GraphedDecodeStep] = {}
        if graphed:
            self._capture_graphs(adaptive)
        self.graphs = self.graphs_by_len.get(self.max_block)  # compat: the max block's graphs
        self.timings = StepTimings()  # the runner's parts; the engine adds its own and steps
        self.path_steps: Counter[str] = Counter()  # steps by Plan.path (/metrics)
        # (decoding sequences, block length, caught up) of the last step if it was an all-decode
        # step: the engine reports its wall time (observe_step_time).
        self.timed_step: tuple[int, int, bool] | None = None
        self.cost_profile_info: dict | None = None
        self.controller: SpecController | None = None  # NOTE: None while costs are measured
        if proposer is not None:
            self.controller = self._init_controller(adaptive)
        self.planner = StepPlanner(self.controller, self.lazy, self.spec_lens, self.max_block,
                                   max_model_len, config.max_num_batched_tokens, self.flat)

    def _capture_graphs(self, adaptive: bool) -> None:
        """Graphs for every block length the policy can choose (fixed: the max block only)."""
        lens = graphed_block_lens(adaptive, self.spec_lens, self.max_block)
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        # NOTE: one pool, largest block first: smaller graphs reuse its intermediates.
        for L in sorted(lens, reverse=True):
            graphed = GraphedDecodeStep(self.steps[L], self.bufs, self.buckets)
            graphed.capture(pool, stream)
            self.graphs_by_len[L] = graphed
        if self.lazy is not None and adaptive:  # the detached plain step
            self.lazy.graphs = GraphedDecodeStep(self.lazy.step, self.bufs, self.buckets)
            self.lazy.graphs.capture(pool, stream)
        if self.block_drafts is not None:
            self.block_drafts.capture([L for L in lens if L > 1], self.buckets, pool, stream)
        if self.flat is not None:
            self.flat.capture([1, *lens], pool, stream)

    def _init_controller(self, adaptive: bool) -> SpecController:
        cost_model = None
        if adaptive:
            cost_model, self.cost_profile_info = load_or_measure_costs(self, self.config)
        graphs = self.graphs_by_len.get(self.max_block)
        return SpecController(self.spec_lens, self.config.speculation_policy, cost_model,
                              batch_bucket=graphs.bucket_for if graphs is not None else None)

    # -- benchmark hooks (not serving options) ----------------------------------------------
    def set_policy(self, mode: str, fixed_len: int | None = None) -> None:
        """Switch the speculation policy at run time: "adaptive", or "fixed" at `fixed_len`
        (1 = plain decode; default: the max block). Block lengths without a captured graph run
        eagerly."""
        if self.controller is None:
            raise ConfigError("set_policy needs a draft model")
        self.controller.set_policy(mode, fixed_len)
        # NOTE: the new policy starts attached, as in a fresh engine, so a fixed block run after
        # a detached stretch does not skip its prefills' drafter context and then pay a catch-up.
        self.context.reattach()

    def set_cost_model(self, cost_model: StepCostModel) -> None:
        """Replace the adaptive policy's step-cost model (tests, what-if runs); the policy then
        prices steps by it alone (no live overhead term, see SpecController.set_cost_model)."""
        if self.controller is None:
            raise ConfigError("set_cost_model needs a draft model")
        self.controller.set_cost_model(cost_model)

    def set_synthetic_acceptance(self, a: float) -> None:
        """Change the synthetic acceptance probability of a benchmark-mode engine; captured graphs
        read it from a device scalar, so they need no re-capture. The acceptance statistics are
        reset, as in a fresh engine whose drafter accepts with probability `a`."""
        if self.synthetic is None:
            raise ConfigError("the engine was not built with synthetic acceptance")
        if not 0.0 <= a <= 1.0:
            raise ConfigError("synthetic acceptance must be a probability in [0, 1]")
        self.synthetic = float(a)
        self.bufs.acceptance.fill_(float(a))
        self.controller.reset_acceptance()

    # -- stepping ---------------------------------------------------------------------------
    def synced(self, t: torch.Tensor) -> list:
        """`t.tolist()`, the step's host sync, timed as `timings.device_wait`."""
        t0 = time.perf_counter()
        out = t.tolist()
        self.timings.device_wait += time.perf_counter() - t0
        return out

    @torch.inference_mode()
    def flush_context(self) -> None:
        """Write the drafter context K/V of every staged plain-step token now (the runner does
        this itself before the drafter runs; tests call it to inspect the drafter's cache)."""
        self.context.flush()

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], num_new_tokens: list[int],
                ctx: StepContext = NO_CONTEXT) -> StepResult:
        """One step of the scheduled `seqs`; `ctx`: what the engine knows of the step (the load,
        the draining batch) for the speculation decision."""
        t0, wait0 = time.perf_counter(), self.timings.device_wait
        res = self._execute(seqs, num_new_tokens, ctx)
        self.timings.runner_host += (time.perf_counter() - t0) - (self.timings.device_wait
                                                                   - wait0)
        return res

    def _execute(self, seqs: list[Sequence], num_new_tokens: list[int],
                 ctx: StepContext) -> StepResult:
        plan = self.planner.decide(seqs, num_new_tokens, ctx)
        self.path_steps[plan.path] += 1
        caught_up = self.context.before_step(seqs, plan)
        # NOTE: only all-decode steps are timed for the policy (SpecController.observe_step_time).
        self.timed_step = (plan.num_decoding, plan.block_len, caught_up) \
            if plan.path == "decode" and self.controller is not None else None
        if plan.path == "decode":
            res = self._execute_decode(seqs, plan.block_len)
        else:
            res = self._execute_mixed(seqs, num_new_tokens, plan)
        self._after(seqs, plan, res)
        return res

    def _after(self, seqs: list[Sequence], plan: Plan, res: StepResult) -> None:
        """The drafter context's counts, and the policy's acceptance statistics."""
        self.context.after_step(seqs, plan, res.advance)
        res.block_len = plan.block_len if plan.num_decoding else 0
        # NOTE: "detached": a plain decode step without the drafter's context (lazy context)
        res.path = "detached" if plan.path == "decode" and plan.block_len == 1 \
            and self.lazy is not None and self.lazy.detached else plan.path
        if self.controller is not None and plan.num_decoding:
            self.controller.observe(plan.block_len, res.drafted, res.accepted)

    def _execute_mixed(self, seqs: list[Sequence], num_new_tokens: list[int],
                       plan: Plan) -> StepResult:
        blens = plan.blens
        if blens is None:
            one = 1 if self.proposer is not None else 0
            blens = [one if d else 0 for d in plan.decoding]
        # NOTE: detached (lazy_draft_context): no drafter context now; caught up before the
        # drafter next runs for these sequences.
        return self.mixed(seqs, num_new_tokens, blens, self.context.writes, self.synthetic,
                          self.flat if plan.path == "flat" else None, self.block_drafts)

    def observe_step_time(self, seconds: float) -> None:
        """The engine's wall time of the step just run (schedule to outputs), for the policy's
        live overhead term; only all-decode steps count (see `timed_step`)."""
        if self.timed_step is not None:
            n, block_len, caught_up = self.timed_step
            self.controller.observe_step_time(n, block_len, seconds, caught_up=caught_up)
            self.timed_step = None

    # -- async scheduling (engine/pipeline.py) -------------------------------------------------
    @torch.inference_mode()
    def launch_spec(self, seqs: list[Sequence], plan: Plan, prev: PendingSpec | None
                    ) -> PendingSpec:
        """The speculative step `plan` of `seqs` launched without waiting for `prev`."""
        t0 = time.perf_counter()
        self.path_steps["ahead"] += 1
        self.context.before_step(seqs, plan)  # NOTE: flushes staged rows; no catch-up is due
        L = plan.block_len
        pending = self.decoder.launch_spec(seqs, plan, self.steps[L], self.graphs_by_len.get(L),
                                           prev, self.synthetic)
        self.timings.runner_host += time.perf_counter() - t0
        return pending

    def settle(self, pending: PendingDecode | PendingSpec
               ) -> tuple[SchedulerOutput, StepResult, float]:
        """Waits for a step launched ahead; what to commit (see PendingDecode.settle), after the
        drafter-context counts and the acceptance statistics a synchronous step keeps."""
        sched, res, waited = pending.settle()
        n = len(res.sampled_seqs)
        if isinstance(pending, PendingSpec):
            plan = dataclasses.replace(pending.plan, decoding=[True] * n,
                                       blens=[pending.block_len] * n)
            self.context.after_step(res.sampled_seqs, plan, res.advance)
        if self.controller is not None and n:
            self.controller.observe(pending.block_len, res.drafted, res.accepted)
        return sched, res, waited

    @torch.inference_mode()
    def launch_ahead(self, seqs: list[Sequence], prev: PendingDecode | None,
                     plan: Plan | None = None) -> PendingDecode:
        """A plain decode step of `seqs` launched without waiting for `prev`'s tokens (async
        scheduling, engine/pipeline.py): the target alone, or with a drafter the detached
        step `plan` (StepPlanner.runs_ahead "plain")."""
        t0 = time.perf_counter()
        self.path_steps["decode"] += 1
        step, graphs = self.steps[1], self.graphs_by_len.get(1)
        if plan is not None:
            self.context.before_step(seqs, plan)  # NOTE: detached: counts the plain streak
            step, graphs = self.context.plain_step(step, graphs)
        pending = self.decoder.launch(seqs, step, graphs, prev)
        self.timings.runner_host += time.perf_counter() - t0
        return pending

    def _execute_decode(self, seqs: list[Sequence], q: int) -> StepResult:
        """All sequences decoding with a block of `q`: the fixed-shape (graphable) step."""
        step, graphs = self.steps[q], self.graphs_by_len.get(q)
        if q == 1:
            step, graphs = self.context.plain_step(step, graphs)
        return self.decoder(seqs, step, graphs, self.synthetic, self.lazy is not None)
