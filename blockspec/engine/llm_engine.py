"""The engine: requests in, one scheduler step at a time, RequestOutputs out."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch

from blockspec.config import ConfigError, EngineConfig, ModelConfig
from blockspec.dflash.metrics import SpecStats
from blockspec.dflash.proposer import DFlashProposer, load_drafter
from blockspec.engine.admission import check_token_ids, resolve_max_tokens, tokenize
from blockspec.engine.backends import set_backends
from blockspec.engine.detokenizer import IncrementalDetokenizer, eos_token_ids, load_tokenizer
from blockspec.engine.kv_cache import BlockManager
from blockspec.engine.memory import decide_num_blocks, kv_bytes_per_block, outside_kv_bytes
from blockspec.engine.model_runner import ModelRunner
from blockspec.engine.output_processor import OUTPUT_KINDS, EngineRequest, OutputProcessor
from blockspec.engine.scheduler import Scheduler, SchedulerOutput
from blockspec.engine.sequence import Sequence
from blockspec.engine.speculation import resolve_block_lens
from blockspec.engine.step_error import StepError
from blockspec.engine.step_result import StepResult, StepTimings
from blockspec.layers.counter_rng import derive_seed
from blockspec.models.loader import load_model
from blockspec.outputs import RequestOutput
from blockspec.policy.drain import Drain
from blockspec.policy.step_context import StepContext
from blockspec.sampling_params import SamplingParams

log = logging.getLogger("blockspec")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.model_config = ModelConfig.from_pretrained(config.model_path)
        mc = self.model_config
        if mc.moe is not None and not config.enforce_eager and config.device != "cpu" \
                and config.linear_backend == "torch":
            # NOTE: the torch experts read the router's choice on the host, which no graph
            # captures; the grouped GEMMs (layers/fused_moe.py, the CUDA default) are captured.
            log.warning("MoE target with linear_backend='torch': CUDA graphs off")
            config = dataclasses.replace(config, enforce_eager=True)
        self.config = config
        if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
            raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's "
                              f"max_position_embeddings {mc.max_position_embeddings}")
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
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
            if config.max_num_batched_tokens < self.spec_block_size:
                raise ConfigError(f"max_num_batched_tokens ({config.max_num_batched_tokens}) "
                                  f"must be >= the block size ({self.spec_block_size})")
            # NOTE: the drafter's pool shares the block ids: each block costs both pools' bytes.
            per_block += kv_bytes_per_block(drafter.config.geometry, config.kv_block_size,
                                            self.dtype)
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
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.lookahead_slots(),
                                   config.decode_step_prefill_tokens)
        proposer = None
        if drafter is not None:
            # NOTE: +1: the trash block that padded lanes of a graphed step write to.
            proposer = DFlashProposer(drafter, self.model, self.spec_block_size, num_blocks + 1,
                                      config.kv_block_size, self.dtype, self.device)
        self.runner = ModelRunner(config, kv_config, self.model, self.block_manager, self.dtype,
                                  self.max_model_len, proposer, self.spec_block_lens)
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
        self.finish_seconds = 0.0  # the last step's time spent finishing requests (_commit)
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
        "final_only": the finished output alone. Finished outputs are always complete.
        NOTE: at large batches the per-step copies of "cumulative" cost host time that the
        engine's per-step sync turns into step time; offline generate asks for "final_only"."""
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
        t0 = time.perf_counter()
        lookahead = self.runner.planner.next_budget_lookahead()
        sched = self.scheduler.schedule(
            budget_lookahead=min(lookahead, self.scheduler.num_lookahead_slots))
        if not sched:
            return []
        t1 = time.perf_counter()
        n = len(self.scheduler.running) + len(self.scheduler.waiting)
        ctl = self.runner.controller
        drain = self._drain if ctl is not None and ctl.policy is not None and self.closed_batch \
            and n <= self.config.max_num_seqs else None
        try:
            res = self.runner.execute(sched.seqs, sched.num_new_tokens,
                                      StepContext(num_unfinished=n, drain=drain))
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
        # requests in one step, and that one sample (clipped at a modelled step) lifted plain
        # decode's term for the runs after it (H200 run 13, a=0.6, C=128: terms of 2.4-3.7 ms
        # at the runs' ends against ~1.8 ms over their decode phases).
        self._observe_step_time(t3 - t0 - self.finish_seconds)
        return outputs

    def _observe_step_time(self, seconds: float) -> None:
        """The step's wall time for the policy (a parallel worker takes rank 0's instead)."""
        self.runner.observe_step_time(seconds)

    def _fail(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Finish the requests of a step that raised ("error"), freeing their KV blocks.
        NOTE: a failed step committed nothing for them (num_computed_tokens did not advance past
        their committed tokens), and the blocks it may have written are theirs alone: blocks
        shared through the prefix cache hold only computed tokens, which no step rewrites."""
        outputs = []
        for seq in seqs:
            req = self.requests.get(seq.request_id)
            if req is None or seq.is_finished:
                continue
            self.scheduler.finish(seq, "error")
            outputs.append(self.outputs.output(req))
        return outputs

    def _drain(self) -> Drain | None:
        """The draining batch, built when the policy asks (StepContext.drain): offered while
        `closed_batch` and every unfinished request fits in the running batch (no later one
        takes a finished one's slot)."""
        left = [s.num_tokens_left
                for s in itertools.chain(self.scheduler.running, self.scheduler.waiting)]
        return Drain.of(left) if left else None

    def _commit(self, sched: SchedulerOutput, res: StepResult) -> list[RequestOutput]:
        """Append each sequence's committed tokens, advance its computed tokens, finish it where
        a stop or its limit was reached, and build this step's outputs."""
        now = time.monotonic()
        self.finish_seconds = 0.0
        finishing: dict[int, tuple[str, str | int | None]] = {}
        spec = self.runner.proposer is not None
        if spec:
            self.spec_stats.record_block_len(res.block_len)
        for seq, toks, lps, drafted, acc, blen in zip(res.sampled_seqs, res.tokens, res.logprobs,
                                                      res.drafted, res.accepted, res.block_lens):
            req = self.requests[seq.request_id]
            # NOTE: a request's plain-decode steps (blen 1: one token each) are not counted here,
            # per sequence and step, but from its token counts when its outputs are built
            # (SpecStats.settle_plain_steps): those of its speculative steps (blen >= 2) and of
            # its prefills (blen 0, one token each) are counted here.
            if spec and blen >= 2:
                m = seq.metrics.spec
                m.block_len_steps[blen] += 1
                m.record(drafted, acc)
                self.spec_stats.record(drafted, acc)
                before = len(seq.output_token_ids)
                reason = self.outputs.append(req, toks, lps, now)
                m.num_spec_tokens += len(seq.output_token_ids) - before
            else:
                if spec and blen == 0:
                    seq.metrics.spec.num_prefill_tokens += 1
                reason = self.outputs.append(req, toks, lps, now)
            if reason is not None:
                finishing[id(seq)] = reason
        bm = self.block_manager
        for seq, adv in zip(sched.seqs, res.advance):
            # NOTE: K/V exist for every token but the newest (the target's own pick, or a
            # truncation point when a stop ends the request mid-block).
            seq.num_computed_tokens = min(seq.num_computed_tokens + adv, len(seq.prompt_token_ids)
                                          + len(seq.output_token_ids) - 1)
            if bm.enable_prefix_caching:
                bm.register_full_blocks(seq)
        outputs = []
        if not finishing and not self.outputs.num_reporting:
            return outputs  # NOTE: the common step of a batch run: nothing to report
        for seq in res.sampled_seqs:
            req = self.requests[seq.request_id]
            if id(seq) in finishing:
                t = time.perf_counter()
                self.scheduler.finish(seq, *finishing[id(seq)])
                outputs.append(self.outputs.output(req))
                self.finish_seconds += time.perf_counter() - t
            elif seq.is_finished or req.output_kind != "final_only":
                outputs.append(self.outputs.output(req))
        return outputs
