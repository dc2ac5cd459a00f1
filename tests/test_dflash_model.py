"""The drafter's paged forward against a straightforward reference written from the checkpoint's
own tensors: materialised attention over [context ; block], no cache, no fused weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from blockspec.config import ModelConfig
from blockspec.dflash.checkpoint import build_random_drafter
from blockspec.dflash.config import DFlashConfig
from blockspec.dflash.proposer import load_drafter
from blockspec.layers.attention import AttentionMetadata, PagedAttention


def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta, dim):
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_drafter(W: dict, cfg: DFlashConfig, taps: torch.Tensor, block: torch.Tensor,
                      ctx_pos: torch.Tensor, blk_pos: torch.Tensor) -> torch.Tensor:
    g = cfg.geometry
    nh, nkv, d = g.num_attention_heads, g.num_key_value_heads, g.head_dim
    ctx = rms(taps @ W["fc.weight"].T, W["hidden_norm.weight"])
    h = block
    for i in range(g.num_hidden_layers):
        p = f"layers.{i}."
        x = rms(h, W[p + "input_layernorm.weight"])
        q = (x @ W[p + "self_attn.q_proj.weight"].T).view(-1, nh, d)
        kv_in = torch.cat([ctx, x])
        k = (kv_in @ W[p + "self_attn.k_proj.weight"].T).view(-1, nkv, d)
        v = (kv_in @ W[p + "self_attn.v_proj.weight"].T).view(-1, nkv, d)
        q = rms(q, W[p + "self_attn.q_norm.weight"])
        k = rms(k, W[p + "self_attn.k_norm.weight"])
        q = rope(q, blk_pos, g.rope.theta, d)
        k = rope(k, torch.cat([ctx_pos, blk_pos]), g.rope.theta, d)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        att = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5  # no mask: non-causal
        out = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(len(block), nh * d)
        h = h + out @ W[p + "self_attn.o_proj.weight"].T
        x = rms(h, W[p + "post_attention_layernorm.weight"])
        mlp = F.silu(x @ W[p + "mlp.gate_proj.weight"].T) * (x @ W[p + "mlp.up_proj.weight"].T)
        h = h + mlp @ W[p + "mlp.down_proj.weight"].T
    return rms(h, W["norm.weight"])


@pytest.fixture(scope="module")
def drafter_dir(models_root, qwen3_path):
    return build_random_drafter(models_root / "drafter-ref", qwen3_path, num_layers=3,
                                block_size=8, target_layer_ids=[0, 2, 3], seed=5)


def bind_cache(drafter, num_blocks: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(0)
    for layer in drafter.modules():
        if isinstance(layer, PagedAttention):
            shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            # Garbage everywhere: reading a slot that was never written shows up.
            layer.k_cache = 50 * torch.randn(shape, generator=gen)
            layer.v_cache = 50 * torch.randn(shape, generator=gen)


@torch.no_grad()
def test_paged_drafter_matches_reference(drafter_dir, qwen3_path):
    target_cfg = ModelConfig.from_pretrained(qwen3_path)
    drafter = load_drafter(str(drafter_dir), target_cfg, 1024, torch.float32,
                           torch.device("cpu"))
    cfg = drafter.config
    W = load_file(str(drafter_dir / "model.safetensors"))
    H, bs = cfg.geometry.hidden_size, 4
    bind_cache(drafter, num_blocks=16, block_size=bs)
    gen = torch.Generator().manual_seed(1)
    # Two sequences, scattered block tables, contexts of 9 and 3 tokens, blocks of 8 and 5.
    seqs = [dict(table=[7, 2, 11, 5, 9], ctx=9, blk=8), dict(table=[3, 14], ctx=3, blk=5)]
    for s in seqs:
        s["taps"] = torch.randn(s["ctx"], 3 * H, generator=gen)
        s["block"] = torch.randn(s["blk"], H, generator=gen)

    def slots(s, lo, hi):
        return [s["table"][p // bs] * bs + p % bs for p in range(lo, hi)]

    # Context written in two chunks per sequence (as chunked prefill + verify steps would).
    for s in seqs:
        for lo, hi in ((0, s["ctx"] // 2), (s["ctx"] // 2, s["ctx"])):
            taps = list(s["taps"][lo:hi].split(H, dim=-1))
            drafter.write_context(drafter.fuse(taps), torch.arange(lo, hi),
                                  torch.tensor(slots(s, lo, hi)))
    meta = AttentionMetadata.build(
        [s["blk"] for s in seqs], [s["ctx"] + s["blk"] for s in seqs], [s["table"] for s in seqs],
        [x for s in seqs for x in slots(s, s["ctx"], s["ctx"] + s["blk"])], "cpu", causal=False)
    positions = torch.cat([torch.arange(s["ctx"], s["ctx"] + s["blk"]) for s in seqs])
    ours = drafter(torch.cat([s["block"] for s in seqs]), positions, meta)
    start = 0
    for s in seqs:
        ref = reference_drafter(W, cfg, s["taps"], s["block"], torch.arange(s["ctx"]),
                                torch.arange(s["ctx"], s["ctx"] + s["blk"]))
        torch.testing.assert_close(ours[start:start + s["blk"]], ref, atol=1e-4, rtol=1e-4)
        start += s["blk"]


def test_default_target_layer_ids():
    from blockspec.dflash.config import default_target_layer_ids

    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
