"""The speculation policy inside the engine: lossless greedy output whatever block length each
step runs, target and drafter KV consistent across block-length changes (plain steps included),
the choices under forced step costs, fixed mode, and the benchmark hooks."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import (
    assert_no_leaks,
    count_block_len_steps,
    cpu_llm,
    force_block_lens,
    greedy_token_ids,
    random_prompts,
)
from spec_models import build_constant_pair

from blockspec import LLM, ConfigError, SamplingParams
from blockspec.policy.mixed_block import mixed_block_len
from blockspec.policy.policy import AcceptanceTracker, SpeculationPolicy, StepCostModel

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Covers every change between 1, 2, 4, 8, 16.
CYCLE = [1, 4, 16, 8, 1, 1, 16, 4, 8, 8, 1, 16, 2, 2, 8, 2, 1, 2, 16, 2, 4, 2]


@pytest.fixture(scope="module")
def drafter(drafter16):
    return drafter16


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([3 + (i * 29) % 70 for i in range(12)], seed=5)


@pytest.fixture(scope="module")
def ar_ref(qwen3_path, prompts):
    return greedy_token_ids(qwen3_path, prompts, GREEDY)


def spec_llm(qwen3_path, drafter, **kw) -> LLM:
    return cpu_llm(qwen3_path, drafter, **kw)


def force_cycle(llm: LLM, cycle: list[int] = CYCLE) -> None:
    force_block_lens(llm, cycle)


def flat_costs(ms: dict[int, float], buckets=(1, 64)) -> StepCostModel:
    """The same step time at every batch size, per block length."""
    return StepCostModel({L: {b: t / 1e3 for b in buckets} for L, t in ms.items()})


def test_defaults_and_config(qwen3_path, drafter):
    llm = spec_llm(qwen3_path, drafter)
    r = llm.engine.runner
    assert llm.engine.config.speculation_policy == "adaptive"
    assert r.spec_lens == [2, 4, 8, 16] and sorted(r.steps) == [1, 2, 4, 8, 16]
    assert llm.engine.spec_block_size == 16 and llm.engine.lookahead_slots() == 15
    assert r.cost_profile_info["measured"] and set(r.cost_profile_info["times"]) == \
        {"1", "2", "4", "8", "16"}
    small = spec_llm(qwen3_path, drafter, block_size=8)
    assert small.engine.runner.spec_lens == [2, 4, 8]
    mine = spec_llm(qwen3_path, drafter, block_sizes=(2, 6))
    assert mine.engine.runner.spec_lens == [2, 6] and mine.engine.spec_block_size == 6
    for kw, msg in [(dict(block_sizes=(4, 32)), "block sizes 32 must be in"),
                    (dict(block_size=8, block_sizes=(4, 16)), "exceed block_size 8"),
                    (dict(block_sizes=(1, 4)), ">= 2"),
                    (dict(block_sizes=()), "empty"),
                    (dict(speculation_policy="greedy"), "adaptive or fixed"),
                    (dict(max_num_batched_tokens=8), r"must be >= the block size \(16\)")]:
        with pytest.raises(ConfigError, match=msg):
            spec_llm(qwen3_path, drafter, **kw)
    with pytest.raises(ConfigError, match="need a draft model"):
        LLM(str(qwen3_path), device="cpu", block_sizes=(4, 8))


@pytest.mark.parametrize("kv", [dict(num_kv_blocks=512),
                                dict(num_kv_blocks=12, max_num_batched_tokens=64)])
def test_greedy_identical_whatever_block_lengths(qwen3_path, drafter, prompts, ar_ref, kv):
    """Every step change among 1, 2, 4, 8, 16, with mixed prefill/decode steps, chunked prefill and
    (small cache) recompute preemption: the output is the target's."""
    llm = spec_llm(qwen3_path, drafter, **kv)
    force_cycle(llm)
    _, per_req = count_block_len_steps(llm)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ar_ref
    assert set(llm.engine.spec_stats.block_len_steps) == {1, 2, 4, 8, 16}
    # Per request, plain steps are settled from token counts: they match the steps run, also
    # across preemptions (re-prefills emit a token too).
    assert all(dict(o.metrics.spec.block_len_steps) == per_req[o.request_id] for o in outs)
    if kv["num_kv_blocks"] == 12:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm)
    # The real adaptive policy (measured costs, live acceptance) is lossless too.
    llm = spec_llm(qwen3_path, drafter, **kv)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ar_ref
    assert_no_leaks(llm)


def test_token_budget_follows_the_policys_last_choice(qwen3_path, drafter, prompts, ar_ref):
    """The scheduler reserves draft tokens in the step budget for the policy's last choice only:
    after a plain choice a prefill chunk takes them, and a step that also prefills then verifies
    at most what was reserved. No step exceeds max_num_batched_tokens; output stays the
    target's."""
    llm = spec_llm(qwen3_path, drafter, max_num_batched_tokens=64)
    force_cycle(llm, [1, 1, 16, 1, 8, 1, 1, 4])
    r, execute, steps = llm.engine.runner, llm.engine.runner.execute, []

    def spy(seqs, num_new_tokens, *rest):
        decoding = [n == 1 and s.num_computed_tokens == s.num_tokens - 1
                    for s, n in zip(seqs, num_new_tokens)]
        budgeted = r.planner.budget_block_len
        res = execute(seqs, num_new_tokens, *rest)
        prefill = sum(n for n, d in zip(num_new_tokens, decoding) if not d)
        steps.append((prefill, sum(decoding), max(res.block_len, 1), budgeted,
                      r.planner.last_block_len))
        return res

    r.execute = spy
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ar_ref
    assert all(p + d * L <= 64 for p, d, L, _, _ in steps)
    mixed = [(L, b, chosen) for p, d, L, b, chosen in steps if p and d]
    assert all(L <= b for L, b, _ in mixed)
    assert any(L < chosen for L, _, chosen in mixed)  # a speculative choice cut to the budget
    # After a plain choice, prefill chunks get what 16-token blocks would have reserved.
    assert any(p + d > 64 - 15 * d for p, d, _, b, _ in steps if p and d and b == 1)
    assert_no_leaks(llm)


def test_a_mixed_step_cuts_its_block_beside_a_prompt_chunk(qwen3_path, drafter, prompts,
                                                          ar_ref):
    """With the auto prefill cap, a step that prefills beside decodes verifies the longest block
    whose extra cost fits beside its chunk (policy/mixed_block.py), budgeted so by the
    scheduler; all-decode steps keep the policy's choice; output stays the target's."""
    llm = spec_llm(qwen3_path, drafter, decode_step_prefill_tokens="auto", max_num_seqs=4)
    r = llm.engine.runner
    cost = flat_costs({1: 6.0, 2: 6.1, 4: 8.0, 8: 11.0, 16: 18.0})
    r.set_cost_model(cost)
    force_cycle(llm, [16])
    execute, schedule, steps, load = r.execute, llm.engine.scheduler.schedule, [], [(0, 0)]

    def scheduled(*a, **kw):
        load[0] = llm.engine.scheduler.mixed_load()  # what the step's budget was set from
        return schedule(*a, **kw)

    def spy(seqs, num_new_tokens, *rest):
        res = execute(seqs, num_new_tokens, *rest)
        decoding = sum(n == 1 for n in num_new_tokens)
        steps.append((load[0], decoding, len(seqs) - decoding, res.block_len,
                      r.planner.budget_block_len))
        return res

    llm.engine.scheduler.schedule, r.execute = scheduled, spy
    # NOTE: lengths apart, so requests finish (and the next arrive) beside decoding ones
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * (i % 7), ignore_eos=True)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [ref[:p.max_tokens] for ref, p in zip(ar_ref, params)]
    mixed = [(ld, L, b) for ld, d, p, L, b in steps if d and p]
    assert mixed and all(b == mixed_block_len(cost, ld[0], 16, [2, 4, 8, 16], ld[1])
                         for ld, _, b in mixed)
    assert all(L <= b < 16 for _, L, b in mixed)  # every chunk here is small: always cut
    assert any(L == 16 for _, d, p, L, _ in steps if d and not p)
    assert_no_leaks(llm)


def _cache_rows(llm: LLM, seq, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and drafter K/V of positions [0, n) of a running sequence."""
    slots = torch.tensor([llm.engine.block_manager.slot(seq, p) for p in range(n)])

    def rows(cache: torch.Tensor) -> torch.Tensor:  # [2, layers, blocks, block size, h, d]
        return cache.flatten(2, 3)[:, :, slots]

    return rows(llm.engine.runner.kv_cache), rows(llm.engine.runner.proposer.kv_cache)


def test_kv_and_drafter_context_consistent_across_block_lengths(qwen3_path, drafter):
    """Synthetic acceptance commits several tokens per step; after steps of 1, 2, 4, 8, 16,
    the target's and the drafter's caches hold exactly what one prefill of the same tokens
    writes. (A plain step whose staged drafter context were never written, or written to the
    wrong slots, would fail this: the run ends on plain steps and flushes explicitly.)"""
    prompt = random_prompts([21], seed=9)[0]
    a = spec_llm(qwen3_path, drafter, synthetic_acceptance=0.7, benchmark_mode=True,
                 enable_prefix_caching=False)
    force_cycle(a)
    rid = a.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=200,
                                                      ignore_eos=True))
    seq = a.engine.requests[rid].seq
    while len(seq.output_token_ids) < 60:
        a.engine.step()
    assert set(a.engine.spec_stats.block_len_steps) == {1, 2, 4, 8, 16}
    assert a.engine.spec_stats.num_accepted_tokens > 10
    force_cycle(a, [1])
    for _ in range(3):
        a.engine.step()
    assert len(a.engine.runner.staging) >= 3
    a.engine.runner.flush_context()  # NOTE: the drafter would do it before its next run
    n = seq.num_computed_tokens
    tokens = seq.token_ids()[:n]
    b = spec_llm(qwen3_path, drafter, speculation_policy="fixed", enable_prefix_caching=False)
    rid_b = b.engine.add_request(tokens, SamplingParams(temperature=0, max_tokens=4))
    b.engine.step()  # one prefill of all n tokens
    seq_b = b.engine.requests[rid_b].seq
    assert seq_b.num_computed_tokens == n
    (ta, da), (tb, db) = _cache_rows(a, seq, n), _cache_rows(b, seq_b, n)
    torch.testing.assert_close(ta, tb, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(da, db, atol=1e-4, rtol=1e-4)
    a.engine.abort(rid)
    b.engine.abort(rid_b)
    assert_no_leaks(a)
    assert_no_leaks(b)


def test_plain_when_verify_expensive_and_acceptance_low(qwen3_path, drafter, prompts, ar_ref):
    llm = spec_llm(qwen3_path, drafter)
    llm.engine.runner.set_cost_model(flat_costs({1: 1.0, 2: 5.0, 4: 10.0, 8: 20.0, 16: 40.0}))
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ar_ref
    assert set(llm.engine.spec_stats.block_len_steps) == {1}
    assert llm.engine.spec_stats.num_steps == 0
    assert_no_leaks(llm)


def test_policy_view_reports_what_the_choice_was_priced_from(qwen3_path, drafter, prompts):
    """bench offline's per-level policy view: the modelled rates, which the choice maximises,
    and the live overhead terms that the steps fed."""
    from blockspec.bench.offline import policy_view

    llm = spec_llm(qwen3_path, drafter)
    llm.engine.runner.set_cost_model(flat_costs({1: 1.0, 2: 5.0, 4: 10.0, 8: 20.0, 16: 40.0}))
    llm.generate(prompts, GREEDY)
    view = policy_view(llm.engine, 2)
    assert view["mode"] == "adaptive" and view["choice"] == 1
    assert max(view["rates"], key=view["rates"].get) == 1
    assert set(view["overhead_s"]) == {1, 2, 4, 8, 16}
    llm.engine.runner.set_policy("fixed", 4)
    assert policy_view(llm.engine, 2) is None


def test_max_block_when_verify_cheap_and_acceptance_high(models_root):
    target, drafter = build_constant_pair(models_root, {5: 0.9, 6: 0.1}, block_size=16,
                                          name="const16")
    llm = LLM(str(target), device="cpu", num_kv_blocks=256, draft=str(drafter),
              cost_profile="none")
    llm.engine.runner.set_cost_model(flat_costs({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2}))
    # NOTE: evidence first: at the prior's 0.8 per position, block 16's stragglers in this
    # closed batch (drained_tau) make block 8 the better first step.
    llm.engine.runner.controller.tracker.observe_many([15] * 8, [15] * 8)
    outs = llm.generate([[1, 2, 3]] * 4, SamplingParams(temperature=0, max_tokens=65,
                                                         ignore_eos=True))
    assert all(o.token_ids == [5] * 65 for o in outs)
    assert dict(llm.engine.spec_stats.block_len_steps) == {16: 4}
    ctl = llm.engine.runner.controller
    assert ctl.explain(4)["choice"] == 16 and ctl.tracker.conditional_rates()[0] > 0.9
    # Same pair, costs where a middle block wins: 8 costs little more than 4, 16 twice as much.
    llm.engine.runner.set_cost_model(flat_costs({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.1, 16: 3.0}))
    assert ctl.explain(4)["choice"] == 8
    assert_no_leaks(llm)


def test_probe_after_plain_streak(qwen3_path, drafter):
    """Plain decode wins, so the engine probes the smallest block after 32 plain steps (with the
    drafter context kept whole: a detached engine's probe also pays a catch-up, see
    test_lazy_context)."""
    llm = spec_llm(qwen3_path, drafter, lazy_draft_context=False)
    llm.engine.runner.set_cost_model(flat_costs({1: 1.0, 2: 1.1, 4: 1.2, 8: 5.0, 16: 9.0}))
    ctl = llm.engine.runner.controller
    for _ in range(20):  # evidence: the first draft is never accepted
        ctl.tracker.observe_many([3] * 4, [0] * 4)
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))
    steps = llm.engine.spec_stats.block_len_steps
    assert set(steps) == {1, 2} and 1 <= steps[2] <= 3 and steps[1] >= 70


def test_fixed_mode_unchanged_and_runtime_switches(qwen3_path, drafter, prompts, ar_ref):
    llm = spec_llm(qwen3_path, drafter, speculation_policy="fixed")
    r = llm.engine.runner
    assert r.cost_profile_info is None and r.controller.mode == "fixed"
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ar_ref
    stats = llm.engine.spec_stats
    assert set(stats.block_len_steps) == {16}
    assert len(stats.drafted_per_position) == 15 and stats.num_draft_tokens == 15 * \
        stats.num_steps
    assert all(set(o.metrics.spec.block_len_steps) == {16} for o in outs)
    with pytest.raises(ConfigError, match="cost profile"):
        r.set_policy("adaptive")
    with pytest.raises(ConfigError, match="block length 3"):
        r.set_policy("fixed", 3)
    r.set_policy("fixed", 1)  # plain decode with a drafter: still the target's output
    spec_steps = stats.num_steps
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ar_ref
    assert stats.block_len_steps[1] >= 23 and stats.num_steps == spec_steps
    assert_no_leaks(llm)


def test_synthetic_acceptance_switch_needs_no_rebuild(qwen3_path, drafter, prompts):
    llm = spec_llm(qwen3_path, drafter, synthetic_acceptance=0.5, benchmark_mode=True)
    r = llm.engine.runner
    params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
    for a, L, tau in ((1.0, 8, 8.0), (0.0, 4, 1.0), (1.0, 16, 16.0)):
        r.set_synthetic_acceptance(a)
        r.set_policy("fixed", L)
        outs = llm.generate(prompts[:4], params)
        assert all(o.metrics.spec.mean_acceptance_length == tau for o in outs)
    with pytest.raises(ConfigError, match="probability"):
        r.set_synthetic_acceptance(1.5)
    with pytest.raises(ConfigError, match="not built with synthetic"):
        spec_llm(qwen3_path, drafter, speculation_policy="fixed").engine.runner \
            .set_synthetic_acceptance(0.5)
    assert_no_leaks(llm)


def test_observe_many_is_one_step_of_observations():
    one, many = AcceptanceTracker(half_life=1e12), AcceptanceTracker(half_life=1e12)
    obs = [(15, 3), (15, 0), (7, 7), (3, 1), (0, 0), (15, 15)]
    for d, a in obs:
        one.observe(d, a)
    many.observe_many([d for d, _ in obs], [a for _, a in obs])
    assert many.reached == pytest.approx(one.reached)
    assert many.accepted == pytest.approx(one.accepted)
    t = AcceptanceTracker(half_life=1.0)
    t.observe_many([2, 2], [2, 2])
    t.observe_many([2], [0])  # decays the previous step once (x 0.5), not once per sequence
    assert t.reached == pytest.approx([2 * 0.5 + 1, 2 * 0.5])
    with pytest.raises(ValueError):
        t.observe_many([2], [3])
    # The evidence cap keeps ratios and lets a small batch move a big batch's estimate quickly.
    capped = AcceptanceTracker(half_life=64, max_weight=100)
    for _ in range(50):
        capped.observe_many([1] * 256, [1] * 256)
    assert capped.reached == pytest.approx([100.0]) and capped.accepted == pytest.approx([100.0])
    for _ in range(100):
        capped.observe_many([1], [0])
    assert capped.conditional_rates()[0] < 0.5


def test_probe_overhead_bounds_probe_cost():
    cm = StepCostModel({1: {1: 1.0, 256: 10.0}, 4: {1: 1.2, 256: 33.0}})
    t = AcceptanceTracker(prior_mean=0.1)  # tau(4) = 1.11: plain wins at both batch sizes
    small = SpeculationPolicy(cm, (4,), probe_every=4, probe_overhead=0.1)
    assert [small.choose(1, t) for _ in range(6)] == [1, 1, 1, 1, 4, 1]  # 0.2 <= 0.1 * 5
    big = SpeculationPolicy(cm, (4,), probe_every=4, probe_overhead=0.1)
    picks = [big.choose(256, t) for _ in range(30)]
    assert picks.index(4) == 22  # extra 23 <= 0.1 * 10 * 23 plain steps


def test_controller_prices_steps_at_their_graph_bucket():
    """5 sequences replay the graph of bucket 8: priced there, speculation loses; interpolated
    between buckets 4 and 8 it would seem to win."""
    from blockspec.engine.speculation import SpecController

    cm = StepCostModel({1: {4: 1.0, 8: 2.0}, 4: {4: 1.1, 8: 6.0}})
    graphed = SpecController([4], "adaptive", cm, batch_bucket=lambda n: 8 if n > 4 else 4)
    eager = SpecController([4], "adaptive", cm)
    assert graphed.choose(5) == 1 and eager.choose(5) == 4
    assert graphed.choose(4) == eager.choose(4) == 4


def test_controller_learns_step_overhead_at_the_graph_bucket():
    from blockspec.engine.speculation import SpecController

    cm = StepCostModel({1: {4: 1.0, 8: 2.0}, 4: {4: 3.0, 8: 6.0}})
    ctl = SpecController([4], "adaptive", cm, batch_bucket=lambda n: 8 if n > 4 else 4)
    ctl.observe_step_time(5, 1, 2.5)  # bucket 8: 2.0 modelled
    ctl.observe_step_time(6, 4, 7.0)  # the same bucket, block 4: 6.0 modelled
    assert ctl.overhead(8, 1) == pytest.approx(0.5) and ctl.overhead(8, 4) == pytest.approx(1.0)
    assert ctl.overhead(4, 1) == 0
    assert ctl.explain(6)["overhead_s"] == pytest.approx({1: 0.5, 4: 1.0})
    ctl.set_policy("fixed", 4)
    ctl.set_policy("adaptive")  # kept across policy switches
    assert ctl.explain(6)["overhead_s"] == pytest.approx({1: 0.5, 4: 1.0})
    ctl.set_cost_model(cm)  # an installed table is exact: no overhead term, none learned
    ctl.observe_step_time(5, 1, 9.0)
    assert ctl.explain(6)["overhead_s"] == {1: 0.0, 4: 0.0}


def test_a_probe_is_priced_at_what_it_took_and_a_catch_up_feeds_no_overhead():
    """A probe step's wall time beyond a plain step (its catch-up included) budgets the next
    probe at that batch size; a caught-up step does not move the overhead terms."""
    from blockspec.engine.speculation import SpecController

    cm = StepCostModel({1: {8: 1.0}, 2: {8: 1.2}})
    ctl = SpecController([2], "adaptive", cm)
    ctl.policy.probing = True  # as after a probe choice
    ctl.observe_step_time(8, 2, 11.0, caught_up=True)
    assert ctl.policy._probe_excess == {8: pytest.approx(10.0)}
    assert ctl.overhead(8, 2) == 0 and ctl.overhead(8, 1) == 0
    ctl.policy.probing = False
    ctl.observe_step_time(8, 2, 1.5)  # not a probe: only the overhead term learns
    assert ctl.policy._probe_excess == {8: pytest.approx(10.0)}
    assert ctl.overhead(8, 2) == pytest.approx(0.3)


def test_engine_reports_all_decode_step_times(qwen3_path, drafter, prompts, monkeypatch):
    """The runner flags all-decode steps only (not prefill or mixed steps) and the engine hands
    each one's wall time to the controller."""
    # NOTE: without the lazy context: no step is flagged as caught up
    llm = spec_llm(qwen3_path, drafter, cost_profile="none", lazy_draft_context=False)
    runner = llm.engine.runner
    seen = []
    monkeypatch.setattr(runner.controller, "observe_step_time",
                        lambda n, L, s, caught_up: seen.append((n, L, s, caught_up)))
    flagged = []
    execute = runner._execute

    def spy(seqs, num_new_tokens, *rest):
        res = execute(seqs, num_new_tokens, *rest)
        decode = all(n == 1 and s.num_computed_tokens == s.num_tokens - 1
                     for s, n in zip(seqs, num_new_tokens))
        flagged.append((decode, runner.timed_step))
        return res

    monkeypatch.setattr(runner, "_execute", spy)
    llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert any(not d for d, _ in flagged) and any(d for d, _ in flagged)
    assert all((t is not None) == d for d, t in flagged)
    assert [(n, L, c) for n, L, _, c in seen] == [t for d, t in flagged if d]
    assert all(s > 0 and not c for _, _, s, c in seen)
    assert runner.timed_step is None


def test_step_time_leaves_out_finishing_requests(qwen3_path, drafter, prompts, monkeypatch):
    """The wall time handed to the policy leaves out the work of finishing requests (freeing,
    final outputs), paid per request whatever the block length: a closed batch that finishes in
    one step would otherwise record it as one very dear decode step."""
    llm = spec_llm(qwen3_path, drafter, cost_profile="none", lazy_draft_context=False)
    eng = llm.engine
    seen = []
    monkeypatch.setattr(eng.runner.controller, "observe_step_time",
                        lambda n, L, s, caught_up: seen.append(s))
    finish = eng.scheduler.finish

    def slow_finish(*args, **kw):
        time.sleep(0.2)
        return finish(*args, **kw)

    monkeypatch.setattr(eng.scheduler, "finish", slow_finish)
    force_cycle(llm, [1])  # plain decode: the three requests finish in the same step
    llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert seen and max(seen) < 0.2
    assert eng.finish_seconds >= 0.6  # the last step's three finishes, measured
