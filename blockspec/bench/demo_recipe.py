"""The demo pair's build recipe (benchmarks/build_demo_pair.py, benchmarks/drafter_sweep.py):
each profile's stage arguments and time budgets, flag overrides of a stage's arguments, and
shipping a model folder (bf16 weights, no optimizer state)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

__all__ = ["CODE_PROMPTS", "PROFILES", "ROOT", "override_flags", "ship_folder"]

ROOT = Path(__file__).resolve().parents[2]
CODE_PROMPTS = ROOT / "benchmarks" / "prompts" / "code.jsonl"  # copy of ../shared/prompts


def _profile(corpus_mb: float, tok_mb: float, target_s: int, samples: int, gen_s: int,
             drafter_s: int) -> dict:
    return dict(
        corpus=["--all-permissive", "--max-mb", str(corpus_mb)], corpus_budget=30,
        tokenizer=["--vocab-size", "8192", "--max-train-mb", str(tok_mb)], tokenizer_budget=30,
        target=["--preset", "demo", "--steps", "100000", "--batch-size", "64", "--seq-len", "1024",
                "--lr", "1.5e-3", "--eval-every", "500", "--time-budget-s", str(target_s)],
        target_budget=target_s + 60,
        gen=["--num-samples", str(samples), "--prompt-tokens", "64", "--max-tokens", "256",
             "--max-num-seqs", "512", "--time-budget-s", str(gen_s)], gen_budget=gen_s + 45,
        # NOTE: the recipe that won benchmarks/results/drafter_sweep_2026-11-30: 4 layers started
        # from the target's last 4, FlexAttention training on CUDA (--attention auto).
        drafter=["--block-size", "16", "--num-layers", "4", "--init-from-target", "--steps",
                 "100000", "--batch-size", "16", "--max-len", "1024", "--anchor-chunk", "4096",
                 "--mask-token-id", "3", "--eval-every", "100", "--save-every", "250", "--lr",
                 "1e-3", "--time-budget-s", str(drafter_s)],
        drafter_budget=drafter_s + 40,
        eval=["--block-size", "16", "--max-tokens", "256"], eval_budget=40,
    )


PROFILES = {
    "full": _profile(250, 64, 400, 16384, 100, 450),
    "onecall": _profile(120, 16, 150, 8192, 60, 200),
    "smoke": dict(
        corpus=["--max-mb", "0.4"], corpus_budget=15,
        tokenizer=["--vocab-size", "512"], tokenizer_budget=15,
        target=["--preset", "smoke", "--steps", "30", "--batch-size", "8", "--seq-len", "64",
                "--eval-every", "10", "--device", "cpu"], target_budget=30,
        gen=["--num-samples", "8", "--prompt-tokens", "16", "--max-tokens", "24",
             "--device", "cpu", "--max-model-len", "128"], gen_budget=30,
        drafter=["--block-size", "4", "--num-layers", "1", "--steps", "2", "--batch-size", "2",
                 "--max-len", "64", "--anchors-per-seq", "8", "--mask-token-id", "3",
                 "--device", "cpu"], drafter_budget=45,
        eval=["--block-size", "4", "--max-tokens", "8", "--num-prompts", "2", "--device", "cpu"],
        eval_budget=30,
    ),
}


def override_flags(args: list[str], extra: list[str]) -> list[str]:
    """A copy of `args` where each flag of `extra` (with one value, or a switch) replaces the same
    flag, or is appended."""
    out = list(args)
    i = 0
    while i < len(extra):
        flag = extra[i]
        has_value = i + 1 < len(extra) and not extra[i + 1].startswith("--")
        if flag in out:
            j = out.index(flag)
            if has_value:
                out[j + 1] = extra[i + 1]
        else:
            out += [flag, extra[i + 1]] if has_value else [flag]
        i += 2 if has_value else 1
    return out


def ship_folder(src: Path, dst: Path) -> None:
    """Copy a model folder without optimizer state, weights cast to bf16 (the engine casts to
    its own dtype on load, so shipping fp32 would only double the package)."""
    from safetensors.torch import load_file, save_file

    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".pt":
            shutil.copy2(f, dst / f.name)
    w = dst / "model.safetensors"
    tensors = load_file(str(w))
    if any(t.dtype == torch.float32 for t in tensors.values()):
        save_file({k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
                   for k, v in tensors.items()}, str(w), metadata={"format": "pt"})
        cfg = json.loads((dst / "config.json").read_text())
        cfg["torch_dtype"] = "bfloat16"
        (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
