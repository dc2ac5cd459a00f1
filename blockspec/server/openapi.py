"""Request-body schemas for /openapi.json.

The POST routes read their bodies by hand (`parse_body`), so FastAPI sees no body parameter and
documents none. `SchemaBook` turns the pydantic models into `openapi_extra` request bodies and,
when the document is first built, files every schema under `components/schemas`, where each
`$ref` it emitted points.
"""

from __future__ import annotations

import warnings
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


class SchemaBook:
    def __init__(self) -> None:
        self.schemas: dict[str, dict[str, Any]] = {}

    def _file(self, name: str, schema: dict[str, Any]) -> None:
        # NOTE: one name, one schema: two models of the same name would make a $ref ambiguous.
        if self.schemas.setdefault(name, schema) != schema:
            raise ValueError(f"two different schemas are both named {name!r}")

    def ref(self, model: type[BaseModel]) -> dict[str, str]:
        """Files `model` (and the models it uses) and returns a `$ref` to it."""
        schema = model.model_json_schema(ref_template=_REF)
        # NOTE: pydantic puts every nested model in one top-level `$defs`, already referenced
        # through `_REF`; moving them to components makes those references resolve.
        for name, sub in schema.pop("$defs", {}).items():
            self._file(name, sub)
        self._file(model.__name__, schema)
        return {"$ref": _REF.format(model=model.__name__)}

    def body(self, *models: type[BaseModel]) -> dict[str, Any]:
        """`openapi_extra` for a route whose JSON body is one of `models`."""
        refs = [self.ref(m) for m in models]
        schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
        return {"requestBody": {"required": True,
                                "content": {"application/json": {"schema": schema}}}}

    def install(self, app: FastAPI) -> None:
        """Adds the filed schemas to the app's document the first time it is built."""
        build = app.openapi

        def openapi() -> dict[str, Any]:
            if app.openapi_schema is None:
                with warnings.catch_warnings():  # fixed by _unique_operation_ids
                    warnings.filterwarnings("ignore", "Duplicate Operation ID", UserWarning)
                    doc = build()  # NOTE: caches itself in app.openapi_schema, completed in place
                _unique_operation_ids(doc)
                components = doc.setdefault("components", {}).setdefault("schemas", {})
                for name, schema in self.schemas.items():
                    if components.setdefault(name, schema) != schema:
                        raise ValueError(f"FastAPI already documents a schema named {name!r}")
            return app.openapi_schema

        app.openapi = openapi  # type: ignore[method-assign]


def _unique_operation_ids(doc: dict[str, Any]) -> None:
    """FastAPI gives every method of a multi-method route (GET and HEAD /health) the same
    operationId, which OpenAPI forbids: suffix the repeats with their method."""
    seen: set[str] = set()
    for path_item in doc.get("paths", {}).values():
        for method, op in path_item.items():
            op_id = op.get("operationId") if isinstance(op, dict) else None
            if op_id is None:
                continue
            if op_id in seen:
                op["operationId"] = op_id = f"{op_id}_{method}"
            seen.add(op_id)
