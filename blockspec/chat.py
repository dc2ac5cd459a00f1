"""Chat messages -> prompt token ids through the tokenizer's chat template."""

from __future__ import annotations

from typing import Any

from blockspec.config import ConfigError


def render_chat(tokenizer: Any, messages: list[dict[str, Any]],
                add_generation_prompt: bool = True) -> list[int]:
    """The template's text already holds any BOS, so it is encoded without adding special
    tokens (a second BOS would change the model's output). ConfigError when the tokenizer has
    no template or the template refuses the messages (role order, ...)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("this model's tokenizer has no chat template")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja raises many types
        raise ConfigError(f"the chat template rejected these messages: {e}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))
