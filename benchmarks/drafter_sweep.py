"""Drafter recipe sweep for the demo target (issue 6), one device call.

Rebuilds the corpus, regenerates drafter data with the target (`generate-data`, time-boxed, one
process per GPU with its own seed), then trains the drafter variants IN PARALLEL (variant i on GPU
i mod --gpus; variants sharing a GPU share its time), each `train-drafter` with the same time
budget, and measures each with `eval-acceptance` on the shared code prompts (greedy, block 16).
Writes OUT/sweep.json (commands, seconds, steps, tau per variant), OUT/best.txt (the variant
with the highest tau) and bf16 ship copies of every drafter under OUT/ship/<variant>.

Usage: python benchmarks/drafter_sweep.py --out OUT [--target blockspec/demo_pair/target]
           [--variants base,init,...] [--gen-seconds 90] [--train-seconds 300]
       python benchmarks/drafter_sweep.py --out OUT --smoke   (CPU, tiny, < 2 min)
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from blockspec.bench.common import git_commit
from blockspec.bench.demo_recipe import CODE_PROMPTS, PROFILES, ROOT, override_flags, ship_folder

# Overrides of the demo recipe's drafter arguments (demo_recipe.PROFILES["full"]).
VARIANTS: dict[str, list[str]] = {
    "base": [],
    "init": ["--init-from-target"],
    "lr3e-3": ["--lr", "3e-3"],
    "l3init": ["--num-layers", "3", "--init-from-target"],
    "l1": ["--num-layers", "1"],
    "l3": ["--num-layers", "3"],
    "l4": ["--num-layers", "4"],
    "l4init": ["--num-layers", "4", "--init-from-target"],
}


# Trainer start-up (target load, flex check and compile), final eval and save, then one
# eval-acceptance per GPU: what a deadline keeps back from training.
DEADLINE_RESERVE_S = 100


def _drafter_args(smoke: bool, seconds: int) -> list[str]:
    args = list(PROFILES["smoke" if smoke else "full"]["drafter"])
    return override_flags(args, ["--time-budget-s", str(seconds)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--target", default=str(ROOT / "blockspec" / "demo_pair" / "target"))
    ap.add_argument("--variants", default="base,init,l3init")
    ap.add_argument("--gen-samples", type=int, default=32768)
    ap.add_argument("--gen-seconds", type=int, default=90)
    ap.add_argument("--train-seconds", type=int, default=300)
    ap.add_argument("--corpus-mb", type=float, default=120, help="corpus size (prompt source)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="finish within this many seconds of the start: training gets what the "
                         "data stage leaves, minus a reserve for start-up and the evals")
    ap.add_argument("--gpus", type=int, default=None, help="default: every visible GPU")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    gpus = max(1, a.gpus or torch.cuda.device_count())
    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if a.smoke:
        env["OMP_NUM_THREADS"] = "1"
    record: dict = {
        "benchmark": "drafter_sweep (issue 6): drafter recipe variants for the demo target",
        "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "python": platform.python_version(), "torch": torch.__version__,
        "target": a.target, "gpus": 0 if a.smoke else gpus, "commit": git_commit(),
        "stages": {}, "variants": {},
    }

    def on_gpu(i: int) -> dict:
        """Environment of a process pinned to GPU i mod gpus."""
        return env if a.smoke else {**env, "CUDA_VISIBLE_DEVICES": str(i % gpus)}

    def save() -> None:
        (out / "sweep.json").write_text(json.dumps(record, indent=1) + "\n")

    def run(name: str, argv_: list[str]) -> None:
        print(f"== {name}: {' '.join(argv_)}", flush=True)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, *argv_], check=True, env=env, cwd=ROOT)
        record["stages"][name] = {"command": argv_, "seconds": round(time.perf_counter() - t0, 1)}
        print(f"== {name}: {record['stages'][name]['seconds']}s", flush=True)
        save()

    corpus = out / "corpus"
    run("corpus", ["-m", "blockspec.train.corpus", "--out", str(corpus),
                   *(["--max-mb", "0.4"] if a.smoke else
                     ["--all-permissive", "--max-mb", str(a.corpus_mb)])])
    gen = ["--prompt-tokens", "64", "--max-tokens", "256", "--max-num-seqs", "512",
           "--time-budget-s", str(a.gen_seconds)]
    if a.smoke:
        gen = ["--prompt-tokens", "16", "--max-tokens", "24", "--device", "cpu",
               "--max-model-len", "128"]
    parts = 1 if a.smoke else gpus
    per_part = 8 if a.smoke else -(-a.gen_samples // parts)
    data = [out / "gen" / f"target_outputs_{k}.jsonl" for k in range(parts)]
    cmds = [["-m", "blockspec.cli", "generate-data", "--model", a.target, "--data",
             str(corpus / "train.jsonl"), "--out", str(f), "--num-samples", str(per_part),
             "--seed", str(k), *gen] for k, f in enumerate(data)]
    print(f"== gen: {parts} x {' '.join(cmds[0])}", flush=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(parts) as pool:
        list(pool.map(lambda kc: subprocess.run([sys.executable, *kc[1]], check=True,
                                                env=on_gpu(kc[0]), cwd=ROOT), enumerate(cmds)))
    record["stages"]["gen"] = {"commands": cmds, "seconds": round(time.perf_counter() - t0, 1)}
    record["gen_rows"] = sum(sum(1 for _ in f.open()) for f in data)
    save()

    # All variants at once, each with the same time budget.
    train_seconds = a.train_seconds
    if a.deadline_s:
        left = a.deadline_s - (time.perf_counter() - t_start) - DEADLINE_RESERVE_S
        train_seconds = max(10, min(train_seconds, int(left)))
    record["train_seconds"] = train_seconds
    procs = {}
    t0 = time.perf_counter()
    for i, name in enumerate(names):
        args = override_flags(_drafter_args(a.smoke, train_seconds), VARIANTS[name])
        cmd = ["-m", "blockspec.cli", "train-drafter", "--target", a.target, "--data",
               *map(str, data), "--out", str(out / "drafters" / name), *args]
        record["variants"][name] = {"train_command": cmd, "gpu": i % gpus}
        log = (out / f"train_{name}.log").open("w")
        procs[name] = (subprocess.Popen([sys.executable, *cmd], env=on_gpu(i), cwd=ROOT,
                                        stdout=log, stderr=subprocess.STDOUT), log)
    save()  # NOTE: the commands are on record even if the call's time runs out mid-training
    for name, (p, log) in procs.items():
        rc = p.wait()
        log.close()
        record["variants"][name]["train_rc"] = rc
    record["stages"]["train_parallel"] = {"seconds": round(time.perf_counter() - t0, 1)}
    save()

    def evaluate(i: int, name: str) -> None:
        v = record["variants"][name]
        if v["train_rc"] != 0:
            return
        res = out / f"eval_{name}.json"
        cmd = ["-m", "blockspec.cli", "eval-acceptance", "--model", a.target, "--draft",
               str(out / "drafters" / name), "--prompts", str(CODE_PROMPTS), "--block-size",
               "16" if not a.smoke else "4", "--max-tokens", "256" if not a.smoke else "8",
               "--out", str(res), *(["--num-prompts", "2", "--device", "cpu"] if a.smoke else [])]
        v["eval_command"] = cmd
        p = subprocess.run([sys.executable, *cmd], env=on_gpu(i), cwd=ROOT, capture_output=True)
        if p.returncode != 0:
            v["eval_error"] = p.stderr.decode()[-2000:]
            return
        ev = json.loads(res.read_text())
        v["tau_code"] = ev["mean_acceptance_length"]
        v["acceptance_rate_per_position"] = ev["acceptance_rate_per_position"]
        state = out / "drafters" / name / "training_state.pt"
        if state.is_file():
            st = torch.load(state, map_location="cpu", weights_only=True)
            v["train_steps"], v["train_seconds"] = st["step"], round(st["elapsed"], 1)
        ship_folder(out / "drafters" / name, out / "ship" / name)
        print(f"== {name}: tau {v['tau_code']:.3f} after {v.get('train_steps')} steps",
              flush=True)

    # NOTE: one engine per GPU at a time: each sizes its KV cache from the free GPU memory.
    by_gpu: dict[int, list[tuple[int, str]]] = {}
    for i, name in enumerate(names):
        by_gpu.setdefault(0 if a.smoke else i % gpus, []).append((i, name))
    with ThreadPoolExecutor(len(by_gpu)) as pool:
        list(pool.map(lambda jobs: [evaluate(i, n) for i, n in jobs], by_gpu.values()))
    scored = {n: v["tau_code"] for n, v in record["variants"].items() if "tau_code" in v}
    if scored:
        record["best"] = max(scored, key=scored.get)
        (out / "best.txt").write_text(record["best"] + "\n")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
