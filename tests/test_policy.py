"""Speculation policy: step-cost interpolation and profiles, decayed acceptance statistics, and
the block-length choice (plain decode vs speculation) under fake costs and fake acceptance."""

from __future__ import annotations

import json
import random

import pytest

from blockspec.policy.policy import (
    AcceptanceTracker,
    SpeculationPolicy,
    StepCostModel,
    StepOverhead,
    expected_committed_from_rates,
    profile_key,
)

# DESIGN.md "Why speculation loses at high concurrency": ms by batch B (rows) x block T (columns).
DESIGN_MS = {
    1: (5.0, 5.6, 5.8, 5.6),
    8: (5.6, 6.2, 6.3, 6.9),
    32: (6.3, 10.0, 12.5, 18.4),
    64: (7.6, 16.8, 22.5, 36.2),
    128: (10.3, 31.1, 44.9, 71.2),
}
TS = (1, 4, 8, 16)


def design_costs() -> StepCostModel:
    return StepCostModel({t: {b: row[i] / 1000 for b, row in DESIGN_MS.items()}
                          for i, t in enumerate(TS)})


def iid_tracker(a: float) -> AcceptanceTracker:
    """Tracker whose rates are exactly a at every position (the prior alone, no data)."""
    return AcceptanceTracker(prior_mean=a)


def feed(tracker: AcceptanceTracker, a: float, steps: int, drafted: int = 15,
         seed: int = 0) -> None:
    """Synthetic prefix-wise acceptance: each draft accepted with prob. a until the first miss."""
    rng = random.Random(seed)
    for _ in range(steps):
        k = 0
        while k < drafted and rng.random() < a:
            k += 1
        tracker.observe(drafted, k)


def closed_form(a: float, L: int) -> float:
    return (1 - a ** L) / (1 - a)


# ---------------------------------------------------------------- cost model


def test_cost_at_buckets_interpolation_and_extrapolation():
    cm = design_costs()
    assert cm.block_lens == [1, 4, 8, 16]
    assert cm.cost(32, 16) == pytest.approx(0.0184)
    # Linear between buckets 32 and 64: halfway at 48.
    assert cm.cost(48, 16) == pytest.approx((0.0184 + 0.0362) / 2)
    assert cm.cost(16, 1) == pytest.approx(0.0056 + (0.0063 - 0.0056) * 8 / 24)
    # Beyond the largest bucket: proportional.
    assert cm.cost(256, 16) == pytest.approx(0.0712 * 2)
    assert cm.cost(192, 1) == pytest.approx(0.0103 * 1.5)
    # Below the smallest measured bucket: the smallest bucket's time.
    sparse = StepCostModel({1: {8: 0.004, 16: 0.006}, 4: {16: 0.01}})
    assert sparse.cost(1, 1) == pytest.approx(0.004)
    assert sparse.cost(3, 4) == pytest.approx(0.01)
    assert sparse.cost(32, 4) == pytest.approx(0.02)
    with pytest.raises(KeyError):
        cm.cost(8, 2)
    with pytest.raises(ValueError):
        cm.cost(0, 1)


@pytest.mark.parametrize("times", [
    {},
    {4: {1: 0.01}},                      # no plain decode
    {1: {1: 0.005}, 4: {}},              # a block length with no bucket
    {1: {1: 0.0}},                       # zero time
    {1: {1: -1.0}},
    {1: {1: float("nan")}},
    {1: {1: float("inf")}},
    {1: {0: 0.005}},                     # bucket < 1
    {0: {1: 0.005}, 1: {1: 0.005}},      # block length < 1
    {1: {1: "5ms"}},
])
def test_invalid_cost_tables_raise(times):
    with pytest.raises(ValueError):
        StepCostModel(times)


def test_profile_round_trip_and_key_mismatch(tmp_path):
    cm = design_costs()
    key = profile_key("/models/Qwen3-8B", "NVIDIA H200", "torch.bfloat16", 16, [16, 4, 8, 1])
    assert key["block_lens"] == [1, 4, 8, 16]
    path = tmp_path / "profiles" / "cost.json"
    cm.save(path, key)
    loaded = StepCostModel.load(path, key)
    assert loaded is not None
    for b in (1, 5, 8, 40, 128, 300):
        for t in TS:
            assert loaded.cost(b, t) == pytest.approx(cm.cost(b, t))
    assert json.loads(path.read_text())["key"] == key
    for stale in (profile_key("/models/Qwen3-8B", "NVIDIA H100", "torch.bfloat16", 16, TS),
                  profile_key("/models/Qwen3-8B", "NVIDIA H200", "torch.float16", 16, TS),
                  profile_key("/models/Qwen3-8B", "NVIDIA H200", "torch.bfloat16", 32, TS),
                  profile_key("/models/Qwen3-8B", "NVIDIA H200", "torch.bfloat16", 16, (1, 16)),
                  profile_key("/models/other", "NVIDIA H200", "torch.bfloat16", 16, TS)):
        assert StepCostModel.load(path, stale) is None
    assert StepCostModel.load(tmp_path / "missing.json", key) is None
    assert StepCostModel.from_json(cm.to_json()).cost(48, 8) == pytest.approx(cm.cost(48, 8))
    with pytest.raises(ValueError):
        StepCostModel.from_json({"times": {"1": {"1": -2.0}}})
    with pytest.raises(ValueError):
        StepCostModel.from_json({"key": None})


# ---------------------------------------------------------------- acceptance tracker


@pytest.mark.parametrize("a", [0.3, 0.5, 0.86, 0.95])
@pytest.mark.parametrize("L", [1, 2, 4, 8, 16])
def test_expected_committed_closed_form(a, L):
    assert iid_tracker(a).expected_committed(L) == pytest.approx(closed_form(a, L))
    assert expected_committed_from_rates([a] * (L - 1), L) == pytest.approx(closed_form(a, L))


def test_expected_committed_from_data_matches_closed_form():
    t = AcceptanceTracker(half_life=1e9)
    feed(t, 0.8, steps=4000, drafted=15, seed=1)
    rates = t.conditional_rates()
    assert len(rates) == 15
    for p in rates[:6]:  # well-reached positions (>= 1000 samples each)
        assert p == pytest.approx(0.8, abs=0.04)
    assert t.expected_committed(8) == pytest.approx(closed_form(0.8, 8), rel=0.05)


def test_prefix_wise_counts():
    t = AcceptanceTracker(half_life=1e12, prior_weight=1e-9)
    t.observe(4, 2)  # positions 1, 2 accepted; 3 reached and rejected; 4 not reached
    t.observe(4, 4)
    t.observe(4, 0)
    assert t.reached == pytest.approx([3, 2, 2, 1])
    assert t.accepted == pytest.approx([2, 2, 1, 1])
    assert t.conditional_rates() == pytest.approx([2 / 3, 1.0, 0.5, 1.0])
    with pytest.raises(ValueError):
        t.observe(3, 4)
    with pytest.raises(ValueError):
        t.observe(3, -1)


def test_prior_before_data_and_unreached_positions_extrapolate():
    t = AcceptanceTracker(prior_mean=0.5, prior_weight=2.0)
    assert t.conditional_rates(15) == pytest.approx([0.5] * 15)
    assert t.expected_committed(16) == pytest.approx(closed_form(0.5, 16))
    feed(t, 0.95, steps=500, drafted=3)  # only block length 4 was run
    rates = t.conditional_rates(15)
    assert rates[0] > 0.8
    # Positions never reached inherit their predecessor's rate, not the 0.5 prior.
    assert rates[14] == pytest.approx(rates[2])


def test_decay_half_life():
    t = AcceptanceTracker(half_life=10)
    t.observe(1, 1)
    assert t.reached[0] == pytest.approx(1.0)
    for _ in range(10):
        t.tick()
    assert t.reached[0] == pytest.approx(0.5)
    assert t.accepted[0] == pytest.approx(0.5)
    # 10 accepts, then 10 rejections: at half-life 10 the old accepts weigh half as much.
    t = AcceptanceTracker(half_life=10, prior_weight=1e-9)
    for _ in range(10):
        t.observe(1, 1)
    for _ in range(10):
        t.observe(1, 0)
    d = 0.5 ** 0.1
    old = sum(d ** i for i in range(10, 20))
    new = sum(d ** i for i in range(10))
    assert old == pytest.approx(new / 2)
    assert t.conditional_rates()[0] == pytest.approx(old / (old + new))
    assert t.conditional_rates()[0] == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        AcceptanceTracker(half_life=0)


# ---------------------------------------------------------------- policy


def test_plain_decode_when_verify_expensive_and_acceptance_low():
    policy = SpeculationPolicy(design_costs())
    assert policy.choose(128, iid_tracker(0.5)) == 1
    assert policy.choose(64, iid_tracker(0.5)) == 1
    info = policy.explain(128, iid_tracker(0.5))
    assert info["choice"] == 1
    assert info["rates"][1] == pytest.approx(128 / 0.0103)
    assert max(info["rates"][L] for L in (4, 8, 16)) < info["rates"][1]


def test_largest_block_for_small_batch_high_acceptance():
    policy = SpeculationPolicy(design_costs())
    assert policy.choose(1, iid_tracker(0.9)) == 16
    info = policy.explain(1, iid_tracker(0.9))
    assert info["rates"][16] == pytest.approx(closed_form(0.9, 16) / 0.0056)
    assert info["tau"][16] == pytest.approx(closed_form(0.9, 16))


def test_intermediate_block_when_optimal():
    # B=32, a=0.8: tau/cost = 2.95/10.0, 4.16/12.5, 4.86/18.4 ms -> block 8 is best.
    policy = SpeculationPolicy(design_costs())
    assert policy.choose(32, iid_tracker(0.8)) == 8
    # A table where 4 wins: large blocks cost much more, acceptance modest.
    cm = StepCostModel({1: {1: 1.0}, 4: {1: 1.2}, 8: {1: 2.0}, 16: {1: 4.0}})
    assert SpeculationPolicy(cm).choose(1, iid_tracker(0.7)) == 4


def test_min_gain_threshold():
    cm = StepCostModel({1: {1: 1.0}, 4: {1: 1.5}})
    t = iid_tracker(0.5)  # tau(4) = 1.875 -> 1.25x plain
    assert SpeculationPolicy(cm, block_lens=(4,)).choose(1, t) == 4
    assert SpeculationPolicy(cm, block_lens=(4,), min_gain=1.3).choose(1, t) == 1
    # Exact tie with plain decode is not a gain.
    tie = StepCostModel({1: {1: 1.0}, 4: {1: 1.875}})
    assert SpeculationPolicy(tie, block_lens=(4,)).choose(1, t) == 1
    # Tie between two blocks (exactly 2x plain each): the smaller block wins.
    two = StepCostModel({1: {1: 1.0}, 4: {1: 1.875 / 2}, 8: {1: 1.9921875 / 2}})
    info = SpeculationPolicy(two, block_lens=(4, 8)).explain(1, t)
    assert info["rates"][4] == info["rates"][8] == 2.0
    assert SpeculationPolicy(two, block_lens=(8, 4)).choose(1, t) == 4


def test_choice_moves_with_statistics():
    policy = SpeculationPolicy(design_costs())
    t = AcceptanceTracker(half_life=16)
    feed(t, 0.95, steps=200, seed=2)
    assert policy.choose(8, t) == 16
    for _ in range(100):  # the drafter goes bad: every first draft rejected
        t.observe(15, 0)
    assert t.conditional_rates()[0] < 0.1  # the prior keeps a small floor
    assert policy.choose(8, t) == 1
    feed(t, 0.95, steps=200, seed=3)  # and recovers
    assert policy.choose(8, t) == 16


def test_probe_after_plain_streak():
    policy = SpeculationPolicy(design_costs(), probe_every=3)
    t = iid_tracker(0.5)
    assert [policy.choose(128, t) for _ in range(8)] == [1, 1, 1, 4, 1, 1, 1, 4]
    no_probe = SpeculationPolicy(design_costs())
    assert {no_probe.choose(128, t) for _ in range(20)} == {1}


def test_plain_choice_is_repriced_every_recheck_plain_steps(monkeypatch):
    """A plain choice made on the rates holds for RECHECK_PLAIN - 1 more steps at the same batch
    size and evidence; new evidence or another batch size re-prices at once."""
    from blockspec.policy import policy as policy_mod

    policy = SpeculationPolicy(design_costs(), min_gain=1.0)
    priced = []
    cands = policy._candidates
    monkeypatch.setattr(policy, "_candidates",
                        lambda *a, **k: priced.append(a[0]) or cands(*a, **k))
    t = iid_tracker(0.3)
    assert [policy.choose(128, t) for _ in range(16)] == [1] * 16
    assert len(priced) == -(-16 // policy_mod.RECHECK_PLAIN) < 16
    policy.choose(64, t)  # another batch size
    assert priced[-1] == 64
    policy.choose(64, iid_tracker(0.3))  # another tracker (reset statistics), same evidence count
    assert len(priced) == 4
    feed(t, 0.95, steps=50)  # new evidence: re-priced, and speculation wins at once
    assert policy.choose(64, t) > 1 and len(priced) == 5
    assert policy.choose(1, t) > 1 and len(priced) == 6  # speculative choices are never held


def test_a_probes_measured_price_spaces_the_next_one():
    """probe_overhead budgets a probe at the larger of its modelled extra and what the last
    probe at that batch size measured: a probe that cost 10x its model waits 10x longer."""
    cm = StepCostModel({1: {1: 1.0}, 4: {1: 1.1}})  # modelled extra 0.1 s; plain wins
    t = iid_tracker(0.01)

    def probe_gaps(measured: float | None) -> list[int]:
        policy = SpeculationPolicy(cm, (4,), probe_every=2, probe_overhead=0.05)
        gaps, n = [], 0
        for _ in range(400):
            n += 1
            if policy.choose(1, t) == 4:
                assert policy.probing
                if measured is not None:
                    policy.observe_probe(1, measured)
                gaps.append(n)
                n = 0
            else:
                assert not policy.probing
        return gaps

    assert set(probe_gaps(None)) == {3}  # 0.1 s <= 5% of 2 plain seconds: every third step
    assert set(probe_gaps(1.0)[1:]) == {20}  # 1 s measured: 20 plain seconds between probes
    assert set(probe_gaps(0.01)) == {3}  # a measured price under the model's: the model's


def test_probe_asks_the_switch_cost_every_recheck_plain_steps():
    """The probe's affordability check re-asks the switch cost (it walks the batch) only every
    RECHECK_PLAIN streak steps."""
    from blockspec.policy import policy as policy_mod

    cm = StepCostModel({1: {1: 1.0}, 4: {1: 1.1}})  # plain wins: only the probe asks
    policy = SpeculationPolicy(cm, (4,), probe_every=2, probe_overhead=0.5)
    asked = []
    switch = lambda b, m: asked.append(b) or (1e9, 1.0)  # noqa: E731 - never affordable
    t = iid_tracker(0.01)
    n = 4 * policy_mod.RECHECK_PLAIN
    assert {policy.choose(1, t, switch_cost=switch) for _ in range(n)} == {1}
    assert len(asked) == 4


def test_switch_cost_is_amortised_over_the_horizon():
    """A one-time cost of speculating (the lazy context's catch-up) is spread over the steps
    that commit the tokens left: a long horizon absorbs it, a short one or a dear one does not,
    and a near-tie with plain never pays it."""
    cm = StepCostModel({1: {1: 1.0}, 4: {1: 1.5}})
    t = iid_tracker(0.5)  # tau(4) = 1.875: 1.25x plain without a switch cost
    policy = SpeculationPolicy(cm, block_lens=(4,))
    calls = []

    def switch(seconds, horizon):
        def fn(batch_size, cost_model):
            calls.append((batch_size, cost_model))
            return seconds, horizon
        return fn

    assert policy.choose(1, t, switch_cost=switch(0.0, 1.0)) == 4 and calls == [(1, cm)]
    # +10 s over 533 steps: +0.019 s per step
    assert policy.choose(1, t, switch_cost=switch(10.0, 1000.0)) == 4
    # over ~11 steps: +0.94 s per step
    assert policy.choose(1, t, switch_cost=switch(10.0, 20.0)) == 1
    # fewer tokens left than one step commits
    assert policy.rates(1, t, 1.0, 1.0)[4] == pytest.approx(1.875 / 2.5)
    assert policy.choose(1, t, switch_cost=switch(1.0, 1.0)) == 1
    # Plain decode never asks: the switch cost only guards a speculative choice.
    calls.clear()
    assert SpeculationPolicy(cm, block_lens=(4,)).choose(1, iid_tracker(0.01)) == 1
    assert policy.choose(1, iid_tracker(0.01), switch_cost=switch(1e9, 1.0)) == 1 \
        and calls == []


def test_fixed_mode_and_determinism():
    policy = SpeculationPolicy(design_costs(), mode="fixed", fixed_len=16)
    assert policy.choose(128, iid_tracker(0.1)) == 16
    assert policy.explain(128, iid_tracker(0.1))["choice"] == 16
    adaptive = SpeculationPolicy(design_costs())
    t = AcceptanceTracker()
    feed(t, 0.7, steps=50, seed=4)
    choices = {adaptive.choose(b, t) for b in (1, 8, 32, 64, 128) for _ in range(3)}
    assert all(adaptive.choose(32, t) == adaptive.choose(32, t) for _ in range(5))
    assert choices <= {1, 4, 8, 16}


def test_policy_validation():
    cm = design_costs()
    with pytest.raises(ValueError):
        SpeculationPolicy(cm, mode="greedy")
    with pytest.raises(ValueError):
        SpeculationPolicy(cm, block_lens=(4, 12))  # 12 not measured
    with pytest.raises(ValueError):
        SpeculationPolicy(cm, block_lens=(1, 4))
    with pytest.raises(ValueError):
        SpeculationPolicy(cm, mode="fixed", fixed_len=12)
    with pytest.raises(ValueError):
        SpeculationPolicy(cm, min_gain=0)


def test_rates_consistent_with_costs():
    cm = design_costs()
    policy = SpeculationPolicy(cm)
    t = iid_tracker(0.86)
    for b in (1, 8, 20, 32, 100, 128, 256):
        rates = policy.rates(b, t)
        for L in (4, 8, 16):
            assert rates[L] == pytest.approx(b * closed_form(0.86, L) / cm.cost(b, L))
        best = max((4, 8, 16), key=lambda L: (rates[L], -L))
        assert policy.choose(b, t) == (best if rates[best] > rates[1] else 1)


# H200 start-up profile (policy_sweep run 7), ms per step at B=256 by block length, and the
# decode-phase step times measured in that run's plain and fixed-4 cells (host included).
H200_B256_MS = {1: 12.00, 4: 38.12, 8: 69.80, 16: 136.42}


def test_live_overhead_moves_the_choice_like_the_h200_measurements():
    """B=256, a=0.86: by the profile alone block 4 is 1.02x plain (under the engine's 1.05 bar:
    plain); with the ~4 ms per step the H200 really paid on top of it, 1.23x: block 4, as the
    run measured (fixed 4 beat plain decoding). At a=0.6 plain stays best either way."""
    cm = StepCostModel({L: {256: t / 1e3} for L, t in H200_B256_MS.items()})
    policy = SpeculationPolicy(cm, min_gain=1.05)
    overhead = StepOverhead()
    policy.overhead = overhead
    assert policy.choose(256, iid_tracker(0.86)) == 1
    assert policy.explain(256, iid_tracker(0.86))["overhead_s"][4] == 0.0
    for _ in range(5):
        overhead.observe(256, 1, cm.cost(256, 1), 0.016)
    info = policy.explain(256, iid_tracker(0.86))
    assert info["overhead_s"] == pytest.approx({1: 0.004, 4: 0.004, 8: 0.004, 16: 0.004})
    assert info["rates"][1] == pytest.approx(256 / 0.016)
    assert info["rates"][4] / info["rates"][1] == pytest.approx(
        closed_form(0.86, 4) * 16.0 / 42.12, rel=1e-6)
    assert policy.choose(256, iid_tracker(0.86)) == 4
    assert policy.choose(256, iid_tracker(0.6)) == 1
    assert policy.choose(128, iid_tracker(0.86)) == 1  # no observation at 128: profile alone
    # Block 4's own steps turn out dearer than plain's: its own term. Block 8, unobserved,
    # borrows plain decode's (5.0 x 16 / 73.8 = 1.08x): tried next, then its own term too.
    overhead.observe(256, 4, cm.cost(256, 4), cm.cost(256, 4) + 0.012)
    assert policy.explain(256, iid_tracker(0.86))["overhead_s"][4] == pytest.approx(0.012)
    assert policy.choose(256, iid_tracker(0.86)) == 8
    overhead.observe(256, 8, cm.cost(256, 8), cm.cost(256, 8) + 0.012)
    assert policy.choose(256, iid_tracker(0.86)) == 1


def test_a_mixed_steps_block_is_cut_to_what_fits_beside_its_chunk():
    """policy/mixed_block.py on the H200's measured 8B-shape costs (mixed_step_profile): beside
    a 512-token prompt chunk, 30 streams' blocks of 8 (+6.0 ms over a plain step) go, blocks
    of 4 (+2.4 ms) stay; a small batch's block 16 stays; a host-bound model's short steps are
    never cut; no chunk, no cut; nothing fits: plain decode."""
    from blockspec.policy.mixed_block import MIXED_VERIFY_SHARE, mixed_block_len

    lens = [2, 4, 8, 16]
    # ms at batch 8 and 32, and a 4096-token step setting the cheapest token (23 us)
    h200 = StepCostModel({1: {8: 5.6e-3, 32: 6.3e-3, 256: 14.4e-3},
                          2: {8: 5.9e-3, 32: 7.3e-3, 256: 25e-3},
                          4: {8: 6.2e-3, 32: 8.7e-3, 256: 45e-3},
                          8: {8: 6.6e-3, 32: 12.3e-3, 256: 75e-3},
                          16: {8: 7.6e-3, 32: 18.4e-3, 256: 94.2e-3}})
    assert h200.min_token_cost() == pytest.approx(23e-6, rel=0.01)
    assert mixed_block_len(h200, 32, 8, lens, 512) == 4
    assert mixed_block_len(h200, 32, 16, lens, 512) == 4
    assert mixed_block_len(h200, 32, 2, lens, 512) == 2
    assert mixed_block_len(h200, 8, 16, lens, 512) == 16
    assert mixed_block_len(h200, 32, 8, lens, 0) == 8
    assert mixed_block_len(h200, 32, 1, lens, 512) == 1
    assert mixed_block_len(h200, 32, 16, lens, 16) == 4  # a step of under 10 ms is not cut
    assert mixed_block_len(h200, 256, 16, lens, 16) == 1  # a tiny chunk: nothing fits
    # a bigger chunk carries a longer block: the verify's share of the step is what is bounded
    assert mixed_block_len(h200, 32, 16, lens, 2048) == 8
    assert 12.3 - 6.3 <= MIXED_VERIFY_SHARE * 2048 * 23e-3
    tiny = StepCostModel({L: {1: 2e-4 * L, 256: 1e-3 * L} for L in [1, *lens]})
    assert mixed_block_len(tiny, 32, 16, lens, 512) == 16
