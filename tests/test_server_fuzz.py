"""Property-based: whatever a client sends to /v1/completions or /v1/chat/completions, the
server answers 2xx or 4xx with an OpenAI-shaped body, never 5xx, and keeps serving with no KV
blocks left behind. Hypothesis draws bodies over the request schema, mixing valid values with
the kinds that once broke it (integers past int64, tiny and non-finite floats, wrong types,
unknown fields); `derandomize` makes the run the same on every machine."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockspec.config import EngineConfig
from blockspec.engine.llm_engine import LLMEngine
from blockspec.server.api import build_app

MODEL = "tiny"
JSON = {"Content-Type": "application/json"}

# NOTE: small integers, or ones far past every bound (so a drawn request never generates for
# long: max_tokens and n are either small or refused).
ints = st.one_of(st.integers(-3, 12), st.integers(2**31, 2**70), st.integers(-(2**70), -(2**31)))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 2),
                   st.sampled_from([0.0, 1e-38, 1e-300, 5e-324, 1.0, 1e38, 3.5e38]))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=6))
anything = st.recursive(scalars, lambda c: st.lists(c, max_size=3)
                        | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=6)


def request(required: dict, optional: dict) -> st.SearchStrategy:
    """Half the bodies valid in every field (edge values included: they must generate), half
    with any field replaced by anything, plus an unknown field now and then."""
    valid = st.fixed_dictionaries(required, optional=optional)
    fuzzed = st.fixed_dictionaries(
        {k: st.one_of(v, anything) if k != "model" else v for k, v in required.items()},
        optional={**{k: st.one_of(v, anything) for k, v in optional.items()},
                  "guided_json": anything, "reasoning_effort": anything, "best_of": anything})
    return st.one_of(valid, fuzzed)


COMMON = {
    "max_tokens": st.integers(3, 6),
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([0.0, 1e-38, 1e-300, 1e6])),
    "top_p": st.one_of(st.floats(1e-300, 1), st.just(1.0)),
    "top_k": st.one_of(st.integers(-1, 20), st.integers(2**31, 2**63 - 1), st.just(2**70)),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**64 - 1), "n": st.integers(1, 3),
    "stop": st.one_of(st.text(min_size=1, max_size=3),
                      st.lists(st.text(min_size=1, max_size=3), max_size=2)),
    "stop_token_ids": st.lists(st.integers(0, 511), max_size=4), "stream": st.booleans(),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 10),
    "logit_bias": st.dictionaries(st.integers(0, 511).map(str), st.floats(-100, 100),
                                  max_size=3),
    "min_tokens": st.integers(0, 3), "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "user": st.text(max_size=4), "use_beam_search": st.just(False),
}
STREAM_OPTIONS = st.fixed_dictionaries({}, optional={
    "include_usage": st.booleans(), "continuous_usage_stats": st.booleans()})
COMPLETION = request(
    {"model": st.just(MODEL), "prompt": st.one_of(st.text(min_size=1, max_size=12),
                                                  st.lists(st.integers(0, 511), min_size=1,
                                                           max_size=6))},
    {**COMMON, "logprobs": st.integers(0, 5), "echo": st.just(False)})
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                 "content": st.text(max_size=10)})
CHAT = request(
    {"model": st.just(MODEL), "messages": st.lists(MESSAGE, min_size=1, max_size=3)},
    {**COMMON, "max_completion_tokens": st.integers(3, 6), "logprobs": st.booleans(),
     "tool_choice": st.just("none")})


def with_stream_options(body: dict, opts: dict) -> dict:
    return {**body, "stream_options": opts} if body.get("stream") is True else body


@pytest.fixture(scope="module")
def tc(qwen3_path) -> Iterator[TestClient]:
    # NOTE: a small cache (8 blocks of 16) so drawn requests also queue and preempt
    eng = LLMEngine(EngineConfig(model=str(qwen3_path), device="cpu", num_kv_blocks=8,
                                 kv_block_size=16, max_model_len=128))
    with TestClient(build_app(eng, MODEL)) as client:
        yield client
    assert eng.block_manager.num_used_blocks == 0 and not eng.requests


def check_answer(r, stream: bool) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        return
    assert r.status_code == 200
    if not stream:
        body = r.json()
        assert body["choices"] and set(body["usage"]) == {"prompt_tokens", "completion_tokens",
                                                           "total_tokens"}
        return
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", lines[-2:]
    assert all("error" not in json.loads(ln) for ln in lines[:-1])


SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@pytest.mark.parametrize("path,bodies", [("/v1/completions", COMPLETION),
                                         ("/v1/chat/completions", CHAT)],
                         ids=["completions", "chat"])
@SETTINGS
@given(data=st.data())
def test_never_5xx(tc, path, bodies, data):
    body = with_stream_options(data.draw(bodies), data.draw(STREAM_OPTIONS))
    r = tc.post(path, content=json.dumps(body), headers=JSON)
    check_answer(r, body.get("stream") is True)


def test_still_serving_afterwards(tc):
    r = tc.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and tc.get("/health").status_code == 200
    eng = tc.app.state.engine.engine
    assert eng.block_manager.num_used_blocks == 0 and not eng.requests
