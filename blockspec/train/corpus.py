"""A Python-source corpus that exists offline on any machine: the interpreter's standard library
plus, optionally, installed distributions under permissive licences.

Output folder: `train.jsonl`, `heldout.jsonl` (one {"text", "path", "source", "license"} per line)
and `MANIFEST.json` (exact counts, bytes, python version, every source with its licence).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import sys
import sysconfig
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

MAX_FILE_BYTES = 1 << 20
MAX_LINE_CHARS = 2000  # longer lines mean generated tables/data, not code worth imitating
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "testing", "__pycache__", "site-packages",
                       "dist-packages"})
PERMISSIVE_SPDX = frozenset({
    "mit", "mit-0", "mit-cmu", "bsd-2-clause", "bsd-3-clause", "0bsd", "apache-2.0", "psf-2.0",
    "python-2.0", "isc", "zlib", "cc0-1.0", "bsl-1.0", "cnri-python", "llvm-exception",
})
PERMISSIVE_CLASSIFIERS = ("MIT License", "BSD License", "Apache Software License",
                          "Python Software Foundation License", "ISC License")
# Free-text `License:` fields are only trusted when they are a short, recognisable name.
_FREE_TEXT = re.compile(r"^(the )?(mit|bsd|isc|apache|psf|python software foundation)"
                        r"[\w .\-]{0,30}$", re.I)


@dataclass(frozen=True)
class Doc:
    text: str
    path: str  # relative to its root, "/"-separated: stable across machines
    source: str  # "stdlib" or a distribution name
    license: str
    sha256: str


def _classifier_license(meta: metadata.PackageMetadata) -> str | None:
    """The OSI licence classifiers, joined, when all licence classifiers are OSI ones and one
    of them is permissive; None otherwise (the other fields decide then)."""
    classifiers = [c for c in (meta.get_all("Classifier") or []) if c.startswith("License ::")]
    osi = [c for c in classifiers if "OSI Approved ::" in c]
    if not osi or len(osi) != len(classifiers):
        return None
    # Several licence classifiers are alternatives (dual licensing): one permissive suffices.
    if any(c.endswith(PERMISSIVE_CLASSIFIERS) or "(ISCL)" in c for c in osi):
        return "; ".join(c.split(" :: ")[-1] for c in osi)
    return None


def _spdx_permissive(expr: str) -> bool:
    """Whether an SPDX licence expression can be taken under permissive terms only."""
    # NOTE: every AND-term must offer at least one permissive alternative.
    terms = re.split(r"\s+AND\s+", expr.replace("(", " ").replace(")", " ").strip())
    return all(any(alt.strip().lower() in PERMISSIVE_SPDX
                   for alt in re.split(r"\s+OR\s+|\s+WITH\s+", t)) for t in terms)


def _free_text_license(meta: metadata.PackageMetadata) -> str | None:
    """A free-text `License:` field, only when it is a short, recognisable permissive name."""
    free = (meta.get("License") or "").strip()
    if free and "\n" not in free and _FREE_TEXT.match(free) and "gpl" not in free.lower():
        return free
    return None


def permissive_license(dist: metadata.Distribution) -> str | None:
    """The distribution's licence if every part of it is permissive, else None."""
    meta = dist.metadata
    from_classifiers = _classifier_license(meta)
    if from_classifiers is not None:
        return from_classifiers
    expr = (meta.get("License-Expression") or "").strip()
    if expr:
        # A licence expression, when present, decides: the free text is not consulted.
        return expr if _spdx_permissive(expr) else None
    return _free_text_license(meta)


def _read(path: Path) -> str | None:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not text.strip() or any(len(line) > MAX_LINE_CHARS for line in text.splitlines()):
        return None
    return text


def _walk_py(root: Path) -> list[Path]:
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        found.extend(Path(dirpath) / f for f in filenames
                     if f.endswith(".py") and not f.startswith("test_"))
    # NOTE: sort on the relative path so the order is the same on every machine.
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def stdlib_files() -> list[tuple[Path, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(p, p.relative_to(root).as_posix()) for p in _walk_py(root)]


def dist_files(dist: metadata.Distribution) -> list[tuple[Path, str]]:
    out = []
    for f in dist.files or []:
        rel = f.as_posix()
        parts = set(rel.split("/")[:-1])
        if not rel.endswith(".py") or parts & SKIP_DIRS or rel.split("/")[-1].startswith("test_"):
            continue
        if ".dist-info" in rel or rel.startswith(".."):  # skip scripts installed outside
            continue
        out.append((Path(str(dist.locate_file(f))), rel))
    return sorted(out, key=lambda x: x[1])


def permissive_dists(names: list[str] | None = None) -> list[tuple[metadata.Distribution, str]]:
    """Given names (or every installed distribution when None) that pass the licence check,
    sorted by name. Names given explicitly but not permissive raise, so nothing slips in."""
    if names is None:
        dists = {d.metadata["Name"].lower(): d for d in metadata.distributions()}
        dists.pop("blockspec", None)  # our own code would leak into the demo weights' corpus
    else:
        dists = {n.lower(): metadata.distribution(n) for n in names}
    kept = []
    for key in sorted(dists):
        lic = permissive_license(dists[key])
        if lic is not None:
            kept.append((dists[key], lic))
        elif names is not None:
            raise ValueError(f"distribution {key!r} has no permissive licence metadata")
    return kept


def is_heldout(sha256: str, heldout_pct: float) -> bool:
    # NOTE: split by content hash, so a file lands on the same side on every machine and run.
    return int(sha256[:8], 16) % 10_000 < heldout_pct * 100


def collect(max_mb: float | None = None, dists: list[str] | None = (),
            include_stdlib: bool = True) -> list[Doc]:
    """Deterministic, deduplicated docs: stdlib first, then distributions by name. `dists=None`
    takes every permissive installed distribution; `()` takes none. Stops at `max_mb`."""
    sources: list[tuple[str, str, list[tuple[Path, str]]]] = []
    if include_stdlib:
        sources.append(("stdlib", f"PSF-2.0 (Python {platform.python_version()})",
                        stdlib_files()))
    for dist, lic in permissive_dists(None if dists is None else list(dists)):
        sources.append((dist.metadata["Name"], lic, dist_files(dist)))
    budget = None if max_mb is None else int(max_mb * 1e6)
    docs: list[Doc] = []
    seen: set[str] = set()
    total = 0
    for source, lic, files in sources:
        for path, rel in files:
            text = _read(path)
            if text is None:
                continue
            digest = hashlib.sha256(text.encode()).hexdigest()
            if digest in seen:
                continue
            size = len(text.encode())
            if budget is not None and total + size > budget:
                return docs
            seen.add(digest)
            total += size
            docs.append(Doc(text, rel, source, lic, digest))
    return docs


def write_corpus(docs: list[Doc], out: str | os.PathLike, heldout_pct: float = 2.0) -> dict:
    """Writes train.jsonl / heldout.jsonl / MANIFEST.json; returns the manifest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[Doc]] = {"train": [], "heldout": []}
    for d in docs:
        splits["heldout" if is_heldout(d.sha256, heldout_pct) else "train"].append(d)
    if not splits["heldout"] and len(docs) > 1 and heldout_pct > 0:
        # NOTE: a small corpus still gets a held-out file (the smallest hash: deterministic),
        # so held-out loss always exists.
        pick = min(splits["train"], key=lambda d: d.sha256)
        splits["train"].remove(pick)
        splits["heldout"].append(pick)
    manifest: dict = {
        "python_version": platform.python_version(), "platform": sys.platform,
        "heldout_pct": heldout_pct, "max_file_bytes": MAX_FILE_BYTES, "splits": {}, "sources": {},
    }
    for split, items in splits.items():
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for d in items:
                rec = {k: v for k, v in asdict(d).items() if k != "sha256"}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        manifest["splits"][split] = {"files": len(items),
                                     "bytes": sum(len(d.text.encode()) for d in items)}
    for d in docs:
        src = manifest["sources"].setdefault(d.source, {"license": d.license, "files": 0,
                                                        "bytes": 0})
        if d.source != "stdlib":
            src["version"] = metadata.version(d.source)
        src["files"] += 1
        src["bytes"] += len(d.text.encode())
    manifest["files"] = len(docs)
    manifest["bytes"] = sum(s["bytes"] for s in manifest["splits"].values())
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_texts(path: str | os.PathLike) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-mb", type=float, default=None, help="stop after this many MB")
    ap.add_argument("--dists", nargs="*", default=[],
                    help="site-packages distributions to add (must be permissive)")
    ap.add_argument("--all-permissive", action="store_true",
                    help="add every installed distribution with a permissive licence")
    ap.add_argument("--no-stdlib", action="store_true")
    ap.add_argument("--heldout-pct", type=float, default=2.0)
    a = ap.parse_args(argv)
    docs = collect(a.max_mb, None if a.all_permissive else a.dists, not a.no_stdlib)
    m = write_corpus(docs, a.out, a.heldout_pct)
    print(f"corpus: {m['files']} files, {m['bytes'] / 1e6:.1f} MB "
          f"(train {m['splits']['train']['files']}, heldout {m['splits']['heldout']['files']}) "
          f"from {len(m['sources'])} sources -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
