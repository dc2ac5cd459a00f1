"""Starting the ranks: rank 0 is the calling process; the other ranks of its node are spawned
worker processes (torch.multiprocessing, "spawn"). Node k > 0 of a multi-node run only starts
its workers (`run_node`). Under torchrun every rank is a torchrun process (`torchrun_main`).

Ranks are node-major: node k holds ranks [k * per_node, (k + 1) * per_node), local rank i on
GPU i.
"""

from __future__ import annotations

import logging
import os
import socket
import sys

import torch.multiprocessing as mp

from blockspec.config import EngineConfig

log = logging.getLogger("blockspec")


def layout_label(tensor_parallel_size: int, expert_parallel_size: int) -> str:
    """"TP8", "EP8" (whole experts per GPU), "EP4x2" (4 expert groups of 2 GPUs); "" on one
    GPU."""
    tp, ep = tensor_parallel_size, expert_parallel_size
    if tp == 1:
        return ""
    if ep == 1:
        return f"TP{tp}"
    return f"EP{ep}" if ep == tp else f"EP{ep}x{tp // ep}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_threads(config: EngineConfig) -> int:
    """A CPU rank's share of the node's cores. NOTE: ranks spinning in a collective beside
    ranks running OpenMP over all cores slow every step ~10x (2 ranks on 2 cores)."""
    per_node = config.tensor_parallel_size // config.nnodes
    return max(1, (os.cpu_count() or 1) // per_node)


def init_method(config: EngineConfig, port: int) -> str:
    return f"tcp://{config.master_addr}:{port}"


def spawn_workers(config: EngineConfig, port: int) -> dict[int, mp.Process]:
    """This node's worker processes (rank -> process), rank 0 excluded: it is the caller."""
    from blockspec.parallel.worker import worker_main

    per_node = config.tensor_parallel_size // config.nnodes
    ctx = mp.get_context("spawn")
    workers = {}
    for local in range(per_node):
        rank = config.node_rank * per_node + local
        if rank == 0:
            continue
        p = ctx.Process(target=worker_main, args=(config, rank, local, init_method(config, port)),
                        name=f"blockspec-rank{rank}", daemon=True)
        p.start()
        workers[rank] = p
    return workers


def run_node(config: EngineConfig) -> int:
    """Node `config.node_rank` > 0: runs this node's workers until rank 0 stops them; returns
    the exit code (non-zero when one failed)."""
    workers = spawn_workers(config, config.master_port)
    code = 0
    try:
        for rank, p in workers.items():
            p.join()
            if p.exitcode:
                log.error("parallel worker rank %d exited with code %s", rank, p.exitcode)
                code = 1
    except KeyboardInterrupt:
        code = 130
    finally:
        for p in workers.values():
            if p.is_alive():
                p.terminate()
    return code


def torchrun_main(config: EngineConfig) -> None:
    """A torchrun-started process of rank RANK > 0 (torchrun sets RANK, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT): the worker loop. Rank 0 runs the command itself."""
    from blockspec.parallel.worker import worker_main

    # NOTE: env://: the rendezvous torchrun already holds at MASTER_ADDR:MASTER_PORT
    worker_main(config, int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)),
                "env://")
    sys.exit(0)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ
