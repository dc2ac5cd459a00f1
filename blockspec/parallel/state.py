"""This process's place in the parallel group, and the few collectives the model uses.

One global group (like vLLM's parallel_state): the model's collectives run on the default group
(NCCL on GPU, gloo on CPU); the step commands rank 0 sends go over a second, gloo group whose
timeout is long, so an idle server's workers wait for work without timing out.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# NOTE: a collective of the forward waits this long for a peer before it raises; a dead peer
# under gloo raises at once (its sockets close), this bounds the rest.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
COMMAND_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class ParallelState:
    rank: int
    world_size: int
    expert_parallel_size: int
    command_group: object  # the gloo group of the step commands

    @property
    def expert_tp_size(self) -> int:
        """Ranks that split one expert's weights (the group of ranks holding the same experts)."""
        return self.world_size // self.expert_parallel_size

    @property
    def expert_group(self) -> int:
        """Which of the expert_parallel_size groups of experts this rank holds."""
        return self.rank // self.expert_tp_size

    @property
    def expert_tp_rank(self) -> int:
        return self.rank % self.expert_tp_size


_STATE: ParallelState | None = None


def init_parallel(rank: int, world_size: int, expert_parallel_size: int, init_method: str,
                  device: str) -> ParallelState:
    """Joins the group (blocks until every rank has); `init_method`: tcp://addr:port."""
    global _STATE
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    _STATE = ParallelState(rank, world_size, expert_parallel_size, commands)
    return _STATE


def get_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("tensor parallel state is not initialised (init_parallel)")
    return _STATE


def shutdown_parallel() -> None:
    global _STATE
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over every rank, in place (the returned tensor is `x`)."""
    dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` [..., n] concatenated along the last dim, rank order."""
    parts = [torch.empty_like(x) for _ in range(get_state().world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def all_min(value: int, device: torch.device) -> int:
    """The smallest `value` over every rank (ranks must agree on sizes such as the KV blocks)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def broadcast_command(obj: object) -> object:
    """Rank 0's `obj` on every rank (rank 0 passes it, the others pass None)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=get_state().command_group)
    return box[0]


def every_rank(flag: bool) -> bool:
    """Whether `flag` holds on every rank (over the command group: host tensors)."""
    t = torch.tensor([int(flag)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=get_state().command_group)
    return bool(t.item())
