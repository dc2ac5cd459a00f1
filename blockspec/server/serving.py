"""/v1/completions and /v1/chat/completions: engine outputs -> OpenAI responses and SSE chunks."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from blockspec.config import ConfigError
from blockspec.engine.llm_engine import LLMEngine
from blockspec.outputs import RequestOutput
from blockspec.sampling_params import SamplingParams
from blockspec.server.async_engine import AsyncEngine
from blockspec.server.errors import APIError, from_config_error
from blockspec.server.protocol import ChatCompletionRequest, CompletionRequest
from blockspec.server.stream import EngineUnavailableError, RequestStream
from blockspec.server.tokens import TokenText, chat_logprobs, completion_logprobs

Chunker = Callable[[RequestOutput], dict[str, Any] | None]


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _unavailable(e: Exception) -> APIError:
    return APIError(str(e), status=503, type="server_error", code="engine_unavailable")


def _usage(out: RequestOutput) -> dict[str, int]:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class _SSEResponse(StreamingResponse):
    """Streams SSE and aborts the request however the response ends: a client disconnect
    cancels the send loop while the body generator sits at a `yield`, and nothing would close
    that generator (and free the request's KV blocks) until garbage collection."""

    def __init__(self, content: AsyncIterator[str], stream: RequestStream) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.abort()


async def _abort_on_disconnect(request: Request, stream: RequestStream) -> None:
    # NOTE: the body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
    stream.abort()


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokens = TokenText(engine.engine.tokenizer)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(f"The model `{model}` does not exist.", status=404, param="model",
                           code="model_not_found")

    async def _start(self, prompt: str | list[int], params: SamplingParams, rid: str,
                     param: str) -> RequestStream:
        try:
            return await self.engine.add(prompt, params, rid)
        except ConfigError as e:
            raise from_config_error(e, default_param=param) from None
        except EngineUnavailableError as e:
            raise _unavailable(e) from None

    async def _collect(self, stream: RequestStream, request: Request) -> RequestOutput:
        watcher = asyncio.create_task(_abort_on_disconnect(request, stream))
        final = None
        try:
            async for out in stream:
                final = out
        except EngineUnavailableError as e:
            raise _unavailable(e) from None
        finally:
            watcher.cancel()
            stream.abort()  # NOTE: no-op when finished; frees the blocks if we were cancelled
        if final is None or final.finish_reason == "abort":
            raise _unavailable(RuntimeError("the request was aborted"))
        return final

    async def _events(self, stream: RequestStream, chunk: Chunker, head: dict[str, Any],
                      include_usage: bool) -> AsyncIterator[str]:
        try:
            async for out in stream:
                if out.finish_reason == "abort":
                    raise EngineUnavailableError("the request was aborted (server shutting down)")
                body = chunk(out)
                if body is not None:
                    yield _data({**head, **body, **({"usage": None} if include_usage else {})})
                if out.finished and include_usage:
                    yield _data({**head, "choices": [], "usage": _usage(out)})
            yield "data: [DONE]\n\n"
        except EngineUnavailableError as e:
            yield _data(_unavailable(e).body())
        finally:
            stream.abort()

    # -- /v1/completions ------------------------------------------------------------------------
    async def completion(self, req: CompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        prompt = req.single_prompt()
        params = req.to_sampling_params()
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        stream = await self._start(prompt, params, rid, "prompt")
        head = {"id": rid, "object": "text_completion", "created": created,
                "model": self.model_name}
        k = params.logprobs
        if not req.stream:
            out = await self._collect(stream, request)
            lp = completion_logprobs(self.tokens, out.token_ids, out.logprobs, 0) \
                if k is not None else None
            choice = {"index": 0, "text": out.text, "logprobs": lp,
                      "finish_reason": out.finish_reason}
            return JSONResponse({**head, "choices": [choice], "usage": _usage(out)})

        state = {"n": 0, "offset": 0}

        def chunk(out: RequestOutput) -> dict[str, Any] | None:
            lp = None
            if k is not None and len(out.token_ids) > state["n"]:
                n = state["n"]
                lp = completion_logprobs(self.tokens, out.token_ids[n:], out.logprobs[n:],
                                         state["offset"])
                state["n"] = len(out.token_ids)
                state["offset"] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            if not (out.delta_text or out.finished or lp):
                return None
            return {"choices": [{"index": 0, "text": out.delta_text, "logprobs": lp,
                                 "finish_reason": out.finish_reason if out.finished else None}]}

        return _SSEResponse(self._events(stream, chunk, head, req.include_usage), stream)

    # -- /v1/chat/completions -------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        params = req.to_sampling_params()
        if not getattr(self.engine.engine.tokenizer, "chat_template", None):
            raise APIError("this model's tokenizer has no chat template: use /v1/completions "
                           "with a prompt instead", param="messages", code="no_chat_template")
        messages = [m.as_template_input() for m in req.messages]
        add_gen = req.add_generation_prompt is not False
        try:
            ids = await self.engine.call(lambda eng: _render_chat(eng, messages, add_gen))
        except EngineUnavailableError as e:
            raise _unavailable(e) from None
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        stream = await self._start(ids, params, rid, "messages")
        head = {"id": rid, "object": "chat.completion", "created": created,
                "model": self.model_name}
        top = req.top_logprobs or 0
        if not req.stream:
            out = await self._collect(stream, request)
            lp = chat_logprobs(self.tokens, out.token_ids, out.logprobs, top) \
                if req.logprobs else None
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "logprobs": lp, "finish_reason": out.finish_reason}
            return JSONResponse({**head, "choices": [choice], "usage": _usage(out)})

        head["object"] = "chat.completion.chunk"
        state = {"n": 0, "first": True}

        def chunk(out: RequestOutput) -> dict[str, Any] | None:
            delta: dict[str, Any] = {}
            if state["first"]:  # OpenAI opens every stream with the role
                delta, state["first"] = {"role": "assistant", "content": ""}, False
            lp = None
            if req.logprobs and len(out.token_ids) > state["n"]:
                n = state["n"]
                lp = chat_logprobs(self.tokens, out.token_ids[n:], out.logprobs[n:], top)
                state["n"] = len(out.token_ids)
            if out.delta_text:
                delta["content"] = delta.get("content", "") + out.delta_text
            if not (delta or out.finished or lp):
                return None
            return {"choices": [{"index": 0, "delta": delta, "logprobs": lp,
                                 "finish_reason": out.finish_reason if out.finished else None}]}

        return _SSEResponse(self._events(stream, chunk, head, req.include_usage), stream)


def _render_chat(engine: LLMEngine, messages: list[dict[str, str]], add_gen: bool) -> list[int]:
    """Engine thread: the template's text already holds any BOS, so encode it without adding
    special tokens (a second BOS would change the model's output)."""
    tok = engine.tokenizer
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_gen)
    except Exception as e:  # jinja raises for messages the template refuses (role order, ...)
        raise APIError(f"the chat template rejected these messages: {e}",
                       param="messages") from None
    return list(tok.encode(text, add_special_tokens=False))
