"""The DFlash drafter's training forward: many random-anchor blocks of one sequence in one pass.

Every block i (anchor a_i) is `[token a_i, mask x (B-1)]` at positions a_i..a_i+B-1. Its queries
see the fused target features of positions < a_i (the drafter's context K/V, computed exactly as
`DraftAttention.write_context` does at inference) and every position of block i (bidirectional),
nothing of other blocks. All blocks of a sequence run in one pass of
`block_sparse_attention`, which computes exactly the attention under `block_attention_mask` (the
recipe's mask, kept as the reference) without materialising its N*B x N*B all-but-diagonal part.

The forward is functional over a `DFlashDrafter`'s own modules (qkv_proj, q_norm, k_norm, o_proj,
mlp, norms, fc, hidden_norm, rotary tables) so training and inference share one set of weights and
the saved checkpoint is the published format without any conversion.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockspec.dflash.dflash import DFlashDrafter, DraftAttention, DraftLayer

# Loss-weight decay per block size (the published recipe); other sizes use 7.
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    return DEFAULT_GAMMA.get(block_size, 7.0)


def sample_anchors(seq_len: int, block_size: int, max_anchors: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Sorted distinct anchors a in [1, seq_len - B]: a full block of labels fits (a + B <= len)
    and at least one context token precedes it, as at inference (the prompt is never empty)."""
    candidates = seq_len - block_size
    if candidates <= 0:
        return torch.empty(0, dtype=torch.long)
    n = min(max_anchors, candidates)
    pick = torch.randperm(candidates, generator=generator)[:n] + 1
    return pick.sort().values


def block_attention_mask(anchors: torch.Tensor, block_size: int, ctx_len: int) -> torch.Tensor:
    """Boolean [N*B, ctx_len + N*B]: True where a query may attend.

    Rows: block i's B positions, blocks in `anchors` order. Columns: context positions 0..ctx_len-1,
    then every block's positions in the same order as the rows."""
    n = anchors.numel()
    device = anchors.device
    q_block = torch.arange(n, device=device).repeat_interleave(block_size)  # block of each query
    q_anchor = anchors.repeat_interleave(block_size)
    ctx_ok = torch.arange(ctx_len, device=device)[None, :] < q_anchor[:, None]
    blk_ok = q_block[:, None] == q_block[None, :]
    return torch.cat([ctx_ok, blk_ok], dim=1)


def _rope(attn: DraftAttention, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return attn.rotary.rotate(positions, x)


def _attention(layer: DraftLayer, x: torch.Tensor, ctx: torch.Tensor, q_pos: torch.Tensor,
               ctx_pos: torch.Tensor, anchors: torch.Tensor, backend: str) -> torch.Tensor:
    """x: [S*N*B, H] block states; ctx: [S*L, H] fused context; anchors [S, N]."""
    attn = layer.self_attn
    nh, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    seqs = anchors.shape[0]
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = _rope(attn, attn.q_norm(q.reshape(-1, nh, d)), q_pos)
    k = _rope(attn, attn.k_norm(k.reshape(-1, nkv, d)), q_pos)
    # NOTE: context K/V exactly as write_context: k_norm(k_proj(ctx)) roped at the context's
    # positions, v_proj(ctx); no input_layernorm on ctx (it is already hidden_norm'ed).
    w, b = attn.qkv_proj.weight[attn.q_size:], attn.qkv_proj.bias
    kv_ctx = F.linear(ctx, w, None if b is None else b[attn.q_size:])
    k_ctx, v_ctx = kv_ctx.split([attn.kv_size, attn.kv_size], dim=-1)
    k_ctx = _rope(attn, attn.k_norm(k_ctx.reshape(-1, nkv, d)), ctx_pos)
    out = block_sparse_attention(
        q.reshape(seqs, -1, nh, d), k_ctx.reshape(seqs, -1, nkv, d),
        v_ctx.reshape(seqs, -1, nkv, d), k.reshape(seqs, -1, nkv, d),
        v.reshape(seqs, -1, nkv, d), anchors, d**-0.5, backend)
    return attn.o_proj(out.reshape(-1, attn.q_size))


def block_sparse_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                           k_blk: torch.Tensor, v_blk: torch.Tensor, anchors: torch.Tensor,
                           scale: float, backend: str = "dense") -> torch.Tensor:
    """Attention under `block_attention_mask` (shapes: `dense_block_attention`), with the
    `backend` "dense" (any device) or "flex" (FlexAttention)."""
    if backend == "flex":
        return flex_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, scale)
    if backend != "dense":
        raise ValueError(f"attention backend must be dense or flex, got {backend!r}")
    return dense_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, scale)


# The compiled flex_attention, built on first CUDA use (a cache, not a setting).
_COMPILED_FLEX: list = []


def flex_block_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                         k_blk: torch.Tensor, v_blk: torch.Tensor, anchors: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """The same attention with FlexAttention: keys [context ; every block], a block mask that
    skips the tiles no query sees (most of the block-diagonal part, the context past the last
    anchor of a tile), one fused kernel forward and backward (compiled on CUDA; the unfused
    reference elsewhere, for tests)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seqs, nb, nh, d = q.shape
    ctx_len = k_ctx.shape[1]
    bsz = nb // anchors.shape[1]

    def visible(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, kv: torch.Tensor
                ) -> torch.Tensor:
        blk = qi // bsz
        return torch.where(kv < ctx_len, kv < anchors[b, blk], (kv - ctx_len) // bsz == blk)

    cuda = q.is_cuda
    mask = create_block_mask(visible, seqs, None, nb, ctx_len + nb, device=q.device,
                             _compile=cuda)
    k = torch.cat([k_ctx, k_blk], dim=1).transpose(1, 2)
    v = torch.cat([v_ctx, v_blk], dim=1).transpose(1, 2)
    fn = flex_attention
    if cuda:
        if not _COMPILED_FLEX:
            _COMPILED_FLEX.append(torch.compile(flex_attention, dynamic=False))
        fn = _COMPILED_FLEX[0]
    out = fn(q.transpose(1, 2), k, v, block_mask=mask, scale=scale, enable_gqa=nh != k.shape[1])
    return out.transpose(1, 2)


def check_flex(device: torch.device) -> float:
    """Max abs difference between flex and dense outputs and input gradients on a small random
    problem (fp32, GQA, ragged anchors): the trainer uses flex only where this is small."""
    gen = torch.Generator().manual_seed(0)
    bsz, ctx_len, d, heads, kv_heads = 16, 300, 64, 6, 2
    anchors = torch.stack([torch.randperm(ctx_len - bsz, generator=gen)[:20].sort().values + 1
                           for _ in range(2)]).to(device)
    nb = anchors.shape[1] * bsz
    shapes = [(2, nb, heads, d), (2, ctx_len, kv_heads, d), (2, ctx_len, kv_heads, d),
              (2, nb, kv_heads, d), (2, nb, kv_heads, d)]
    inputs = [torch.randn(sh, generator=gen).to(device).requires_grad_() for sh in shapes]
    results = []
    for fn in (dense_block_attention, flex_block_attention):
        out = fn(*inputs, anchors, d**-0.5)
        grads = torch.autograd.grad((out * out.detach().cos()).sum(), inputs)
        results.append([out.detach(), *grads])
    return max((a - b).abs().max().item() for a, b in zip(*results))


def dense_block_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                          k_blk: torch.Tensor, v_blk: torch.Tensor, anchors: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Attention under `block_attention_mask`, per sequence, without materialising the mask.

    q, k_blk, v_blk: [S, N*B, heads, d] (blocks in anchor order); k_ctx, v_ctx: [S, L, kv_heads,
    d]; anchors: [S, N]. Returns [S, N*B, heads, d].
    NOTE: a query sees its own sequence's context positions < its anchor plus its own block's B
    keys, never another block, so the scores are [N*B, L] (context, prefix-masked) and [N, B, B]
    (own block) under one joint softmax: L + B columns per query instead of L + N*B. GQA: query
    head h reads kv head h // (heads / kv_heads), as SDPA's enable_gqa."""
    seqs, nb, nh, d = q.shape
    n = anchors.shape[1]
    bsz = nb // n
    ctx_len, nkv = k_ctx.shape[1], k_ctx.shape[2]
    g = nh // nkv
    qh = q.reshape(seqs, nb, nkv, g, d)
    s_ctx = torch.einsum("sqkgd,slkd->skgql", qh, k_ctx) * scale  # [S, nkv, g, NB, L]
    visible = (torch.arange(ctx_len, device=q.device)[None, None, :]
               < anchors.repeat_interleave(bsz, dim=1)[:, :, None])  # [S, NB, L]
    s_ctx = s_ctx.masked_fill(~visible[:, None, None], float("-inf"))
    qb = qh.reshape(seqs, n, bsz, nkv, g, d)
    s_blk = torch.einsum("snqkgd,snpkd->skgnqp", qb,
                         k_blk.reshape(seqs, n, bsz, nkv, d)) * scale
    scores = torch.cat([s_ctx, s_blk.reshape(seqs, nkv, g, nb, bsz)], dim=-1)
    probs = scores.to(torch.promote_types(scores.dtype, torch.float32)).softmax(dim=-1)
    probs = probs.to(v_ctx.dtype)
    p_ctx, p_blk = probs.split([ctx_len, bsz], dim=-1)
    out = torch.einsum("skgql,slkd->sqkgd", p_ctx, v_ctx)
    out = out + torch.einsum("skgnqp,snpkd->snqkgd", p_blk.reshape(seqs, nkv, g, n, bsz, bsz),
                             v_blk.reshape(seqs, n, bsz, nkv, d)).reshape(seqs, nb, nkv, g, d)
    return out.reshape(seqs, nb, nh, d)


def _mlp(layer: DraftLayer, x: torch.Tensor) -> torch.Tensor:
    gate, up = layer.mlp.gate_up_proj(x).chunk(2, dim=-1)
    return layer.mlp.down_proj(F.silu(gate) * up)


def train_forward(drafter: DFlashDrafter, taps: torch.Tensor, block_embeds: torch.Tensor,
                  anchors: torch.Tensor, attention: str = "dense") -> torch.Tensor:
    """taps: [L, n_taps*H] target hidden states (config order, concatenated) of one sequence, or
    [S, L, n_taps*H] for S equal-length sequences; block_embeds: [(S*)N*B, H] embedded blocks;
    anchors: [N] or [S, N]; `attention`: "dense" or "flex" (`block_sparse_attention`). Returns
    final-normed states [(S*)N*B, H].

    NOTE: S sequences run as one pass (bigger GEMMs, S times fewer launches); each block still
    sees only its own sequence's context."""
    if taps.dim() == 2:
        taps, anchors = taps[None], anchors[None]
    bsz = drafter.config.block_size
    seqs, ctx_len = taps.shape[:2]
    dev = taps.device
    ctx = drafter.hidden_norm(drafter.fc(taps.reshape(seqs * ctx_len, -1)))
    ctx_pos = torch.arange(ctx_len, device=dev).repeat(seqs)
    q_pos = (anchors[:, :, None] + torch.arange(bsz, device=dev)).reshape(-1)
    h = block_embeds
    for layer in drafter.layers:
        h = h + _attention(layer, layer.input_layernorm(h), ctx, q_pos, ctx_pos, anchors,
                           attention)
        h = h + _mlp(layer, layer.post_attention_layernorm(h))
    return drafter.norm(h)


def block_inputs(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int,
                 mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block token ids [..., N, B], labels [..., N, B-1]) for anchors [..., N] into tokens
    [..., L] (one sequence, or a batch of equal-length ones)."""
    offsets = torch.arange(block_size, device=tokens.device)
    idx = anchors[..., None] + offsets[1:]
    labels = tokens.gather(-1, idx.flatten(-2)).view_as(idx)
    blocks = torch.full((*anchors.shape, block_size), mask_token_id, dtype=tokens.dtype,
                        device=tokens.device)
    blocks[..., 0] = tokens.gather(-1, anchors)
    return blocks, labels


def position_weights(block_size: int, gamma: float, device: torch.device | str = "cpu"
                     ) -> torch.Tensor:
    """exp(-(k-1)/gamma) for block positions k = 1..B-1: early positions gate every later one."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def weighted_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
                  ) -> torch.Tensor:
    """logits [N, B-1, V], labels [N, B-1] -> position-weighted mean cross-entropy."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    ce = ce.view_as(labels)
    return (ce * weights[None, :]).sum() / (weights.sum() * labels.shape[0])


def acceptance_length(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Greedy tau per block: 1 + length of the prefix of positions whose argmax equals the label."""
    return 1 + (pred == labels).long().cumprod(dim=1).sum(dim=1)

