"""Incremental detokenization that never emits half a UTF-8 character.

Decoding a window `[prefix_offset, ...)` rather than the newest token alone keeps tokenizers that
merge spaces or bytes across tokens (byte-level BPE, SentencePiece) correct; text is emitted only
once it no longer ends in a replacement character.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

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
