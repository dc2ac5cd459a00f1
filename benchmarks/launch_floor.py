"""What a chain of kernel launches costs by itself in a CUDA graph, one GPU, one run (issues 21
and 23: how much of a batch-1 MoE step's time over its bytes floor no kernel can win back).

A batch-1 decode step is a chain of dependent kernels (Moonlight-16B-A3B's: 343 a step, the
Kimi-width INT4 slice's: 162; benchmarks/profile_step.py). Here each link of the chain is a
kernel that does nothing but its dependency: program 0 reads one int the previous kernel wrote
and writes it + 1 for the next (the value at the end proves the order). The chain of N such
kernels is captured in one CUDA graph, launched with programmatic dependent launch (the next kernel
allowed to launch on a program's entry, the decode path's way (layers/pdl.py), after its store,
or at its exit) and without, at grids of 1, one per SM and eight per SM programs of
4 warps; each is the median of 50 replays (after 5). Per link: the replay over N.

Against it, the persistent alternative (a kernel per layer or step): one grid of a program an
SM running N phases, each a grid barrier (an atomic a program, then polling) and the same reads
after it, or before it (weights a phase can read while it waits).

Usage: python benchmarks/launch_floor.py --out FILE.json [--links 343,162]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from blockspec.bench.common import git_commit, recorded_command
from blockspec.bench.gpu_timing import event_times
from blockspec.layers.pdl import pdl_enabled, pdl_sync


@triton.jit
def _link_kernel(src, dst, weights, sink, USE_PDL: tl.constexpr, TRIGGER: tl.constexpr,
                 WORK: tl.constexpr):
    """TRIGGER (with USE_PDL): 0 lets the next kernel launch on entry (pdl_sync's way), 1 after
    the program's store, 2 never explicitly (at the program's exit). WORK: int32 each program
    streams from `weights` (a GEMV's reads), their sum stored to `sink`."""
    if USE_PDL and TRIGGER == 0:
        pdl_sync(USE_PDL)
    elif USE_PDL:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    if WORK > 0:
        acc = tl.zeros([1024], dtype=tl.int32)
        for k in range(0, WORK, 1024):
            acc += tl.load(weights + pid.to(tl.int64) * WORK + k + tl.arange(0, 1024))
        tl.store(sink + pid, tl.sum(acc, 0))
    if pid == 0:
        tl.store(dst, tl.load(src) + 1)
    if USE_PDL and TRIGGER == 1:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _phases_kernel(counter, weights, sink, phases, spin_limit, WORK: tl.constexpr,
                   PREFETCH: tl.constexpr):
    """One persistent grid (every program resident) running `phases` phases, each a grid
    barrier on `counter` (one atomic a program, then polling until all have arrived) and
    `WORK` int32 a program read from `weights`: after the barrier (a kernel link's reads
    of its predecessor's output), or with PREFETCH before it (weights, which no phase writes:
    what a persistent kernel can overlap with the wait). `counter` ends at phases x programs
    when no poll gave up after `spin_limit` tries."""
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    acc = tl.zeros([1024], dtype=tl.int32)
    for i in range(phases):
        base = weights + (i * n + pid).to(tl.int64) * WORK
        if PREFETCH:
            for k in range(0, WORK, 1024):
                acc += tl.load(base + k + tl.arange(0, 1024))
        tl.debug_barrier()
        tl.atomic_add(counter, 1, sem="release")
        seen = tl.atomic_add(counter, 0, sem="acquire")
        tries = 0
        while (seen < (i + 1) * n) & (tries < spin_limit):
            seen = tl.load(counter, volatile=True)
            tries += 1
        tl.debug_barrier()
        if not PREFETCH:
            for k in range(0, WORK, 1024):
                acc += tl.load(base + k + tl.arange(0, 1024))
    tl.store(sink + pid, tl.sum(acc, 0))


def phases_ms(phases: int, programs: int, work: int, prefetch: bool, dev: torch.device
              ) -> tuple[float, bool]:
    """(median replay ms of one graph-captured persistent kernel of `phases` grid barriers,
    whether every replay's barriers all completed)."""
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    weights = torch.ones(max(1, phases * programs * work), dtype=torch.int32, device=dev)
    sink = torch.empty(programs, dtype=torch.int32, device=dev)

    def run() -> None:
        counter.zero_()
        _phases_kernel[(programs,)](counter, weights, sink, phases, 1 << 22, WORK=work,
                                    PREFETCH=prefetch, num_warps=4)

    run()  # compiles
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        run()
    times = sorted(event_times(graph.replay, 50, warmup=5))
    torch.cuda.synchronize()
    return times[len(times) // 2], int(counter.item()) == phases * programs


MODES = {"pdl_entry": (True, 0), "pdl_after_store": (True, 1), "pdl_at_exit": (True, 2),
         "plain": (False, 0)}


def chain_ms(links: int, programs: int, mode: str, work: int, dev: torch.device
             ) -> tuple[float, int]:
    """(median replay ms of a graph of `links` dependent kernels, the value at the chain's end:
    `links` when every kernel saw its predecessor's write); each program streams `work` int32
    from a buffer links x programs x work (distinct reads, past L2 for enough links)."""
    buf = torch.zeros(links + 1, dtype=torch.int32, device=dev)
    weights = torch.ones(max(1, links * programs * work), dtype=torch.int32, device=dev)
    sink = torch.empty(programs, dtype=torch.int32, device=dev)
    pdl, trigger = MODES[mode]
    kw = {"USE_PDL": pdl, "TRIGGER": trigger, **({"launch_pdl": True} if pdl else {})}

    def chain() -> None:
        for i in range(links):
            _link_kernel[(programs,)](buf[i:], buf[i + 1:], weights[i * programs * work:], sink,
                                      WORK=work, num_warps=4, **kw)

    chain()  # compiles
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        chain()
    buf.zero_()
    graph.replay()
    torch.cuda.synchronize()
    end = int(buf[-1].item())
    times = sorted(event_times(graph.replay, 50, warmup=5))
    return times[len(times) // 2], end


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--links", default="343,162", help="chain lengths (kernels a step)")
    ap.add_argument("--work", default="0,1024", help="int32 each program reads (multiples of "
                    "1024)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    res: dict = {"command": recorded_command("benchmarks/launch_floor.py"),
                 "commit": git_commit(), "device": torch.cuda.get_device_name(),
                 "torch": torch.__version__, "triton": triton.__version__,
                 "date": datetime.date.today().isoformat(), "sms": sms, "rows": []}
    modes = list(MODES) if pdl_enabled(dev) else ["plain"]
    cases = [(int(n), p, int(w)) for n in args.links.split(",") for w in args.work.split(",")
             for p in (1, sms, 8 * sms)]
    for links, programs, work in cases:
        for mode in modes:
            ms, end = chain_ms(links, programs, mode, work, dev)
            row = {"links": links, "programs": programs, "work_int32": work, "mode": mode,
                   "replay_ms": ms,
                   "us_per_link": 1e3 * ms / links, "chain_ok": end == links}
            res["rows"].append(row)
            print(f"{links} links x {programs} programs x {work} int32, {mode}: {ms:.4f} ms, "
                  f"{row['us_per_link']:.2f} us a link, chain ok {row['chain_ok']}")
    # NOTE: one program an SM, so every program is resident and the barriers cannot deadlock
    for links, work, prefetch in [(int(n), int(w), p) for n in args.links.split(",")
                                  for w in args.work.split(",") for p in (False, True)]:
        ms, ok = phases_ms(links, sms, work, prefetch, dev)
        mode = "barrier_prefetch" if prefetch else "barrier"
        res["rows"].append({"links": links, "programs": sms, "work_int32": work, "mode": mode,
                            "replay_ms": ms, "us_per_link": 1e3 * ms / links, "chain_ok": ok})
        print(f"{links} grid barriers x {sms} programs x {work} int32, {mode}: {ms:.4f} ms, "
              f"{1e3 * ms / links:.2f} us a barrier, completed {ok}")
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0 if all(r["chain_ok"] for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
