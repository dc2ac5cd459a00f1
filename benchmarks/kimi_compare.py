"""Issue 25's comparison: Kimi K2.6's text shape (61 layers, MLA, 384 INT4 experts top 8 + 1
shared; dummy weights) with its published drafter's shape (6 layers, block 8, target layers
1/12/24/35/47/58, mask 163838) over parallel layouts (default TP8, EP8, EP4x2), each AR and with
DFlash (adaptive) at the LABELLED synthetic acceptances (default: the a whose block of 8 commits
3.8 tokens, the deployment's acceptance length, and 0.86). Every config is `blockspec bench
offline` in its own process (`blockspec.bench.compare`); the table sets each against the best AR
layout at every C, and the summary adds the bytes model's C=1 prediction for the block the
adaptive engine chose.

    python benchmarks/kimi_compare.py --out-dir DIR            # 8 GPUs (nvidia-h200-x8)
    python benchmarks/kimi_compare.py --out-dir DIR --smoke    # CPU, a tiny shape, gloo ranks
    python benchmarks/kimi_compare.py --out-dir DIR --layouts tp1 --moe-layers 5  # one GPU

`--moe-layers N` cuts the target to its first N + 1 layers (the dense one, then N MoE layers: 5
fit an 80 GB GPU with the drafter) for a dry run on fewer GPUs; the drafter then reads target
layers spread over the cut (the published ids need 59), and the bytes model counts the cut's
own weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from blockspec.bench.common import environment, recorded_command
from blockspec.bench.compare import (
    acceptance_for_length,
    best_plain,
    configs,
    parse_layouts,
    run_configs,
    write_comparison,
)
from blockspec.bench.moe_shapes import (
    KIMI_DRAFTER,
    KIMI_INT4,
    distinct_experts,
    kimi_k26,
    kimi_slice,
    write_moe_folders,
)
from blockspec.bench.report import _levels

DEPLOYMENT_TAU = 3.8
# DESIGN.md, "MoE targets": Kimi K2.6's bytes per step outside the routed experts (bf16) and
# per selected expert over its 60 MoE layers (INT4 + group-32 scales).
DENSE_GB, EXPERT_GB = 23.0, 60 * 3 * 7168 * 2048 * (0.5 + 2 / 32) / 1e9


def bytes_model_c1(tau: float, block: int, dense_gb: float = DENSE_GB,
                   expert_gb: float = EXPERT_GB) -> float:
    """DFlash / AR at batch 1 by the bytes a step reads under uniform routing (the drafter's
    own bytes left out: an upper bound); `expert_gb`: one selected expert over all MoE layers."""
    def step(t: int) -> float:
        return dense_gb + expert_gb * distinct_experts(384, 8, t)
    return tau / (step(block) / step(1))


def cut_gb(target: Path) -> tuple[float, float]:
    """(bytes outside the routed experts, one expert over the MoE layers) of a cut target, in
    GB, from its own parameters (built on the meta device: no memory)."""
    import torch

    from blockspec.bench.moe_shapes import expert_bytes
    from blockspec.config import ModelConfig
    from blockspec.models.loader import build_model

    parts = expert_bytes(build_model(ModelConfig.from_pretrained(target), torch.bfloat16, "meta"))
    return parts["dense"] / 1e9, parts["per_expert"] * parts["moe_layers"] / 1e9


def smoke_shape() -> dict:
    """A tiny DeepSeek-V3 shape with INT4 experts: every code path of the full run, on CPU."""
    shape = kimi_k26()
    shape.update(hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                 n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, vocab_size=163840)
    return shape


def chosen_block(level: dict) -> int:
    """The block length whose steps committed the most tokens in a level (1: plain)."""
    cells = {int(k.split("/")[1]): v["tokens"] for k, v in (level.get("step_mix") or {}).items()
             if k.split("/")[1] != "0"}
    return max(cells, key=cells.get) if cells else 1


def headline(results: dict, acceptances: list[float],
             gb: tuple[float, float] = (DENSE_GB, EXPERT_GB)) -> dict:
    """Per acceptance: DFlash's best layout over the best AR at C=1, its minimum over C, and the
    bytes model's C=1 prediction for the block it chose."""
    best = {c: tok for c, (tok, _) in sorted(best_plain(results).items())}
    out = {}
    for a in acceptances:
        spec = [r for n, r in results.items() if n.endswith(f"_a{a:g}")]
        if not spec or not best:
            continue
        ratios = {c: max(_levels(r)[c]["output_tok_s"] for r in spec if c in _levels(r)) / t
                  for c, t in best.items()}
        first = min(best)
        c1 = max(spec, key=lambda r: _levels(r)[first]["output_tok_s"])
        block = chosen_block(_levels(c1)[first])
        tau = (_levels(c1)[first].get("acceptance") or {}).get("mean_acceptance_length") or 1.0
        out[f"a{a:g}"] = {"dflash_c1_vs_best_ar": ratios[first], "min_ratio_vs_best_ar":
                          min(ratios.values()), "by_concurrency": ratios, "c1_block": block,
                          "c1_tau": tau, "bytes_model_c1": bytes_model_c1(tau, block, *gb)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--layouts", default=None, help="default tp8,ep8,ep4x2 (smoke: tp1,tp2)")
    ap.add_argument("--concurrency", default=None,
                    help="default 1,2,4,8,16,32,64,128,256 (smoke: 1,2)")
    ap.add_argument("--acceptances", default="auto,0.86",
                    help=f"synthetic a per DFlash row; auto: block 8 commits {DEPLOYMENT_TAU}")
    ap.add_argument("--moe-layers", type=int, default=None,
                    help="cut the target to the dense layer + N MoE layers (a dry run)")
    ap.add_argument("--smoke", action="store_true", help="CPU: a tiny shape over gloo ranks")
    a = ap.parse_args(argv)
    if a.moe_layers is not None and (a.smoke or a.moe_layers < 1):
        ap.error("--moe-layers takes N >= 1, and not with --smoke (its shape is tiny already)")
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    block = KIMI_DRAFTER["block_size"]
    accs = [acceptance_for_length(DEPLOYMENT_TAU, block) if x.strip() == "auto" else float(x)
            for x in a.acceptances.split(",")]
    layouts = parse_layouts(a.layouts or ("tp1,tp2" if a.smoke else "tp8,ep8,ep4x2"))
    conc = a.concurrency or ("1,2" if a.smoke else "1,2,4,8,16,32,64,128,256")
    with tempfile.TemporaryDirectory() as d:
        full = not a.smoke and a.moe_layers is None
        ids = KIMI_DRAFTER["target_layer_ids"] if full else None
        shape = smoke_shape() if a.smoke else kimi_k26()
        if a.moe_layers is not None:
            shape = {**kimi_slice(a.moe_layers), "quantization_config": KIMI_INT4}
        target, drafter = write_moe_folders(
            Path(d), "kimi-k2.6-shape", shape, 1 if a.smoke else KIMI_DRAFTER["draft_layers"],
            block, ids)
        gb = (DENSE_GB, EXPERT_GB) if a.moe_layers is None else cut_gb(target)
        plan = configs(layouts, "off", None)
        for acc in accs:
            plan += [(f"{n}_a{acc:g}", f"{lab} [SYNTHETIC acceptance a={acc:g}]", flags)
                     for n, lab, flags in configs(layouts, "on", str(drafter), acc)]
        common = ["--model", str(target), "--load-format", "dummy", "--dataset", "random",
                  "--input-len", "16" if a.smoke else "512", "--concurrency", conc,
                  "--output-len", "8" if a.smoke else "256", "--ignore-eos",
                  "--no-prefix-caching"]
        if a.smoke:
            common += ["--device", "cpu", "--num-kv-blocks", "64", "--num-prompts", "2",
                       "--warmup-tokens", "0", "--dtype", "float32"]
        results, failed = run_configs(plan, common, out)
    if not results:
        print("every config failed", file=sys.stderr)
        return 1
    print(write_comparison(results, out))
    summary = {"benchmark": "kimi_compare", "command": recorded_command(
        "benchmarks/kimi_compare.py"), "environment": environment(), "smoke": a.smoke,
        "moe_layers": a.moe_layers or shape.get("num_hidden_layers", 1) - 1, "bytes_gb": gb,
        "acceptances": accs, "failed": failed, "headline": headline(results, accs, gb)}
    (out / "kimi_compare.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["headline"], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
