"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, never a bare 500/422."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from blockspec.config import ConfigError

logger = logging.getLogger("blockspec.server")


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | int | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.type = message, status, param, type
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def from_validation(e: ValidationError | RequestValidationError) -> APIError:
    """The first pydantic error, named by its field path (`body` and union branches dropped)."""
    err = e.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return APIError(f"request body is not valid JSON: {err.get('msg')}", code="invalid_json")
    if not loc:
        return APIError(f"invalid request body: {err.get('msg')}")
    # NOTE: strict unions report per-branch locations ("stop.str", "stop.list[str]"); the user
    # sent one field, so name the field and the first index, not the branch.
    path = [p for p in loc if not re.fullmatch(r"[a-z]+\[.*\]|str|int|float|bool", p)]
    where = ".".join(path) or loc[0]
    if err.get("type") == "missing":
        return APIError(f"missing required field '{where}'", param=loc[0])
    if err.get("type") == "extra_forbidden":
        # NOTE: protocol.py's models rely on this wording for their unknown fields too.
        return APIError(f"unknown field '{where}'", param=loc[0])
    return APIError(f"invalid value for '{where}': {err.get('msg')}", param=loc[0])


_PARAM = re.compile(r"^(\w+) must")


def from_config_error(e: ConfigError, rename: dict[str, str] | None = None,
                      default_param: str | None = None) -> APIError:
    """ConfigError messages start with the parameter they blame ("top_p must be ...")."""
    msg = str(e)
    m = _PARAM.match(msg)
    param = m.group(1) if m else default_param
    if param and rename:
        param = rename.get(param, param)
    return APIError(msg, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        return from_validation(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        # NOTE: the exception's headers are part of the answer (405 must carry `Allow`).
        resp = APIError(str(e.detail), status=e.status_code, code=e.status_code).response()
        resp.headers.update(e.headers or {})
        return resp

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")
        return APIError("internal server error", status=500, type="server_error").response()
