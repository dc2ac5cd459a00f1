"""A model folder's tokenizer through transformers' AutoTokenizer, with the chat template the
folder ships (tokenizer_config.json or chat_template.jinja).

A tokenizer that ships its own code (Kimi's tiktoken tokenizer: tokenizer_config.json's
auto_map sends AutoTokenizer to tokenization_kimi.TikTokenTokenizer) runs only with
`trust_remote_code`, off by default, as in transformers and vLLM; without it the error names
the flag.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from blockspec.errors import ConfigError


def remote_tokenizer_class(path: str) -> str | None:
    """The class a folder's tokenizer_config.json maps AutoTokenizer to in its own code, or
    None when it names none."""
    cfg = Path(path) / "tokenizer_config.json"
    try:
        auto = json.loads(cfg.read_text()).get("auto_map") or {}
    except (OSError, json.JSONDecodeError):
        return None
    ref = auto.get("AutoTokenizer") if isinstance(auto, dict) else None
    if isinstance(ref, list):
        ref = next((r for r in ref if r), None)
    return ref if isinstance(ref, str) else None


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    code = remote_tokenizer_class(path)
    if code is not None and not trust_remote_code:
        # NOTE: transformers 5 would fall back to a generic tokenizer built from the folder's
        # vocab files, which is not the one the model ships: refuse instead.
        raise ConfigError(f"the tokenizer in {path!r} ships its own code ({code}); pass "
                          "--trust-remote-code (LLM(..., trust_remote_code=True)) to run it")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many types for a broken folder
        raise ConfigError(f"could not load a tokenizer from {path!r}: {e}") from None
