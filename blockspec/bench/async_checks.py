"""GPU checks of async scheduling with a drafter (engine/pipeline.py, PendingSpec): speculative
steps launched ahead, their inputs computed on the device inside the graphed path, give the
synchronous engine's tokens. Run by benchmarks/gpu_checks.py.

- the demo pair (a trained drafter: real, varying acceptance), fp32, fixed block 16, greedy,
  code prompts: async == sync token for token;
- a tiny random Qwen3 with the LABELLED synthetic acceptance a = 0.6 (benchmark-only mode; the
  accepted counts vary by design), fixed block 8, fp32: async == sync, one request per engine
  (a batch's draws follow its rows, and the async engine keeps a finishing request in the batch
  one step longer, which shifts later rows' draws);
each with the steps launched ahead counted (the check fails if none ran ahead).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from blockspec import LLM, SamplingParams
from blockspec.bench.datasets import completion_prompt, load_jsonl
from blockspec.dflash.checkpoint import build_random_drafter
from blockspec.tiny import build_tiny_model

DEMO = Path(__file__).resolve().parents[1] / "demo_pair"
CODE_PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts" / "code.jsonl"


def _tokens(model: Path, prompts: list, params: SamplingParams, kw: dict[str, Any]
            ) -> tuple[list[list[int]], dict[str, Any]]:
    llm = LLM(str(model), **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    eng = llm.engine
    assert eng.block_manager.num_used_blocks == 0, "leaked KV blocks"
    info = {"steps_by_path": dict(eng.runner.path_steps),
            "mean_acceptance_length": eng.spec_stats.mean_acceptance_length}
    return [o.token_ids for o in outs], info


def _pair(name: str, model: Path, prompts: list, params: SamplingParams,
          kw: dict[str, Any], report: dict[str, Any]) -> bool:
    sync, sync_info = _tokens(model, prompts, params, {**kw, "async_scheduling": False})
    got, info = _tokens(model, prompts, params, {**kw, "async_scheduling": True})
    ahead = info["steps_by_path"].get("ahead", 0)
    ok = got == sync and ahead > 0
    report[name] = {"async_equals_sync": got == sync, "steps_ahead": ahead,
                    "sync": sync_info, "async": info}
    print(f"{name}: async == sync {got == sync}, {ahead} steps ahead, "
          f"tau {info['mean_acceptance_length']:.2f}")
    return ok


def check_async_speculation(tmp: Path, report: dict[str, Any], device: str = "cuda") -> None:
    base = dict(device=device, dtype="float32", num_kv_blocks=1024, cost_profile="none",
                speculation_policy="fixed")
    prompts = [completion_prompt(s) for s in load_jsonl(CODE_PROMPTS)][:16]
    ok = _pair("async_demo_pair", DEMO / "target", prompts,
               SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
               {**base, "draft": str(DEMO / "drafter"), "block_size": 16}, report)
    target = build_tiny_model(tmp / "async_qwen3", arch="qwen3")
    drafter = build_random_drafter(tmp / "async_drafter", target, num_layers=2, block_size=8)
    for i in (1, 6):
        ids = [[(7 * i + 3 * j) % 200 + 1 for j in range(5 + 9 * i)]]
        ok &= _pair(f"async_synthetic_a0.6_prompt{i}", target, ids,
                    SamplingParams(temperature=0, max_tokens=96, ignore_eos=True),
                    {**base, "draft": str(drafter), "synthetic_acceptance": 0.6,
                     "benchmark_mode": True}, report)
    assert ok
