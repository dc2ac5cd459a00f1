"""Batched sampling with per-row parameters: greedy, temperature, top-k, top-p, min-p, seeds.

Processing order: temperature -> top-k -> top-p -> min-p -> sample. Sampling uses the exponential
race (argmax p_i / E_i with E_i ~ Exp(1)), which is an exact draw from p and lets each seeded row
use its own generator while the rest of the batch shares one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.sampling_params import SamplingParams


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [N] fp32, 0 = greedy
    top_k: torch.Tensor  # [N] int64, vocab size = off
    top_p: torch.Tensor  # [N] fp32
    min_p: torch.Tensor  # [N] fp32
    generators: list[torch.Generator | None]
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None],
              vocab_size: int, device: torch.device) -> SamplingTensors:
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32,
                                     device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            # NOTE: a top_p below fp32's smallest normal would round to 0 and mask everything.
            top_p=torch.tensor([max(p.top_p, 1.2e-38) for p in params], dtype=torch.float32,
                               device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            generators=generators,
            all_greedy=all(p.greedy for p in params),
            needs_top_k=any(k < vocab_size for k in top_k),
            needs_top_p=any(p.top_p < 1.0 for p in params),
            needs_min_p=any(p.min_p > 0.0 for p in params),
        )


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


def exponential_noise(shape: tuple[int, int], generators: list[torch.Generator | None],
                      default: torch.Generator | None, device: torch.device) -> torch.Tensor:
    noise = torch.empty(shape, dtype=torch.float32, device=device).exponential_(generator=default)
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    return noise


def sample(logits: torch.Tensor, st: SamplingTensors,
           default_generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [N, V] -> token ids [N] (int64)."""
    if st.all_greedy:
        return logits.argmax(dim=-1)
    probs = target_probs(logits, st)
    noise = exponential_noise(tuple(probs.shape), st.generators, default_generator, probs.device)
    return (probs / noise).argmax(dim=-1)


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                    num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw-model logprobs (before temperature/truncation, as vLLM reports them) of the chosen tokens
    and the top `num_top` alternatives."""
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    top_vals, top_ids = logp.topk(max(num_top, 1), dim=-1)
    return chosen, top_vals[:, :num_top], top_ids[:, :num_top]
