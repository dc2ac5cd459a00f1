"""The drafter run's schedule: how many steps, the learning-rate curve, and which sequences each
step trains on (pure functions of the step, so a resumed run replays the uninterrupted one)."""

from __future__ import annotations

import functools
import math
import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blockspec.train.drafter_train import TrainArgs


def total_steps(args: TrainArgs, n_train: int) -> int:
    """`--steps` when given, else `--epochs` (default 1) over `n_train` sequences."""
    if args.steps is not None:
        return args.steps
    epochs = args.epochs if args.epochs is not None else 1.0
    return max(1, math.ceil(epochs * n_train / args.batch_size))


def lr_factor(progress: float, warmup_frac: float) -> float:
    """Linear warm-up then cosine to 0, as a function of the run's progress in [0, 1]."""
    if progress < warmup_frac:
        return max(progress / warmup_frac, 1e-3)
    t = (progress - warmup_frac) / max(1e-9, 1.0 - warmup_frac)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))


def batch_indices(step: int, batch_size: int, n: int, seed: int) -> list[int]:
    """The sequences of `step`: a fresh permutation per epoch, a pure function of the step, so
    a resumed run sees exactly the data the uninterrupted one would have."""
    out = []
    for j in range(step * batch_size, (step + 1) * batch_size):
        epoch, k = divmod(j, n)
        out.append(_epoch_order(n, seed, epoch)[k])
    return out


@functools.lru_cache(maxsize=2)
def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    perm = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(perm)
    return perm
