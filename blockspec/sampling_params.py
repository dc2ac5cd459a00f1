"""SamplingParams with vLLM's names and defaults."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from blockspec.config import ConfigError

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: chosen token's logprob plus the top k
    include_stop_str_in_output: bool = False
    stop_strs: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ConfigError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ConfigError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not -(2**63) <= self.seed < 2**64):
            raise ConfigError(f"seed must be an integer in [-2^63, 2^64), got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ConfigError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                              f"got {self.logprobs!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ConfigError("stop must be a non-empty string or a list of non-empty strings")
        self.stop_strs = stop
        ids = list(self.stop_token_ids or [])
        if any(not _is_int(t) or t < 0 for t in ids):
            raise ConfigError("stop_token_ids must be non-negative integers")
        self.stop_token_ids = ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)
