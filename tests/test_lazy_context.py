"""Lazy drafter context (lazy_draft_context, on by default with the adaptive policy): after
DETACH_AFTER plain choices, or at a load where the policy would decode plainly, the engine runs no
drafter work at all, and catches the drafter's context up before it next drafts. Greedy output
stays the target's; the caught-up drafter pool is what one prefill writes (and would not be
without the catch-up); the drafter sees the same context as without detaching; the
per-sequence counts stay exact; detached steps write and stage nothing."""

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

from blockspec import LLM, ConfigError, SamplingParams
from blockspec.cli import build_parser, engine_kwargs
from blockspec.engine.lazy_context import DETACH_AFTER
from blockspec.policy.step_context import StepContext

GREEDY = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)
# Long plain streaks (detaching after 64), speculative steps after them, short streaks too.
LONG = [1] * 70 + [16] + [1] * 3 + [4] + [1] * 66 + [8]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([3 + (i * 29) % 70 for i in range(6)], seed=13)


@pytest.fixture(scope="module")
def ar_ref(qwen3_path, prompts):
    return greedy_token_ids(qwen3_path, prompts, GREEDY)


def spec_llm(qwen3_path, drafter16, **kw) -> LLM:
    return cpu_llm(qwen3_path, drafter16,
                   **{"speculation_policy": "fixed", "lazy_draft_context": True, **kw})


def check_counts(llm: LLM) -> dict[str, int]:
    """Wrap execute: before each step every scheduled sequence's count is at most its computed
    tokens, and whenever the drafter runs, every decoding sequence of the step (all of them
    draft) has a complete context. Returns counts of mixed steps run attached / detached."""
    r, execute, mixed = llm.engine.runner, llm.engine.runner.execute, {}
    step_seqs: list = []

    def checked(seqs, num_new_tokens, ctx):
        assert all(s.num_draft_ctx_tokens <= s.num_computed_tokens for s in seqs)
        step_seqs[:] = seqs
        res = execute(seqs, num_new_tokens, ctx)
        if any(s.num_computed_tokens < s.num_tokens - 1 for s in seqs):  # a prefill chunk
            key = "detached" if r.lazy.detached else "attached"
            mixed[key] = mixed.get(key, 0) + 1
        return res

    def complete(module, args):  # NOTE: the invariant
        for s in step_seqs:
            if s.num_computed_tokens == s.num_tokens - 1:
                assert s.num_draft_ctx_tokens == s.num_computed_tokens

    r.execute = checked
    r.proposer.drafter.register_forward_pre_hook(complete)
    return mixed


@pytest.mark.parametrize("kv", [dict(), dict(num_kv_blocks=12, max_num_batched_tokens=64)],
                         ids=["roomy", "preempting"])
def test_greedy_identical_and_drafter_sees_same_context(qwen3_path, drafter16, prompts,
                                                        ar_ref, kv):
    """Same forced schedule with and without lazy context (chunked prefill and recompute
    preemption in the small cache): the target's output, and every drafter forward sees the
    same context, so drafts and acceptance match."""
    runs, mixed = [], {}
    for lazy in (True, False):
        llm = spec_llm(qwen3_path, drafter16, lazy_draft_context=lazy, **kv)
        force_block_lens(llm, LONG)
        mixed = check_counts(llm) if lazy else mixed
        seen = record_drafter(llm)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ar_ref
        assert_no_leaks(llm)
        runs.append((llm, seen))
    (lazy_llm, lazy_seen), (eager_llm, eager_seen) = runs
    lz = lazy_llm.engine.runner.lazy
    assert lz.num_catchups > 0 and lz.num_catchup_tokens > 0 and lz.num_detached_steps > 0
    assert lz.catchup_seconds > 0
    assert lazy_llm.engine.spec_stats.block_len_steps == eager_llm.engine.spec_stats \
        .block_len_steps
    assert len(lazy_seen) == len(eager_seen) > 0
    for a, b in zip(lazy_seen, eager_seen):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    if "num_kv_blocks" in kv:  # recompute prefills, some of them while detached
        assert lazy_llm.engine.scheduler.num_preemptions > 0 and mixed.get("detached", 0) > 0


def reference_context(qwen3_path, drafter16, tokens: list[int]) -> torch.Tensor:
    ref = spec_llm(qwen3_path, drafter16, lazy_draft_context=False, enable_prefix_caching=False)
    rid = ref.engine.add_request(tokens + [1], SamplingParams(temperature=0, max_tokens=2))
    ref.engine.step()  # one prefill of all the tokens
    seq = ref.engine.requests[rid].seq
    slots = [ref.engine.block_manager.slot(seq, p) for p in range(len(tokens))]
    rows = ref.engine.runner.proposer.kv_cache.flatten(2, 3)[:, :, slots].clone()
    ref.engine.abort(rid)
    return rows


@pytest.mark.parametrize("skip", [False, True], ids=["caught-up", "catch-up-skipped"])
def test_catch_up_writes_what_a_prefill_writes(qwen3_path, drafter16, skip):
    """Synthetic acceptance (several tokens per step); detached plain steps, then a
    speculative step: right after its catch-up the drafter pool holds, for every computed
    token, what one prefill writes. Skipping the catch-up's writes must break that."""
    (prompt,) = random_prompts([21], seed=9)
    llm = spec_llm(qwen3_path, drafter16, synthetic_acceptance=0.7, benchmark_mode=True,
                   enable_prefix_caching=False)
    force_block_lens(llm, [4] * 3 + [1] * (DETACH_AFTER + 10) + [16])
    r, lz = llm.engine.runner, llm.engine.runner.lazy
    if skip:
        lz.catch_up = lambda seqs: None
    rid = llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=200,
                                                        ignore_eos=True))
    seq = llm.engine.requests[rid].seq
    snapshots = []

    def snap(module, args):  # the drafter is about to run: what context does it see?
        if lz.num_detached_steps and not snapshots:
            n = seq.num_computed_tokens
            slots = [llm.engine.block_manager.slot(seq, p) for p in range(n)]
            snapshots.append((seq.token_ids()[:n],
                              r.proposer.kv_cache.flatten(2, 3)[:, :, slots].clone()))

    r.proposer.drafter.register_forward_pre_hook(snap)
    for _ in range(1 + 3 + DETACH_AFTER + 10 + 1):  # prefill, 4s, plain steps, the 16
        llm.engine.step()
    assert lz.num_detached_steps == 10 and not lz.detached and len(snapshots) == 1
    tokens, got = snapshots[0]
    want = reference_context(qwen3_path, drafter16, tokens)
    if skip:
        assert not torch.allclose(got, want, atol=1e-3, rtol=1e-3)
    else:
        assert lz.num_catchups == 1 and lz.num_catchup_tokens == 10
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    llm.engine.abort(rid)
    assert_no_leaks(llm)


def test_detached_steps_run_no_drafter_work(qwen3_path, drafter16, prompts):
    """Plain steps only: after DETACH_AFTER of them, no context write, no staged row, no
    drafter forward; before, the plain steps stage and the flush counts them written. (The
    policy itself would speculate, so the load rule does not detach at the prefill.)"""
    llm = spec_llm(qwen3_path, drafter16)
    r = llm.engine.runner
    force_block_lens(llm, [1])
    lz, st = r.lazy, r.staging
    writes, stage, write = [], st.stage, r.proposer.write_context
    r.proposer.write_context = lambda *a: (writes.append(lz.detached), write(*a))
    st.stage = lambda *a: (writes.append(lz.detached), stage(*a))
    drafts = record_drafter(llm)
    rid = llm.engine.add_request(prompts[1], SamplingParams(temperature=0, max_tokens=120,
                                                            ignore_eos=True))
    seq = llm.engine.requests[rid].seq
    for _ in range(DETACH_AFTER + 1):  # the prefill, then DETACH_AFTER plain steps
        llm.engine.step()
    assert not lz.detached and len(st) > 0
    counted = seq.num_draft_ctx_tokens
    assert counted < seq.num_computed_tokens  # staged rows are not counted as written
    llm.engine.step()  # the streak passes DETACH_AFTER: flush, then detach
    assert lz.detached and len(st) == 0 and lz.num_detached_steps == 1
    assert seq.num_draft_ctx_tokens == seq.num_computed_tokens - 1  # all but this step's token
    n_writes = len(writes)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert lz.num_detached_steps == 120 - 1 - DETACH_AFTER
    # The step mix (bench offline's) tells detached plain steps from attached ones.
    mix = llm.engine.step_mix.cells
    assert mix["detached", 1][0] == lz.num_detached_steps
    assert mix["decode", 1][0] == DETACH_AFTER
    assert len(writes) == n_writes and not any(writes) and not drafts
    assert lz.num_catchups == 0 and len(st) == 0
    assert_no_leaks(llm)


def test_prefix_hit_starts_without_context_and_is_caught_up(qwen3_path, drafter16):
    """A sequence admitted with prefix-cache blocks starts at 0 drafter-context tokens (the
    blocks may have been filled while detached); its first drafting step catches all up."""
    llm = spec_llm(qwen3_path, drafter16)
    r = llm.engine.runner
    (a,) = random_prompts([40], seed=4)
    force_block_lens(llm, [1])
    llm.generate([a], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    force_block_lens(llm, [4])
    rid = llm.engine.add_request(a + [7, 8], SamplingParams(temperature=0, max_tokens=3,
                                                            ignore_eos=True))
    seq = llm.engine.requests[rid].seq
    llm.engine.step()  # prefill of the uncached tail
    assert seq.metrics.num_cached_tokens == 32 and seq.num_draft_ctx_tokens == 0
    llm.engine.step()  # drafts: catch-up of all 42 tokens first
    assert r.lazy.num_catchup_tokens == 42
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert_no_leaks(llm)


def test_config_and_cli(qwen3_path, drafter16):
    """On by default with the adaptive policy, off with the fixed one, either way on request."""
    def lazy(**kw):
        return LLM(str(qwen3_path), device="cpu", num_kv_blocks=64, draft=str(drafter16),
                   cost_profile="none", **kw).engine.runner.lazy

    assert lazy() is not None and lazy(lazy_draft_context=False) is None
    assert lazy(speculation_policy="fixed") is None
    assert lazy(speculation_policy="fixed", lazy_draft_context=True) is not None
    assert LLM(str(qwen3_path), device="cpu", num_kv_blocks=64).engine.config \
        .use_lazy_draft_context is False  # no drafter
    with pytest.raises(ConfigError, match="needs a draft model"):
        LLM(str(qwen3_path), device="cpu", lazy_draft_context=True)
    with pytest.raises(ConfigError, match="true, false or None"):
        spec_llm(qwen3_path, drafter16, lazy_draft_context="yes")
    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "x", "--lazy-draft-context"])
    assert engine_kwargs(args)["lazy_draft_context"] is True
    args = parser.parse_args(["generate", "--prompt", "x", "--no-lazy-draft-context"])
    assert engine_kwargs(args)["lazy_draft_context"] is False
    args = parser.parse_args(["generate", "--prompt", "x"])
    assert engine_kwargs(args)["lazy_draft_context"] is None


def test_probe_pays_the_catch_up(qwen3_path, drafter16):
    """Detached, the policy's probe budget includes the catch-up: a catch-up priced at ~0 s
    per token lets the probe through, a dear one holds it back. (A probe costs 0.5 plain steps
    more, and its catch-up at least one plain step: affordable after 300 plain steps.)"""
    from blockspec.policy.policy import StepCostModel

    llm = spec_llm(qwen3_path, drafter16, speculation_policy="adaptive",
                   block_sizes=(4, 8, 16))  # NOTE: the costs below are for these
    r = llm.engine.runner
    r.set_cost_model(StepCostModel({L: {1: 1e-3 * t, 64: 1e-3 * t}
                                    for L, t in {1: 1.0, 4: 1.5, 8: 5.0, 16: 9.0}.items()}))
    ctl = r.controller
    for price, probes in ((1e-9, True), (1.0, False)):
        for _ in range(20):  # evidence: the first draft is never accepted
            ctl.tracker.observe_many([3] * 4, [0] * 4)
        r.lazy.seconds_per_token = price
        llm.engine.spec_stats.block_len_steps.clear()
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=360,
                                                 ignore_eos=True))
        assert (4 in llm.engine.spec_stats.block_len_steps) == probes
        assert r.lazy.num_detached_steps > 0
    assert_no_leaks(llm)


def test_return_to_speculation_pays_the_catch_up(qwen3_path, drafter16):
    """Two requests decode with plain steps (at B = 2 a verify is dear) and detach; once the
    shorter one finishes, the longer one alone would speculate (cheap at B = 1), but only if
    its catch-up is repaid by the tokens it has left: a dear catch-up keeps it on plain decode
    (no drafter work to the end), a cheap one lets it catch up and speculate."""
    from blockspec.policy.policy import StepCostModel

    llm = spec_llm(qwen3_path, drafter16, speculation_policy="adaptive",
                   block_sizes=(4, 8, 16))  # NOTE: the costs below are for these
    r = llm.engine.runner
    ms = {1: (1.0, 1.0), 4: (1.2, 5.0), 8: (5.0, 9.0), 16: (9.0, 17.0)}  # (B=1, B=2)
    r.set_cost_model(StepCostModel({L: {1: 1e-3 * a, 2: 1e-3 * b} for L, (a, b) in ms.items()}))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (150, 100)]
    for price, speculates in ((1.0, False), (1e-9, True)):
        r.controller.reset_acceptance()  # the prior (0.8): block 4 wins at B = 1 by 2.4x
        r.lazy.seconds_per_token = price
        catchups = r.lazy.num_catchups
        llm.engine.spec_stats.block_len_steps.clear()
        llm.generate(random_prompts([5, 7], seed=3), params)
        steps = llm.engine.spec_stats.block_len_steps
        assert (set(steps) != {1}) == speculates, steps
        assert (r.lazy.num_catchups > catchups) == speculates
        assert r.lazy.num_detached_steps > 0
    assert_no_leaks(llm)


def test_load_rule_detaches_before_the_prefills(qwen3_path, drafter16, prompts, ar_ref):
    """Six requests at once, chunked prefill: at a load of 6 a verify is dear, so the engine
    detaches before the first prefill writes any drafter context, and stays detached while
    the batch fills (priced at the load, not at the few sequences already decoding). As
    requests finish and the load falls, the switch is priced; output stays the target's."""
    from blockspec.policy.policy import StepCostModel

    llm = spec_llm(qwen3_path, drafter16, speculation_policy="adaptive", block_sizes=(4, 8, 16),
                   max_num_batched_tokens=96, max_num_seqs=6)
    r = llm.engine.runner
    # ms at B = 1, 3, 6: at 2-3 decoding sequences block 4 would pay (the prior: 2.95 tokens
    # per step), at 6 plain decode wins.
    ms = {1: (1.0, 1.0, 1.0), 4: (1.2, 1.3, 9.0), 8: (5.0, 6.0, 17.0), 16: (9.0, 10.0, 33.0)}
    r.set_cost_model(StepCostModel({L: dict(zip((1, 3, 6), (1e-3 * t for t in ts)))
                                    for L, ts in ms.items()}))
    ctx, write = [], r.proposer.write_context
    r.proposer.write_context = lambda *a: (ctx.append(1), write(*a))
    decoding_steps = []
    execute = r.execute

    def spy(seqs, num_new_tokens, ctx):
        n_dec = sum(n == 1 and s.num_computed_tokens == s.num_tokens - 1
                    for s, n in zip(seqs, num_new_tokens))
        res = execute(seqs, num_new_tokens, ctx)
        decoding_steps.append((n_dec, ctx.num_unfinished, r.lazy.detached))
        return res

    r.execute = spy
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ar_ref
    assert not ctx  # no prefill or plain step wrote drafter context
    ramp = [d for d in decoding_steps if 0 < d[0] < d[1]]
    assert any(n_dec in (2, 3) for n_dec, _, _ in ramp)
    assert ramp and all(detached for _, _, detached in ramp)
    assert set(llm.engine.spec_stats.block_len_steps) == {1}
    assert r.lazy.num_catchups == 0
    assert_no_leaks(llm)


def test_set_policy_starts_attached(qwen3_path, drafter16, prompts):
    """A benchmark switching a detached engine to a fixed block: the next run's prefills write
    the drafter context (no catch-up inside the run), as in a fresh engine."""
    llm = spec_llm(qwen3_path, drafter16, speculation_policy="adaptive")
    r = llm.engine.runner
    r.set_policy("fixed", 1)
    llm.generate(prompts[:2], GREEDY)  # 90 plain steps: detaches after DETACH_AFTER
    assert r.lazy.detached
    r.set_policy("fixed", 4)
    assert not r.lazy.detached and r.lazy.plain_streak == 0
    catchups = r.lazy.num_catchups
    llm.generate(prompts[2:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert r.lazy.num_catchups == catchups
    assert set(llm.engine.spec_stats.block_len_steps) == {1, 4}
    assert_no_leaks(llm)


def test_load_rule_reattaches_for_new_prefills(qwen3_path, drafter16, prompts, ar_ref):
    """Detached at a load where plain decode won, then the policy's view at the load turns to
    speculation (e.g. the live step overhead it learned) while the running requests' catch-up
    stays too dear to pay: requests admitted from then on get their drafter context as they
    prefill (no gap), and the runner speculates once the gapped requests are done. The output
    stays the target's."""
    from blockspec.policy.policy import StepCostModel

    llm = spec_llm(qwen3_path, drafter16, speculation_policy="adaptive", block_sizes=(4, 8, 16),
                   max_num_batched_tokens=96, max_num_seqs=6)
    eng, r = llm.engine, llm.engine.runner
    r.set_cost_model(StepCostModel({1: {1: 1e-3}, 4: {1: 9e-3}, 8: {1: 17e-3},
                                    16: {1: 33e-3}}))  # plain decode wins everywhere
    ids = [eng.add_request(p, GREEDY) for p in prompts[:3]]
    while not r.lazy.detached or eng.scheduler.waiting:
        eng.step()
    for _ in range(40):  # NOTE: fewer plain steps left than DETACH_AFTER when the rest arrive
        eng.step()
    r.set_cost_model(StepCostModel({L: {1: 1e-3} for L in (1, 4, 8, 16)}))  # speculation wins
    r.lazy.seconds_per_token = 1.0  # ... but not at the price of a catch-up
    later = {eng.add_request(p, GREEDY) for p in prompts[3:]}
    ids += sorted(later, key=int)
    whole_at_first_decode, execute = {}, r.execute

    def spy(seqs, num_new_tokens, *rest):
        for s in seqs:
            if s.request_id in later and s.num_computed_tokens == s.num_tokens - 1:
                whole_at_first_decode.setdefault(
                    s.request_id, s.num_draft_ctx_tokens == s.num_computed_tokens)
        return execute(seqs, num_new_tokens, *rest)

    r.execute = spy
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert [outs[i] for i in ids] == ar_ref
    assert r.lazy.num_reattaches == 1 and r.lazy.num_catchups == 0
    assert whole_at_first_decode == {i: True for i in later}
    assert set(eng.spec_stats.block_len_steps) > {1}
    assert_no_leaks(llm)


def test_load_rule_follows_the_policys_choice(qwen3_path, drafter16):
    """The load rule detaches wherever the policy's choice at the load is plain decode, also
    where the best block's modelled gain is above 1.0 but under the policy's min_gain (kept
    attached, the prefills would write drafter context for a speculation the policy does not
    take), and re-attaches once the choice at the load is a block."""
    llm = spec_llm(qwen3_path, drafter16, speculation_policy="adaptive")
    lz = llm.engine.runner.lazy

    class View:  # the policy's view at the load (SpecController.explain)
        mode = "adaptive"

        def __init__(self, choice: int, gain: float) -> None:
            self.view = {"mode": "adaptive", "choice": choice, "gain": gain}

        def explain(self, batch_size: int, drain=None) -> dict:
            return self.view

    load = StepContext(num_unfinished=6)
    assert not lz.detached
    assert lz.policy_batch(0, load, View(4, 1.05)) == 0
    assert not lz.detached and lz.load_wants_drafter
    assert lz.policy_batch(0, load, View(1, 1.02)) == 6  # detached: priced at the load
    assert lz.detached and not lz.load_wants_drafter
    assert lz.policy_batch(2, load, View(4, 1.05)) == 2
    assert not lz.detached and lz.num_reattaches == 1
    # No load beyond the decoding batch: the rule leaves the state alone.
    assert lz.policy_batch(6, load, View(1, 0.5)) == 6 and not lz.detached
    assert_no_leaks(llm)
