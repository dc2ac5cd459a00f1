"""`blockspec download`'s check: every engine file against the size and hash the Hub gives."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from blockspec.hub.fetch import Snapshot
from blockspec.hub.files import RemoteFile

_CHUNK = 1 << 20


@dataclass
class Verification:
    num_files: int = 0
    num_bytes: int = 0
    num_sha256: int = 0  # LFS files checked by the sha256 of their content
    num_sha1: int = 0  # other files checked by their git blob id
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        hashes = (f"sha256 of {self.num_sha256} LFS file(s), git blob sha1 of {self.num_sha1}"
                  if self.num_sha256 + self.num_sha1 else "sizes only: no hashes offline")
        return f"{self.num_files} files, {self.num_bytes} bytes verified ({hashes})"


def verify_snapshot(snapshot: Snapshot) -> Verification:
    """Sizes of every file, and their hashes when the snapshot carries the Hub's (online)."""
    result = Verification()
    files = snapshot.files or []
    to_hash = sum(f.size or 0 for f in files) if snapshot.hashed else 0
    with tqdm(total=to_hash, unit="B", unit_scale=True, desc="verify",
              disable=to_hash < 1 << 26) as bar:
        for f in files:
            problem = _check(Path(snapshot.path) / f.path, f, snapshot.hashed, bar)
            if problem:
                # NOTE: the resolved path: in the cache, the blob a snapshot entry links to.
                where = (Path(snapshot.path) / f.path).resolve()
                result.problems.append(f"{f.path}: {problem} ({where})")
                continue
            result.num_files += 1
            result.num_bytes += f.size or 0
            result.num_sha256 += bool(snapshot.hashed and f.sha256)
            result.num_sha1 += bool(snapshot.hashed and not f.sha256 and f.blob_id)
    return result


def _check(path: Path, f: RemoteFile, hashed: bool, bar: tqdm) -> str | None:
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if f.size is not None and size != f.size:
        return f"{size} bytes, the Hub says {f.size}"
    if not hashed or not (f.sha256 or f.blob_id):
        return None
    # NOTE: git names a blob by sha1("blob <size>\0" + content); LFS files by their sha256.
    h = hashlib.sha256() if f.sha256 else hashlib.sha1(f"blob {size}\0".encode())
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    expected = f.sha256 or f.blob_id
    return None if h.hexdigest() == expected else f"{'sha256' if f.sha256 else 'git sha1'} " \
        f"{h.hexdigest()[:12]}..., the Hub says {expected[:12]}..."
