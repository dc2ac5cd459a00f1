"""Write DFlash drafters in the published checkpoint format (unfused HF names, no `model.`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from blockspec.config import ModelConfig, RopeConfig
from blockspec.dflash.config import DFlashConfig, default_target_layer_ids
from blockspec.dflash.dflash import DFlashDrafter


def unfused_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF names for a model with fused qkv_proj / gate_up_proj (drafter or target)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        module = name.split(".")[-2] if "." in name else ""
        if module in ("qkv_proj", "gate_up_proj"):
            prefix, suffix = name.rsplit(".", 2)[0], name.rsplit(".", 1)[1]
            parts = ["q_proj", "k_proj", "v_proj"] if module == "qkv_proj" \
                else ["gate_proj", "up_proj"]
            for part, piece in zip(parts, t.split(model.shard_sizes(name), dim=0)):
                out[f"{prefix}.{part}.{suffix}"] = piece.contiguous()
        else:
            out[name] = t.contiguous()
    return out


def save_drafter(drafter: DFlashDrafter, out: str | os.PathLike) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = drafter.config.to_dict()
    cfg["torch_dtype"] = str(next(drafter.parameters()).dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = {k: v.detach().cpu() for k, v in unfused_state_dict(drafter).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def new_drafter_config(target: ModelConfig, num_layers: int, block_size: int,
                       mask_token_id: int, target_layer_ids: list[int] | None = None,
                       intermediate_size: int | None = None) -> DFlashConfig:
    """A drafter geometry matching the target's heads and width (the published recipe); an MLA
    target's heads become plain heads of hidden / heads dims."""
    head_dim = target.head_dim if target.mla is None \
        else target.hidden_size // target.num_attention_heads
    geometry = ModelConfig(
        model_type="qwen3", vocab_size=target.vocab_size, hidden_size=target.hidden_size,
        intermediate_size=intermediate_size or target.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads, head_dim=head_dim,
        rms_norm_eps=target.rms_norm_eps, max_position_embeddings=target.max_position_embeddings,
        rope=RopeConfig(**vars(target.rope)), dtype=target.dtype,
    )
    ids = target_layer_ids or default_target_layer_ids(target.num_hidden_layers, num_layers)
    return DFlashConfig(geometry=geometry, block_size=block_size, mask_token_id=mask_token_id,
                        target_layer_ids=ids, num_target_layers=target.num_hidden_layers)


def build_random_drafter(out: str | os.PathLike, target_path: str | os.PathLike,
                         num_layers: int = 2, block_size: int = 16,
                         mask_token_id: int | None = None,
                         target_layer_ids: list[int] | None = None, init_std: float = 0.25,
                         seed: int = 0) -> Path:
    """Random drafter for a target folder (tests). Mask token: the tokenizer's `<|mask|>` if it has
    one, else the last vocab id."""
    target = ModelConfig.from_pretrained(target_path)
    if mask_token_id is None:
        mask_token_id = target.vocab_size - 1
        vocab_file = Path(target_path) / "tokenizer.json"
        if vocab_file.is_file():
            added = json.loads(vocab_file.read_text()).get("added_tokens", [])
            mask_token_id = next((t["id"] for t in added if t["content"] == "<|mask|>"),
                                 mask_token_id)
    cfg = new_drafter_config(target, num_layers, block_size, mask_token_id, target_layer_ids)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg).float()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, init_std)
    return save_drafter(drafter, out)
