"""A model name as users type it (a local folder or a Hub id) -> the folder to load."""

from __future__ import annotations

import os
import re
from pathlib import Path

from blockspec.errors import ConfigError

# org/name as the Hub spells repo ids: letters, digits, `_`, `-`, `.`; no part starts or ends
# with `-` or `.`; no `--` or `..` (huggingface_hub's own rules).
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9])?"
_HUB_ID = re.compile(rf"{_PART}/{_PART}")


def is_hub_id(name: str) -> bool:
    """Whether `name` has the shape of a Hub model id, `org/name`."""
    return bool(_HUB_ID.fullmatch(name)) and "--" not in name and ".." not in name \
        and not name.endswith(".git")


def resolve_model_path(name: str | os.PathLike, *, what: str = "model", revision: str | None = None,
                       trust_remote_code: bool = False, weights: bool = True) -> str:
    """The local folder for `name`. NOTE: a path that exists always wins over a Hub id; any
    other `org/name` is fetched from the Hub (the cache first, see blockspec/hub/fetch.py);
    anything else is a one-line ConfigError."""
    name = os.fspath(name)
    if Path(name).exists():
        if revision is not None:
            raise ConfigError(f"{what} revision {revision!r} selects a Hub commit, but {what} "
                              f"{name!r} is a local folder")
        return name
    if not is_hub_id(name):
        raise ConfigError(f"{what} {name!r} is not a directory, nor a Hugging Face Hub id "
                          "(org/name)")
    from blockspec.hub.fetch import fetch  # NOTE: imports huggingface_hub only when needed

    return fetch(name, revision=revision, trust_remote_code=trust_remote_code, weights=weights,
                 what=what).path


def served_name(model: str) -> str:
    """What clients call the model: a folder's name, or the Hub id itself (as vLLM does)."""
    if Path(model).exists() or not is_hub_id(model):
        return Path(model.rstrip("/")).name or model
    return model
