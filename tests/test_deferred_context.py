"""Deferred drafter-context writes of plain decode steps (ContextStaging): the drafter sees
exactly the context that immediate writes give it, the staging overflows cleanly, and a staged
row never writes into a block that another sequence now owns, while a finished sequence's rows
still complete its prefix-cached blocks."""

from __future__ import annotations

import itertools

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

from blockspec import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Long plain streaks between speculative steps (10 in a row: overflows a 2-sequence staging).
PLAIN_HEAVY = [1, 1, 1, 4, 1, 1, 16, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 8]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([3 + (i * 29) % 70 for i in range(8)], seed=11)


@pytest.fixture(scope="module")
def ar_ref(qwen3_path, prompts):
    return greedy_token_ids(qwen3_path, prompts, GREEDY)


def spec_llm(qwen3_path, drafter16, **kw) -> LLM:
    return cpu_llm(qwen3_path, drafter16, **{"speculation_policy": "fixed", **kw})


def drafter_rows(llm: LLM, slots: list[int]) -> torch.Tensor:
    return llm.engine.runner.proposer.kv_cache.flatten(2, 3)[:, :, slots].clone()


def reference_context(qwen3_path, drafter16, tokens: list[int]) -> torch.Tensor:
    """The drafter context K/V that one prefill of `tokens` writes."""
    ref = spec_llm(qwen3_path, drafter16, enable_prefix_caching=False)
    rid = ref.engine.add_request(tokens + [1], SamplingParams(temperature=0, max_tokens=2))
    ref.engine.step()
    seq = ref.engine.requests[rid].seq
    assert seq.num_computed_tokens == len(tokens) + 1
    rows = drafter_rows(ref, [ref.engine.block_manager.slot(seq, p) for p in range(len(tokens))])
    ref.engine.abort(rid)
    return rows


def plain_heavy_run(qwen3_path, drafter16, prompts, ar_ref, kv: dict, defer: bool) -> tuple:
    """Greedy run under PLAIN_HEAVY; `defer=False`: plain steps write their context at once."""
    llm = spec_llm(qwen3_path, drafter16, **kv)
    force_block_lens(llm, PLAIN_HEAVY)
    r = llm.engine.runner
    r.steps[1].defer_context = defer
    overflows, stage = [], r.staging.stage

    def counted(taps, positions, blocks, seqs=None):
        overflows.append(len(r.staging) + len(positions) > r.staging.capacity)
        stage(taps, positions, blocks, seqs)

    r.staging.stage = counted
    seen = record_drafter(llm)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ar_ref
    assert_no_leaks(llm)
    return (seen, dict(llm.engine.spec_stats.block_len_steps), overflows, r.staging.num_flushes,
            llm.engine.scheduler.num_preemptions)


@pytest.mark.parametrize("kv", [dict(),
                                dict(num_kv_blocks=12, max_num_batched_tokens=64),
                                dict(max_num_seqs=2)],
                         ids=["roomy", "preempting", "overflowing"])
def test_drafter_sees_what_immediate_writes_give(qwen3_path, drafter16, prompts, ar_ref, kv):
    """Same run with deferred and with immediate plain-step context writes: every drafter
    forward sees the same context (so drafts, acceptance and scheduling match), with chunked
    prefill, preemption, sequences finishing with staged rows, and staging overflow."""
    runs = [plain_heavy_run(qwen3_path, drafter16, prompts, ar_ref, kv, defer)
            for defer in (True, False)]
    (deferred, steps_d, overflows, flushes, preempted), (immediate, steps_i, unused, *_) = runs
    assert steps_d == steps_i and set(steps_d) == {1, 4, 8, 16}
    assert len(deferred) == len(immediate) > 0 and flushes > 0 and not unused
    for a, b in zip(deferred, immediate):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if "num_kv_blocks" in kv:
        assert preempted > 0
    assert any(overflows) == ("max_num_seqs" in kv)


def test_stale_row_goes_to_trash_not_to_the_blocks_new_owner(qwen3_path, drafter16):
    """A finishes with staged rows; B gets A's freed blocks (3 blocks in all) and writes its own
    context at the very slots of A's rows; the flush must leave B's context alone."""
    llm = spec_llm(qwen3_path, drafter16, num_kv_blocks=3, block_size=4)
    r, bm = llm.engine.runner, llm.engine.block_manager
    r.set_policy("fixed", 1)
    a, b = random_prompts([20, 40], seed=3)
    llm.generate([a], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    st = r.staging
    assert sorted(st.positions) == list(range(20, 31))  # its plain steps, all still staged
    a_slots = {blk * bm.block_size + p % bm.block_size for blk, p in zip(st.blocks, st.positions)}
    rid = llm.engine.add_request(b, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    llm.engine.step()  # B's prefill: a mixed step, which does not flush
    seq_b = llm.engine.requests[rid].seq
    b_slots = {bm.slot(seq_b, p) for p in range(seq_b.num_computed_tokens)}
    assert len(st) == 11 and a_slots <= b_slots  # A's rows point at B's written context
    assert all(bm.generation[blk] != g for blk, g in zip(st.blocks, st.generations))
    cache = r.proposer.kv_cache
    before, trash = cache[:, :, :bm.num_blocks].clone(), cache[:, :, r.trash_block].clone()
    r.flush_context()
    assert len(st) == 0
    assert torch.equal(cache[:, :, :bm.num_blocks], before)
    assert not torch.equal(cache[:, :, r.trash_block], trash)  # where A's rows went
    llm.engine.abort(rid)
    assert_no_leaks(llm)


def test_finished_rows_complete_its_prefix_cached_blocks(qwen3_path, drafter16):
    """A finishes with staged rows in blocks the prefix cache keeps; B's prompt is A's whole
    text, so B revives those blocks: after the flush they hold the full drafter context (no
    holes where A's last plain steps were)."""
    llm = spec_llm(qwen3_path, drafter16)
    r, bm = llm.engine.runner, llm.engine.block_manager
    r.set_policy("fixed", 1)
    (a,) = random_prompts([30], seed=4)
    out = llm.generate([a], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    tokens = a + out.token_ids
    assert len(r.staging) == 19
    rid = llm.engine.add_request(tokens, SamplingParams(temperature=0, max_tokens=2))
    llm.engine.step()  # B's prefill of its last 2 tokens (a mixed step: no flush)
    seq_b = llm.engine.requests[rid].seq
    assert seq_b.metrics.num_cached_tokens == 48 and len(r.staging) == 19
    r.flush_context()
    n = len(tokens)
    got = drafter_rows(llm, [bm.slot(seq_b, p) for p in range(n)])
    torch.testing.assert_close(got, reference_context(qwen3_path, drafter16, tokens),
                               atol=1e-4, rtol=1e-4)
    llm.engine.abort(rid)
    assert_no_leaks(llm)


def test_flush_never_changes_another_sequences_context(qwen3_path, drafter16, prompts, ar_ref):
    """Under preemption (tiny cache), flush every third step and check that no slot of a running
    sequence's computed positions changes, except those its own valid staged rows fill."""
    llm = spec_llm(qwen3_path, drafter16, num_kv_blocks=12, max_num_batched_tokens=64)
    force_block_lens(llm, [1, 1, 1, 1, 1, 1, 1, 1, 1, 4])
    r, bm, sched = llm.engine.runner, llm.engine.block_manager, llm.engine.scheduler
    st, execute, calls, stale = r.staging, r.execute, itertools.count(), []

    def checked(seqs, num_new_tokens, *rest):
        if next(calls) % 3 == 2:
            valid = {blk * bm.block_size + p % bm.block_size
                     for blk, g, p in zip(st.blocks, st.generations, st.positions)
                     if bm.generation[blk] == g}
            stale.append(sum(bm.generation[blk] != g for blk, g in zip(st.blocks,
                                                                        st.generations)))
            kept = sorted({bm.slot(s, p) for s in sched.running
                           for p in range(s.num_computed_tokens)} - valid)
            before = drafter_rows(llm, kept)
            r.flush_context()
            assert torch.equal(drafter_rows(llm, kept), before)
        return execute(seqs, num_new_tokens, *rest)

    r.execute = checked
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ar_ref
    assert sched.num_preemptions > 0 and sum(stale) > 0
    assert_no_leaks(llm)


def test_cost_profile_prices_the_deferred_write(qwen3_path, drafter16, monkeypatch):
    """The plain step's profiled cost includes its share of the batched context write, and the
    profile key carries the step version (a profile of the old plain step is not loaded)."""
    from blockspec.engine import cost_profile

    llm = spec_llm(qwen3_path, drafter16, speculation_policy="adaptive")
    r = llm.engine.runner
    flushes = r.staging.num_flushes  # the profile's own, at start-up
    assert flushes > 0 and len(r.staging) == 0
    assert cost_profile._time_flush(r, 4, 64) > 0
    assert len(r.staging) == 0 and r.staging.num_flushes == flushes + 4
    monkeypatch.setattr(cost_profile, "_time_flush", lambda runner, n, ctx: 1.0)
    info = spec_llm(qwen3_path, drafter16, speculation_policy="adaptive") \
        .engine.runner.cost_profile_info
    assert info["measured"] and info["key"]["steps"] == cost_profile.STEP_VERSION
    assert all(t > 1.0 for t in info["times"]["1"].values())
    assert all(t < 1.0 for t in info["times"]["4"].values())
