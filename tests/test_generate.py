"""End-to-end generation through the offline API: parity with HF, batching, preemption, chunked
prefill, prefix caching, and KV-block accounting."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPTS, assert_no_leaks, random_prompts

from blockspec import LLM, RequestOutput, SamplingParams
from blockspec.config import ConfigError

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LENGTHS = [5 + (115 * i) // 15 for i in range(16)]  # 16 prompts, 5..120 tokens


def make_llm(path, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 256)
    return LLM(str(path), device="cpu", kv_block_size=16, **kw)


@pytest.fixture(scope="module")
def references(request):
    """Greedy outputs generated one request at a time with a roomy cache and no prefix cache:
    the baseline every batched / preempted / chunked / cached configuration must reproduce."""
    cache = {}

    def get(path, prompts, sp=GREEDY):
        key = (str(path), repr(prompts), repr(sp))
        if key not in cache:
            llm = make_llm(path, enable_prefix_caching=False, max_num_seqs=1)
            cache[key] = [llm.generate(p, sp, use_tqdm=False)[0].token_ids for p in prompts]
            assert_no_leaks(llm)
        return cache[key]

    return get


@torch.no_grad()
def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, eos_token_id=None,
                      pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


# -- parity with HF generate -----------------------------------------------------------------------
def test_greedy_matches_hf_generate(arch_path, hf_model):
    llm = make_llm(arch_path, num_kv_blocks=64)
    n = 40
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    hf = hf_model(arch_path)
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        assert len(out.token_ids) == n and out.finish_reason == "length"
        assert out.token_ids == hf_greedy(hf, ids, n), prompt
    assert_no_leaks(llm)


def test_greedy_matches_hf_on_token_id_prompts(arch_path, hf_model):
    prompts = random_prompts([3, 31, 64, 90], seed=11)
    llm = make_llm(arch_path, num_kv_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    hf = hf_model(arch_path)
    for prompt, out in zip(prompts, outs):
        assert out.prompt is None and out.prompt_token_ids == prompt
        assert out.token_ids == hf_greedy(hf, prompt, 20)
    assert_no_leaks(llm)


def test_greedy_matches_hf_with_llama3_rope_past_original_context(llama_rope_path, hf_model):
    """Generation across positions ~250..300, past original_max_position_embeddings=256."""
    prompt = random_prompts([250], seed=12)[0]
    llm = make_llm(llama_rope_path, num_kv_blocks=32)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf_model(llama_rope_path), prompt, 50)
    assert_no_leaks(llm)


# -- batching, preemption, chunked prefill ---------------------------------------------------------
def test_batched_with_preemption_matches_sequential(arch_path, references):
    prompts = random_prompts(LENGTHS, seed=1)
    ref = references(arch_path, prompts)
    # 24 blocks x 16 slots = 384 slots for 16 requests needing up to 144 each: must preempt.
    llm = make_llm(arch_path, num_kv_blocks=24, enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == llm.engine.scheduler.num_preemptions
    assert [o.token_ids for o in outs] == ref
    assert all(o.finish_reason == "length" for o in outs)
    assert_no_leaks(llm)


def test_batched_with_preemption_and_prefix_cache(arch_path, references):
    prompts = random_prompts(LENGTHS, seed=1)
    llm = make_llm(arch_path, num_kv_blocks=24, enable_prefix_caching=True)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == references(arch_path, prompts)
    assert_no_leaks(llm)


@pytest.mark.parametrize("budget", [7, 32])
def test_chunked_prefill_matches_sequential(qwen3_path, references, budget):
    prompts = random_prompts(LENGTHS, seed=2)
    llm = make_llm(qwen3_path, max_num_batched_tokens=budget, enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == references(qwen3_path, prompts)
    assert_no_leaks(llm)


def test_chunked_prefill_with_preemption_and_few_seqs(llama_path, references):
    prompts = random_prompts(LENGTHS, seed=3)
    llm = make_llm(llama_path, num_kv_blocks=20, max_num_batched_tokens=40, max_num_seqs=5)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == references(llama_path, prompts)
    assert_no_leaks(llm)


def test_batch_size_one_equals_batched(qwen3_path, references):
    prompts = random_prompts([9, 17, 33], seed=4)
    llm = make_llm(qwen3_path, max_num_seqs=1)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == references(qwen3_path, prompts)
    assert_no_leaks(llm)


# -- prefix caching --------------------------------------------------------------------------------
def test_same_prompt_twice_hits_prefix_cache(arch_path, references):
    prompt = random_prompts([100], seed=5)[0]
    llm = make_llm(arch_path, num_kv_blocks=32)
    first = llm.generate(prompt, GREEDY)[0]
    assert_no_leaks(llm)
    second = llm.generate(prompt, GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens == 96  # 6 full blocks; the last token is recomputed
    assert first.token_ids == second.token_ids == references(arch_path, [prompt])[0]
    assert_no_leaks(llm)


def test_block_aligned_prompt_recomputes_last_block(qwen3_path):
    prompt = random_prompts([64], seed=6)[0]
    llm = make_llm(qwen3_path, num_kv_blocks=32)
    a = llm.generate(prompt, GREEDY)[0]
    b = llm.generate(prompt, GREEDY)[0]
    assert b.metrics.num_cached_tokens == 48
    assert a.token_ids == b.token_ids
    assert_no_leaks(llm)


def test_shared_prefix_prompts_match_uncached(arch_path):
    prefix = random_prompts([70], seed=7)[0]
    suffixes = random_prompts([1, 5, 13, 26, 40, 2], seed=8)
    prompts = [prefix + s for s in suffixes]
    off = make_llm(arch_path, enable_prefix_caching=False)
    want = [o.token_ids for o in off.generate(prompts, GREEDY)]
    on = make_llm(arch_path)
    first = on.generate(prompts[0], GREEDY)[0]
    rest = on.generate(prompts[1:], GREEDY)
    assert [first.token_ids] + [o.token_ids for o in rest] == want
    assert all(o.metrics.num_cached_tokens == 64 for o in rest)
    assert on.engine.block_manager.num_prefix_hits > 0
    assert off.engine.block_manager.num_prefix_hits == 0
    assert all(o.metrics.num_cached_tokens == 0 for o in off.generate(prompts, GREEDY))
    assert_no_leaks(on)
    assert_no_leaks(off)


def test_prefix_cache_covers_generated_tokens(qwen3_path):
    """A prompt that continues an earlier request's prompt + output reuses the output's blocks."""
    prompt = random_prompts([40], seed=9)[0]
    llm = make_llm(qwen3_path)
    first = llm.generate(prompt, GREEDY)[0]  # 40 + 24 = 64 tokens; 63 computed -> 3 full blocks
    follow = prompt + first.token_ids + [5, 6, 7]
    out = llm.generate(follow, GREEDY)[0]
    assert out.metrics.num_cached_tokens == 48
    cold = make_llm(qwen3_path, enable_prefix_caching=False).generate(follow, GREEDY)[0]
    assert out.token_ids == cold.token_ids
    assert_no_leaks(llm)


def test_prefix_cache_under_pressure_matches_uncached(qwen3_path, references):
    """Shared prefixes + a tiny cache (eviction, preemption) + chunked prefill."""
    prefix = random_prompts([48], seed=10)[0]
    prompts = [prefix + s for s in random_prompts([3, 20, 37, 50, 9, 16, 60, 1], seed=11)]
    prompts += prompts[:3]
    llm = make_llm(qwen3_path, num_kv_blocks=14, max_num_batched_tokens=50)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == references(qwen3_path, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm)


# -- API surface -----------------------------------------------------------------------------------
def test_output_fields_and_text(arch_path):
    llm = make_llm(arch_path, num_kv_blocks=32)
    tok = llm.tokenizer
    outs = llm.generate(PROMPTS[:3] + [tok.encode(PROMPTS[3])],
                        SamplingParams(temperature=0, max_tokens=30))
    assert len(outs) == 4
    for i, out in enumerate(outs):
        assert isinstance(out, RequestOutput) and out.finished
        assert out.outputs[0] is out
        assert out.prompt == (PROMPTS[i] if i < 3 else None)
        assert out.finish_reason in ("stop", "length")
        assert 1 <= len(out.token_ids) <= 30
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
        assert out.logprobs is None
        m = out.metrics
        assert m.num_prompt_tokens == len(out.prompt_token_ids)
        assert m.num_generated_tokens == len(out.token_ids)
        assert m.ttft is not None and m.ttft >= 0
        assert m.tpot is not None and m.tpot >= 0
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert_no_leaks(llm)


def test_string_and_token_prompts_agree(qwen3_path):
    llm = make_llm(qwen3_path, num_kv_blocks=32)
    text = "class Foo(object):\n    def bar(self):"
    a = llm.generate(text, GREEDY)
    b = llm.generate(llm.tokenizer.encode(text), GREEDY)  # a bare token list is one prompt
    c = llm.generate([text, llm.tokenizer.encode(text)], GREEDY)
    assert len(a) == len(b) == 1 and len(c) == 2
    assert a[0].token_ids == b[0].token_ids == c[0].token_ids == c[1].token_ids
    assert a[0].text == b[0].text
    assert_no_leaks(llm)


def test_text_decodes_token_ids_for_many_outputs(llama_path):
    """Incremental detokenization over lots of random (often non-UTF-8) byte tokens."""
    llm = make_llm(llama_path)
    outs = llm.generate(random_prompts([4, 8, 16, 32, 64] * 2, seed=13),
                        SamplingParams(temperature=1.0, seed=3, max_tokens=48, ignore_eos=True))
    for out in outs:
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert_no_leaks(llm)


def test_per_prompt_sampling_params(qwen3_path):
    llm = make_llm(qwen3_path, num_kv_blocks=32)
    outs = llm.generate(["a", "b"], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                     SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)])
    assert [len(o.token_ids) for o in outs] == [3, 7]
    with pytest.raises(ValueError):
        llm.generate(["a", "b"], [SamplingParams()])
    assert_no_leaks(llm)


def test_default_sampling_params(qwen3_path):
    out = make_llm(qwen3_path, num_kv_blocks=32).generate("hello")[0]
    assert 1 <= len(out.token_ids) <= 16  # vLLM default max_tokens


def test_streaming_step_deltas(qwen3_path):
    llm = make_llm(qwen3_path, num_kv_blocks=32)
    eng = llm.engine
    rid = eng.add_request("def foo(x):", SamplingParams(temperature=0, max_tokens=12,
                                                         ignore_eos=True))
    text, ids, final = "", [], None
    while eng.has_unfinished():
        for out in eng.step():
            assert out.request_id == rid
            text += out.delta_text
            ids += out.delta_token_ids
            final = out
    assert final.finished and ids == final.token_ids and text == final.text
    assert_no_leaks(llm)


def test_output_kinds(qwen3_path):
    """vLLM's RequestOutputKind: cumulative (default), delta, final_only (offline generate)."""
    llm = make_llm(qwen3_path, num_kv_blocks=64)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    kinds = {k: eng.add_request("def foo(x):", params, output_kind=k)
             for k in ("cumulative", "delta", "final_only")}
    seen: dict[str, list] = {k: [] for k in kinds}
    by_id = {rid: k for k, rid in kinds.items()}
    # NOTE: steps skip building outputs while no live request reports every step
    assert eng.outputs.num_reporting == 2
    while eng.has_unfinished():
        for out in eng.step():
            seen[by_id[out.request_id]].append(out)
    final = {k: outs[-1] for k, outs in seen.items()}
    assert all(f.finished for f in final.values())
    want = final["cumulative"].token_ids
    assert len(want) == 10 and final["delta"].token_ids == want == final["final_only"].token_ids
    assert final["delta"].text == final["cumulative"].text == final["final_only"].text
    assert len(seen["final_only"]) == 1 and len(seen["cumulative"]) == 10
    # delta: each intermediate output holds only its step's tokens (and logprobs)
    inter = seen["delta"][:-1]
    assert [t for o in inter for t in o.token_ids] + final["delta"].delta_token_ids == want
    assert all(o.token_ids == o.delta_token_ids and len(o.logprobs) == len(o.token_ids)
               for o in inter)
    assert seen["cumulative"][3].token_ids == want[:4]
    assert eng.outputs.num_reporting == 0
    eng.abort(eng.add_request("def foo(x):", params, output_kind="delta"))
    assert eng.outputs.num_reporting == 0
    with pytest.raises(ConfigError, match="output_kind"):
        eng.add_request("x", params, output_kind="final")
    assert_no_leaks(llm)


def test_step_timings_account_for_the_steps(qwen3_path):
    import time

    llm = make_llm(qwen3_path, num_kv_blocks=64)
    t = llm.engine.timings
    assert t.steps == 0 and t.per_step_ms() == {}
    t0 = time.perf_counter()
    llm.generate(["def foo(x):", "x"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    wall = time.perf_counter() - t0
    parts = [t.schedule, t.runner_host, t.device_wait, t.postprocess]
    assert t.steps >= 8 and all(x > 0 for x in parts[:2] + parts[3:]) and t.device_wait >= 0
    assert sum(parts) <= wall  # parts of the steps, nothing counted twice
    assert set(t.per_step_ms()) == {"schedule", "runner_host", "device_wait", "postprocess"}
    before = t.copy()
    llm.generate(["y"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    delta = t.copy()
    delta.add(before, sign=-1)
    assert delta.steps == 3 and delta.runner_host > 0


def test_abort(qwen3_path):
    llm = make_llm(qwen3_path, num_kv_blocks=32)
    eng = llm.engine
    a = eng.add_request("def foo(x):", GREEDY)
    b = eng.add_request("class Bar:", GREEDY)
    eng.step()
    eng.step()
    out = eng.abort(a)
    assert out.finished and out.finish_reason == "abort"
    assert eng.abort(a) is None and eng.abort("nope") is None
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert list(done) == [b] and len(done[b].token_ids) == 24
    assert_no_leaks(llm)


def test_context_length_limit_finishes_with_length(qwen3_path):
    llm = make_llm(qwen3_path, num_kv_blocks=32, max_model_len=64)
    out = llm.generate([random_prompts([60], seed=14)[0]],
                       SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    # NOTE: more than the context leaves is refused (as vLLM does), not silently clamped
    with pytest.raises(ConfigError, match="max_tokens must be at most 4"):
        llm.generate([random_prompts([60], seed=14)[0]],
                     SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    out = llm.generate([random_prompts([60], seed=14)[0]],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    assert_no_leaks(llm)
