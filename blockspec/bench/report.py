"""`blockspec bench report`: result files -> comparison tables (markdown) and a sweep plot.

The main table is DESIGN.md's `| Config | C=1 | C=32 | C=64 | C=128 | Peak |` of output tok/s,
one row per result file. Synthetic-acceptance results always carry their label in the row name.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from blockspec.config import ConfigError

DEFAULT_COLUMNS = "1,32,64,128"


def load_result(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"result file {str(path)!r} does not exist")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not a JSON file ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("levels"), list):
        raise ConfigError(f"{p}: not a blockspec bench result (no 'levels' list)")
    data.setdefault("label", p.stem)
    return data


def config_label(result: dict[str, Any]) -> str:
    label = str(result.get("label") or "?")
    if result.get("synthetic") and "synthetic" not in label.lower():
        label += f" [SYNTHETIC acceptance a={result.get('synthetic_acceptance')}]"
    return label


def _levels(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(lv["concurrency"]): lv for lv in result["levels"] if "concurrency" in lv}


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def _median(key: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda lv: (lv.get(key) or {}).get("median")


def _tau(lv: dict[str, Any]) -> float | None:
    return (lv.get("acceptance") or {}).get("mean_acceptance_length")


def _table(results: list[dict[str, Any]], labels: list[str], columns: list[int],
           value: Callable[[dict[str, Any]], float | None], peak: str | None) -> list[str]:
    """peak: None (no column), "max" or "min" over every level of the file."""
    head = "| Config | " + " | ".join(f"C={c}" for c in columns) + (" | Peak |" if peak else " |")
    rows = [head, "|---|" + "---:|" * (len(columns) + (1 if peak else 0))]
    for res, label in zip(results, labels):
        lv = _levels(res)
        cells = [_fmt(value(lv[c])) if c in lv else "-" for c in columns]
        if peak:
            vals = [(v, c) for c, x in lv.items() if (v := value(x)) is not None]
            best = (max if peak == "max" else min)(vals) if vals else None
            cells.append(f"{_fmt(best[0])} (C={best[1]})" if best else "-")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return rows


def _speedup_rows(results: list[dict[str, Any]], labels: list[str],
                  columns: list[int]) -> list[str]:
    base = _levels(results[0])
    rows = ["| Config | " + " | ".join(f"C={c}" for c in columns) + " |",
            "|---|" + "---:|" * len(columns)]
    for res, label in zip(results[1:], labels[1:]):
        lv = _levels(res)
        cells = []
        for c in columns:
            ok = c in lv and c in base and base[c].get("output_tok_s")
            cells.append(f"{lv[c]['output_tok_s'] / base[c]['output_tok_s']:.2f}x" if ok else "-")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return rows


def unique_labels(results: list[dict[str, Any]], paths: list[str]) -> list[str]:
    labels = [config_label(r) for r in results]
    for i, lab in enumerate(labels):
        if labels.count(lab) > 1:
            labels[i] = f"{lab} ({Path(paths[i]).stem})"
    return labels


def format_report(results: list[dict[str, Any]], labels: list[str], columns: list[int],
                  extra: bool = False) -> str:
    parts = ["Output tokens/s (higher is better)", "",
             *_table(results, labels, columns, lambda lv: lv.get("output_tok_s"), "max")]
    if len(results) > 1:
        parts += ["", f"Speed-up over {labels[0]} (output tok/s ratio, same run)", "",
                  *_speedup_rows(results, labels, columns)]
    if extra:
        parts += ["", "TTFT median, ms (lower is better)", "",
                  *_table(results, labels, columns, _median("ttft_ms"), None),
                  "", "TPOT median, ms (lower is better)", "",
                  *_table(results, labels, columns, _median("tpot_ms"), None),
                  "", "ITL p99, ms (gap between streamed outputs)", "",
                  *_table(results, labels, columns,
                          lambda lv: (lv.get("itl_ms") or {}).get("p99"), None)]
        if any(_tau(lv) for r in results for lv in r["levels"]):
            parts += ["", "Mean acceptance length (tokens per verify step)", "",
                      *_table(results, labels, columns, _tau, None)]
    if any(r.get("synthetic") for r in results):
        parts += ["", "SYNTHETIC rows: each draft position accepted with probability a "
                  "(benchmark-only mode; the text is not the target's)."]
    return "\n".join(parts) + "\n"


def plot_sweep(results: list[dict[str, Any]], labels: list[str], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # NOTE: headless: never needs a display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    ticks: set[int] = set()
    for res, label in zip(results, labels):
        lv = sorted(_levels(res).items())
        xs = [c for c, x in lv if x.get("output_tok_s")]
        ys = [x["output_tok_s"] for _, x in lv if x.get("output_tok_s")]
        if not xs:
            continue
        ticks.update(xs)
        ax.plot(xs, ys, marker="o", linestyle="--" if res.get("synthetic") else "-", label=label)
    if ticks:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(sorted(ticks)))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([str(t) for t in sorted(ticks)])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title("Output throughput vs concurrency")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(str(path))
    plt.close(fig)


def parse_columns(text: str, results: list[dict[str, Any]]) -> list[int]:
    if text.strip() == "all":
        return sorted({c for r in results for c in _levels(r)})
    try:
        cols = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise ConfigError(f"--columns must be comma-separated integers or 'all', got {text!r}") \
            from None
    if not cols or any(c <= 0 for c in cols):
        raise ConfigError("--columns needs at least one positive concurrency")
    return cols


def run_report(args: argparse.Namespace) -> str:
    if not args.results:
        raise ConfigError("give at least one result file")
    results = [load_result(p) for p in args.results]
    labels = unique_labels(results, args.results)
    columns = parse_columns(args.columns, results)
    text = format_report(results, labels, columns, extra=args.extra)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
        print(f"[blockspec] table written to {args.out}", file=sys.stderr)
    if args.plot:
        plot_sweep(results, labels, args.plot)
        print(f"[blockspec] plot written to {args.plot}", file=sys.stderr)
    return text
