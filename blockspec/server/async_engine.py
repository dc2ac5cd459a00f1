"""The step-level engine on its own thread, driven from asyncio.

Torch work never runs on the event loop: one engine thread owns the `LLMEngine` and is the only
thread that steps it or changes its state. The event loop talks to it through a thread-safe op
queue (add, abort, call, stop); the engine thread answers through each request's `asyncio.Queue`,
fed with `loop.call_soon_threadsafe`. Between two steps the thread drains every pending op, so
requests that arrive together join the same batch, and an abort frees its KV blocks before the
next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from blockspec.config import ConfigError
from blockspec.engine.llm_engine import LLMEngine
from blockspec.engine.step_error import StepError
from blockspec.outputs import RequestOutput
from blockspec.sampling_params import SamplingParams
from blockspec.server.engine_ops import Abort, Add, Call, Prompt, Stop, resolve
from blockspec.server.engine_stats import EngineStats
from blockspec.server.stream import (
    ACCEPTED,
    EngineUnavailableError,
    RequestFailedError,
    RequestStream,
)

logger = logging.getLogger("blockspec.server")
T = TypeVar("T")


class AsyncEngine:
    def __init__(self, engine: LLMEngine,
                 on_finished: Callable[[RequestOutput], None] | None = None,
                 on_iteration: Callable[[EngineStats], None] | None = None) -> None:
        """`on_finished(output)` runs once per finished request, `on_iteration(stats)` after
        every engine iteration; both on the engine thread (keep them cheap)."""
        self.engine = engine
        self.stats = EngineStats(num_blocks=engine.block_manager.num_blocks)
        self._on_finished = on_finished
        self._on_iteration = on_iteration
        self._ops: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # NOTE: engine thread only
        self._lock = threading.Lock()  # guards _accepting/_closed against the thread's exit
        self._accepting = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # why the engine thread died, if it did
        self.died = threading.Event()  # set when the thread ends on an error
        self.num_step_failures = 0  # engine thread only; published in EngineStats

    # -- event-loop side ------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="blockspec-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def _abort_later(self, request_id: str) -> None:
        self.submit(Abort(request_id), strict=False)

    def _refuse_then(self, op: Any) -> None:
        with self._lock:
            self._accepting = False
            if not self._closed:
                self._ops.put(op)

    def submit(self, op: Any, strict: bool = True) -> None:
        with self._lock:
            if self._closed or (strict and not self._accepting):
                if strict:
                    raise EngineUnavailableError(
                        "the engine is not running" if self._closed or self._thread is None
                        else "the server is shutting down")
                return
            self._ops.put(op)

    async def add(self, prompt: Prompt, params: SamplingParams, request_id: str) -> RequestStream:
        """Queues a request; returns once the engine has accepted it. Raises ConfigError for a
        bad request (the engine's validation: prompt length, KV capacity, token ids)."""
        stream = RequestStream(request_id, self._abort_later)
        self.submit(Add(prompt, params, stream))
        try:
            item = await stream.get()
        except asyncio.CancelledError:
            stream.abort()  # NOTE: ops run in order, so this abort lands after the add
            raise
        assert item is ACCEPTED
        return stream

    async def generate(self, prompt: Prompt, params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        stream = await self.add(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()  # no-op once finished; frees the KV blocks of an abandoned request

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs `fn(engine)` on the engine thread (tokenizer work that must not race it)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self.submit(Call(fn, loop, fut))
        return await fut

    def abort_all(self) -> None:
        """Stop accepting and abort everything in flight (start of a graceful shutdown)."""
        self._refuse_then(Abort(None))

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting, abort what is in flight, join the engine thread."""
        self._refuse_then(Stop())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    # -- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as e:  # noqa: B036 - the thread must report, whatever happened
            logger.exception("engine thread died")
            self.error = e
        finally:
            self._close()
            if self.error is not None:
                self.died.set()

    def _iterate(self) -> bool:
        eng = self.engine
        busy = eng.has_unfinished()
        # NOTE: nothing schedulable while busy (a waiting request whose blocks are not free yet
        # and nothing running) would spin; a short wait on the op queue avoids burning a core.
        stalled = busy and not eng.scheduler.running
        ops = self._take_ops(None if not busy else (1e-3 if stalled else 0.0))
        for op in ops:
            if isinstance(op, Stop):
                self._abort(None)
                return False
            self._handle(op)
        if eng.has_unfinished():
            try:
                outs = eng.step()
            except StepError as e:
                self._fail_step(e)
                outs = []
            for out in outs:
                self._emit(out)
        self._publish()
        return True

    def _fail_step(self, e: StepError) -> None:
        """Fail the step's requests and go on; a fault that leaves the device state untrusted
        ends the thread (the server then exits non-zero, see `died`)."""
        self.num_step_failures += 1
        logger.error("engine step failed (%d requests): %s", len(e.outputs), e,
                     exc_info=e.cause)
        for out in e.outputs:
            stream = self._streams.pop(out.request_id, None)
            self._finished(out)
            if stream is not None:
                stream.put(RequestFailedError(str(e)))
        if e.fatal:
            raise e

    def _take_ops(self, timeout: float | None) -> list[Any]:
        ops = []
        try:
            ops.append(self._ops.get(timeout=timeout) if timeout != 0.0
                       else self._ops.get_nowait())
            while True:
                ops.append(self._ops.get_nowait())
        except queue.Empty:
            pass
        return ops

    def _handle(self, op: Any) -> None:
        if isinstance(op, Add):
            self._add(op)
        elif isinstance(op, Abort):
            self._abort(op.request_id)
        elif isinstance(op, Call):
            try:
                result, exc = op.fn(self.engine), None
            except Exception as e:
                result, exc = None, e
            resolve(op, result, exc)

    def _add(self, op: Add) -> None:
        rid = op.stream.request_id
        try:
            # NOTE: max_tokens None ("up to the context") is the engine's to resolve: what the
            # context and the KV cache hold (admission.resolve_max_tokens).
            self.engine.add_request(op.prompt, op.params, rid, stream=True)
        except (ConfigError, ValueError, TypeError, OverflowError) as e:
            # NOTE: add_request validates before it mutates anything, so the engine is intact.
            op.stream.put(e if isinstance(e, ConfigError) else ConfigError(str(e)))
            return
        except Exception as e:  # a bug, not a bad request: fail this one, keep the engine
            logger.exception("add_request failed")
            op.stream.put(RequestFailedError(f"the engine could not add the request: "
                                             f"{type(e).__name__}: {e}"))
            return
        self._streams[rid] = op.stream
        op.stream.put(ACCEPTED)

    def _abort(self, request_id: str | None) -> None:
        for rid in [request_id] if request_id is not None else list(self._streams):
            out = self.engine.abort(rid)
            if out is not None:
                self._emit(out)
            else:
                self._streams.pop(rid, None)

    def _emit(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if out.finished:
            self._streams.pop(out.request_id, None)
            self._finished(out)
        if stream is not None:
            stream.put(out)

    def _finished(self, out: RequestOutput) -> None:
        if self._on_finished is not None:
            try:
                self._on_finished(out)
            except Exception:
                logger.exception("on_finished hook failed")

    def _publish(self) -> None:
        self.stats = EngineStats.of(self.engine, self.num_step_failures)
        if self._on_iteration is not None:
            try:
                self._on_iteration(self.stats)
            except Exception:
                logger.exception("on_iteration hook failed")

    def _close(self) -> None:
        """Fail whatever is still waiting on this thread; nothing can be queued after this."""
        with self._lock:
            self._closed = True
            self._accepting = False
        reason = ("the engine stopped" if self.error is None
                  else f"the engine failed: {type(self.error).__name__}: {self.error}")
        for stream in self._streams.values():
            stream.put(EngineUnavailableError(reason))
        self._streams.clear()
        if self.error is None:
            self._publish()
        for op in self._take_ops(0.0):
            if isinstance(op, Add):
                op.stream.put(EngineUnavailableError(reason))
            elif isinstance(op, Call):
                resolve(op, None, EngineUnavailableError(reason))
