"""Split mixed steps (EngineConfig.split_prefill; on by default with CUDA graphs): a step that
mixes prefill chunks with decodes runs the chunks as their own forward beside the decode step.
Run eagerly here, the same functions the graphs capture: greedy output stays the target's, seeded
sampling and logprobs are those of the one-forward mixed step, the drafter sees the same context
(lazy or not, with preemption), and the lazy context's counts stay exact."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_no_leaks,
    cpu_llm,
    force_block_lens,
    greedy_token_ids,
    random_prompts,
    record_drafter,
)
from test_lazy_context import LONG, check_counts

from blockspec import SamplingParams
from blockspec.engine.model_runner import ModelRunner
from blockspec.engine.prefill_step import PREFILL_GRAPH_SEQS, prefill_buckets

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def case(qwen3_path) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, plain greedy decoding's outputs for them)."""
    prompts = random_prompts([3 + (i * 29) % 70 for i in range(6)], seed=13)
    return prompts, greedy_token_ids(qwen3_path, prompts, GREEDY)


def count_paths(monkeypatch) -> dict[str, int]:
    calls = {"split": 0, "mixed": 0}
    for name in ("split", "mixed"):
        original = getattr(ModelRunner, f"_execute_{name}")

        def counted(self, *args, _name=name, _original=original):
            calls[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(ModelRunner, f"_execute_{name}", counted)
    return calls


def test_buckets():
    assert prefill_buckets(8192) == [32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048]
    assert prefill_buckets(600) == [32, 64, 128, 256, 384, 512, 600]
    assert prefill_buckets(100) == [32, 64, 100]
    assert prefill_buckets(16) == []


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "attached"])
@pytest.mark.parametrize("kv", [dict(), dict(num_kv_blocks=12, max_num_batched_tokens=64)],
                         ids=["roomy", "preempting"])
def test_greedy_and_drafter_context_match_the_mixed_step(qwen3_path, drafter16, case, lazy, kv,
                                                         monkeypatch):
    prompts, ar_ref = case
    calls = count_paths(monkeypatch)
    runs = []
    for split in (True, False):
        llm = cpu_llm(qwen3_path, drafter16, speculation_policy="fixed",
                      lazy_draft_context=lazy, split_prefill=split, max_num_seqs=4, **kv)
        force_block_lens(llm, LONG if lazy else [1, 16, 4, 1, 8])
        if lazy:
            check_counts(llm)
        seen = record_drafter(llm)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ar_ref
        assert_no_leaks(llm)
        runs.append((llm, seen))
        if split:
            assert calls["split"] > 0 and calls["mixed"] == 0
    (split_llm, split_seen), (mixed_llm, mixed_seen) = runs
    assert split_llm.engine.spec_stats.block_len_steps == \
        mixed_llm.engine.spec_stats.block_len_steps
    assert len(split_seen) == len(mixed_seen) > 0
    for a, b in zip(split_seen, mixed_seen):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("draft", [True, False], ids=["dflash", "plain"])
def test_seeded_sampling_and_logprobs_match(qwen3_path, drafter16, case, draft):
    prompts = case[0]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i, max_tokens=24,
                             logprobs=2, ignore_eos=True, presence_penalty=0.3)
              for i in range(len(prompts))]
    outs = []
    for split in (True, False):
        llm = cpu_llm(qwen3_path, drafter16 if draft else None, split_prefill=split,
                      max_num_seqs=3, **({"speculation_policy": "fixed"} if draft else {}))
        if draft:
            force_block_lens(llm, [16, 1, 4])
        outs.append(llm.generate(prompts, params))
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert [sorted(d) for d in a.logprobs] == [sorted(d) for d in b.logprobs]
        for da, db in zip(a.logprobs, b.logprobs):
            assert all(abs(da[k] - db[k]) < 1e-4 for k in da)


def test_more_chunks_than_lanes_run_the_mixed_step(qwen3_path, monkeypatch):
    """A step with more prefill chunks than the prefill buffers' lanes falls back to the one
    eager forward, with the same output."""
    calls = count_paths(monkeypatch)
    n = PREFILL_GRAPH_SEQS + 2
    prompts = random_prompts([5 + i for i in range(n)], seed=3)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = cpu_llm(qwen3_path, split_prefill=True, max_num_seqs=n + 2)
    assert [o.token_ids for o in llm.generate(prompts, params)] == \
        greedy_token_ids(qwen3_path, prompts, params)
    assert calls["mixed"] >= 1


def test_prefix_cache_hits_and_n_samples_match(qwen3_path, drafter16):
    """Chunks that start mid-prompt (prefix-cache hits) and n = 2 samples per request give the
    same outputs through the split step as through the one-forward mixed step."""
    shared = random_prompts([40], seed=21)[0]
    prompts = [shared + tail for tail in random_prompts([3, 9, 17, 30, 5], seed=22)]
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
    outs = []
    for split in (True, False):
        llm = cpu_llm(qwen3_path, drafter16, split_prefill=split, max_num_seqs=3,
                      speculation_policy="fixed")
        force_block_lens(llm, [4, 16, 1])
        got = llm.generate(prompts, params)
        assert sum(o.metrics.num_cached_tokens for o in got) > 0  # the later prompts hit
        outs.append([[s.token_ids for s in o.samples or [o]] for o in got])
        assert_no_leaks(llm)
    assert outs[0] == outs[1]
