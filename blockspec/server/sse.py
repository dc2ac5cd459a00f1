"""Server-sent events for the OpenAI streaming responses: n streams merged into one event stream,
aborted however the response ends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from blockspec.outputs import RequestOutput
from blockspec.server.errors import APIError
from blockspec.server.stream import EngineUnavailableError, RequestFailedError, RequestStream

# (sample index, output) -> that choice's chunk, or None when the output adds nothing to send
Chunker = Callable[[int, RequestOutput], dict[str, Any] | None]


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def unavailable(e: Exception) -> APIError:
    if isinstance(e, RequestFailedError):
        return APIError(str(e), status=500, type="server_error", code="engine_step_failed")
    return APIError(str(e), status=503, type="server_error", code="engine_unavailable")


def usage(outs: list[RequestOutput]) -> dict[str, int]:
    """Usage of the n samples of one prompt: the prompt counts once."""
    p, c = len(outs[0].prompt_token_ids), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class SSEResponse(StreamingResponse):
    """Streams SSE and aborts the request however the response ends: a client disconnect
    cancels the send loop while the body generator sits at a `yield`, and nothing would close
    that generator (and free the request's KV blocks) until garbage collection."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                stream.abort()


async def abort_on_disconnect(request: Request, streams: list[RequestStream]) -> None:
    # NOTE: the body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for stream in streams:
        stream.abort()


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(sample index, output) of every stream, in the order the engine produced them."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as e:  # NOTE: handed to the consumer, raised there
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                left -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def events(streams: list[RequestStream], chunk: Chunker, head: dict[str, Any],
                 include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
    """The SSE body: one chunk per choice update, an optional usage chunk, then [DONE]; an error
    event (and no [DONE]) when the engine fails or stops the request."""
    outs: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, out in _merged(streams):
            if out.finish_reason == "abort":
                raise EngineUnavailableError("the request was aborted (server shutting down)")
            outs[i] = out
            body = chunk(i, out)
            if body is not None:
                used = usage([o for o in outs if o is not None]) if continuous_usage \
                    else None
                yield _data({**head, "choices": [body],
                             **({"usage": used} if include_usage or continuous_usage else {})})
        if include_usage:
            yield _data({**head, "choices": [], "usage": usage(outs)})
        yield "data: [DONE]\n\n"
    except (EngineUnavailableError, RequestFailedError) as e:
        yield _data(unavailable(e).body())
    finally:
        for stream in streams:
            stream.abort()
