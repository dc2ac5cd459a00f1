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


def summarize(res: dict) -> None:
    """Ratios per C and their minima, and the markdown table."""
    ratios: dict = {}
    lines = []
    for a_key, runs in res.get("spec", {}).items():
        # NOTE: plain decoding as timed alongside this a's runs where the sweep did (runs[c]
        # ["plain"]), else the sweep's one plain table (results of older sweeps).
        plain = {c: x["plain"] if "plain" in x else res.get("plain", {}).get(c)
                 for c, x in runs.items()}
        cs = [c for c in plain if plain[c] is not None and "adaptive" in runs[c]]
        if not cs:
            continue
        lines += [f"### synthetic acceptance a={a_key[2:]}", "",
                  "| Config | " + " | ".join(cs) + " |", "|---|" + "---|" * len(cs)]
        lines.append("| plain (no drafter) | " + " | ".join(
            f"{plain[c]['output_tok_s']:.0f}" for c in cs) + " |")
        for name, _, _ in CONFIGS:
            lines.append(f"| {name} | " + " | ".join(
                f"{runs[c][name]['output_tok_s']:.0f}" if name in runs[c] else "-"
                for c in cs) + " |")
        rows = {"adaptive / plain": [], "adaptive / best": []}
        for c in cs:
            ad = runs[c]["adaptive"]["output_tok_s"]
            # NOTE: the reference set, {plain, fixed 4, 8, 16}: adaptive may beat it (it
            # can also run block 2), and then shows above 1.0x.
            best = max([plain[c]["output_tok_s"]] + [runs[c][n]["output_tok_s"]
                                                     for n, _, _ in CONFIGS
                                                     if n in runs[c] and n != "adaptive"])
            r = {"vs_plain": ad / plain[c]["output_tok_s"], "vs_best": ad / best}
            if "fixed 16" in runs[c]:
                r["vs_fixed16"] = ad / runs[c]["fixed 16"]["output_tok_s"]
            ratios.setdefault(a_key, {})[c] = r
            rows["adaptive / plain"].append(f"{r['vs_plain']:.3f}x")
            rows["adaptive / best"].append(f"{r['vs_best']:.3f}x")
        for name, vals in rows.items():
            lines.append(f"| {name} | " + " | ".join(vals) + " |")
        if all(runs[c]["adaptive"].get("decode_tok_s") and plain[c].get("decode_tok_s")
               for c in cs):
            # NOTE: the decode phase alone (after every request's first token), see
            # blockspec.bench.timed_runs.decode_phase
            lines.append("| decode phase: adaptive / plain | " + " | ".join(
                f"{runs[c]['adaptive']['decode_tok_s'] / plain[c]['decode_tok_s']:.3f}x"
                for c in cs) + " |")
            if all("fixed 4" in runs[c] and runs[c]["fixed 4"].get("decode_tok_s") for c in cs):
                lines.append("| decode phase: fixed 4 / plain | " + " | ".join(
                    f"{runs[c]['fixed 4']['decode_tok_s'] / plain[c]['decode_tok_s']:.3f}x"
                    for c in cs) + " |")
        lines.append("| adaptive block lengths | " + " | ".join(
            " ".join(f"{k}:{v}" for k, v in runs[c]["adaptive"].get("block_len_steps", {})
                     .items()) for c in cs) + " |")
        lines.append("")
    res["ratios"] = ratios
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
    head = [f"# {res['benchmark']}", "", f"`{res['command']}` on {res['device']}, torch "
            f"{res['torch']}, {res['date']}", "", "Output tok/s (synthetic acceptance is a "
            "labelled benchmark-only mode).", ""]
    for k in ("policy_min_vs_plain", "policy_min_vs_best", "policy_c1_a086_vs_fixed16"):
        if k in res:
            head.append(f"- {k}: {res[k]:.3f}")
    # C=1 is left out: its runs differ by their synthetic draws (one sequence each), not noise.
    cells = {"plain": [spread(x) for c, x in res.get("plain", {}).items() if c != "C=1"],
             "adaptive": [spread(x.get("adaptive", {})) for per_a in res.get("spec", {}).values()
                          for c, x in per_a.items() if c != "C=1"]}
    cells = {k: [x for x in v if x is not None] for k, v in cells.items()}
    if any(cells.values()):
        # NOTE: the noise the ratios sit in: identical runs of one cell differ by this much.
        res["max_run_spread"] = {k: max(v) for k, v in cells.items() if v}
        head.append("- run-to-run spread of a cell's repeats ((max - min) / mean), largest: "
                    + ", ".join(f"{k} {v:.1%}" for k, v in res["max_run_spread"].items())
                    + " (C > 1)")
    if "plain_step_overhead" in res:
        head.append("- plain step with drafter context / without drafter, by batch: " + ", ".join(
            f"B={b} {v:.3f}x" for b, v in res["plain_step_overhead"].items()))
    prof = res.get("cost_profile", {})
    if prof.get("times"):
        head += ["", f"Cost profile ({'measured' if prof.get('measured') else 'loaded'}, "
                 f"{prof.get('path')}), ms per step:", "",
                 "| L \\ B | " + " | ".join(next(iter(prof["times"].values()))) + " |",
                 "|---|" + "---|" * len(next(iter(prof["times"].values())))]
        for L, row in sorted(prof["times"].items(), key=lambda kv: int(kv[0])):
            head.append(f"| {L} | " + " | ".join(f"{t * 1e3:.2f}" for t in row.values()) + " |")
    res["table_md"] = "\n".join(head + [""] + lines)


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
