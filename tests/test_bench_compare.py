"""`blockspec bench compare`: layouts parsed, each config's offline flags, the table against the
best plain layout, one CPU run over gloo (two ranks), a failing config, and the scripts of issues
24 and 25 (their engine runs stubbed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_script

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
               "--num-kv-blocks", "64", "--layouts", "tp2", "--concurrency", "1",
               "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
               "--warmup-tokens", "0", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    res = json.loads((out / "tp2_ar.json").read_text())
    assert res["levels"][0]["output_tokens"] == 8
    assert res["config"]["engine"]["parallel"]["layout"] == "TP2"  # the layout's own flags
    assert "| TP2 AR | 1.00x | 1.00x |" in (out / "compare.md").read_text()
    summary = json.loads((out / "compare.json").read_text())
    assert summary["failed"] == [] and set(summary["configs"]) == {"tp2_ar"}
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


def test_synthetic_acceptance_for_an_acceptance_length():
    from blockspec.bench.compare import acceptance_for_length, acceptance_length

    assert acceptance_length(0.86, 8) == pytest.approx(5.0056, abs=1e-4)  # the a=0.86 runs'
    a = acceptance_for_length(3.8, 8)  # the deployment's block-8 acceptance length
    assert 0.76 < a < 0.78 and acceptance_length(a, 8) == pytest.approx(3.8, abs=1e-3)
    assert acceptance_for_length(1.0, 8) == 0.0 and acceptance_for_length(8.0, 8) == 1.0
    with pytest.raises(ConfigError, match="outside"):
        acceptance_for_length(9.0, 8)


def _kimi_script():
    return load_script("kimi_compare")


def test_kimi_shapes_and_the_bytes_model(tmp_path):
    """Issue 25's folders: Kimi K2.6's text model (61 layers, MLA, 384 int4 experts top 8) and
    its published drafter's shape; the bytes model reproduces DESIGN.md's batch-1 gains."""
    from blockspec.bench.moe_shapes import (
        KIMI_DRAFTER,
        distinct_experts,
        kimi_k26,
        write_moe_folders,
    )
    from blockspec.config import ModelConfig
    from blockspec.dflash.config import DFlashConfig

    target, drafter = write_moe_folders(tmp_path, "kimi", kimi_k26(), 6, 8,
                                        KIMI_DRAFTER["target_layer_ids"])
    cfg = ModelConfig.from_pretrained(target)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.moe.num_experts) == (61, 7168, 384)
    assert cfg.quant is not None and cfg.quant.group_size == 32
    d = DFlashConfig.from_pretrained(drafter)
    assert (d.block_size, d.mask_token_id, d.target_layer_ids) == (
        8, 163838, [1, 12, 24, 35, 47, 58])
    assert [round(distinct_experts(384, 8, t), 1) for t in (1, 4, 8)] == [8.0, 31.0, 59.5]
    mod = _kimi_script()
    # DESIGN.md: at a=0.86, batch 1, block 4 gains 1.64x and block 8 1.57x by bytes
    from blockspec.bench.compare import acceptance_length

    assert mod.bytes_model_c1(acceptance_length(0.86, 4), 4) == pytest.approx(1.64, abs=0.01)
    assert mod.bytes_model_c1(acceptance_length(0.86, 8), 8) == pytest.approx(1.57, abs=0.01)


def test_kimi_compare_plans_every_layout_and_acceptance(tmp_path, monkeypatch):
    """The script's plan and headline, its offline runs stubbed (the real ones: the compare
    test above runs offline processes over gloo; tests/test_parallel.py the int4 experts
    under TP and EP): AR per layout, DFlash per layout and acceptance, on the Kimi folders."""
    mod = _kimi_script()
    seen = []

    def fake_run_configs(plan, common, out):
        model = common[common.index("--model") + 1]
        assert json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"] == 61
        seen.extend(plan)
        results = {}
        for name, label, _ in plan:
            spec = not name.endswith("_ar")
            res = _result(label, {1: 300.0 if spec else 100.0, 8: 500.0})
            res["levels"][0].update(step_mix={"ahead/4": {"tokens": 90}, "eager/0": {
                "tokens": 5}} if spec else {}, acceptance={"mean_acceptance_length": 3.2})
            results[name] = res
        return results, []

    monkeypatch.setattr(mod, "run_configs", fake_run_configs)
    assert mod.main(["--out-dir", str(tmp_path), "--concurrency", "1,8"]) == 0
    names = [n for n, _, _ in seen]
    a = mod.acceptance_for_length(mod.DEPLOYMENT_TAU, 8)
    assert names[:3] == ["tp8_ar", "ep8_ar", "ep4x2_ar"]
    assert set(names[3:]) == {f"{lay}_dflash_a{x:g}" for lay in ("tp8", "ep8", "ep4x2")
                              for x in (a, 0.86)}
    flags = seen[-1][2]  # ep4x2's DFlash row at a=0.86
    assert flags[:4] == ["-tp", "8", "-ep", "4"] and "--synthetic-acceptance" in flags
    head = json.loads((tmp_path / "kimi_compare.json").read_text())["headline"]
    assert head["a0.86"]["dflash_c1_vs_best_ar"] == 3.0 and head["a0.86"]["c1_block"] == 4
    assert head["a0.86"]["min_ratio_vs_best_ar"] == 1.0
    assert head["a0.86"]["bytes_model_c1"] == pytest.approx(mod.bytes_model_c1(3.2, 4))


def test_two_gpu_plans_its_layouts_and_its_headline(tmp_path, monkeypatch):
    """Issue 24's script, its engine runs stubbed (they are tests/test_parallel.py's and the
    compare test's): Qwen3 tp1/tp2 and Moonlight tp2/ep2, each AR and DFlash; the headline is
    tp2's batch-1 TPOT over tp1's and the least DFlash / AR of a parallel layout."""
    mod = load_script("two_gpu")
    plans = []

    def fake_run_configs(plan, common, out):
        plans.append([n for n, _, _ in plan])
        tpot = {"tp1_ar": 10.0, "tp2_ar": 6.0}
        results = {}
        for name, label, _ in plan:
            tok = {1: 300.0, 8: 900.0} if name.endswith("_dflash") else {1: 100.0, 8: 1000.0}
            results[name] = _result(label, tok)
            results[name]["levels"][0]["tpot_ms"] = {"median": tpot.get(name, 5.0)}
        return results, []

    monkeypatch.setattr(mod, "run_configs", fake_run_configs)
    monkeypatch.setattr(mod, "correctness", lambda root, device, one_gpu: {
        "qwen3": {"all_equal": True}, "deepseek_v3": {"all_equal": True}})
    monkeypatch.setattr(mod, "allreduce_times", lambda *a, **k: {1: 10.0})
    assert mod.main(["--out-dir", str(tmp_path), "--smoke"]) == 0
    assert plans == [["tp1_ar", "tp1_dflash", "tp2_ar", "tp2_dflash"],
                     ["tp2_ar", "tp2_dflash", "ep2_ar", "ep2_dflash"]]
    res = json.loads((tmp_path / "two_gpu.json").read_text())
    assert res["headline"]["tp2_ar_b1_step_ratio"] == pytest.approx(0.6)
    assert res["headline"]["tp2_adaptive_min_ratio_vs_ar"] == pytest.approx(0.9)
    assert res["scaling"]["dflash_over_ar"]["moonlight_ep2"] == {"1": 3.0, "8": 0.9}
    monkeypatch.setattr(mod, "correctness", lambda root, device, one_gpu: {
        "qwen3": {"all_equal": False}, "deepseek_v3": {"all_equal": True}})
    assert mod.main(["--out-dir", str(tmp_path), "--smoke", "--skip-scaling"]) == 1


def test_two_gpu_one_gpu_dry_run_runs_the_tp1_half(tmp_path, monkeypatch):
    """`--one-gpu` (issue 24's dry run while no two-GPU machine is lent): correctness at -tp 1
    only, no all-reduce, the -tp 1 configs of both shapes, and no two-GPU headline."""
    mod = load_script("two_gpu")
    plans, layouts = [], []

    def fake_run_configs(plan, common, out):
        plans.append([n for n, _, _ in plan])
        tok = {"tp1_ar": {1: 100.0}, "tp1_dflash": {1: 250.0}}
        return {n: _result(label, tok[n]) for n, label, _ in plan}, []

    def fake_correctness(root, device, one_gpu):
        layouts.append((device, one_gpu))
        return {"qwen3": {"all_equal": True}, "deepseek_v3": {"all_equal": True}}

    def no_allreduce(*a, **k):
        raise AssertionError("one GPU has no all-reduce to time")

    monkeypatch.setattr(mod, "run_configs", fake_run_configs)
    monkeypatch.setattr(mod, "correctness", fake_correctness)
    monkeypatch.setattr(mod, "allreduce_times", no_allreduce)
    monkeypatch.setattr(mod, "floor_ms", lambda target: 4.0)
    assert mod.main(["--out-dir", str(tmp_path), "--one-gpu"]) == 0
    assert layouts == [("cuda", True)]
    assert plans == [["tp1_ar", "tp1_dflash"], ["tp1_ar", "tp1_dflash"]]
    res = json.loads((tmp_path / "two_gpu.json").read_text())
    assert "headline" not in res and "allreduce_us" not in res and res["one_gpu"]
    assert res["scaling"]["tp1_bytes_floor_ms"] == 8.0
    assert res["scaling"]["dflash_over_ar"]["qwen3_8b_tp1"] == {"1": 2.5}
    with pytest.raises(SystemExit):
        mod.main(["--out-dir", str(tmp_path), "--one-gpu", "--smoke"])


def test_kimi_compare_cut_for_one_gpu(tmp_path, monkeypatch):
    """`--moe-layers N` (issue 25's dry run on fewer GPUs): the target is the dense layer + N
    MoE layers at full width, the drafter reads layers within the cut, and the bytes model
    counts the cut's own weights (less than the full model's outside the experts)."""
    from blockspec.dflash.config import DFlashConfig

    mod = _kimi_script()
    seen = {}

    def fake_run_configs(plan, common, out):
        model = Path(common[common.index("--model") + 1])
        seen["layers"] = json.loads((model / "config.json").read_text())["num_hidden_layers"]
        draft = Path(plan[-1][2][plan[-1][2].index("--draft") + 1])
        seen["ids"] = DFlashConfig.from_pretrained(draft).target_layer_ids
        seen["names"] = [n for n, _, _ in plan]
        res = {}
        for name, label, _ in plan:
            r = _result(label, {1: 100.0 if name.endswith("_ar") else 200.0})
            r["levels"][0].update(step_mix={"ahead/8": {"tokens": 9}},
                                  acceptance={"mean_acceptance_length": 3.0})
            res[name] = r
        return res, []

    monkeypatch.setattr(mod, "run_configs", fake_run_configs)
    argv = ["--out-dir", str(tmp_path), "--layouts", "tp1", "--concurrency", "1",
            "--acceptances", "0.86", "--moe-layers", "2"]
    assert mod.main(argv) == 0
    assert seen["layers"] == 3 and max(seen["ids"]) < 3
    assert seen["names"] == ["tp1_ar", "tp1_dflash_a0.86"]
    out = json.loads((tmp_path / "kimi_compare.json").read_text())
    dense_gb, expert_gb = out["bytes_gb"]
    assert 0 < dense_gb < mod.DENSE_GB and expert_gb == pytest.approx(mod.EXPERT_GB / 30)
    assert out["headline"]["a0.86"]["bytes_model_c1"] == pytest.approx(
        mod.bytes_model_c1(3.0, 8, dense_gb, expert_gb))
    with pytest.raises(SystemExit):
        mod.main([*argv, "--smoke"])
