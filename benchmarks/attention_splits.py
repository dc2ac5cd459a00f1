"""Paged attention of small decode steps on one GPU: how many KV splits, which key tile?

Times the Triton backend's `attend` (attention + split merge) for one step's 36 layers (each its
own KV cache, as in the Qwen3-8B-shape model: 32 query heads, 8 KV heads, head_dim 128, bf16,
KV block 16) captured in one CUDA graph, at batch 1 for the query shapes of the engine's small
steps: a decode token (q=1, causal), a verify block (q=16, causal) and the drafter's block (q=16,
non-causal), over contexts 640 / 2048 / 8192, for every split count and key tile here (splits
as forced, down to one key tile each), and for the backend's own choice (`choose_num_splits`,
each split at least `split_limits` keys of the real context) at the graphs' max_seq_len
(--max-model-len) and at 40960 (Qwen3-8B's).

Usage: python benchmarks/attention_splits.py --out FILE.json [--max-model-len 1024]
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
from blockspec.layers.attention import AttentionMetadata
from blockspec.layers.attention_splits import choose_num_splits, num_sms, split_limits
from blockspec.layers.triton_attention import TritonAttentionBackend

LAYERS, HQ, HKV, D, BS = 36, 32, 8, 128, 16


def metadata(ctx: int, q: int, causal: bool, max_seq_len: int, dev) -> AttentionMetadata:
    blocks = -(-ctx // BS)
    return AttentionMetadata(
        slot_mapping=torch.arange(ctx - q, ctx, device=dev),
        cu_seqlens_q=torch.tensor([0, q], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([ctx], dtype=torch.int32, device=dev),
        block_tables=torch.randperm(blocks, device=dev).to(torch.int32)[None],
        max_query_len=q, max_seq_len=max_seq_len, causal=causal)


def time_attend(be: TritonAttentionBackend, x: torch.Tensor, caches: list,
                meta: AttentionMetadata) -> float:
    def step() -> None:
        for k, v in caches:
            be.attend(x, k, v, meta, D**-0.5)

    return graph_ms(step)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-model-len", type=int, default=1024,
                    help="the graphs' max_seq_len, which the split heuristic sees")
    args = ap.parse_args()
    dev = torch.device("cuda")
    res: dict = {"benchmark": "attention_splits: Triton paged attention, 36 layers, batch 1",
                 "command": recorded_command("benchmarks/attention_splits.py"),
                 "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                     timespec="seconds"), "commit": git_commit(), "cases": []}
    for ctx in (640, 2048, 8192):
        blocks = -(-ctx // BS)
        caches = [(torch.randn(blocks, BS, HKV, D, device=dev, dtype=torch.bfloat16),
                   torch.randn(blocks, BS, HKV, D, device=dev, dtype=torch.bfloat16))
                  for _ in range(LAYERS)]
        for q, causal, name in ((1, True, "decode"), (16, True, "verify"),
                                (16, False, "draft")):
            meta = metadata(ctx, q, causal, max(args.max_model_len, ctx), dev)
            x = torch.randn(q, HQ, D, device=dev, dtype=torch.bfloat16)
            heuristic = choose_num_splits(HKV, q, meta.max_seq_len, num_sms(dev),
                                          *split_limits(16 if q == 1 else 64))
            row = {"context": ctx, "query": name, "heuristic_splits": heuristic, "ms": {}}
            for block_n in (32, 64):
                for splits in (1, 2, 4, 8, 16, 32):
                    be = TritonAttentionBackend(block_n=block_n, num_splits=splits,
                                                split_keys=block_n)
                    row["ms"][f"n{block_n}_s{splits}"] = time_attend(be, x, caches, meta)
            row["heuristic_ms"] = time_attend(TritonAttentionBackend(), x, caches, meta)
            # A deployment's graphs see max_model_len (Qwen3-8B: 40960), not the context.
            long = metadata(ctx, q, causal, 40960, dev)
            row["heuristic_40960_splits"] = choose_num_splits(
                HKV, q, 40960, num_sms(dev), *split_limits(16 if q == 1 else 64))
            row["heuristic_40960_ms"] = time_attend(TritonAttentionBackend(), x, caches, long)
            best = min(row["ms"], key=row["ms"].get)
            row["best"], row["best_ms"] = best, row["ms"][best]
            print(f"ctx {ctx:5d} {name:6s}: heuristic ({heuristic} splits) "
                  f"{row['heuristic_ms']:.3f} ms, at max_model_len 40960 "
                  f"({row['heuristic_40960_splits']}) {row['heuristic_40960_ms']:.3f} ms, "
                  f"best {best} {row['best_ms']:.3f} ms; "
                  + " ".join(f"{k}:{v:.3f}" for k, v in row["ms"].items()), flush=True)
            res["cases"].append(row)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
