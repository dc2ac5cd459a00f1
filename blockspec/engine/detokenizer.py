"""Incremental detokenization that never emits half a UTF-8 character.

Decoding a window `[prefix_offset, ...)` rather than the newest token alone keeps tokenizers that
merge spaces or bytes across tokens (byte-level BPE, SentencePiece) correct; text is emitted only
once it no longer ends in a replacement character. Also: loading the tokenizer, and the EOS ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from blockspec import hf_tokenizer
from blockspec.config import ModelConfig


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int], final: bool = False) -> str:
        """Append token ids; return the text they complete (possibly empty)."""
        self.token_ids.extend(new_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) > len(prefix_text) and (final or not full.endswith("\ufffd")):
            delta = full[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            self.text += delta
            return delta
        return ""


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    return hf_tokenizer.load_tokenizer(path, trust_remote_code)


def eos_token_ids(model_config: ModelConfig, model_path: str, tokenizer: Any) -> tuple[int, ...]:
    """config.json's EOS ids, plus generation_config.json's; the tokenizer's if neither has any."""
    ids = set(model_config.eos_token_ids)
    gen_cfg = Path(model_path) / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
