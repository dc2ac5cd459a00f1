"""`blockspec bench serve`: a concurrency sweep against any OpenAI-compatible server.

Streaming requests (SSE, `stream_options.include_usage`), exactly C in flight per level, one
warm-up request first. Acceptance comes from the server's Prometheus counters, read before and
after each level, when it exposes known ones (blockspec or vLLM names).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

import httpx
from tqdm.auto import tqdm

from blockspec.bench.common import (
    check_lengths,
    level_line,
    new_result,
    parse_concurrency,
    requests_per_level,
    save_result,
)
from blockspec.bench.datasets import Sample, chat_messages, completion_prompt, load_samples
from blockspec.bench.stats import RequestRecord, acceptance_from_metrics, summarize_level
from blockspec.config import ConfigError

_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def server_root(base_url: str) -> str:
    """'http://h:8000/v1/' -> 'http://h:8000': the API lives under /v1, metrics at /metrics."""
    url = base_url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--base-url must start with http:// or https://, got {base_url!r}")
    return url[:-3] if url.endswith("/v1") else url


def _short(text: str, n: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + "..."


def _chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if not chat:
        return c.get("text") or ""
    delta = c.get("delta") or {}
    # NOTE: reasoning models stream their thinking in a separate field; it is output too.
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


def build_body(args: argparse.Namespace, model: str, sample: Sample, tokenizer: Any,
               max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens,
                            "temperature": args.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True  # vLLM / SGLang / blockspec extension, not OpenAI's
    if args.endpoint == "chat":
        body["messages"] = chat_messages(sample)
    else:
        body["prompt"] = completion_prompt(sample, tokenizer)
    return body


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any],
               chat: bool) -> RequestRecord:
    rec = RequestRecord()
    start = time.perf_counter()
    last: float | None = None
    chunks = 0
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                raw = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {_short(raw)}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    rec.error = f"stream error: {_short(json.dumps(chunk['error']))}"
                    return rec
                usage = chunk.get("usage") or usage
                if _chunk_text(chunk, chat):
                    now = time.perf_counter()
                    if last is None:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        rec.error = f"{type(e).__name__}: {_short(str(e)) or 'no detail'}"
        return rec
    rec.latency = (last if last is not None else time.perf_counter()) - start
    if usage and usage.get("completion_tokens") is not None:
        rec.output_tokens = int(usage["completion_tokens"])
        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    else:  # NOTE: a chunk may hold several tokens (speculation), so this can undercount
        rec.output_tokens, rec.token_source = chunks, "chunks"
    rec.ok = True
    return rec


async def fetch_metrics(client: httpx.AsyncClient, root: str) -> str | None:
    try:
        r = await client.get(root + "/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


async def resolve_model_name(client: httpx.AsyncClient, root: str, model: str | None) -> str:
    if model:
        return model
    try:
        r = await client.get(root + "/v1/models", timeout=10.0)
    except httpx.HTTPError as e:
        raise ConfigError(f"cannot reach the server at {root}: {type(e).__name__}: "
                          f"{_short(str(e))}") from None
    try:
        return str(r.json()["data"][0]["id"])
    except Exception:  # noqa: BLE001 - any malformed answer means the same thing to the user
        raise ConfigError(f"{root}/v1/models gave no model (HTTP {r.status_code}); "
                          "pass --model") from None


async def run_level(client: httpx.AsyncClient, url: str, bodies: list[dict[str, Any]],
                    concurrency: int, chat: bool) -> tuple[list[RequestRecord], float]:
    # NOTE: asyncio.Semaphore wakes waiters in FIFO order, so exactly `concurrency` requests are
    # in flight until fewer than that remain.
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(bodies), desc=f"C={concurrency}", unit="req", leave=False)

    async def one(body: dict[str, Any]) -> RequestRecord:
        async with sem:
            rec = await send(client, url, body, chat)
        bar.update(1)
        return rec

    start = time.perf_counter()
    try:
        records = await asyncio.gather(*(one(b) for b in bodies))
    finally:
        bar.close()
    return list(records), time.perf_counter() - start


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    levels = parse_concurrency(args.concurrency)
    check_lengths(args.input_len, args.output_len)
    root = server_root(args.base_url)
    tokenizer = None
    if args.tokenizer:
        from blockspec.hf_tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer, getattr(args, "trust_remote_code", False))
    counts = [requests_per_level(args.num_prompts, c) for c in levels]
    # NOTE: one dataset slice per level (file datasets cycle), so random prompts never repeat
    # across levels and a prefix cache cannot flatter later levels.
    samples = load_samples(args.dataset, sum(counts), args.input_len, args.dataset_seed)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(levels) + 4,
                          max_keepalive_connections=max(levels) + 4)
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    chat = args.endpoint == "chat"
    url = root + _PATHS[args.endpoint]
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        model = await resolve_model_name(client, root, args.model)
        label = args.label or f"{model} (serve, {args.endpoint})"
        result = new_result("serve", args, label)
        result["config"].update(model=model, url=url, concurrency_levels=levels)
        warm = build_body(args, model, Sample("Hello, how are you?",
                          [{"role": "user", "content": "Hello, how are you?"}] if chat else None),
                          tokenizer, min(16, args.output_len))
        rec = await send(client, url, warm, chat)
        if not rec.ok:
            raise ConfigError(f"warm-up request to {url} failed: {rec.error}")
        start = 0
        for c, n in zip(levels, counts):
            bodies = [build_body(args, model, s, tokenizer, args.output_len)
                      for s in samples[start:start + n]]
            start += n
            before = await fetch_metrics(client, root)
            records, duration = await run_level(client, url, bodies, c, chat)
            after = await fetch_metrics(client, root)
            level = summarize_level(c, records, duration)
            level["acceptance"] = acceptance_from_metrics(before, after)
            result["levels"].append(level)
            save_result(args.out, result)
            print(level_line(level), flush=True)
    return result


def run_serve(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_bench(args))
