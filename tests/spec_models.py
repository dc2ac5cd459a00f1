"""Target + drafter pairs for the speculative-decoding tests."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from blockspec.dflash.checkpoint import build_random_drafter
from blockspec.tiny import build_tiny_model


def _rewrite(path: Path, edit) -> None:
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(f), metadata={"format": "pt"})


def build_constant_pair(root: Path, probs: dict[int, float], block_size: int = 8,
                        name: str = "const") -> tuple[Path, Path]:
    """A target whose next-token distribution is `probs` whatever the context, and a drafter that
    always proposes the most likely token.

    Every layer's o_proj/down_proj is zero, so the residual stream is the token embedding; all
    embedding rows are equal, so the final state is one vector h for every token; lm_head maps h
    to logits log(probs) (others -30). The drafter's layers are zeroed too, so it outputs the same
    h and hence argmax(probs). Drafts of the top token are accepted with probability p(top).
    """
    target = build_tiny_model(root / f"{name}-target", arch="qwen3", seed=7)

    def edit_target(t: dict[str, torch.Tensor]) -> None:
        for k in t:
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                t[k].zero_()
        emb = t["model.embed_tokens.weight"]
        emb.copy_(emb[1:2].expand_as(emb))
        hidden = emb.shape[1]
        t["model.norm.weight"].fill_(1.0)
        h = emb[0].clone()
        h = h / h.pow(2).mean().sqrt()  # what the final RMSNorm produces (eps ~ 0)
        lm = torch.zeros(emb.shape[0], hidden)
        for tok in range(emb.shape[0]):
            lm[tok] = h * (-30.0 / h.pow(2).sum())
        for tok, p in probs.items():
            lm[tok] = h * (math.log(p) / h.pow(2).sum())
        t["lm_head.weight"] = lm

    _rewrite(target, edit_target)
    drafter = build_random_drafter(root / f"{name}-drafter", target, num_layers=2,
                                   block_size=block_size)

    def edit_drafter(t: dict[str, torch.Tensor]) -> None:
        for k in t:
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                t[k].zero_()
        t["norm.weight"].fill_(1.0)

    _rewrite(drafter, edit_drafter)
    return target, drafter
