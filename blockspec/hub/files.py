"""Which files of a Hub repo an engine reads, and what the Hub says each one is."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

INDEX = "model.safetensors.index.json"
# NOTE: root-level files only: the loader reads the folder itself, never a subfolder (published
# repos keep other formats, e.g. `original/` or quantized variants, in subfolders).
_CONFIG = ("config.json", "generation_config.json")
_TOKENIZER = ("tokenizer*", "vocab*", "merges.txt", "special_tokens_map.json",
              "added_tokens.json", "chat_template*", "*.tiktoken", "tiktoken.model",
              "spiece.model")


@dataclass(frozen=True)
class RemoteFile:
    """One file of a repo at a commit, as the Hub describes it."""

    path: str
    size: int | None
    sha256: str | None = None  # LFS files: the content's sha256
    blob_id: str | None = None  # the git blob id: sha1 of the content, for files not in LFS

    @classmethod
    def from_hub(cls, entry: Any) -> RemoteFile:
        """From a `RepoSibling` (model_info with files_metadata) or a `RepoFile` (a tree)."""
        path = getattr(entry, "rfilename", None) or entry.path
        lfs = getattr(entry, "lfs", None)
        return cls(path=path, size=entry.size, sha256=lfs.sha256 if lfs else None,
                   blob_id=None if lfs else entry.blob_id)


def engine_files(files: Iterable[RemoteFile], *, trust_remote_code: bool, weights: bool,
                 shards: set[str] | None = None) -> list[RemoteFile]:
    """The files an engine needs: config, generation config, tokenizer and chat template, the
    safetensors weights (only the index's shards when `shards` is given, none without
    `weights`), and remote-code *.py files only when they are trusted."""
    return [f for f in files
            if _wanted(f.path, trust_remote_code=trust_remote_code, weights=weights,
                       shards=shards)]


def _wanted(name: str, *, trust_remote_code: bool, weights: bool,
            shards: set[str] | None) -> bool:
    if "/" in name:
        return False
    if name.endswith(".py"):
        return trust_remote_code
    if name.endswith(".safetensors"):
        return weights and (shards is None or name in shards)
    if name == INDEX:
        return weights
    return name in _CONFIG or any(fnmatch.fnmatchcase(name, p) for p in _TOKENIZER)


def format_bytes(n: float) -> str:
    """1234567 -> '1.2 MB' (decimal units, as the Hub shows sizes)."""
    if n < 1000:
        return f"{n:.0f} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1000
        if n < 1000:
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} TB"
