"""Reading JSON request bodies: media type, size bound, strict validation into a pydantic model."""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from blockspec.server.errors import APIError, from_validation

MAX_BODY_BYTES = 16 << 20  # far above any prompt that fits a context; bounds memory per request
M = TypeVar("M", bound=BaseModel)


def is_json_media_type(content_type: str) -> bool:
    """`application/json` or `application/<anything>+json`, any parameters, any case."""
    mime = content_type.split(";", 1)[0].strip().lower()
    kind, _, subtype = mime.partition("/")
    return kind == "application" and (subtype == "json"
                                      or (subtype.endswith("+json") and len(subtype) > 5))


def check_json_content_type(request: Request) -> None:
    """415 unless the request says it carries JSON.

    NOTE: this is a CSRF guard, not pedantry: a web page can make a browser POST `text/plain`
    (or a form) to a keyless local server without a CORS preflight, and the body would
    otherwise be read as JSON. `application/json` always triggers a preflight, which this
    server never answers, so a browser cannot send it cross-origin."""
    values = request.headers.getlist("content-type")
    got = values[0] if len(values) == 1 else None
    if got is not None and is_json_media_type(got):
        return
    what = "no Content-Type" if not values else \
        "several Content-Type headers" if len(values) > 1 else f"Content-Type '{got}'"
    raise APIError(f"the request body must be JSON with Content-Type: application/json "
                   f"(got {what})", status=415, code="unsupported_media_type")


async def read_body(request: Request) -> bytes:
    """The raw body of a JSON request, refused (415) before reading when it is not JSON."""
    check_json_content_type(request)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise APIError(f"request body larger than {MAX_BODY_BYTES} bytes", status=413)
    return bytes(body)


def validate_body(raw: bytes, model: type[M]) -> M:
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise from_validation(e) from None


async def parse_body(request: Request, model: type[M]) -> M:
    return validate_body(await read_body(request), model)
