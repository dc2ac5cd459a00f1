"""HTTP-level hardening of the server: media types, 405/404 shapes, the vLLM-style utility
routes (/tokenize, /detokenize, /version), the OpenAPI document, HEAD /health and the refusal
metrics. In-process through FastAPI's TestClient: one engine and app for the whole module."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict, ValidationError

import blockspec
from blockspec.engine.llm_engine import LLMEngine
from blockspec.server.api import build_app
from blockspec.server.async_engine import EngineStats
from blockspec.server.body import is_json_media_type
from blockspec.server.errors import from_validation
from blockspec.server.metrics import ServerMetrics

MODEL = "tiny-qwen3"
CTX = 256
PROMPT = "def fibonacci(n):"
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi!"}]
C, CH, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
OK_BODIES = {C: {"model": MODEL, "prompt": "x", "max_tokens": 1},
             CH: {"model": MODEL, "messages": MESSAGES, "max_tokens": 1},
             TOK: {"prompt": PROMPT}, DETOK: {"tokens": [1, 2, 3]}}


@pytest.fixture(scope="module")
def engine(qwen3_path) -> LLMEngine:
    from blockspec.config import EngineConfig

    return LLMEngine(EngineConfig(model=str(qwen3_path), device="cpu", num_kv_blocks=48,
                                  kv_block_size=16, max_model_len=CTX))


@pytest.fixture(scope="module")
def tc(engine) -> Iterator[TestClient]:
    with TestClient(build_app(engine, MODEL)) as client:
        yield client


def openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def refused(client: TestClient, status: int) -> float:
    text = client.get("/metrics").text
    m = re.search(rf'^blockspec_requests_refused_total{{status="{status}"}} (\S+)$', text, re.M)
    assert m, f"no refused series for status {status}"
    return float(m.group(1))


def render_chat(engine: LLMEngine, messages: list[dict], add_gen: bool) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=add_gen)
    return engine.tokenizer.encode(text, add_special_tokens=False)


# -- media type ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,ok", [
    ("application/json", True), ("application/json; charset=utf-8", True),
    ("Application/JSON;charset=UTF-8", True), (" application/json ", True),
    ("application/merge-patch+json", True), ("application/vnd.api+json; v=1", True),
    ("text/plain", False), ("text/json", False), ("application/x-www-form-urlencoded", False),
    ("multipart/form-data; boundary=x", False), ("application/+json", False),
    ("application/jsonx", False), ("", False), ("json", False)])
def test_json_media_types(value, ok):
    assert is_json_media_type(value) is ok


@pytest.mark.parametrize("path", [C, CH, TOK, DETOK])
def test_non_json_content_type_is_415(tc, path):
    raw = httpx.Request("POST", "/", json=OK_BODIES[path]).content
    before = refused(tc, 415)
    for headers in ({"Content-Type": "text/plain"}, {}):
        err = openai_error(tc.post(path, content=raw, headers=headers), 415)
        assert err["code"] == "unsupported_media_type"
    openai_error(tc.post(path, data={"model": MODEL, "prompt": "x"}), 415)  # a form
    assert refused(tc, 415) == before + 3
    r = tc.post(path, content=raw, headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", [C, TOK])
def test_media_type_is_checked_before_the_size(tc, path):
    big = b'{"prompt": "' + b"x" * (17 << 20) + b'"}'
    openai_error(tc.post(path, content=big), 415)
    openai_error(tc.post(path, content=big, headers={"Content-Type": "application/json"}), 413)


# -- 405, trailing slashes -------------------------------------------------------------------------
@pytest.mark.parametrize("method,path,allow", [
    ("GET", C, {"POST"}), ("GET", CH, {"POST"}), ("GET", TOK, {"POST"}),
    ("PUT", DETOK, {"POST"}), ("POST", "/v1/models", {"GET"}), ("POST", "/version", {"GET"}),
    ("POST", "/health", {"GET", "HEAD"}), ("DELETE", "/metrics", {"GET"})])
def test_405_carries_allow(tc, method, path, allow):
    r = tc.request(method, path)
    openai_error(r, 405)
    assert {m.strip() for m in r.headers["allow"].split(",")} == allow


@pytest.mark.parametrize("method,path", [("POST", C + "/"), ("POST", CH + "/"),
                                         ("POST", TOK + "/"), ("GET", "/health/"),
                                         ("GET", "/v1/models/" + MODEL + "/extra")])
def test_trailing_slash_is_a_json_404_not_a_redirect(tc, method, path):
    assert tc.app.router.redirect_slashes is False
    r = tc.request(method, path, json=OK_BODIES[C], follow_redirects=False)
    openai_error(r, 404)
    assert "location" not in r.headers


# -- /tokenize, /detokenize, /version --------------------------------------------------------------
@pytest.mark.parametrize("special", [True, False])
def test_tokenize_prompt_matches_the_tokenizer(tc, engine, special):
    r = tc.post(TOK, json={"model": MODEL, "prompt": PROMPT, "add_special_tokens": special})
    assert r.status_code == 200, r.text
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=special)
    assert r.json() == {"count": len(ids), "max_model_len": CTX, "tokens": ids}
    usage = tc.post(C, json=OK_BODIES[C] | {"prompt": PROMPT}).json()["usage"]
    assert tc.post(TOK, json={"prompt": PROMPT}).json()["count"] == usage["prompt_tokens"]


@pytest.mark.parametrize("add_gen", [True, False])
def test_tokenize_messages_matches_the_chat_template(tc, engine, add_gen):
    r = tc.post(TOK, json={"messages": MESSAGES, "add_generation_prompt": add_gen})
    assert r.status_code == 200, r.text
    ids = render_chat(engine, MESSAGES, add_gen)
    assert r.json() == {"count": len(ids), "max_model_len": CTX, "tokens": ids}
    if add_gen:  # exactly what the chat route feeds the model
        usage = tc.post(CH, json=OK_BODIES[CH]).json()["usage"]
        assert usage["prompt_tokens"] == len(ids)


def test_detokenize_round_trips(tc, engine):
    ids = tc.post(TOK, json={"prompt": PROMPT}).json()["tokens"]
    r = tc.post(DETOK, json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": PROMPT}
    assert tc.post(DETOK, json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("tokens", [[1, -1], [512], [3, 10**30], [True], [1.0], ["1"], 5, None])
def test_detokenize_refuses_bad_ids(tc, engine, tokens):
    assert engine.model_config.vocab_size == 512
    openai_error(tc.post(DETOK, json={"tokens": tokens}), 400, "tokens")


@pytest.mark.parametrize("path,body,param", [
    (TOK, {"prompt": "x", "foo": 1}, "foo"), (TOK, {"messages": MESSAGES, "bar": 1}, "bar"),
    (TOK, {"prompt": "x", "messages": MESSAGES}, "prompt"), (DETOK, {"tokens": [], "x": 0}, "x")])
def test_unknown_field_is_400_naming_it(tc, path, body, param):
    err = openai_error(tc.post(path, json=body), 400, param)
    assert err["message"] == f"unknown field '{param}'"


@pytest.mark.parametrize("path,body,param", [
    (TOK, {}, "prompt"), (TOK, {"prompt": 1}, "prompt"), (TOK, {"messages": []}, "messages"),
    (TOK, {"messages": "hi"}, "messages"), (TOK, {"prompt": "x", "add_special_tokens": 1},
                                            "add_special_tokens"),
    (TOK, [], None), (TOK, b"{", None), (DETOK, {}, "tokens"), (DETOK, b"null", None)])
def test_bad_tokenize_bodies_are_400(tc, path, body, param):
    r = tc.post(path, content=body, headers={"Content-Type": "application/json"}) \
        if isinstance(body, bytes) else tc.post(path, json=body)
    openai_error(r, 400, param)


@pytest.mark.parametrize("path", [TOK, DETOK])
def test_utility_routes_check_the_model(tc, path):
    err = openai_error(tc.post(path, json=OK_BODIES[path] | {"model": "gpt-4"}), 404, "model")
    assert err["code"] == "model_not_found"
    assert tc.post(path, json=OK_BODIES[path] | {"model": MODEL}).status_code == 200


def test_version(tc):
    r = tc.get("/version")
    assert r.status_code == 200 and r.json() == {"version": blockspec.__version__}


# -- OpenAPI ---------------------------------------------------------------------------------------
def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for v in node.values():
            yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def _resolve(doc: dict, ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def test_openapi_documents_request_bodies(tc):
    doc = tc.get("/openapi.json").json()
    refs = list(_refs(doc))
    assert refs and all(_resolve(doc, ref) for ref in refs)
    assert "$defs" not in str(doc)
    for path, field in ((C, "prompt"), (CH, "messages"), (DETOK, "tokens")):
        body = doc["paths"][path]["post"]["requestBody"]
        schema = _resolve(doc, body["content"]["application/json"]["schema"]["$ref"])
        assert field in schema["properties"] and field in schema["required"]
    tok = doc["paths"][TOK]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {_resolve(doc, s["$ref"])["title"] for s in tok["anyOf"]} == \
        {"TokenizeCompletionRequest", "TokenizeChatRequest"}
    ops = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert len(ops) == len(set(ops))
    assert {"/version", "/health", "/metrics", "/v1/models"} <= set(doc["paths"])


def test_openapi_document_is_valid(tc):
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(tc.get("/openapi.json").json())


def test_docs_is_html(tc):
    r = tc.get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/openapi.json" in r.text


# -- /health ---------------------------------------------------------------------------------------
def test_health_get_and_head(tc, engine):
    assert tc.get("/health").json() == {"status": "ok"}
    r = tc.head("/health")
    assert r.status_code == 200 and r.content == b""
    # an app whose lifespan never ran has no engine thread: 503, for HEAD too
    dead = TestClient(build_app(engine, MODEL))
    openai_error(dead.get("/health"), 503)
    r = dead.head("/health")
    assert r.status_code == 503 and r.content == b""


# -- metrics ---------------------------------------------------------------------------------------
def test_refused_counter_moves_on_4xx_of_api_routes_only(tc):
    text = tc.get("/metrics").text
    for status in (400, 401, 404, 405, 413, 415):  # created at start-up
        assert f'blockspec_requests_refused_total{{status="{status}"}}' in text
    before = {s: refused(tc, s) for s in (400, 404)}
    openai_error(tc.post(C, json=OK_BODIES[C] | {"temperature": "hot"}), 400)
    openai_error(tc.post(TOK, json={"prompt": 3}), 400)
    assert refused(tc, 400) == before[400] + 2
    openai_error(tc.get("/nothing"), 404)  # not an API route: not counted
    assert refused(tc, 404) == before[404]
    openai_error(tc.get("/v1/nothing"), 404)
    assert refused(tc, 404) == before[404] + 1
    tc.post(TOK, json={"prompt": "ok"})
    assert refused(tc, 400) == before[400] + 2


def test_refused_counter_counts_401(engine):
    # NOTE: no lifespan: the key check answers before any route runs
    client = TestClient(build_app(engine, MODEL, api_key="sekrit"))
    openai_error(client.get("/v1/models"), 401)
    assert refused(client, 401) == 1
    assert client.post(TOK, json={"prompt": "x"}).status_code == 503  # not behind the key


def test_step_failures_are_exported(tc):
    assert re.search(r"^blockspec_engine_step_failures_total 0\.0$", tc.get("/metrics").text,
                     re.M)
    text = ServerMetrics(lambda: EngineStats(num_step_failures=3)).render().decode()
    assert re.search(r"^blockspec_engine_step_failures_total 3\.0$", text, re.M)


def test_from_validation_words_unknown_fields():
    class Closed(BaseModel):
        model_config = ConfigDict(extra="forbid")
        a: int = 0

    with pytest.raises(ValidationError) as info:
        Closed.model_validate_json(b'{"a": 1, "zz": 2}')
    err = from_validation(info.value)
    assert (err.status, err.param, err.message) == (400, "zz", "unknown field 'zz'")
