"""Training text for the drafter: text / JSONL files -> token sequences packed to max_len.

JSONL rows hold text (`text`, `prompt`+`response`/`completion`, `messages`) or token ids
(`input_ids`, as written by `blockspec generate-data`: the target's own tokens, never re-tokenised).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from blockspec.config import ConfigError


def _row_text(row: Any, tokenizer: Any, where: str) -> str | list[int]:
    """One JSONL row as the text the target would see (chat template for conversations), or
    its token ids as given."""
    if isinstance(row, str):
        return row
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object or string per line")
    if "input_ids" in row:
        ids = row["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ConfigError(f"{where}: 'input_ids' must be a list of token ids")
        return ids
    if "messages" in row:
        return _chat(tokenizer, row["messages"], where)
    if "prompt" in row:
        reply = row.get("response", row.get("completion"))
        if reply is None:
            raise ConfigError(f"{where}: 'prompt' without 'response' or 'completion'")
        if getattr(tokenizer, "chat_template", None):
            return _chat(tokenizer, [{"role": "user", "content": row["prompt"]},
                                     {"role": "assistant", "content": reply}], where)
        return str(row["prompt"]) + str(reply)
    if "text" in row:
        return str(row["text"])
    raise ConfigError(f"{where}: no 'text', 'input_ids', 'prompt'+'response'/'completion' or "
                      "'messages' key")


def _chat(tokenizer: Any, messages: list[dict], where: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{where}: 'messages' rows need a tokenizer with a chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False)


def iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    """(location "file:line", row) for each non-empty line; a bad line is a ConfigError."""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{n}", json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: invalid JSON ({e.msg})") from None


def read_texts(paths: list[str], tokenizer: Any) -> Iterator[str | list[int]]:
    """Documents from .jsonl files (one row each: text, or token ids) or plain text files (the
    whole file)."""
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"data file {path!r} does not exist")
        if p.suffix == ".jsonl":
            for where, row in iter_jsonl(p):
                yield _row_text(row, tokenizer, where)
        else:
            yield p.read_text()


def pack(docs: list[list[int]], max_len: int, sep: int | None, min_len: int) -> list[list[int]]:
    """Concatenate documents (separated by `sep`) and cut the stream into max_len chunks.

    NOTE: a chunk may span documents; the target sees the same stream, so its features and the
    labels stay consistent. Tails shorter than min_len cannot hold a block and are dropped."""
    stream: list[int] = []
    for doc in docs:
        stream.extend(doc)
        if sep is not None:
            stream.append(sep)
    chunks = [stream[i:i + max_len] for i in range(0, len(stream), max_len)]
    return [c for c in chunks if len(c) >= min_len]


def load_sequences(paths: list[str], tokenizer: Any, max_len: int, block_size: int,
                   eval_fraction: float, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """(train, held-out) token sequences. Documents are split before packing, so no held-out
    text leaks into training chunks."""
    docs = [t if isinstance(t, list) else tokenizer(t, add_special_tokens=False)["input_ids"]
            for t in read_texts(paths, tokenizer) if (t if isinstance(t, list) else t.strip())]
    if not docs:
        raise ConfigError("training data is empty")
    random.Random(seed).shuffle(docs)
    n_eval = round(len(docs) * eval_fraction) if eval_fraction > 0 else 0
    if eval_fraction > 0 and len(docs) > 1:
        n_eval = min(max(1, n_eval), len(docs) - 1)
    sep = tokenizer.eos_token_id
    min_len = block_size + 2
    train = pack(docs[n_eval:], max_len, sep, min_len)
    held = pack(docs[:n_eval], max_len, sep, min_len)
    if not train:
        raise ConfigError(f"no training sequence of at least {min_len} tokens "
                          f"(block size {block_size})")
    if eval_fraction > 0 and not held and len(train) > 1:
        held = train[-1:]  # one long document: hold out its last chunk instead
        train = train[:-1]
    return train, held
