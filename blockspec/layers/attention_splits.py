"""How many ways the paged-attention kernel splits a short query's key range (flash-decoding):
a pure function of shapes and metadata ints, so a CUDA-graph bucket always gets the same one."""

from __future__ import annotations

import functools

import torch
import triton

SPLIT_MAX_QUERY_LEN = 16  # split-KV only for decode / verify / drafter-sized queries
# Keys per split below which a split's fixed cost (its partial output, the merge) outweighs the
# parallelism it adds, and the most splits worth launching: a decode token's rows (<= 16) gain
# up to 32 splits of >= 64 keys, a 16-token block's up to 16 of >= 128 (one H200, contexts
# 640-8192: benchmarks/results/attention_splits_2026-11-30*.json).
MIN_KEYS_PER_SPLIT_DECODE, MAX_SPLITS_DECODE = 64, 32
MIN_KEYS_PER_SPLIT_BLOCK, MAX_SPLITS_BLOCK = 128, 16


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H200's count: CPU (interpreter) runs then pick what the GPU would


def split_limits(block_m: int) -> tuple[int, int]:
    """(fewest keys per split, most splits) for programs of `block_m` query rows."""
    if block_m <= 16:
        return MIN_KEYS_PER_SPLIT_DECODE, MAX_SPLITS_DECODE
    return MIN_KEYS_PER_SPLIT_BLOCK, MAX_SPLITS_BLOCK


def choose_num_splits(num_programs: int, max_query_len: int, max_seq_len: int,
                      num_sms: int, min_keys: int, max_splits: int) -> int:
    """How many ways to split the key range at most: a pure function of shapes and metadata
    ints, so a CUDA-graph bucket (fixed num_seqs / max_query_len / max_seq_len) always gets the
    same one. NOTE: max_seq_len is the bucket's (max_model_len), not the context: the kernels
    give each split >= `min_keys` keys of the real context, so a short one uses fewer."""
    if max_query_len > SPLIT_MAX_QUERY_LEN or num_programs >= num_sms:
        return 1
    want = min(triton.cdiv(2 * num_sms, num_programs), max_seq_len // min_keys, max_splits)
    # Powers of two keep the number of compiled kernel variants small.
    return triton.next_power_of_2(want + 1) // 2 if want > 1 else 1
