"""Per-request logits processing before sampling: logit_bias, min_tokens, repetition, frequency
and presence penalties (vLLM's semantics, in SamplingParams' documented order).

A row sees the tokens before the position it samples: the request's prompt, its committed output,
and, for a row of a verify block, the drafts ahead of it in the block. Since a row's pick is used
only when every draft before it was accepted, those drafts are exactly the output a plain decode
would have had there, so speculative and plain decoding process identical logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.sampling_params import SamplingParams


@dataclass
class RowContext:
    """What one row's processing depends on."""

    params: SamplingParams
    prompt: list[int]
    output: list[int]  # output tokens before this row's position (committed + draft prefix)
    eos_token_ids: tuple[int, ...]


def _banned(ctx: RowContext, vocab: int) -> list[int]:
    """Tokens a row may not sample yet: while its output is shorter than min_tokens, the stop
    token ids and (unless ignore_eos) EOS."""
    p = ctx.params
    if len(ctx.output) >= p.min_tokens:
        return []
    ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(ctx.eos_token_ids))
    return sorted(t for t in ids if t < vocab)


def _index(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, ...]:
    t = torch.tensor(pairs, dtype=torch.int64, device=device).view(-1, 2)
    return t[:, 0], t[:, 1]


def _counts(rows: list[int], tokens: list[list[int]], vocab: int,
            device: torch.device) -> torch.Tensor:
    """[len(rows), vocab] occurrence counts of each row's tokens."""
    counts = torch.zeros(len(rows), vocab, dtype=torch.float32, device=device)
    pairs = [(k, t) for k, toks in enumerate(tokens) for t in toks if 0 <= t < vocab]
    if pairs:
        r, c = _index(pairs, device)
        counts.index_put_((r, c), torch.ones(len(pairs), device=device), accumulate=True)
    return counts


def _penalize(logits: torch.Tensor, rows: list[int], ctxs: list[RowContext]) -> None:
    vocab, dev = logits.shape[-1], logits.device
    idx = torch.tensor(rows, dtype=torch.int64, device=dev)
    x = logits[idx]
    out = _counts(rows, [c.output for c in ctxs], vocab, dev)
    rep = torch.tensor([c.params.repetition_penalty for c in ctxs], device=dev)[:, None]
    if bool((rep != 1.0).any()):
        seen = (out + _counts(rows, [c.prompt for c in ctxs], vocab, dev)) > 0
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = torch.tensor([c.params.frequency_penalty for c in ctxs], device=dev)[:, None]
    pres = torch.tensor([c.params.presence_penalty for c in ctxs], device=dev)[:, None]
    x = x - freq * out - pres * (out > 0).float()
    logits[idx] = x


def process_logits(logits: torch.Tensor, ctxs: list[RowContext | None]) -> torch.Tensor:
    """logits [R, V] fp32 -> processed logits (a new tensor); rows whose context is None, or
    whose request has no processors, are unchanged."""
    logits = logits.clone()
    vocab, dev = logits.shape[-1], logits.device
    bias = [(r, t, v) for r, c in enumerate(ctxs) if c is not None and c.params.logit_bias
            for t, v in c.params.logit_bias.items() if t < vocab]
    if bias:
        r, t = _index([(r, t) for r, t, _ in bias], dev)
        logits.index_put_((r, t), torch.tensor([v for *_, v in bias], device=dev),
                          accumulate=True)
    ban = [(r, t) for r, c in enumerate(ctxs) if c is not None for t in _banned(c, vocab)]
    if ban:
        logits.index_put_(_index(ban, dev), torch.tensor(float("-inf"), device=dev))
    pen = [r for r, c in enumerate(ctxs) if c is not None and (
        c.params.repetition_penalty != 1.0 or c.params.frequency_penalty != 0.0
        or c.params.presence_penalty != 0.0)]
    if pen:
        _penalize(logits, pen, [ctxs[r] for r in pen])
    return logits
