"""`blockspec serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from blockspec.config import ConfigError, EngineConfig
from blockspec.hub import served_name


def add_serve_parser(subparsers: Any,
                     add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model folder or Hugging Face Hub id, as --model (vLLM's `serve MODEL`)")
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes "
                        "the server to the network, use it with --api-key)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("BLOCKSPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: "
                        "$BLOCKSPEC_API_KEY; none: no authentication)")
    s.add_argument("--served-model-name", default=None,
                   help="model id clients send as `model` (default: the model folder's name, or "
                        "the Hub id)")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per finished request (id, tokens, TTFT, tok/s, acceptance "
                        "length, finish reason, status)")
    s.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic engine stats line (running, waiting, KV use, tok/s, "
                        "acceptance length) while busy")
    p.set_defaults(func=_serve_with_shared_helpers)


def _serve_with_shared_helpers(args: argparse.Namespace) -> int:
    # NOTE: imported at call time: blockspec.cli imports this module to register `serve`.
    from blockspec import cli

    return cmd_serve(args, cli.engine_kwargs, cli.resolve_model)


def cmd_serve(args: argparse.Namespace, engine_kwargs: Callable[[argparse.Namespace], dict],
              resolve_model: Callable[[argparse.Namespace], str]) -> int:
    from blockspec.parallel.driver import make_engine
    from blockspec.server.api import build_app
    from blockspec.server.runner import make_server

    args.model = model_arg(args.model_tag, args.model)
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    check_bind(args.host, args.port)  # NOTE: before loading a model that may take minutes
    model = resolve_model(args)  # NOTE: first: it may pick the demo pair's drafter
    kwargs = engine_kwargs(args)
    # NOTE: synthetic acceptance changes the output; it is benchmark-only and never served.
    if kwargs.pop("synthetic_acceptance", None) is not None:
        raise ConfigError("synthetic acceptance is benchmark-only and cannot be served")
    kwargs.pop("benchmark_mode", None)
    engine = make_engine(EngineConfig(model=model, **kwargs))
    name = args.served_model_name or served_name(model)
    app = build_app(engine, name, api_key=args.api_key,
                    log_requests=not args.disable_log_requests,
                    log_stats_interval=None if args.disable_log_stats else 10.0)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    auth = "API key required" if args.api_key else "no API key"
    print(f"[blockspec] serving {name!r} ({engine.config.model_path}) on "
          f"http://{args.host}:{args.port}/v1 "
          f"({auth}; device {engine.config.device}, {engine.block_manager.num_blocks} KV blocks, "
          f"context {engine.max_model_len})", file=sys.stderr)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"[blockspec] warning: listening on {args.host} without --api-key: anyone who can "
              "reach this port can use the model", file=sys.stderr)
    server = make_server(app, args.host, args.port, args.log_level)
    engine_thread = app.state.engine
    threading.Thread(target=_exit_when_engine_dies, args=(engine_thread, server), daemon=True,
                     name="blockspec-watchdog").start()
    server.run()
    if engine_thread.error is not None:
        # NOTE: non-zero, so a supervisor restarts a server whose engine can no longer serve
        print(f"blockspec: error: the engine failed: {type(engine_thread.error).__name__}: "
              f"{engine_thread.error}", file=sys.stderr)
        return 1
    return 0


def model_arg(positional: str | None, flag: str | None) -> str | None:
    """`serve MODEL` and `serve --model MODEL` are one argument: given twice, it must agree."""
    if positional is not None and flag is not None and positional != flag:
        raise ConfigError(f"two models given: {positional!r} (positional) and --model {flag!r}; "
                          "give one")
    return positional if positional is not None else flag


def check_bind(host: str, port: int) -> None:
    """Raises ConfigError when the server could not listen on host:port (a name that does not
    resolve, an address not on this machine, a port in use or not allowed)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"--host {host!r} does not resolve: {e}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # NOTE: as uvicorn binds (SO_REUSEADDR): a port in TIME_WAIT is free, one in use is not
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _exit_when_engine_dies(engine: Any, server: Any) -> None:
    """A dead engine thread (a fault that leaves the device state untrusted) stops the server:
    a live process that answers 503 forever helps nobody."""
    engine.died.wait()
    server.should_exit = True
