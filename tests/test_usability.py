"""What a new user meets first: --version, LLM() and eval-acceptance default to the demo pair
like the CLI, LLM.chat, help(LLM), a plain engine's metrics."""

from __future__ import annotations

import pytest

import blockspec
from blockspec import LLM, SamplingParams
from blockspec.chat import render_chat
from blockspec.cli import main
from blockspec.demo import demo_drafter, demo_target

needs_demo = pytest.mark.skipif(demo_target() is None, reason="demo pair not in this checkout")


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"blockspec {blockspec.__version__}"


@needs_demo
def test_llm_without_a_model_is_the_demo_pair():
    llm = LLM(device="cpu", num_kv_blocks=64, speculation_policy="fixed")
    assert llm.engine.config.model == str(demo_target())
    assert llm.engine.config.draft == str(demo_drafter())
    alone = LLM(device="cpu", num_kv_blocks=64, draft="none")
    assert alone.engine.config.draft is None
    p = SamplingParams(temperature=0, max_tokens=12)
    assert llm.generate("def add(a, b):", p)[0].token_ids == \
        alone.generate("def add(a, b):", p)[0].token_ids


def test_help_documents_the_engine_arguments():
    doc = LLM.__doc__
    for name in ("draft", "block_size", "speculation_policy", "max_model_len", "num_kv_blocks",
                 "max_num_seqs", "enable_prefix_caching", "load_format", "seed"):
        assert f"`{name}`" in doc, name


def test_chat_uses_the_template(qwen3_path):
    llm = LLM(str(qwen3_path), device="cpu", num_kv_blocks=64)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = render_chat(llm.tokenizer, messages)
    want = llm.generate([ids], p)[0].token_ids
    assert llm.chat(messages, p)[0].token_ids == want
    two = llm.chat([messages, messages[1:]], p)
    assert len(two) == 2 and two[0].token_ids == want
    assert ids[-1] != llm.tokenizer.encode(messages[1]["content"])[-1]  # a template was applied


def test_plain_engine_reports_no_spec_metrics(qwen3_path, drafter16):
    out = LLM(str(qwen3_path), device="cpu", num_kv_blocks=64).generate(
        "x", SamplingParams(max_tokens=3))[0]
    assert out.metrics.spec is None
    spec = LLM(str(qwen3_path), device="cpu", num_kv_blocks=64, draft=str(drafter16),
               speculation_policy="fixed").generate("x", SamplingParams(max_tokens=3))[0]
    assert spec.metrics.spec is not None


@needs_demo
def test_eval_acceptance_defaults_to_the_demo_pair(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    out = tmp_path / "tau.json"
    assert main(["eval-acceptance", "--prompts", str(prompts), "--max-tokens", "16",
                 "--device", "cpu", "--out", str(out)]) == 0
    assert "demo pair" in capsys.readouterr().err and out.is_file()


def test_decode_step_prefill_tokens_flag():
    from blockspec.cli import build_parser, engine_kwargs

    parse = build_parser().parse_args
    assert engine_kwargs(parse(["serve"]))["decode_step_prefill_tokens"] is None
    assert engine_kwargs(parse(["serve", "--decode-step-prefill-tokens", "auto"]))[
        "decode_step_prefill_tokens"] == "auto"
    assert engine_kwargs(parse(["serve", "--decode-step-prefill-tokens", "0"]))[
        "decode_step_prefill_tokens"] == 0
    assert engine_kwargs(parse(["serve", "--decode-step-prefill-tokens", "384"]))[
        "decode_step_prefill_tokens"] == 384
    with pytest.raises(SystemExit):
        parse(["serve", "--decode-step-prefill-tokens", "-1"])


def test_decode_step_prefill_tokens_default_resolution(qwen3_path, drafter16):
    """The default caps prefill beside decodes ("auto") for a speculative engine on CUDA only;
    an explicit setting holds everywhere; the engine's scheduler takes the resolved one."""
    from blockspec.config import ConfigError, EngineConfig
    from blockspec.engine.llm_engine import LLMEngine

    plain = EngineConfig(str(qwen3_path), device="cpu")
    spec = EngineConfig(str(qwen3_path), device="cpu", draft=str(drafter16))
    assert plain.prefill_cap_setting == 0 and spec.prefill_cap_setting == 0  # CPU
    spec.device = plain.device = "cuda"  # NOTE: the resolution alone; nothing runs on it
    assert spec.prefill_cap_setting is None and plain.prefill_cap_setting == 0
    for value, want in (("auto", None), (0, 0), (384, 384)):
        spec.decode_step_prefill_tokens = plain.decode_step_prefill_tokens = value
        assert spec.prefill_cap_setting == want and plain.prefill_cap_setting == want
    for bad in (-1, "fast", 1.5, True):
        with pytest.raises(ConfigError, match="decode_step_prefill_tokens"):
            EngineConfig(str(qwen3_path), device="cpu", decode_step_prefill_tokens=bad)
    engine = LLMEngine(EngineConfig(str(qwen3_path), device="cpu", num_kv_blocks=64,
                                    decode_step_prefill_tokens="auto"))
    assert engine.scheduler.decode_step_prefill_tokens is None
