"""What the engine hands back per request (vLLM-shaped)."""

from __future__ import annotations

from dataclasses import dataclass, field

from blockspec.engine.sequence import RequestMetrics


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[dict[int, float]] | None = None
    metrics: RequestMetrics | None = None
    # Streaming: what this step added.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    # n > 1 (offline generate): every sample's output; this one's own fields are the first's.
    samples: list[RequestOutput] | None = None

    @property
    def outputs(self) -> list[RequestOutput]:
        """vLLM-style access (`out.outputs[i].text`): the n samples of the prompt."""
        return self.samples if self.samples is not None else [self]
