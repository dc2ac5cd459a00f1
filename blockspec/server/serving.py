"""/v1/completions and /v1/chat/completions: engine outputs -> OpenAI responses and SSE chunks.
A request with n > 1 runs as n engine requests (SamplingParams.samples), one choice each."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from blockspec.chat import render_chat
from blockspec.config import ConfigError
from blockspec.engine.llm_engine import LLMEngine
from blockspec.outputs import RequestOutput
from blockspec.sampling_params import SamplingParams
from blockspec.server.async_engine import AsyncEngine
from blockspec.server.errors import APIError, from_config_error
from blockspec.server.protocol import ChatCompletionRequest, CompletionRequest
from blockspec.server.sse import SSEResponse, abort_on_disconnect, events, unavailable, usage
from blockspec.server.stream import EngineUnavailableError, RequestFailedError, RequestStream
from blockspec.server.tokens import TokenText, chat_logprobs, completion_logprobs


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
                     param: str) -> list[RequestStream]:
        """One engine request per sample; all or none of them are admitted."""
        samples = params.samples()
        streams: list[RequestStream] = []
        try:
            for i, p in enumerate(samples):
                streams.append(await self.engine.add(
                    prompt, p, rid if len(samples) == 1 else f"{rid}-{i}"))
        except ConfigError as e:
            raise from_config_error(e, default_param=param) from None
        except (EngineUnavailableError, RequestFailedError) as e:
            raise unavailable(e) from None
        finally:
            if len(streams) < len(samples):
                for stream in streams:
                    stream.abort()
        return streams

    async def _collect(self, streams: list[RequestStream],
                       request: Request) -> list[RequestOutput]:
        watcher = asyncio.create_task(abort_on_disconnect(request, streams))

        async def final(stream: RequestStream) -> RequestOutput | None:
            last = None
            async for out in stream:
                last = out
            return last

        try:
            outs = await asyncio.gather(*(final(s) for s in streams))
        except (EngineUnavailableError, RequestFailedError) as e:
            raise unavailable(e) from None
        finally:
            watcher.cancel()
            for stream in streams:
                stream.abort()  # NOTE: no-op when finished; frees the blocks if cancelled
        if any(o is None or o.finish_reason == "abort" for o in outs):
            raise unavailable(RuntimeError("the request was aborted"))
        return outs

    # -- /v1/completions ------------------------------------------------------------------------
    async def completion(self, req: CompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        prompt = req.single_prompt()
        params = req.to_sampling_params()
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        streams = await self._start(prompt, params, rid, "prompt")
        head = {"id": rid, "object": "text_completion", "created": created,
                "model": self.model_name}
        k = params.logprobs
        if not req.stream:
            outs = await self._collect(streams, request)
            choices = [{"index": i, "text": out.text,
                        "logprobs": completion_logprobs(self.tokens, out.token_ids,
                                                        out.logprobs, 0) if k is not None
                        else None, "finish_reason": out.finish_reason}
                       for i, out in enumerate(outs)]
            return JSONResponse({**head, "choices": choices, "usage": usage(outs)})

        state = [{"n": 0, "offset": 0} for _ in streams]

        def chunk(i: int, out: RequestOutput) -> dict[str, Any] | None:
            lp, st = None, state[i]
            if k is not None and len(out.token_ids) > st["n"]:
                n = st["n"]
                lp = completion_logprobs(self.tokens, out.token_ids[n:], out.logprobs[n:],
                                         st["offset"])
                st["n"] = len(out.token_ids)
                st["offset"] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            if not (out.delta_text or out.finished or lp):
                return None
            return {"index": i, "text": out.delta_text, "logprobs": lp,
                    "finish_reason": out.finish_reason if out.finished else None}

        return SSEResponse(events(streams, chunk, head, req.include_usage, req.continuous_usage),
                           streams)

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
            ids = await self.engine.call(lambda eng: render_chat_on_engine(eng, messages, add_gen))
        except EngineUnavailableError as e:
            raise unavailable(e) from None
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        streams = await self._start(ids, params, rid, "messages")
        head = {"id": rid, "object": "chat.completion", "created": created,
                "model": self.model_name}
        top = req.top_logprobs or 0
        if not req.stream:
            outs = await self._collect(streams, request)
            choices = [{"index": i, "message": {"role": "assistant", "content": out.text},
                        "logprobs": chat_logprobs(self.tokens, out.token_ids, out.logprobs, top)
                        if req.logprobs else None, "finish_reason": out.finish_reason}
                       for i, out in enumerate(outs)]
            return JSONResponse({**head, "choices": choices, "usage": usage(outs)})

        head["object"] = "chat.completion.chunk"
        state = [{"n": 0, "first": True} for _ in streams]

        def chunk(i: int, out: RequestOutput) -> dict[str, Any] | None:
            delta: dict[str, Any] = {}
            st = state[i]
            if st["first"]:  # OpenAI opens every choice's stream with the role
                delta, st["first"] = {"role": "assistant", "content": ""}, False
            lp = None
            if req.logprobs and len(out.token_ids) > st["n"]:
                n = st["n"]
                lp = chat_logprobs(self.tokens, out.token_ids[n:], out.logprobs[n:], top)
                st["n"] = len(out.token_ids)
            if out.delta_text:
                delta["content"] = delta.get("content", "") + out.delta_text
            if not (delta or out.finished or lp):
                return None
            return {"index": i, "delta": delta, "logprobs": lp,
                    "finish_reason": out.finish_reason if out.finished else None}

        return SSEResponse(events(streams, chunk, head, req.include_usage, req.continuous_usage),
                           streams)


def render_chat_on_engine(engine: LLMEngine, messages: list[dict[str, str]],
                          add_gen: bool) -> list[int]:
    """Engine thread (the tokenizer must not race the engine's own detokenization)."""
    try:
        return render_chat(engine.tokenizer, messages, add_gen)
    except ConfigError as e:
        raise APIError(str(e), param="messages") from None
