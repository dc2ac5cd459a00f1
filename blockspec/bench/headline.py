"""The headline figures file, benchmarks/results/latest.json (the figures DESIGN.md quotes):
a run's measured figures merged into the committed file, each with the run it came from."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["COMMITTED_LATEST", "merge_latest"]

COMMITTED_LATEST = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "latest.json"


def merge_latest(res: dict, figures: dict, path: Path, committed: Path = COMMITTED_LATEST) -> None:
    """Headline figures merged into the committed latest.json and written to `path`; measured
    ones only, each with its run recorded under "sources" (a figure from an older run keeps its
    own source). `res` is the run's record (device, date, commit, command)."""
    latest = json.loads(committed.read_text()) if committed.is_file() else {}
    if figures:
        latest.update(device=res["device"], date=res["date"], commit=res["commit"], **figures)
        run = f"{res['command']} ({res['device']}, {res['date']})"
        latest.setdefault("sources", {}).update({k: run for k in figures})
    path.write_text(json.dumps(latest, indent=2) + "\n")
