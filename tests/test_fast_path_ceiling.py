"""benchmarks/fast_path_ceiling.py: its matmul lists are exactly the steps' matmuls, and its
expected schedule obeys the acceptance extremes."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import cpu_llm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import fast_path_ceiling as fpc  # noqa: E402


def recorded_matmuls(monkeypatch, fn) -> Counter:
    """(N, K, M) of every F.linear that `fn` runs."""
    seen: Counter = Counter()
    linear = F.linear

    def spy(x, w, b=None):
        seen[(w.shape[0], w.shape[1], x.reshape(-1, x.shape[-1]).shape[0])] += 1
        return linear(x, w, b)

    monkeypatch.setattr(F, "linear", spy)
    fn()
    monkeypatch.setattr(F, "linear", linear)
    return seen


def as_counter(calls) -> Counter:
    return Counter((w.shape[0], w.shape[1], m) for w, m in calls)


@pytest.mark.parametrize("b", [1, 3])
def test_step_matmuls_are_the_steps(qwen3_path, drafter16, monkeypatch, b):
    sp = cpu_llm(qwen3_path, drafter16, enforce_eager=True)
    runner = sp.engine.runner
    bufs = runner.bufs
    bufs.block_tables.fill_(runner.trash_block)
    bufs.ctx_lens[:b].fill_(20)
    model, drafter = sp.engine.model, runner.proposer.drafter
    monkeypatch.setattr(fpc, "BLOCK", runner.steps[runner.max_block].q)
    with torch.inference_mode():
        seen = recorded_matmuls(monkeypatch, lambda: runner.decode(bufs, b))
    assert seen == as_counter(fpc.dflash_step_calls(model, drafter, b))
    ar = cpu_llm(qwen3_path, enforce_eager=True)
    r = ar.engine.runner
    r.bufs.block_tables.fill_(r.trash_block)
    r.bufs.ctx_lens[:b].fill_(20)
    with torch.inference_mode():
        seen = recorded_matmuls(monkeypatch, lambda: r.decode(r.bufs, b))
    assert seen == as_counter(fpc.target_calls(ar.engine.model, b, b))


def test_expected_schedule_extremes(monkeypatch):
    monkeypatch.setattr(fpc, "C", 4)
    monkeypatch.setattr(fpc, "BLOCK", 16)
    # Nothing accepted: one token per step, every sequence to the end.
    assert fpc.expected_schedule(0.0, runs=3) == [4.0] * (fpc.OUTPUT_LEN - 1)
    # Everything accepted: 16 tokens per step.
    assert fpc.expected_schedule(1.0, runs=3) == [4.0] * -(-(fpc.OUTPUT_LEN - 1) // 16)
    mid = fpc.expected_schedule(0.86, runs=50)
    assert mid[0] == 4.0 and all(x >= y for x, y in zip(mid, mid[1:])) and mid[-1] < 4.0
