"""Owns the model and its KV cache on the device; turns scheduled sequences into tensors, runs the
forward, samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.config import ConfigError, EngineConfig, ModelConfig
from blockspec.engine.kv_cache import BlockManager
from blockspec.engine.sequence import Sequence
from blockspec.layers.attention import AttentionMetadata, PagedAttention
from blockspec.layers.sampler import SamplingTensors, chosen_logprobs, sample
from blockspec.models.qwen3 import CausalLM

_GiB = 1 << 30


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the flat batch whose logits are sampled
    sample_seqs: list[Sequence]


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                       num_layers: int | None = None) -> int:
    layers = cfg.num_hidden_layers if num_layers is None else num_layers
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


def decide_num_blocks(config: EngineConfig, per_block: int) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory_gb is not None:
        budget = int(config.kv_cache_memory_gb * _GiB)
    elif str(config.device).startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        # NOTE: leave room for activations and the sampler's [N, vocab] fp32 buffers.
        budget = int(free * 0.9) - 2 * _GiB
    else:
        budget = _GiB
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ConfigError(f"KV-cache memory budget ({budget / _GiB:.2f} GiB) is smaller than one "
                          f"KV block ({per_block / _GiB:.4f} GiB); raise --kv-cache-memory")
    return num_blocks


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model: CausalLM,
                 block_manager: BlockManager, dtype: torch.dtype) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.model = model
        self.device = torch.device(config.device)
        self.dtype = dtype
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.manual_seed(config.seed)
        self.kv_cache = self._allocate_kv(model, block_manager.num_blocks)

    def _allocate_kv(self, model: torch.nn.Module, num_blocks: int) -> torch.Tensor:
        layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        kv_heads, head_dim = layers[0].num_kv_heads, layers[0].head_dim
        cache = torch.zeros(2, len(layers), num_blocks, self.block_size, kv_heads, head_dim,
                            dtype=self.dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
        return cache

    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int]) -> StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sample_seqs: list[Sequence] = []
        bm = self.block_manager
        for seq, n in zip(seqs, num_new_tokens):
            start = seq.num_computed_tokens
            for p in range(start, start + n):
                input_ids.append(seq.token_at(p))
                positions.append(p)
                slots.append(bm.slot(seq, p))
            seq_lens.append(start + n)
            if start + n == seq.num_tokens:
                logits_indices.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        meta = AttentionMetadata.build(num_new_tokens, seq_lens, [s.block_table for s in seqs],
                                       slots, self.device)
        dev = self.device
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64).to(dev),
            sample_seqs=sample_seqs,
        )

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], num_new_tokens: list[int]
                ) -> tuple[list[Sequence], list[int], list[dict[int, float] | None]]:
        """Runs one step. Returns the sequences that got a new token, the tokens, and logprobs."""
        inp = self.prepare(seqs, num_new_tokens)
        hidden, _ = self.model(inp.input_ids, inp.positions, inp.meta)
        if not inp.sample_seqs:
            return [], [], []
        logits = self.model.compute_logits(hidden[inp.logits_indices]).float()
        st = SamplingTensors.build([s.params for s in inp.sample_seqs],
                                   [s.generator for s in inp.sample_seqs],
                                   self.model_cfg.vocab_size, self.device)
        tokens = sample(logits, st, self.default_generator)
        logprobs: list[dict[int, float] | None] = [None] * len(inp.sample_seqs)
        want = [s.params.logprobs for s in inp.sample_seqs]
        if any(w is not None for w in want):
            k = max(w or 0 for w in want)
            chosen, top_vals, top_ids = chosen_logprobs(logits, tokens, k)
            chosen, top_vals, top_ids = chosen.tolist(), top_vals.tolist(), top_ids.tolist()
            tok_list = tokens.tolist()
            for r, w in enumerate(want):
                if w is not None:
                    d = {tok_list[r]: chosen[r]}
                    for j in range(w):
                        d.setdefault(top_ids[r][j], top_vals[r][j])
                    logprobs[r] = d
        return inp.sample_seqs, tokens.tolist(), logprobs
