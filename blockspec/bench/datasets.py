"""Benchmark prompts: JSONL files (plain prompts or chats) or random prompts of a set length.

A JSONL line is an object with one of:
  "prompt" / "text": a string (or, for "prompt", a list of token ids);
  "messages": OpenAI chat messages [{"role", "content"}, ...];
  "conversations": ShareGPT turns [{"from": "human"|"gpt"|"system", "value"}, ...] (the turns up
  to the first user turn are kept, like vLLM's ShareGPT loader).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockspec.config import ConfigError

KEYS = ("prompt", "text", "messages", "conversations")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
          "bot": "assistant", "model": "assistant", "chatgpt": "assistant", "system": "system"}
# Short, common words: about one token each in large BPE vocabularies, so a random prompt of
# N words is roughly N tokens on any server without needing its tokenizer.
_WORDS = (
    "the of and to in is was for on that with as by at from his her it an are were which be "
    "this have has had not but or one all their they there been more when who will would new "
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city name team minute idea kid body information"
).split()


@dataclass
class Sample:
    prompt: str | list[int]  # text or token ids ("" for chats, see messages)
    messages: list[dict[str, str]] | None = None  # chat datasets: the conversation to send


def _content(value: Any) -> str:
    """A message content: a string, or OpenAI content parts whose text parts are joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(p.get("text", "") for p in value if isinstance(p, dict))
    raise ValueError("message content must be a string or a list of content parts")


def _messages(turns: Any, role_key: str, content_key: str) -> list[dict[str, str]]:
    if not isinstance(turns, list) or not turns:
        raise ValueError("must be a non-empty list of turns")
    out: list[dict[str, str]] = []
    for t in turns:
        if not isinstance(t, dict) or role_key not in t or content_key not in t:
            raise ValueError(f"every turn needs {role_key!r} and {content_key!r}")
        role = _ROLES.get(str(t[role_key]).lower(), str(t[role_key]))
        out.append({"role": role, "content": _content(t[content_key])})
        if role == "user" and role_key == "from":
            break  # ShareGPT: benchmark the first user turn, not the recorded replies
    if not any(m["role"] == "user" for m in out):
        raise ValueError("has no user turn")
    return out


def parse_line(obj: Any) -> Sample:
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    for key in ("prompt", "text"):
        value = obj.get(key)
        if isinstance(value, str) and value:
            return Sample(value)
        if key == "prompt" and isinstance(value, list) and value \
                and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return Sample(list(value))
    if "messages" in obj:
        return Sample("", _messages(obj["messages"], "role", "content"))
    if "conversations" in obj:
        turns = obj["conversations"]
        keys = ("from", "value") if turns and isinstance(turns[0], dict) and "from" in turns[0] \
            else ("role", "content")
        return Sample("", _messages(turns, *keys))
    raise ValueError(f"no non-empty prompt: expected one of the keys {', '.join(KEYS)}")


def load_jsonl(path: str | Path) -> list[Sample]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"dataset {str(path)!r} is not a file (give a .jsonl file or 'random')")
    samples: list[Sample] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                samples.append(parse_line(json.loads(line)))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{p}:{lineno}: invalid JSON ({e.msg})") from None
            except ValueError as e:
                raise ConfigError(f"{p}:{lineno}: {e}") from None
    if not samples:
        raise ConfigError(f"{p}: no prompts in the file")
    return samples


def random_samples(n: int, input_len: int, seed: int = 0, vocab_size: int | None = None,
                   exclude_ids: set[int] | None = None) -> list[Sample]:
    """n distinct random prompts: token ids when `vocab_size` is given (exact lengths, offline),
    else random common words (about input_len tokens; any server can take text)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if vocab_size is None:
            out.append(Sample(" ".join(rng.choice(_WORDS) for _ in range(input_len))))
            continue
        ids = []
        while len(ids) < input_len:
            t = rng.randrange(vocab_size)
            if not exclude_ids or t not in exclude_ids:
                ids.append(t)
        out.append(Sample(ids))
    return out


def load_samples(source: str, n: int, input_len: int | None, seed: int = 0,
                 vocab_size: int | None = None, exclude_ids: set[int] | None = None
                 ) -> list[Sample]:
    """`n` samples from a JSONL file (cycled when it has fewer lines) or from `random`."""
    if n <= 0:
        raise ConfigError("need at least one prompt")
    if source == "random":
        return random_samples(n, input_len or 512, seed, vocab_size, exclude_ids)
    samples = load_jsonl(source)
    return [samples[i % len(samples)] for i in range(n)]


def completion_prompt(sample: Sample, tokenizer: Any = None) -> str | list[int]:
    """The prompt for a completions request: a chat goes through the tokenizer's chat template
    when one is available, else its contents are joined with newlines."""
    if sample.messages is None:
        return sample.prompt
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(sample.messages, tokenize=False,
                                             add_generation_prompt=True)
    return "\n".join(m["content"] for m in sample.messages)


def chat_messages(sample: Sample) -> list[dict[str, str]]:
    if sample.messages is not None:
        return sample.messages
    if not isinstance(sample.prompt, str):
        raise ConfigError("token-id prompts cannot be sent to the chat endpoint; use "
                          "--endpoint completions")
    return [{"role": "user", "content": sample.prompt}]


def token_ids(sample: Sample, tokenizer: Any, chat: bool = False,
              input_len: int | None = None) -> list[int]:
    """Token ids for the offline engine. `chat` wraps plain text prompts as one user message;
    `input_len` truncates (file datasets only: random ones already have that length)."""
    if isinstance(sample.prompt, list) and sample.messages is None:
        ids = sample.prompt
    else:
        if chat and sample.messages is None:
            sample = Sample("", chat_messages(sample))
        text = completion_prompt(sample, tokenizer)
        # NOTE: a chat template already writes the special tokens (BOS included).
        ids = tokenizer.encode(text, add_special_tokens=sample.messages is None
                               or not getattr(tokenizer, "chat_template", None))
    if not ids:
        raise ConfigError("a dataset prompt tokenizes to nothing")
    return list(ids[:input_len]) if input_len else list(ids)
