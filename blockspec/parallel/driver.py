"""Rank 0's engine under tensor/expert parallelism: it schedules, runs its share of every
forward and tells the workers what to run.

Every call that changes the engine's state (add_request, abort, the closed-batch flag, the
runner's benchmark hooks) is recorded and broadcast with the next step, so the workers' engine
replicas plan the same steps (worker.py). A worker that dies is reported by rank: a collective
with a dead peer fails (gloo at once; NCCL at its timeout), and a watchdog ends the process
when the main thread stays stuck in one.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time

import torch

from blockspec.config import ConfigError, EngineConfig
from blockspec.engine.llm_engine import LLMEngine
from blockspec.engine.step_error import StepError
from blockspec.outputs import RequestOutput
from blockspec.parallel import launch
from blockspec.parallel.state import broadcast_command, init_parallel, shutdown_parallel
from blockspec.sampling_params import SamplingParams

log = logging.getLogger("blockspec")
STUCK_SECONDS = 20.0  # the watchdog's wait for the main thread to see a dead worker itself
_RUNNER_HOOKS = ("set_policy", "set_cost_model", "set_synthetic_acceptance")


class WorkerDiedError(RuntimeError):
    pass


class _RunnerProxy:
    """The runner, with its benchmark hooks recorded for the workers."""

    def __init__(self, runner: object, ops: list) -> None:
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "_ops", ops)

    def __getattr__(self, name: str):
        attr = getattr(self._runner, name)
        if name not in _RUNNER_HOOKS:
            return attr

        def hook(*args):
            out = attr(*args)
            self._ops.append(("runner", (name, args)))
            return out
        return hook

    def __setattr__(self, name: str, value) -> None:
        setattr(self._runner, name, value)


class ParallelEngine(LLMEngine):
    """LLMEngine on rank 0 of `tensor_parallel_size` ranks (one per GPU)."""

    _active: ParallelEngine | None = None

    def __init__(self, config: EngineConfig) -> None:
        if ParallelEngine._active is not None:
            raise ConfigError("one parallel engine per process: shut the previous one down "
                              "(engine.shutdown())")
        self._ops: list[tuple[str, object]] = []
        self._last_step_time: float | None = None
        self._stopped = False
        self._failed: str | None = None
        self.workers: dict = {}
        self._threads = torch.get_num_threads()
        if config.device.startswith("cuda"):
            torch.cuda.set_device(0)
        else:
            torch.set_num_threads(launch.cpu_threads(config))
        if launch.under_torchrun():
            method = "env://"
        else:
            port = config.master_port or launch.free_port()
            self.workers = launch.spawn_workers(config, port)
            method = launch.init_method(config, port)
        ParallelEngine._active = self
        threading.Thread(target=self._watch, daemon=True, name="blockspec-watchdog").start()
        try:
            init_parallel(0, config.tensor_parallel_size, config.expert_parallel_size, method,
                          config.device)
            super().__init__(config)
        except Exception as e:
            self._raise_if_worker_died(e)
            self.shutdown()
            raise
        self.runner = _RunnerProxy(self.runner, self._ops)

    # -- what the workers replay --------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, stream: bool = True,
                    output_kind: str = "cumulative") -> str:
        request_id = super().add_request(prompt, params, request_id, stream, output_kind)
        # NOTE: only after it succeeded here: the workers' copy cannot fail differently
        self._ops.append(("add", dict(prompt=prompt, params=params, request_id=request_id,
                                      stream=stream, output_kind=output_kind)))
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        out = super().abort(request_id)
        self._ops.append(("abort", request_id))
        return out

    def step(self) -> list[RequestOutput]:
        if self._failed is not None:
            raise WorkerDiedError(self._failed)
        try:
            broadcast_command(("step", self._ops, self.closed_batch, self._last_step_time))
            self._ops.clear()
            self._last_step_time = None
            return super().step()
        except Exception as e:
            self._raise_if_worker_died(e)
            raise

    def _observe_step_time(self, seconds: float) -> None:
        self._last_step_time = seconds
        super()._observe_step_time(seconds)

    # -- failures and shutdown -----------------------------------------------------------------
    def _dead_worker(self) -> str | None:
        for rank, p in self.workers.items():
            if p.exitcode is not None:
                return f"parallel worker rank {rank} died (exit code {p.exitcode})"
        return None

    def _raise_if_worker_died(self, error: Exception) -> None:
        """Re-raises a collective's failure as WorkerDiedError naming the rank that caused it."""
        cause = error.cause if isinstance(error, StepError) else error
        if isinstance(cause, ConfigError):
            return  # NOTE: rank 0's own refusal (every rank refuses alike): the real message
        dead = self._dead_worker()
        if dead is None:
            time.sleep(1.0)  # NOTE: a peer's sockets close a moment before its exit is seen
            dead = self._dead_worker()
        if dead is None and "gloo" not in str(cause).lower() \
                and "nccl" not in str(cause).lower():
            return
        self._failed = f"{dead or 'a parallel worker on another node failed'}: {cause}"
        self.shutdown()
        raise WorkerDiedError(self._failed) from error

    def _watch(self) -> None:
        """Ends the process when a worker died and the main thread did not notice within
        STUCK_SECONDS (it waits in a collective that never returns: NCCL without a timeout)."""
        while not self._stopped:
            dead = self._dead_worker()
            if dead is not None:
                deadline = time.monotonic() + STUCK_SECONDS
                while time.monotonic() < deadline and self._failed is None \
                        and not self._stopped:
                    time.sleep(0.2)
                if self._failed is None and not self._stopped:
                    log.error("%s; rank 0 is stuck in a collective: exiting", dead)
                    os._exit(1)
                return
            time.sleep(0.5)

    def shutdown(self) -> None:
        """Stops the workers and leaves the process group (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        if self._failed is None and self._dead_worker() is None:
            try:
                broadcast_command(("stop",))
            except Exception:  # noqa: BLE001 - shutting down: the workers are stopped below
                pass
        for p in self.workers.values():
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        shutdown_parallel()
        torch.set_num_threads(self._threads)
        ParallelEngine._active = None


@atexit.register
def _shutdown_active() -> None:
    """Stops the live parallel engine's workers at exit. NOTE: registered once, holding no
    engine: an engine shut down by hand is freed."""
    if ParallelEngine._active is not None:
        ParallelEngine._active.shutdown()


def make_engine(config: EngineConfig) -> LLMEngine:
    """LLMEngine on one GPU (exactly today's path), ParallelEngine with tensor parallelism.
    NOTE: on a node other than node 0 (`node_rank` > 0, or a torchrun rank > 0) this process
    is only a host of workers: it runs them until rank 0 stops them and exits, never
    returning, so the same command line serves every node."""
    if config.tensor_parallel_size == 1:
        return LLMEngine(config)
    if launch.under_torchrun() and int(os.environ["RANK"]) > 0:
        launch.torchrun_main(config)
    if config.node_rank > 0 and not launch.under_torchrun():
        sys.exit(launch.run_node(config))
    return ParallelEngine(config)
