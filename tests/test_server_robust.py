"""The server under requests that once broke it (issue 26's defects), and the sampling fields
vLLM/SGLang users expect (n, min_tokens, penalties, logit_bias, skip_special_tokens), with and
without a DFlash drafter. In-process through FastAPI's TestClient."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from blockspec import LLM, SamplingParams
from blockspec.config import EngineConfig
from blockspec.engine.llm_engine import LLMEngine
from blockspec.server.api import build_app

MODEL = "tiny"
C, CH = "/v1/completions", "/v1/chat/completions"
PROMPT = "def f(x):"


def make_engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(**{**dict(model=str(path), device="cpu", num_kv_blocks=64,
                                            kv_block_size=16, max_model_len=256), **kw}))


@pytest.fixture(scope="module")
def engine(qwen3_path) -> LLMEngine:
    return make_engine(qwen3_path)


@pytest.fixture(scope="module")
def tc(engine) -> Iterator[TestClient]:
    with TestClient(build_app(engine, MODEL)) as client:
        yield client


@pytest.fixture(scope="module")
def spec_tc(qwen3_path, drafter16) -> Iterator[TestClient]:
    with TestClient(build_app(make_engine(qwen3_path, draft=str(drafter16)), MODEL)) as client:
        yield client


def idle(client: TestClient) -> bool:
    eng = client.app.state.engine.engine
    return eng.block_manager.num_used_blocks == 0 and not eng.requests


def text_of(r) -> list[str]:
    assert r.status_code == 200, r.text
    return [c["text"] for c in r.json()["choices"]]


def streamed(r) -> tuple[dict[int, str], list[dict]]:
    """(choice index -> text, every event) of an SSE response that ended with [DONE]."""
    assert r.status_code == 200, r.text
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    events = [json.loads(ln) for ln in lines[:-1]]
    texts: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (
                c.get("text") or (c.get("delta") or {}).get("content") or "")
    return texts, events


# -- defects ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("top_k", [2**63, 2**64, 10**30])
def test_huge_top_k_is_off_not_a_dead_engine(tc, top_k):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    free = text_of(tc.post(C, json={**body, "temperature": 1.0, "seed": 3}))
    assert text_of(tc.post(C, json={**body, "temperature": 1.0, "seed": 3, "top_k": top_k})) \
        == free
    assert tc.post(C, json={**body, "temperature": 0, "top_k": top_k}).status_code == 200
    chat = tc.post(CH, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 4, "top_k": top_k, "stream": True})
    streamed(chat)
    assert tc.get("/health").status_code == 200 and idle(tc)


@pytest.mark.parametrize("t", [1e-38, 1e-300, 3e-6])
def test_tiny_temperature_is_greedy(tc, t):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
    assert text_of(tc.post(C, json={**body, "temperature": t})) == \
        text_of(tc.post(C, json={**body, "temperature": 0}))


def test_min_tokens_with_a_stop_string(tc, engine):
    """The issue's example: min_tokens 8 with stop "\\n" returned "" (min_tokens was dropped)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    free = tc.post(C, json=body).json()["choices"][0]["text"]
    stop = free[:1]  # the first character: it stops at once without min_tokens
    assert text_of(tc.post(C, json={**body, "stop": stop})) == [""]
    r = tc.post(C, json={**body, "stop": stop, "min_tokens": 8})
    assert r.json()["usage"]["completion_tokens"] >= 8 and free.startswith(text_of(r)[0])


def test_max_tokens_beyond_the_context_is_400(tc):
    r = tc.post(C, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 10**9})
    assert r.status_code == 400 and "max_tokens must be at most" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "max_tokens"


def test_a_failing_step_fails_only_its_requests(qwen3_path, monkeypatch):
    eng = make_engine(qwen3_path)
    real = eng.runner.execute
    calls = {"n": 0}

    def flaky(seqs, num_new_tokens, *rest):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("simulated bug in a step")
        return real(seqs, num_new_tokens, *rest)

    monkeypatch.setattr(eng.runner, "execute", flaky)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    with TestClient(build_app(eng, MODEL)) as client:
        r = client.post(C, json=body)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == "engine_step_failed" and "simulated bug" in err["message"]
        assert client.get("/health").status_code == 200
        assert len(text_of(client.post(C, json=body))[0]) > 0
        metrics = client.get("/metrics").text
        assert re.search(r"^blockspec_engine_step_failures_total 1\.0$", metrics, re.M)
        assert idle(client)


def test_a_failing_step_while_streaming_ends_with_an_error_event(qwen3_path, monkeypatch):
    eng = make_engine(qwen3_path)
    real = eng.runner.execute

    calls = [0]

    def fail_third(seqs, n, *rest):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("simulated failure")
        return real(seqs, n, *rest)

    monkeypatch.setattr(eng.runner, "execute", fail_third)
    with TestClient(build_app(eng, MODEL)) as client:
        r = client.post(C, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8,
                                 "stream": True, "ignore_eos": True})
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert "[DONE]" not in events
        assert json.loads(events[-1])["error"]["code"] == "engine_step_failed"
        assert client.get("/health").status_code == 200 and idle(client)


def test_offline_engine_survives_a_failing_step(qwen3_path, monkeypatch):
    from blockspec.engine.step_error import StepError

    llm = LLM(str(qwen3_path), device="cpu", num_kv_blocks=64)
    real = llm.engine.runner.execute
    monkeypatch.setattr(llm.engine.runner, "execute",
                        lambda *a: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(StepError, match="boom") as info:
        llm.generate(["a", "b"], SamplingParams(max_tokens=4))
    assert not info.value.fatal and {o.finish_reason for o in info.value.outputs} == {"error"}
    monkeypatch.setattr(llm.engine.runner, "execute", real)
    assert llm.generate("a", SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.requests


@pytest.mark.parametrize("message,fatal", [
    ("CUDA error: an illegal memory access was encountered", True),
    ("CUDA error: device-side assert triggered", True),
    ("shape mismatch", False)])
def test_which_step_errors_are_fatal(message, fatal):
    from blockspec.engine.step_error import is_fatal

    assert is_fatal(RuntimeError(message)) is fatal
    import torch

    assert not is_fatal(torch.cuda.OutOfMemoryError("CUDA out of memory"))


# -- features --------------------------------------------------------------------------------------
def test_n_samples(tc):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 9,
            "n": 3, "ignore_eos": True}
    r = tc.post(C, json=body)
    texts = text_of(r)
    assert len(texts) == 3 and len(set(texts)) > 1
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    assert r.json()["usage"]["completion_tokens"] == 24
    single = [text_of(tc.post(C, json={**body, "n": 1, "seed": 9 + i}))[0] for i in range(3)]
    assert texts == single  # sample i is the seed + i request (as vLLM's children)
    got, events = streamed(tc.post(C, json={**body, "stream": True,
                                            "stream_options": {"include_usage": True}}))
    assert [got[i] for i in range(3)] == texts
    assert events[-1]["usage"]["completion_tokens"] == 24
    chat = tc.post(CH, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 1})
    assert len(chat.json()["choices"]) == 2 and idle(tc)


def test_continuous_usage_stats(tc):
    _, events = streamed(tc.post(C, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 6, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == sorted(counts) and counts[-1] == 6 and events[-1]["choices"] == []


def test_skip_special_tokens(tc, engine):
    eos = engine.eos_token_ids[0]
    ids = engine.tokenizer.encode(PROMPT)
    # the stop token's own text is kept, so its special-token text shows only when not skipped
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0,
            "logit_bias": {str(eos): 100}, "include_stop_str_in_output": True}
    special = engine.tokenizer.decode([eos])
    assert special
    assert text_of(tc.post(C, json=body)) == [""]
    assert text_of(tc.post(C, json={**body, "skip_special_tokens": False})) == [special]


CASES = [
    {"temperature": 0, "frequency_penalty": 1.5, "presence_penalty": 0.5},
    {"temperature": 0, "repetition_penalty": 1.3, "logit_bias": {"7": 3.0, "9": -100}},
    {"temperature": 0.8, "seed": 4, "frequency_penalty": 0.7, "top_p": 0.9},
    {"temperature": 1.0, "seed": 12, "min_tokens": 10, "n": 2},
]


@pytest.mark.parametrize("fields", CASES, ids=range(len(CASES)))
def test_sampling_fields_equal_with_and_without_a_drafter(tc, spec_tc, fields):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, **fields}
    plain = text_of(tc.post(C, json=body))
    assert text_of(spec_tc.post(C, json=body)) == plain
    got, _ = streamed(spec_tc.post(C, json={**body, "stream": True}))
    assert [got[i] for i in range(len(plain))] == plain
    assert idle(spec_tc)


def test_a_dead_engine_stops_the_server():
    """`blockspec serve` must not stay up answering 503 forever: the watchdog stops uvicorn
    once the engine thread dies (cmd_serve then exits with status 1)."""
    import threading
    from types import SimpleNamespace

    from blockspec.server.cli import _exit_when_engine_dies

    engine, server = SimpleNamespace(died=threading.Event()), SimpleNamespace(should_exit=False)
    watchdog = threading.Thread(target=_exit_when_engine_dies, args=(engine, server))
    watchdog.start()
    assert not server.should_exit
    engine.died.set()
    watchdog.join(timeout=30)
    assert server.should_exit and not watchdog.is_alive()


def test_engine_thread_death_sets_died(qwen3_path, monkeypatch):
    eng = make_engine(qwen3_path)
    monkeypatch.setattr(eng, "step", lambda: (_ for _ in ()).throw(RuntimeError("CUDA error")))
    app = build_app(eng, MODEL)
    with TestClient(app) as client:
        client.post(C, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert app.state.engine.died.wait(timeout=30)
        assert client.get("/health").status_code == 503


def test_serve_checks_the_bind_before_loading(capsys):
    """A port in use, or a host that does not resolve, is one error line and status 2, before
    any model is loaded (a folder that does not exist is never looked at)."""
    import socket

    from blockspec.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for host, port_, words in (("127.0.0.1", port, "cannot listen on 127.0.0.1"),
                                   ("no-such-host.invalid", 8000, "does not resolve")):
            assert main(["serve", "--model", "/nonexistent/model", "--host", host,
                         "--port", str(port_)]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith("blockspec: error:") and words in err[0]


# -- logs ------------------------------------------------------------------------------------------
def test_request_log_line(qwen3_path, caplog):
    eng = make_engine(qwen3_path)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True}
    for log_requests in (True, False):
        caplog.clear()
        with caplog.at_level("INFO", logger="blockspec.server"), \
                TestClient(build_app(eng, MODEL, log_requests=log_requests)) as client:
            assert client.post(C, json=body).status_code == 200
        lines = [r.getMessage() for r in caplog.records if "finished:" in r.getMessage()]
        if not log_requests:
            assert lines == []
            continue
        assert len(lines) == 1
        line = lines[0]
        assert re.match(r"request cmpl-\w+ finished: prompt \d+, output 5 tokens, TTFT [\d.]+ ms, "
                        r"[\d.]+ tok/s, finish_reason length, status ok$", line), line


def test_stats_log_line():
    from blockspec.server.engine_stats import EngineStats
    from blockspec.server.logs import StatsLogger

    log = StatsLogger(interval=10.0)
    idle = EngineStats(num_blocks=100)
    busy = EngineStats(num_running=3, num_waiting=1, num_used_blocks=25, num_blocks=100,
                       num_prompt_tokens=2000, num_generation_tokens=500, spec_verify_steps=50,
                       spec_accepted_tokens=100)
    assert log.tick(idle, now=0.0) is None
    assert log.tick(busy, now=5.0) is None  # not yet an interval
    line = log.tick(busy, now=10.0)
    assert line == ("engine: 3 running, 1 waiting, KV cache 25.0%, prompt 200.0 tok/s, "
                    "generation 50.0 tok/s, acceptance length 3.00")
    assert log.tick(busy, now=15.0) is None
    assert log.tick(idle, now=25.0).startswith("engine: 0 running, 0 waiting")  # went idle
    assert log.tick(idle, now=50.0) is None  # idle stays quiet
