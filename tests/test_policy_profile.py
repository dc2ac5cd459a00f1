"""The speculation policy's start-up cost profile (measured, cached, reloaded, re-measured), its
metrics (engine stats, request outputs, /metrics, `generate --verbose`), the CLI flags, and the
policy benchmark's CPU smoke run."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from helpers import assert_no_leaks, count_block_len_steps

from blockspec import LLM, SamplingParams
from blockspec.cli import build_parser, engine_kwargs, main
from blockspec.dflash.checkpoint import build_random_drafter
from blockspec.engine import cost_profile
from blockspec.server.api import build_app

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def drafter(models_root, qwen3_path):
    return build_random_drafter(models_root / "profile-drafter16", qwen3_path, num_layers=2,
                                block_size=16)


def spec_llm(qwen3_path, drafter, **kw) -> LLM:
    return LLM(str(qwen3_path), **{**dict(device="cpu", num_kv_blocks=256, draft=str(drafter)),
                                   **kw})


def test_profile_written_loaded_and_remeasured(qwen3_path, drafter, tmp_path, monkeypatch,
                                               capfd):
    path = tmp_path / "profiles" / "cost.json"
    first = spec_llm(qwen3_path, drafter, cost_profile=str(path))
    info = first.engine.runner.cost_profile_info
    assert info["measured"] and info["path"] == str(path) and path.is_file()
    saved = json.loads(path.read_text())
    assert saved["key"] == info["key"] and set(saved["times"]) == {"1", "2", "4", "8", "16"}
    assert saved["key"]["device"].startswith("cpu") and saved["key"]["graphs"] is False
    assert "measured in" in capfd.readouterr().err

    def no_measuring(*args, **kwargs):
        raise AssertionError("the profile should have been loaded, not measured")

    # Same key: loaded. Forced costs written into the file are what the policy then uses.
    saved["times"] = {"1": {"1": 0.001, "16": 0.002}, "2": {"1": 0.005, "16": 0.01},
                      "4": {"1": 0.01, "16": 0.02},
                      "8": {"1": 0.02, "16": 0.04}, "16": {"1": 0.04, "16": 0.08}}
    path.write_text(json.dumps(saved))
    with monkeypatch.context() as m:
        m.setattr(cost_profile, "measure_costs", no_measuring)
        second = spec_llm(qwen3_path, drafter, cost_profile=str(path))
    assert not second.engine.runner.cost_profile_info["measured"]
    assert "loaded from" in capfd.readouterr().err
    assert second.engine.runner.controller.cost_model.cost(1, 16) == pytest.approx(0.04)
    second.generate([[1, 2, 3], [4, 5]], GREEDY)
    assert set(second.engine.spec_stats.block_len_steps) == {1}
    assert_no_leaks(second)

    # Another key (block lengths, KV block size): re-measured and the file rewritten.
    for kw in (dict(block_sizes=(4, 16)), dict(kv_block_size=8)):
        third = spec_llm(qwen3_path, drafter, cost_profile=str(path), **kw)
        assert third.engine.runner.cost_profile_info["measured"]
        assert json.loads(path.read_text())["key"] == third.engine.runner.cost_profile_info["key"]
    # A broken file is re-measured (with a warning), never fatal.
    path.write_text("{not json")
    spec_llm(qwen3_path, drafter, cost_profile=str(path))
    assert "ignoring unreadable cost profile" in capfd.readouterr().err
    assert json.loads(path.read_text())["version"] == 1


def test_profile_cache_location(qwen3_path, drafter, tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path / "cache"))
    for value in ("none", ""):  # explicit "no file": nothing written
        llm = spec_llm(qwen3_path, drafter, cost_profile=value)
        assert llm.engine.runner.cost_profile_info["path"] is None
    assert not (tmp_path / "cache").exists()
    key = llm.engine.runner.cost_profile_info["key"]
    default = cost_profile.default_profile_path(key)
    assert default.parent == tmp_path / "cache" / "cost_profiles"
    # The default (CPU too): the cache file, written once, then loaded.
    llm = spec_llm(qwen3_path, drafter)
    assert llm.engine.runner.cost_profile_info["path"] == str(default) and default.is_file()
    assert not spec_llm(qwen3_path, drafter).engine.runner.cost_profile_info["measured"]
    assert default == cost_profile.default_profile_path(json.loads(json.dumps(key)))
    # Shapes, not paths or weights, identify a model: a copy elsewhere shares the profile.
    assert key["model"].startswith("qwen3@") and key["draft"].startswith("profile-drafter16@")


def scraped(tc: TestClient) -> dict[int, float]:
    text = tc.get("/metrics").text
    return {int(k): float(v) for k, v in re.findall(
        r'^blockspec_spec_decode_block_len_steps_total\{block_len="(\d+)"\} (\S+)$', text, re.M)}


def test_metrics_show_block_lengths(qwen3_path, drafter, capsys):
    llm = spec_llm(qwen3_path, drafter, cost_profile="none")
    cycle = itertools.cycle([4, 1, 16, 8, 1])
    llm.engine.runner.controller.choose = lambda n, ctx=None: next(cycle)
    engine_steps, per_req = count_block_len_steps(llm)
    outs = llm.generate([[1, 2, 3], [9, 8, 7, 6], [5] * 20], GREEDY)
    stats = llm.engine.spec_stats
    assert dict(stats.block_len_steps) == engine_steps and set(engine_steps) == {1, 4, 8, 16}
    for out in outs:
        spec = out.metrics.spec
        assert dict(spec.block_len_steps) == per_req[out.request_id]
        assert spec.num_steps == sum(v for k, v in spec.block_len_steps.items() if k > 1)
    assert stats.block_len_summary().startswith("{1:")

    with TestClient(build_app(llm.engine, "tiny")) as tc:
        r = tc.post("/v1/completions", json={"model": "tiny", "prompt": "def f(x):",
                                             "max_tokens": 12, "temperature": 0,
                                             "ignore_eos": True})
        assert r.status_code == 200
        want = {k: float(v) for k, v in stats.block_len_steps.items()}
        deadline = time.monotonic() + 15  # NOTE: stats are published after the step's outputs
        while (got := scraped(tc)) != want and time.monotonic() < deadline:
            time.sleep(0.02)
    # The wrapper saw the server's steps too: every engine step is in the counter.
    assert got == want == {k: float(v) for k, v in engine_steps.items()}
    assert_no_leaks(llm)

    rc = main(["generate", "--model", str(qwen3_path), "--draft", str(drafter), "--device",
               "cpu", "--num-kv-blocks", "64", "--prompt", "def f(x):", "--max-tokens", "8",
               "--block-sizes", "4,8", "--speculation-policy", "adaptive", "--cost-profile",
               "none", "--verbose"])
    err = capsys.readouterr().err
    assert rc == 0 and "speculation policy adaptive: decode steps by block length" in err


def test_cli_flags(qwen3_path, capsys):
    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "x", "--draft", "d", "--block-sizes",
                              "16,4,8", "--speculation-policy", "fixed", "--cost-profile", "p"])
    kw = engine_kwargs(args)
    assert (kw["block_sizes"], kw["speculation_policy"], kw["cost_profile"]) == \
        ((16, 4, 8), "fixed", "p")
    defaults = engine_kwargs(parser.parse_args(["generate", "--prompt", "x"]))
    assert (defaults["block_sizes"], defaults["speculation_policy"]) == (None, "adaptive")
    for bad, msg in (("4,x", "comma-separated integers"), ("1,4", ">= 2"), ("", "integers"),
                     ("4;8", "integers")):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["generate", "--prompt", "x", "--block-sizes", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert "--block-sizes" in err[-1] and msg in err[-1]
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--prompt", "x", "--speculation-policy", "greedy"])
    capsys.readouterr()
    # Block sizes without a drafter: the usual one-line user error.
    assert main(["generate", "--model", str(qwen3_path), "--device", "cpu", "--prompt", "x",
                 "--block-sizes", "4,8"]) == 2
    assert "need a draft model" in capsys.readouterr().err


def test_policy_sweep_smoke(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "policy_sweep.py"),
                           "--smoke", "--c1-repeats", "2", "--out-dir", str(tmp_path)],
                          env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "policy_sweep.json").read_text())
    assert set(res["plain"]) == {"C=1", "C=4"}
    # C=1 pools two runs (tokens over time), C=4 is a single run per a; the plain table pools
    # the plain runs timed alongside each a
    one = res["spec"]["a=0.6"]["C=1"]["adaptive"]
    assert one["repeats"] == 2 and len(one["runs"]) == 2
    assert "repeats" not in res["spec"]["a=0.6"]["C=4"]["plain"]
    assert res["plain"]["C=4"]["repeats"] == 2 and res["plain"]["C=1"]["repeats"] == 4
    assert one["output_tokens"] == sum(r["output_tokens"] for r in one["runs"])
    # The decode phase (after every request's first token): time within the run's, and pooled
    # as tokens over time
    for r in one["runs"]:
        assert 0 < r["decode_phase_s"] <= r["elapsed_s"] and r["decode_tok_s"] > 0
    assert one["decode_phase_s"] == pytest.approx(sum(r["decode_phase_s"] for r in one["runs"]))
    assert min(r["decode_tok_s"] for r in one["runs"]) <= one["decode_tok_s"] \
        <= max(r["decode_tok_s"] for r in one["runs"])
    for L, n in one["block_len_steps"].items():
        assert n == sum(r["block_len_steps"].get(L, 0) for r in one["runs"])
    # A fixed block under 0.9x the first round's best ran one round only; the rest both.
    assert res["dominated_below"] == 0.9
    for a in ("a=0.86", "a=0.6"):
        cell = res["spec"][a]["C=1"]
        first = {n: (x["runs"][0] if "runs" in x else x)["output_tok_s"] for n, x in cell.items()}
        for name in ("fixed 4", "fixed 8", "fixed 16"):
            dominated = first[name] < 0.9 * max(first.values())
            assert cell[name].get("repeats", 1) == (1 if dominated else 2), (a, name, first)
    for a in ("a=0.86", "a=0.6"):
        for c in ("C=1", "C=4"):
            runs = res["spec"][a][c]
            assert set(runs) == {"plain", "fixed 4", "fixed 8", "fixed 16", "adaptive"}
            assert res["ratios"][a][c]["vs_plain"] == pytest.approx(
                runs["adaptive"]["output_tok_s"] / runs["plain"]["output_tok_s"])
            assert set(runs["fixed 8"]["block_len_steps"]) == {"8"}
            assert sum(runs["adaptive"]["block_len_steps"].values()) > 0
            assert res["ratios"][a][c]["vs_best"] > 0  # may top 1.0: block 2 is not a config
    assert res["spec"]["a=0.86"]["C=1"]["fixed 16"]["tau"] > \
        res["spec"]["a=0.6"]["C=1"]["fixed 16"]["tau"]  # the acceptance switch took effect
    assert {"policy_min_vs_plain", "policy_min_vs_best", "policy_c1_a086_vs_fixed16"} <= set(res)
    assert res["cost_profile"]["measured"] and set(res["cost_profile"]["times"]) == \
        {"1", "2", "4", "8", "16"}
    assert (tmp_path / "policy_sweep.png").stat().st_size > 0
    md = (tmp_path / "policy_sweep.md").read_text()
    assert "adaptive / best" in md and "decode phase: adaptive / plain" in md


def test_policy_report_run_spread(monkeypatch):
    """The report states how far a cell's identical runs (C > 1) lie apart: the noise that the
    adaptive/plain ratios sit in. C=1 runs differ by their synthetic draws and are left out."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from blockspec.bench.policy_report import spread, summarize

    def cell(*tok_s):
        runs = [{"output_tok_s": t} for t in tok_s]
        return {"output_tok_s": sum(tok_s) / len(tok_s), "runs": runs} if len(runs) > 1 \
            else runs[0]

    assert spread(cell(90.0, 110.0)) == pytest.approx(0.2) and spread(cell(5.0)) is None
    res = {"benchmark": "b", "command": "c", "device": "d", "torch": "t", "date": "x",
           "plain": {"C=1": cell(10.0, 30.0), "C=8": cell(95.0, 105.0)},
           "spec": {"a=0.6": {c: {"adaptive": cell(100.0, 100.0)} for c in ("C=1", "C=8")}}}
    summarize(res)
    assert res["max_run_spread"] == {"plain": pytest.approx(0.1), "adaptive": 0.0}
    assert "plain 10.0%, adaptive 0.0%" in res["table_md"]


def test_plain_ab_smoke(tmp_path):
    """benchmarks/plain_ab.py --smoke: alternating pairs, each engine's all-decode steps timed by
    part (only those: a closed batch of 8 x 16 tokens has 15 decode steps at most), and a
    cProfile of each engine's decode steps."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plain_ab.py"), "--smoke",
                           "--pairs", "2", "--between", "4", "--out-dir", str(tmp_path)],
                          env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "plain_ab.json").read_text())
    assert len(res["pairs"]) == 2 and (res["concurrency"], res["output_len"]) == (8, 16)
    assert (res["between"], res["between_runs"]) == (4, 2)
    assert res["adaptive_engine_block_len_steps"].get("4", 0) > 0
    for pair in res["pairs"]:
        for name in ("plain", "adaptive"):
            steps = pair[name]["steps"]
            assert 0 < steps["steps"] <= 15
            assert steps["wall"] >= steps["runner_host"] > 0
            # The other steps (the prefill), in all: at least the closed batch's one prefill.
            pre = pair[name]["prefill_steps"]
            assert pre["steps"] >= 1 and pre["wall"] >= pre["runner_host"] > 0
            assert pre["wall"] < 1e3 * pair[name]["elapsed_s"]
        assert pair["decode_phase_ratio"] > 0
    assert set(res["parts_diff_ms"]) == {"schedule", "runner_host", "device_wait",
                                         "postprocess", "wall"}
    assert set(res["prefill_parts_diff_ms"]) == set(res["parts_diff_ms"])
    # NOTE: which step functions ran under the profiler, not the top-N listing (the order by
    # own time depends on the machine's load)
    assert set(res["profiles"]) == {"plain", "adaptive"}
    assert res["profiled_steps"] == {name: ["_execute_decode"] for name in res["profiles"]}
    # The replay probe needs CUDA graphs (None here); each engine's last run's block tables
    # were kept, and their adjacency is a share.
    assert res["replay_ms"] == {name: {"contiguous": None, "real": None, "scattered": None}
                                for name in ("plain", "adaptive")}
    assert all(0.0 <= v <= 1.0 for v in res["table_adjacency"].values())
    # Against a fixed block on the same engine: both configs' steps counted apart.
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plain_ab.py"), "--smoke",
                           "--pairs", "1", "--reference", "fixed:4", "--out-dir",
                           str(tmp_path / "fixed")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "fixed" / "plain_ab.json").read_text())
    assert res["reference"] == "fixed 4" and set(res["profiles"]) == {"fixed 4", "adaptive"}
    assert len(res["pairs"]) == 1
    for pair in res["pairs"]:
        assert 0 < pair["fixed 4"]["steps"]["steps"] <= 15
        assert 0 < pair["adaptive"]["steps"]["steps"] <= 15
    assert res["adaptive_engine_block_len_steps"].get("4", 0) > 0


def test_plain_ab_block_table_adjacency():
    """plain_ab.adjacency: the share of a table's live neighbouring entries that are
    neighbouring block ids (-1 pads a shorter table and is not counted)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from plain_ab import adjacency

    t = torch.tensor([[0, 1, 2, 9], [3, 4, 5, -1]], dtype=torch.int32)
    assert adjacency(t) == pytest.approx(4 / 5)
    assert adjacency(torch.tensor([[7, 6, 5, 4]])) == 1.0  # descending runs count too
    assert adjacency(torch.tensor([[0, 2, 4, 6]])) == 0.0


def test_host_overhead_benchmark(tmp_path):
    """benchmarks/host_overhead.py (in a subprocess: it stubs the decode step's forward): every
    mode reports host ms per all-decode step, and the stub really skipped the device work (a
    decode step's forward ran once per (step kind, batch bucket), not once per step)."""
    out = tmp_path / "host.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "host_overhead.py"),
                           "--concurrency", "8", "--output-len", "12", "--repeats", "1",
                           "--out", str(out)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["modes"]) == {"plain", "adaptive-plain", "fixed4", "adaptive-spec"}
    for mode in res["modes"].values():
        assert set(mode) == {"schedule", "runner_host", "postprocess", "step_wall"}
        assert all(v > 0 for v in mode.values())
    # 4 modes x 2 runs x 11 decode steps: 88 steps; forwards: one per (step kind, bucket), the
    # speculative engines' start-up profiles (4 block lengths x 3 buckets each) included
    assert 0 < res["real_forwards"] <= 56


def test_policy_replay_simulation():
    """benchmarks/policy_replay.py replays the policy on run 12's modelled H200 (a labelled
    simulation): every cell reports every config, the adaptive policy lands near the best of
    the configs it chooses among, and common random numbers make a round reproducible."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import policy_replay

    res = json.loads((REPO / "benchmarks" / "results" / "policy_sweep_2026-11-30_run12"
                      / "policy_sweep.json").read_text())
    res = {**res, "concurrency": [1, 32]}
    table = policy_replay.replay(res, noise=0.0, rounds=1, seed=0, out_len=64)
    again = policy_replay.replay(res, noise=0.0, rounds=1, seed=0, out_len=64)
    assert table == again
    for cells in table.values():
        for cell in cells.values():
            assert set(cell["tok_s"]) == set(policy_replay.CONFIGS)
            assert cell["vs_best"] > 0.9 and sum(cell["adaptive_steps"].values()) > 0
    # A good drafter at C=1: block 16, far ahead of plain decoding (the source run: 4.9x).
    assert table["a=0.86"]["C=1"]["vs_plain"] > 3
    assert "SIMULATED" in policy_replay.report(table, res)


def test_policy_sweep_round_order(monkeypatch):
    """Each round: the fixed blocks rotated, then plain and adaptive back to back, each of the
    two first in every other round (the pair the 1.0x bar compares, on an equal footing)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from policy_sweep import round_order

    fixed = ["fixed 4", "fixed 8", "fixed 16"]
    rounds = [round_order(k, fixed) for k in range(4)]
    assert rounds[0] == fixed + ["plain", "adaptive"]
    assert rounds[1] == ["fixed 8", "fixed 16", "fixed 4", "adaptive", "plain"]
    for r in rounds:
        assert sorted(r) == sorted(fixed + ["plain", "adaptive"]) and set(r[-2:]) == {
            "plain", "adaptive"}
    assert sum(r[-2] == "plain" for r in rounds) == sum(r[-2] == "adaptive" for r in rounds)
