"""The embedded demo pair: present, small enough to ship, the CLI default, lossless."""

from __future__ import annotations

import argparse
import json

import pytest

from blockspec import LLM, SamplingParams
from blockspec.cli import main, resolve_model
from blockspec.demo import DEMO_DIR, demo_drafter, demo_target

pytestmark = pytest.mark.skipif(demo_target() is None, reason="demo pair not in this checkout")


def test_demo_pair_ships_within_budget():
    size = sum(f.stat().st_size for f in DEMO_DIR.rglob("*") if f.is_file())
    assert size <= 50e6, size
    cfg = json.loads((demo_target() / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    draft = json.loads((demo_drafter() / "config.json").read_text())
    assert draft["block_size"] == 16
    record = json.loads((DEMO_DIR / "build_record.json").read_text())
    assert record["target"]["params"] <= 25e6 and record["corpus"]["sources"]


def test_cli_default_is_the_demo_pair(capsys):
    ns = argparse.Namespace(model=None, draft=None)
    assert resolve_model(ns) == str(demo_target())
    assert ns.draft == str(demo_drafter())
    assert "demo pair" in capsys.readouterr().err
    ns = argparse.Namespace(model=None, draft="none")
    assert resolve_model(ns) == str(demo_target()) and ns.draft is None
    ns = argparse.Namespace(model="/some/model", draft=None)
    assert resolve_model(ns) == "/some/model" and ns.draft is None


def test_generate_without_model_runs_the_pair(capsys):
    assert main(["generate", "--prompt", "def add(a, b):", "--max-tokens", "12", "--device",
                 "cpu", "--verbose", "--speculation-policy", "fixed"]) == 0
    out = capsys.readouterr()
    assert "demo pair" in out.err and "acceptance" in (out.out + out.err).lower()
    # The adaptive policy (the default) also says why it chose what it chose.
    assert main(["generate", "--prompt", "def add(a, b):", "--max-tokens", "4", "--device",
                 "cpu", "--verbose", "--cost-profile", "none"]) == 0
    err = capsys.readouterr().err
    assert "policy's view at batch 1" in err and "expected tok/s plain" in err


def test_demo_pair_speculation_is_lossless():
    prompts = ["def quicksort(items):\n", "class Stack:\n    def __init__(self):\n"]
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ar = LLM(str(demo_target()), device="cpu", dtype="float32")
    want = [o.token_ids for o in ar.generate(prompts, greedy)]
    spec = LLM(str(demo_target()), draft=str(demo_drafter()), device="cpu", dtype="float32",
               speculation_policy="fixed")
    assert [o.token_ids for o in spec.generate(prompts, greedy)] == want
    assert spec.engine.spec_stats.num_steps > 0
