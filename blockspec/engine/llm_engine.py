"""The engine: requests in, one scheduler step at a time, RequestOutputs out."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable

import torch

from blockspec.config import ConfigError, EngineConfig, ModelConfig
from blockspec.dflash.metrics import SpecStats
from blockspec.dflash.proposer import DFlashProposer, load_drafter
from blockspec.engine.admission import check_token_ids, resolve_max_tokens, tokenize
from blockspec.engine.backends import set_backends
from blockspec.engine.commit import commit_step, fail_requests
from blockspec.engine.detokenizer import IncrementalDetokenizer, eos_token_ids, load_tokenizer
from blockspec.engine.kv_cache import BlockManager
from blockspec.engine.memory import decide_num_blocks, kv_bytes_per_block, outside_kv_bytes
from blockspec.engine.model_runner import ModelRunner
from blockspec.engine.output_processor import OUTPUT_KINDS, EngineRequest, OutputProcessor
from blockspec.engine.pipeline import PendingDecode, PendingSpec, pipelinable
from blockspec.engine.scheduler import Scheduler, SchedulerOutput
from blockspec.engine.sequence import Sequence
from blockspec.engine.speculation import resolve_block_lens
from blockspec.engine.step_error import StepError
from blockspec.engine.step_mix import StepMix
from blockspec.engine.step_plan import step_context
from blockspec.engine.step_result import StepResult, StepTimings
from blockspec.layers.counter_rng import derive_seed
from blockspec.models.loader import load_model
from blockspec.outputs import RequestOutput
from blockspec.policy.step_context import StepContext
from blockspec.sampling_params import SamplingParams

log = logging.getLogger("blockspec")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.model_config = ModelConfig.from_pretrained(config.model_path)
        mc = self.model_config
        self.config, self.max_model_len = config.for_model(mc)
        config = self.config
        self.dtype = config.resolve_dtype(mc.dtype)
        torch.manual_seed(config.seed)
        self.device = torch.device(config.device)
        self.tokenizer = load_tokenizer(config.tokenizer_path, config.trust_remote_code)
        kv_config = mc  # the KV cache's view of the model: a tensor-parallel rank's KV heads
        if config.tensor_parallel_size == 1:
            self.model = load_model(config.model_path, mc, self.dtype, self.device,
                                    config.load_format)
        else:
            from blockspec.parallel.loading import load_sharded

            self.model, kv_config = load_sharded(config, mc, self.dtype, self.device)
        self.eos_token_ids = eos_token_ids(self.model_config, config.model_path, self.tokenizer)

        per_block = kv_bytes_per_block(kv_config, config.kv_block_size, self.dtype)
        drafter = None
        self.spec_block_size = 0  # the max block: fixed mode's, and the lookahead reserve's
        self.spec_block_lens: list[int] = []  # speculative block lengths the policy may run
        if config.draft_path is not None:
            drafter = load_drafter(config.draft_path, mc, self.max_model_len, self.dtype,
                                   self.device, config.load_format)
            self.spec_block_size, self.spec_block_lens = resolve_block_lens(
                config, drafter.config.block_size)
            # NOTE: the drafter's pool shares the block ids: each block costs both pools' bytes.
            per_block += kv_bytes_per_block(drafter.config.geometry, config.kv_block_size,
                                            self.dtype)
        fuse = getattr(self.model, "fuse_projections", None)
        if fuse is not None:  # NOTE: after loading and sharding, which replace weights
            fuse()
        self.attention_backend, self.linear_backend = set_backends(
            self.model, drafter, config, mc, self.device)
        activation = 0
        if self.device.type == "cuda" and config.num_kv_blocks is None \
                and config.kv_cache_memory_gb is None:
            activation = outside_kv_bytes(config, self.model, mc, drafter, self.max_model_len,
                                          self.spec_block_size, self.spec_block_lens, self.dtype)
        num_blocks = decide_num_blocks(config, per_block, activation)
        if config.tensor_parallel_size > 1:  # NOTE: every rank's cache holds the same blocks
            from blockspec.parallel.state import all_min

            num_blocks = all_min(num_blocks, self.device)
        self.block_manager = BlockManager(num_blocks, config.kv_block_size,
                                          config.enable_prefix_caching)
        proposer = None
        if drafter is not None:
            # NOTE: +1: the trash block that padded lanes of a graphed step write to.
            proposer = DFlashProposer(drafter, self.model, self.spec_block_size, num_blocks + 1,
                                      config.kv_block_size, self.dtype, self.device)
        self.runner = ModelRunner(config, kv_config, self.model, self.block_manager, self.dtype,
                                  self.max_model_len, proposer, self.spec_block_lens)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.lookahead_slots(),
                                   config.prefill_cap_setting,
                                   self.runner.flat.buckets if self.runner.flat else ())
        self.async_scheduling = config.use_async_scheduling
        self._pending: PendingDecode | PendingSpec | None = None  # the step in flight
        self.spec_stats = SpecStats()
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len,
                                       count_plain_steps=proposer is not None)
        self.requests = self.outputs.requests  # NOTE: the same dict (request id -> EngineRequest)
        self._ids = itertools.count()
        self._seed_counter = itertools.count()  # requests without a seed of their own
        # NOTE: True while the caller has added every request it will (LLM.generate; a
        # benchmark's last wave): the batch then drains, and the speculation policy prices its
        # stragglers (SpeculationPolicy.rates). A server never sets it.
        self.closed_batch = False
        # The last step's time spent finishing requests (_commit), and the tokens it appended.
        self.finish_seconds, self.committed_tokens = 0.0, 0
        self.step_mix = StepMix()  # steps, seconds and tokens by kind (benchmarks report it)
        if hasattr(self.model, "reset_expert_counts"):
            self.model.reset_expert_counts()  # NOTE: the memory profile's forwards counted too

    # -- requests -------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return tokenize(self.tokenizer, prompt, self.model_config.vocab_size)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, stream: bool = True,
                    output_kind: str = "cumulative") -> str:
        """Queues a request. With `stream=False` (offline generate) the text is produced when the
        request finishes; intermediate outputs then carry token ids only.

        `output_kind` (vLLM's RequestOutputKind): which steps return an output for it and what
        it holds. "cumulative": every step, everything so far (plus the step's delta);
        "delta": every step, only what the step added in `token_ids`/`text`/`logprobs`;
        "final_only": the finished output alone (offline generate's: at large batches the
        per-step copies of "cumulative" cost host time). Finished outputs are always complete."""
        if output_kind not in OUTPUT_KINDS:
            raise ConfigError(f"output_kind must be one of {OUTPUT_KINDS}, got {output_kind!r}")
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ConfigError(f"request id {request_id!r} is already in use")
        ids = self.tokenize(prompt)
        max_tokens = resolve_max_tokens(len(ids), params, self.max_model_len,
                                        self.cache_tokens())
        check_token_ids(params, self.model_config.vocab_size)
        needed = self.block_manager.blocks_for(len(ids) + max_tokens + self.lookahead_slots())
        if needed > self.block_manager.num_blocks:
            raise ConfigError(
                f"request needs {needed} KV blocks ({len(ids)} prompt + {max_tokens} new tokens) "
                f"but the cache holds {self.block_manager.num_blocks}; raise the KV-cache budget "
                "or lower max_tokens")
        seed = params.seed if params.seed is not None \
            else derive_seed(self.config.seed, next(self._seed_counter))
        seq = Sequence(request_id, ids, params, max_tokens, eos_token_ids=self.eos_token_ids,
                       sampling_seed=seed,
                       plain_greedy=params.greedy and not params.has_processors)
        if self.runner.proposer is not None:
            seq.metrics.spec = SpecStats()
        self.outputs.add(request_id, EngineRequest(
            seq, prompt if isinstance(prompt, str) else None,
            IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            incremental=stream or bool(params.stop_strs), output_kind=output_kind))
        self.scheduler.add(seq)
        return request_id

    def lookahead_slots(self) -> int:
        return max(self.spec_block_size - 1, 0)

    def cache_tokens(self) -> int:
        """Tokens one request may hold in the KV cache (all of it, less the draft lookahead)."""
        return self.block_manager.num_blocks * self.block_manager.block_size \
            - self.lookahead_slots()

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.seq.is_finished:
            return None
        self.scheduler.finish(req.seq, "abort")
        return self.outputs.output(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- stepping -------------------------------------------------------------------------------
    @property
    def timings(self) -> StepTimings:
        """Wall time of the engine's steps by part (see StepTimings), summed since start."""
        return self.runner.timings

    def step(self) -> list[RequestOutput]:
        """One engine step. With async scheduling a decode step that may run ahead is launched
        and the previous one's outputs returned (engine/pipeline.py); any other step first
        commits the step in flight. NOTE: a commit before an undecided synchronous step (a
        prefill) returns alone, so the streams' tokens do not wait for that step."""
        if not self.async_scheduling:
            return self._step()
        if self.runner.proposer is not None:
            return self._step_speculative()
        ahead = self.scheduler.schedule_ahead(self.max_model_len) \
            if pipelinable(self.scheduler.running) else None
        if ahead is not None:
            return self._step_ahead(ahead, 1, lambda: self.runner.launch_ahead(ahead,
                                                                                self._pending))
        return self._settle() or self._step()

    def _step_speculative(self) -> list[RequestOutput]:
        """Async scheduling with a drafter: the step's one decision, then the step launched
        ahead of the one in flight where it may run so (runs_ahead), else a synchronous step
        with that choice (prefills, sampled rows, catch-ups, probes, attached plain steps)."""
        seqs, chosen, prev = list(self.scheduler.running), None, self._pending
        if not self.scheduler.waiting and pipelinable(seqs):
            planner = self.runner.planner
            plan = planner.plan_ahead(seqs, self._step_context())
            chosen, how = plan.block_len, planner.runs_ahead(seqs, plan)
            if how == "spec" and not isinstance(prev, PendingDecode) \
                    and self.scheduler.reserve_ahead(prev.block_len if prev else 0, chosen,
                                                     self.max_model_len):
                return self._step_ahead(seqs, chosen,
                                        lambda: self.runner.launch_spec(seqs, plan, prev))
            if how == "plain" and not isinstance(prev, PendingSpec) \
                    and self.scheduler.schedule_ahead(self.max_model_len) is not None:
                return self._step_ahead(seqs, 1,
                                        lambda: self.runner.launch_ahead(seqs, prev, plan))
        if chosen is None:
            return self._settle() or self._step()
        return self._settle() + self._step(chosen)

    def _step_ahead(self, seqs: list[Sequence], block_len: int,
                    launch: Callable[[], PendingDecode | PendingSpec]) -> list[RequestOutput]:
        prev, t0 = self._pending, time.perf_counter()
        try:
            self._pending = launch()
            outputs = self._commit_pending(prev) if prev is not None else []
        except Exception as e:
            self._pending = None
            raise StepError(e, self._fail(seqs)) from e
        if all(s.is_finished for s in self._pending.seqs):
            self._pending = None  # NOTE: nothing of it to commit; the device finishes it alone
        self.runner.timings.steps += 1
        self.step_mix.add("ahead", block_len, time.perf_counter() - t0,
                          self.committed_tokens if prev is not None else 0)
        return outputs

    def _settle(self) -> list[RequestOutput]:
        """Commits the step in flight, if any."""
        prev, self._pending = self._pending, None
        if prev is None:
            return []
        t0 = time.perf_counter()
        try:
            outputs = self._commit_pending(prev)
        except Exception as e:
            raise StepError(e, self._fail(prev.seqs)) from e
        self.step_mix.add("settle", 1, time.perf_counter() - t0, self.committed_tokens)
        return outputs

    def _commit_pending(self, pending: PendingDecode | PendingSpec) -> list[RequestOutput]:
        sched, res, waited = self.runner.settle(pending)
        self.runner.timings.device_wait += waited
        t0 = time.perf_counter()
        outputs = self._commit(sched, res)
        self.runner.timings.postprocess += time.perf_counter() - t0
        return outputs

    def _step(self, chosen_block_len: int | None = None) -> list[RequestOutput]:
        """A synchronous step; `chosen_block_len`: the policy's choice made for it already."""
        t0 = time.perf_counter()
        load = self.scheduler.load()
        lookahead = self.runner.planner.next_budget_lookahead(*self.scheduler.mixed_load(load))
        sched = self.scheduler.schedule(
            budget_lookahead=min(lookahead, self.scheduler.num_lookahead_slots), load=load)
        if not sched:
            return []
        t1 = time.perf_counter()
        ctx = dataclasses.replace(self._step_context(), chosen_block_len=chosen_block_len)
        try:
            res = self.runner.execute(sched.seqs, sched.num_new_tokens, ctx)
            t2 = time.perf_counter()
            outputs = self._commit(sched, res)
        except Exception as e:
            raise StepError(e, self._fail(sched.seqs)) from e
        timings = self.runner.timings
        timings.steps += 1
        timings.schedule += t1 - t0
        t3 = time.perf_counter()
        timings.postprocess += t3 - t2
        # NOTE: without the finishing requests' work (freeing, final outputs): it is paid per
        # request whatever the block length. A closed batch decoding plainly finishes all its
        # requests in one step, and that one sample (clipped at a modelled step) would lift
        # plain decode's term for the runs after it.
        self._observe_step_time(t3 - t0 - self.finish_seconds)
        self.step_mix.add(res.path or "eager", res.block_len, t3 - t0, self.committed_tokens)
        return outputs

    def _step_context(self) -> StepContext:
        ctl = self.runner.controller
        return step_context(self.scheduler, self.config.max_num_seqs, drains=self.closed_batch
                            and ctl is not None and ctl.policy is not None)

    def _observe_step_time(self, seconds: float) -> None:
        """The step's wall time for the policy (a parallel worker takes rank 0's instead)."""
        self.runner.observe_step_time(seconds)

    def _fail(self, seqs: list[Sequence]) -> list[RequestOutput]:
        return fail_requests(seqs, self.outputs, self.scheduler)

    def _commit(self, sched: SchedulerOutput, res: StepResult) -> list[RequestOutput]:
        outputs, self.finish_seconds, self.committed_tokens = commit_step(
            sched, res, self.outputs, self.scheduler,
            self.spec_stats if self.runner.proposer is not None else None)
        return outputs
