"""A Hub repo's engine files as a local snapshot folder: from the Hugging Face cache, or
downloaded into it (or into a local dir) after checking there is room for them.

The cache, HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE and the token (HF_TOKEN, `hf auth login`) are
huggingface_hub's; downloads show its progress bars, keep the files completed so far when
interrupted, and resume a dropped transfer with a Range request.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx2
from huggingface_hub import HfApi, constants, get_cached_repo_tree, hf_hub_download
from huggingface_hub import snapshot_download as hub_snapshot_download
from huggingface_hub.errors import (
    CachedRepoTreeNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    RevisionResolutionError,
)
from huggingface_hub.file_download import repo_folder_name

from blockspec.errors import ConfigError
from blockspec.hub.files import INDEX, RemoteFile, engine_files, format_bytes

# NOTE: what a missing Hub means: no answer at all, offline mode, or a Hub that is down (5xx).
_UNREACHABLE = (httpx2.TransportError, OfflineModeIsEnabled, RevisionResolutionError)


@dataclass(frozen=True)
class Snapshot:
    repo_id: str
    path: str  # the folder to load: a cache snapshot or the local dir
    commit: str | None
    # The engine files as the Hub describes them (sizes; sha256 / git blob ids when `hashed`);
    # None when offline without a cached listing of the repo.
    files: list[RemoteFile] | None
    hashed: bool


def hub_endpoint() -> str:
    # NOTE: read at each call (huggingface_hub reads its constants once, at import).
    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def fetch(repo_id: str, *, revision: str | None = None, trust_remote_code: bool = False,
          weights: bool = True, local_dir: str | None = None, what: str = "model") -> Snapshot:
    """The engine files of `repo_id` at `revision` (default: the main branch), downloading the
    missing ones. Raises ConfigError (one line) for an unknown or gated repo or revision, a
    repo an engine cannot load, too little disk space, or an offline miss."""
    if constants.HF_HUB_OFFLINE:
        return _from_cache(repo_id, revision, trust_remote_code, weights, local_dir, what,
                           "HF_HUB_OFFLINE is set")
    endpoint = hub_endpoint()
    api = HfApi(endpoint=endpoint)
    try:
        rev = api.resolve_revision(repo_id, revision=revision)
        info = api.model_info(repo_id, revision=rev.resolved, files_metadata=True)
    except _UNREACHABLE as e:
        return _from_cache(repo_id, revision, trust_remote_code, weights, local_dir, what,
                           f"the Hub at {endpoint} cannot be reached ({type(e).__name__})")
    except HfHubHTTPError as e:
        if e.response.status_code >= 500:
            return _from_cache(repo_id, revision, trust_remote_code, weights, local_dir, what,
                               f"the Hub at {endpoint} answers {e.response.status_code}")
        raise ConfigError(_refusal(e, repo_id, revision, what, endpoint)) from None
    listing = [RemoteFile.from_hub(s) for s in info.siblings or []]
    try:
        shards = _index_shards(repo_id, rev, listing, local_dir, endpoint) if weights else None
        files = engine_files(listing, trust_remote_code=trust_remote_code, weights=weights,
                             shards=shards)
        _check_loadable(files, repo_id, weights, what)
        target = Path(local_dir) if local_dir else Path(constants.HF_HUB_CACHE)
        need = bytes_to_fetch(files, repo_id, rev.resolved, local_dir)
        free = check_free_space(need, target, f"{what} {repo_id!r}")
        if need:
            print(f"[blockspec] downloading {what} {repo_id} ({rev.resolved[:7]}): "
                  f"{format_bytes(need)} into {target} ({format_bytes(free)} free)",
                  file=sys.stderr)
        path = hub_snapshot_download(repo_id, revision=rev, local_dir=local_dir,
                                     allow_patterns=[glob.escape(f.path) for f in files],
                                     endpoint=endpoint)
    except (httpx2.TransportError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"downloading {what} {repo_id!r} failed ({first}); the files completed "
                          "so far are kept: run the same command again to resume") from None
    return Snapshot(repo_id, path, rev.resolved, files, hashed=True)


def _refusal(e: HfHubHTTPError, repo_id: str, revision: str | None, what: str,
             endpoint: str) -> str:
    if isinstance(e, GatedRepoError):
        return (f"{what} {repo_id!r} is gated: accept its terms at {endpoint}/{repo_id} and set "
                "HF_TOKEN (or run `hf auth login`)")
    if isinstance(e, RepositoryNotFoundError):
        return (f"{what} {repo_id!r} is not a local folder, and the Hugging Face Hub has no model "
                f"{repo_id!r} (a private one needs HF_TOKEN)")
    if isinstance(e, RevisionNotFoundError):
        return f"{what} {repo_id!r} has no revision {revision!r} on the Hugging Face Hub"
    return f"the Hugging Face Hub refuses {what} {repo_id!r}: HTTP {e.response.status_code}"


def _index_shards(repo_id: str, revision: str, listing: list[RemoteFile],
                  local_dir: str | None, endpoint: str) -> set[str] | None:
    """The shards a sharded checkpoint's index names (repos may also hold other safetensors,
    e.g. a consolidated copy of the same weights); None without an index."""
    if not any(f.path == INDEX for f in listing):
        return None
    path = hf_hub_download(repo_id, INDEX, revision=revision, local_dir=local_dir,
                           endpoint=endpoint)
    return shards_in_index(Path(path))


def shards_in_index(path: Path) -> set[str]:
    try:
        return set(json.loads(path.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError(f"{str(path)!r} is not a safetensors index (no weight_map)") from None


def _check_loadable(files: list[RemoteFile], repo_id: str, weights: bool, what: str) -> None:
    names = {f.path for f in files}
    if "config.json" not in names:
        raise ConfigError(f"{what} {repo_id!r} on the Hub has no config.json: not a model an "
                          "engine can load")
    if weights and not any(n.endswith(".safetensors") for n in names):
        raise ConfigError(f"{what} {repo_id!r} on the Hub has no *.safetensors weights (blockspec "
                          "reads safetensors only)")


def bytes_to_fetch(files: list[RemoteFile], repo_id: str, commit: str,
                   local_dir: str | None) -> int:
    """Bytes of `files` not yet on disk: in the cache a file is there when its snapshot link
    or its blob exists (blobs are named by sha256 for LFS files, by git blob id otherwise); in
    a local dir when a file of that size exists."""
    if local_dir is not None:
        def present(f: RemoteFile) -> bool:
            p = Path(local_dir) / f.path
            return p.is_file() and (f.size is None or p.stat().st_size == f.size)
    else:
        storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id,
                                                                   repo_type="model")

        def present(f: RemoteFile) -> bool:
            blob = f.sha256 or f.blob_id
            return ((storage / "snapshots" / commit / f.path).exists()
                    or (blob is not None and (storage / "blobs" / blob).exists()))
    return sum(f.size or 0 for f in files if not present(f))


def check_free_space(need: int, target: Path, label: str) -> int:
    """Free bytes on the disk that will hold `target`; ConfigError when fewer than `need`."""
    probe = target.resolve()
    while not probe.exists():  # NOTE: the cache or local dir may not exist yet
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need > free:
        raise ConfigError(f"not enough disk space for {label}: {format_bytes(need)} to download "
                          f"into {target}, {format_bytes(free)} free there (point HF_HOME, or "
                          "`blockspec download --local-dir`, at a larger disk)")
    return free


def _from_cache(repo_id: str, revision: str | None, trust_remote_code: bool, weights: bool,
                local_dir: str | None, what: str, reason: str) -> Snapshot:
    """The snapshot already on disk when the Hub is not asked or does not answer; complete
    when huggingface_hub cached the repo's listing (it does when it downloads)."""
    fix = f"fetch it with `blockspec download {repo_id}` where the Hub is reachable"
    where = local_dir or f"the Hugging Face cache ({constants.HF_HUB_CACHE})"
    try:
        # NOTE: config.json alone: the completeness of the rest is checked below, against the
        # engine's files (huggingface_hub would ask for every file of the repo).
        path = hub_snapshot_download(repo_id, revision=revision, local_dir=local_dir,
                                     local_files_only=True, allow_patterns=["config.json"])
    except LocalEntryNotFoundError:
        raise ConfigError(f"{what} {repo_id!r} is not a local folder nor in {where}, and "
                          f"{reason}: {fix}") from None
    try:
        # NOTE: the cached listing keeps sizes only: hashes are checked online.
        listing = [RemoteFile(f.path, f.size)
                   for f in get_cached_repo_tree(repo_id, revision=revision, local_dir=local_dir)]
    except CachedRepoTreeNotFoundError:
        return Snapshot(repo_id, path, None, None, hashed=False)
    index = Path(path) / INDEX
    shards = shards_in_index(index) if weights and index.is_file() else None
    files = engine_files(listing, trust_remote_code=trust_remote_code, weights=weights,
                         shards=shards)
    missing = [f.path for f in files if not (Path(path) / f.path).is_file()]
    if missing:
        raise ConfigError(f"the copy of {what} {repo_id!r} in {where} lacks {len(missing)} "
                          f"file(s) ({', '.join(missing[:3])}), and {reason}: {fix}")
    commit = None if local_dir else Path(path).name
    return Snapshot(repo_id, path, commit, files, hashed=False)
