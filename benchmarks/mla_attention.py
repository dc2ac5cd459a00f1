"""MLA attention on one GPU: the Triton MLA backend's launch configs against the torch backend.

Times `attend` (attention + split merge, one layer, captured in a CUDA graph) over a bf16 latent
cache of 512 + 64 values per token (DeepSeek-V3 / Kimi-K2; KV block 16) for decode batches,
verify blocks and prefill chunks at 16 and 128 heads, for each (BLOCK_N, num_warps, num_stages)
here and the backend's default (launch_config), with the largest difference from the torch
reference's first 512 output columns and the latent bytes read per second.

Usage: python benchmarks/mla_attention.py --out FILE.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from blockspec.bench.common import git_commit, recorded_command
from blockspec.bench.gpu_timing import graph_ms
from blockspec.layers.attention import AttentionMetadata, TorchAttentionBackend
from blockspec.layers.triton_mla import TritonMLABackend

RANK, D, BS, REPS = 512, 576, 16, 10
# (name, batch, query tokens, context, heads)
CASES = [("decode", 1, 1, 4096, 128), ("decode", 8, 1, 4096, 128), ("decode", 64, 1, 4096, 128),
         ("decode", 1, 1, 32768, 16), ("decode", 64, 1, 4096, 16), ("verify", 1, 16, 4096, 128),
         ("verify", 8, 4, 4096, 128), ("prefill", 1, 512, 4096, 128), ("prefill", 1, 512, 512, 16)]
CONFIGS = [(16, 4, 1), (32, 4, 1), (32, 8, 1), (32, 8, 2), (64, 8, 1), (16, 8, 1), (64, 4, 1)]


def case(batch: int, q: int, ctx: int, heads: int, dev) -> tuple:
    blocks = -(-ctx // BS)
    tables = torch.randperm(batch * blocks, device=dev).to(torch.int32).view(batch, blocks)
    meta = AttentionMetadata.build([q] * batch, [ctx] * batch, tables.tolist(),
                                   list(range(batch * q)), dev)
    cache = torch.randn(batch * blocks, BS, 1, D, device=dev, dtype=torch.bfloat16)
    x = torch.randn(batch * q, heads, D, device=dev, dtype=torch.bfloat16)
    return x, cache, meta


def time_ms(be, x, cache, meta) -> float:
    def step() -> None:
        for _ in range(REPS):
            be.attend(x, cache, cache, meta, D**-0.5)

    return graph_ms(step) / REPS


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    res: dict = {"benchmark": "mla_attention: Triton MLA backend vs torch, one layer, bf16",
                 "command": recorded_command("benchmarks/mla_attention.py"),
                 "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                     timespec="seconds"), "commit": git_commit(), "cases": []}
    for name, batch, q, ctx, heads in CASES:
        x, cache, meta = case(batch, q, ctx, heads, dev)
        ref = TorchAttentionBackend().attend(x, cache, cache, meta, D**-0.5)[..., :RANK]
        row = {"query": name, "batch": batch, "q_len": q, "context": ctx, "heads": heads,
               "torch_ms": time_ms(TorchAttentionBackend(), x, cache, meta), "ms": {}}
        for n, w, s in [(None, None, None), *CONFIGS]:
            be = TritonMLABackend(block_n=n, num_warps=w, num_stages=s)
            key = "default" if n is None else f"n{n}_w{w}_s{s}"
            try:
                err = (be.attend(x, cache, cache, meta, D**-0.5)[..., :RANK] - ref).abs().max()
                row["ms"][key] = time_ms(be, x, cache, meta)
            except Exception as e:  # a config past the chip's resources: recorded, skipped
                row.setdefault("errors", {})[key] = str(e)[:200]
                continue
            row.setdefault("max_err", {})[key] = float(err)
        gbs = batch * ctx * D * 2 / (row["ms"]["default"] * 1e-3) / 1e9
        row["default_latent_gb_s"] = gbs
        print(f"{name:7s} B{batch:3d} q{q:3d} ctx{ctx:6d} H{heads:3d}: torch "
              f"{row['torch_ms']:.3f} ms, default {row['ms']['default']:.3f} ms ({gbs:.0f} GB/s)"
              f"; " + " ".join(f"{k}:{v:.3f}" for k, v in row["ms"].items())
              + f" max_err {max(row['max_err'].values()):.3g}", flush=True)
        res["cases"].append(row)
        del x, cache, meta, ref
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
