"""DFlash speculative decoding: lossless greedy and sampled output, stops inside blocks,
acceptance, checkpoint format and pairing errors."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter

import pytest
from helpers import assert_no_leaks, random_prompts
from spec_models import build_constant_pair

from blockspec import LLM, ConfigError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts32():
    lengths = [3 + (i * 37) % 90 for i in range(32)]
    return random_prompts(lengths, seed=11)


@pytest.fixture(scope="module")
def ar_reference(qwen3_path, prompts32):
    llm = LLM(str(qwen3_path), device="cpu", num_kv_blocks=512)
    return [o.token_ids for o in llm.generate(prompts32, GREEDY)]


@pytest.fixture(scope="module")
def const_pair(models_root):
    """Target: i.i.d. tokens with p(5)=0.5, p(6)=0.3, p(0)=0.2 (0 is EOS); drafter proposes 5."""
    return build_constant_pair(models_root, {5: 0.5, 6: 0.3, 0: 0.2}, block_size=8)


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_greedy_identical_to_autoregressive(qwen3_path, drafter16, prompts32, ar_reference,
                                            block_size):
    # NOTE: fixed policy: every step runs the whole block (adaptive: tests/test_policy_engine.py).
    llm = LLM(str(qwen3_path), device="cpu", num_kv_blocks=512, draft=str(drafter16),
              block_size=block_size, speculation_policy="fixed")
    outs = llm.generate(prompts32, GREEDY)
    assert [o.token_ids for o in outs] == ar_reference
    stats = llm.engine.spec_stats
    assert stats.num_steps > 0 and len(stats.drafted_per_position) == block_size - 1
    assert_no_leaks(llm)


def test_greedy_identical_with_preemption_and_prefix_cache(qwen3_path, drafter16, prompts32,
                                                           ar_reference):
    llm = LLM(str(qwen3_path), device="cpu", num_kv_blocks=24, draft=str(drafter16),
              block_size=8, max_num_batched_tokens=256)
    outs = llm.generate(prompts32, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == ar_reference
    assert_no_leaks(llm)
    # Same prompts twice: the second pass is served partly from the prefix cache (target and
    # drafter KV alike), and gives the same tokens.
    llm = LLM(str(qwen3_path), device="cpu", num_kv_blocks=512, draft=str(drafter16),
              block_size=8)
    assert [o.token_ids for o in llm.generate(prompts32, GREEDY)] == ar_reference
    again = llm.generate(prompts32, GREEDY)
    assert sum(o.metrics.num_cached_tokens for o in again) > 0
    assert [o.token_ids for o in again] == ar_reference
    assert_no_leaks(llm)


def test_acceptance_path_reaches_block_size(const_pair):
    target, drafter = const_pair
    llm = LLM(str(target), device="cpu", num_kv_blocks=128, draft=str(drafter),
              speculation_policy="fixed")
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=64,
                                                    ignore_eos=True))[0]
    assert out.token_ids == [5] * 64
    spec = out.metrics.spec
    # Prefill emits the first token; then every block of 8 is accepted whole (tau = 8).
    assert spec.num_steps == math.ceil(63 / 8)
    assert spec.mean_acceptance_length > 7.0
    assert spec.acceptance_rate_per_position == [1.0] * 7


def test_max_tokens_and_eos_inside_accepted_block(const_pair):
    target, drafter = const_pair
    llm = LLM(str(target), device="cpu", num_kv_blocks=128, draft=str(drafter))
    out = llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=5,
                                                 ignore_eos=True))[0]
    assert out.token_ids == [5] * 5 and out.finish_reason == "length"
    stop = llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=20,
                                                  stop_token_ids=[5]))[0]
    assert stop.token_ids == [5] and stop.finish_reason == "stop" and stop.stop_reason == 5
    assert_no_leaks(llm)


def test_sampled_stops_end_at_first_stop_token(const_pair):
    """Token 5 is accepted mid-block; a stop on it must cut the block right after it."""
    target, drafter = const_pair
    llm = LLM(str(target), device="cpu", num_kv_blocks=512, draft=str(drafter))
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=30, ignore_eos=True,
                             stop_token_ids=[6]) for i in range(40)]
    for out in llm.generate([[1, 2, 3]] * 40, params):
        if out.finish_reason == "stop":
            assert out.token_ids[-1] == 6 and 6 not in out.token_ids[:-1]
        else:
            assert len(out.token_ids) == 30 and 6 not in out.token_ids
    eos = llm.generate([[1, 2, 3]] * 40, [SamplingParams(temperature=1.0, seed=i, max_tokens=30)
                                          for i in range(40)])
    for out in eos:  # token 0 is EOS
        assert out.finish_reason == "stop" or len(out.token_ids) == 30
        assert 0 not in out.token_ids[:-1]
    assert_no_leaks(llm)


def test_greedy_stop_token_same_as_autoregressive(qwen3_path, drafter16, prompts32,
                                                  ar_reference):
    stops = [ref[len(ref) // 2] for ref in ar_reference[:8]]
    params = [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[s]) for s in stops]
    ar = LLM(str(qwen3_path), device="cpu", num_kv_blocks=512)
    sp = LLM(str(qwen3_path), device="cpu", num_kv_blocks=512, draft=str(drafter16))
    want = [(o.token_ids, o.finish_reason) for o in ar.generate(prompts32[:8], params)]
    got = [(o.token_ids, o.finish_reason) for o in sp.generate(prompts32[:8], params)]
    assert got == want
    text_ar = ar.generate(prompts32[:8], GREEDY)
    stop_strs = [o.text[len(o.text) // 2:][:3] for o in text_ar]
    sparams = [SamplingParams(temperature=0, max_tokens=24, stop=[s]) for s in stop_strs]
    want = [(o.text, o.token_ids) for o in ar.generate(prompts32[:8], sparams)]
    got = [(o.text, o.token_ids) for o in sp.generate(prompts32[:8], sparams)]
    assert got == want
    assert_no_leaks(sp)


def _chi_square(counts: Counter, probs: dict, n: int) -> float:
    return sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in probs.items())


def test_sampling_is_lossless(const_pair):
    """Temperature 1: the joint law of tokens 2..4 (all decided by verification, with drafts
    accepted about half the time) must be i.i.d. with the target's p. Chi-square over the 27
    outcomes; critical value for 26 dof at p=0.001 is 54.05."""
    target, drafter = const_pair
    p = {5: 0.5, 6: 0.3, 0: 0.2}
    llm = LLM(str(target), device="cpu", num_kv_blocks=2048, draft=str(drafter), seed=3,
              speculation_policy="fixed")
    n = 1500
    outs = llm.generate([[1, 2, 3]] * n, SamplingParams(temperature=1.0, max_tokens=4,
                                                         ignore_eos=True))
    triples = Counter(tuple(o.token_ids[1:4]) for o in outs)
    joint = {(a, b, c): p[a] * p[b] * p[c] for a in p for b in p for c in p}
    assert set(triples) <= set(joint)
    assert _chi_square(triples, joint, n) < 54.05
    stats = llm.engine.spec_stats
    assert 0.4 < stats.acceptance_rate_per_position[0] < 0.6  # P(accept) = p(5)
    # The test can fail: a biased law (drafts always accepted) is rejected.
    biased = {(5, 5, 5): 1.0}
    assert _chi_square(triples, {**{k: 1e-9 for k in joint}, **biased}, n) > 54.05


def test_top_k_applies_to_target(const_pair):
    target, drafter = const_pair
    llm = LLM(str(target), device="cpu", num_kv_blocks=512, draft=str(drafter))
    outs = llm.generate([[1, 2]] * 20, SamplingParams(temperature=1.0, top_k=2, max_tokens=12,
                                                       ignore_eos=True, seed=0))
    assert all(set(o.token_ids) <= {5, 6} for o in outs)


def test_drafter_deterministic(qwen3_path, drafter16, prompts32):
    runs = []
    for _ in range(2):
        llm = LLM(str(qwen3_path), device="cpu", num_kv_blocks=512, draft=str(drafter16))
        outs = llm.generate(prompts32[:6], GREEDY)
        runs.append([(o.token_ids, o.metrics.spec.num_accepted_tokens) for o in outs])
    assert runs[0] == runs[1]


def test_checkpoint_format_and_pairing_errors(models_root, qwen3_path, llama_path, drafter16):
    cfg = json.loads((drafter16 / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert set(cfg["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    from safetensors import safe_open

    with safe_open(str(drafter16 / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.1.mlp.gate_proj.weight", "layers.0.self_attn.k_norm.weight"} <= names
    assert not any(n.startswith(("model.", "embed_tokens", "lm_head")) for n in names)

    # Older layout: mask_token_id / target_layer_ids at top level.
    old = models_root / "drafter-old"
    shutil.copytree(drafter16, old)
    legacy = dict(cfg)
    dflash = legacy.pop("dflash_config")
    legacy.update(dflash)
    (old / "config.json").write_text(json.dumps(legacy))
    LLM(str(qwen3_path), device="cpu", num_kv_blocks=64, draft=str(old))

    def broken(**changes) -> str:
        path = models_root / f"drafter-broken-{len(changes)}-{next(iter(changes))}"
        shutil.copytree(drafter16, path, dirs_exist_ok=True)
        bad = json.loads(json.dumps(cfg))
        for k, v in changes.items():
            if k in ("mask_token_id", "target_layer_ids"):
                bad["dflash_config"][k] = v
            else:
                bad[k] = v
        (path / "config.json").write_text(json.dumps(bad))
        return str(path)

    cases = [
        (dict(architectures=["Qwen3ForCausalLM"]), "not a DFlash drafter"),
        (dict(hidden_size=32), "hidden_size"),
        (dict(target_layer_ids=[0, 99]), "not layers of the target"),
        (dict(mask_token_id=10**6), "mask_token_id"),
    ]
    for changes, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            LLM(str(qwen3_path), device="cpu", num_kv_blocks=64, draft=broken(**changes))
    with pytest.raises(ConfigError, match="block size 32"):
        LLM(str(qwen3_path), device="cpu", num_kv_blocks=64, draft=str(drafter16),
            block_size=32)
    with pytest.raises(ConfigError, match="not a directory"):
        LLM(str(qwen3_path), device="cpu", draft=str(models_root / "nope"))
    with pytest.raises(ConfigError, match="needs a draft model"):
        LLM(str(qwen3_path), device="cpu", block_size=4)


def test_request_outputs_carry_spec_metrics(qwen3_path, drafter16):
    llm = LLM(str(qwen3_path), device="cpu", num_kv_blocks=128, draft=str(drafter16),
              block_size=4, speculation_policy="fixed")
    out = llm.generate([[7, 8, 9]], GREEDY)[0]
    spec = out.metrics.spec
    assert spec.num_steps >= 1 and spec.num_draft_tokens == 3 * spec.num_steps
    assert sum(spec.acceptance_length_hist.values()) == spec.num_steps
    assert 1.0 <= spec.mean_acceptance_length <= 4.0
    assert math.isclose(spec.mean_acceptance_length * spec.num_steps,
                        spec.num_accepted_tokens + spec.num_steps)


def test_synthetic_acceptance_is_benchmark_only(qwen3_path, drafter16, prompts32):
    with pytest.raises(ConfigError, match="benchmark-only"):
        LLM(str(qwen3_path), device="cpu", draft=str(drafter16), synthetic_acceptance=0.8)
    llm = LLM(str(qwen3_path), device="cpu", num_kv_blocks=512, draft=str(drafter16),
              block_size=8, synthetic_acceptance=0.8, benchmark_mode=True,
              speculation_policy="fixed")
    outs = llm.generate(prompts32[:16], SamplingParams(temperature=0, max_tokens=48,
                                                       ignore_eos=True))
    assert all(len(o.token_ids) == 48 for o in outs)
    # E[tau] = sum_{k<B} a^k for i.i.d. per-position acceptance.
    expected = (1 - 0.8**8) / (1 - 0.8)
    assert abs(llm.engine.spec_stats.mean_acceptance_length - expected) < 0.4
    assert_no_leaks(llm)
