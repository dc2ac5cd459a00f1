"""Seeded speculative sampling against autoregressive sampling on a GPU (issue 19).

The demo pair, default engine (adaptive policy, CUDA graphs), the code prompts: every request
seeded, at C=1 (each prompt alone) and C=16 (all at once), greedy and sampled. In fp32 the
speculative engine must give the autoregressive tokens; in bf16 a verify block runs GEMMs of other
shapes than a decode step, so a near-tie can round the other way: the fraction of identical
sequences is reported next to greedy's (the same rounding effect) and next to AR at C=16 vs AR at
C=1 (batching changes the GEMM shapes too).

    python benchmarks/seeded_sampling.py --out-dir DIR          # one GPU, ~2 minutes
    python benchmarks/seeded_sampling.py --out-dir DIR --smoke  # CPU, fewer tokens
"""

from __future__ import annotations

import argparse
import datetime

import torch

from blockspec import LLM, SamplingParams
from blockspec.bench.common import git_commit, recorded_command, write_json
from blockspec.bench.datasets import completion_prompt, load_jsonl
from blockspec.demo import demo_drafter, demo_target

MODES = {
    "greedy": lambda i, n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
    "sampled": lambda i, n: SamplingParams(temperature=(0.8, 1.0)[i % 2], top_p=0.95,
                                           top_k=(-1, 50)[i % 2], seed=1000 + i, max_tokens=n,
                                           ignore_eos=True),
}


def run(llm: LLM, prompts: list[str], params: list[SamplingParams], alone: bool) -> list[list]:
    if alone:
        return [llm.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts,
                                                                                 params)]
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    same = [x == y for x, y in zip(a, b)]
    first = [next((k for k, (s, t) in enumerate(zip(x, y)) if s != t), None)
             for x, y in zip(a, b)]
    return {"identical": sum(same), "of": len(same), "fraction": sum(same) / len(same),
            "first_divergence": [f for f in first if f is not None]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    n_out = 16 if args.smoke else args.output_len
    n_prompts = 4 if args.smoke else args.num_prompts
    prompts = [completion_prompt(s) for s in load_jsonl("benchmarks/prompts/code.jsonl")]
    prompts = prompts[:n_prompts]
    res = {"benchmark": "seeded_sampling: speculative vs autoregressive, same seeds",
           "command": recorded_command("benchmarks/seeded_sampling.py"),
           "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__, "commit": git_commit(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "model": "demo pair (target + DFlash drafter, block 16), adaptive policy",
           "num_prompts": len(prompts), "output_len": n_out, "results": {}}
    for dtype in ("float32", "bfloat16"):
        kw = dict(device=device, dtype=dtype, enable_prefix_caching=False)
        # NOTE: both engines live at once: each gets a fixed KV budget, not 90% of the GPU
        kw.update(num_kv_blocks=256) if device == "cpu" else kw.update(kv_cache_memory_gb=8.0)
        ar = LLM(str(demo_target()), draft="none", **kw)
        spec = LLM(str(demo_target()), draft=str(demo_drafter()), **kw)
        for mode, make in MODES.items():
            params = [make(i, n_out) for i in range(len(prompts))]
            outs = {(name, c): run(llm, prompts, params, alone=c == 1)
                    for name, llm in (("ar", ar), ("spec", spec)) for c in (1, 16)}
            cell = {f"C={c}": compare(outs[("ar", c)], outs[("spec", c)]) for c in (1, 16)}
            cell["ar_C16_vs_C1"] = compare(outs[("ar", 1)], outs[("ar", 16)])
            cell["spec_acceptance_length"] = spec.engine.spec_stats.mean_acceptance_length
            res["results"][f"{dtype}/{mode}"] = cell
            print(f"{dtype:9s} {mode:8s} spec == AR: C=1 {cell['C=1']['identical']}/"
                  f"{cell['C=1']['of']}, C=16 {cell['C=16']['identical']}/{cell['C=16']['of']};"
                  f" AR C=16 == AR C=1: {cell['ar_C16_vs_C1']['identical']}/"
                  f"{cell['ar_C16_vs_C1']['of']}; tau {cell['spec_acceptance_length']:.2f}",
                  flush=True)
        del ar, spec
        if device == "cuda":
            torch.cuda.empty_cache()
    write_json(args.out_dir, "seeded_sampling.json", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
