"""`blockspec bench compare`: layouts parsed, each config's offline flags, the table against the
best plain layout, one CPU run over gloo (one device and two ranks), and a failing config."""

from __future__ import annotations

import json

import pytest

from blockspec.bench.compare import (
    comparison,
    configs,
    offline_argv,
    parse_layouts,
)
from blockspec.config import ConfigError


def test_layouts_parse_to_tp_and_ep():
    got = parse_layouts("tp8, ep8,ep4x2,tp1")
    assert [(x.tensor_parallel_size, x.expert_parallel_size) for x in got] == [
        (8, 1), (8, 8), (8, 4), (1, 1)]
    assert [x.label for x in got] == ["TP8", "EP8", "EP4x2", "1 GPU"]
    assert got[2].flags() == ["-tp", "8", "-ep", "4"]
    for bad in ("tp2x2", "dp4", "ep0", "tp8,tp8", "", "ep4x0"):
        with pytest.raises(ConfigError, match="--layouts"):
            parse_layouts(bad)


def test_offline_flags_are_the_command_line_less_what_compare_sets():
    argv = ["bench", "compare", "--model", "m", "--layouts", "tp1,tp2", "--out=d", "--draft",
            "x", "-tp", "2", "--concurrency", "1,2", "--synthetic-acceptance", "0.8",
            "--ignore-eos", "--output-len", "4"]
    assert offline_argv(argv) == ["--model", "m", "--concurrency", "1,2", "--ignore-eos",
                                  "--output-len", "4"]


def test_configs_plain_and_speculative():
    lays = parse_layouts("tp2,ep2")
    plan = configs(lays, "both", "/d", 0.8)
    assert [(n, lab) for n, lab, _ in plan] == [
        ("tp2_ar", "TP2 AR"), ("tp2_dflash", "TP2 DFlash"), ("ep2_ar", "EP2 AR"),
        ("ep2_dflash", "EP2 DFlash")]
    assert plan[0][2] == ["-tp", "2", "-ep", "1", "--draft", "none"]  # AR: no synthetic mode
    assert plan[3][2] == ["-tp", "2", "-ep", "2", "--draft", "/d", "--synthetic-acceptance",
                          "0.8"]
    assert [n for n, _, _ in configs(lays, "off", None)] == ["tp2_ar", "ep2_ar"]
    with pytest.raises(ConfigError, match="needs --draft"):
        configs(lays, "on", None)


def _result(label: str, tok: dict[int, float]) -> dict:
    return {"label": label, "levels": [{"concurrency": c, "output_tok_s": t}
                                       for c, t in tok.items()]}


def test_every_config_is_set_against_the_best_plain_layout_at_each_c():
    results = {"tp8_ar": _result("TP8 AR", {1: 100.0, 32: 1000.0}),
               "ep8_ar": _result("EP8 AR", {1: 80.0, 32: 1200.0}),
               "ep8_dflash": _result("EP8 DFlash", {1: 300.0, 32: 900.0})}
    text = comparison(results)
    assert "C=1: TP8 AR, C=32: EP8 AR" in text
    assert "| TP8 AR | 1.00x | 0.83x | 0.83x |" in text
    assert "| EP8 AR | 0.80x | 1.00x | 1.00x |" in text
    assert "| EP8 DFlash | 3.00x | 0.75x | 0.75x |" in text  # peak 900 over AR's peak 1200
    assert "| Config | C=1 | C=32 | Peak |" in text


def test_compare_runs_each_layout_in_its_own_process(qwen3_path, tmp_path, capsys):
    from blockspec.cli import main

    out = tmp_path / "cmp"
    rc = main(["bench", "compare", "--model", str(qwen3_path), "--device", "cpu",
               "--num-kv-blocks", "64", "--layouts", "tp1,tp2", "--concurrency", "1",
               "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
               "--warmup-tokens", "0", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    for name in ("tp1_ar", "tp2_ar"):
        res = json.loads((out / f"{name}.json").read_text())
        assert res["levels"][0]["output_tokens"] == 8
    assert json.loads((out / "tp2_ar.json").read_text())["config"]["engine"]["parallel"][
        "layout"] == "TP2"
    table = (out / "compare.md").read_text()
    assert "| 1 GPU AR |" in table and "| TP2 AR |" in table and "1.00x" in table
    summary = json.loads((out / "compare.json").read_text())
    assert summary["failed"] == [] and set(summary["configs"]) == {"tp1_ar", "tp2_ar"}
    assert summary["command"].startswith("blockspec bench compare")
    assert (out / "compare.png").stat().st_size > 0


def test_a_failing_config_is_reported_and_the_others_kept(tmp_path, monkeypatch, capsys):
    """Each config is one offline process: one that fails (here its process exits 2) leaves
    the others' results, table and plot, and the command exits 1 naming it."""
    import subprocess
    from types import SimpleNamespace

    from blockspec.bench import compare

    def fake_run(cmd, **_):
        path = cmd[cmd.index("--out") + 1]
        if "-tp" in cmd and cmd[cmd.index("-tp") + 1] == "3":
            return SimpleNamespace(returncode=2)
        label = cmd[cmd.index("--label") + 1]
        with open(path, "w") as f:
            json.dump(_result(label, {1: 10.0}), f)
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    args = SimpleNamespace(layouts="tp1,tp3", speculative=None, draft=None, label=None,
                           synthetic_acceptance=None, tensor_parallel_size=1,
                           expert_parallel_size=1, out=str(tmp_path),
                           argv=["bench", "compare", "--model", "m", "--layouts", "tp1,tp3"])
    assert compare.run_compare(args) == 1
    assert "1 config(s) failed: TP3 AR" in capsys.readouterr().err
    assert json.loads((tmp_path / "compare.json").read_text())["failed"] == ["TP3 AR"]
    assert "| 1 GPU AR | 1.00x | 1.00x |" in (tmp_path / "compare.md").read_text()
    monkeypatch.setattr(subprocess, "run", lambda cmd, **_: SimpleNamespace(returncode=1))
    with pytest.raises(ConfigError, match="every config failed"):
        compare.run_compare(args)


def test_compare_refuses_what_it_sets_itself(qwen3_path, tmp_path, capsys):
    from blockspec.cli import main

    base = ["bench", "compare", "--model", str(qwen3_path), "--layouts", "tp1",
            "--out", str(tmp_path)]
    assert main([*base, "-tp", "2"]) == 2
    assert main([*base, "--speculative", "on"]) == 2
    assert "needs --draft" in capsys.readouterr().err
