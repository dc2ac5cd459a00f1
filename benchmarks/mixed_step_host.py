"""Host time of a mixed step's input side (CPU, no model): the scheduler's step with the default
speculative prefill cap, the flat batch built from it, and the flat buffers filled, for the shape
of issue 20's C=32 closed loop (decoding sequences verifying blocks of 8 beside arriving 512-token
prompts). What a synchronous mixed step pays on the host before its device work starts.

Usage: python benchmarks/mixed_step_host.py [--decoding 28] [--waiting 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from blockspec.bench.common import environment, recorded_command
from blockspec.bench.mixed_profile import BLOCK, PROMPT, host_state
from blockspec.engine.flat_batch import FlatBatch
from blockspec.engine.flat_step import FlatBuffers


def time_once(decoding: int, waiting: int, bufs: FlatBuffers) -> tuple[float, ...]:
    sched, bm = host_state(decoding, waiting)
    t0 = time.perf_counter()
    out = sched.schedule(budget_lookahead=BLOCK - 1)
    t1 = time.perf_counter()
    blens = [BLOCK if n == 1 else 0 for n in out.num_new_tokens]
    batch = FlatBatch.build(out.seqs, out.num_new_tokens, blens, BLOCK, bm)
    t2 = time.perf_counter()
    bufs.fill(batch, 0, write_context=True)
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, float(len(batch.input_ids))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decoding", type=int, default=28)
    ap.add_argument("--waiting", type=int, default=2)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    bufs = FlatBuffers.allocate(2048, 257, 64, torch.device("cpu"))
    runs = np.array([time_once(a.decoding, a.waiting, bufs) for _ in range(a.iters + 3)][3:])
    med = np.median(runs, axis=0)
    res = {"benchmark": "mixed_step_host", "command": recorded_command(
        "benchmarks/mixed_step_host.py"), "environment": environment(),
        "decoding": a.decoding, "waiting": a.waiting, "block": BLOCK, "prompt": PROMPT,
        "step_tokens": int(med[3]),  # verify rows and prompt tokens: the flat batch
        "median_ms": {"schedule": 1e3 * med[0], "flat_batch_build": 1e3 * med[1],
                      "flat_buffers_fill": 1e3 * med[2]}}
    print(f"{a.decoding} decoding (block {BLOCK}) + {a.waiting} waiting prompts of {PROMPT}: "
          f"a step of {int(med[3])} tokens; median ms: schedule {1e3 * med[0]:.3f}, "
          f"flat batch {1e3 * med[1]:.3f}, buffers {1e3 * med[2]:.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
