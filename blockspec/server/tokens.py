"""Token strings and the two OpenAI logprobs layouts (completions and chat)."""

from __future__ import annotations

import math
from typing import Any


def _finite(x: float) -> float:
    """JSON has no -inf; like vLLM, an impossible token is reported as -9999.0."""
    return x if math.isfinite(x) else -9999.0


class TokenText:
    """id -> the token's own text, cached (the vocabulary bounds the cache)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            # NOTE: decoding only reads the tokenizer, so it may run beside the engine thread.
            s = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = s
        return s


def completion_logprobs(text: TokenText, token_ids: list[int],
                        logprobs: list[dict[int, float]] | None, offset: int) -> dict[str, Any]:
    """/v1/completions layout. `top_logprobs` holds the chosen token plus the top k (as vLLM);
    `offset` is where these tokens start in the completion text."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}
    for tid, lp in zip(token_ids, logprobs or []):
        s = text(tid)
        out["tokens"].append(s)
        out["token_logprobs"].append(_finite(lp.get(tid, -math.inf)))
        top: dict[str, float] = {}
        for i, v in lp.items():  # NOTE: the chosen token comes first and wins a string clash
            top.setdefault(text(i), _finite(v))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def chat_logprobs(text: TokenText, token_ids: list[int],
                  logprobs: list[dict[int, float]] | None, top: int) -> dict[str, Any]:
    """/v1/chat/completions layout: per token its logprob and the `top` most likely tokens."""
    content = []
    for tid, lp in zip(token_ids, logprobs or []):
        best = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        content.append({**_entry(text, tid, lp.get(tid, -math.inf)),
                        "top_logprobs": [_entry(text, i, v) for i, v in best]})
    return {"content": content}


def _entry(text: TokenText, tid: int, logprob: float) -> dict[str, Any]:
    s = text(tid)
    return {"token": s, "logprob": _finite(logprob), "bytes": list(s.encode("utf-8"))}
