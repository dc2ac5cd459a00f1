"""The ops the event loop queues for the engine thread, and how a call's answer gets back.

The engine thread is the only one that touches the `LLMEngine`, so everything the event loop
wants from it travels as one of these ops on a thread-safe queue, in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from blockspec.engine.llm_engine import LLMEngine
from blockspec.sampling_params import SamplingParams
from blockspec.server.stream import RequestStream

Prompt = str | list[int]


@dataclass
class Add:
    """Add a request; its stream gets ACCEPTED or the reason it was refused."""

    prompt: Prompt
    params: SamplingParams
    stream: RequestStream


@dataclass
class Abort:
    """Abort a request, freeing its KV blocks before the next step."""

    request_id: str | None  # None: every request in flight


@dataclass
class Call:
    """Run `fn(engine)` on the engine thread; the answer settles `future` on `loop`."""

    fn: Callable[[LLMEngine], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class Stop:
    """Abort everything in flight and end the engine thread."""


def resolve(op: Call, result: Any, exc: BaseException | None) -> None:
    """Engine thread: settle a call's future on its loop (if that loop still runs), since an
    asyncio future is not thread-safe."""
    try:
        op.loop.call_soon_threadsafe(_settle, op.future, result, exc)
    except RuntimeError:
        pass


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():  # the caller was cancelled
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
