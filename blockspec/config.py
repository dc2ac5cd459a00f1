"""The engine's configuration (vLLM's engine args), validated on construction. The model's own
(`ModelConfig`, from config.json) lives in model_config.py; both are importable from here."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from blockspec.errors import ConfigError
from blockspec.model_config import (  # noqa: F401 - the configs' one import path
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    RopeConfig,
    parse_dtype,
    read_config_json,
)

log = logging.getLogger("blockspec")


@dataclass
class EngineConfig:
    """Everything the engine needs besides the weights. Names follow vLLM's engine args."""

    model: str
    dtype: str = "auto"
    device: str | None = None  # None: cuda when available, else cpu
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # Prefill tokens of a step that also decodes (they delay every running stream): 0 only
    # max_num_batched_tokens bounds them; N at most N; "auto" the scheduler's rule (at least
    # 512 and 12 per decoding sequence, more while a backlog waits, the step's graph bucket
    # filled, none past ~80 decoding sequences: engine/scheduler.py; the block beside the chunk
    # cut: policy/mixed_block.py); None, the default: "auto" for a speculative engine on CUDA,
    # 0 otherwise (measured: docs/benchmarks.md, "Mixed steps").
    decode_step_prefill_tokens: int | str | None = None
    kv_block_size: int = 16
    kv_cache_memory_gb: float | None = None  # None: 1 GiB on CPU; on CUDA what is left of
    # gpu_memory_utilization x total after weights and a profiled warm-up forward
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # overrides the memory budget (tests, debugging)
    enable_prefix_caching: bool = True
    seed: int = 0
    tokenizer: str | None = None
    load_format: str = "auto"  # "dummy": random weights from config.json (benchmarks only)
    draft: str | None = None  # DFlash drafter folder or Hub id: enables speculative decoding
    block_size: int | None = None  # speculative block (verified tokens); None: the drafter's
    enforce_eager: bool = False  # CUDA: no graphs
    # Decode steps scheduled and launched while the previous one runs (engine/pipeline.py;
    # vLLM's --async-scheduling): plain decode, and greedy speculative blocks whose schedule
    # does not wait for the accepted counts. None: on for one CUDA GPU, where the host's step
    # then hides behind the device's; off on CPU (the host is the device: nothing to overlap)
    # and with tensor parallelism (not supported yet).
    async_scheduling: bool | None = None
    # Speculation policy (with a drafter): "adaptive" picks plain decode or one of `block_sizes`
    # each step from measured step costs and live acceptance; "fixed" always runs the max block.
    # Without a drafter the policy and the profile are ignored, and `block_sizes` is refused.
    speculation_policy: str = "adaptive"
    # Block lengths the adaptive policy may run (the max block is always one). None: those of
    # 2, 4, 8, 16 below the max block, plus the max block (`block_size`, else the largest given
    # here, else the drafter's trained block size).
    block_sizes: tuple[int, ...] | None = None
    # Step-cost profile file (adaptive mode). None: a cache file under ~/.cache/blockspec
    # (or $BLOCKSPEC_CACHE), keyed by what changes costs; "none" or "": measure every start.
    cost_profile: str | None = None
    # With a drafter: while the policy decodes plainly (a long streak, or a load at which it
    # would), stop writing the drafter's context ("detached" mode) and catch it up with one
    # eager target pass before the drafter next runs. None: on with the adaptive policy.
    lazy_draft_context: bool | None = None
    # A step that is not all-decode (prefill chunks beside decodes or verify blocks) runs its
    # flat batch's forward as one CUDA graph per token bucket (the flat step), not one eager
    # forward. None: on with CUDA graphs; True elsewhere runs the same buffered step eagerly.
    graph_mixed_steps: bool | None = None
    attention_backend: str = "auto"  # auto: triton on CUDA, torch on CPU
    # Matmuls of at most 16 rows (small decode steps): auto = Triton kernels on CUDA (they read
    # the weights faster than cuBLAS there), torch (F.linear / cuBLAS) on CPU and for the rest.
    linear_backend: str = "auto"
    # Benchmark-only: accept each draft position with this probability instead of checking it.
    # Output is then NOT the target's; `benchmark_mode=True` must be set to use it.
    synthetic_acceptance: float | None = None
    benchmark_mode: bool = False
    # `model`, `draft` and `tokenizer` may be Hub ids (org/name): the Hub revision (branch, tag
    # or commit; default main) of `model` and of `draft`, and whether their *.py files (remote
    # code) are fetched and a tokenizer's own code (tokenizer_config.json's auto_map: Kimi's
    # tiktoken tokenizer) may run.
    revision: str | None = None
    draft_revision: str | None = None
    trust_remote_code: bool = False
    # Parallel layout (docs/parallel.md): attention and MLPs split over tensor_parallel_size
    # ranks, one per GPU; routed experts over expert_parallel_size groups of them (it divides
    # tensor_parallel_size). Several nodes: nnodes, this node's node_rank, and the address of
    # node 0 (master_port None: a free local port, one node only).
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # The folders to load, resolved on construction (blockspec/hub): the names themselves when
    # they are local folders (a path that exists wins), else snapshots in the Hugging Face cache.
    model_path: str = field(init=False, default="")
    draft_path: str | None = field(init=False, default=None)
    tokenizer_path: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self._validate_device()
        self._validate_sizes()
        self._validate_speculation()
        self._validate_synthetic()
        self._validate_parallel()
        for name, value, allowed in (("attention backend", self.attention_backend,
                                      ("auto", "torch", "triton")),
                                     ("linear backend", self.linear_backend,
                                      ("auto", "torch", "triton")),
                                     ("load_format", self.load_format, ("auto", "dummy"))):
            if value not in allowed:
                raise ConfigError(f"{name} must be {', '.join(allowed[:-1])} or {allowed[-1]}, "
                                  f"got {value!r}")
        self._resolve_paths()

    def _resolve_paths(self) -> None:
        # NOTE: last: a Hub id may mean gigabytes to download, so every cheap check runs first.
        from blockspec.hub import resolve_model_path

        if self.draft_revision is not None and self.draft is None:
            raise ConfigError("draft_revision is a drafter's Hub revision: it needs a draft model")
        hub = dict(trust_remote_code=self.trust_remote_code)
        weights = self.load_format != "dummy"  # NOTE: random weights need config.json only
        self.model_path = resolve_model_path(self.model, revision=self.revision, weights=weights,
                                             **hub)
        self.draft_path = None if self.draft is None else resolve_model_path(
            self.draft, what="draft", revision=self.draft_revision, weights=weights, **hub)
        self.tokenizer_path = self.model_path if self.tokenizer is None else resolve_model_path(
            self.tokenizer, what="tokenizer", weights=False, **hub)

    def _validate_device(self) -> None:
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ConfigError(f"unknown device {self.device!r}; choose cpu or cuda")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device cuda requested but no CUDA GPU is available")
        if self.dtype != "auto":
            parse_dtype(self.dtype)

    def _validate_sizes(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        cap = self.decode_step_prefill_tokens
        if cap is not None and cap != "auto" and (type(cap) is not int or cap < 0):
            raise ConfigError(f"decode_step_prefill_tokens must be 'auto' or >= 0 (0: no cap), "
                              f"got {cap!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError("max_model_len must be positive")
        if self.kv_block_size <= 0 or self.kv_block_size & (self.kv_block_size - 1):
            raise ConfigError("kv_block_size must be a positive power of two")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ConfigError("kv cache memory budget must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ConfigError("num_kv_blocks must be positive")

    def _validate_parallel(self) -> None:
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        if tp < 1 or ep < 1:
            raise ConfigError("tensor_parallel_size and expert_parallel_size must be >= 1")
        if tp % ep:
            raise ConfigError(f"expert_parallel_size ({ep}) must divide tensor_parallel_size "
                              f"({tp})")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes or tp % self.nnodes:
            raise ConfigError(f"nnodes ({self.nnodes}) must divide tensor_parallel_size ({tp}) "
                              f"and node_rank ({self.node_rank}) be in [0, nnodes)")
        if tp > 1 and ":" in self.device:
            raise ConfigError(f"tensor parallelism places rank i on GPU i of its node: pass "
                              f"device 'cuda', not {self.device!r}")
        if tp > 1 and self.async_scheduling:
            raise ConfigError("async_scheduling is not supported with tensor parallelism yet")
        if self.nnodes > 1 and self.master_port is None:
            raise ConfigError("several nodes need --master-addr and --master-port (node 0's)")
        if tp > 1 and self.device.startswith("cuda") \
                and torch.cuda.device_count() < tp // self.nnodes:
            raise ConfigError(f"tensor_parallel_size {tp} needs {tp // self.nnodes} GPUs per "
                              f"node; this one has {torch.cuda.device_count()}")

    def _validate_synthetic(self) -> None:
        if self.synthetic_acceptance is None:
            return
        if not self.benchmark_mode:
            raise ConfigError("synthetic acceptance is a benchmark-only mode (its output is "
                              "not the target's); it is refused outside benchmarks")
        if not 0.0 <= self.synthetic_acceptance <= 1.0:
            raise ConfigError("synthetic acceptance must be a probability in [0, 1]")
        if self.draft is None:
            raise ConfigError("synthetic acceptance needs a draft model")

    @property
    def prefill_cap_setting(self) -> int | None:
        """`decode_step_prefill_tokens` as the scheduler takes it (None: its "auto" rule).
        NOTE: a speculative step carries tau tokens per stream, so a prefill beside it delays
        that many; a mixed step's graph pads it to a bucket, which "auto" fills. On CPU mixed
        steps run eagerly at their size, and plain decoding keeps its throughput uncapped."""
        cap = self.decode_step_prefill_tokens
        if cap is None:
            cap = "auto" if self.draft is not None and self.device.startswith("cuda") else 0
        return None if cap == "auto" else cap

    @property
    def use_async_scheduling(self) -> bool:
        """`async_scheduling`, resolved (None: on for one CUDA GPU)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.device.startswith("cuda") and self.tensor_parallel_size == 1

    @property
    def use_lazy_draft_context(self) -> bool:
        """`lazy_draft_context`, resolved: None means on with a drafter and the adaptive policy
        (the policy is what decides to decode plainly)."""
        if self.lazy_draft_context is not None:
            return self.lazy_draft_context
        return self.draft is not None and self.speculation_policy == "adaptive"

    def _validate_speculation(self) -> None:
        if self.block_size is not None and self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2, got {self.block_size}")
        if self.block_size is not None and self.draft is None:
            raise ConfigError("block_size is the speculative block length: it needs a draft model")
        if self.speculation_policy not in ("adaptive", "fixed"):
            raise ConfigError(f"speculation policy must be adaptive or fixed, got "
                              f"{self.speculation_policy!r}")
        if self.lazy_draft_context is not None and not isinstance(self.lazy_draft_context, bool):
            raise ConfigError(f"lazy_draft_context must be true, false or None (auto), got "
                              f"{self.lazy_draft_context!r}")
        if self.lazy_draft_context and self.draft is None:
            raise ConfigError("lazy draft context defers the drafter's context writes: it needs "
                              "a draft model")
        if self.block_sizes is None:
            return
        try:
            sizes = tuple(sorted({int(b) for b in self.block_sizes}))
        except (TypeError, ValueError):
            raise ConfigError(f"block sizes must be integers, got {self.block_sizes!r}") from None
        if not sizes:
            raise ConfigError("block sizes must not be empty")
        if sizes[0] < 2:
            raise ConfigError(f"block sizes must be >= 2 (1 is plain decode, always a choice), "
                              f"got {list(sizes)}")
        if self.draft is None:
            raise ConfigError("block sizes are speculative block lengths: they need a draft model")
        if self.block_size is not None and sizes[-1] > self.block_size:
            raise ConfigError(f"block sizes {list(sizes)} exceed block_size {self.block_size} "
                              "(the max block)")
        self.block_sizes = sizes

    def resolve_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """`auto`: the checkpoint's dtype on CUDA (fp32 checkpoints run in bf16), fp32 on CPU."""
        if self.dtype != "auto":
            return parse_dtype(self.dtype)
        if str(self.device).startswith("cpu"):
            return torch.float32
        return torch.bfloat16 if checkpoint_dtype == torch.float32 else checkpoint_dtype

    def for_model(self, mc: ModelConfig) -> tuple[EngineConfig, int]:
        """This config as the engine runs `mc`, and the max model length it resolves to."""
        config = self
        if mc.moe is not None and not self.enforce_eager and self.device != "cpu" \
                and self.linear_backend == "torch":
            # NOTE: the torch experts read the router's choice on the host, which no graph
            # captures; the grouped GEMMs (layers/fused_moe.py, the CUDA default) are captured.
            log.warning("MoE target with linear_backend='torch': CUDA graphs off")
            config = dataclasses.replace(self, enforce_eager=True)
        if self.max_model_len is not None and self.max_model_len > mc.max_position_embeddings:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's "
                              f"max_position_embeddings {mc.max_position_embeddings}")
        return config, self.max_model_len or mc.max_position_embeddings
