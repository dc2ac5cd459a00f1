"""The Python heap while one engine serves: collected once, then frozen.

A full (oldest-generation) collection walks every object alive: after an engine's start that is
its modules, parameters, graphs' outputs and tokenizer (~230K objects for the demo pair), 130-160
ms on this project's machines, and the collector starts one whenever enough new objects have
piled up, inside whatever step runs then (a 160 ms host stall in one step of a C=1 level on an
H200: docs/benchmarks.md). Frozen, those objects are skipped by every collection (vLLM freezes
its engine core's heap after start-up for the same reason).
NOTE: frozen objects are never collected, so a process that builds engine after engine would
keep the reference cycles of those it dropped: the heap is frozen only around one engine's
serving or benchmark run, and unfrozen after it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Collects, freezes the heap for the block, and puts the frozen objects back after it."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
