"""Where a mixed step's time goes, on one GPU (issue 20's ITL tail at C=32): the Qwen3-8B shape
with its drafter (labelled synthetic acceptance), `--decoding` sequences verifying blocks beside
one arriving 512-token prompt, as the scheduler's default cap builds that step. Prints and writes:
the whole step, its drafts, its flat forward per token bucket (extra buckets captured here) at
blocks 8 and 4, a speculative decode step of the same sequences, the forward's kernels, and the
device time per kernel of a graph of empty kernels.

With --attention-only: the flat step's two attention launches for that step's metadata, per
launch and per variant (tiles, stages, grids, splits), without an engine.

Usage: python benchmarks/mixed_step_profile.py --out FILE.json [--decoding 30] [--attention-only]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from blockspec import LLM
from blockspec.bench.common import environment, recorded_command
from blockspec.bench.fullsize import prompts, write_folders
from blockspec.bench.mixed_profile import (
    attention_variants,
    bucket_curve,
    kernel_table,
    launch_floor_us,
    mixed_state,
    time_ms,
)
from blockspec.engine.decode_step import GraphedDecodeStep
from blockspec.engine.flat_step import GraphedFlatStep, short_query_len

A = 0.86
EXTRA_BUCKETS = [576, 640, 704, 896]
# The attention launches' variants (TritonAttentionBackend arguments; "short_flat"/"long_flat":
# False for a grid of lanes x tiles instead of the flat grid).
ATTENTION_VARIANTS = {
    "base": {}, "short_lanes": {"short_flat": False}, "long_lanes": {"long_flat": False},
    "bn32": {"block_n": 32}, "bn128": {"block_n": 128}, "warps8": {"num_warps": 8},
    "bm64": {"max_block_m": 64}, **{f"stages{n}": {"num_stages": n} for n in (1, 2, 3, 4)},
    "short_lanes_split2": {"short_flat": False, "num_splits": 2},
    "short_lanes_split4": {"short_flat": False, "num_splits": 4},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--decoding", type=int, default=30)
    ap.add_argument("--attention-only", action="store_true",
                    help="only the attention launches' variants (no engine)")
    a = ap.parse_args()
    if a.attention_only:
        res = {"benchmark": "mixed_step_profile", "command": recorded_command(
            "benchmarks/mixed_step_profile.py"), "environment": environment(),
            "attention_ms_per_layer": attention_variants(ATTENTION_VARIANTS, a.decoding)}
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        return 0
    target, drafter = write_folders(Path(tempfile.mkdtemp()))
    llm = LLM(str(target), draft=str(drafter), device="cuda", dtype="bfloat16",
              load_format="dummy", max_model_len=1024, kv_cache_memory_gb=36, max_num_seqs=256,
              enable_prefix_caching=False, block_size=16, block_sizes=(4, 8, 16),
              speculation_policy="fixed", synthetic_acceptance=A, benchmark_mode=True,
              async_scheduling=False)
    runner = llm.engine.runner
    # NOTE: the fixed policy captures the max block's graphs only: add blocks 8 and 4's
    pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    runner.block_drafts.capture([8, 4], runner.buckets, pool, stream)
    for L in (8, 4):
        runner.graphs_by_len[L] = GraphedDecodeStep(runner.steps[L], runner.bufs, runner.buckets)
        runner.graphs_by_len[L].capture(pool, stream)
    extra = GraphedFlatStep(runner.flat.step, runner.flat.bufs, EXTRA_BUCKETS,
                            [short_query_len(8), short_query_len(4)])
    extra.capture(pool, stream)
    state = mixed_state(llm, prompts(a.decoding + 1), a.decoding)
    res: dict = {"benchmark": "mixed_step_profile", "command": recorded_command(
        "benchmarks/mixed_step_profile.py"), "environment": environment(),
        "decoding": len(state.decoding), "step_tokens": sum(state.num_new), "acceptance": A}
    for width in (8, 4):
        batch, _ = state.batch(width)
        r = res[f"block{width}"] = {
            "whole_mixed_step_ms": time_ms(lambda w=width: state.whole_step(w, A)),
            "drafts_ms": time_ms(lambda w=width: state.drafts(w)),
            "decode_step_ms": time_ms(lambda w=width: state.decode_step(w, A)),
            "flat_tokens": len(batch.input_ids),
        }
        buckets = sorted({*runner.flat.buckets, *EXTRA_BUCKETS} & set(range(384, 1025)))
        r["replay_ms_by_bucket"] = bucket_curve(state, width, buckets, extra)
        print(f"block {width}: {r}")
    bufs = runner.flat.bufs
    batch, _ = state.batch(8)
    t = bufs.fill(batch, runner.flat.trash_slot, write_context=True)
    bufs.place_drafts(batch, state.drafts(8))
    lanes = runner.flat.lanes + 1
    res["kernels_flat_768"] = kernel_table(
        lambda: runner.flat.step(bufs, 768, lanes, short_query_len(8)))
    res["kernels_whole_step"] = kernel_table(lambda: state.whole_step(8, A))
    res["launch_floor_us"] = launch_floor_us()
    print(f"flat forward of {t} tokens (bucket 768), kernels:")
    for row in res["kernels_flat_768"]["top"]:
        print(f"  {row['us']:9.1f} us  x{row['calls']:<4} {row['kernel']}")
    print(f"launch floor: {res['launch_floor_us']:.2f} us a kernel")
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
