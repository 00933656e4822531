"""The computed state of shared prefix caches (issue 14), exact: which writer's lookup hits which
block when, what a confirmation promotes, what a duplicate or a dropped writer leaves behind."""

import numpy as np
import pytest

from kvd import errors
from kvd.api import STATUS_OK, AdmitRequest, GroupSpec, ManagerConfig, StepBatch
from kvd.hashing import hash_prompt
from kvd.manager import BlockManager

BS = 4


@pytest.fixture
def m():
    return BlockManager(ManagerConfig(num_gpu_blocks=16, max_model_len=64, max_num_reqs=8, groups=(GroupSpec(BS),),
                                      debug_checks=True))


PROMPT = np.arange(13, dtype=np.int32)  # three full blocks and one token
HASHES = hash_prompt(PROMPT, BS)


def test_a_block_is_a_hit_for_another_writer_only_after_its_writer_confirms(m):
    a = m.allocate("a", 13, HASHES, writer=1)
    assert a.block_ids.tolist() == [1, 2, 3, 4] and m.tick == 1
    # Writer 1's own later lookups see its blocks (its passes run in order) ...
    assert m.lookup(HASHES, writer=1) == 3
    # ... nobody else does: B computes the prompt again, into blocks of its own.
    b = m.allocate("b", 13, HASHES, writer=2)
    assert b.num_cached_tokens == 0 and b.block_ids.tolist() == [5, 6, 7, 8]
    assert m.lookup(HASHES) == 0 and m.lookup(HASHES, writer=3) == 0
    assert m.stats()["num_pending_blocks"] == 6
    m.mark_computed(1, 1)
    assert m.lookup(HASHES, writer=2) == 3 and m.lookup(HASHES) == 3
    c = m.allocate("c", 13, HASHES, writer=3)
    assert c.num_cached_tokens == 12 and c.block_ids.tolist() == [1, 2, 3, 9]
    assert m.pool.ref_cnt[1:10].tolist() == [2, 2, 2, 1, 1, 1, 1, 1, 1]
    # B's confirmation finds A's copies shared: its duplicates stop being cached.
    m.mark_computed(2, m.tick)
    assert m.pool.cache_key[5:8].tolist() == [0, 0, 0]
    assert m.pool.cache_key[1:4].tolist() == [1, 1, 1] and m.stats()["num_pending_blocks"] == 0
    m.free("b")
    assert m.pool.free_queue_order()[:4].tolist() == [5, 6, 7, 8]  # uncached: front of the queue


def test_a_freed_unconfirmed_duplicate_goes_to_the_front_of_the_free_queue_when_promoted(m):
    m.allocate("a", 13, HASHES, writer=1)
    m.allocate("b", 13, HASHES, writer=2)
    m.mark_computed(1, m.tick)
    m.free("b")  # B's blocks are cached in its pending map: evictable, at the back
    assert m.pool.free_queue_order().tolist() == [8, 9, 10, 11, 12, 13, 14, 15, 7, 6, 5]
    m.mark_computed(2, m.tick)
    assert m.pool.free_queue_order().tolist() == [7, 6, 5, 8, 9, 10, 11, 12, 13, 14, 15]  # leaf first
    assert m.pool.cache_key[5:9].tolist() == [0, 0, 0, 0]


def test_confirmation_is_per_tick_and_per_writer(m):
    m.allocate("a", 13, HASHES, writer=1)  # tick 1
    other = hash_prompt(PROMPT + 100, BS)
    m.allocate("x", 13, other, writer=1)  # tick 2
    m.allocate("y", 13, other, writer=2)  # tick 3: writer 2's, unaffected below
    m.mark_computed(1, 1)
    assert m.lookup(HASHES) == 3 and m.lookup(other) == 0
    m.mark_computed(2, 3)
    assert m.lookup(other) == 3  # writer 2's copy of `other`
    assert m.block_table("y")[:3].tolist() == m.pool.lookup(m._cache_key(0, 0), other).tolist()
    m.mark_computed(1, 2)  # writer 1's copy now duplicates writer 2's: dropped
    assert m.pool.cache_key[m.block_table("x")[:3]].tolist() == [0, 0, 0]


def test_an_entry_evicted_and_stored_again_waits_for_the_later_tick():
    m = BlockManager(ManagerConfig(num_gpu_blocks=5, max_model_len=64, max_num_reqs=8, groups=(GroupSpec(BS),),
                                   debug_checks=True))
    m.allocate("a", 13, HASHES, writer=1)  # tick 1: blocks 1-4, three of them pending
    m.free("a")
    m.allocate("f", 16)  # tick 2: every block of the pool: a's are evicted
    assert m.stats()["num_pending_blocks"] == 0
    m.free("f")
    a2 = m.allocate("a2", 13, HASHES, writer=1)  # tick 3: stored again, in the same four blocks
    assert sorted(a2.block_ids.tolist()) == [1, 2, 3, 4]
    m.mark_computed(1, 1)
    assert m.lookup(HASHES) == 0, "tick 1's confirmation must not promote tick 3's blocks"
    m.mark_computed(1, 3)
    assert m.lookup(HASHES) == 3 and m.block_table("a2")[:3].tolist() == m.pool.lookup(
        m._cache_key(0, 0), HASHES).tolist()


def test_drop_writer_forgets_what_it_never_confirmed(m):
    m.allocate("a", 13, HASHES, writer=1)
    before = m.pool.cache_key.copy()
    with pytest.raises(errors.InvalidArgument):
        m.drop_writer(1)  # it still holds a request
    assert np.array_equal(m.pool.cache_key, before)
    m.free("a")
    m.drop_writer(1)
    assert m.pool.cache_key[1:5].tolist() == [0, 0, 0, 0]
    assert m.pool.free_queue_order().tolist() == list(range(1, 16))
    assert m.lookup(HASHES, writer=1) == 0 and m.stats()["num_pending_blocks"] == 0
    m.check_invariants(heavy=True)


def test_mark_computed_rejects_a_tick_from_the_future(m):
    m.allocate("a", 13, HASHES, writer=1)
    for bad in (2, -1, "1", 1.0):
        with pytest.raises(errors.InvalidArgument):
            m.mark_computed(1, bad)
    assert m.lookup(HASHES) == 0 and m.stats()["num_pending_blocks"] == 3


def test_namespaces_never_see_each_other(m):
    m.allocate("a", 13, HASHES, namespace=1)
    m.allocate("b", 13, HASHES, namespace=2, writer=1)
    m.mark_computed(1, m.tick)
    assert m.lookup(HASHES, namespace=1) == 3 and m.lookup(HASHES, namespace=2) == 3
    assert m.lookup(HASHES) == 0
    assert m.block_table("a")[:3].tolist() == [1, 2, 3] and m.block_table("b")[:3].tolist() == [5, 6, 7]


def test_steps_confirm_the_previous_step_and_batched_admissions_stay_pending(m):
    r1 = m.step(StepBatch(admit=[AdmitRequest("a", 13, HASHES)]), writer=1)
    assert r1.admit_status.tolist() == [STATUS_OK] and r1.tick == m.tick
    log = m.pool.event_log = []
    r2 = m.step(StepBatch(admit=[AdmitRequest("b", 13, HASHES)]), writer=2)
    assert r2.admit_cached_tokens.tolist() == [0] and log == []  # pending stores publish nothing
    m.step(StepBatch(computed_through=r1.tick), writer=1)
    assert [e[0] for e in log] == ["stored"] and log[0][2] == HASHES.tolist()
    r4 = m.step(StepBatch(admit=[AdmitRequest("c", 13, HASHES)], computed_through=r2.tick), writer=2)
    assert r4.admit_cached_tokens.tolist() == [12]
    assert m.block_table("c")[:3].tolist() == m.block_table("a")[:3].tolist() == [1, 2, 3]


def test_a_daemon_promotes_a_large_confirmation_in_bounded_batches(monkeypatch):
    import kvd.manager as M

    monkeypatch.setattr(M, "PROMOTE_BATCH", 2)
    m = BlockManager(ManagerConfig(num_gpu_blocks=16, max_model_len=64, max_num_reqs=8, groups=(GroupSpec(BS),),
                                   debug_checks=True, defer_cache_registration=True))
    m.allocate("a", 13, HASHES, writer=1)
    m.mark_computed(1, m.tick)
    m.flush_deferred()  # two of the three blocks: the third waits for the next call
    assert m.pool.cache_key[1:4].tolist() == [1, 1, 1]  # one shared map (key 1) ...
    assert m.pool.unconfirmed_by[1:4].tolist() == [0, 0, 2]  # ... the third still writer 1's (side key 2)
    assert m.pool.lookup(m._cache_key(0, 0), HASHES).tolist() == [1, 2]
    assert m.lookup(HASHES) == 3  # the next call goes on with it first
    assert m.pool.unconfirmed_by[1:4].tolist() == [0, 0, 0] and m.stats()["num_pending_blocks"] == 0


def test_confirmations_waiting_for_promotion_budget_stay_one_per_writer(monkeypatch):
    """A backlog longer than a flush's budget: confirmations wait in the order they first waited,
    a writer's later ones merge into its waiting one (however many steps confirm meanwhile), and
    every flush promotes exactly its budget's worth in that order."""
    import kvd.manager as M

    monkeypatch.setattr(M, "PROMOTE_BATCH", 2)
    m = BlockManager(ManagerConfig(num_gpu_blocks=16, max_model_len=64, max_num_reqs=8, groups=(GroupSpec(BS),),
                                   debug_checks=True, defer_cache_registration=True))
    for rid, writer, shift in (("a", 1, 0), ("b", 2, 100), ("c", 1, 200)):  # ticks 1, 2, 3
        assert m.allocate(rid, 13, hash_prompt(PROMPT + shift, BS), writer=writer).ok
    assert [m.block_table(r).tolist() for r in "abc"] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]

    def unconfirmed():
        return np.flatnonzero(m.pool.unconfirmed_by).tolist()

    m.mark_computed(1, 1)
    m.mark_computed(2, 2)
    m.mark_computed(1, 3)
    assert m.num_deferred == 3
    m.flush_deferred()
    assert unconfirmed() == [3, 5, 6, 7, 9, 10, 11] and m._waiting == {1: 3, 2: 2} and m.num_deferred == 2
    for _ in range(20):  # steps confirming while the backlog lasts
        m.mark_computed(1, 3)
    assert m.num_deferred == 22
    m.flush_deferred()  # writer 1's merged confirmation first: its block 3, then its tick-3 blocks
    assert unconfirmed() == [5, 6, 7, 10, 11] and m._waiting == {1: 3, 2: 2} and m.num_deferred == 2
    m.flush_deferred()
    assert unconfirmed() == [5, 6, 7] and m._waiting == {2: 2}
    m.flush_deferred()
    assert unconfirmed() == [7] and m._waiting == {2: 2}
    m.flush_deferred()
    assert unconfirmed() == [] and m._waiting == {} and m.num_deferred == 0
    assert m.lookup(hash_prompt(PROMPT + 100, BS), writer=3) == 3


def test_a_race_loser_keeps_its_copy_in_its_side_map_and_the_first_confirmed_copy_wins(m):
    m.allocate("a", 13, HASHES, writer=1)  # blocks 1-3 in the shared map, unconfirmed by writer 1
    b = m.allocate("b", 13, HASHES, writer=2)  # A's entries are hidden from B: B's copies, side map
    assert b.block_ids.tolist() == [5, 6, 7, 8]
    shared, side_a, side_b = m._cache_key(0, 0), m._cache_key(m._space(0, 1), 0), m._cache_key(m._space(0, 2), 0)
    assert m.pool.cache_key[1:9].tolist() == [shared] * 3 + [0] + [side_b] * 3 + [0]
    assert m.pool.unconfirmed_by[1:9].tolist() == [side_a] * 3 + [0] + [side_b] * 3 + [0]
    assert m.lookup(HASHES, writer=2) == 3 and m.block_table("b")[:3].tolist() == [5, 6, 7]
    assert m.pool.lookup(shared, HASHES, side_b).tolist() == [5, 6, 7]
    m.mark_computed(2, m.tick)  # B confirms first: its copies replace A's unconfirmed entries
    assert m.pool.caches[shared] == dict(zip(HASHES.tolist(), [5, 6, 7])) and not m.pool.caches.get(side_b)
    assert m.pool.cache_key[1:4].tolist() == [0, 0, 0] and m.stats()["num_pending_blocks"] == 0
    assert m.lookup(HASHES) == 3 and m.lookup(HASHES, writer=1) == 3  # A now sees B's blocks
    m.mark_computed(1, m.tick)  # nothing of A's is still cached unconfirmed: a no-op
    assert m.pool.cache_key[1:4].tolist() == [0, 0, 0]
    m.free("a")
    assert m.pool.free_queue_order()[:4].tolist() == [1, 2, 3, 4]  # uncached: front of the queue
    m.check_invariants(heavy=True)


def test_a_confirmed_registration_replaces_an_unconfirmed_entry(m):
    m.allocate("a", 13, HASHES, writer=1)
    z = m.allocate("z", 13, HASHES)  # writer 0: computed by the time anyone looks
    assert z.num_cached_tokens == 0 and z.block_ids.tolist() == [5, 6, 7, 8]
    assert m.pool.lookup(m._cache_key(0, 0), HASHES).tolist() == [5, 6, 7]
    assert m.pool.cache_key[1:4].tolist() == [0, 0, 0] and m.stats()["num_pending_blocks"] == 0
    assert m.lookup(HASHES, writer=1) == 3
    m.check_invariants(heavy=True)


def test_drop_writer_removes_its_unconfirmed_shared_and_side_entries_only(m):
    m.allocate("a", 13, HASHES, writer=1)  # 1-3: shared, unconfirmed by 1
    m.allocate("b", 13, HASHES, writer=2)  # 5-7: writer 2's side map
    other = hash_prompt(PROMPT + 100, BS)
    m.allocate("c", 13, other, writer=2)  # 9-11: shared, unconfirmed by 2
    m.mark_computed(1, m.tick)
    for r in ("a", "b", "c"):
        m.free(r)
    m.drop_writer(2)
    shared = m._cache_key(0, 0)
    assert m.pool.caches[shared] == dict(zip(HASHES.tolist(), [1, 2, 3]))
    assert m.pool.cache_key[5:12].tolist() == [0] * 7 and m.stats()["num_pending_blocks"] == 0
    # the dropped blocks became fresh, the most recently freed first; writer 1's stay evictable
    assert m.pool.free_queue_order().tolist() == [9, 10, 11, 5, 6, 7, 12, 8, 4, 13, 14, 15, 3, 2, 1]
    assert m.lookup(HASHES, writer=3) == 3 and m.lookup(other, writer=3) == 0
    m.check_invariants(heavy=True)


def test_a_batched_admission_goes_on_after_a_request_that_races(m):
    m.allocate("a", 13, HASHES, writer=1)  # 1-4, its three full blocks unconfirmed
    other = hash_prompt(PROMPT + 100, BS)
    res = m.step(StepBatch(admit=[AdmitRequest("x", 13, HASHES), AdmitRequest("y", 13, HASHES),
                                  AdmitRequest("z", 13, other)]), writer=2)
    assert res.admit_status.tolist() == [STATUS_OK] * 3
    assert res.admit_cached_tokens.tolist() == [0, 12, 0]  # y hits x's side copy, not a's blocks
    assert [m.block_table(r).tolist() for r in "xyz"] == [[5, 6, 7, 8], [5, 6, 7, 9], [10, 11, 12, 13]]
    side = m._cache_key(m._space(0, 2), 0)
    assert m.pool.caches[side] == dict(zip(HASHES.tolist(), [5, 6, 7]))
    assert m.pool.unconfirmed_by[10:13].tolist() == [side] * 3 and m.pool.cache_key[10:13].tolist() == [1] * 3
    m.check_invariants(heavy=True)


def test_a_manager_without_prefix_caching_registers_nothing_a_decode_step_deferred():
    """A decode step's hashes are deferred like any other's; with prefix caching off its idle
    slices and the full flush store none of them (the slice's fast path checks it too)."""
    m = BlockManager(ManagerConfig(num_gpu_blocks=16, max_model_len=64, max_num_reqs=8, groups=(GroupSpec(BS),),
                                   enable_prefix_caching=False, defer_cache_registration=True))
    for rid in ("a", "b"):
        assert m.allocate(rid, 3, HASHES[:0]).ok
    rows = m.rows_of(["a", "b"])
    res = m.step(StepBatch(append_rows=rows, append_num_tokens=1, append_hashes=(np.concatenate([HASHES[:1]] * 2),),
                           append_hash_counts=(np.array([1, 1], np.int32),)))
    assert res.append_status.tolist() == [STATUS_OK] * 2 and m.num_deferred == 1
    assert m.flush_deferred(1) == 1 and m.num_deferred == 1  # a slice of one request
    assert m.flush_deferred() == 1 and m.num_deferred == 0
    assert m.pool.caches == {} and not m.pool.cache_key.any() and m.lookup(HASHES) == 0
    assert [m.block_table(r).tolist() for r in "ab"] == [[1], [2]]


def test_a_lone_admission_registers_its_prompt_after_the_reply_under_the_admissions_tick():
    """defer_cache_registration (the daemon's): a step's lone admission leaves its prompt's
    registration for later, as a decode step its filled blocks; what it registers then counts under
    the admission's tick, so the confirmation of that tick makes the prompt a hit for others."""
    def fresh(defer):  # without debug checks: their invariant check runs deferred work
        return BlockManager(ManagerConfig(num_gpu_blocks=16, max_model_len=64, max_num_reqs=8, groups=(GroupSpec(BS),),
                                          defer_cache_registration=defer))

    m, now = fresh(True), fresh(False)
    for x in (m, now):
        res = x.step(StepBatch(admit=[AdmitRequest("a", 13, HASHES)]), writer=1)
        assert res.admit_status.tolist() == [STATUS_OK] and x.block_table("a").tolist() == [1, 2, 3, 4]
    key = now.pool.cache_key[1]
    assert key != 0 and now.pool.cache_key[1:5].tolist() == [key, key, key, 0] and now.num_deferred == 0
    assert m.pool.cache_key[1:5].tolist() == [0, 0, 0, 0] and m.num_deferred == 1  # after the reply
    # A decode step that registers nothing goes before it (tick 2) ...
    m.step(StepBatch(append_rows=m.rows_of(["a"]), append_num_tokens=1), writer=1)
    assert m.tick == 2 and m.num_deferred == 1 and m.block_table("a").tolist() == [1, 2, 3, 4]
    assert m.flush_deferred() == 1 and m.num_deferred == 0
    assert m.pool.cache_key[1:5].tolist() == [key, key, key, 0]
    assert m.lookup(HASHES, writer=2) == 0  # unconfirmed
    m.mark_computed(1, 1)  # ... and the admission's tick confirms the prompt
    assert m.lookup(HASHES, writer=2) == 3 and m.pool.cache_key[1:4].tolist() == [1, 1, 1]
    m.check_invariants(heavy=True)


def test_a_step_with_several_admissions_registers_them_at_once():
    m = BlockManager(ManagerConfig(num_gpu_blocks=16, max_model_len=64, max_num_reqs=8, groups=(GroupSpec(BS),),
                                   defer_cache_registration=True))
    m.step(StepBatch(admit=[AdmitRequest("a", 13, HASHES), AdmitRequest("b", 13, HASHES)]))
    assert m.num_deferred == 0 and m.block_table("b").tolist() == [1, 2, 3, 5]  # b hits a's blocks in the step
