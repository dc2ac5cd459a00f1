"""Issue 24's two-device run, the parts a script shares with its CPU smoke mode: greedy tokens
of every layout against one device on tiny fp32 models (graphs and eager, AR and DFlash), and
the time of one all-reduce of a decode step's activations between two ranks."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from blockspec import LLM, SamplingParams
from blockspec.parallel.launch import free_port

__all__ = ["allreduce_times", "layout_tokens_match"]

PROMPTS = [list(range(1, 30)), [7, 8, 9], [5] * 11]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _tokens(path: Path, **kw: Any) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy tokens of PROMPTS and what ran them (steps by path, speculative blocks)."""
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_seqs=2, **kw)
    eng = llm.engine
    try:
        out = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        facts = {"step_mix": {f"{p}/{L}": c[0] for (p, L), c in eng.step_mix.cells.items()},
                 "spec_steps": dict(eng.spec_stats.block_len_steps) if kw.get("draft") else {}}
        return out, facts
    finally:
        if hasattr(eng, "shutdown"):  # NOTE: a parallel engine's workers
            eng.shutdown()


def layout_tokens_match(target: Path, drafter: Path | None, layouts: list[tuple[int, int]],
                        device: str) -> dict[str, Any]:
    """Per layout (tp, ep) and mode (graphs / eager on CUDA; eager on CPU; DFlash with a
    drafter, fixed blocks): its greedy tokens == one device's AR greedy tokens."""
    ref, _ = _tokens(target, device=device, enforce_eager=True)
    modes: dict[str, dict[str, Any]] = {"eager": {"enforce_eager": True}}
    if device.startswith("cuda"):
        modes["graphs"] = {}
    if drafter is not None:
        modes["dflash"] = {"draft": str(drafter), "speculation_policy": "fixed",
                           "cost_profile": "none"}
    rows = {}
    for tp, ep in layouts:
        for mode, kw in modes.items():
            got, facts = _tokens(target, device=device, tensor_parallel_size=tp,
                                 expert_parallel_size=ep, **kw)
            rows[f"tp{tp}_ep{ep}_{mode}"] = {"equal": got == ref, **facts}
    return {"reference": "one device, eager, AR greedy", "cases": rows,
            "all_equal": all(r["equal"] for r in rows.values())}


def _allreduce_rank(rank: int, port: int, device: str, sizes: list[int], hidden: int,
                    iters: int, out: dict) -> None:
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        dev = torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")
        if device == "cuda":
            torch.cuda.set_device(dev)
        times = {}
        for n in sizes:
            x = torch.ones(n, hidden, dtype=torch.bfloat16 if device == "cuda" else
                           torch.float32, device=dev)
            for _ in range(3):
                dist.all_reduce(x)
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x)
            _sync(device)
            times[n] = 1e6 * (time.perf_counter() - t0) / iters
        if rank == 0:
            out.update(times)
    finally:
        dist.destroy_process_group()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def allreduce_times(device: str, hidden: int, sizes: list[int], iters: int = 50
                    ) -> dict[int, float]:
    """Microseconds per all-reduce of [n, hidden] activations (bf16 on CUDA, fp32 on CPU)
    between two ranks, eagerly launched, per n in `sizes`. A decode step of a TP target runs
    two per layer (after attention and after the MLP/MoE)."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_allreduce_rank, args=(free_port(), device, sizes, hidden, iters, out),
                 nprocs=2, join=True)
        return {int(k): float(v) for k, v in out.items()}
