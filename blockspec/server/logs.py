"""The server's logs, like vLLM's: one line per finished request, and a periodic engine stats
line while the engine is busy."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from blockspec.outputs import RequestOutput
from blockspec.server.engine_stats import EngineStats

logger = logging.getLogger("blockspec.server")
_STATUS = {"abort": "aborted", "error": "failed"}


def request_line(out: RequestOutput) -> str:
    """`request cmpl-... finished: prompt 12, output 64 tokens, TTFT 35.1 ms, 410.2 tok/s,
    acceptance length 3.41, finish_reason length, status ok`."""
    m = out.metrics
    parts = [f"prompt {len(out.prompt_token_ids)}", f"output {len(out.token_ids)} tokens"]
    if m is not None and m.ttft is not None:
        parts.append(f"TTFT {m.ttft * 1e3:.1f} ms")
        if m.finished_time is not None and m.finished_time > m.first_token_time:
            rate = (len(out.token_ids) - 1) / (m.finished_time - m.first_token_time)
            parts.append(f"{rate:.1f} tok/s")
    if m is not None and m.spec is not None and m.spec.num_steps:
        parts.append(f"acceptance length {m.spec.mean_acceptance_length:.2f}")
    parts.append(f"finish_reason {out.finish_reason}")
    parts.append(f"status {_STATUS.get(out.finish_reason or '', 'ok')}")
    return f"request {out.request_id} finished: " + ", ".join(parts)


class RequestLogger:
    def on_finished(self, out: RequestOutput) -> None:
        """Engine thread, once per request."""
        logger.info(request_line(out))


@dataclass
class _Mark:
    at: float
    stats: EngineStats


class StatsLogger:
    """Every `interval` seconds while requests run or wait (and once when the engine goes idle):
    running, waiting, KV use, prompt and generation tok/s and acceptance length since the last
    line."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last: _Mark | None = None

    def tick(self, stats: EngineStats, now: float | None = None) -> str | None:
        """Engine thread, after each iteration; returns the line it logged, if any."""
        now = time.monotonic() if now is None else now
        if self._last is None:
            self._last = _Mark(now, stats)
            return None
        last = self._last
        busy = stats.num_running or stats.num_waiting
        was_busy = last.stats.num_running or last.stats.num_waiting
        if now - last.at < self.interval or not (busy or was_busy):
            return None
        line = self.line(last.stats, stats, now - last.at)
        self._last = _Mark(now, stats)
        logger.info(line)
        return line

    @staticmethod
    def line(before: EngineStats, after: EngineStats, seconds: float) -> str:
        dt = max(seconds, 1e-9)
        kv = 100.0 * after.num_used_blocks / max(after.num_blocks, 1)
        text = (f"engine: {after.num_running} running, {after.num_waiting} waiting, KV cache "
                f"{kv:.1f}%, prompt {(after.num_prompt_tokens - before.num_prompt_tokens) / dt:.1f}"
                f" tok/s, generation "
                f"{(after.num_generation_tokens - before.num_generation_tokens) / dt:.1f} tok/s")
        steps = after.spec_verify_steps - before.spec_verify_steps
        if steps:
            accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
            text += f", acceptance length {(accepted + steps) / steps:.2f}"
        if after.num_step_failures > before.num_step_failures:
            text += f", {after.num_step_failures - before.num_step_failures} failed steps"
        return text
