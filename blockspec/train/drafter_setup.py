"""What a drafter trains against and starts from: the frozen HF target (tapped hidden states,
embeddings, lm_head) and the drafter's initial weights (fresh, or layers copied from the target)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from blockspec.config import ConfigError, ModelConfig
from blockspec.dflash.checkpoint import new_drafter_config
from blockspec.dflash.dflash import DFlashDrafter

if TYPE_CHECKING:
    from blockspec.train.drafter_train import TrainArgs


class FrozenTarget:
    """The HF target, frozen: tapped hidden states, embeddings and lm_head.

    NOTE: taps are HF `hidden_states[id + 1]` (the output of decoder layer `id`; for the last
    layer HF gives it after the final norm), exactly what the engine feeds the drafter."""

    def __init__(self, path: str, layer_ids: list[int], device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        # bf16 on CUDA (the drafter trains under bf16 autocast anyway), exact fp32 on CPU.
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        except (OSError, ValueError) as e:
            raise ConfigError(f"could not load target {path!r}: {e}") from None
        self.model = model.to(device).eval().requires_grad_(False)
        self.embed: nn.Module = model.get_input_embeddings()
        self.lm_head: nn.Module = model.get_output_embeddings()
        self.layer_ids = layer_ids

    @torch.no_grad()
    def features(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [L] or [S, L] (equal lengths, no padding) -> concatenated taps [(S,) L,
        n_taps*H] (config order), fp32."""
        ids = tokens[None] if tokens.dim() == 1 else tokens
        out = self.model.get_decoder()(input_ids=ids, use_cache=False, output_hidden_states=True)
        # NOTE: fp32 features and embeddings keep the drafter's residual stream in fp32; autocast
        # still runs its matmuls in bf16 on CUDA.
        taps = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1).float()
        return taps[0] if tokens.dim() == 1 else taps


def init_drafter(target_path: str, args: TrainArgs, tokenizer: Any,
                 device: torch.device) -> DFlashDrafter:
    target_cfg = ModelConfig.from_pretrained(target_path)
    mask = args.mask_token_id
    if mask is None:
        mask = getattr(tokenizer, "mask_token_id", None)
        if mask is None:
            mask = tokenizer.convert_tokens_to_ids("<|mask|>")
            mask = None if mask == tokenizer.unk_token_id else mask
    if mask is None:
        raise ConfigError("the tokenizer has no mask token; pass --mask-token-id")
    if args.max_len > target_cfg.max_position_embeddings:
        raise ConfigError(f"--max-len {args.max_len} exceeds the target's "
                          f"max_position_embeddings {target_cfg.max_position_embeddings}")
    cfg = new_drafter_config(target_cfg, args.num_layers, args.block_size, int(mask),
                             args.target_layer_ids)
    cfg.validate_pair(target_cfg)
    with torch.device(device):
        drafter = DFlashDrafter(cfg).float()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    if args.init_from_target:
        copy_target_layers(drafter, target_path)
    return drafter


def copy_target_layers(drafter: DFlashDrafter, target_path: str) -> None:
    """Drafter layer i <- target layer (n - num_layers + i): the same Qwen3 layer shapes. The
    fc / hidden_norm / final norm keep their fresh init.

    NOTE: a warm start only; the drafter's layers see [context ; block] K/V, not the target's
    inputs, so training still has to adapt them."""
    from safetensors import safe_open

    from blockspec.models.loader import copy_weight, safetensors_files

    cfg = drafter.config
    offset = cfg.num_target_layers - cfg.geometry.num_hidden_layers
    if offset < 0:
        raise ConfigError("--init-from-target needs a drafter with no more layers than the target")
    params = dict(drafter.named_parameters())
    with torch.no_grad():
        for file in safetensors_files(target_path):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    parts = name.split(".")
                    if parts[:2] != ["model", "layers"] or int(parts[2]) < offset:
                        continue
                    mine = ".".join(["layers", str(int(parts[2]) - offset), *parts[3:]])
                    copy_weight(drafter, mine, f.get_tensor(name).float(), params)
