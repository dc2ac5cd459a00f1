"""Which kernels a model's layers run: the attention and linear backends ("auto": Triton on
CUDA, torch on CPU) set into every PagedAttention and Linear of the target and the drafter, an
MLA target's attention on the MLA kernel where the generic one would run, a MoE layer's routed
experts following the linear backend."""

from __future__ import annotations

import torch

from blockspec.config import EngineConfig, ModelConfig
from blockspec.layers.attention import PagedAttention, get_backend
from blockspec.layers.linear import Linear


def set_backends(model: torch.nn.Module, drafter: torch.nn.Module | None, config: EngineConfig,
                 model_config: ModelConfig, device: torch.device) -> tuple[str, str]:
    """Sets the backends in one walk; returns (attention, linear) as resolved."""
    auto = "triton" if device.type == "cuda" else "torch"
    attention_name = auto if config.attention_backend == "auto" else config.attention_backend
    linear = auto if config.linear_backend == "auto" else config.linear_backend
    attention = target_attention = get_backend(attention_name)
    if model_config.mla is not None and attention_name == "triton":
        # NOTE: the generic kernel's tile over a 576-wide latent and 64-128 heads needs more
        # shared memory than an H100/H200 has (256-384 KB): MLA has a kernel of its own.
        from blockspec.layers.triton_mla import TritonMLABackend

        target_attention = TritonMLABackend(kv_lora_rank=model_config.mla.kv_lora_rank)
    for net in (model, drafter):
        for m in net.modules() if net is not None else ():
            if isinstance(m, PagedAttention):
                m.backend = target_attention if net is model else attention
            elif isinstance(m, Linear):
                m.backend = linear
            elif hasattr(m, "experts_backend"):
                m.experts_backend = linear
    return attention_name, linear
