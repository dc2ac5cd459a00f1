"""Benchmark suite: datasets, statistics, Prometheus parsing, `bench offline` on the tiny model,
`bench serve` against an in-test fake OpenAI streaming server, and `bench report`."""

from __future__ import annotations

import argparse
import json
import math
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from blockspec import LLM, ConfigError, SamplingParams
from blockspec.bench.datasets import (
    chat_messages,
    completion_prompt,
    load_jsonl,
    load_samples,
    random_samples,
    token_ids,
)
from blockspec.bench.offline import default_label
from blockspec.bench.stats import (
    RequestRecord,
    acceptance_from_metrics,
    distribution,
    metric_sums,
    parse_prometheus,
    summarize_level,
)
from blockspec.cli import main as blockspec_main

SHARED_PROMPTS = Path(__file__).resolve().parents[1].parent / "shared" / "prompts"


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = blockspec_main(["bench", *argv])  # the real CLI, as a user runs it
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_error_line(rc: int, err: str, needle: str) -> None:
    assert rc == 2
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("blockspec: error:")]
    assert len(lines) == 1 and needle in lines[0], err


# -- datasets --------------------------------------------------------------------------------
def test_jsonl_formats_and_cycling(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [
        {"id": 1, "prompt": "def f(x):"},
        "",
        {"text": "plain text"},
        {"prompt": [5, 6, 7]},
        {"messages": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                           {"from": "human", "value": "q2"}]},
    ])
    s = load_jsonl(f)
    assert [x.prompt for x in s[:3]] == ["def f(x):", "plain text", [5, 6, 7]]
    assert s[3].messages == [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": "hi"}]
    assert s[4].messages == [{"role": "user", "content": "q1"}]  # first user turn only
    assert completion_prompt(s[3]) == "be brief\nhi"  # no tokenizer: contents joined
    assert chat_messages(s[0]) == [{"role": "user", "content": "def f(x):"}]
    cyc = load_samples(str(f), 12, None)
    assert len(cyc) == 12 and cyc[5].prompt == cyc[0].prompt


@pytest.mark.parametrize("line, needle", [
    ('{"prompt": "ok"}\n{"prompt": "x",\n', "d.jsonl:2: invalid JSON"),
    ('{"prompt": "ok"}\n\n{"question": "x"}\n', "d.jsonl:3: no non-empty prompt"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}\n', "d.jsonl:1: has no user turn"),
    ('[1, 2]\n', "d.jsonl:1: expected a JSON object"),
    ("\n\n", "no prompts"),
])
def test_bad_dataset_lines_are_reported(tmp_path, line, needle):
    f = tmp_path / "d.jsonl"
    f.write_text(line)
    with pytest.raises(ConfigError, match=needle):
        load_jsonl(f)


def test_random_prompts():
    words = random_samples(3, 40, seed=1)
    assert len({s.prompt for s in words}) == 3
    assert all(len(s.prompt.split()) == 40 for s in words)
    ids = random_samples(20, 30, seed=1, vocab_size=16, exclude_ids={0, 1, 2})
    assert all(len(s.prompt) == 30 and all(3 <= t < 16 for t in s.prompt) for s in ids)
    assert random_samples(2, 5, seed=3, vocab_size=99)[0].prompt == \
        random_samples(2, 5, seed=3, vocab_size=99)[0].prompt


def test_chat_template_and_truncation(tmp_path, qwen3_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen3_path))
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "x=1"}]},
                                          {"prompt": "import json"}])
    s = load_jsonl(f)
    text = completion_prompt(s[0], tok)
    assert text.startswith("<|im_start|>user\nx=1<|im_end|>") and text.endswith("assistant\n")
    assert token_ids(s[0], tok) == tok.encode(text, add_special_tokens=False)
    wrapped = tok.decode(token_ids(s[1], tok, chat=True))
    assert "<|im_start|>user\nimport json" in wrapped
    assert token_ids(s[1], tok, input_len=2) == tok.encode("import json")[:2]


def test_shared_prompt_files_load():
    # The repo's copy (benchmarks/prompts/) always; the shared originals where they exist.
    files = sorted((Path(__file__).parents[1] / "benchmarks" / "prompts").glob("*.jsonl"))
    assert files, "benchmarks/prompts/*.jsonl missing"
    if SHARED_PROMPTS.is_dir():
        files += sorted(SHARED_PROMPTS.glob("*.jsonl"))
    for f in files:
        n = sum(1 for ln in f.read_text().splitlines() if ln.strip())
        samples = load_jsonl(f)
        assert len(samples) == n > 0
        assert all(isinstance(s.prompt, str) and s.prompt for s in samples)


# -- statistics ------------------------------------------------------------------------------
def test_distribution_and_level_summary():
    ttfts = [i / 1e3 for i in range(1, 101)]  # 1..100 ms
    d = distribution(ttfts)
    assert d["mean"] == pytest.approx(50.5) and d["median"] == pytest.approx(50.5)
    assert d["p99"] == pytest.approx(99.01) and d["count"] == 100
    assert distribution([]) is None
    recs = [RequestRecord(ok=True, prompt_tokens=10, output_tokens=11, ttft=0.1, latency=1.1,
                          itl=[0.1] * 10) for _ in range(3)]
    recs.append(RequestRecord(ok=False, error="HTTP 500: boom"))
    recs.append(RequestRecord(ok=True, prompt_tokens=10, output_tokens=1, ttft=0.2, latency=0.2,
                              token_source="chunks"))
    lv = summarize_level(4, recs, duration_s=2.0)
    assert (lv["completed"], lv["failed"], lv["errors"]) == (4, 1, ["HTTP 500: boom"])
    assert lv["output_tokens"] == 34 and lv["output_tok_s"] == pytest.approx(17.0)
    assert lv["total_tok_s"] == pytest.approx((34 + 40) / 2.0)
    assert lv["req_s"] == pytest.approx(2.0)
    assert lv["tpot_ms"]["mean"] == pytest.approx(100.0)  # (1.1 - 0.1) / 10; 1-token req skipped
    assert lv["tpot_ms"]["count"] == 3 and lv["itl_ms"]["count"] == 30
    assert lv["ttft_ms"]["median"] == pytest.approx(100.0)
    assert lv["e2e_latency_ms"]["p99"] == pytest.approx(np.percentile([1100] * 3 + [200], 99))
    assert lv["token_counts"] == "chunks/usage"


PROM_BEFORE = """\
# HELP blockspec_spec_draft_tokens_total Draft tokens proposed.
# TYPE blockspec_spec_draft_tokens_total counter
blockspec_spec_draft_tokens_total{model="a"} 100
blockspec_spec_draft_tokens_total{model="b"} 20
blockspec_spec_draft_tokens_created{model="a"} 1.7e9
blockspec_spec_accepted_tokens_total 50.0
blockspec_spec_verify_steps_total 10 1712345678000
blockspec_spec_accepted_tokens_per_position_total{position="0"} 9
blockspec_spec_accepted_tokens_per_position_total{position="1"} 6
odd_metric{label="a \\"quoted\\", } value"} NaN
this line is not a sample
"""
PROM_AFTER = PROM_BEFORE.replace('{model="a"} 100', '{model="a"} 160').replace(
    "accepted_tokens_total 50.0", "accepted_tokens_total 80").replace(
    "steps_total 10 ", "steps_total 30 ").replace(
    '{position="0"} 9', '{position="0"} 27').replace('{position="1"} 6', '{position="1"} 18')


def test_prometheus_parsing_and_acceptance():
    s = parse_prometheus(PROM_BEFORE)
    sums = metric_sums(s)
    assert sums["blockspec_spec_draft_tokens_total"] == 120  # summed over label sets
    assert sums["blockspec_spec_verify_steps_total"] == 10  # the timestamp is not the value
    assert s["odd_metric"][0][0] == {"label": 'a \\"quoted\\", } value'}
    assert math.isnan(sums["odd_metric"])
    acc = acceptance_from_metrics(PROM_BEFORE, PROM_AFTER)
    assert acc["num_draft_tokens"] == 60 and acc["num_accepted_tokens"] == 30
    assert acc["num_steps"] == 20 and acc["mean_acceptance_length"] == pytest.approx(2.5)
    assert acc["draft_acceptance_rate"] == pytest.approx(0.5)
    assert acc["acceptance_rate_per_position"] == pytest.approx([0.9, 0.6])
    assert acceptance_from_metrics(PROM_BEFORE, PROM_BEFORE) is None  # nothing drafted
    assert acceptance_from_metrics(None, None) is None
    assert acceptance_from_metrics("", "# nothing\nfoo_total 3\n") is None
    vllm = ('vllm:spec_decode_num_draft_tokens_total{model_name="m",engine="0"} 40\n'
            'vllm:spec_decode_num_accepted_tokens_total{model_name="m",engine="0"} 30\n'
            'vllm:spec_decode_num_drafts_total{model_name="m",engine="0"} 10\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9\n')
    acc = acceptance_from_metrics(None, vllm)  # first scrape failed: counted from zero
    assert acc["source"].endswith("(vllm)") and acc["mean_acceptance_length"] == 4.0
    assert acc["acceptance_rate_per_position"] == [0.9]


# -- offline ---------------------------------------------------------------------------------
OFFLINE_ARGS = ["--device", "cpu", "--num-kv-blocks", "256", "--input-len", "12",
                "--output-len", "6", "--ignore-eos", "--warmup-tokens", "2"]


def test_bench_offline_end_to_end(qwen3_path, tmp_path, capsys):
    out = tmp_path / "ar.json"
    rc, stdout, err = run_cli(["offline", "--model", str(qwen3_path), "--concurrency", "2,1",
                               "--num-prompts", "3", *OFFLINE_ARGS, "--step-trace",
                               "--out", str(out)], capsys)
    assert rc == 0, err
    res = json.loads(out.read_text())
    assert res["kind"] == "offline" and res["synthetic"] is False
    assert "(autoregressive)" in res["label"]
    assert res["environment"]["python"] and res["environment"]["torch"]
    assert res["config"]["engine"]["num_kv_blocks"] == 256
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 2]
    for lv in res["levels"]:
        assert (lv["completed"], lv["failed"], lv["output_tokens"]) == (3, 0, 18)
        assert lv["input_tokens"] == 36
        assert lv["output_tok_s"] == pytest.approx(18 / lv["duration_s"])
        assert lv["ttft_ms"]["count"] == 3 and lv["tpot_ms"]["median"] > 0
        assert lv["itl_ms"]["count"] == 15  # 5 gaps per 6-token request
        assert lv["step_trace"]["gaps"] == 15
        assert lv["acceptance"] is None and lv["drafter_context"] == {}
        # Every output token comes from a step of the level: plain decodes (block 1) and the
        # prefill steps that sample the first token (block 0, nothing decoding) or run beside
        # decodes (block 1).
        mix = lv["step_mix"]
        assert sum(cell["tokens"] for cell in mix.values()) == 18
        assert set(mix) <= {"decode/1", "eager/0", "eager/1", "flat/0", "flat/1"}
        assert mix["decode/1"]["steps"] >= 4 and mix["decode/1"]["ms_per_step"] > 0
        assert sum(cell["time_share"] for cell in mix.values()) == pytest.approx(1, abs=1e-3)
    assert "| Config | C=1 | C=2 | Peak |" in stdout


def test_offline_keeps_exactly_c_in_flight(qwen3_path):
    from blockspec.bench.offline import run_requests
    from blockspec.config import EngineConfig
    from blockspec.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(str(qwen3_path), device="cpu", num_kv_blocks=128))
    seen: list[int] = []
    step = engine.step
    engine.step = lambda: (seen.append(len(engine.requests)), step())[1]
    prompts = [[3 + i, 4, 5] for i in range(7)]
    recs, _, _ = run_requests(engine, prompts, SamplingParams(max_tokens=4, ignore_eos=True), 3,
                              "t", show=False)
    assert len(recs) == 7 and all(r.ok and r.output_tokens == 4 for r in recs)
    assert max(seen) == 3 and seen[0] == 3 and seen.count(3) >= 4


def test_step_trace_accounts_for_every_step_prefill_token_and_gap(qwen3_path):
    from blockspec.bench.offline import run_requests
    from blockspec.bench.step_trace import StepTrace
    from blockspec.config import EngineConfig
    from blockspec.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(str(qwen3_path), device="cpu", num_kv_blocks=128,
                                    max_num_batched_tokens=16))
    calls = []
    step = engine.step
    engine.step = lambda: (calls.append(1), step())[1]
    prompts = [[3 + i] + [4] * 11 for i in range(5)]  # 12 tokens: chunked at 16 per step
    trace = StepTrace(threshold_ms=0.0)
    recs, _, _ = run_requests(engine, prompts, SamplingParams(max_tokens=4, ignore_eos=True), 2,
                              "t", show=False, trace=trace)
    assert len(trace.steps) == len(calls)
    assert sum(s.prefill_tokens for s in trace.steps) == 5 * 12
    assert max(s.prefill_tokens for s in trace.steps) <= 16
    assert any(s.prefill_tokens and s.num_decoding for s in trace.steps)  # arrivals mid-decode
    assert all(s.host_ms >= 0 and s.wait_ms >= 0 and s.kinds for s in trace.steps)
    summary = trace.summary()
    assert summary["gaps"] == sum(len(r.itl) for r in recs) == 5 * 3
    assert summary["slow_gaps"] == summary["gaps"]  # threshold 0: every gap
    assert "(no step)" not in summary["slow_by_steps_inside"]
    assert sum(summary["slow_by_steps_inside"].values()) == summary["gaps"]
    assert len(summary["steps"]) == len(calls)
    assert any("[prefill<=256]" in k for k in summary["slow_by_steps_inside"])


def test_bench_offline_synthetic_is_labelled(qwen3_path, models_root, tmp_path, capsys):
    from blockspec.dflash.checkpoint import build_random_drafter

    drafter = build_random_drafter(models_root / "bench-drafter", qwen3_path, num_layers=1,
                                   block_size=4)
    out = tmp_path / "syn.json"
    # NOTE: the fixed policy: the adaptive one chooses from step costs measured on this (maybe
    # loaded) machine, so which blocks ran, and the positions drafted, would depend on timing
    rc, stdout, err = run_cli(["offline", "--model", str(qwen3_path), "--draft", str(drafter),
                               "--synthetic-acceptance", "0.75", "--concurrency", "2",
                               "--speculation-policy", "fixed",
                               "--num-prompts", "2", *OFFLINE_ARGS, "--output-len", "16",
                               "--out", str(out)], capsys)
    assert rc == 0, err
    res = json.loads(out.read_text())
    assert res["synthetic"] is True and res["synthetic_acceptance"] == 0.75
    assert "SYNTHETIC" in res["label"] and "block 4" in res["label"]
    assert "blocks 2/4" in default_label("m", "d", 4, 0.75, "adaptive", [2, 4])
    acc = res["levels"][0]["acceptance"]
    assert 1.0 <= acc["mean_acceptance_length"] <= 4.0
    assert len(acc["acceptance_rate_per_position"]) == 3
    assert sum(acc["acceptance_length_hist"].values()) == acc["num_steps"]
    mix = res["levels"][0]["step_mix"]
    assert sum(cell["tokens"] for cell in mix.values()) == 32
    context = res["levels"][0]["drafter_context"]
    assert set(context) == {"staged_flushes"}  # the fixed policy has no lazy context
    assert any(key.endswith("/4") for key in mix)  # the fixed block's speculative steps
    assert "SYNTHETIC" in stdout
    # Synthetic acceptance without a drafter is refused with one line.
    rc, _, err = run_cli(["offline", "--model", str(qwen3_path), "--synthetic-acceptance", "0.5",
                          *OFFLINE_ARGS], capsys)
    assert_one_error_line(rc, err, "needs a draft model")


@pytest.mark.parametrize("extra, needle", [
    (["--concurrency", " , "], "--concurrency is empty"),
    (["--concurrency", "1,x"], "comma-separated integers"),
    (["--dataset", "/nonexistent/p.jsonl"], "is not a file"),
    (["--output-len", "0"], "--output-len must be positive"),
])
def test_bench_offline_bad_input(extra, needle, capsys):
    # NOTE: every check here runs before a model is loaded (fast, and --model is bogus).
    rc, _, err = run_cli(["offline", "--model", "/nonexistent/model", *extra], capsys)
    assert_one_error_line(rc, err, needle)


# -- serve against a fake OpenAI-compatible server --------------------------------------------
class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        self.bodies: list[dict] = []
        self.auth: set[str] = set()
        self.send_usage = True
        self.steps = self.drafts = self.accepted = 0
        self.per_pos = [0, 0, 0]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class FakeHandler(BaseHTTPRequestHandler):
    """Streams max_tokens chunks of one token each, 5 ms apart. Each request adds 4 verify steps
    with 3 drafts each and 8 accepted (tau 3; per position 1.0, 0.75, 0.25) to /metrics."""

    server: FakeServer

    def log_message(self, *args) -> None:
        pass

    def _send(self, code: int, body: str, ctype: str = "application/json") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        srv = self.server
        if self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": "fake-model"}]}))
        elif self.path == "/metrics":
            with srv.lock:
                text = (f"# TYPE blockspec_spec_decode_verify_steps counter\n"
                        f"blockspec_spec_decode_verify_steps_total {srv.steps}\n"
                        f"blockspec_spec_decode_draft_tokens_total {srv.drafts}\n"
                        f'blockspec_spec_decode_accepted_tokens_total{{m="x"}} {srv.accepted}\n'
                        + "".join(f'blockspec_spec_decode_accepted_tokens_per_position_total'
                                  f'{{position="{j}"}} {v}\n' for j, v in enumerate(srv.per_pos)))
            self._send(200, text, "text/plain; version=0.0.4")
        else:
            self._send(404, '{"error": "not found"}')

    def do_POST(self) -> None:
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        chat = self.path == "/v1/chat/completions"
        with srv.lock:
            srv.bodies.append(body)
            srv.auth.add(self.headers.get("Authorization", ""))
        prompt = json.dumps(body.get("messages") if chat else body.get("prompt"))
        if "FAIL" in prompt:
            return self._send(500, '{"error": {"message": "injected failure"}}')
        if body.get("model") != "fake-model":
            return self._send(404, '{"error": {"message": "model not found"}}')
        with srv.lock:
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
        n = body["max_tokens"]
        for i in range(n):
            delta = {"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
            self.wfile.write(f"data: {json.dumps({'choices': [{'index': 0, **delta}]})}\n\n"
                             .encode())
            self.wfile.flush()
            time.sleep(0.005)
        if srv.send_usage and body.get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        with srv.lock:
            srv.in_flight -= 1  # NOTE: before [DONE], so the client cannot overlap the next one
            srv.steps += 4
            srv.drafts += 12
            srv.accepted += 8
            srv.per_pos = [a + b for a, b in zip(srv.per_pos, (4, 3, 1))]
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def fake_server():
    srv = FakeServer()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_bench_serve_completions(fake_server, tmp_path, capsys, monkeypatch):
    out = tmp_path / "serve.json"
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(5)]
                       + [{"prompt": "FAIL here"}])
    argv = ["serve", "--base-url", fake_server.url + "/v1/", "--concurrency", "1,3",
            "--num-prompts", "6", "--dataset", str(data), "--output-len", "5", "--ignore-eos",
            "--api-key", "sekrit", "--out", str(out)]
    # NOTE: the results record the process's own command line: make it this one
    monkeypatch.setattr(sys, "argv", ["blockspec", "bench", *argv])
    rc, stdout, err = run_cli(argv, capsys)
    assert rc == 0, err
    assert "2 request(s) failed" in err
    res = json.loads(out.read_text())
    assert res["kind"] == "serve" and res["config"]["model"] == "fake-model"
    assert "sekrit" not in out.read_text() and fake_server.auth == {"Bearer sekrit"}
    assert "--api-key '<redacted>'" in res["environment"]["command"]
    assert fake_server.max_in_flight == 3  # reached C=3, never more
    body = fake_server.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 5
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 3]
    for lv in res["levels"]:
        assert lv["num_requests"] == 6 and (lv["completed"], lv["failed"]) == (5, 1)
        assert lv["errors"] == ["HTTP 500: {\"error\": {\"message\": \"injected failure\"}}"]
        assert lv["output_tokens"] == 25 and lv["input_tokens"] == 35
        assert lv["token_counts"] == "usage"
        assert lv["output_tok_s"] == pytest.approx(25 / lv["duration_s"])
        assert lv["itl_ms"]["count"] == 20 and lv["itl_ms"]["median"] >= 4.0
        assert lv["tpot_ms"]["median"] >= 4.0 and lv["ttft_ms"]["count"] == 5
        acc = lv["acceptance"]
        assert acc["mean_acceptance_length"] == pytest.approx(3.0)
        assert acc["acceptance_rate_per_position"] == pytest.approx([1.0, 0.75, 0.25])
    assert "| Config | C=1 | C=3 | Peak |" in stdout


def test_bench_serve_chat_without_usage(fake_server, tmp_path, capsys):
    fake_server.send_usage = False
    out = tmp_path / "chat.json"
    rc, _, err = run_cli(["serve", "--base-url", fake_server.url, "--model", "fake-model",
                          "--endpoint", "chat", "--concurrency", "2", "--num-prompts", "4",
                          "--input-len", "8", "--output-len", "4", "--label", "fake chat",
                          "--out", str(out)], capsys)
    assert rc == 0, err
    lv = json.loads(out.read_text())["levels"][0]
    assert lv["token_counts"] == "chunks" and lv["output_tokens"] == 16
    msgs = fake_server.bodies[-1]["messages"]
    assert msgs[0]["role"] == "user" and len(msgs[0]["content"].split()) == 8


def test_bench_serve_unreachable_and_wrong_model(fake_server, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    rc, _, err = run_cli(["serve", "--base-url", f"http://127.0.0.1:{port}", "--concurrency",
                          "1"], capsys)
    assert_one_error_line(rc, err, "cannot reach the server")
    rc, _, err = run_cli(["serve", "--base-url", fake_server.url, "--model", "nope",
                          "--concurrency", "1"], capsys)
    assert_one_error_line(rc, err, "warm-up request")
    rc, _, err = run_cli(["serve", "--base-url", "localhost:1", "--concurrency", "1"], capsys)
    assert_one_error_line(rc, err, "must start with http")


# -- report ----------------------------------------------------------------------------------
def fake_result(path: Path, label: str, tok_s: dict[int, float], **extra) -> str:
    levels = [{"concurrency": c, "output_tok_s": v, "ttft_ms": {"median": 10.0 * c},
               "tpot_ms": {"median": 2.0}, "itl_ms": {"p99": 3.0},
               "acceptance": {"mean_acceptance_length": 4.5} if extra else None,
               "completed": 1, "failed": 0}
              for c, v in tok_s.items()]
    path.write_text(json.dumps({"schema": "blockspec.bench/1", "label": label, "levels": levels,
                                **extra}))
    return str(path)


def test_bench_report_table_and_plot(tmp_path, capsys):
    ar = fake_result(tmp_path / "ar.json", "AR", {1: 100.0, 32: 1600.0, 64: 2500.0,
                                                  128: 3000.0, 256: 3100.0})
    sp = fake_result(tmp_path / "sp.json", "DFlash b16", {1: 450.0, 32: 3200.0, 64: 3000.0},
                     synthetic=True, synthetic_acceptance=0.86)
    md, png = tmp_path / "table.md", tmp_path / "sweep.png"
    rc, stdout, err = run_cli(["report", ar, sp, "--out", str(md), "--plot", str(png),
                               "--extra"], capsys)
    assert rc == 0, err
    text = md.read_text()
    assert text == stdout
    lines = text.splitlines()
    assert lines[2] == "| Config | C=1 | C=32 | C=64 | C=128 | Peak |"
    assert "| AR | 100 | 1600 | 2500 | 3000 | 3100 (C=256) |" in lines
    assert ("| DFlash b16 [SYNTHETIC acceptance a=0.86] | 450 | 3200 | 3000 | - | 3200 (C=32) |"
            in lines)
    assert "| DFlash b16 [SYNTHETIC acceptance a=0.86] | 4.50x | 2.00x | 1.20x | - |" in lines
    assert "| AR | 10.0 | 320 | 640 | 1280 |" in lines  # TTFT table
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {png}" in err and f"table written to {md}" in err
    rc, stdout, _ = run_cli(["report", ar, "--columns", "all"], capsys)
    assert "| Config | C=1 | C=32 | C=64 | C=128 | C=256 | Peak |" in stdout


def test_bench_report_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"foo": 1}')
    rc, _, err = run_cli(["report", str(bad)], capsys)
    assert_one_error_line(rc, err, "not a blockspec bench result")
    rc, _, err = run_cli(["report", str(tmp_path / "missing.json")], capsys)
    assert_one_error_line(rc, err, "does not exist")


def test_fast_path_closed_loop_record(qwen3_path, monkeypatch):
    """benchmarks/fast_path.py --waves: waves x C requests, C at a time; the record has the
    fields the sweep reports, counted over every request."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import fast_path

    monkeypatch.setattr(fast_path.torch.cuda, "synchronize", lambda: None)
    llm = LLM(str(qwen3_path), device="cpu", num_kv_blocks=256)
    in_flight, step = [], llm.engine.step

    def counted():
        in_flight.append(len(llm.engine.scheduler.running) + len(llm.engine.scheduler.waiting))
        return step()

    monkeypatch.setattr(llm.engine, "step", counted)
    r = fast_path.timed_closed_loop(llm, [[1, 2, 3 + i] for i in range(6)], 5, 2)
    assert r["requests"] == 6 and r["output_tokens"] == 30 and max(in_flight) == 2
    assert r["output_tok_s"] == pytest.approx(30 / r["elapsed_s"])
    assert r["tau"] is None and r["engine_steps"] >= 15 and r["mean_tpot_ms"] > 0


def test_fast_path_decode_phase(qwen3_path, monkeypatch):
    """The decode phase (after every request's first token) is timed within the run, its token
    estimate stays under the run's tokens, and the table reports DFlash / AR over it apart."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import fast_path

    monkeypatch.setattr(fast_path.torch.cuda, "synchronize", lambda: None)
    llm = LLM(str(qwen3_path), device="cpu", num_kv_blocks=256, max_num_batched_tokens=8)
    from blockspec.bench.timed_runs import timed_generate

    r, outs = timed_generate(llm, [[1, 2, 3, 4 + i] for i in range(4)], 6)
    assert 0 < r["decode_phase_s"] <= r["elapsed_s"]
    # 4 requests prefill 2 at a time (8-token budget): the first two decode during the others'
    # prefill, so the decode phase holds fewer than the 5 tokens each makes after its first
    tokens = r["decode_tok_s"] * r["decode_phase_s"]
    assert 0 < tokens < 4 * 5
    res = {"synthetic_acceptance": 0.86,
           "ar": {"C=1": {"output_tok_s": 100.0, "decode_tok_s": 110.0}},
           "dflash": {"C=1": {"output_tok_s": 400.0, "decode_tok_s": 550.0}}}
    fast_path.summarize(res)
    assert "| DFlash / AR | 4.00x" in res["table_md"]
    assert "| DFlash / AR, decode phase only | 5.00x" in res["table_md"]


def test_recorded_command_lines_carry_no_secrets(monkeypatch):
    from blockspec.bench.common import args_config, environment, redact_argv

    monkeypatch.setenv("BLOCKSPEC_API_KEY", "env-secret-1")
    argv = ["blockspec", "bench", "serve", "--api-key", "k1", "--api-key=k2", "--label",
            "run env-secret-1", "--api-keys-file", "x"]
    assert redact_argv(argv) == ["blockspec", "bench", "serve", "--api-key", "<redacted>",
                                 "--api-key=<redacted>", "--label", "run <redacted>",
                                 "--api-keys-file", "x"]
    monkeypatch.setattr(sys, "argv", argv)
    recorded = json.dumps([environment(), args_config(argparse.Namespace(
        api_key="k1", label="run env-secret-1"))])
    assert not any(s in recorded for s in ("k1", "k2", "env-secret-1"))


def test_check_runner_keeps_going_and_names_failures():
    from blockspec.bench.check_runner import run_checks

    ran, report = [], {}

    def bad():
        raise ValueError("boom")

    assert run_checks({"first": bad, "second": lambda: ran.append(2)}, report) is False
    assert ran == [2] and report == {"first_error": "ValueError('boom')"}
    assert run_checks({"only": lambda: None}, {}) is True


def test_warmup_prompts_come_from_the_dataset_unless_it_is_random():
    from blockspec.bench.offline import warmup_prompts

    prompts = [list(range(10, 60)), list(range(100, 120))]
    got = warmup_prompts(prompts, 3, False, 0, 1000, set())
    assert got == [prompts[0][:32], prompts[1], prompts[0][:32]]
    rand = warmup_prompts(prompts, 3, True, 0, 1000, {0})
    assert len(rand) == 3 and all(len(p) == 32 for p in rand) and rand[0] != prompts[0][:32]
