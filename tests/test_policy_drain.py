"""The policy's corrections to the step-cost model: the live per-step overhead (averaging,
clipping, borrowing, staleness, sampling plain decode) and a draining batch's stragglers
(`drained_tau` against a simulated closed batch, the choices it changes, the engine's signal)."""

from __future__ import annotations

import random

import pytest
from helpers import cpu_llm

from blockspec import SamplingParams
from blockspec.bench.offline import run_requests
from blockspec.policy.acceptance import committed_moments_from_rates
from blockspec.policy.policy import (
    EXPLORE_BELOW,
    EXPLORE_MIN_LEFT,
    AcceptanceTracker,
    Drain,
    SpeculationPolicy,
    StepCostModel,
    StepOverhead,
    drained_tau,
    expected_max_normal,
)


def iid_tracker(a: float) -> AcceptanceTracker:
    return AcceptanceTracker(prior_mean=a)


def test_step_overhead_averages_clips_and_borrows():
    o = StepOverhead(alpha=0.25)
    assert o(256, 1) == o(256, 4) == 0.0
    o.observe(256, 4, modelled=0.038, wall=0.041)
    assert o(256, 4) == pytest.approx(0.003)
    # Unobserved plain decode borrows the smallest speculative term at its batch size, and an
    # unobserved block borrows plain decode's (borrowed or not).
    o.observe(256, 8, modelled=0.070, wall=0.075)
    assert o(256, 1) == pytest.approx(0.003) and o(256, 16) == pytest.approx(0.003)
    o.observe(256, 1, modelled=0.012, wall=0.016)
    assert o(256, 1) == pytest.approx(0.004) and o(256, 16) == pytest.approx(0.004)
    # The first 1 / alpha samples are averaged equally, then alpha per sample.
    o.observe(256, 1, modelled=0.012, wall=0.018)
    o.observe(256, 1, modelled=0.012, wall=0.019)
    assert o(256, 1) == pytest.approx((0.004 + 0.006 + 0.007) / 3)
    o.observe(256, 1, modelled=0.012, wall=0.020)
    assert o(256, 1) == pytest.approx(0.00625)
    o.observe(256, 1, modelled=0.012, wall=10.0)  # an outlier counts as one modelled step at most
    assert o(256, 1) == pytest.approx(0.00625 + 0.25 * (0.012 - 0.00625))
    before = o(256, 1)
    o.observe(256, 1, modelled=0.012, wall=0.001)  # faster than modelled: the profile is a floor
    assert o(256, 1) == pytest.approx(0.75 * before)
    assert o(8, 1) == o(8, 4) == 0.0  # per batch size
    for bad in [dict(alpha=0), dict(min_samples=0), dict(stale_after=0)]:
        with pytest.raises(ValueError):
            StepOverhead(**bad)


def test_plain_decode_needs_samples_until_known_and_again_when_stale():
    o = StepOverhead(min_samples=3, stale_after=4)
    assert o.plain_needs_samples(128)
    for _ in range(3):
        assert o.plain_needs_samples(128)
        o.observe(128, 1, modelled=0.008, wall=0.0115)
    assert not o.plain_needs_samples(128) and o(128, 1) == pytest.approx(0.0035)
    for _ in range(4):
        o.observe(128, 4, modelled=0.018, wall=0.020)
    assert not o.plain_needs_samples(128)
    o.observe(64, 4, modelled=0.010, wall=0.011)  # any batch size advances the clock
    assert o.plain_needs_samples(128)
    o.observe(128, 1, modelled=0.008, wall=0.0095)  # a stale term restarts from the new sample
    assert o(128, 1) == pytest.approx(0.0015) and o.plain_needs_samples(128)


def test_policy_samples_a_stale_plain_term_like_the_h200_a06_b128_run():
    """H200 run 10, a=0.6, B=128: plain decode's term had been learned in a batch's tail at long
    contexts (+3.55 ms) and never again, as the policy then kept speculating: block 4 looked
    1.20x plain decoding and ran at 0.96x. Stale, the term is sampled again (plain steps), and
    at its real value (+1.8 ms) plain decode wins. A good drafter's gain, beyond EXPLORE_BELOW,
    is not interrupted."""
    cm = StepCostModel({1: {128: 8.04e-3}, 4: {128: 18.44e-3}})
    policy = SpeculationPolicy(cm, block_lens=(4,), min_gain=1.05)
    o = policy.overhead = StepOverhead(stale_after=8)
    for _ in range(3):
        o.observe(128, 1, cm.cost(128, 1), cm.cost(128, 1) + 3.55e-3)
    o.observe(128, 4, cm.cost(128, 4), cm.cost(128, 4) + 2.5e-3)
    assert policy.choose(128, iid_tracker(0.6)) == 4
    for _ in range(8):
        o.observe(128, 4, cm.cost(128, 4), cm.cost(128, 4) + 2.5e-3)
    rates = policy.rates(128, iid_tracker(0.6))
    assert 1.05 < rates[4] / rates[1] < EXPLORE_BELOW
    assert policy.choose(128, iid_tracker(0.6)) == 1  # sampling plain decode
    for _ in range(3):
        o.observe(128, 1, cm.cost(128, 1), cm.cost(128, 1) + 1.8e-3)
    assert policy.choose(128, iid_tracker(0.6)) == 1  # on the merits now
    for _ in range(9):
        o.observe(128, 4, cm.cost(128, 4), cm.cost(128, 4) + 2.5e-3)
    assert o.plain_needs_samples(128)
    assert policy.choose(128, iid_tracker(0.86)) == 4  # 1.52x: no sampling


def test_no_plain_sampling_near_a_draining_batchs_end():
    """Sampling plain decode's term costs plain steps; in a draining batch's last tokens the
    term would serve few steps more, so the policy keeps speculating there."""
    cm = StepCostModel({1: {8: 6.0e-3}, 4: {8: 9.0e-3}})
    policy = SpeculationPolicy(cm, block_lens=(4,), min_gain=1.03)
    policy.overhead = StepOverhead()  # nothing observed: plain decode's term is unknown
    rates = policy.rates(8, iid_tracker(0.6))
    assert 1.03 < rates[4] / rates[1] < EXPLORE_BELOW
    assert policy.choose(8, iid_tracker(0.6), drain=Drain.of([EXPLORE_MIN_LEFT] * 8)) == 1
    assert policy.choose(8, iid_tracker(0.6), drain=Drain.of([40] * 8)) == 4
    assert policy.choose(8, iid_tracker(0.6)) == 1  # not draining: sampled


def simulated_steps(a: float, L: int, n: int, horizon: int, trials: int, seed: int) -> float:
    """Mean steps until all of n sequences have `horizon` tokens, each step committing
    1 + (accepted drafts) with iid acceptance a (the synthetic-acceptance mode's law)."""
    rng = random.Random(seed)
    total = 0
    for _ in range(trials):
        worst = 0
        for _ in range(n):
            got = steps = 0
            while got < horizon:
                k = 1
                while k < L and rng.random() < a:
                    k += 1
                got += k
                steps += 1
            worst = max(worst, steps)
        total += worst
    return total / trials


@pytest.mark.parametrize("a,L,n,horizon", [(0.6, 4, 128, 256), (0.86, 4, 256, 256),
                                           (0.86, 16, 8, 256), (0.86, 8, 32, 64),
                                           (0.86, 16, 1, 256)])
def test_drained_tau_matches_a_simulated_closed_batch(a, L, n, horizon):
    mean, var = committed_moments_from_rates([a] * (L - 1), L)
    want = simulated_steps(a, L, n, horizon, trials=max(12, 2000 // n), seed=L * n)
    got = horizon / drained_tau(mean, var, n, horizon)
    assert got == pytest.approx(want, rel=0.05)
    if n > 1:  # the stragglers matter: the mean alone is well off
        assert horizon / mean < 0.93 * want


def simulated_makespan(left: list[int], a: float, L: int, trials: int, rng: random.Random
                       ) -> float:
    total = 0
    for _ in range(trials):
        worst = 0
        for horizon in left:
            got = steps = 0
            while got < horizon:
                k = 1
                while k < L and rng.random() < a:
                    k += 1
                got, steps = got + k, steps + 1
            worst = max(worst, steps)
        total += worst
    return total / trials


@pytest.mark.parametrize("a,L,n,done", [(0.6, 4, 64, 60), (0.6, 4, 128, 90), (0.86, 4, 256, 40),
                                        (0.86, 16, 32, 20)])
def test_drain_mid_run_races_only_the_requests_near_the_last(a, L, n, done):
    """Part-way through a closed batch (`done` steps of block L taken, 256 tokens each), the
    requests' tokens left have spread; the batch's remaining steps follow the request with most
    left and those near it. Drain.tau predicts a simulation of the rest within 10%, nearer
    than pricing every request at the most left."""
    rng = random.Random(n + done)
    left = [max(1, 256 - sum(_committed(rng, a, L, done))) for _ in range(n)]
    mean, var = committed_moments_from_rates([a] * (L - 1), L)
    drain = Drain.of(left)
    most = drain.left[-1]
    want = simulated_makespan(left, a, L, trials=20, rng=random.Random(1))
    got = most / drain.tau(mean, var)
    everyone = most / drained_tau(mean, var, n, most)
    assert got == pytest.approx(want, rel=0.1)
    assert abs(got - want) < abs(everyone - want)


def _committed(rng: random.Random, a: float, L: int, steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        k = 1
        while k < L and rng.random() < a:
            k += 1
        out.append(k)
    return out


def test_moments_and_expected_max():
    mean, var = committed_moments_from_rates([0.6] * 3, 4)
    probs = {1: 0.4, 2: 0.24, 3: 0.144, 4: 0.216}
    assert mean == pytest.approx(sum(k * p for k, p in probs.items()))
    assert var == pytest.approx(sum(k * k * p for k, p in probs.items()) - mean ** 2)
    assert committed_moments_from_rates([], 1) == (1.0, 0.0)
    # Several block lengths in one pass: the same as one at a time, by exact distributions.
    rates = [0.9, 0.7, 0.5, 0.8, 0.6, 0.3, 0.95]
    both = committed_moments_from_rates(rates, [8, 2, 4])
    assert set(both) == {2, 4, 8}
    for L, (m, v) in both.items():
        reach = [1.0]
        for p in rates[:L - 1]:
            reach.append(reach[-1] * p)  # P(k >= j + 1)
        pk = [reach[j] - (reach[j + 1] if j + 1 < L else 0.0) for j in range(L)]
        assert m == pytest.approx(sum((j + 1) * q for j, q in enumerate(pk)))
        assert v == pytest.approx(sum((j + 1) ** 2 * q for j, q in enumerate(pk)) - m * m)
        assert committed_moments_from_rates(rates, L) == (m, v)
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(0.5642, abs=0.03)  # 1 / sqrt(pi)
    assert expected_max_normal(128) == pytest.approx(2.6, abs=0.03)
    assert drained_tau(1.0, 0.0, 256, 100) == 1.0  # plain decode: no stragglers
    assert drained_tau(3.2, 1.3, 64, 1) <= 1.0  # one token left: a block gains nothing


# H200 start-up profile (policy_sweep run 9), ms per step, and the live terms run 10 measured.
H200_MS = {1: {128: 8.04, 256: 11.85}, 4: {128: 18.44, 256: 35.17}}


def test_drain_turns_the_a06_b128_choice_to_plain_and_keeps_a086_b256_on_block_4():
    """Per step, block 4 at a=0.6, B=128 beats plain decoding by ~8% (plain +2.4 ms, block 4
    +2.5 ms); over a closed batch of 256-token requests its stragglers cost 11% more steps, and
    the H200 measured it 5% under plain. At a=0.86, B=256 block 4 still wins (+9% measured)."""
    cm = StepCostModel({L: {b: t / 1e3 for b, t in row.items()} for L, row in H200_MS.items()})
    policy = SpeculationPolicy(cm, block_lens=(4,), min_gain=1.05)
    o = policy.overhead = StepOverhead()
    for b, L, extra in [(128, 1, 2.4), (128, 4, 2.5), (256, 1, 3.9), (256, 4, 5.0)]:
        for _ in range(3):
            o.observe(b, L, cm.cost(b, L), cm.cost(b, L) + extra / 1e3)
    assert policy.choose(128, iid_tracker(0.6)) == 4
    assert policy.choose(128, iid_tracker(0.6), drain=Drain.of([256] * 128)) == 1
    assert policy.explain(128, iid_tracker(0.6), drain=Drain.of([256] * 128))["choice"] == 1
    assert policy.choose(256, iid_tracker(0.86), drain=Drain.of([256] * 256)) == 4
    # Requests that will run far longer: the stragglers matter less.
    assert policy.choose(128, iid_tracker(0.6), drain=Drain.of([16384] * 128)) == 4


def test_engine_drains_only_in_a_closed_batch(qwen3_path, drafter16, monkeypatch):
    """LLM.generate (every request known up front) and a benchmark's last wave set the drain;
    requests added one by one (a server) never do."""
    llm = cpu_llm(qwen3_path, drafter16, cost_profile="none", max_num_seqs=4)
    eng = llm.engine
    seen: list = []
    choose = eng.runner.controller.policy.choose
    def spy(b, t, drain=None, switch_cost=None):
        seen.append(drain() if callable(drain) else drain)  # NOTE: built on demand
        return choose(b, t, drain, switch_cost)

    monkeypatch.setattr(eng.runner.controller.policy, "choose", spy)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    llm.generate(prompts, params)
    assert seen and all(d is not None and len(d.left) <= 3 for d in seen)
    assert seen[0] == Drain((5, 5, 5))  # the first decode step: 3 requests, 5 tokens left each
    assert not eng.closed_batch
    seen.clear()
    eng.add_request([5, 6, 7], params)
    while eng.has_unfinished():
        eng.step()
    assert seen and all(d is None for d in seen)
    seen.clear()
    # Six prompts, two in flight: only the last wave (no prompt left to add) drains.
    run_requests(eng, [[5 + i, 6, 7] for i in range(6)], params, concurrency=2, tag="t",
                 show=False)
    assert None in seen and seen[-1] is not None and not eng.closed_batch
    # ... and a step that raises in the last wave leaves the engine open again too.
    step = eng.step

    def failing_step():
        if eng.closed_batch:
            raise RuntimeError("boom")
        return step()

    monkeypatch.setattr(eng, "step", failing_step)
    with pytest.raises(RuntimeError, match="boom"):
        run_requests(eng, [[5, 6, 7]], params, concurrency=2, tag="u", show=False)
    assert not eng.closed_batch
    monkeypatch.setattr(eng, "step", step)
    for rid in list(eng.requests):
        eng.abort(rid)
    # More requests than fit in the batch: the ones waiting take finished slots, no drain.
    seen.clear()
    llm.generate([[5 + i, 6] for i in range(6)], params)
    assert seen[0] is None and seen[-1] is not None
