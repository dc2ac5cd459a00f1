"""Issue 24's run on two GPUs (nvidia-h200-x2): tensor and expert parallelism, correct and
scaling, in one call.

- Correctness (fp32, tiny Qwen3 and tiny DeepSeek-V3 with random DFlash drafters): `-tp 2` and
  `-tp 2 -ep 2` greedy tokens == one device's, with graphs and eagerly, and DFlash (fixed
  blocks, its whole step graph-captured with the collectives inside) == AR greedy.
- All-reduce: microseconds per all-reduce of a step's [tokens, 4096] bf16 activations between
  the two GPUs; a TP step of the Qwen3-8B shape runs two per layer.
- Scaling (bf16, dummy weights; `blockspec.bench.compare`, each config its own process):
  Qwen3-8B shape `-tp 1` vs `-tp 2`, AR and DFlash (adaptive, LABELLED synthetic a=0.86),
  C = 1, 8, 32, 128, 256; Moonlight-16B-A3B shape `-tp 2` vs `-tp 2 -ep 2`. Headline: the
  `-tp 2` AR batch-1 step (TPOT) over `-tp 1`'s and the per-GPU bytes floor; DFlash over AR per
  layout.

    python benchmarks/two_gpu.py --out-dir DIR            # two GPUs
    python benchmarks/two_gpu.py --out-dir DIR --smoke    # CPU: gloo ranks, tiny shapes
    python benchmarks/two_gpu.py --out-dir DIR --one-gpu  # the dry run while no -x2 is lent

`--one-gpu` runs what one GPU can of it: the correctness checks at `-tp 1` (graphs, eager and
DFlash against one device's eager AR tokens) and the scaling sweep's `-tp 1` configs (both
shapes, AR and DFlash): the two-GPU run's baselines. No all-reduce, no two-GPU headline.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from blockspec.bench.common import environment, recorded_command
from blockspec.bench.compare import comparison, configs, parse_layouts, run_configs
from blockspec.bench.fullsize import INPUT_LEN, write_folders
from blockspec.bench.moe_shapes import MOONLIGHT, write_moe_folders
from blockspec.bench.parallel_checks import allreduce_times, layout_tokens_match
from blockspec.bench.report import _levels
from blockspec.dflash.checkpoint import build_random_drafter
from blockspec.tiny import build_tiny_deepseek_v3, build_tiny_model


def correctness(root: Path, device: str, one_gpu: bool = False) -> dict:
    qwen = build_tiny_model(root / "qwen3")
    ds = build_tiny_deepseek_v3(root / "deepseek-v3", q_lora_rank=24, seed=3)
    dense_layouts, moe_layouts = ([(1, 1)], [(1, 1)]) if one_gpu else ([(2, 1)], [(2, 1), (2, 2)])
    return {
        "qwen3": layout_tokens_match(qwen, build_random_drafter(root / "qwen3-d", qwen,
                                                                num_layers=2, block_size=8),
                                     dense_layouts, device),
        "deepseek_v3": layout_tokens_match(ds, build_random_drafter(root / "ds-d", ds,
                                                                    num_layers=2, block_size=8),
                                           moe_layouts, device)}


def sweep(name: str, target: Path, drafter: Path, layouts: str, common: list[str],
          out: Path) -> dict:
    """Each layout AR and DFlash (a=0.86) on one shape, into out/name."""
    (out / name).mkdir(parents=True, exist_ok=True)
    plan = configs(parse_layouts(layouts), "both", str(drafter), 0.86)
    results, failed = run_configs(plan, ["--model", str(target), *common], out / name)
    (out / name / "compare.md").write_text(comparison(results) if results else "")
    return {"results": results, "failed": failed}


def ratios(results: dict) -> dict:
    """DFlash over AR of the same layout, per concurrency."""
    out = {}
    for n, r in results.items():
        ar = results.get(n.replace("_dflash", "_ar"))
        if n.endswith("_dflash") and ar:
            a, s = _levels(ar), _levels(r)
            out[n.removesuffix("_dflash")] = {c: s[c]["output_tok_s"] / a[c]["output_tok_s"]
                                              for c in a if c in s}
    return out


def b1_step(results: dict, name: str) -> float | None:
    lv = _levels(results[name]).get(1) if name in results else None
    return (lv.get("tpot_ms") or {}).get("median") if lv else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU: gloo ranks, tiny shapes")
    ap.add_argument("--one-gpu", action="store_true",
                    help="the -tp 1 half on one GPU (a dry run: no all-reduce, no headline)")
    ap.add_argument("--skip-scaling", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke and a.one_gpu:
        ap.error("--smoke and --one-gpu are two different dry runs: pick one")
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if a.smoke else "cuda"
    res: dict = {"benchmark": "two_gpu", "command": recorded_command("benchmarks/two_gpu.py"),
                 "environment": environment(), "smoke": a.smoke, "one_gpu": a.one_gpu}
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        res["correctness"] = correctness(root, device, a.one_gpu)
        if not a.one_gpu:
            res["allreduce_us"] = allreduce_times(device, 64 if a.smoke else 4096,
                                                  [1, 8] if a.smoke else [1, 8, 32, 128, 256])
        if not a.skip_scaling:
            res.update(scaling(root, out, a.smoke, a.one_gpu))
    (out / "two_gpu.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "environment"}, indent=1,
                     default=str)[:4000])
    ok = res["correctness"]["qwen3"]["all_equal"] and res["correctness"]["deepseek_v3"][
        "all_equal"]
    return 0 if ok else 1


def scaling(root: Path, out: Path, smoke: bool, one_gpu: bool = False) -> dict:
    if smoke:
        dense = build_tiny_model(root / "dense")
        dense_d = build_random_drafter(root / "dense-d", dense, num_layers=1, block_size=8)
        moe = build_tiny_deepseek_v3(root / "moe", seed=1)
        moe_d = build_random_drafter(root / "moe-d", moe, num_layers=1, block_size=8)
        common = ["--device", "cpu", "--input-len", "16", "--concurrency", "1,2",
                  "--num-prompts", "2", "--num-kv-blocks", "64", "--warmup-tokens", "0",
                  "--output-len", "8"]
    else:
        dense, dense_d = write_folders(root / "qwen3-8b")
        moe, moe_d = write_moe_folders(root, "moonlight-16b-a3b-shape", MOONLIGHT,
                                       draft_layers=4, block_size=16)
        common = ["--load-format", "dummy", "--input-len", str(INPUT_LEN),
                  "--concurrency", "1,8,32,128,256", "--output-len", "256"]
    common += ["--dataset", "random", "--ignore-eos", "--no-prefix-caching"]
    q = sweep("qwen3_8b", dense, dense_d, "tp1" if one_gpu else "tp1,tp2", common, out)
    m = sweep("moonlight", moe, moe_d, "tp1" if one_gpu else "tp2,ep2", common, out)
    tp1, tp2 = b1_step(q["results"], "tp1_ar"), b1_step(q["results"], "tp2_ar")
    spec = {**{f"qwen3_8b_{k}": v for k, v in ratios(q["results"]).items()},
            **{f"moonlight_{k}": v for k, v in ratios(m["results"]).items()}}
    if one_gpu:  # the baselines only: no -tp 2 to set them against
        return {"scaling": {"failed": q["failed"] + m["failed"], "dflash_over_ar": spec,
                            "ar_b1_tpot_ms": {"tp1": tp1,
                                              "moonlight_tp1": b1_step(m["results"], "tp1_ar")},
                            "tp1_bytes_floor_ms": 2 * floor_ms(dense)}}
    mins = [min(v.values()) for k, v in spec.items() if v and not k.endswith("tp1")]
    return {"scaling": {"failed": q["failed"] + m["failed"], "dflash_over_ar": spec,
                        "ar_b1_tpot_ms": {"tp1": tp1, "tp2": tp2}},
            "headline": {"tp2_ar_b1_step_ratio": tp2 / tp1 if tp1 and tp2 else None,
                         "tp2_adaptive_min_ratio_vs_ar": min(mins) if mins else None,
                         "per_gpu_bytes_floor_ms": None if smoke else floor_ms(dense)}}


def floor_ms(target: Path) -> float | None:
    """The -tp 2 batch-1 step's floor: half the target's weight bytes (bf16, less the embedding
    table, which a step gathers a row of) at this GPU's measured copy bandwidth."""
    from blockspec.bench.gpu_timing import copy_bandwidth
    from blockspec.config import ModelConfig
    from blockspec.models.loader import build_model

    model = build_model(ModelConfig.from_pretrained(target), torch.bfloat16, "meta")
    n = sum(p.numel() for k, p in model.named_parameters() if "embed_tokens" not in k)
    return 1e3 * (2 * n / 2) / copy_bandwidth()


if __name__ == "__main__":
    raise SystemExit(main())
