"""`blockspec bench compare`: one model over several parallel layouts, each plain and with its
drafter, in one command. Every config runs `blockspec bench offline` in its own process (its
engine starts, sweeps and exits, so no config's GPU memory or compiled state is another's) and
writes its result JSON into the output folder; then every config is set against the best plain
(AR) layout at each concurrency, `| Config | C=1 | C=32 | C=64 | C=128 | Peak |`, with a plot.
A config that fails is reported and the others still run.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockspec.bench.common import environment, redact_argv
from blockspec.bench.report import _levels, _table, load_result, plot_sweep
from blockspec.config import ConfigError
from blockspec.parallel.launch import layout_label

__all__ = ["Layout", "acceptance_for_length", "acceptance_length", "comparison", "configs",
           "offline_argv", "parse_layouts", "run_compare", "run_configs", "write_comparison"]

COLUMNS = (1, 32, 64, 128)


@dataclass(frozen=True)
class Layout:
    name: str  # as given: "tp8", "ep8", "ep4x2", "tp1"
    tensor_parallel_size: int
    expert_parallel_size: int

    @property
    def label(self) -> str:
        return layout_label(self.tensor_parallel_size, self.expert_parallel_size) or "1 GPU"

    def flags(self) -> list[str]:
        return ["-tp", str(self.tensor_parallel_size), "-ep", str(self.expert_parallel_size)]


def parse_layouts(text: str) -> list[Layout]:
    """`tpN` (tensor parallel over N devices), `epN` (N devices, whole experts on each), `epAxB`
    (A expert groups of B devices: -tp A*B -ep A), comma-separated."""
    out: list[Layout] = []
    for name in (x.strip().lower() for x in text.split(",")):
        m = re.fullmatch(r"(tp|ep)(\d+)(?:x(\d+))?", name)
        if not m or (m[1] == "tp" and m[3]) or int(m[2]) < 1 or (m[3] and int(m[3]) < 1):
            raise ConfigError(f"--layouts: {name!r} is not tpN, epN or epAxB")
        n, per = int(m[2]), int(m[3] or 1)
        out.append(Layout(name, n * per, 1 if m[1] == "tp" else n))
    if len({x.name for x in out}) != len(out):
        raise ConfigError(f"--layouts: a layout is named twice in {text!r}")
    return out


def _own_options() -> argparse.ArgumentParser:
    """The options compare sets per config itself: stripped from what offline runs get."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for names in (("--layouts",), ("--speculative",), ("--out",), ("--label",), ("--draft",),
                  ("--synthetic-acceptance",), ("--tensor-parallel-size", "-tp"),
                  ("--expert-parallel-size", "-ep")):
        p.add_argument(*names)
    return p


def offline_argv(argv: list[str]) -> list[str]:
    """The `bench offline` flags of a `bench compare` command line (`argv` after `blockspec`),
    less those compare sets per config."""
    i = argv.index("compare") + 1 if "compare" in argv else 0
    _, rest = _own_options().parse_known_args(argv[i:])
    return rest


def configs(layouts: list[Layout], speculative: str, draft: str | None,
            synthetic: float | None = None) -> list[tuple[str, str, list[str]]]:
    """(file name, label, flags) per config: each layout plain ("*_ar"), with the drafter
    ("*_dflash", with the labelled synthetic acceptance if given), or both."""
    if speculative != "off" and not draft:
        raise ConfigError(f"--speculative {speculative} needs --draft")
    spec = ["--draft", str(draft)] + (
        ["--synthetic-acceptance", str(synthetic)] if synthetic is not None else [])
    out = []
    for lay in layouts:
        if speculative in ("off", "both"):
            out.append((f"{lay.name}_ar", f"{lay.label} AR", [*lay.flags(), "--draft", "none"]))
        if speculative in ("on", "both"):
            out.append((f"{lay.name}_dflash", f"{lay.label} DFlash", [*lay.flags(), *spec]))
    return out


def acceptance_length(a: float, block: int) -> float:
    """The mean tokens a verify block of `block` commits when each draft position is accepted
    with probability `a` until the first rejection (the synthetic mode): 1 + a + ... + a^(B-1)."""
    return sum(a ** k for k in range(block))


def acceptance_for_length(tau: float, block: int) -> float:
    """The synthetic acceptance `a` whose block of `block` commits `tau` tokens on average."""
    if not 1.0 <= tau <= block:
        raise ConfigError(f"an acceptance length of {tau} is outside [1, {block}]")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if acceptance_length(mid, block) < tau else (lo, mid)
    return round((lo + hi) / 2, 4)


def best_plain(results: dict[str, dict[str, Any]]) -> dict[int, tuple[float, str]]:
    """Per concurrency: the best AR config's output tok/s and its label."""
    best: dict[int, tuple[float, str]] = {}
    for name, res in results.items():
        if not name.endswith("_ar"):
            continue
        for c, lv in _levels(res).items():
            tok = lv.get("output_tok_s") or 0.0
            if tok > best.get(c, (0.0, ""))[0]:
                best[c] = (tok, res["label"])
    return best


def ratio_rows(results: dict[str, dict[str, Any]], columns: list[int]) -> list[str]:
    """Each config's tok/s over the best plain layout's at that C, and peak over peak."""
    best = best_plain(results)
    peak_ar = max((t for t, _ in best.values()), default=0.0)
    rows = ["| Config | " + " | ".join(f"C={c}" for c in columns) + " | Peak |",
            "|---|" + "---:|" * (len(columns) + 1)]
    for res in results.values():
        lv = _levels(res)
        cells = [f"{lv[c]['output_tok_s'] / best[c][0]:.2f}x"
                 if c in lv and best.get(c, (0.0,))[0] else "-" for c in columns]
        peak = max((x.get("output_tok_s") or 0.0 for x in lv.values()), default=0.0)
        cells.append(f"{peak / peak_ar:.2f}x" if peak_ar else "-")
        rows.append(f"| {res['label']} | " + " | ".join(cells) + " |")
    return rows


def comparison(results: dict[str, dict[str, Any]]) -> str:
    measured = sorted({c for r in results.values() for c in _levels(r)})
    columns = [c for c in COLUMNS if c in measured] or measured
    labels = [r["label"] for r in results.values()]
    best = best_plain(results)
    parts = ["Output tokens/s (higher is better)", "",
             *_table(list(results.values()), labels, columns,
                     lambda lv: lv.get("output_tok_s"), "max"), "",
             "Over the best plain (AR) layout at each concurrency ("
             + ", ".join(f"C={c}: {best[c][1]}" for c in columns if c in best) + ")", "",
             *ratio_rows(results, columns)]
    if any(r.get("synthetic") for r in results.values()):
        parts += ["", "SYNTHETIC rows: each draft position accepted with probability a "
                  "(benchmark-only mode; the text is not the target's)."]
    return "\n".join(parts) + "\n"


def write_comparison(results: dict[str, dict[str, Any]], out: Path) -> str:
    """`comparison(results)` into out/compare.md and its plot into out/compare.png; returns
    the table."""
    text = comparison(results)
    (out / "compare.md").write_text(text)
    plot_sweep(list(results.values()), [r["label"] for r in results.values()],
               out / "compare.png")
    return text


def run_configs(plan: list[tuple[str, str, list[str]]], passthrough: list[str], out: Path
                ) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Each config's `bench offline` in its own process: (results by name, failed labels)."""
    results: dict[str, dict[str, Any]] = {}
    failed: list[str] = []
    for i, (name, label, flags) in enumerate(plan, 1):
        path = out / f"{name}.json"
        cmd = [sys.executable, "-m", "blockspec.cli", "bench", "offline", *passthrough, *flags,
               "--label", label, "--out", str(path)]
        print(f"[blockspec] compare {i}/{len(plan)}: {label}", file=sys.stderr, flush=True)
        if subprocess.run(cmd).returncode != 0 or not path.is_file():
            failed.append(label)
            continue
        results[name] = load_result(path)
    return results, failed


def run_compare(args: argparse.Namespace) -> int:
    if (args.tensor_parallel_size, args.expert_parallel_size) != (1, 1) or args.label:
        raise ConfigError("bench compare sets -tp, -ep and --label per config (--layouts)")
    layouts = parse_layouts(args.layouts)
    speculative = args.speculative or ("both" if args.draft else "off")
    plan = configs(layouts, speculative, args.draft, args.synthetic_acceptance)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, failed = run_configs(plan, offline_argv(list(args.argv)), out)
    if not results:
        raise ConfigError(f"every config failed: {', '.join(failed)}")
    print("\n" + write_comparison(results, out), end="")
    summary = {"benchmark": "compare", "command": shlex.join(["blockspec",
                                                              *redact_argv(args.argv)]),
               "environment": environment(), "layouts": [lay.name for lay in layouts],
               "speculative": speculative, "configs": {n: r["label"] for n, r in results.items()},
               "failed": failed, "best_plain": {str(c): {"tok_s": t, "config": lab}
                                                for c, (t, lab) in best_plain(results).items()}}
    (out / "compare.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"[blockspec] results, table and plot written to {out}", file=sys.stderr)
    if failed:
        print(f"[blockspec] error: {len(failed)} config(s) failed: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0
