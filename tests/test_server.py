"""The OpenAI-compatible server, live on loopback, driven by the official `openai` client (and raw
httpx for malformed bodies and disconnects)."""

from __future__ import annotations

import json
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from blockspec import LLM, SamplingParams
from blockspec.config import ConfigError, EngineConfig
from blockspec.engine.llm_engine import LLMEngine
from blockspec.server.api import build_app
from blockspec.server.runner import BackgroundServer
from blockspec.server.stream import RequestStream

MODEL = "tiny-qwen3"
CTX = 256
PROMPT = "def fibonacci(n):"


def make_engine(path: Path, **kw) -> LLMEngine:
    cfg = dict(model=str(path), device="cpu", num_kv_blocks=48, kv_block_size=16,
               max_model_len=CTX)
    return LLMEngine(EngineConfig(**{**cfg, **kw}))


@pytest.fixture(scope="module")
def engine(qwen3_path) -> LLMEngine:
    return make_engine(qwen3_path)


@pytest.fixture(scope="module")
def server(engine) -> Iterator[BackgroundServer]:
    with BackgroundServer(build_app(engine, MODEL)) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(qwen3_path) -> LLM:
    """The same model offline: the server must return exactly what the engine generates."""
    return LLM(str(qwen3_path), device="cpu", num_kv_blocks=48, kv_block_size=16,
               max_model_len=CTX)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def wait_for(cond: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def idle(engine: LLMEngine) -> bool:
    return engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished() \
        and not engine.requests


@pytest.fixture(autouse=True)
def _no_leaks_after(request):
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        assert wait_for(lambda: idle(eng)), "KV blocks or requests left behind"


JSON = {"Content-Type": "application/json"}


def metric(server: BackgroundServer, name: str, labels: str = "") -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} missing from /metrics"
    return float(m.group(1))


def greedy(**kw) -> dict:
    return dict(model=MODEL, temperature=0, **kw)


# -- happy paths -----------------------------------------------------------------------------------
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_completion_stream_equals_nonstream_and_usage(client, engine, offline):
    kw = greedy(prompt=PROMPT, max_tokens=12, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12,
                                                  ignore_eos=True))[0]
    assert full.choices[0].text == ref.text
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert full.created > 0 and full.model == MODEL
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    n_prompt = len(engine.tokenizer.encode(PROMPT))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens,
            full.usage.total_tokens) == (n_prompt, 12, n_prompt + 12)

    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == choice.text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert len({c.id for c in chunks}) == 1
    # the same prompt as token ids, and as a batch of one
    ids = engine.tokenizer.encode(PROMPT)
    assert client.completions.create(**{**kw, "prompt": ids}).choices[0].text == choice.text
    assert client.completions.create(**{**kw, "prompt": [PROMPT]}).choices[0].text == choice.text


def test_chat_stream_equals_nonstream(client):
    kw = greedy(messages=[{"role": "system", "content": "Be terse."},
                          {"role": "user", "content": "Write a haiku."}],
                max_completion_tokens=10, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == msg.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    parts = [{"type": "text", "text": "Write a "}, {"type": "text", "text": "haiku."}]
    as_parts = client.chat.completions.create(**{**kw, "messages": [
        kw["messages"][0], {"role": "user", "content": parts}]})
    assert as_parts.choices[0].message.content == msg.content
    # max_tokens (the older name) works too, and no limit at all runs until EOS or the context
    old = client.chat.completions.create(**{**kw, "max_completion_tokens": None}, max_tokens=10)
    assert old.choices[0].message.content == msg.content
    free = client.chat.completions.create(model=MODEL, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}])
    assert free.choices[0].finish_reason in ("stop", "length")
    assert free.usage.total_tokens <= CTX


def test_stop_strings_and_stop_tokens(client, offline):
    kw = greedy(prompt=PROMPT, max_tokens=24, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    stop = text[6:9]
    cut = text.index(stop)
    for stream in (False, True):
        r = client.completions.create(**kw, stop=[stop, "\x00"], stream=stream)
        got = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
        assert got == text[:cut]
        if not stream:
            assert r.choices[0].finish_reason == "stop"
    r = client.completions.create(**{**kw, "stop": stop})
    assert r.choices[0].text == text[:cut]
    r = client.completions.create(**{**kw, "extra_body": {
        "ignore_eos": True, "include_stop_str_in_output": True}}, stop=stop)
    assert r.choices[0].text == text[:cut + len(stop)]
    # stop_token_ids (vLLM extension): stop at the first generated token, its text left out
    first = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1))[0].token_ids[0]
    r = client.completions.create(**greedy(prompt=PROMPT, max_tokens=8,
                                           extra_body={"stop_token_ids": [first]}))
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    assert r.choices[0].text == ""


def test_seed_reproducible(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                         temperature=1.0, top_p=0.95, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    a = sample(7)
    assert sample(7) == a
    assert len({a, sample(8), sample(9), sample(10)}) > 1  # the seed is actually used


def test_logprobs(client):
    r = client.completions.create(**greedy(prompt=PROMPT, max_tokens=6, logprobs=3,
                                           extra_body={"ignore_eos": True}))
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and top[tok] == chosen
        assert chosen == pytest.approx(max(top.values()))  # greedy takes the most likely
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        **greedy(prompt=PROMPT, max_tokens=6, logprobs=3, stream=True,
                 extra_body={"ignore_eos": True})) if c.choices[0].logprobs]
    assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(lp.token_logprobs)

    c = client.chat.completions.create(**greedy(messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5, logprobs=True, top_logprobs=2,
                                                extra_body={"ignore_eos": True}))
    content = c.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    plain = client.chat.completions.create(**greedy(messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=3))
    assert plain.choices[0].logprobs is None


def test_concurrent_greedy_requests_match_sequential(client):
    prompts = [f"x = {i} * " + "y" * i for i in range(6)]

    def run(p: str) -> str:
        return client.completions.create(**greedy(prompt=p, max_tokens=10)).choices[0].text

    sequential = [run(p) for p in prompts]
    results: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(prompts[i])))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results[i] for i in range(len(prompts))] == sequential


# -- malformed requests: every parameter, always an OpenAI-style 4xx -----------------------------
C, CH = "/v1/completions", "/v1/chat/completions"
OK_C = {"model": MODEL, "prompt": "x", "max_tokens": 2}
OK_CH = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
LONG_IDS = list(range(1, CTX + 20))

BAD = [  # (endpoint, fields merged into a valid body, param the error must name)
    (C, {"model": 5}, "model"), (C, {"model": None}, "model"),
    (C, {"prompt": ""}, "prompt"), (C, {"prompt": []}, "prompt"), (C, {"prompt": [""]}, "prompt"),
    (C, {"prompt": 5}, "prompt"), (C, {"prompt": [1.5]}, "prompt"),
    (C, {"prompt": [True]}, "prompt"), (C, {"prompt": ["a", "b"]}, "prompt"),
    (C, {"prompt": [10**9]}, "prompt"), (C, {"prompt": [-1]}, "prompt"),
    (C, {"prompt": LONG_IDS}, "prompt"), (C, {"prompt": LONG_IDS, "stream": True}, "prompt"),
    (C, {"prompt": "word " * 400}, "prompt"),
    (C, {"prompt": {"text": "x"}}, "prompt"),
    (C, {"max_tokens": 0}, "max_tokens"), (C, {"max_tokens": -1}, "max_tokens"),
    (C, {"max_tokens": "5"}, "max_tokens"), (C, {"max_tokens": 1.5}, "max_tokens"),
    (C, {"max_tokens": True}, "max_tokens"),
    (C, {"temperature": -1}, "temperature"), (C, {"temperature": "hot"}, "temperature"),
    (C, {"temperature": [1]}, "temperature"),
    (C, {"top_p": 2}, "top_p"), (C, {"top_p": 0}, "top_p"), (C, {"top_p": "1"}, "top_p"),
    (C, {"top_k": -2}, "top_k"), (C, {"top_k": 1.5}, "top_k"),
    (C, {"min_p": 1.5}, "min_p"), (C, {"min_p": -0.1}, "min_p"),
    (C, {"seed": "7"}, "seed"), (C, {"seed": 1.5}, "seed"), (C, {"seed": 2**70}, "seed"),
    (C, {"stop": 5}, "stop"), (C, {"stop": [1]}, "stop"), (C, {"stop": ""}, "stop"),
    (C, {"stop": ["ok", ""]}, "stop"),
    (C, {"n": 0}, "n"), (C, {"n": "1"}, "n"),
    (C, {"logprobs": -1}, "logprobs"), (C, {"logprobs": 21}, "logprobs"),
    (C, {"logprobs": 10**6}, "logprobs"), (C, {"logprobs": True}, "logprobs"),
    (C, {"stream": "yes"}, "stream"),
    (C, {"stream_options": {"include_usage": True}}, "stream_options"),
    (C, {"stream": True, "stream_options": {"include_usage": "x"}}, "stream_options"),
    (C, {"stream": True, "stream_options": 3}, "stream_options"),
    (C, {"ignore_eos": "x"}, "ignore_eos"),
    (C, {"stop_token_ids": [-1]}, "stop_token_ids"), (C, {"stop_token_ids": "x"}, "stop_token_ids"),
    (C, {"stop_token_ids": [1.5]}, "stop_token_ids"),
    (C, {"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    (C, {"presence_penalty": 2.5}, "presence_penalty"),
    (C, {"frequency_penalty": -3}, "frequency_penalty"),
    (C, {"repetition_penalty": 0.0}, "repetition_penalty"),
    (C, {"logit_bias": {"x": 5}}, "logit_bias"), (C, {"logit_bias": {"1": 500}}, "logit_bias"),
    (C, {"logit_bias": {"-1": 5}}, "logit_bias"),
    (C, {"logit_bias": {"99999999": 1}}, "logit_bias"),
    (C, {"n": 0}, "n"), (C, {"n": 10**6}, "n"), (C, {"min_tokens": -1}, "min_tokens"),
    (C, {"min_tokens": 17}, "min_tokens"), (C, {"max_tokens": 10**9}, "max_tokens"),
    (C, {"max_tokens": 2**64}, "max_tokens"), (C, {"seed": 2**64}, "seed"),
    (C, {"stop_token_ids": [2**63]}, "stop_token_ids"),
    (C, {"stop_token_ids": [10**30]}, "stop_token_ids"),
    (C, {"logprobs": 2**63}, "logprobs"),
    (C, {"use_beam_search": True}, "use_beam_search"),
    (C, {"prompt_logprobs": 1}, "prompt_logprobs"),
    (C, {"guided_json": {"type": "object"}}, "guided_json"),
    (C, {"skip_special_tokens": "no"}, "skip_special_tokens"),
    (C, {"stream": True, "stream_options": {"continuous_usage_stats": 1}}, "stream_options"),
    (C, {"stream": True, "stream_options": {"bogus": True}}, "stream_options"),
    (C, {"echo": True}, "echo"),
    (C, {"best_of": 2}, "best_of"), (C, {"suffix": "x"}, "suffix"), (C, {"user": 5}, "user"),
    (CH, {"messages": []}, "messages"), (CH, {"messages": "hi"}, "messages"),
    (CH, {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    (CH, {"messages": [{"content": "x"}]}, "messages"),
    (CH, {"messages": [{"role": "user", "content": 5}]}, "messages"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
    (CH, {"messages": [{"role": "user", "content": "word " * 400}]}, "messages"),
    (CH, {"max_completion_tokens": 0}, "max_completion_tokens"),
    (CH, {"max_tokens": -5}, "max_tokens"),
    (CH, {"logprobs": 3}, "logprobs"), (CH, {"top_logprobs": 2}, "top_logprobs"),
    (CH, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    (CH, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CH, {"temperature": -1}, "temperature"), (CH, {"top_p": 2}, "top_p"),
    (CH, {"n": 129}, "n"), (CH, {"seed": "x"}, "seed"), (CH, {"stop": [None]}, "stop"),
    (CH, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CH, {"tool_choice": "auto"}, "tool_choice"), (CH, {"reasoning_effort": "low"},
                                                    "reasoning_effort"),
    (CH, {"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages"),
    (CH, {"response_format": {"type": "json_object"}}, "response_format"),
    (CH, {"add_generation_prompt": "no"}, "add_generation_prompt"),
]


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("path,fields,param", BAD,
                         ids=[f"{p.split('/')[-1]}-{json.dumps(f)[:40]}" for p, f, _ in BAD])
def test_bad_parameter_is_400(server, path, fields, param):
    body = {**(OK_C if path == C else OK_CH), **fields}
    assert_openai_error(httpx.post(server.url + path, json=body, timeout=30), 400, param)


@pytest.mark.parametrize("path", [C, CH])
@pytest.mark.parametrize("raw", [b"{", b"", b"[]", b"null", b'"x"', b"\xff\xfe", b'{"model": }'])
def test_malformed_json_is_400(server, path, raw):
    r = httpx.post(server.url + path, content=raw, headers={"Content-Type": "application/json"})
    assert_openai_error(r, 400)


@pytest.mark.parametrize("path,missing", [(C, "model"), (C, "prompt"), (CH, "model"),
                                          (CH, "messages")])
def test_missing_field_is_400(server, path, missing):
    body = {k: v for k, v in (OK_C if path == C else OK_CH).items() if k != missing}
    assert_openai_error(httpx.post(server.url + path, json=body), 400, missing)


def test_nan_temperature_is_400(server):
    raw = b'{"model": "%s", "prompt": "x", "temperature": NaN}' % MODEL.encode()
    assert_openai_error(httpx.post(server.url + C, content=raw, headers=JSON), 400)


@pytest.mark.parametrize("path", [C, CH])
def test_unknown_model_is_404(server, client, path):
    body = {**(OK_C if path == C else OK_CH), "model": "gpt-4"}
    err = assert_openai_error(httpx.post(server.url + path, json=body), 404, "model")
    assert err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)


def test_unknown_route_and_method(server):
    assert_openai_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_openai_error(httpx.get(server.url + C), 405)


def test_server_still_serves_after_bad_requests(client):
    r = client.completions.create(**greedy(prompt=PROMPT, max_tokens=3))
    assert r.choices[0].finish_reason in ("stop", "length")


# -- API key ---------------------------------------------------------------------------------------
def test_api_key_enforced(qwen3_path):
    with BackgroundServer(build_app(make_engine(qwen3_path), MODEL, api_key="sekrit")) as srv:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"},
                        {"Authorization": "Basic sekrit"}, {"Authorization": "Bearer sekrit2"},
                        {"Authorization": "Bearer"}, {"X-Api-Key": "sekrit"}):
            for method, path in (("GET", "/v1/models"), ("POST", C), ("POST", CH),
                                 ("GET", "/v1/nothing")):
                r = httpx.request(method, srv.url + path, json=OK_C, headers=headers)
                assert assert_openai_error(r, 401)["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/metrics").status_code == 200
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        r = httpx.get(srv.url + "/v1/models", headers={"Authorization": "bearer sekrit"})
        assert r.status_code == 200  # the auth scheme is case-insensitive
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
        assert good.completions.create(**greedy(prompt="x", max_tokens=2)).usage.total_tokens


def test_no_chat_template_is_400(qwen3_path, tmp_path):
    folder = tmp_path / "no-template"
    shutil.copytree(qwen3_path, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with TestClient(build_app(make_engine(folder), MODEL)) as tc:
        err = assert_openai_error(tc.post(CH, json=OK_CH), 400, "messages")
        assert "chat template" in err["message"]
        assert tc.post(C, json=OK_C).status_code == 200


# -- disconnects, metrics, shutdown ----------------------------------------------------------------
def test_stream_disconnect_aborts_and_frees_blocks(server, engine):
    aborted = metric(server, "blockspec_requests_total", '{finish_reason="abort"}')
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": CTX - 20, "ignore_eos": True,
            "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + C, json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert engine.block_manager.num_used_blocks > 0
    # closing the response drops the connection mid-stream
    assert wait_for(lambda: idle(engine))
    assert wait_for(lambda: metric(server, "blockspec_requests_total",
                                   '{finish_reason="abort"}') == aborted + 1)


def test_nonstream_disconnect_aborts_and_frees_blocks(server, engine, monkeypatch):
    """The client hangs up while its request runs: the engine is held after every step until
    the server has asked for the abort, so the request cannot finish first whatever the
    machine's speed."""
    aborted = metric(server, "blockspec_requests_total", '{finish_reason="abort"}')
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": CTX - 20,
                       "ignore_eos": True, "temperature": 0}).encode()
    asked, step, abort = threading.Event(), engine.step, RequestStream.abort

    def held_step():
        out = step()
        asked.wait(30)
        return out

    def abort_asked(self):
        abort(self)
        asked.set()

    monkeypatch.setattr(engine, "step", held_step)
    monkeypatch.setattr(RequestStream, "abort", abort_asked)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {C} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_for(lambda: engine.block_manager.num_used_blocks > 0)
    assert asked.wait(30)
    assert wait_for(lambda: idle(engine))
    assert wait_for(lambda: metric(server, "blockspec_requests_total",
                                   '{finish_reason="abort"}') == aborted + 1)


def test_metrics_move(server, client):
    text = httpx.get(server.url + "/metrics").text
    for name in ("blockspec_requests_total", "blockspec_prompt_tokens_total",
                 "blockspec_generation_tokens_total", "blockspec_time_to_first_token_seconds",
                 "blockspec_time_per_output_token_seconds", "blockspec_num_requests_running",
                 "blockspec_num_requests_waiting", "blockspec_kv_cache_usage_perc",
                 "blockspec_spec_decode_draft_tokens_total",
                 "blockspec_spec_decode_accepted_tokens_total",
                 "blockspec_spec_decode_verify_steps_total"):
        assert f"\n{name}" in text, name
    moved = {("blockspec_requests_total", '{finish_reason="length"}'): lambda r: 1,
             ("blockspec_prompt_tokens_total", ""): lambda r: r.usage.prompt_tokens,
             ("blockspec_generation_tokens_total", ""): lambda r: 5,
             ("blockspec_time_to_first_token_seconds_count", ""): lambda r: 1,
             ("blockspec_time_per_output_token_seconds_count", ""): lambda r: 1}
    before = {key: metric(server, *key) for key in moved}
    def steps(path: str) -> float:  # NOTE: a path with no step yet has no sample
        text = httpx.get(server.url + "/metrics").text
        m = re.search(rf'^blockspec_engine_steps_total\{{path="{path}"\}} (\S+)$', text, re.M)
        return float(m.group(1)) if m else 0.0

    paths = {p: steps(p) for p in ("decode", "eager")}
    r = client.completions.create(**greedy(prompt=PROMPT, max_tokens=5,
                                           extra_body={"ignore_eos": True}))
    for key, delta in moved.items():  # NOTE: recorded before the response is handed over
        assert metric(server, *key) == before[key] + delta(r), key
    # the gauges are published after the step that finished the request
    assert wait_for(lambda: metric(server, "blockspec_kv_cache_usage_perc") == 0.0)
    # one prefill step (eager on CPU), then a decode step per further token
    assert steps("eager") == paths["eager"] + 1 and steps("decode") == paths["decode"] + 4
    assert wait_for(lambda: metric(server, "blockspec_num_requests_running") == 0.0)


def test_shutdown_aborts_inflight_streams(qwen3_path):
    eng = make_engine(qwen3_path)
    srv = BackgroundServer(build_app(eng, MODEL)).start()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": CTX - 20, "ignore_eos": True,
            "stream": True}
    events: list[str] = []
    with httpx.stream("POST", srv.url + C, json=body, timeout=30) as r:
        lines = r.iter_lines()
        events.append(next(lines))
        t0 = time.monotonic()
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        events += [line for line in lines if line]
    stopper.join(30)
    assert not stopper.is_alive() and time.monotonic() - t0 < 10
    assert "data: [DONE]" not in events  # the stream did not run to its end
    assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "engine_unavailable"
    assert idle(eng)
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health")


def test_tiny_top_p_is_greedy(client):
    ref = client.completions.create(**greedy(prompt=PROMPT, max_tokens=4,
                                             extra_body={"ignore_eos": True})).choices[0].text
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, top_p=1e-300,
                                  seed=1, extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref


def test_body_too_large_is_413(server):
    r = httpx.post(server.url + C, content=b'{"prompt": "' + b"x" * (17 << 20) + b'"}',
                   headers=JSON)
    assert_openai_error(r, 413)


def test_engine_thread_death_is_503_not_a_hang(qwen3_path, monkeypatch):
    """An error outside a step's own failure handling ends the engine thread: requests are
    refused (503), never left hanging (`blockspec serve` then exits non-zero)."""
    eng = make_engine(qwen3_path)

    def broken_step():
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(eng, "step", broken_step)
    with TestClient(build_app(eng, MODEL)) as tc:
        r = tc.post(C, json=OK_C)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert "simulated device failure" in r.json()["error"]["message"]
        assert tc.get("/health").status_code == 503
        assert tc.post(C, json=OK_C).status_code == 503  # refused, not queued


# -- speculative decoding --------------------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_dflash_server_is_lossless_and_exports_acceptance(qwen3_path, tmp_path, client,
                                                          async_scheduling):
    from blockspec.dflash.checkpoint import build_random_drafter

    drafter = build_random_drafter(tmp_path / "drafter", qwen3_path, num_layers=2, block_size=4)
    # NOTE: block 4 alone, so every verify step drafts 3 tokens (the counts checked below), and
    # the fixed policy: the adaptive one chooses from step costs measured on this (maybe loaded)
    # machine, and may decode plainly throughout (no verify step to count)
    eng = make_engine(qwen3_path, draft=str(drafter), block_size=4, block_sizes=(4,),
                      speculation_policy="fixed", async_scheduling=async_scheduling)
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 0,
          "ignore_eos": True}
    # the reference is the plain (no drafter) server's greedy text
    ref = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
    with TestClient(build_app(eng, MODEL)) as tc:
        r = tc.post(C, json=kw)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref
        streamed = tc.post(C, json={**kw, "stream": True}).text
        text = "".join(json.loads(line[6:])["choices"][0]["text"]
                       for line in streamed.splitlines()
                       if line.startswith("data: {"))
        assert text == ref
        m = tc.get("/metrics").text
    assert (eng.runner.path_steps["ahead"] > 0) == async_scheduling

    def value(name: str) -> float:
        return float(re.search(rf"^{name} (\S+)$", m, re.M).group(1))

    steps = value("blockspec_spec_decode_verify_steps_total")
    drafted = value("blockspec_spec_decode_draft_tokens_total")
    accepted = value("blockspec_spec_decode_accepted_tokens_total")
    assert steps > 0 and drafted == 3 * steps and 0 <= accepted <= drafted
    assert 1.0 <= (accepted + steps) / steps <= 4.0
    per_pos = [float(v) for v in re.findall(
        r'^blockspec_spec_decode_accepted_tokens_per_position_total\{position="\d"\} (\S+)$',
        m, re.M)]
    assert len(per_pos) == 3 and sum(per_pos) == accepted


def test_synthetic_acceptance_is_never_served(qwen3_path):
    cfg = EngineConfig(model=str(qwen3_path), device="cpu", draft=str(qwen3_path),
                       synthetic_acceptance=0.9, benchmark_mode=True)
    with pytest.raises(ConfigError, match="never served"):
        build_app(cfg, MODEL)


def test_infinite_penalty_is_400(server):
    raw = b'{"model": "%s", "prompt": "x", "repetition_penalty": 1e400}' % MODEL.encode()
    assert_openai_error(httpx.post(server.url + C, content=raw, headers=JSON), 400,
                        "repetition_penalty")
