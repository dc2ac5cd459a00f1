"""A tiny folder in Kimi K2.6's layout (tests/kimi_layout.py: kimi_k25 wrapper, INT4 experts,
a tiktoken tokenizer shipping its own code) loads, tokenizes with its own tokenizer and chat
template, and generates what HF transformers' dequantized model generates; its DFlash drafter
changes nothing in greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kimi_layout import SPECIAL, kimi_k26_folder
from quant_models import hf_dequantized

from blockspec import LLM, SamplingParams
from blockspec.errors import ConfigError
from blockspec.tiny import build_tiny_deepseek_v3


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("kimi")
    dense = build_tiny_deepseek_v3(root / "dense", q_lora_rank=32, n_group=4, topk_group=2,
                                   seed=7)
    return kimi_k26_folder(dense, root)


@pytest.fixture(scope="module")
def kimi_llm(kimi) -> LLM:
    return LLM(str(kimi), device="cpu", trust_remote_code=True, num_kv_blocks=64,
               max_num_seqs=2)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 490, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_greedy_tokens_match_hf_dequantized(kimi, kimi_llm):
    prompts = [prompt(n, n) for n in (6, 40)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = [o.token_ids for o in kimi_llm.generate(prompts, params)]
    hf = hf_dequantized(kimi.parent / "int4")  # the same weights before wrapping
    ref = [hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert got == ref


def test_its_own_tokenizer_and_chat_template_serve_text(kimi_llm):
    tok = kimi_llm.tokenizer
    assert type(tok).__name__ == "TikTokenTokenizer"  # the folder's code, not a fallback
    text = "def foo(x):\n    return json.dumps(x)"
    assert tok.decode(tok.encode(text)) == text
    out = kimi_llm.chat([{"role": "user", "content": "hi"}],
                        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    special = {t: len(tok) - len(SPECIAL) + i for i, t in enumerate(SPECIAL)}
    assert out.prompt_token_ids[0] == special["<|im_user|>"]
    assert out.prompt_token_ids[-1] == special["<|im_middle|>"]
    assert len(out.token_ids) == 5 and out.text == tok.decode(out.token_ids,
                                                              skip_special_tokens=True)


def test_tokenizer_code_runs_only_with_the_flag(kimi):
    with pytest.raises(ConfigError, match="ships its own code .*--trust-remote-code"):
        LLM(str(kimi), device="cpu", num_kv_blocks=8)


def test_dflash_drafter_keeps_greedy_output(kimi, kimi_llm, tmp_path):
    from blockspec.dflash.checkpoint import build_random_drafter

    mask = len(kimi_llm.tokenizer) - len(SPECIAL) + SPECIAL.index("[MASK]")
    drafter = build_random_drafter(tmp_path / "dflash", kimi, num_layers=2, block_size=8,
                                   mask_token_id=mask)
    prompts = [prompt(n, n + 1) for n in (9, 30)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = [o.token_ids for o in kimi_llm.generate(prompts, params)]
    llm = LLM(str(kimi), device="cpu", trust_remote_code=True, draft=str(drafter),
              speculation_policy="fixed", cost_profile="none", num_kv_blocks=64)
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    assert llm.engine.spec_stats.block_len_steps.get(8, 0) > 0


def test_cli_generate_takes_the_flag(kimi, capsys):
    from blockspec.cli import main

    argv = ["generate", "--model", str(kimi), "--device", "cpu", "--num-kv-blocks", "16",
            "--prompt", "def", "--chat", "--max-tokens", "3", "--ignore-eos"]
    assert main(argv) == 2
    assert "--trust-remote-code" in capsys.readouterr().err
    assert main([*argv, "--trust-remote-code"]) == 0
