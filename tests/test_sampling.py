"""SamplingParams validation, stop conditions, seeds, logprobs, and the sampler's distribution."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch
from helpers import PROMPTS, assert_no_leaks, random_prompts
from safetensors.torch import load_file, save_file

from blockspec import LLM, SamplingParams
from blockspec.config import ConfigError
from blockspec.layers.sampler import SamplingTensors, sample, target_probs


@pytest.fixture(scope="module")
def llm(qwen3_path) -> LLM:
    return LLM(str(qwen3_path), device="cpu", num_kv_blocks=64, kv_block_size=16)


@pytest.fixture(autouse=True)
def _no_leaks_after(request):
    yield
    if "llm" in request.fixturenames:
        assert_no_leaks(request.getfixturevalue("llm"))


def greedy(max_tokens: int = 32, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


# -- validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.1), dict(temperature="hot"),
    dict(top_p=0.0), dict(top_p=1.01), dict(top_p=-0.5), dict(top_p=float("nan")),
    dict(top_k=-2), dict(top_k=2.5),
    dict(min_p=1.5), dict(min_p=-0.1),
    dict(max_tokens=0), dict(max_tokens=-3), dict(max_tokens=2.0),
    dict(stop=""), dict(stop=["ok", ""]), dict(stop=[3]), dict(stop=["ok", None]),
    dict(stop_token_ids=[-1]), dict(stop_token_ids=[1.5]), dict(stop_token_ids=["7"]),
    dict(logprobs=-1), dict(logprobs=1.5),
    dict(seed=1.5), dict(seed="7"),
    dict(temperature=float("inf")), dict(top_p="x"), dict(max_tokens=True), dict(seed=True),
    dict(stop_token_ids=[True]), dict(logprobs=21), dict(seed=2**64), dict(seed=-(2**63) - 1),
], ids=repr)
def test_invalid_sampling_params(kwargs):
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)


def test_nan_temperature_rejected():
    with pytest.raises(ConfigError):
        SamplingParams(temperature=float("nan"))


@pytest.mark.parametrize("kwargs", [
    dict(), dict(temperature=0), dict(top_p=1.0), dict(top_p=0.01), dict(top_k=-1),
    dict(top_k=0), dict(top_k=1), dict(min_p=0.0), dict(min_p=1.0), dict(max_tokens=None),
    dict(max_tokens=1), dict(stop="x"), dict(stop=["a", "bc"]), dict(stop_token_ids=[0, 5]),
    dict(logprobs=0), dict(logprobs=5), dict(seed=0),
], ids=repr)
def test_valid_sampling_params(kwargs):
    sp = SamplingParams(**kwargs)
    assert sp.greedy == (kwargs.get("temperature", 1.0) == 0)


def test_stop_normalisation():
    assert SamplingParams(stop="ab").stop_strs == ["ab"]
    assert SamplingParams(stop=["a", "b"]).stop_strs == ["a", "b"]
    assert SamplingParams().stop_strs == [] and SamplingParams().stop_token_ids == []


# -- stop conditions -------------------------------------------------------------------------------
def _pick_stop_string(text: str, n: int = 3) -> tuple[str, int]:
    """An n-character printable-ASCII substring after the first few characters, and the index of
    its first occurrence in `text`."""
    for j in range(4, len(text) - n):
        s = text[j:j + n]
        if all(c.isascii() and c.isprintable() for c in s) and s.strip():
            return s, text.find(s)
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("prompt,n", [(PROMPTS[0], 3), (PROMPTS[1], 1), (PROMPTS[2], 6),
                                      (PROMPTS[4], 4)])
def test_stop_string(llm, prompt, n):
    full = llm.generate(prompt, greedy(64, ignore_eos=True))[0]
    s, i = _pick_stop_string(full.text, n)
    out = llm.generate(prompt, greedy(64, ignore_eos=True, stop=s))[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", s)
    assert out.text == full.text[:i]
    assert full.token_ids[:len(out.token_ids)] == out.token_ids
    assert len(out.token_ids) < len(full.token_ids)
    decoded = llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert s in decoded and decoded.startswith(out.text)

    kept = llm.generate(prompt, greedy(64, ignore_eos=True, stop=s,
                                       include_stop_str_in_output=True))[0]
    assert kept.text == full.text[:i + len(s)]
    assert kept.token_ids == out.token_ids and kept.stop_reason == s


def test_stop_string_while_streaming(llm):
    """Streamed deltas never show a stop string (or text after it), and add up to the final text."""
    full = llm.generate(PROMPTS[0], greedy(64, ignore_eos=True))[0]
    s, i = _pick_stop_string(full.text, 5)
    eng = llm.engine
    eng.add_request(PROMPTS[0], greedy(64, ignore_eos=True, stop=s))
    streamed, last = "", None
    while eng.has_unfinished():
        for out in eng.step():
            streamed += out.delta_text
            assert out.text == streamed
            assert s not in streamed
            last = out
    assert last.finished and last.stop_reason == s
    assert streamed == last.text == full.text[:i]


def test_earliest_of_several_stop_strings(llm):
    full = llm.generate(PROMPTS[1], greedy(64, ignore_eos=True))[0]
    s, i = _pick_stop_string(full.text)
    later = full.text[i + 8:i + 12]
    assert later and "\ufffd" not in later
    out = llm.generate(PROMPTS[1], greedy(64, ignore_eos=True, stop=[later, s, "\x00never"]))[0]
    assert out.stop_reason == s and out.text == full.text[:i]


def test_stop_token_ids(llm):
    full = llm.generate(PROMPTS[0], greedy(40, ignore_eos=True))[0]
    t = full.token_ids[4]
    first = full.token_ids.index(t)
    out = llm.generate(PROMPTS[0], greedy(40, ignore_eos=True, stop_token_ids=[t]))[0]
    assert out.token_ids == full.token_ids[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", t)
    # As in vLLM, the stop token's own text is left out unless include_stop_str_in_output.
    tok = llm.tokenizer
    assert out.text == tok.decode(out.token_ids[:-1], skip_special_tokens=True)
    kept = llm.generate(PROMPTS[0], greedy(40, ignore_eos=True, stop_token_ids=[t],
                                           include_stop_str_in_output=True))[0]
    assert kept.text == tok.decode(kept.token_ids, skip_special_tokens=True)
    # A stop token that never comes changes nothing.
    unused = next(x for x in range(1, 512) if x not in full.token_ids)
    same = llm.generate(PROMPTS[0], greedy(40, ignore_eos=True, stop_token_ids=[unused]))[0]
    assert same.token_ids == full.token_ids and same.finish_reason == "length"


@pytest.fixture(scope="module")
def eos_pair(llm, qwen3_path, tmp_path_factory):
    """The qwen3 model with token ids 0 (EOS) and t swapped in both the embedding and lm_head: the
    same model under relabelled tokens. A greedy run of the original that emits t as its 5th token
    therefore emits EOS there in the relabelled one, deterministically."""
    prompt = random_prompts([12], seed=21)[0]
    full = llm.generate([prompt], greedy(40, ignore_eos=True))[0].token_ids
    t = full[4]
    assert t != 0 and 0 not in full[:5]
    relabel = lambda ids: [0 if x == t else t if x == 0 else x for x in ids]
    folder = tmp_path_factory.mktemp("eos") / "qwen3-relabelled"
    shutil.copytree(qwen3_path, folder)
    weights = load_file(str(folder / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = weights[name]
        w[[0, t]] = w[[t, 0]].clone()
    save_file(weights, str(folder / "model.safetensors"))
    eos_llm = LLM(str(folder), device="cpu", num_kv_blocks=32, kv_block_size=16)
    return eos_llm, relabel(prompt), relabel(full)


def test_eos_stops_unless_ignored(eos_pair):
    eos_llm, prompt, full = eos_pair
    k = full.index(0)
    assert k <= 4
    out = eos_llm.generate([prompt], greedy(40))[0]
    assert out.token_ids == full[:k + 1] and out.token_ids[-1] == 0
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert out.text == eos_llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert "<|endoftext|>" not in out.text
    ignored = eos_llm.generate([prompt], greedy(40, ignore_eos=True))[0]
    assert ignored.token_ids == full and ignored.finish_reason == "length"
    assert_no_leaks(eos_llm)


def test_eos_in_a_batch_finishes_only_that_request(eos_pair):
    eos_llm, prompt, full = eos_pair
    k = full.index(0)
    later = next(x for x in full[k + 1:] if x not in full[:k + 1])
    outs = eos_llm.generate([prompt, prompt, prompt],
                            [greedy(40), greedy(40, ignore_eos=True),
                             greedy(40, stop_token_ids=[later])])
    assert outs[0].token_ids == full[:k + 1] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == full and outs[1].finish_reason == "length"
    assert outs[2].token_ids == full[:k + 1]  # EOS comes before the stop token
    assert outs[2].stop_reason is None
    assert_no_leaks(eos_llm)


@pytest.mark.parametrize("n", [1, 2, 17])
def test_max_tokens_gives_length(llm, n):
    out = llm.generate(PROMPTS[3], SamplingParams(temperature=0.8, seed=1, max_tokens=n,
                                                  ignore_eos=True))[0]
    assert len(out.token_ids) == n
    assert (out.finish_reason, out.stop_reason) == ("length", None)


# -- seeds, top-k, logprobs ------------------------------------------------------------------------
def test_seeded_sampling_reproducible_and_batch_independent(llm):
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=32, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], sp)[0].token_ids
    again = llm.generate(PROMPTS[0], sp)[0].token_ids
    assert alone == again
    others = [SamplingParams(temperature=0.7, top_k=20, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.3, seed=9, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5)]
    batch = llm.generate([PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[3]],
                         [others[0], others[1], sp, others[2]])
    assert batch[2].token_ids == alone
    twice = llm.generate([PROMPTS[0], PROMPTS[0]], [sp, sp])
    assert twice[0].token_ids == twice[1].token_ids == alone


def test_seeded_sampling_survives_preemption(qwen3_path, llm):
    """Recompute after preemption must not re-draw (or skip) a seeded request's random numbers."""
    prompts = random_prompts([10, 30, 50, 70, 90, 20, 40, 60], seed=22)
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_tokens=30,
                             ignore_eos=True) for i in range(len(prompts))]
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    tight = LLM(str(qwen3_path), device="cpu", num_kv_blocks=16, kv_block_size=16,
                max_num_batched_tokens=64)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == alone
    assert_no_leaks(tight)


def test_different_seeds_differ(llm):
    outs = [llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=s, max_tokens=32,
                                                    ignore_eos=True))[0].token_ids
            for s in (1, 2, 3)]
    assert len({tuple(o) for o in outs}) == 3


def test_sampling_is_not_greedy(llm):
    g = llm.generate(PROMPTS[2], greedy(32, ignore_eos=True))[0].token_ids
    s = llm.generate(PROMPTS[2], SamplingParams(temperature=1.5, seed=5, max_tokens=32,
                                                ignore_eos=True))[0].token_ids
    assert g != s


def test_top_k_1_equals_greedy(llm):
    g = llm.generate(PROMPTS[:3], greedy(24, ignore_eos=True))
    k1 = llm.generate(PROMPTS[:3], SamplingParams(temperature=1.0, top_k=1, seed=3,
                                                  max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in g] == [o.token_ids for o in k1]


def test_tiny_top_p_equals_greedy(llm):
    g = llm.generate(PROMPTS[3], greedy(24, ignore_eos=True))[0]
    p = llm.generate(PROMPTS[3], SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=24,
                                                ignore_eos=True))[0]
    assert g.token_ids == p.token_ids


@pytest.mark.parametrize("k", [0, 1, 5])
def test_logprobs(llm, hf_model, qwen3_path, k):
    sp = SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True, logprobs=k)
    out = llm.generate(PROMPTS[0], sp)[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp
        assert k <= len(lp) <= k + 1
        assert all(v <= 0 and math.isfinite(v) for v in lp.values())
        if k:  # the top-k alternatives are the k best, so none beats them
            best = sorted(lp.values(), reverse=True)[:k]
            assert lp[tok] <= best[0] + 1e-6
    # The first token's logprobs are the raw model's log-softmax at the last prompt position.
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = hf_model(qwen3_path)(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
    for tok, v in out.logprobs[0].items():
        assert v == pytest.approx(ref[tok].item(), abs=1e-4)
    if k:
        assert set(out.logprobs[0]) >= set(ref.topk(k).indices.tolist())


def test_greedy_logprobs_choose_the_best(llm):
    out = llm.generate(PROMPTS[1], greedy(8, ignore_eos=True, logprobs=3))[0]
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert len(lp) == 3 and lp[tok] == max(lp.values())


# -- the sampler's distribution --------------------------------------------------------------------
LOGITS = torch.tensor([1.0, -0.5, 2.0, 0.0, -3.0, 1.5, 0.5, -1.0])  # best: 2, 5, 0, 6, 3, 1, 7, 4
N_DRAWS = 40_000
# Upper 0.1% points of the chi-square distribution, df = 1..7 (for when scipy is missing).
CHI2_CRIT_999 = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322]


def reference_probs(logits: np.ndarray, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """Written independently of blockspec: softmax(logits / T), then keep the top_k best, then the
    smallest prefix (by probability) whose mass reaches top_p, then tokens with at least
    min_p * max probability; renormalise."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros_like(p, dtype=bool)
    kept_mass = 0.0
    for rank, i in enumerate(order):
        if top_k > 0 and rank >= top_k:
            break
        keep[i] = True
        kept_mass += p[i]
        if kept_mass >= top_p * p[order[: (top_k if top_k > 0 else len(p))]].sum():
            break
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    q = np.where(q >= min_p * q.max(), q, 0.0)
    return q / q.sum()


def draw(params: SamplingParams, n: int = N_DRAWS, seed: int = 0) -> np.ndarray:
    vocab = LOGITS.shape[0]
    # NOTE: n requests' first tokens: seeds seed * n ... seed * n + n - 1, output position 0.
    st = SamplingTensors.build([params] * n, list(range(seed * n, seed * n + n)), [0] * n, vocab,
                               torch.device("cpu"))
    tokens = sample(LOGITS.expand(n, vocab).clone(), st)
    return np.bincount(tokens.numpy(), minlength=vocab)


def chi2_rejects(counts: np.ndarray, probs: np.ndarray, alpha: float = 1e-3) -> bool:
    """Chi-square goodness of fit on the support of `probs`; True when the fit is rejected (or when
    there are draws outside the support)."""
    support = probs > 0
    if counts[~support].sum() > 0:
        return True
    obs, exp = counts[support], probs[support] * counts.sum()
    if support.sum() == 1:
        return False
    try:
        from scipy.stats import chisquare
    except ImportError:
        assert alpha == 1e-3
        stat = float(((obs - exp) ** 2 / exp).sum())
        return stat > CHI2_CRIT_999[support.sum() - 2]
    return chisquare(obs, exp).pvalue < alpha


CASES = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=2.0),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.8, top_k=5, top_p=0.9),
    dict(temperature=1.5, top_k=6, top_p=0.95, min_p=0.08),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_sampler_matches_reference_distribution(kw):
    probs = reference_probs(LOGITS.numpy(), **kw)
    counts = draw(SamplingParams(**kw))
    assert counts.sum() == N_DRAWS
    assert counts[probs == 0].sum() == 0, "sampled a token outside the truncated support"
    assert not chi2_rejects(counts, probs), (counts / N_DRAWS, probs)
    # target_probs (used by speculative verification too) agrees exactly with the reference.
    st = SamplingTensors.build([SamplingParams(**kw)], [0], [0], 8, torch.device("cpu"))
    np.testing.assert_allclose(target_probs(LOGITS[None], st)[0].numpy(), probs, atol=1e-6)


def test_reference_truncations_are_not_trivial():
    """The truncation cases above really cut the support (so "no mass outside" means something)."""
    base = (reference_probs(LOGITS.numpy()) > 0).sum()
    assert base == 8
    for kw in CASES[3:]:
        assert 1 < (reference_probs(LOGITS.numpy(), **kw) > 0).sum() < 8, kw


@pytest.mark.parametrize("kw,wrong", [
    (dict(temperature=1.0), dict(temperature=1.15)),
    (dict(temperature=0.5), dict(temperature=1.0)),
    (dict(temperature=1.0, top_k=3), dict(temperature=1.0)),
    (dict(temperature=1.0, top_p=0.7), dict(temperature=1.0, top_k=4)),
])
def test_chi_square_rejects_a_wrong_distribution(kw, wrong):
    """The goodness-of-fit check has power: samples from one setting fail against another."""
    counts = draw(SamplingParams(**kw), seed=1)
    assert not chi2_rejects(counts, reference_probs(LOGITS.numpy(), **kw))
    assert chi2_rejects(counts, reference_probs(LOGITS.numpy(), **wrong))


def test_sampler_greedy_rows_and_mixed_batch():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=2),
              SamplingParams(temperature=0, top_k=3)]
    logits = LOGITS.expand(3, 8).clone()
    for seed in range(50):
        st = SamplingTensors.build(params, [seed] * 3, [0, 1, 2], 8, torch.device("cpu"))
        tok = sample(logits, st).tolist()
        assert tok[0] == 2 and tok[2] == 2 and tok[1] in (2, 5)


def test_a_rows_draw_is_a_function_of_its_seed_and_position_only():
    """The same (seed, position) draws the same token whatever else the batch holds; another
    position or seed draws afresh."""
    vocab = 8
    logits = LOGITS.expand(4, vocab).clone()
    params = [SamplingParams(temperature=1.0)] + [SamplingParams(top_p=0.9)] * 3
    per_position = []
    for pos in range(12):
        seen = set()
        for others in range(5):  # the rest of the batch: other seeds and positions
            st = SamplingTensors.build(params, [77, others, others + 1, 3], [pos, others, 9, 0],
                                       vocab, torch.device("cpu"))
            seen.add(sample(logits, st)[0].item())
        assert len(seen) == 1
        per_position.append(seen.pop())
    assert len(set(per_position)) > 1
    other_seed = SamplingTensors.build(params[:1] * 12, [78] * 12, list(range(12)), vocab, "cpu")
    assert sample(logits[:1].expand(12, vocab), other_seed).tolist() != per_position


def test_tiny_top_p_keeps_the_most_likely_token():
    from blockspec.layers.sampler import SamplingTensors, sample

    logits = torch.tensor([[0.0, 3.0, 1.0, -2.0]])
    for seed in range(20):
        st = SamplingTensors.build([SamplingParams(temperature=1.0, top_p=1e-300)], [seed], [0],
                                   4, "cpu")
        assert sample(logits, st).item() == 1


def test_huge_temperature_with_a_banned_token_has_no_nan():
    """A temperature past fp32's range must not turn a banned (-inf) logit into NaN."""
    logits = torch.tensor([[0.0, float("-inf"), 1.0, 2.0]])
    for t in (1e38, 3.5e38, 1e300):
        st = SamplingTensors.build([SamplingParams(temperature=t)], [1], [0], 4, "cpu")
        from blockspec.layers.sampler import target_probs

        probs = target_probs(logits, st)
        assert not probs.isnan().any() and probs[0, 1] == 0
        assert sample(logits, st).item() != 1
