"""Soak check of the OpenAI-compatible server (CPU, tiny random model, loopback only).

Starts the server in-process on 127.0.0.1 with a tiny random Qwen3, then sends --requests
streaming requests (completions and chat, random short prompts, max_tokens 16-48) at
--concurrency, closing ~--cancel-frac of the streams after their first few chunks. Checks:
  - every request that was not cancelled ran to a finish_reason and `data: [DONE]`, with usage
    consistent with it (length -> exactly max_tokens tokens);
  - no 5xx and no transport errors;
  - once idle, no KV blocks in use and nothing left in the scheduler;
  - /metrics accounts for every request; /health answers 200 and a final completion works.
Bounded: --requests (default 600) and --time-limit (default 900 s); exits 1 if a check fails.

Usage: python benchmarks/soak_server.py [--out benchmarks/results/soak_server_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

if "TRITON_INTERPRET" not in os.environ:  # NOTE: before blockspec imports triton (CPU machine)
    os.environ["TRITON_INTERPRET"] = "1"

import httpx  # noqa: E402
import torch  # noqa: E402

from blockspec.bench.common import git_commit, recorded_command
from blockspec.config import EngineConfig  # noqa: E402
from blockspec.engine.llm_engine import LLMEngine  # noqa: E402
from blockspec.server.api import build_app  # noqa: E402
from blockspec.server.runner import BackgroundServer  # noqa: E402
from blockspec.tiny import build_tiny_model  # noqa: E402

MODEL = "tiny-soak"
WORDS = ("def class return import json value list dict for while if else self data key item "
         "print range len None True False yield lambda async await").split()


async def one(client: httpx.AsyncClient, i: int, rng: random.Random, cancel: bool) -> dict:
    max_tokens = rng.randint(16, 48)
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 24)))
    chat = rng.random() < 0.25
    body: dict = {"model": MODEL, "max_tokens": max_tokens, "stream": True,
                  "stream_options": {"include_usage": True},
                  "temperature": rng.choice([0.0, 0.8]), "seed": i}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    path = "/v1/chat/completions" if chat else "/v1/completions"
    res = {"i": i, "cancel": cancel, "max_tokens": max_tokens, "status": None, "chunks": 0,
           "finish_reason": None, "done": False, "usage": None, "error": None}
    cut = rng.randint(1, 4)
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as r:
            res["status"] = r.status_code
            if r.status_code != 200:
                res["error"] = (await r.aread()).decode(errors="replace")[:300]
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    res["done"] = True
                    break
                obj = json.loads(line[6:])
                if "error" in obj:
                    res["error"] = obj["error"]["message"]
                    break
                if obj.get("usage"):
                    res["usage"] = obj["usage"]
                for c in obj["choices"]:
                    res["finish_reason"] = c["finish_reason"] or res["finish_reason"]
                res["chunks"] += 1
                if cancel and res["chunks"] >= cut:
                    break  # NOTE: leaving the block unread closes the connection mid-stream
    except httpx.HTTPError as e:
        res["error"] = f"{type(e).__name__}: {e}"
    res["latency_s"] = time.perf_counter() - t0
    return res


def check(res: dict) -> str | None:
    """Why a finished request is wrong, or None."""
    if res["status"] != 200:
        return f"status {res['status']}: {res['error']}"
    if res["cancel"]:
        return None if res["error"] is None else res["error"]
    if res["error"] or not res["done"] or res["finish_reason"] not in ("stop", "length"):
        return f"incomplete: {res}"
    u = res["usage"]
    if u is None or not 1 <= u["completion_tokens"] <= res["max_tokens"] or \
            (res["finish_reason"] == "length") != (u["completion_tokens"] == res["max_tokens"]):
        return f"usage inconsistent: {res}"
    return None


async def drive(url: str, n: int, concurrency: int, cancel_frac: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    plan = [(i, rng.random() < cancel_frac) for i in range(n)]
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def task(i: int, cancel: bool) -> dict:
            async with sem:
                return await one(client, i, random.Random(seed * 100003 + i), cancel)

        return await asyncio.gather(*(task(i, c) for i, c in plan))


def metric_sum(text: str, name: str) -> dict[str, float]:
    return {m.group(1) or "": float(m.group(2))
            for m in re.finditer(rf"^{name}(\{{.*?\}})? (\S+)$", text, re.M)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/soak_server_cpu.json")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--cancel-frac", type=float, default=0.1)
    ap.add_argument("--num-kv-blocks", type=int, default=128,
                    help="small enough that 64 streams preempt each other at times")
    ap.add_argument("--time-limit", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    report: dict = {
        "benchmark": "soak_server: OpenAI-compatible server under concurrent streaming load with "
                     "client cancellations (tiny random Qwen3, CPU, loopback)",
        "command": recorded_command("benchmarks/soak_server.py"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads()},
        "config": {k: v for k, v in vars(args).items() if k != "out"},
    }
    report["commit"] = git_commit()
    try:
        report["uncommitted_changes"] = bool(subprocess.check_output(
            ["git", "status", "--porcelain", "--", "blockspec", "benchmarks/soak_server.py"],
            text=True, stderr=subprocess.DEVNULL).strip())
    except Exception:  # noqa: BLE001 - not a checkout, no git: the field is just absent
        pass
    with tempfile.TemporaryDirectory() as d:
        path = build_tiny_model(Path(d) / "tiny")
        engine = LLMEngine(EngineConfig(model=str(path), device="cpu",
                                        num_kv_blocks=args.num_kv_blocks, max_model_len=512))
        with BackgroundServer(build_app(engine, MODEL)) as srv:
            t0 = time.perf_counter()
            results = asyncio.run(asyncio.wait_for(
                drive(srv.url, args.requests, args.concurrency, args.cancel_frac, args.seed),
                args.time_limit))
            load_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            deadline = t1 + 60
            while time.perf_counter() < deadline and (
                    engine.block_manager.num_used_blocks or engine.has_unfinished()
                    or engine.requests):
                time.sleep(0.05)
            idle_s = time.perf_counter() - t1
            metrics = httpx.get(srv.url + "/metrics").text
            health = httpx.get(srv.url + "/health").status_code
            final = httpx.post(srv.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "def main():", "max_tokens": 8, "temperature": 0})
            final_ok = final.status_code == 200 and \
                final.json()["choices"][0]["finish_reason"] in ("stop", "length")
            leaked = engine.block_manager.num_used_blocks
            unfinished = engine.has_unfinished() or bool(engine.requests)
            preemptions = engine.scheduler.num_preemptions
    problems = [(r["i"], p) for r in results if (p := check(r)) is not None]
    statuses = Counter(r["status"] for r in results)
    done = [r for r in results if not r["cancel"]]
    by_reason = metric_sum(metrics, "blockspec_requests_total")
    gen_tokens = sum(r["usage"]["completion_tokens"] for r in done if r["usage"])
    report.update({
        "requests": len(results), "cancelled": len(results) - len(done),
        "completed": sum(r["done"] for r in done),
        "finish_reasons": dict(Counter(r["finish_reason"] for r in done)),
        "http_status": {str(k): v for k, v in statuses.items()},
        "server_5xx": sum(v for k, v in statuses.items() if k is None or k >= 500),
        "problems": problems[:20], "num_problems": len(problems),
        "metrics_requests_by_finish_reason": by_reason,
        "metrics_accounts_for_every_request": sum(by_reason.values()) == len(results),
        "preemptions": preemptions,
        "load_duration_s": round(load_s, 2), "idle_wait_s": round(idle_s, 2),
        "requests_per_s": round(len(results) / load_s, 2),
        "generated_tokens_completed_requests": gen_tokens,
        "latency_s_p50": round(sorted(r["latency_s"] for r in done)[len(done) // 2], 3),
        "latency_s_max": round(max(r["latency_s"] for r in done), 3),
        "kv_blocks_used_when_idle": leaked, "unfinished_when_idle": unfinished,
        "health_status": health, "final_completion_ok": final_ok,
    })
    report["all_checks_passed"] = bool(
        not problems and report["server_5xx"] == 0 and leaked == 0 and not unfinished
        and health == 200 and final_ok and report["metrics_accounts_for_every_request"]
        and len(results) >= 500)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if report["all_checks_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
