"""Request bodies of the OpenAI API (the subset blockspec serves) and their SamplingParams.

Models are strict (no "0.5" -> 0.5, no true -> 1): a wrong type is a 400, not a guess. Unknown
fields are ignored, as vLLM does, since clients send extras; known fields blockspec cannot honour
(n > 1, penalties, echo, tools, ...) are refused rather than silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from blockspec.config import ConfigError
from blockspec.sampling_params import SamplingParams
from blockspec.server.errors import APIError, from_config_error

MAX_LOGPROBS = 20  # like vLLM's default max_logprobs; the engine itself has no bound
_SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts
_MIN_TOP_P = 1e-30  # well inside fp32's normal range


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _SamplingRequest(_Strict):
    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM extensions
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    # OpenAI fields with no blockspec support beyond their neutral value
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def check_common(self) -> None:
        if self.n not in (None, 1):
            raise APIError("only n=1 is supported", param="n")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true",
                           param="stream_options")
        if self.seed is not None and not _SEED_RANGE[0] <= self.seed < _SEED_RANGE[1]:
            raise APIError("seed must fit in 64 bits", param="seed")
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                              ("repetition_penalty", 1.0)):
            v = getattr(self, name)
            if v is not None and v != neutral:  # NOTE: NaN != neutral, so NaN is refused too
                raise APIError(f"{name} is not supported (only {neutral} is accepted)",
                               param=name)
        if self.logit_bias:
            raise APIError("logit_bias is not supported", param="logit_bias")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        rename: dict[str, str]) -> SamplingParams:
        def pick(v: Any, default: Any) -> Any:
            return default if v is None else v

        top_p = self.top_p
        if top_p is not None and 0.0 < top_p < _MIN_TOP_P:
            top_p = _MIN_TOP_P  # NOTE: the sampler keeps top_p in fp32, where it would round to
            # 0 and mask every token (the output turns into token 0); this is the same choice.
        try:
            return SamplingParams(
                temperature=pick(self.temperature, 1.0), top_p=pick(top_p, 1.0),
                top_k=pick(self.top_k, -1), min_p=pick(self.min_p, 0.0), seed=self.seed,
                max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                ignore_eos=bool(self.ignore_eos), logprobs=logprobs,
                include_stop_str_in_output=bool(self.include_stop_str_in_output))
        except ConfigError as e:
            raise from_config_error(e, rename) from None


class CompletionRequest(_SamplingRequest):
    prompt: Any  # str | [str] | [int] | [[int]]: checked by hand for a clearer message
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if not p:
                raise APIError("prompt is empty", param="prompt")
            return p
        if isinstance(p, list) and all(type(t) is int for t in p):
            if not p:
                raise APIError("prompt is empty", param="prompt")
            return p
        if isinstance(p, list) and p and all(isinstance(x, str | list) for x in p):
            raise APIError("only one prompt per request is supported", param="prompt")
        raise APIError("prompt must be a string, a list with one string, or a list of token ids",
                       param="prompt")

    def to_sampling_params(self) -> SamplingParams:
        self.check_common()
        if self.echo:
            raise APIError("echo is not supported", param="echo")
        if self.best_of not in (None, 1):
            raise APIError("only best_of=1 is supported", param="best_of")
        if self.suffix is not None:
            raise APIError("suffix is not supported", param="suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(f"logprobs must be in [0, {MAX_LOGPROBS}]", param="logprobs")
        # NOTE: null max_tokens means OpenAI's default (16), not "up to the context".
        return self.sampling_params(16 if self.max_tokens is None else self.max_tokens,
                                    self.logprobs, {})


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        msg = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True  # vLLM extension

    def to_sampling_params(self) -> SamplingParams:
        self.check_common()
        if not self.messages:
            raise APIError("messages must not be empty", param="messages")
        if self.tools:
            raise APIError("tools are not supported", param="tools")
        if self.response_format and self.response_format.get("type") != "text":
            raise APIError("only response_format {'type': 'text'} is supported",
                           param="response_format")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError("top_logprobs requires logprobs=true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}]",
                               param="top_logprobs")
        k = (self.top_logprobs or 0) if self.logprobs else None
        max_param = "max_completion_tokens" if self.max_completion_tokens is not None \
            else "max_tokens"
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        # NOTE: None: up to the context (capped at the KV capacity by the async engine).
        return self.sampling_params(max_tokens, k,
                                    {"max_tokens": max_param, "logprobs": "top_logprobs"})
