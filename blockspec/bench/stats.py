"""Per-request records -> per-level statistics, and acceptance from Prometheus counters."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestRecord:
    """One benchmark request. Times in seconds from the moment the request was sent."""

    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    latency: float | None = None  # send -> last token
    # NOTE: gaps between successive outputs (stream chunks / engine steps that carried tokens).
    # With speculative decoding one gap can carry several tokens, so ITL >= TPOT there.
    itl: list[float] = field(default_factory=list)
    token_source: str = "usage"  # "usage": server-reported counts; "chunks": counted chunks
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's definition)."""
        if self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def distribution(values_s: Sequence[float]) -> dict[str, float] | None:
    """mean / median / p99 in milliseconds (linear-interpolated percentiles); None if empty."""
    if not values_s:
        return None
    a = np.asarray(values_s, dtype=np.float64) * 1e3
    return {"mean": float(a.mean()), "median": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99)), "count": int(a.size)}


def _first_errors(records: Sequence[RequestRecord], limit: int = 5) -> list[str]:
    """The first `limit` distinct failure messages: enough to diagnose, short enough to print."""
    errors: list[str] = []
    for r in records:
        if not r.ok and r.error and r.error not in errors and len(errors) < limit:
            errors.append(r.error)
    return errors


def _latency_distributions(ok: Sequence[RequestRecord]) -> dict[str, dict[str, float] | None]:
    """TTFT / TPOT / ITL / end-to-end distributions over requests that report each one."""
    return {
        "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": distribution([g for r in ok for g in r.itl]),
        "e2e_latency_ms": distribution([r.latency for r in ok if r.latency is not None]),
    }


def summarize_level(concurrency: int, records: Sequence[RequestRecord],
                    duration_s: float) -> dict[str, Any]:
    """Throughput counts successful requests only; failures are reported, never hidden."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    dur = max(duration_s, 1e-9)
    sources = {r.token_source for r in ok}
    return {
        "concurrency": concurrency,
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / dur,
        "total_tok_s": (in_tokens + out_tokens) / dur,
        "req_s": len(ok) / dur,
        **_latency_distributions(ok),
        "token_counts": "usage" if sources == {"usage"} else "/".join(sorted(sources)) or None,
        "errors": _first_errors(records),
    }


# -- Prometheus text format ------------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')

Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse_prometheus(text: str) -> Samples:
    """Sample name -> [(labels, value)]. Comments, blank and malformed lines are skipped: a
    metrics page is best-effort input and must never fail a benchmark."""
    out: Samples = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.setdefault(m.group(1), []).append((labels, value))
    return out


def metric_sums(samples: Samples) -> dict[str, float]:
    """Sum of all samples of each name (over every label set: models, engines, ...)."""
    return {name: math.fsum(v for _, v in vals) for name, vals in samples.items()}


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, v in samples.get(name, []):
        if label in labels:
            out[labels[label]] = out.get(labels[label], 0.0) + v
    return out


# Counter families that carry speculative-decoding totals; per key, the first name present wins.
# "steps" counts verify steps that carried drafts (vLLM: num_drafts): tau = 1 + accepted / steps.
SPEC_COUNTERS: dict[str, dict[str, tuple[str, ...]]] = {
    "blockspec": {
        "drafts": ("blockspec_spec_decode_draft_tokens_total",
                   "blockspec_spec_draft_tokens_total"),
        "accepted": ("blockspec_spec_decode_accepted_tokens_total",
                     "blockspec_spec_accepted_tokens_total"),
        "steps": ("blockspec_spec_decode_verify_steps_total",
                  "blockspec_spec_verify_steps_total"),
        "per_position": ("blockspec_spec_decode_accepted_tokens_per_position_total",
                         "blockspec_spec_accepted_tokens_per_position_total"),
    },
    "vllm": {
        "drafts": ("vllm:spec_decode_num_draft_tokens_total",),
        "accepted": ("vllm:spec_decode_num_accepted_tokens_total",),
        "steps": ("vllm:spec_decode_num_drafts_total",),
        "per_position": ("vllm:spec_decode_num_accepted_tokens_per_pos_total",),
    },
}


def _pick(names: tuple[str, ...], present: dict[str, float] | Samples) -> str | None:
    return next((n for n in names if n in present), None)


def acceptance_from_metrics(before: str | None, after: str | None) -> dict[str, Any] | None:
    """Acceptance over one level from the counters' difference; None when the server exposes no
    known speculative counters (or nothing was drafted during the level)."""
    if after is None:
        return None
    a_samples = parse_prometheus(after)
    b_samples = parse_prometheus(before or "")
    a, b = metric_sums(a_samples), metric_sums(b_samples)
    for source, family in SPEC_COUNTERS.items():
        names = {k: _pick(v, a) for k, v in family.items()}
        if names["drafts"] is None and names["steps"] is None:
            continue
        d = {k: a[n] - b.get(n, 0.0) if n else 0.0
             for k, n in names.items() if k != "per_position"}
        if d["drafts"] <= 0 and d["steps"] <= 0:
            return None
        res: dict[str, Any] = {
            "source": f"server /metrics ({source})",
            "num_draft_tokens": d["drafts"], "num_accepted_tokens": d["accepted"],
            "num_steps": d["steps"],
            "draft_acceptance_rate": d["accepted"] / d["drafts"] if d["drafts"] > 0 else None,
            "mean_acceptance_length": 1 + d["accepted"] / d["steps"] if d["steps"] > 0 else None,
        }
        pos_name = names["per_position"]
        pa = by_label(a_samples, pos_name, "position") if pos_name else {}
        pb = by_label(b_samples, pos_name, "position") if pos_name else {}
        if pa and d["steps"] > 0:
            keys = sorted(pa, key=lambda k: int(k) if k.isdigit() else k)
            res["acceptance_rate_per_position"] = [(pa[k] - pb.get(k, 0.0)) / d["steps"]
                                                   for k in keys]
        return res
    return None


def acceptance_from_spec(spec: Any) -> dict[str, Any] | None:
    """The same fields from an engine SpecStats (offline bench)."""
    if spec is None or not spec.num_steps:
        return None
    return {
        "source": "engine (RequestOutput.metrics.spec)",
        "num_draft_tokens": spec.num_draft_tokens,
        "num_accepted_tokens": spec.num_accepted_tokens,
        "num_steps": spec.num_steps,
        "draft_acceptance_rate": spec.num_accepted_tokens / max(spec.num_draft_tokens, 1),
        "mean_acceptance_length": spec.mean_acceptance_length,
        "acceptance_rate_per_position": spec.acceptance_rate_per_position,
        "acceptance_length_hist": {str(k): v
                                   for k, v in sorted(spec.acceptance_length_hist.items())},
    }
