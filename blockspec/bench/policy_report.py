"""Tables, ratios and the plot of benchmarks/policy_sweep.py's results (kept apart from the
runner: they rebuild from a saved policy_sweep.json). matplotlib is imported by `plot` only."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CONFIGS", "plot", "spread", "summarize"]

# (name, policy mode, fixed block length) of every speculative configuration in the sweep.
CONFIGS = (("fixed 4", "fixed", 4), ("fixed 8", "fixed", 8), ("fixed 16", "fixed", 16),
           ("adaptive", "adaptive", None))


def spread(cell: dict) -> float | None:
    """(max - min) / mean of a pooled cell's per-run output tok/s (None for a single run)."""
    runs = [r["output_tok_s"] for r in cell.get("runs", [])]
    return (max(runs) - min(runs)) * len(runs) / sum(runs) if len(runs) > 1 else None


def _plain_per_c(res: dict, runs: dict) -> dict:
    """Plain decoding per C for one acceptance's runs (None where the sweep has none)."""
    # NOTE: plain decoding as timed alongside this a's runs where the sweep did (runs[c]
    # ["plain"]), else the sweep's one plain table (results of older sweeps).
    return {c: x["plain"] if "plain" in x else res.get("plain", {}).get(c)
            for c, x in runs.items()}


def _row(name: str, cells: list[str]) -> str:
    """One markdown table row."""
    return f"| {name} | " + " | ".join(cells) + " |"


def _tok_s_rows(a_key: str, runs: dict, plain: dict, cs: list[str]) -> list[str]:
    """The section's heading and its output tok/s rows: plain, then every configuration."""
    lines = [f"### synthetic acceptance a={a_key[2:]}", "",
             "| Config | " + " | ".join(cs) + " |", "|---|" + "---|" * len(cs)]
    lines.append(_row("plain (no drafter)", [f"{plain[c]['output_tok_s']:.0f}" for c in cs]))
    for name, _, _ in CONFIGS:
        lines.append(_row(name, [f"{runs[c][name]['output_tok_s']:.0f}" if name in runs[c]
                                 else "-" for c in cs]))
    return lines


def _cell_ratios(cell: dict, plain_cell: dict) -> dict[str, float]:
    """Adaptive's output tok/s over plain, over the best reference and over fixed 16."""
    ad = cell["adaptive"]["output_tok_s"]
    # NOTE: the reference set, {plain, fixed 4, 8, 16}: adaptive may beat it (it
    # can also run block 2), and then shows above 1.0x.
    best = max([plain_cell["output_tok_s"]] + [cell[n]["output_tok_s"] for n, _, _ in CONFIGS
                                               if n in cell and n != "adaptive"])
    r = {"vs_plain": ad / plain_cell["output_tok_s"], "vs_best": ad / best}
    if "fixed 16" in cell:
        r["vs_fixed16"] = ad / cell["fixed 16"]["output_tok_s"]
    return r


def _decode_rows(runs: dict, plain: dict, cs: list[str]) -> list[str]:
    """Decode-phase ratio rows, where every C of the section has decode-phase timings."""
    if not all(runs[c]["adaptive"].get("decode_tok_s") and plain[c].get("decode_tok_s")
               for c in cs):
        return []
    # NOTE: the decode phase alone (after every request's first token), see
    # blockspec.bench.timed_runs.decode_phase
    lines = [_row("decode phase: adaptive / plain", [
        f"{runs[c]['adaptive']['decode_tok_s'] / plain[c]['decode_tok_s']:.3f}x" for c in cs])]
    if all("fixed 4" in runs[c] and runs[c]["fixed 4"].get("decode_tok_s") for c in cs):
        lines.append(_row("decode phase: fixed 4 / plain", [
            f"{runs[c]['fixed 4']['decode_tok_s'] / plain[c]['decode_tok_s']:.3f}x"
            for c in cs]))
    return lines


def _section(a_key: str, runs: dict, plain: dict, cs: list[str]) -> tuple[list[str], dict]:
    """One synthetic acceptance's markdown table and its ratios per C."""
    lines = _tok_s_rows(a_key, runs, plain, cs)
    ratios = {c: _cell_ratios(runs[c], plain[c]) for c in cs}
    lines.append(_row("adaptive / plain", [f"{ratios[c]['vs_plain']:.3f}x" for c in cs]))
    lines.append(_row("adaptive / best", [f"{ratios[c]['vs_best']:.3f}x" for c in cs]))
    lines += _decode_rows(runs, plain, cs)
    lines.append(_row("adaptive block lengths", [
        " ".join(f"{k}:{v}" for k, v in runs[c]["adaptive"].get("block_len_steps", {}).items())
        for c in cs]))
    lines.append("")
    return lines, ratios


def _headline(res: dict, ratios: dict) -> None:
    """The sweep's summary numbers into `res`: plain step overhead and the ratios' minima."""
    spec_plain = res.get("cost_profile", {}).get("times", {}).get("1", {})
    if spec_plain and res.get("plain_step_times"):
        res["plain_step_overhead"] = {b: spec_plain[b] / t for b, t in
                                      res["plain_step_times"].items() if b in spec_plain}
    allr = [r for per_c in ratios.values() for r in per_c.values()]
    if allr:
        res["policy_min_vs_plain"] = min(r["vs_plain"] for r in allr)
        res["policy_min_vs_best"] = min(r["vs_best"] for r in allr)
    c1 = ratios.get("a=0.86", {}).get("C=1", {}).get("vs_fixed16")
    if c1 is not None:
        res["policy_c1_a086_vs_fixed16"] = c1


def _run_spread(res: dict) -> dict[str, float]:
    """Largest run-to-run spread of a cell's repeats, plain and adaptive (empty: no repeats)."""
    # C=1 is left out: its runs differ by their synthetic draws (one sequence each), not noise.
    cells = {"plain": [spread(x) for c, x in res.get("plain", {}).items() if c != "C=1"],
             "adaptive": [spread(x.get("adaptive", {})) for per_a in res.get("spec", {}).values()
                          for c, x in per_a.items() if c != "C=1"]}
    cells = {k: [x for x in v if x is not None] for k, v in cells.items()}
    return {k: max(v) for k, v in cells.items() if v}


def _cost_profile_lines(prof: dict) -> list[str]:
    """The cost profile's ms-per-step table (L rows, B columns); empty without one."""
    if not prof.get("times"):
        return []
    batches = next(iter(prof["times"].values()))
    lines = ["", f"Cost profile ({'measured' if prof.get('measured') else 'loaded'}, "
             f"{prof.get('path')}), ms per step:", "",
             "| L \\ B | " + " | ".join(batches) + " |", "|---|" + "---|" * len(batches)]
    for L, row in sorted(prof["times"].items(), key=lambda kv: int(kv[0])):
        lines.append(_row(L, [f"{t * 1e3:.2f}" for t in row.values()]))
    return lines


def _head(res: dict) -> list[str]:
    """The report's title, provenance and headline bullets (sets res["max_run_spread"])."""
    head = [f"# {res['benchmark']}", "", f"`{res['command']}` on {res['device']}, torch "
            f"{res['torch']}, {res['date']}", "", "Output tok/s (synthetic acceptance is a "
            "labelled benchmark-only mode).", ""]
    for k in ("policy_min_vs_plain", "policy_min_vs_best", "policy_c1_a086_vs_fixed16"):
        if k in res:
            head.append(f"- {k}: {res[k]:.3f}")
    max_spread = _run_spread(res)
    if max_spread:
        # NOTE: the noise the ratios sit in: identical runs of one cell differ by this much.
        res["max_run_spread"] = max_spread
        head.append("- run-to-run spread of a cell's repeats ((max - min) / mean), largest: "
                    + ", ".join(f"{k} {v:.1%}" for k, v in max_spread.items()) + " (C > 1)")
    if "plain_step_overhead" in res:
        head.append("- plain step with drafter context / without drafter, by batch: " + ", ".join(
            f"B={b} {v:.3f}x" for b, v in res["plain_step_overhead"].items()))
    return head + _cost_profile_lines(res.get("cost_profile", {}))


def summarize(res: dict) -> None:
    """Ratios per C and their minima, and the markdown table."""
    ratios: dict = {}
    lines: list[str] = []
    for a_key, runs in res.get("spec", {}).items():
        plain = _plain_per_c(res, runs)
        cs = [c for c in plain if plain[c] is not None and "adaptive" in runs[c]]
        if not cs:
            continue
        section, ratios[a_key] = _section(a_key, runs, plain, cs)
        lines += section
    res["ratios"] = ratios
    _headline(res, ratios)
    res["table_md"] = "\n".join(_head(res) + [""] + lines)


def plot(res: dict, path: Path) -> None:
    """Output tok/s vs concurrency, one panel per synthetic acceptance, written to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec, plain = res.get("spec", {}), res.get("plain", {})
    if not spec or not plain:
        return
    fig, axes = plt.subplots(1, len(spec), figsize=(6 * len(spec), 4.5), squeeze=False)
    for ax, (a_key, runs) in zip(axes[0], spec.items()):
        cs = [c for c in plain if c in runs]
        xs = [int(c[2:]) for c in cs]
        ax.plot(xs, [runs[c].get("plain", plain[c])["output_tok_s"] for c in cs], "k--o",
                label="plain (no drafter)")
        for name, _, _ in CONFIGS:
            pts = [(x, runs[c][name]["output_tok_s"]) for x, c in zip(xs, cs) if name in runs[c]]
            if pts:
                ax.plot(*zip(*pts), "-o", lw=2.5 if name == "adaptive" else 1.2, label=name)
        ax.set(xscale="log", yscale="log", xlabel="concurrency C", ylabel="output tok/s",
               title=f"synthetic acceptance {a_key}")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
