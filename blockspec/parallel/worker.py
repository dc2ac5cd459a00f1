"""A parallel worker (ranks 1..N-1): the same engine as rank 0, driven by rank 0's commands.

Each step rank 0 broadcasts what changed since the last one (requests added or aborted, the
benchmark hooks it called, whether the batch is closed, its last step's wall time for the
speculation policy); the worker applies it and runs the same step. The scheduler, the block
manager and the sampler are deterministic given those inputs, so every rank plans the same step
and samples the same tokens from the same gathered logits: the collectives inside the forward
are the only traffic besides the commands.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch

from blockspec.config import EngineConfig
from blockspec.engine.llm_engine import LLMEngine
from blockspec.engine.step_error import StepError
from blockspec.parallel.launch import cpu_threads
from blockspec.parallel.state import broadcast_command, init_parallel, shutdown_parallel

log = logging.getLogger("blockspec")


class WorkerEngine(LLMEngine):
    """LLMEngine whose speculation policy sees rank 0's step times, not its own (the policy's
    choices must match rank 0's)."""

    def _observe_step_time(self, seconds: float) -> None:
        pass  # NOTE: runner.timed_step stays set until rank 0's time arrives (apply)

    def apply(self, command: tuple) -> bool:
        """Runs one command of rank 0's; False on "stop"."""
        if command[0] == "stop":
            return False
        _, ops, closed_batch, last_step_time = command
        if last_step_time is not None:
            self.runner.observe_step_time(last_step_time)
        for op, args in ops:
            if op == "add":
                self.add_request(**args)
            elif op == "abort":
                self.abort(args)
            else:  # "runner": a benchmark hook (set_policy, set_synthetic_acceptance, ...)
                name, call_args = args
                getattr(self.runner, name)(*call_args)
        self.closed_batch = closed_batch
        try:
            self.step()
        except StepError as e:
            if e.fatal:  # NOTE: rank 0 fails the same step's requests and goes on, or stops
                raise
        return True


def _exit_with_parent() -> None:
    """Ends this worker when the process that started it is gone (rank 0 killed by SIGKILL or
    SIGTERM has no chance to stop it, and an NCCL collective would wait for it forever)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="blockspec-parent-watch").start()


def worker_main(config: EngineConfig, rank: int, local_rank: int, init_method: str) -> None:
    """The entry point of a spawned worker process."""
    _exit_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(message)s")
    if config.device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(cpu_threads(config))
    try:
        init_parallel(rank, config.tensor_parallel_size, config.expert_parallel_size,
                      init_method, config.device)
        engine = WorkerEngine(config)
        while engine.apply(broadcast_command(None)):
            pass
    except KeyboardInterrupt:
        sys.exit(0)  # NOTE: Ctrl-C reaches every process of the terminal: rank 0 reports it
    except Exception:
        log.exception("parallel worker rank %d failed", rank)
        sys.exit(1)
    finally:
        shutdown_parallel()
