"""The block length of a step that prefills a prompt chunk beside decoding sequences (a mixed
step), from the measured step costs.

Every decoding stream waits for the whole mixed step, so its verify blocks lengthen the gap
between the streams' tokens as much as the chunk does. Beside a chunk the policy's block is cut
to the longest whose extra time over a plain step (draft + verify, from the cost profile) is
at most MIXED_VERIFY_SHARE of the chunk's own time (its tokens at the profile's cheapest token
cost). NOTE: measured on one H200 (Qwen3-8B shape, 30 streams beside a 512-token prompt,
docs/benchmarks.md, "Mixed steps"): blocks of 8 make a 25 ms step, blocks of 4 a 21 ms one,
and the tokens per ms the longer block adds are about a decode step's, so a closed loop, whose
prompts must be prefilled anyway, loses no throughput to the cut.
Steps whose modelled time stays under MIXED_STEP_MIN_S are not cut (a small model's steps are
host-bound: a shorter block there saves no time and drops tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

from blockspec.policy.cost_model import StepCostModel

__all__ = ["MIXED_STEP_MIN_S", "MIXED_VERIFY_SHARE", "mixed_block_len"]

MIXED_VERIFY_SHARE = 0.25
MIXED_STEP_MIN_S = 0.010


def mixed_block_len(cost: StepCostModel, batch_size: int, block_len: int,
                    block_lens: Sequence[int], prefill_tokens: int) -> int:
    """The longest of `block_lens` (or plain decode, 1) up to `block_len` for `batch_size`
    decoding sequences beside a chunk of `prefill_tokens` prompt tokens."""
    if block_len <= 1 or prefill_tokens <= 0:
        return block_len
    chunk = prefill_tokens * cost.min_token_cost()
    plain = cost.cost(batch_size, 1)
    for L in sorted((x for x in block_lens if 1 < x <= block_len), reverse=True):
        extra = cost.cost(batch_size, L) - plain
        if extra <= MIXED_VERIFY_SHARE * chunk or plain + extra + chunk <= MIXED_STEP_MIN_S:
            return L
    return 1
