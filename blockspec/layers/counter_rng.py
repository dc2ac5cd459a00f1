"""Counter-based randomness for sampling: a uniform draw is a pure function of (request seed,
output position), so a seeded request draws the same token at a position however the engine
stepped (block length, batch, preemption, speculative or plain).

splitmix64 (Steele, Lea, Flood 2014) in numpy's wrapping uint64 arithmetic, on the host: one
draw per sampled row, identical on every device.
"""

from __future__ import annotations

import numpy as np

_MASK = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_POSITION_SALT = np.uint64(0xD1B54A32D192ED03)


def _mix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def seed_word(seed: int) -> int:
    """Any seed a request may carry ([-2^63, 2^64)) as one uint64 word."""
    return seed & _MASK


def derive_seed(engine_seed: int, counter: int) -> int:
    """The seed of a request that brought none: the engine seed and the request's arrival number,
    so an engine started with the same `--seed` replays the same requests the same way."""
    a = _mix(np.array([seed_word(engine_seed)], dtype=np.uint64))
    return int(_mix(a ^ np.array([seed_word(counter)], dtype=np.uint64))[0])


def uniforms(seeds: list[int], positions: list[int]) -> np.ndarray:
    """One draw in (0, 1) per (seed, output position) pair, as float64 (53 random bits)."""
    s = _mix(np.array([seed_word(x) for x in seeds], dtype=np.uint64))
    with np.errstate(over="ignore"):
        p = np.array(positions, dtype=np.uint64) * _POSITION_SALT
    h = _mix(s ^ _mix(p))
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
