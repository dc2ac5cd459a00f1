"""Prometheus metrics, one registry per app (several apps in one process never collide).

Per-request figures are recorded by the engine thread when a request finishes (prometheus_client
is thread-safe); gauges and the speculative counters are read at scrape time from the engine's
published `EngineStats` snapshot. Refused requests are counted on the event loop, by an ASGI
middleware that sees every response status of the API routes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from blockspec.outputs import RequestOutput
from blockspec.server.async_engine import EngineStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily("blockspec_num_requests_running",
                                "Requests in the running batch", value=s.num_running)
        yield GaugeMetricFamily("blockspec_num_requests_waiting",
                                "Requests waiting to be scheduled", value=s.num_waiting)
        yield GaugeMetricFamily("blockspec_kv_cache_usage_perc",
                                "Fraction of KV-cache blocks in use (0..1)",
                                value=s.num_used_blocks / max(s.num_blocks, 1))
        yield CounterMetricFamily("blockspec_num_preemptions",
                                  "Sequences preempted (recomputed later)",
                                  value=s.num_preemptions)
        yield CounterMetricFamily("blockspec_engine_step_failures",
                                  "Engine steps that raised (the requests in them failed)",
                                  value=s.num_step_failures)
        fam = CounterMetricFamily("blockspec_engine_steps",
                                  "Engine steps by how they ran: decode (every sequence decodes), "
                                  "flat (a mixed batch, one graph replay), eager (a mixed "
                                  "batch, one eager forward)", labels=["path"])
        for path, steps in s.steps_by_path:
            fam.add_metric([path], steps)
        yield fam
        # NOTE: mean acceptance length = (accepted + verify_steps) / verify_steps.
        yield CounterMetricFamily("blockspec_spec_decode_draft_tokens",
                                  "Draft tokens proposed by the DFlash drafter",
                                  value=s.spec_draft_tokens)
        yield CounterMetricFamily("blockspec_spec_decode_accepted_tokens",
                                  "Draft tokens accepted by the target",
                                  value=s.spec_accepted_tokens)
        yield CounterMetricFamily("blockspec_spec_decode_verify_steps",
                                  "Verify steps that carried at least one draft token",
                                  value=s.spec_verify_steps)
        # NOTE: acceptance rate at draft position j = accepted[j] / drafted[j] (j from 0).
        for name, values in (("drafted", s.spec_drafted_per_position),
                             ("accepted", s.spec_accepted_per_position)):
            fam = CounterMetricFamily(f"blockspec_spec_decode_{name}_tokens_per_position",
                                      f"Draft tokens {name} at each draft position",
                                      labels=["position"])
            for j, v in enumerate(values):
                fam.add_metric([str(j)], v)
            yield fam
        # NOTE: a MoE target's distinct experts per layer per forward = selected / forwards: what
        # a step reads of the experts (a verify block selects many more than one token).
        yield CounterMetricFamily("blockspec_moe_experts_selected",
                                  "Distinct routed experts selected, summed over MoE layer "
                                  "forwards", value=s.moe_experts_selected)
        yield CounterMetricFamily("blockspec_moe_layer_forwards", "MoE layer forwards",
                                  value=s.moe_layer_forwards)
        # NOTE: engine steps by the block length the speculation policy ran (1 = plain decode).
        fam = CounterMetricFamily("blockspec_spec_decode_block_len_steps",
                                  "Decode steps by block length (1 = plain decode)",
                                  labels=["block_len"])
        for block_len, steps in s.spec_block_len_steps:
            fam.add_metric([str(block_len)], steps)
        yield fam


REFUSED_STATUSES = (400, 401, 404, 405, 413, 415)  # the 4xx codes this server answers


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("blockspec_requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("blockspec_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("blockspec_generation_tokens",
                                         "Generated tokens of finished requests", registry=r)
        self.ttft = Histogram("blockspec_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("blockspec_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("blockspec_e2e_request_latency_seconds",
                             "Arrival to finish, per request", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.refused = Counter("blockspec_requests_refused",
                               "Requests to /v1/*, /tokenize and /detokenize answered with a 4xx "
                               "error (bad body or parameter, unknown model or route, wrong "
                               "method or media type, and 401 for a missing or wrong API key), "
                               "by HTTP status", ["status"], registry=r)
        # so the series exist before traffic
        for reason in ("stop", "length", "abort"):
            self.requests.labels(reason)
        for status in REFUSED_STATUSES:
            self.refused.labels(str(status))
        r.register(_EngineCollector(stats))

    def on_finished(self, out: RequestOutput) -> None:
        """Engine thread, once per request."""
        self.requests.labels(out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        m = out.metrics
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.tpot is not None and m.num_generated_tokens >= 2:
            self.tpot.observe(m.tpot)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _counted(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


class RefusedRequestsMiddleware:
    """Counts the 4xx answers of the API routes, whichever layer sent them (validation, the
    router, the API-key check). Pure ASGI, so streaming responses pass through untouched.

    NOTE: it must wrap APIKeyMiddleware (be added after it) to see the 401s."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _counted(scope.get("path", "")):
            await self.app(scope, receive, send)
            return

        async def observe(message: Message) -> None:
            if message["type"] == "http.response.start" and 400 <= message["status"] < 500:
                self._metrics.refused.labels(str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, observe)
