"""Engine-level bad input: clear ConfigErrors, and an engine that keeps working afterwards."""

from __future__ import annotations

import pytest
from helpers import assert_no_leaks, random_prompts

from blockspec import LLM, EngineConfig, SamplingParams
from blockspec.config import ConfigError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen3_path) -> LLM:
    return LLM(str(qwen3_path), device="cpu", num_kv_blocks=8, kv_block_size=16, max_model_len=96)


@pytest.fixture(scope="module")
def reference(llm):
    out = llm.generate("def foo(x):", GREEDY)[0]
    assert_no_leaks(llm)
    return out.token_ids


@pytest.fixture(autouse=True)
def _engine_still_works(request):
    """After every test here (each feeds bad input), the shared engine has no leaked blocks or
    requests, and generates exactly what it generated before."""
    yield
    if "llm" in request.fixturenames:
        llm = request.getfixturevalue("llm")
        ref = request.getfixturevalue("reference")
        assert_no_leaks(llm)
        assert llm.generate("def foo(x):", GREEDY)[0].token_ids == ref
        assert_no_leaks(llm)


@pytest.mark.parametrize("prompt", ["", [], [[]]], ids=["empty-str", "empty-list-as-prompt",
                                                        "empty-token-list"])
def test_empty_prompt(llm, reference, prompt):
    if prompt == []:  # an empty batch is not an error: nothing to do
        assert llm.generate(prompt, GREEDY) == []
        return
    with pytest.raises(ConfigError, match="empty"):
        llm.generate(prompt, GREEDY)


@pytest.mark.parametrize("ids", [[1, 2, 512], [-1, 3], [5, 10**9]])
def test_token_ids_out_of_vocab(llm, reference, ids):
    with pytest.raises(ConfigError, match=r"\[0, 512\)"):
        llm.generate([ids], GREEDY)


def test_non_integer_token_ids(llm, reference):
    with pytest.raises(ConfigError, match="integers"):
        llm.generate([[1, 2.5, 3]], GREEDY)


@pytest.mark.parametrize("n", [96, 97, 200])
def test_prompt_longer_than_context(llm, reference, n):
    prompt = random_prompts([n], seed=n)[0]
    with pytest.raises(ConfigError, match=f"prompt has {n} tokens.*context length is 96"):
        llm.generate([prompt], GREEDY)


def test_long_string_prompt_beyond_context(llm, reference):
    text = "def foo(x):\n    return x\n" * 40
    assert len(llm.tokenizer.encode(text)) > 96
    with pytest.raises(ConfigError, match="context length"):
        llm.generate(text, GREEDY)


def test_prompt_that_just_fits_generates_to_context_end(llm, reference):
    prompt = random_prompts([95], seed=3)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None,
                                                ignore_eos=True))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_kv_cache_too_small_for_request(qwen3_path):
    llm = LLM(str(qwen3_path), device="cpu", num_kv_blocks=3, kv_block_size=16)
    prompt = random_prompts([40], seed=5)[0]
    with pytest.raises(ConfigError, match=r"needs 4 KV blocks.*holds 3"):
        llm.generate([prompt], SamplingParams(max_tokens=9))
    assert_no_leaks(llm)
    # max_tokens=None means "as far as the context and the cache allow": 3 blocks of 16 here.
    out = llm.generate([prompt], SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 * 16 - 40 and out.finish_reason == "length"
    assert_no_leaks(llm)
    # A fitting request queued before the failing one is aborted with it, nothing leaks.
    with pytest.raises(ConfigError, match="KV blocks"):
        llm.generate([prompt[:5], prompt], SamplingParams(max_tokens=9))
    assert_no_leaks(llm)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    assert_no_leaks(llm)


def test_bad_request_in_a_batch_aborts_the_whole_batch(llm, reference):
    good = random_prompts([10, 20], seed=6)
    with pytest.raises(ConfigError):
        llm.generate([good[0], good[1], [1, 99999]], GREEDY)
    assert not llm.engine.requests and not llm.engine.has_unfinished()
    with pytest.raises(ConfigError):
        llm.generate([good[0], ""], GREEDY)


def test_mismatched_params_list(llm, reference):
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(["a", "b", "c"], [GREEDY, GREEDY])


def test_duplicate_request_id(llm, reference):
    eng = llm.engine
    eng.add_request("hello", GREEDY, request_id="dup")
    with pytest.raises(ConfigError, match="already in use"):
        eng.add_request("world", GREEDY, request_id="dup")
    while eng.has_unfinished():
        eng.step()


def test_bad_engine_config(qwen3_path):
    path = str(qwen3_path)
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(path, device="cpu", num_kv_blocks=4, max_model_len=4096)  # > max_position_embeddings
    for kwargs in [dict(device="tpu"), dict(kv_block_size=12), dict(kv_block_size=0),
                   dict(num_kv_blocks=0), dict(max_num_seqs=0), dict(max_num_batched_tokens=0),
                   dict(max_model_len=0), dict(dtype="float8"), dict(kv_cache_memory_gb=0)]:
        with pytest.raises(ConfigError):
            EngineConfig(model=path, **kwargs)


def test_bad_sampling_params_do_not_reach_the_engine(llm, reference):
    with pytest.raises(ConfigError):
        llm.generate("hello", SamplingParams(temperature=-1))


def test_numpy_and_tuple_prompts(llm, reference):
    import numpy as np

    ids = llm.tokenizer.encode("def foo(x):")
    assert llm.generate(np.array(ids), GREEDY)[0].token_ids == reference
    assert llm.generate(tuple(ids), GREEDY)[0].token_ids == reference
    assert llm.generate([np.array(ids)], GREEDY)[0].token_ids == reference


def test_no_max_tokens_fits_the_cache(llm):
    """max_tokens=None means "what the context and the KV cache can hold" (8 blocks x 16 here,
    less than max_model_len 96 would allow only if the cache were smaller): never refused."""
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=None,
                                                    ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == min(96, 8 * 16) - 3
