"""BlockManager (ref counts, prefix cache, LRU eviction) and Scheduler (preemption) unit tests."""

from __future__ import annotations

import pytest

from blockspec import SamplingParams
from blockspec.engine.kv_cache import BlockManager, NoFreeBlocksError
from blockspec.engine.scheduler import Scheduler
from blockspec.engine.sequence import Sequence, SequenceStatus

BS = 4


def make_seq(tokens: list[int], rid: str = "r", max_tokens: int = 8) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens), max_tokens)


def run_prefill(bm: BlockManager, seq: Sequence) -> int:
    """What the engine does for a fresh sequence: match the prefix, allocate, compute, publish."""
    cached = bm.match_prefix(seq)
    bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)
    return cached


def check_invariants(bm: BlockManager) -> None:
    assert all(rc >= 0 for rc in bm.ref_counts)
    for b in range(bm.num_blocks):
        assert (bm.ref_counts[b] == 0) == (b in bm.free_blocks)
    for h, b in bm.hash_to_block.items():
        assert bm.block_hash[b] == h


# -- allocation and reference counts ---------------------------------------------------------------
def test_allocate_and_free_ref_counts():
    bm = BlockManager(8, BS)
    seq = make_seq(range(1, 11))
    assert bm.blocks_for(10) == 3 and bm.num_blocks_needed(seq, 10) == 3
    bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert all(bm.ref_counts[b] == 1 for b in seq.block_table)
    assert bm.num_free_blocks == 5 and bm.num_used_blocks == 3 and bm.usage == 3 / 8
    seq.num_computed_tokens = 10
    assert bm.num_blocks_needed(seq, 2) == 0  # 12 tokens still fit in 3 blocks
    bm.allocate(seq, 2)
    assert len(seq.block_table) == 3
    bm.allocate(seq, 3)  # 13 tokens: one more block
    assert len(seq.block_table) == 4
    table = list(seq.block_table)
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert all(bm.ref_counts[b] == 0 for b in table)
    assert bm.num_free_blocks == 8
    check_invariants(bm)


def test_slots_follow_block_table():
    bm = BlockManager(8, BS)
    seq = make_seq(range(1, 10))
    bm.allocate(seq, 9)
    for p in range(9):
        assert bm.slot(seq, p) == seq.block_table[p // BS] * BS + p % BS


def test_allocate_beyond_capacity_raises():
    bm = BlockManager(2, BS)
    seq = make_seq(range(1, 12))
    assert not bm.can_allocate(seq, 9)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(seq, 9)
    assert bm.num_free_blocks == 2 and seq.block_table == []


def test_double_free_is_caught():
    bm = BlockManager(4, BS)
    seq = make_seq(range(1, 5))
    bm.allocate(seq, 4)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    with pytest.raises(AssertionError):
        bm.free(seq)


# -- prefix cache ----------------------------------------------------------------------------------
def test_prefix_match_shares_blocks():
    bm = BlockManager(16, BS)
    a = make_seq(range(1, 14), "a")  # 13 tokens: 3 full blocks + 1
    assert run_prefill(bm, a) == 0
    b = make_seq(list(range(1, 13)) + [99, 98], "b")  # same first 3 blocks
    assert bm.match_prefix(b) == 12
    assert b.block_table == a.block_table[:3]
    assert b.num_computed_tokens == 12
    assert all(bm.ref_counts[blk] == 2 for blk in a.block_table[:3])
    assert bm.ref_counts[a.block_table[3]] == 1
    bm.allocate(b, 2)
    assert b.block_table[3] != a.block_table[3]
    bm.free(a)
    assert all(bm.ref_counts[blk] == 1 for blk in b.block_table[:3])
    bm.free(b)
    assert bm.num_free_blocks == 16
    check_invariants(bm)


def test_prefix_match_stops_at_first_difference():
    bm = BlockManager(16, BS)
    run_prefill(bm, make_seq(range(1, 14), "a"))
    b = make_seq([1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12, 13], "b")  # differs in block 1
    assert bm.match_prefix(b) == 4 and len(b.block_table) == 1
    c = make_seq([7] + list(range(2, 14)), "c")  # differs in block 0: no later block may match
    assert bm.match_prefix(c) == 0 and c.block_table == []


def test_same_block_tokens_after_different_prefix_do_not_match():
    bm = BlockManager(16, BS)
    run_prefill(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a"))
    b = make_seq([9, 9, 9, 9, 5, 6, 7, 8, 9], "b")
    assert bm.match_prefix(b) == 0


@pytest.mark.parametrize("n,expected", [(4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12)])
def test_last_token_never_served_from_cache(n, expected):
    bm = BlockManager(16, BS)
    run_prefill(bm, make_seq(range(1, 17), "a"))  # 16 tokens, 4 hashed blocks
    b = make_seq(range(1, n + 1), "b")
    assert bm.match_prefix(b) == expected
    assert b.num_computed_tokens < b.num_tokens


def test_block_aligned_identical_prompt():
    bm = BlockManager(16, BS)
    a = make_seq(range(1, 9), "a")
    run_prefill(bm, a)
    b = make_seq(range(1, 9), "b")
    assert bm.match_prefix(b) == 4  # not 8: the last token's logits must be computed
    bm.allocate(b, 4)
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_only_full_computed_blocks_are_registered():
    bm = BlockManager(16, BS)
    a = make_seq(range(1, 11), "a")
    bm.allocate(a, 10)
    a.num_computed_tokens = 6  # a chunked prefill part way through block 1
    bm.register_full_blocks(a)
    assert len(bm.hash_to_block) == 1 and a.num_hashed_blocks == 1
    a.num_computed_tokens = 10
    bm.register_full_blocks(a)
    assert len(bm.hash_to_block) == 2 and a.num_hashed_blocks == 2
    b = make_seq(range(1, 12), "b")
    assert bm.match_prefix(b) == 8


def test_prefix_caching_disabled():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    run_prefill(bm, make_seq(range(1, 14), "a"))
    assert bm.hash_to_block == {}
    assert bm.match_prefix(make_seq(range(1, 14), "b")) == 0


def test_freed_hashed_blocks_are_reused():
    bm = BlockManager(8, BS)
    a = make_seq(range(1, 10), "a")
    run_prefill(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 8  # freed, but still findable by hash
    b = make_seq(list(range(1, 9)) + [50, 51], "b")
    assert bm.match_prefix(b) == 8
    assert b.block_table == table[:2]
    assert all(bm.ref_counts[blk] == 1 for blk in table[:2])
    assert all(blk not in bm.free_blocks for blk in table[:2])
    assert bm.num_free_blocks == 6
    hits = bm.num_prefix_hits
    bm.free(b)
    assert bm.num_prefix_hits == hits
    check_invariants(bm)


def test_lru_eviction_order_and_hash_removal():
    """Allocation takes the least recently freed block first; a freed sequence's tail block goes
    before its head; evicting a block drops its hash."""
    bm = BlockManager(4, BS)
    a = make_seq(range(1, 9), "a")  # blocks 0, 1
    b = make_seq(range(11, 19), "b")  # blocks 2, 3
    run_prefill(bm, a)
    run_prefill(bm, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    assert len(bm.hash_to_block) == 4
    bm.free(a)
    bm.free(b)
    c = make_seq(range(21, 25), "c")
    bm.allocate(c, 4)
    assert c.block_table == [a_blocks[1]]  # a's tail: freed first, a tail before its head
    assert bm.block_hash[a_blocks[1]] is None and len(bm.hash_to_block) == 3
    assert a_blocks[1] not in bm.hash_to_block.values()
    # a's head block survives; its tail block is gone.
    a2 = make_seq(range(1, 10), "a2")
    assert bm.match_prefix(a2) == 4 and a2.block_table == [a_blocks[0]]
    # b is fully cached still.
    b2 = make_seq(range(11, 20), "b2")
    assert bm.match_prefix(b2) == 8 and b2.block_table == b_blocks
    check_invariants(bm)


def test_recently_used_blocks_are_evicted_last():
    bm = BlockManager(4, BS)
    a = make_seq(range(1, 5), "a")
    b = make_seq(range(11, 15), "b")
    filler = make_seq(range(21, 29), "f")
    run_prefill(bm, a)
    run_prefill(bm, b)
    bm.allocate(filler, 8)
    bm.free(a)
    bm.free(b)
    bm.free(filler)
    # Touch a's block again (a hit moves it to the most recently used end when freed).
    a2 = make_seq(range(1, 6), "a2")
    assert bm.match_prefix(a2) == 4
    bm.free(a2)
    c = make_seq(range(31, 43), "c")
    bm.allocate(c, 12)  # takes 3 of the 4 blocks: b's and filler's, not a's
    assert a.block_table == [] and bm.num_free_blocks == 1
    a3 = make_seq(range(1, 6), "a3")
    assert bm.match_prefix(a3) == 4
    b3 = make_seq(range(11, 16), "b3")
    assert bm.match_prefix(b3) == 0
    check_invariants(bm)


def test_evicted_block_is_not_matched_after_reuse():
    bm = BlockManager(2, BS)
    a = make_seq(range(1, 9), "a")
    run_prefill(bm, a)
    bm.free(a)
    c = make_seq(range(100, 108), "c")
    run_prefill(bm, c)  # overwrites both blocks with other tokens
    bm.free(c)
    a2 = make_seq(range(1, 10), "a2")
    assert bm.match_prefix(a2) == 0
    c2 = make_seq(range(100, 109), "c2")
    assert bm.match_prefix(c2) == 8
    check_invariants(bm)


# -- scheduler -------------------------------------------------------------------------------------
def step(sched: Scheduler) -> tuple[list[str], int]:
    """One engine step without a model: commit computed tokens; finished prefills get a token."""
    out = sched.schedule()
    for seq, n in zip(out.seqs, out.num_new_tokens):
        seq.num_computed_tokens += n
        sched.block_manager.register_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(7)
    return [s.request_id for s in out.seqs], out.num_preempted


def test_scheduler_admits_in_order_with_budget_and_max_seqs():
    bm = BlockManager(64, BS)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100)
    for rid in "abc":
        sched.add(make_seq(range(1, 6), rid))
    ids, _ = step(sched)
    assert ids == ["a", "b"] and [s.request_id for s in sched.waiting] == ["c"]
    assert all(s.status == SequenceStatus.RUNNING for s in sched.running)


def test_scheduler_chunks_prefill_to_the_token_budget():
    bm = BlockManager(64, BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    a, b = make_seq(range(1, 26), "a"), make_seq(range(1, 4), "b")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["a"] and out.num_new_tokens == [10]
    a.num_computed_tokens += 10
    out = sched.schedule()
    assert out.num_new_tokens == [10]
    a.num_computed_tokens += 10
    out = sched.schedule()  # a's last 5 tokens, then b fills the rest of the budget
    assert [s.request_id for s in out.seqs] == ["a", "b"] and out.num_new_tokens == [5, 3]
    assert out.total_tokens == 8


def test_scheduler_budget_lookahead_counts_fewer_tokens_but_keeps_the_blocks():
    """A decoding sequence reserves its drafts' K/V blocks (num_lookahead_slots) whatever the
    budget_lookahead, but counts only budget_lookahead of them against the token budget, so a
    waiting prefill gets the rest of the step."""
    for budget_lookahead, chunks in ((7, [1, 2]), (0, [1, 8])):
        bm = BlockManager(64, BS, enable_prefix_caching=False)
        sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10, num_lookahead_slots=7)
        a = make_seq(range(1, 4), "a")
        sched.add(a)
        step(sched)  # a's prefill; a now decodes
        sched.add(make_seq(range(1, 9), "b"))
        out = sched.schedule(budget_lookahead=budget_lookahead)
        assert [s.request_id for s in out.seqs] == ["a", "b"] and out.num_new_tokens == chunks
        assert len(a.block_table) == bm.blocks_for(a.num_computed_tokens + 1 + 7)


def test_scheduler_preempts_newest_first():
    bm = BlockManager(6, BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b, c = (make_seq(range(1, 9), rid) for rid in "abc")  # 8 tokens = 2 blocks each
    for s in (a, b, c):
        sched.add(s)
    ids, pre = step(sched)
    assert ids == ["a", "b", "c"] and pre == 0 and bm.num_free_blocks == 0
    d = make_seq(range(1, 3), "d")
    sched.add(d)
    # Each now has 9 tokens (8 computed + 1 sampled) and needs a third block: c, the newest,
    # is preempted, its two blocks feed a and b, and nothing new is admitted this step.
    ids, pre = step(sched)
    assert ids == ["a", "b"] and pre == 1
    assert c.status == SequenceStatus.WAITING and c.block_table == []
    assert c.num_computed_tokens == 0 and c.output_token_ids == [7]
    assert c.metrics.num_preemptions == 1 and sched.num_preemptions == 1
    assert [s.request_id for s in sched.waiting] == ["c", "d"]  # back at the front
    assert [s.request_id for s in sched.running] == ["a", "b"]
    assert bm.num_free_blocks == 0


def test_scheduler_preempts_several_newest_first_and_requeues_oldest_first():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    seqs = [make_seq(range(1, 8), rid) for rid in "abcd"]  # 7 tokens = 2 blocks each
    for s in seqs:
        sched.add(s)
    step(sched)
    assert bm.num_free_blocks == 0
    seqs[0].output_token_ids += [7] * 5  # a jumps to 13 tokens: it needs 2 more blocks
    ids, pre = step(sched)
    assert pre == 1 and ids == ["a", "b", "c"]  # d (newest) gave its 2 blocks to a
    seqs[1].output_token_ids += [7] * 5
    ids, pre = step(sched)
    assert pre == 1 and ids[:2] == ["a", "b"]
    assert [s.request_id for s in sched.waiting] == ["c", "d"]
    assert [s.status for s in seqs] == [SequenceStatus.RUNNING] * 2 + [SequenceStatus.WAITING] * 2


def test_scheduler_preempts_itself_when_it_is_the_newest():
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(range(1, 5), "a"), make_seq(range(1, 9), "b")  # 1 + 2 blocks
    sched.add(a)
    sched.add(b)
    step(sched)
    b.output_token_ids += [7] * 4  # b needs 2 more blocks, only 1 is free
    ids, pre = step(sched)
    assert pre == 1 and ids == ["a"]
    assert b.status == SequenceStatus.WAITING and list(sched.waiting) == [b]


def test_scheduler_readmits_preempted_sequence_for_recompute():
    bm = BlockManager(6, BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b, c = (make_seq(range(1, 9), rid) for rid in "abc")
    for s in (a, b, c):
        sched.add(s)
    step(sched)
    step(sched)  # c preempted
    sched.finish(a, "stop")
    assert a.status == SequenceStatus.FINISHED and a.block_table == []
    ids, pre = step(sched)
    assert pre == 0 and ids == ["b", "c"]
    # c recomputes its prompt and its generated token (9 tokens) in one prefill.
    assert c.num_computed_tokens == 9 and c.output_token_ids == [7, 7]


def test_finish_waiting_sequence():
    bm = BlockManager(6, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a = make_seq(range(1, 9), "a")
    sched.add(a)
    sched.finish(a, "abort")
    assert not sched.has_unfinished and a.finish_reason == "abort"
    assert bm.num_free_blocks == 6


def test_decode_prefill_budget_rule():
    from blockspec.engine.scheduler import decode_prefill_budget

    assert decode_prefill_budget(None, 0, 8192) == 8192  # nothing decodes: the whole step
    assert decode_prefill_budget(None, 1, 8192) == 512
    assert decode_prefill_budget(None, 32, 8192) == 512
    assert decode_prefill_budget(None, 64, 8192) == 768
    assert decode_prefill_budget(None, 85, 8192) == 1020
    # past MAX_STEP (1024) tokens of decodes and the floor or per-decode term: no cap
    assert decode_prefill_budget(None, 86, 8192) == 8192
    assert decode_prefill_budget(None, 256, 8192) == 8192
    assert decode_prefill_budget(None, 256, 2048) == 2048
    assert decode_prefill_budget(None, 32, 8192, 0, 32 * 16 + 1) == 8192
    assert decode_prefill_budget(None, 32, 8192, 0, 32 * 16) == 512
    assert decode_prefill_budget(0, 32, 8192) == 8192
    assert decode_prefill_budget(100, 32, 8192) == 100
    # a backlog drains within 16 steps: the budget grows with it; N holds
    assert decode_prefill_budget(None, 32, 8192, pending_prefill_tokens=16 * 512) == 512
    assert decode_prefill_budget(None, 32, 8192, pending_prefill_tokens=16 * 1000) == 1000
    assert decode_prefill_budget(None, 32, 8192, pending_prefill_tokens=10 ** 6) == 8192
    assert decode_prefill_budget(100, 16, 8192, pending_prefill_tokens=10 ** 6) == 100
    # the step fills its graph bucket: 27 verify blocks of 8 (216 tokens) + 512 -> 768
    buckets = [256, 512, 768, 1024, 2048]
    assert decode_prefill_budget(None, 27, 8192, 0, 216, buckets) == 768 - 216
    assert decode_prefill_budget(None, 32, 8192, 0, 256, buckets) == 512
    assert decode_prefill_budget(None, 40, 8192, 10 ** 5, 320, buckets) == 6250  # past them
    assert decode_prefill_budget(300, 27, 8192, 0, 216, buckets) == 300  # N is not rounded


def test_mixed_load_is_what_the_auto_cap_prefills_beside_decodes():
    """(decoding sequences, prompt tokens of the next step beside them before its bucket fill)
    under the auto cap; (0, 0) with no cap, nothing decoding or nothing waiting."""
    from blockspec.bench.mixed_profile import host_state

    sched, _ = host_state(decoding=30, waiting=2)  # the auto cap (None)
    assert sched.mixed_load() == (30, 512)
    for cap in (0, 300):
        sched.decode_step_prefill_tokens = cap
        assert sched.mixed_load() == (0, 0)
    sched.decode_step_prefill_tokens = None
    sched.waiting.pop()
    sched.waiting[0].num_computed_tokens = 400  # a prompt partly computed: its rest
    assert sched.mixed_load() == (30, 112)
    sched.waiting.clear()
    assert sched.mixed_load() == (0, 0)
    assert host_state(decoding=0, waiting=2)[0].mixed_load() == (0, 0)
    sched, _ = host_state(decoding=64, waiting=40)  # a backlog: it drains within 16 steps
    assert sched.mixed_load() == (64, 40 * 512 // 16)


def test_prefill_beside_decodes_is_capped_and_decodes_still_run():
    """With sequences decoding, prefill chunks (a running partial prefill and new admissions)
    share the decode-step prefill budget; a partial prefill that gets none waits while the
    decodes after it in the running list still run."""
    bm = BlockManager(256, BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100,
                      decode_step_prefill_tokens=6)
    a = make_seq(range(1, 4), "a")
    sched.add(a)
    step(sched)  # a's whole prompt: nothing decodes yet, the whole budget
    sched.add(make_seq(range(1, 21), "b"))
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["a", "b"] and out.num_new_tokens == [1, 6]
    b = out.seqs[1]
    b.num_computed_tokens += 6
    a.num_computed_tokens += 1
    a.output_token_ids.append(7)
    sched.running.reverse()  # b (prefilling) ahead of a (decoding)
    sched.decode_step_prefill_tokens = 6
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["b", "a"] and out.num_new_tokens == [6, 1]
    sched.add(make_seq(range(1, 9), "c"))
    b.num_computed_tokens += 6
    a.num_computed_tokens += 1
    a.output_token_ids.append(7)
    out = sched.schedule()  # b takes the prefill budget, c waits, a decodes
    assert [s.request_id for s in out.seqs] == ["b", "a"] and out.num_new_tokens == [6, 1]
    assert [s.request_id for s in sched.waiting] == ["c"]


def test_auto_prefill_cap_grows_with_a_backlog_and_fills_the_bucket(monkeypatch):
    """The auto cap binds while the prompts waiting fit in DRAIN_STEPS capped steps, grows so a
    larger backlog drains within that many steps, and rounds the step up to its graph bucket."""
    import blockspec.engine.scheduler as sched_mod

    monkeypatch.setattr(sched_mod, "DECODE_PREFILL_FLOOR", 4)
    monkeypatch.setattr(sched_mod, "DECODE_PREFILL_PER_DECODE", 1)
    monkeypatch.setattr(sched_mod, "DECODE_PREFILL_DRAIN_STEPS", 2)
    bm = BlockManager(256, BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100,
                      decode_step_prefill_tokens=None)
    for rid in "ab":
        sched.add(make_seq(range(1, 4), rid))
    step(sched)  # a and b prefill whole: nothing decodes yet
    for rid in "cd":
        sched.add(make_seq(range(1, 11), rid))
    out = sched.schedule()  # 2 decode, 20 prompt tokens wait: 10 per step drains them in 2
    assert out.num_new_tokens == [1, 1, 10]
    for seq, n in zip(out.seqs, out.num_new_tokens):
        seq.num_computed_tokens += n
        seq.output_token_ids.append(7)
    sched.add(make_seq(range(1, 9), "e"))
    out = sched.schedule()  # 3 decode, d's 10 + e's 8 wait: ceil(18 / 2) = 9
    assert [s.request_id for s in out.seqs] == ["a", "b", "c", "d"]
    assert out.num_new_tokens == [1, 1, 1, 9]
    bucketed = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100,
                         decode_step_prefill_tokens=None, step_token_buckets=[8, 16])
    bucketed.running, bucketed.waiting = sched.running, sched.waiting
    out = bucketed.schedule()  # the same step: 3 decode + 9 = 12 tokens -> 16: 13 prefill
    assert [s.request_id for s in out.seqs] == ["a", "b", "c", "d", "e"]
    assert out.num_new_tokens == [1, 1, 1, 10, 3]


def test_partial_prefill_without_budget_waits_and_later_decodes_run():
    bm = BlockManager(256, BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100,
                      decode_step_prefill_tokens=5)
    a, b, c = make_seq(range(1, 4), "a"), make_seq(range(1, 21), "b"), make_seq(range(1, 21), "c")
    for seq, done in ((b, 4), (c, 4), (a, 3)):
        sched.add(seq)
        bm.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = done
    sched.waiting.clear()
    sched.running[:] = [b, c, a]
    a.output_token_ids.append(7)  # a decodes
    for seq in (a, b, c):
        seq.status = SequenceStatus.RUNNING
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["b", "a"] and out.num_new_tokens == [5, 1]
