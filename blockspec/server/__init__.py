"""OpenAI-compatible HTTP server: `build_app(engine_or_config, served_model_name, api_key)`.

Nothing is imported eagerly: `blockspec.cli` imports `blockspec.server.cli` to register `serve`,
and other subcommands should not pay for FastAPI.
"""

from typing import Any

__all__ = ["AsyncEngine", "build_app"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from blockspec.server.api import build_app

        return build_app
    if name == "AsyncEngine":
        from blockspec.server.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
