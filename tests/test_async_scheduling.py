"""Async scheduling (engine/pipeline.py): plain decode steps launched ahead of the previous
step's tokens give the synchronous engine's outputs, drop the token in flight past a stop, and
leave nothing behind; what cannot run ahead runs as before."""

from __future__ import annotations

import pytest
from helpers import abort_in_flight, assert_no_leaks, count_calls, cpu_llm, random_prompts

from blockspec import SamplingParams
from blockspec.config import ConfigError
from blockspec.engine.model_runner import ModelRunner


@pytest.fixture
def launches(monkeypatch) -> list:
    """Calls of ModelRunner.launch_ahead: the steps that ran ahead."""
    return count_calls(monkeypatch, ModelRunner, "launch_ahead")


def run(model, prompts, params, **kw) -> list[tuple]:
    llm = cpu_llm(model, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leaks(llm)
    return [(o.token_ids, o.finish_reason, o.stop_reason, o.text) for o in outs]


def stopping_params(model, prompts) -> list[SamplingParams]:
    """Per prompt: a length limit, a stop token or a stop string that ends it mid-stream."""
    ref = cpu_llm(model).generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                          ignore_eos=True), use_tqdm=False)
    params = []
    for i, r in enumerate(ref):
        kw = dict(temperature=0, max_tokens=7 + 2 * i, ignore_eos=True)
        if i % 3 == 1:
            kw["stop_token_ids"] = [r.token_ids[4]]
        elif i % 3 == 2 and len(r.text) > 6:
            kw["stop"] = [r.text[3:6]]
        params.append(SamplingParams(**kw))
    return params


def test_greedy_outputs_equal_the_synchronous_engine(qwen3_path, launches):
    prompts = random_prompts([5, 17, 3, 30, 11, 8])
    params = stopping_params(qwen3_path, prompts)
    sync = run(qwen3_path, prompts, params, async_scheduling=False)
    assert len(launches) == 0
    assert run(qwen3_path, prompts, params, async_scheduling=True) == sync
    assert len(launches) > 10
    assert any(r[1] == "stop" for r in sync) and any(r[1] == "length" for r in sync)


def test_arrivals_preemption_and_prefix_hits(qwen3_path, launches):
    """More requests than max_num_seqs (arrivals end the pipeline, it restarts), a cache small
    enough to preempt, and a second run over the first's cached prefixes."""
    prompts = random_prompts([40, 9, 33, 21, 14, 27, 6], seed=3)
    params = [SamplingParams(temperature=0, max_tokens=10 + i, ignore_eos=True)
              for i in range(7)]
    kw = dict(max_num_seqs=3, num_kv_blocks=6)
    sync = run(qwen3_path, prompts, params, async_scheduling=False, **kw)
    llm = cpu_llm(qwen3_path, async_scheduling=True, **kw)
    for _ in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == [r[0] for r in sync]
        assert_no_leaks(llm)
    assert len(launches) > 0 and llm.engine.scheduler.num_preemptions > 0
    # The step mix (what benchmarks report) accounts for every token, ahead steps included.
    mix = llm.engine.step_mix.cells
    assert sum(t for _, _, t in mix.values()) == 2 * sum(len(r[0]) for r in sync)
    assert mix["ahead", 1][0] == len(launches) and mix["ahead", 1][2] > 0


def test_abort_while_a_step_is_in_flight(qwen3_path, launches):
    prompts = random_prompts([12, 7, 20], seed=5)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = run(qwen3_path, prompts, params, async_scheduling=False)
    llm = cpu_llm(qwen3_path, async_scheduling=True)
    assert abort_in_flight(llm, prompts, params, 6) == [want[0][0], want[2][0]]
    assert len(launches) > 0


def test_sampled_or_logprob_batches_run_synchronously(qwen3_path, launches):
    prompts = random_prompts([6, 9], seed=7)
    params = [SamplingParams(temperature=0.8, seed=11, max_tokens=8),
              SamplingParams(temperature=0, max_tokens=8, logprobs=2)]
    sync = run(qwen3_path, prompts, params, async_scheduling=False)
    assert run(qwen3_path, prompts, params, async_scheduling=True) == sync
    assert len(launches) == 0


def test_config(qwen3_path, drafter16):
    llm = cpu_llm(qwen3_path)
    assert llm.engine.async_scheduling is False  # the default is off on CPU
    config = llm.engine.config
    config.device = "cuda"  # NOTE: the resolution alone; nothing runs on it
    assert config.use_async_scheduling  # ... and on for one CUDA GPU
    config.tensor_parallel_size = 2
    assert not config.use_async_scheduling
    # With a drafter it runs speculative steps ahead (tests/test_async_speculation.py).
    assert cpu_llm(qwen3_path, drafter16, async_scheduling=True).engine.async_scheduling
    with pytest.raises(ConfigError, match="tensor parallelism"):
        cpu_llm(qwen3_path, async_scheduling=True, tensor_parallel_size=2)


def test_cli_flag():
    from blockspec.cli import build_parser, engine_kwargs

    parse = build_parser().parse_args
    assert engine_kwargs(parse(["serve"]))["async_scheduling"] is None  # the device decides
    assert engine_kwargs(parse(["serve", "--no-async-scheduling"]))["async_scheduling"] is False
    assert engine_kwargs(parse(["serve", "--async-scheduling"]))["async_scheduling"] is True


@pytest.mark.parametrize("with_drafter", [False, True])
def test_a_step_in_flight_reaches_its_streams_before_an_arrival_prefills(
        qwen3_path, drafter16, with_drafter):
    """An arrival ends the pipeline: the step in flight is committed and its outputs returned
    at once; the arrival's prefill runs at the next call (held for it, the running streams'
    tokens would wait a whole prefill step)."""
    llm = cpu_llm(qwen3_path, drafter16 if with_drafter else None, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = random_prompts([9, 30], seed=7)
    first = engine.add_request(prompts[0], params)
    for _ in range(20):
        engine.step()
        if engine._pending is not None:
            break
    assert engine._pending is not None, "no step ran ahead"
    second = engine.add_request(prompts[1], params)
    outs = engine.step()
    assert [o.request_id for o in outs] == [first] and outs[0].token_ids
    assert engine._pending is None
    arrival = engine.scheduler.waiting[0]
    assert arrival.request_id == second and arrival.num_computed_tokens == 0
    outs = engine.step()
    assert arrival.num_computed_tokens == len(prompts[1])  # now it prefills
    final = {}
    while True:
        final.update({o.request_id: o.token_ids for o in outs if o.finished})
        if not engine.has_unfinished():
            break
        outs = engine.step()
    want = cpu_llm(qwen3_path).generate(prompts, params, use_tqdm=False)
    assert [final[first], final[second]] == [w.token_ids for w in want]
