"""The GPU check scripts' frame (benchmarks/gpu_checks.py, quant_gpu_checks.py): the report's
provenance, and every check run even when one fails, each failure recorded by name."""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch

from blockspec.bench.common import git_commit, recorded_command


def check_report(script: str) -> dict:
    """Device, torch, the exact command, date and commit of a check run."""
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "command": recorded_command(script),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit()}


def run_checks(checks: dict[str, Callable[[], None]], report: dict) -> bool:
    """Runs every check (a failure raises); True if all passed. NOTE: one failing check does
    not stop the others: the report then says what else holds."""
    ok = True
    for name, check in checks.items():
        try:
            check()
        except Exception as e:  # noqa: BLE001 - keep going: report every failing check
            ok = False
            report[f"{name}_error"] = repr(e)
            print(f"FAILED {name}: {e!r}")
    return ok
