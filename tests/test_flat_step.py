"""The flat step (EngineConfig.graph_mixed_steps; on by default with CUDA graphs): a step that is
not all-decode runs its flat batch (prefill chunks, plain decodes, verify blocks) from static
buffers, the function each token bucket's graph captures. Run eagerly here: greedy output stays
the target's, seeded sampling and logprobs are those of the exact-size eager forward, the drafter
sees the same context (lazy or not, with preemption), and the lazy context's counts stay
exact."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_no_leaks,
    cpu_llm,
    force_block_lens,
    greedy_token_ids,
    random_prompts,
    record_drafter,
)
from test_lazy_context import LONG, check_counts

from blockspec import SamplingParams
from blockspec.engine import flat_step
from blockspec.engine.decode_exec import BlockDrafts
from blockspec.engine.flat_exec import FlatForward
from blockspec.engine.flat_step import flat_buckets
from blockspec.engine.mixed_step import MixedStep

# NOTE: lengths that differ, so requests finish apart and later prompts prefill beside
# running decodes and verify blocks (the steps under test).
GREEDY = [SamplingParams(temperature=0, max_tokens=12 + (i * 11) % 37, ignore_eos=True)
          for i in range(8)]


@pytest.fixture(scope="module")
def case(qwen3_path) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, plain greedy decoding's outputs for them)."""
    prompts = random_prompts([3 + (i * 29) % 70 for i in range(8)], seed=13)
    return prompts, greedy_token_ids(qwen3_path, prompts, GREEDY)


def paths(llm) -> dict[str, int]:
    return dict(llm.engine.runner.path_steps)


def mixed_kinds(monkeypatch) -> set[tuple[bool, int, bool]]:
    """What each mixed step ran: (through the flat step, widest block, a prefill chunk in it);
    ("block_drafts", L, True) once the draft step drafted blocks of L in a mixed step."""
    seen: set[tuple] = set()
    original, drafted = MixedStep.__call__, BlockDrafts.__call__

    def recorded(self, seqs, num_new_tokens, blens, *rest):
        flat = len(rest) > 2 and rest[2] is not None
        seen.add((flat, max(blens), 0 in blens))
        return original(self, seqs, num_new_tokens, blens, *rest)

    def drafts(self, seqs, L):
        seen.add(("block_drafts", L, True))
        return drafted(self, seqs, L)

    monkeypatch.setattr(MixedStep, "__call__", recorded)
    monkeypatch.setattr(BlockDrafts, "__call__", drafts)
    return seen


def test_buckets():
    assert flat_buckets(8192) == [32, 64, 128, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536,
                                  2048]
    assert flat_buckets(600) == [32, 64, 128, 256, 320, 384, 512, 600]
    assert flat_buckets(100) == [32, 64, 100]
    assert flat_buckets(16) == []


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "attached"])
@pytest.mark.parametrize("kv", [dict(), dict(num_kv_blocks=12, max_num_batched_tokens=64)],
                         ids=["roomy", "preempting"])
def test_greedy_and_drafter_context_match_the_eager_step(qwen3_path, drafter16, case, lazy, kv,
                                                         monkeypatch):
    prompts, ar_ref = case
    kinds = mixed_kinds(monkeypatch)
    runs = []
    for flat in (True, False):
        llm = cpu_llm(qwen3_path, drafter16, speculation_policy="fixed",
                      lazy_draft_context=lazy, graph_mixed_steps=flat, max_num_seqs=4, **kv)
        force_block_lens(llm, LONG if lazy else [1, 16, 4, 1, 8])
        if lazy:
            check_counts(llm)
        seen = record_drafter(llm)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ar_ref
        assert_no_leaks(llm)
        runs.append((llm, seen))
        assert paths(llm).get("flat" if flat else "eager", 0) > 0
        assert paths(llm).get("eager" if flat else "flat", 0) == 0
    # plain decodes (and, attached, verify blocks) beside prefill chunks, both ways
    for flat in (True, False):
        assert (flat, 1, True) in kinds
        assert lazy or any(f == flat and w >= 2 and pre for f, w, pre in kinds)
    assert lazy or any(k[0] == "block_drafts" for k in kinds)
    (flat_llm, flat_seen), (eager_llm, eager_seen) = runs
    assert flat_llm.engine.spec_stats.block_len_steps == \
        eager_llm.engine.spec_stats.block_len_steps
    assert len(flat_seen) == len(eager_seen) > 0
    for a, b in zip(flat_seen, eager_seen):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("draft", [True, False], ids=["dflash", "plain"])
def test_seeded_sampling_and_logprobs_match(qwen3_path, drafter16, case, draft):
    prompts = case[0]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i, max_tokens=24,
                             logprobs=2, ignore_eos=True, presence_penalty=0.3)
              for i in range(len(prompts))]
    outs = []
    for flat in (True, False):
        llm = cpu_llm(qwen3_path, drafter16 if draft else None, graph_mixed_steps=flat,
                      max_num_seqs=3, **({"speculation_policy": "fixed"} if draft else {}))
        if draft:
            force_block_lens(llm, [16, 1, 4])
        outs.append(llm.generate(prompts, params))
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert [sorted(d) for d in a.logprobs] == [sorted(d) for d in b.logprobs]
        for da, db in zip(a.logprobs, b.logprobs):
            assert all(abs(da[k] - db[k]) < 1e-4 for k in da)


def test_flat_forward_equals_the_exact_eager_forward(qwen3_path, drafter16, case, monkeypatch):
    """Every flat-step forward (buffers padded to all lanes, drafts placed on the device) gives
    the hidden states of the exact-size eager forward of the same batch, and the draft step
    the eager drafter pass's drafts."""
    llm = cpu_llm(qwen3_path, drafter16, speculation_policy="fixed", lazy_draft_context=False,
                  graph_mixed_steps=True, max_num_seqs=4, max_num_batched_tokens=64)
    force_block_lens(llm, [1, 16, 4, 1, 8])
    mixed, original, compared = llm.engine.runner.mixed, FlatForward.__call__, []

    def checked(self, batch, drafts, write_context, width):
        hidden = original(self, batch, drafts, write_context, width)[:len(batch.input_ids)]
        ref = mixed._forward(batch, drafts, write_context)
        torch.testing.assert_close(hidden, ref, atol=1e-5, rtol=1e-5)
        compared.append(len(batch.draft_dst) > 0)
        return hidden

    drafted, draft_lens = BlockDrafts.__call__, []

    def drafts_checked(self, seqs, L):
        out = drafted(self, seqs, L).clone()
        ref = mixed._propose(seqs, [L] * len(seqs), list(range(len(seqs))), L)
        assert torch.equal(out, ref)
        draft_lens.append(L)
        return out

    monkeypatch.setattr(FlatForward, "__call__", checked)
    monkeypatch.setattr(BlockDrafts, "__call__", drafts_checked)
    assert [o.token_ids for o in llm.generate(case[0], GREEDY)] == case[1]
    assert True in compared and False in compared
    assert draft_lens


def test_batches_past_the_largest_bucket_run_eagerly(qwen3_path, drafter16, monkeypatch):
    """A step whose flat batch no bucket holds runs the exact-size eager forward instead, with
    the same output; the others still run the flat step."""
    monkeypatch.setattr(flat_step, "MAX_FLAT_BUCKET", 64)
    prompts = random_prompts([30 + 7 * i for i in range(8)], seed=3)
    llm = cpu_llm(qwen3_path, drafter16, graph_mixed_steps=True, max_num_seqs=4,
                  speculation_policy="fixed")
    force_block_lens(llm, [16, 4, 1])
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == \
        greedy_token_ids(qwen3_path, prompts, GREEDY)
    assert paths(llm).get("eager", 0) >= 1 and paths(llm).get("flat", 0) >= 1
    assert llm.engine.runner.flat.buckets[-1] == 64


def test_prefix_cache_hits_and_n_samples_match(qwen3_path, drafter16):
    """Chunks that start mid-prompt (prefix-cache hits) and n = 2 samples per request give the
    same outputs through the flat step as through the exact-size eager forward."""
    shared = random_prompts([40], seed=21)[0]
    prompts = [shared + tail for tail in random_prompts([3, 9, 17, 30, 5], seed=22)]
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
    outs = []
    for flat in (True, False):
        llm = cpu_llm(qwen3_path, drafter16, graph_mixed_steps=flat, max_num_seqs=3,
                      speculation_policy="fixed")
        force_block_lens(llm, [4, 16, 1])
        got = llm.generate(prompts, params)
        assert sum(o.metrics.num_cached_tokens for o in got) > 0  # the later prompts hit
        outs.append([[s.token_ids for s in o.samples or [o]] for o in got])
        assert_no_leaks(llm)
    assert outs[0] == outs[1]
