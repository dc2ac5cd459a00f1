"""A local HTTP server that answers the Hugging Face Hub endpoints huggingface_hub downloads
through (model info, tree listing, file resolve with HEAD and Range), for offline tests.

Repos are folders; *.safetensors files are served as LFS files (ETag = sha256), the rest as git
blobs (ETag = git blob sha1), as the Hub does. `drop_once[path] = n` sends n bytes of the next
full GET of a file and cuts the connection; `fail_get` answers 500 to every GET of those files.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    commit: str
    files: dict[str, bytes]
    gated: bool = False

    def is_lfs(self, path: str) -> bool:
        return path.endswith(".safetensors")

    def etag(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha256(data).hexdigest() if self.is_lfs(path) else git_blob_id(data)

    def sibling(self, path: str) -> dict:
        data = self.files[path]
        if not self.is_lfs(path):
            return {"rfilename": path, "size": len(data), "blobId": git_blob_id(data)}
        sha = hashlib.sha256(data).hexdigest()
        pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\n"
                   f"size {len(data)}\n")
        return {"rfilename": path, "size": len(data), "blobId": git_blob_id(pointer.encode()),
                "lfs": {"sha256": sha, "size": len(data), "pointerSize": len(pointer)}}

    def tree_entry(self, path: str) -> dict:
        s = self.sibling(path)
        entry = {"type": "file", "path": path, "size": s["size"], "oid": s["blobId"]}
        if "lfs" in s:
            entry["lfs"] = {"oid": s["lfs"]["sha256"], "size": s["size"],
                            "pointerSize": s["lfs"]["pointerSize"]}
        return entry


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, Range
    drop_once: dict[str, int] = field(default_factory=dict)
    fail_get: set[str] = field(default_factory=set)
    url: str = ""

    def add_repo(self, repo_id: str, folder: Path, extra: dict[str, bytes] | None = None,
                 gated: bool = False) -> FakeRepo:
        files = {p.relative_to(folder).as_posix(): p.read_bytes()
                 for p in sorted(folder.rglob("*")) if p.is_file()}
        files.update(extra or {})
        commit = hashlib.sha1(repo_id.encode() + b"".join(files.values())).hexdigest()
        self.repos[repo_id] = FakeRepo(commit, files, gated)
        return self.repos[repo_id]

    def gets(self, filename: str) -> list[str | None]:
        """The Range header of each GET of a file (None: a full GET)."""
        return [r for m, p, r in self.requests if m == "GET" and p.endswith("/" + filename)]

    def file_gets(self) -> list[str]:
        return [p.split("/resolve/", 1)[1].split("/", 1)[1]
                for m, p, _ in self.requests if m == "GET" and "/resolve/" in p]

    def start(self) -> ThreadingHTTPServer:
        hub = self

        class Handler(_Handler):
            fake = hub

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()
        return server


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def _route(self, head: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.fake.requests.append(("HEAD" if head else "GET", path, self.headers.get("Range")))
        if path.startswith("/api/models/"):
            parts = path[len("/api/models/"):].split("/")
            repo, rest = "/".join(parts[:2]), parts[2:]
            return self._api(repo, rest)
        parts = path.lstrip("/").split("/", 4)
        if len(parts) == 5 and parts[2] == "resolve":
            return self._file("/".join(parts[:2]), parts[3], parts[4], head)
        self._error(404, "EntryNotFound")

    def _repo(self, repo_id: str, rev: str) -> FakeRepo | None:
        repo = self.fake.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound")
        elif repo.gated:
            self._error(403, "GatedRepo")
        elif rev not in ("main", repo.commit):
            self._error(404, "RevisionNotFound")
        else:
            return repo
        return None

    def _api(self, repo_id: str, rest: list[str]) -> None:
        rev = rest[1] if len(rest) >= 2 else "main"
        repo = self._repo(repo_id, rev)
        if repo is None:
            return
        if rest and rest[0] == "tree":
            return self._json([repo.tree_entry(p) for p in repo.files])
        self._json({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                    "siblings": [repo.sibling(p) for p in repo.files]})

    def _file(self, repo_id: str, rev: str, filename: str, head: bool) -> None:
        repo = self._repo(repo_id, rev)
        if repo is None:
            return
        if filename not in repo.files:
            return self._error(404, "EntryNotFound", repo.commit)
        if not head and filename in self.fake.fail_get:
            return self._error(500, None, repo.commit)
        data = repo.files[filename]
        start = int(self.headers["Range"].split("=")[1].split("-")[0]) \
            if self.headers.get("Range") else 0
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", repo.commit)
        self.send_header("ETag", f'"{repo.etag(filename)}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if head:
            return
        cut = self.fake.drop_once.pop(filename, None) if not start else None
        # NOTE: a cut sends fewer bytes than Content-Length and closes: a dropped transfer.
        self.wfile.write(data[start:] if cut is None else data[:cut])
        self.wfile.flush()
        self.close_connection = True

    def _json(self, obj: object) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, code: str | None, commit: str | None = None) -> None:
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Length", "0")
        self.end_headers()
