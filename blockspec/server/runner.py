"""Running the app under uvicorn: in the foreground (`blockspec serve`) or on a background thread
(tests, the soak benchmark), with a shutdown that aborts in-flight requests first."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

GRACEFUL_TIMEOUT_S = 10.0


class Server(uvicorn.Server):
    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # NOTE: uvicorn waits for open connections before the lifespan shutdown, and a stream can
        # run for minutes: abort everything first, so each stream ends at once with an error
        # event and its KV blocks are freed; then the usual drain and lifespan shutdown.
        app = self.config.app
        engine = getattr(getattr(app, "state", None), "engine", None)
        if engine is not None:
            engine.abort_all()
        await super().shutdown(sockets)


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000,
                log_level: str = "info") -> Server:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=GRACEFUL_TIMEOUT_S, access_log=False)
    return Server(config)


class BackgroundServer:
    """`with BackgroundServer(app) as srv: srv.url` on a free loopback port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", log_level: str = "warning",
                 startup_timeout: float = 60.0) -> None:
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))  # NOTE: bound here, so the port cannot be taken meanwhile
        self.host, self.port = self._sock.getsockname()[:2]
        self.server = make_server(app, host, self.port, log_level)
        self._startup_timeout = startup_timeout
        self._thread = threading.Thread(target=self._run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self._sock]))

    def start(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
