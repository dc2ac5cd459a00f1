"""One command that rebuilds the demo pair (target + DFlash drafter) on one H200 in <= 20 min.

Stages: corpus (stdlib + permissive site-packages) -> byte-level BPE -> Qwen3 target (time-boxed)
-> drafter via `blockspec train-drafter`. Writes OUT/{corpus,tokenizer,target,drafter} and
OUT/build_record.json (commands, timings against their budgets, sizes, parameter counts).

Usage: python benchmarks/build_demo_pair.py --out OUT [--smoke]
`--smoke` runs every stage tiny on CPU (< 2 min); the tests use it.

Demo target: Qwen3, hidden 384, 8 layers, 6/2 heads (head_dim 64), MLP 1024, vocab 8192, tied
embeddings: 15.74M parameters, 31.5 MB bf16. Stage budgets add up to 1170 s (19.5 min); the
target's training is time-boxed, the drafter's step count is an estimate until measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from blockspec.train import corpus, target, tokenizer

# Seconds per stage on one H200 (16 CPU cores); the target stage's training is time-boxed inside
# its budget, so the total holds even if the machine is slower than expected.
DEMO = dict(
    corpus=["--all-permissive", "--max-mb", "250"], corpus_budget=60,
    tokenizer=["--vocab-size", "8192", "--max-train-mb", "64"], tokenizer_budget=90,
    target=["--preset", "demo", "--steps", "20000", "--batch-size", "64", "--seq-len", "1024",
            "--lr", "1.5e-3", "--eval-every", "500", "--time-budget-s", "570", "--compile"],
    target_budget=660,
    drafter=["--block-size", "16", "--num-layers", "2", "--steps", "3000", "--batch-size", "16",
             "--max-len", "1024", "--mask-token-id", "3", "--eval-every", "250"],
    drafter_budget=360,
)
SMOKE = dict(
    corpus=["--max-mb", "0.4"], corpus_budget=15,
    tokenizer=["--vocab-size", "512"], tokenizer_budget=15,
    target=["--preset", "smoke", "--steps", "30", "--batch-size", "8", "--seq-len", "64",
            "--eval-every", "10", "--device", "cpu"],
    target_budget=30,
    drafter=["--block-size", "4", "--num-layers", "1", "--steps", "2", "--batch-size", "2",
             "--max-len", "64", "--anchors-per-seq", "8", "--mask-token-id", "3",
             "--device", "cpu"],
    drafter_budget=45,
)


def _folder_bytes(path: Path) -> int:
    # Optimizer state (*.pt) stays behind when the weights ship.
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.suffix != ".pt")


def drafter_cli_available() -> bool:
    """True when `blockspec train-drafter` exists (it is built separately from this recipe)."""
    r = subprocess.run([sys.executable, "-m", "blockspec.cli", "train-drafter", "--help"],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return r.returncode == 0 and "--target" in r.stdout


def build(out: str | Path, smoke: bool = False, skip_drafter: bool = False) -> dict:
    plan = SMOKE if smoke else DEMO
    env = dict(os.environ)
    if smoke:
        # NOTE: smoke models are tiny; on a small shared CPU extra OpenMP threads only spin
        # against other processes (10x slower steps), so every stage runs on one thread.
        env["OMP_NUM_THREADS"] = "1"
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dirs = {k: out / k for k in ("corpus", "tokenizer", "target", "drafter")}
    record: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": "smoke" if smoke else "demo", "python": platform.python_version(),
        "stages": {},
    }
    t_all = time.perf_counter()

    def stage(name: str, module: str, fn, argv: list[str]) -> None:
        budget = plan[f"{name}_budget"]
        cmd = [sys.executable, "-m", module, *argv]
        print(f"== {name} (budget {budget}s): {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = fn(argv)
        if rc != 0:
            raise RuntimeError(f"stage {name} failed with exit code {rc}")
        secs = time.perf_counter() - t0
        over = " OVER BUDGET" if secs > budget else ""
        print(f"== {name}: {secs:.1f}s of {budget}s{over}", flush=True)
        record["stages"][name] = {"command": cmd[1:], "seconds": round(secs, 1),
                                  "budget_s": budget}

    stage("corpus", "blockspec.train.corpus", corpus.main,
          ["--out", str(dirs["corpus"]), *plan["corpus"]])
    stage("tokenizer", "blockspec.train.tokenizer", tokenizer.main,
          ["--corpus", str(dirs["corpus"]), "--out", str(dirs["tokenizer"]), *plan["tokenizer"]])
    stage("target", "blockspec.train.target", target.main,
          ["--corpus", str(dirs["corpus"]), "--tokenizer", str(dirs["tokenizer"]),
           "--out", str(dirs["target"]), *plan["target"]])
    record["corpus"] = json.loads((dirs["corpus"] / "MANIFEST.json").read_text())
    record["target"] = json.loads((dirs["target"] / "training.json").read_text())
    record["target"]["bytes"] = _folder_bytes(dirs["target"])

    if skip_drafter or not drafter_cli_available():
        msg = "skipped (--skip-drafter)" if skip_drafter else (
            "skipped: `blockspec train-drafter` is not available in this checkout")
        print(f"== drafter: {msg}", flush=True)
        record["stages"]["drafter"] = {"skipped": msg}
    else:
        cmd = [sys.executable, "-m", "blockspec.cli", "train-drafter", "--target",
               str(dirs["target"]), "--data", str(dirs["corpus"] / "train.jsonl"),
               "--out", str(dirs["drafter"]), *plan["drafter"]]
        budget = plan["drafter_budget"]
        print(f"== drafter (budget {budget}s): {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, env=env)
        secs = time.perf_counter() - t0
        print(f"== drafter: {secs:.1f}s of {budget}s{' OVER BUDGET' if secs > budget else ''}",
              flush=True)
        record["stages"]["drafter"] = {"command": cmd[1:], "seconds": round(secs, 1),
                                       "budget_s": budget}
        record["drafter"] = {"bytes": _folder_bytes(dirs["drafter"])}

    if smoke:
        torch.set_num_threads(threads)
    record["total_seconds"] = round(time.perf_counter() - t_all, 1)
    record["ship_bytes"] = record["target"]["bytes"] + record.get("drafter", {}).get("bytes", 0)
    # The manifest's per-file lists are not kept; counts, bytes and licences are.
    (out / "build_record.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"== total {record['total_seconds']:.0f}s; target {record['target']['params'] / 1e6:.2f}M"
          f" params; shipping {record['ship_bytes'] / 1e6:.1f} MB -> {out}", flush=True)
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run of every stage")
    ap.add_argument("--skip-drafter", action="store_true")
    a = ap.parse_args(argv)
    build(a.out, a.smoke, a.skip_drafter)
    return 0


if __name__ == "__main__":
    sys.exit(main())
