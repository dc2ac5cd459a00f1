"""vLLM-style utility routes: POST /tokenize, POST /detokenize, GET /version.

Like vLLM, they sit outside /v1, so the API key does not cover them; they never run the model.
"""

from __future__ import annotations

import importlib.metadata
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

import blockspec
from blockspec.engine.llm_engine import LLMEngine
from blockspec.server.async_engine import AsyncEngine
from blockspec.server.body import read_body, validate_body
from blockspec.server.errors import APIError
from blockspec.server.openapi import SchemaBook
from blockspec.server.protocol import ChatMessage
from blockspec.server.serving import OpenAIServing, render_chat_on_engine
from blockspec.server.stream import EngineUnavailableError


class _Body(BaseModel):
    # NOTE: strict (no "1" -> 1, no true -> 1) and closed: a misspelt option is a 400 naming it,
    # never silently ignored.
    model_config = ConfigDict(strict=True, extra="forbid")


class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def server_version() -> str:
    return getattr(blockspec, "__version__", None) or importlib.metadata.version("blockspec")


async def _parse_tokenize(request: Request) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A body with `messages` is the chat form; anything else is validated as the prompt form
    (a pydantic union would report the errors of both branches)."""
    raw = await read_body(request)
    try:
        data = json.loads(raw)
    except ValueError:
        data = None  # validate_body words the JSON error
    chat = isinstance(data, dict) and "messages" in data
    return validate_body(raw, TokenizeChatRequest if chat else TokenizeCompletionRequest)


def _tokenize(eng: LLMEngine, req: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
    """Engine thread: exactly the ids a completion or chat request with this input would feed
    the model (the chat form goes through the same template rendering as /v1/chat)."""
    if isinstance(req, TokenizeChatRequest):
        messages = [m.as_template_input() for m in req.messages]
        return render_chat_on_engine(eng, messages, req.add_generation_prompt)
    return list(eng.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))


def _detokenize(eng: LLMEngine, ids: list[int]) -> str:
    """Engine thread."""
    vocab = eng.model_config.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(f"token id {bad} is out of range: ids are in [0, {vocab})",
                       param="tokens")
    return eng.tokenizer.decode(ids)


class UtilityRoutes:
    def __init__(self, engine: AsyncEngine, serving: OpenAIServing) -> None:
        self.engine = engine
        self.serving = serving

    def _check_model(self, model: str | None) -> None:
        if model is not None:
            self.serving.check_model(model)

    async def _call(self, fn: Any) -> Any:
        try:
            return await self.engine.call(fn)
        except EngineUnavailableError as e:
            raise APIError(str(e), status=503, type="server_error",
                           code="engine_unavailable") from None

    async def tokenize(self, request: Request) -> JSONResponse:
        req = await _parse_tokenize(request)
        self._check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            if not req.messages:
                raise APIError("messages must not be empty", param="messages")
            if not getattr(self.engine.engine.tokenizer, "chat_template", None):
                raise APIError("this model's tokenizer has no chat template: tokenize a prompt "
                               "instead", param="messages", code="no_chat_template")
        ids = await self._call(lambda eng: _tokenize(eng, req))
        return JSONResponse({"count": len(ids), "max_model_len": self.engine.engine.max_model_len,
                             "tokens": ids})

    async def detokenize(self, request: Request) -> JSONResponse:
        req = validate_body(await read_body(request), DetokenizeRequest)
        self._check_model(req.model)
        text = await self._call(lambda eng: _detokenize(eng, req.tokens))
        return JSONResponse({"prompt": text})

    def register(self, app: FastAPI, book: SchemaBook) -> None:
        app.post("/tokenize", openapi_extra=book.body(TokenizeCompletionRequest,
                                                      TokenizeChatRequest))(self.tokenize)
        app.post("/detokenize", openapi_extra=book.body(DetokenizeRequest))(self.detokenize)

        @app.get("/version")
        async def get_version() -> JSONResponse:
            return JSONResponse({"version": server_version()})
