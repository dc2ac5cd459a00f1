"""KV-cache sizing: bytes per block, the activation peak of the largest forward, and how many
blocks the memory budget holds."""

from __future__ import annotations

import torch

from blockspec.config import ConfigError, EngineConfig, ModelConfig
from blockspec.dflash.config import DFlashConfig
from blockspec.engine.context_staging import staging_rows
from blockspec.engine.decode_step import graph_buckets, graphed_block_lens
from blockspec.engine.flat_step import SHORT_QUERY_LENS, flat_buckets
from blockspec.layers.attention import AttentionMetadata, PagedAttention
from blockspec.models.qwen3 import CausalLM

_GiB = 1 << 30


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    tensors, heads, dim = cfg.kv_cache_geometry
    return tensors * cfg.num_hidden_layers * block_size * heads * dim * dtype.itemsize


def profile_activation_bytes(model: CausalLM, num_tokens: int, logit_rows: int,
                             block_size: int, dtype: torch.dtype) -> int:
    """Peak memory of the largest forward the engine will run (a full prefill chunk, then the
    logits of the largest decode batch), measured with a throwaway KV cache."""
    dev = next(model.parameters()).device
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    num_blocks = -(-num_tokens // block_size)
    cache = torch.zeros(2, len(layers), num_blocks, block_size, layers[0].num_kv_heads,
                        layers[0].head_dim, dtype=dtype, device=dev)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.inference_mode():
        meta = AttentionMetadata.build([num_tokens], [num_tokens], [list(range(num_blocks))],
                                       list(range(num_tokens)), dev)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        hidden, _ = model(ids, torch.arange(num_tokens, device=dev), meta)
        rows = hidden[:1].expand(logit_rows, -1)
        model.compute_logits(rows).float().softmax(dim=-1)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for layer in layers:
        layer.k_cache = layer.v_cache = torch.empty(0)
    del cache, hidden
    torch.cuda.empty_cache()
    return peak


def decide_num_blocks(config: EngineConfig, per_block: int, activation_bytes: int = 0) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory_gb is not None:
        budget = int(config.kv_cache_memory_gb * _GiB)
    elif str(config.device).startswith("cuda"):
        _, total = torch.cuda.mem_get_info()
        # NOTE: measured after a warm-up forward: weights, peak activations, and 1 GiB for the
        # CUDA graphs' pool and allocator slack stay outside the KV budget.
        used = torch.cuda.memory_allocated()
        budget = int(total * config.gpu_memory_utilization) - used - activation_bytes - _GiB
    else:
        budget = _GiB
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ConfigError(f"KV-cache memory budget ({budget / _GiB:.2f} GiB) is smaller than one "
                          f"KV block ({per_block / _GiB:.4f} GiB); raise --kv-cache-memory")
    return num_blocks


def graph_output_bytes(block_lens: list[int], buckets: list[int], vocab_size: int,
                       dtype: torch.dtype) -> int:
    """Logits that the captured graphs keep alive beyond the largest graph's (which the
    activation profile counts): outputs of graphs sharing a pool cannot share memory."""
    elem = dtype.itemsize
    sizes = [b * L * vocab_size * elem for L in block_lens for b in buckets]
    return sum(sizes) - max(sizes, default=0)


def flat_graph_bytes(config: EngineConfig, hidden_size: int, dtype: torch.dtype) -> int:
    """The hidden states each flat-step graph keeps alive (their intermediates share the graph
    pool with the decode graphs')."""
    if config.graph_mixed_steps is False:
        return 0
    classes = len(SHORT_QUERY_LENS) if config.draft is not None else 1
    return classes * sum(flat_buckets(config.max_num_batched_tokens)) * hidden_size \
        * dtype.itemsize


def context_staging_bytes(config: EngineConfig, target: ModelConfig, drafter: DFlashConfig,
                          graphed: bool, dtype: torch.dtype) -> tuple[int, int]:
    """(persistent, transient) bytes of the runner's deferred plain-step context writes.
    Persistent: the staging rows and the taps output that each captured plain-step graph keeps
    alive (`graphed`). Transient, while a flush runs: the fused features (fc output and its
    norm) and one drafter layer's K/V projection for every staged row."""
    elem = dtype.itemsize
    rows = staging_rows(config.max_num_seqs)
    width = len(drafter.target_layer_ids) * target.hidden_size
    buckets = graph_buckets(config.max_num_seqs) if graphed else []
    g = drafter.geometry
    persistent = (rows + sum(buckets)) * width * elem
    transient = rows * 2 * (g.hidden_size + g.num_key_value_heads * g.head_dim) * elem
    return persistent, transient


def outside_kv_bytes(config: EngineConfig, model: CausalLM, mc: ModelConfig,
                     drafter: torch.nn.Module | None, max_model_len: int, spec_block_size: int,
                     spec_block_lens: list[int], dtype: torch.dtype) -> int:
    """What stays outside the KV budget besides the weights: the largest forward's activations
    (profiled), the drafter context's staging, and the captured graphs' kept outputs."""
    activation = profile_activation_bytes(
        model, min(config.max_num_batched_tokens, max_model_len),
        config.max_num_seqs * max(spec_block_size, 1), config.kv_block_size, dtype)
    adaptive = drafter is not None and config.speculation_policy == "adaptive"
    if drafter is not None:
        # NOTE: the runner's staging of plain steps' drafter context (allocated after the KV
        # cache) stays outside the KV budget; a flush's transient peaks on its own.
        kept, peak = context_staging_bytes(config, mc, drafter.config,
                                           adaptive and not config.enforce_eager, dtype)
        activation = max(activation, peak) + kept
    if not config.enforce_eager:
        lens = graphed_block_lens(adaptive, spec_block_lens, max(spec_block_size, 1))
        if adaptive and config.use_lazy_draft_context:
            lens.append(1)  # the detached plain step's own graphs
        activation += graph_output_bytes(lens, graph_buckets(config.max_num_seqs),
                                         mc.vocab_size, dtype) \
            + flat_graph_bytes(config, mc.hidden_size, dtype)
    return activation
