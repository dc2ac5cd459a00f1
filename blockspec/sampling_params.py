"""SamplingParams with vLLM's names, defaults and semantics."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace

from blockspec.config import ConfigError

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
MAX_N = 128  # samples per prompt (each one a request of its own)
GREEDY_EPSILON = 1e-5  # temperatures below this are greedy, as in vLLM (logits / T overflows)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty
_SEED_RANGE = (-(2**63), 2**64)


@dataclass
class SamplingParams:
    """Per-request sampling. Logits are processed in this order: logit_bias, the min_tokens ban
    of stop tokens, repetition_penalty (prompt and output tokens), frequency and presence
    penalties (output tokens), then temperature -> top-k -> top-p -> min-p."""

    n: int = 1  # independent samples of the prompt (LLM.generate and the server fan them out)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off; values above the vocabulary size are off too
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0  # EOS and stop token ids are banned, and stops unchecked, before this
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: chosen token's logprob plus the top k
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stop_strs: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        self._check_sampling()
        self._check_lengths()
        self._check_processors()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ConfigError("stop must be a non-empty string or a list of non-empty strings")
        self.stop_strs = stop
        ids = list(self.stop_token_ids or [])
        if any(not _is_int(t) or not 0 <= t < 2**63 for t in ids):
            raise ConfigError("stop_token_ids must be non-negative integers")
        self.stop_token_ids = ids

    def _check_sampling(self) -> None:
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < GREEDY_EPSILON:
            self.temperature = 0.0  # NOTE: logits / 1e-38 is inf - inf = NaN in fp32
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ConfigError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not _SEED_RANGE[0] <= self.seed < _SEED_RANGE[1]):
            raise ConfigError(f"seed must be an integer in [-2^63, 2^64), got {self.seed!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ConfigError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")

    def _check_lengths(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ConfigError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ConfigError(f"min_tokens must be a non-negative integer, got "
                              f"{self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ConfigError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got "
                              f"{self.min_tokens}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ConfigError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                              f"got {self.logprobs!r}")

    def _check_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ConfigError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {v!r}")
        r = self.repetition_penalty
        if not _is_real(r) or not 0.0 < r < math.inf:
            raise ConfigError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        bias = dict(self.logit_bias or {})
        for tok, v in bias.items():
            if not _is_int(tok) or not 0 <= tok < 2**63:
                raise ConfigError(f"logit_bias must have token ids (non-negative integers) as "
                                  f"keys, got {tok!r}")
            if not _is_real(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                raise ConfigError(f"logit_bias must have values in [-{MAX_LOGIT_BIAS:g}, "
                                  f"{MAX_LOGIT_BIAS:g}], got {v!r} for token {tok}")
        self.logit_bias = {int(t): float(v) for t, v in bias.items()} or None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_processors(self) -> bool:
        """Whether its logits need processing before sampling (see the class docstring)."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.presence_penalty != 0.0 \
            or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def samples(self) -> list[SamplingParams]:
        """The `n` requests this one fans out to, each n=1; seeded ones get seed, seed + 1, ...
        (as vLLM's children do), so each sample is reproducible on its own."""
        if self.n == 1:
            return [self]
        return [replace(self, n=1, seed=None if self.seed is None
                        else (self.seed + i) % _SEED_RANGE[1]) for i in range(self.n)]


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)
