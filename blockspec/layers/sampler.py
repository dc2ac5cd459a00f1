"""Batched sampling with per-row parameters: greedy, temperature, top-k, top-p, min-p.

Processing order: temperature -> top-k -> top-p -> min-p -> sample. A sampled row draws by
inverse CDF (the first token whose cumulative probability, in vocabulary order, reaches u) from
one uniform u per row, and u is a function of the row's request seed and output position only
(`counter_rng`): a seeded request draws the same token at a position in any batch, at any block
length, speculative or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.layers.counter_rng import uniforms
from blockspec.sampling_params import SamplingParams

# NOTE: rows per chunk of the sampled path are chosen so that one chunk's [rows, vocab] float64
# CDF stays near 256 MiB whatever the batch (a 256 x 16 verify block of a 151k vocab would
# otherwise build ~5 GB of temporaries).
_CHUNK_ELEMENTS = 1 << 25
_MAX_TEMPERATURE = 1e30


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [N] fp32, 0 = greedy
    top_k: torch.Tensor  # [N] int64, vocab size = off
    top_p: torch.Tensor  # [N] fp32
    min_p: torch.Tensor  # [N] fp32
    uniforms: torch.Tensor  # [N] fp64 in (0, 1): each row's draw (unused by greedy rows)
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], positions: list[int],
              vocab_size: int, device: torch.device | str) -> SamplingTensors:
        """`seeds[i]`, `positions[i]`: row i's request seed and output position (the index of the
        token it samples among the request's output tokens)."""
        # NOTE: top_k above the vocabulary means "off"; clamping keeps any integer in int64.
        top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        all_greedy = all(p.greedy for p in params)
        u = uniforms(seeds, positions) if not all_greedy else [0.5] * len(params)
        return cls(
            # NOTE: capped where fp32 still holds it (a temperature past 3.4e38 would be inf,
            # and a banned token's -inf / inf is NaN); at 1e30 every row is uniform anyway.
            temperature=torch.tensor([min(p.temperature, _MAX_TEMPERATURE) for p in params],
                                     dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            # NOTE: a top_p below fp32's smallest normal would round to 0 and mask everything.
            top_p=torch.tensor([max(p.top_p, 1.2e-38) for p in params], dtype=torch.float32,
                               device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            uniforms=torch.as_tensor(u, dtype=torch.float64).to(device),
            all_greedy=all_greedy,
            needs_top_k=any(k < vocab_size for k in top_k),
            needs_top_p=any(p.top_p < 1.0 for p in params),
            needs_min_p=any(p.min_p > 0.0 for p in params),
        )

    def rows(self, start: int, stop: int) -> SamplingTensors:
        return SamplingTensors(
            self.temperature[start:stop], self.top_k[start:stop], self.top_p[start:stop],
            self.min_p[start:stop], self.uniforms[start:stop], self.all_greedy,
            self.needs_top_k, self.needs_top_p, self.needs_min_p)


def target_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The distribution each row samples from, after temperature and truncation. Greedy rows get
    a one-hot on their argmax, so callers (e.g. speculative verify) can treat all rows alike."""
    logits = logits.float()
    greedy = st.temperature == 0
    temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    logits = logits / temp[:, None]
    if st.needs_top_k or st.needs_top_p:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        if st.needs_top_k:
            ranks = torch.arange(vocab, device=logits.device)[None, :]
            sorted_logits = sorted_logits.masked_fill(ranks >= st.top_k[:, None], float("-inf"))
        if st.needs_top_p:
            probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            cum_before = probs.cumsum(dim=-1) - probs
            drop = cum_before >= st.top_p[:, None]
            drop[:, 0] = False  # NOTE: the most likely token always survives
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    probs = logits.softmax(dim=-1)
    if st.needs_min_p:
        cutoff = st.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < cutoff, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative probability reaches u x total: a draw from `probs`.
    NOTE: searchsorted (left) lands on a token of positive probability: the CDF steps there."""
    cdf = probs.double().cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits [N, V] -> token ids [N] (int64)."""
    if st.all_greedy:
        return logits.argmax(dim=-1)
    n, vocab = logits.shape
    chunk = max(1, _CHUNK_ELEMENTS // vocab)
    out = [_inverse_cdf(target_probs(logits[i:i + chunk], st.rows(i, i + chunk)),
                        st.uniforms[i:i + chunk]) for i in range(0, n, chunk)]
    return out[0] if len(out) == 1 else torch.cat(out)


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                    num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw-model logprobs (before temperature/truncation, as vLLM reports them) of the chosen tokens
    and the top `num_top` alternatives."""
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    top_vals, top_ids = logp.topk(max(num_top, 1), dim=-1)
    return chosen, top_vals[:, :num_top], top_ids[:, :num_top]
