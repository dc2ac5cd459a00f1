"""Request bodies of the OpenAI API (the subset blockspec serves) and their SamplingParams.

Models are strict (no "0.5" -> 0.5, no true -> 1): a wrong type is a 400, not a guess. Unknown
fields are refused with a 400 naming them (a dropped field silently changes what the client
asked for); known fields blockspec cannot honour (echo, tools, beam search, ...) are refused
unless they carry their neutral value.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from blockspec.config import ConfigError
from blockspec.sampling_params import MAX_LOGPROBS, SamplingParams
from blockspec.server.errors import APIError, from_config_error

_MIN_TOP_P = 1e-30  # well inside fp32's normal range


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk


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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    min_tokens: int | None = 0
    repetition_penalty: float | None = None
    skip_special_tokens: bool | None = True
    use_beam_search: bool | None = False  # refused when true
    prompt_logprobs: int | None = None  # refused unless null

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true",
                           param="stream_options")
        if self.use_beam_search:
            raise APIError("beam search is not supported", param="use_beam_search")
        if self.prompt_logprobs is not None:
            raise APIError("prompt_logprobs is not supported", param="prompt_logprobs")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise APIError("logit_bias must have token ids (integers as strings) as keys",
                           param="logit_bias") from None

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
                n=pick(self.n, 1), temperature=pick(self.temperature, 1.0), top_p=pick(top_p, 1.0),
                top_k=pick(self.top_k, -1), min_p=pick(self.min_p, 0.0), seed=self.seed,
                max_tokens=max_tokens, min_tokens=pick(self.min_tokens, 0),
                presence_penalty=pick(self.presence_penalty, 0.0),
                frequency_penalty=pick(self.frequency_penalty, 0.0),
                repetition_penalty=pick(self.repetition_penalty, 1.0),
                logit_bias=self._logit_bias(), stop=self.stop,
                stop_token_ids=self.stop_token_ids, ignore_eos=bool(self.ignore_eos),
                logprobs=logprobs, include_stop_str_in_output=bool(self.include_stop_str_in_output),
                skip_special_tokens=pick(self.skip_special_tokens, True))
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
    tools: list[Any] | None = None  # refused unless empty
    tool_choice: str | dict[str, Any] | None = None  # refused unless "none"
    parallel_tool_calls: bool | None = None  # meaningless without tools: accepted
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True  # vLLM extension

    def to_sampling_params(self) -> SamplingParams:
        self.check_common()
        if not self.messages:
            raise APIError("messages must not be empty", param="messages")
        if self.tools:
            raise APIError("tools are not supported", param="tools")
        if self.tool_choice not in (None, "none"):
            raise APIError("tool_choice is not supported (only 'none' is accepted)",
                           param="tool_choice")
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
