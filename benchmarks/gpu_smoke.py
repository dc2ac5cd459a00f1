"""GPU smoke run of the core engine with the torch reference attention backend (issue 2).

Checks on CUDA, then records to benchmarks/results/gpu_smoke.json (or --out):
  1. greedy output equals HF transformers `generate` on a tiny random Qwen3 and Llama (fp32);
  2. 16 batched prompts with forced preemption equal one-at-a-time generation (fp32);
  3. bf16 generation runs and produces text;
  4. eager decode throughput of a Qwen3-8B-shaped model with random weights (`load_format=dummy`),
     batch 1 and 32, torch reference backend, no CUDA graphs. A baseline, not a target.

Usage: python benchmarks/gpu_smoke.py [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from blockspec import LLM, SamplingParams
from blockspec.bench.common import git_commit
from blockspec.bench.fullsize import QWEN3_8B
from blockspec.tiny import build_tiny_model


def hf_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    outs = []
    for ids in prompts:
        x = torch.tensor([ids], device="cuda")
        y = hf.generate(x, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(y[0, len(ids):].tolist())
    del hf
    return outs


def check_tiny(tmp: Path, report: dict) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for arch in ("qwen3", "llama"):
        path = build_tiny_model(tmp / arch, arch=arch)
        llm = LLM(str(path), device="cuda", dtype="float32", num_kv_blocks=256)
        prompts = [torch.randint(1, 500, (int(n),), generator=g).tolist() for n in (5, 37, 90)]
        ours = [o.token_ids for o in llm.generate(prompts, greedy)]
        ref = hf_greedy(path, prompts, 48)
        report[f"hf_match_{arch}"] = ours == ref
        print(f"[tiny {arch}] greedy == HF generate on CUDA: {ours == ref}")
        del llm

    path = tmp / "qwen3"
    prompts = [torch.randint(1, 500, (5 + 7 * i,), generator=g).tolist() for i in range(16)]
    solo = LLM(str(path), device="cuda", dtype="float32", num_kv_blocks=512)
    alone = [solo.generate([p], greedy, use_tqdm=False)[0].token_ids for p in prompts]
    del solo
    small = LLM(str(path), device="cuda", dtype="float32", num_kv_blocks=40)
    batched = [o.token_ids for o in small.generate(prompts, greedy)]
    bm = small.engine.block_manager
    report["preemption_batch_match"] = batched == alone
    report["preemptions"] = small.engine.scheduler.num_preemptions
    report["kv_blocks_leaked"] = bm.num_used_blocks
    print(f"[tiny qwen3] 16 prompts batched ({report['preemptions']} preemptions) == alone: "
          f"{batched == alone}; leaked blocks: {bm.num_used_blocks}")
    del small

    bf16 = LLM(str(path), device="cuda", dtype="bfloat16")
    out = bf16.generate("def fibonacci(n):", SamplingParams(temperature=0.8, seed=1,
                                                          max_tokens=32))[0]
    report["bf16_sample"] = {"text": out.text, "num_tokens": len(out.token_ids)}
    print(f"[tiny qwen3 bf16] {out.text!r}")
    del bf16


def decode_throughput(tmp: Path, report: dict) -> None:
    folder = tmp / "qwen3-8b-shape"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_8B))
    # Any tokenizer will do for token-id prompts; reuse the tiny one.
    for f in (tmp / "qwen3").glob("tokenizer*"):
        (folder / f.name).write_bytes(f.read_bytes())
    llm = LLM(str(folder), device="cuda", dtype="bfloat16", load_format="dummy",
              kv_cache_memory_gb=40)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    results = {}
    for batch in (1, 32):
        prompts = [torch.randint(0, 151000, (512,), generator=g).tolist() for _ in range(batch)]
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        tpot = sum(o.metrics.tpot for o in outs) / len(outs)
        results[f"C={batch}"] = {"output_tok_s": tokens / dt, "mean_tpot_ms": tpot * 1e3,
                                 "elapsed_s": dt}
        print(f"[qwen3-8b shape, eager torch backend] C={batch}: {tokens / dt:.1f} output tok/s, "
              f"TPOT {tpot * 1e3:.2f} ms")
    report["qwen3_8b_shape_eager_torch_backend"] = results
    report["qwen3_8b_shape_kv_blocks"] = llm.engine.block_manager.num_blocks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/gpu_smoke.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    report = {
        "benchmark": "gpu_smoke (issue 2): core engine, torch reference attention backend",
        "command": "python benchmarks/gpu_smoke.py --out " + args.out,
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    with tempfile.TemporaryDirectory() as d:
        check_tiny(Path(d), report)
        decode_throughput(Path(d), report)
    ok = report["hf_match_qwen3"] and report["hf_match_llama"] and report[
        "preemption_batch_match"] and report["kv_blocks_leaked"] == 0
    report["all_checks_passed"] = bool(ok)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
