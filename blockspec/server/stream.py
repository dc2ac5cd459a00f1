"""One request's outputs, handed from the engine thread to the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from blockspec.outputs import RequestOutput


class EngineUnavailableError(RuntimeError):
    """The engine is shutting down or has died: the request cannot be served (HTTP 503)."""


class RequestFailedError(RuntimeError):
    """The engine step that ran this request raised: the request is failed (HTTP 500), the
    engine serves on."""


ACCEPTED = object()  # first item of a stream whose add_request succeeded


class RequestStream:
    """The outputs of one request, in order; the last one has `finished` set."""

    def __init__(self, request_id: str, on_abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.finished = False
        self._on_abort = on_abort
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._abort_sent = False

    def put(self, item: Any) -> None:
        """Engine thread -> event loop."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def get(self) -> Any:
        """The next raw item (an output, ACCEPTED, or an exception, which is raised)."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        return item

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out: RequestOutput = await self.get()
        self.finished = out.finished
        return out

    def abort(self) -> None:
        """Idempotent and synchronous (safe in `finally` and on cancellation). The engine thread
        aborts the request, which frees its KV blocks."""
        if not self.finished and not self._abort_sent:
            self._abort_sent = True
            self._on_abort(self.request_id)
