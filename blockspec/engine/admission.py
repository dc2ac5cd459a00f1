"""What a request must satisfy to be queued: a prompt of token ids in the vocabulary, a
max_tokens that the context and the KV cache hold, stop / bias token ids in range. Every check
raises ConfigError with a message for the user (the server answers it as a 400)."""

from __future__ import annotations

import operator
from typing import Any

from blockspec.config import ConfigError
from blockspec.sampling_params import SamplingParams


def tokenize(tokenizer: Any, prompt: str | list[int], vocab: int) -> list[int]:
    """A text prompt encoded, or a token-id prompt checked."""
    if isinstance(prompt, str):
        if not prompt:
            raise ConfigError("prompt is empty")
        return tokenizer.encode(prompt)
    try:
        ids = [operator.index(t) for t in prompt]
    except TypeError:
        raise ConfigError("a prompt must be a string or a list of token ids (integers in "
                          f"[0, {vocab}))") from None
    if not ids:
        raise ConfigError("prompt is empty")
    if any(isinstance(t, bool) or not 0 <= t < vocab for t in prompt):
        raise ConfigError(f"prompt token ids must be integers in [0, {vocab})")
    return ids


def resolve_max_tokens(num_prompt: int, params: SamplingParams, max_model_len: int,
                       cache_tokens: int) -> int:
    """The request's max_tokens resolved against the context (None: what the context and the
    KV cache can hold, `cache_tokens` less the lookahead); more than the context leaves is
    refused, as vLLM does."""
    if num_prompt >= max_model_len:
        raise ConfigError(f"prompt has {num_prompt} tokens; the context length is "
                          f"{max_model_len}, which leaves no room to generate")
    room = max_model_len - num_prompt
    if params.max_tokens is not None:
        if params.max_tokens > room:
            raise ConfigError(
                f"max_tokens must be at most {room} for this prompt: the context length is "
                f"{max_model_len} and the prompt has {num_prompt} tokens, got "
                f"{params.max_tokens}")
        return params.max_tokens
    if params.min_tokens > room:
        raise ConfigError(f"min_tokens must be at most {room} for this prompt (the context "
                          f"length is {max_model_len}), got {params.min_tokens}")
    room = min(room, cache_tokens - num_prompt)
    if room < 1:
        raise ConfigError(f"prompt has {num_prompt} tokens; the KV cache holds {cache_tokens}, "
                          "which leaves no room to generate")
    return room


def check_token_ids(params: SamplingParams, vocab: int) -> None:
    if any(t >= vocab for t in params.stop_token_ids):
        raise ConfigError(f"stop_token_ids must be token ids in [0, {vocab})")
    if params.logit_bias and any(t >= vocab for t in params.logit_bias):
        raise ConfigError(f"logit_bias must have token ids in [0, {vocab}) as keys")
