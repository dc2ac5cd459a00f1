"""Where a step's first-use time goes: Triton compiles per kernel, CUDA allocator growth, and a
Python profile of a run. Benchmark diagnostics only; nothing here runs while serving."""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import time
from collections.abc import Iterator

import torch

__all__ = ["CompileLog", "allocator_counters", "profiled"]


class CompileLog:
    """Every Triton JIT compile in the process while `active`, as (kernel, seconds, the end of
    its cache key: the constexprs and specialisations)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, str]] = []
        self.active = False
        self._install()

    def _install(self) -> None:
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:  # NOTE: no Triton, nothing compiles
            return
        original = JITFunction._do_compile
        log = self

        def logged(fn_self, key, *args, **kwargs):
            t0 = time.perf_counter()
            out = original(fn_self, key, *args, **kwargs)
            if log.active:
                log.events.append((getattr(fn_self, "__name__", repr(fn_self)),
                                   time.perf_counter() - t0, str(key)[-400:]))
            return out

        JITFunction._do_compile = logged

    def summary(self) -> dict:
        per: dict[str, list] = {}
        for name, s, _ in self.events:
            cell = per.setdefault(name, [0, 0.0])
            cell[0] += 1
            cell[1] += s
        return {"compiles": len(self.events), "seconds": sum(s for _, s, _ in self.events),
                "per_kernel": {k: {"n": n, "s": round(s, 3)} for k, (n, s) in per.items()},
                "keys": [(n, round(s, 3), k) for n, s, k in self.events[:40]]}


def allocator_counters() -> dict:
    """The CUDA caching allocator's cudaMalloc count, OOM retries and reserved bytes."""
    if not torch.cuda.is_available():
        return {}
    st = torch.cuda.memory_stats()
    return {"segments": st.get("segment.all.allocated", 0),
            "alloc_retries": st.get("num_alloc_retries", 0),
            "reserved_gb": st.get("reserved_bytes.all.current", 0) / 2**30}


@contextlib.contextmanager
def profiled(top: int = 30) -> Iterator[dict]:
    """cProfile the block; the dict it yields gets "profile" and "profile_self": the top
    functions by cumulative and by own time, as text."""
    out: dict = {}
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield out
    finally:
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
        out["profile"] = buf.getvalue()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        out["profile_self"] = buf.getvalue()
