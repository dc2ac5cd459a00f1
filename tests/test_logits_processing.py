"""logit_bias, min_tokens and the repetition/frequency/presence penalties: against a reference
written independently (numpy), and token-identical with and without a DFlash drafter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_no_leaks
from spec_models import build_constant_pair

from blockspec import LLM, SamplingParams
from blockspec.layers.logits_processors import RowContext, process_logits

VOCAB = 12
EOS = (11,)


def reference(logits: np.ndarray, prompt: list[int], output: list[int],
              p: SamplingParams, eos: tuple[int, ...] = EOS) -> np.ndarray:
    """vLLM's semantics, one row at a time: bias, min_tokens ban, repetition penalty over prompt
    and output, frequency and presence penalties over the output."""
    x = logits.astype(np.float64).copy()
    for tok, b in (p.logit_bias or {}).items():
        x[tok] += b
    if len(output) < p.min_tokens:
        for tok in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            x[tok] = -np.inf
    for tok in set(prompt) | set(output):
        x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    for tok in set(output):
        x[tok] -= p.frequency_penalty * output.count(tok) + p.presence_penalty
    return x


PARAMS = [
    SamplingParams(logit_bias={3: 2.5, 7: -100.0}),
    SamplingParams(min_tokens=4, stop_token_ids=[2]),
    SamplingParams(min_tokens=4, ignore_eos=True, stop_token_ids=[5]),
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(frequency_penalty=0.8, presence_penalty=-0.5),
    SamplingParams(frequency_penalty=-1.2, repetition_penalty=1.3, logit_bias={0: 1.0},
                   min_tokens=9, stop_token_ids=[1]),
]


@pytest.mark.parametrize("p", PARAMS, ids=range(len(PARAMS)))
def test_processing_matches_reference(p):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=gen) * 3
    prompts = [[1, 2, 3], [3, 3, 9], [], [0, 11], [4]]
    outputs = [[], [3, 3, 4], [5, 5, 5, 5, 6], [11, 2, 2, 7], list(range(VOCAB))]
    ctxs = [RowContext(p, pr, out, EOS) for pr, out in zip(prompts, outputs)]
    got = process_logits(logits, ctxs).numpy()
    for r in range(5):
        want = reference(logits[r].numpy(), prompts[r], outputs[r], p)
        np.testing.assert_allclose(got[r], want, rtol=1e-6, atol=1e-6)
    # the reference really changes something in every case
    assert any(not np.allclose(got[r], logits[r].numpy()) for r in range(5))


def test_rows_without_processors_are_untouched():
    logits = torch.randn(3, VOCAB)
    ctxs = [None, RowContext(SamplingParams(), [1], [1, 1], EOS),
            RowContext(SamplingParams(frequency_penalty=1.0), [], [4], EOS)]
    got = process_logits(logits, ctxs)
    assert torch.equal(got[:2], logits[:2]) and not torch.equal(got[2], logits[2])


@pytest.fixture(scope="module")
def pair(models_root):
    return build_constant_pair(models_root, {5: 0.5, 6: 0.3, 0: 0.2}, block_size=8,
                               name="const-proc")


@pytest.fixture(scope="module")
def engines(pair):
    target, drafter = pair
    ar = LLM(str(target), device="cpu", num_kv_blocks=256)
    fixed = LLM(str(target), device="cpu", num_kv_blocks=256, draft=str(drafter),
                speculation_policy="fixed")
    adaptive = LLM(str(target), device="cpu", num_kv_blocks=256, draft=str(drafter))
    return ar, fixed, adaptive


CASES = [
    dict(temperature=0, frequency_penalty=0.3),
    dict(temperature=0, presence_penalty=0.6, frequency_penalty=0.1),
    dict(temperature=0, repetition_penalty=1.8),
    dict(temperature=0, logit_bias={6: 0.25, 0: 0.5}, frequency_penalty=0.15),
    dict(temperature=0, min_tokens=12, logit_bias={0: 5.0}, stop_token_ids=[0]),
    dict(temperature=1.0, seed=3, frequency_penalty=0.4),
    dict(temperature=0.7, seed=5, frequency_penalty=0.2, top_p=0.9, logit_bias={6: 1.0}),
    dict(temperature=1.0, seed=11, min_tokens=20, stop_token_ids=[0], repetition_penalty=1.2),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_speculative_equals_plain_with_processors(engines, kw):
    """The constant pair's drafter always proposes token 5, so the penalties make the target
    reject drafts mid-block: a row's processing must count the drafts ahead of it."""
    ar, fixed, adaptive = engines
    p = SamplingParams(max_tokens=40, ignore_eos=True, **kw)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [5, 5]]
    want = [o.token_ids for o in ar.generate(prompts, p)]
    assert any(len(set(w)) > 1 for w in want)  # the processing changes the constant output
    before = fixed.engine.spec_stats.num_accepted_tokens
    for llm in (fixed, adaptive):
        assert [o.token_ids for o in llm.generate(prompts, p)] == want, llm
        assert_no_leaks(llm)
    assert fixed.engine.spec_stats.num_accepted_tokens > before  # drafts were accepted


def test_min_tokens_holds_back_stops(engines):
    ar, fixed, _ = engines
    # token 0 is the stop token and strongly biased: without min_tokens it ends at once
    base = dict(temperature=0, max_tokens=30, logit_bias={0: 5.0}, stop_token_ids=[0])
    assert len(ar.generate([[1, 2]], SamplingParams(**base))[0].token_ids) == 1
    for llm in (ar, fixed):
        out = llm.generate([[1, 2]], SamplingParams(min_tokens=7, **base))[0]
        assert len(out.token_ids) == 8 and out.finish_reason == "stop"
        assert 0 not in out.token_ids[:7]


def test_min_tokens_defers_stop_strings(qwen3_path):
    llm = LLM(str(qwen3_path), device="cpu", num_kv_blocks=64)
    free = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=24,
                                                     ignore_eos=True))[0]
    stop = free.text[:2]  # a stop string the first tokens already contain
    cut = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=24,
                                                    ignore_eos=True, stop=stop))[0]
    assert cut.text == "" and cut.finish_reason == "stop"
    held = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=24,
                                                     ignore_eos=True, stop=stop,
                                                     min_tokens=8))[0]
    assert len(held.token_ids) >= 8 and held.token_ids == free.token_ids[:len(held.token_ids)]


def test_n_samples_offline(engines):
    ar, fixed, _ = engines
    p = SamplingParams(n=4, temperature=1.0, seed=40, max_tokens=16, ignore_eos=True)
    out = ar.generate([[1, 2, 3]], p)[0]
    assert len(out.outputs) == 4 and out.token_ids == out.outputs[0].token_ids
    singles = [ar.generate([[1, 2, 3]], SamplingParams(temperature=1.0, seed=40 + i,
                                                         max_tokens=16, ignore_eos=True))[0]
               for i in range(4)]
    assert [o.token_ids for o in out.outputs] == [s.token_ids for s in singles]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    spec = fixed.generate([[1, 2, 3]], p)[0]
    assert [o.token_ids for o in spec.outputs] == [o.token_ids for o in out.outputs]


def test_tiny_temperature_is_greedy(qwen3_path):
    llm = LLM(str(qwen3_path), device="cpu", num_kv_blocks=64)
    greedy = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=12,
                                                       ignore_eos=True))[0]
    for t in (1e-38, 1e-30, 5e-6):
        out = llm.generate("def f(x):", SamplingParams(temperature=t, max_tokens=12,
                                                        ignore_eos=True))[0]
        assert out.token_ids == greedy.token_ids, t


HF_CASES = [
    dict(repetition_penalty=1.5),
    dict(frequency_penalty=0.9, presence_penalty=0.4),
    dict(logit_bias={7: 4.0, 100: 2.5}, repetition_penalty=0.8),
    dict(min_tokens=6, stop_token_ids=[3], logit_bias={3: 30.0}),
]


@pytest.mark.parametrize("kw", HF_CASES, ids=range(len(HF_CASES)))
def test_greedy_with_processors_matches_hf_reference_loop(qwen3_path, drafter16, hf_model, kw):
    """End to end against a plain loop: HF transformers' forward over the whole sequence each
    step, the numpy reference processing, argmax; with and without a drafter."""
    hf = hf_model(qwen3_path)
    prompt = [5, 17, 33, 17, 90]
    p = SamplingParams(temperature=0, max_tokens=14, **kw)
    eos = tuple(t for t in [hf.config.eos_token_id] if t is not None)
    out: list[int] = []
    with torch.no_grad():
        while len(out) < p.max_tokens:
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].numpy()
            x = reference(logits, prompt, out, p, eos)
            tok = int(np.argmax(x))
            out.append(tok)
            if len(out) >= p.min_tokens and (tok in eos or tok in p.stop_token_ids):
                break
    for draft in (None, str(drafter16)):
        llm = LLM(str(qwen3_path), device="cpu", num_kv_blocks=64, draft=draft)
        assert llm.generate([prompt], p)[0].token_ids == out, draft
    if kw.get("min_tokens"):
        assert len(out) == 7 and out[-1] == 3  # the bias makes 3 win as soon as it may
