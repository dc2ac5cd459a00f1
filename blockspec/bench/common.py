"""What `serve` and `offline` share: concurrency lists, the result file, environment, labels."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from blockspec.config import ConfigError

SCHEMA = "blockspec.bench/1"
DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64,128,256"
# Argument names never written to a result file, and the flags and environment variables that
# carry them.
_SECRET_ARGS = {"api_key"}
_SECRET_FLAGS = ("--api-key",)
_SECRET_ENV = ("BLOCKSPEC_API_KEY", "OPENAI_API_KEY")
REDACTED = "<redacted>"


def redact_argv(argv: list[str]) -> list[str]:
    """A command line as it may be recorded: the values of secret flags (`--api-key K`,
    `--api-key=K`) and any secret environment variable's value replaced by <redacted>."""
    secrets = [v for v in (os.environ.get(name) for name in _SECRET_ENV) if v]
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if flag in _SECRET_FLAGS:
            out.append(f"{flag}={REDACTED}" if eq else arg)
            hide_next = not eq
            continue
        for secret in secrets:
            arg = arg.replace(secret, REDACTED)
        out.append(arg)
    return out


def parse_concurrency(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (sorted, deduplicated)."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ConfigError("--concurrency is empty; give a list such as 1,2,4,8")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--concurrency must be comma-separated integers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise ConfigError(f"--concurrency values must be positive, got {text!r}")
    return sorted(set(values))


def requests_per_level(num_prompts: int | None, concurrency: int) -> int:
    """Requests sent at one concurrency level. The default keeps C requests in flight for most of
    the level, so the ramp-down tail (fewer than C left) does not dominate the figure."""
    if num_prompts is not None:
        if num_prompts <= 0:
            raise ConfigError("--num-prompts must be positive")
        return num_prompts
    return max(4 * concurrency, 8)


def check_lengths(input_len: int | None, output_len: int) -> None:
    if output_len <= 0:
        raise ConfigError("--output-len must be positive")
    if input_len is not None and input_len <= 0:
        raise ConfigError("--input-len must be positive")


def recorded_command(script: str) -> str:
    """How a benchmark script was run, as its results record it (secrets redacted)."""
    return f"python {script} " + shlex.join(redact_argv(sys.argv[1:]))


def write_json(out_dir: str | Path, name: str, obj: Any) -> Path:
    """A benchmark script's result file `out_dir/name` (the folder made if needed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(obj, indent=1) + "\n")
    return path


def git_commit() -> str | None:
    """HEAD of this checkout, or $BLOCKSPEC_COMMIT where set (a copied tree whose git metadata
    is not its own, as on a lent GPU machine)."""
    if os.environ.get("BLOCKSPEC_COMMIT"):
        return os.environ["BLOCKSPEC_COMMIT"]
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, text=True,
            stderr=subprocess.DEVNULL, timeout=5).strip()
    except Exception:  # noqa: BLE001 - not a checkout, no git: the field is just absent
        return None


def environment() -> dict[str, Any]:
    """Where and how the numbers were measured (the client side, for `serve`)."""
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "command": shlex.join(redact_argv(sys.argv)),
        "commit": git_commit(),
    }
    for pkg in ("blockspec", "torch", "transformers", "httpx"):
        try:
            env[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            env[pkg] = None
    try:
        import torch

        if torch.cuda.is_available():
            env["device"] = torch.cuda.get_device_name()
            env["cuda"] = torch.version.cuda
    except Exception:  # noqa: BLE001 - environment capture must never fail a benchmark
        pass
    return env


def args_config(args: Any) -> dict[str, Any]:
    """The parsed command line as JSON-safe values, secrets redacted."""
    out: dict[str, Any] = {}
    for key, value in vars(args).items():
        # NOTE: "argv" is the raw command line (secrets included); `command` holds it redacted
        if callable(value) or key == "argv":
            continue
        if key in _SECRET_ARGS and value:
            value = REDACTED
        elif isinstance(value, str):
            value = redact_argv([value])[0]
        out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
    return out


def new_result(kind: str, args: Any, label: str,
               synthetic_acceptance: float | None = None) -> dict[str, Any]:
    res: dict[str, Any] = {"schema": SCHEMA, "kind": kind, "label": label,
                           "synthetic": synthetic_acceptance is not None}
    if synthetic_acceptance is not None:
        res["synthetic_acceptance"] = synthetic_acceptance
        res["synthetic_note"] = (
            "benchmark-only mode: each draft position is accepted with probability a instead of "
            "being verified; the output text is NOT the target model's and the acceptance "
            "figures hold by construction")
    res.update(config=args_config(args), environment=environment(), levels=[])
    return res


def finish_summary(result: dict[str, Any]) -> None:
    levels = [lv for lv in result["levels"] if lv.get("output_tok_s")]
    if levels:
        best = max(levels, key=lambda lv: lv["output_tok_s"])
        result["summary"] = {"peak_output_tok_s": best["output_tok_s"],
                             "peak_concurrency": best["concurrency"]}


def save_result(path: str | None, result: dict[str, Any]) -> None:
    """Rewritten after every level, so a crash or Ctrl-C keeps what was measured."""
    if not path:
        return
    finish_summary(result)
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, p)


def level_line(level: dict[str, Any]) -> str:
    """One human-readable line per finished level."""

    def med(key: str) -> str:
        d = level.get(key)
        return f"{d['median']:.1f} ms" if d else "-"

    acc = level.get("acceptance") or {}
    tau = acc.get("mean_acceptance_length")
    line = (f"C={level['concurrency']}: {level['output_tok_s']:.1f} out tok/s, "
            f"{level['req_s']:.2f} req/s, TTFT median {med('ttft_ms')}, "
            f"TPOT median {med('tpot_ms')}, {level['completed']} ok / {level['failed']} failed")
    if tau:
        line += f", acceptance length {tau:.2f}"
    return line
