"""Async scheduling with a drafter (engine/pipeline.py, PendingSpec): speculative steps launched
ahead of the previous step's accepted tokens, their inputs computed on the device, give the
synchronous engine's outputs token for token, with variable acceptance, stops, arrivals,
preemption and aborts, and leave nothing behind."""

from __future__ import annotations

import pytest
from helpers import (
    abort_in_flight,
    assert_no_leaks,
    count_calls,
    cpu_llm,
    greedy_token_ids,
    random_prompts,
)

from blockspec import SamplingParams
from blockspec.engine.model_runner import ModelRunner
from blockspec.engine.pipeline import block_tokens


@pytest.fixture
def launches(monkeypatch) -> list:
    """Calls of ModelRunner.launch_spec: the speculative steps that ran ahead."""
    return count_calls(monkeypatch, ModelRunner, "launch_spec")


def spec_run(model, draft, prompts, params, **kw):
    llm = cpu_llm(model, draft, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leaks(llm)
    return [(o.token_ids, o.finish_reason) for o in outs], llm


def test_block_tokens():
    # [q picks, q - 1 drafts, accepted]: greedy commits the picks up to the first rejection
    # plus the pick after it; synthetic commits the accepted drafts and that pick.
    row = [7, 8, 9, 1, 2, 3, 4, 5] + [50, 51, 52, 53, 54, 55, 56] + [2]
    assert block_tokens(row, 8, synthetic=False) == ([7, 8, 9], 2)
    assert block_tokens(row, 8, synthetic=True) == ([50, 51, 9], 2)
    assert block_tokens([7, 8, 9, 1, 50, 51, 52, 0], 4, synthetic=True) == ([7], 0)


@pytest.mark.parametrize("block_size", [2, 8])
def test_greedy_equals_autoregressive(qwen3_path, drafter16, launches, block_size):
    """Per prompt a length limit, a stop token, or a stop inside a block; fixed policy."""
    prompts = random_prompts([5, 17, 3, 30, 11, 8], seed=2)
    ref = greedy_token_ids(qwen3_path, prompts, SamplingParams(temperature=0, max_tokens=30,
                                                               ignore_eos=True))
    params = [SamplingParams(temperature=0, max_tokens=12 + 3 * i, ignore_eos=True,
                             stop_token_ids=[ref[i][9]] if i % 2 else None)
              for i in range(len(prompts))]
    want = greedy_token_ids(qwen3_path, prompts, params)
    got, _ = spec_run(qwen3_path, drafter16, prompts, params, async_scheduling=True,
                      block_size=block_size, speculation_policy="fixed")
    assert [t for t, _ in got] == want
    assert len(launches) > 5


def test_synthetic_acceptance_equals_the_synchronous_engine(qwen3_path, drafter16, launches):
    """Variable accepted counts (synthetic a=0.6, the labelled benchmark mode): the device-side
    context lengths and newest tokens of steps launched ahead match the host's. One request:
    a batch's draws follow its rows, and the asynchronous engine keeps a finishing request in
    the batch one step longer (Scheduler.reserve_ahead), which shifts later rows' draws."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    kw = dict(block_size=8, speculation_policy="fixed", synthetic_acceptance=0.6,
              benchmark_mode=True)
    for prompt in random_prompts([9, 21], seed=4):
        sync, _ = spec_run(qwen3_path, drafter16, [prompt], params, **kw)
        assert len(launches) == 0
        got, llm = spec_run(qwen3_path, drafter16, [prompt], params, async_scheduling=True,
                            **kw)
        assert got == sync
        assert len(launches) > 5
        launches.clear()
        assert 1.5 < llm.engine.spec_stats.mean_acceptance_length < 7  # acceptance did vary
    got, llm = spec_run(qwen3_path, drafter16, random_prompts([9, 21, 4, 13], seed=4), params,
                        async_scheduling=True, **kw)
    assert [len(t) for t, _ in got] == [60] * 4
    mix = llm.engine.step_mix.cells
    assert mix["ahead", 8][0] == len(launches) > 5
    assert sum(t for _, _, t in mix.values()) == 4 * 60


def test_arrivals_preemption_prefix_hits_and_the_adaptive_policy(qwen3_path, drafter16,
                                                                  launches):
    """More requests than max_num_seqs and a cache that preempts (both end the pipeline; it
    restarts), a second pass over cached prefixes, and the default adaptive policy with a cost
    model under which speculation pays."""
    from blockspec.policy.cost_model import StepCostModel

    prompts = random_prompts([40, 9, 33, 21, 14, 27, 6], seed=3)
    params = [SamplingParams(temperature=0, max_tokens=14 + i, ignore_eos=True)
              for i in range(7)]
    want = greedy_token_ids(qwen3_path, prompts, params)
    llm = cpu_llm(qwen3_path, drafter16, async_scheduling=True, max_num_seqs=3,
                  num_kv_blocks=8)
    llm.engine.runner.set_cost_model(StepCostModel(
        {L: {b: 1.0 + 0.01 * L for b in (1, 2, 4)} for L in (1, 2, 4, 8, 16)}))
    for _ in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == want
        assert_no_leaks(llm)
    assert len(launches) > 0 and llm.engine.scheduler.num_preemptions > 0


def test_abort_and_sampled_rows(qwen3_path, drafter16, launches):
    prompts = random_prompts([12, 7, 20], seed=5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = greedy_token_ids(qwen3_path, prompts, params)
    llm = cpu_llm(qwen3_path, drafter16, async_scheduling=True, block_size=4,
                  speculation_policy="fixed")
    assert abort_in_flight(llm, prompts, params, 4) == [want[0], want[2]]
    assert len(launches) > 0
    # A sampled request keeps the batch synchronous (its draw needs the tokens in flight).
    before = len(launches)
    sampled = [SamplingParams(temperature=0.8, seed=3, max_tokens=10),
               SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    a = [o.token_ids for o in llm.generate(prompts[:2], sampled, use_tqdm=False)]
    b = [o.token_ids for o in cpu_llm(qwen3_path, drafter16, block_size=4,
                                      speculation_policy="fixed").generate(
        prompts[:2], sampled, use_tqdm=False)]
    assert a == b and len(launches) == before


def test_detached_plain_steps_run_ahead(qwen3_path, drafter16, monkeypatch):
    """A cost model under which speculation never pays: the adaptive policy decodes plainly, the
    drafter context detaches, and those plain steps (the target alone) run ahead, with the same
    tokens as autoregressive decoding; the probes among them run synchronously."""
    from blockspec.policy.cost_model import StepCostModel

    calls = count_calls(monkeypatch, ModelRunner, "launch_ahead")
    prompts = random_prompts([10, 25, 7, 16], seed=6)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = greedy_token_ids(qwen3_path, prompts, params)
    llm = cpu_llm(qwen3_path, drafter16, async_scheduling=True)
    llm.engine.runner.set_cost_model(StepCostModel(
        {L: {b: 1.0 + 10.0 * (L > 1) for b in (1, 2, 4)} for L in (1, 2, 4, 8, 16)}))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert_no_leaks(llm)
    plans = [args[2] for args in calls]
    assert len(plans) > 10 and all(p is not None and p.block_len == 1 for p in plans)
    assert llm.engine.runner.lazy.num_detached_steps >= len(plans)
    mix = llm.engine.step_mix.cells
    assert mix["ahead", 1][0] == len(plans)
