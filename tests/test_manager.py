"""Exact-state tests of BlockManager (foundation API): ids, ref counts, free-queue order, prefix hits,
no-space leaving state unchanged, misuse raising typed errors with nothing changed."""

import copy

import numpy as np
import pytest

from kvd import errors
from kvd.api import STATUS_NO_SPACE, STATUS_OK, AdmitRequest, AllocStatus, GroupSpec, ManagerConfig, StepBatch
from kvd.hashing import hash_prompt
from kvd.manager import BlockManager


def make(num_blocks=16, **kw):
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_reqs", 8)
    return BlockManager(ManagerConfig(num_gpu_blocks=num_blocks, debug_checks=True, **kw))


def prompt(n, start=0):
    return np.arange(start, start + n, dtype=np.int32)


def snapshot(m: BlockManager):
    """Everything observable about the manager's state, for byte-for-byte comparisons."""
    p = m.pool
    return (
        p.ref_cnt.tobytes(), p.cache_key.tobytes(), p.block_hash.tobytes(), p.free_queue_order().tobytes(),
        copy.deepcopy(p.caches), m.tables[0].tobytes(), m.num_blocks[0].tobytes(), m.num_tokens.tobytes(),
        dict(m._row_of), list(m._free_rows), dict(m.counters),
    )


def test_allocate_hands_out_blocks_in_order_and_registers_full_blocks():
    m = make()
    r = m.allocate("a", 40, hash_prompt(prompt(40), 16))
    assert r.ok and r.block_ids.tolist() == [1, 2, 3] and r.num_cached_tokens == 0
    assert m.pool.ref_cnt[1:4].tolist() == [1, 1, 1]
    assert m.pool.cache_key[1:4].tolist() == [1, 1, 0]  # the partial third block is not cached
    assert m.num_free_blocks == 12 and m.block_table("a").tolist() == [1, 2, 3]


def test_prefix_hit_shares_blocks_and_counts_tokens():
    m = make()
    hashes = hash_prompt(prompt(40), 16)
    m.allocate("a", 40, hashes)
    assert m.lookup(hashes) == 2
    r = m.allocate("b", 40, hashes)
    assert r.num_cached_tokens == 32 and r.block_ids.tolist() == [1, 2, 4]
    assert m.pool.ref_cnt[1:5].tolist() == [2, 2, 1, 1]
    s = m.stats()
    assert (s["prefix_queries"], s["prefix_hits"]) == (80, 32) and s["hit_rate"] == pytest.approx(0.4)


def test_a_fully_cached_prompt_recomputes_its_last_block():
    m = make()
    hashes = hash_prompt(prompt(32), 16)
    m.allocate("a", 32, hashes)
    r = m.allocate("b", 32, hashes)
    assert r.num_cached_tokens == 16 and r.block_ids.tolist() == [1, 3]
    assert m.pool.cache_key[3] == 0  # the recomputed copy is not registered twice


def test_free_order_uncached_front_cached_back_tail_first():
    m = make()
    m.allocate("a", 40, hash_prompt(prompt(40), 16))  # 1, 2 cached; 3 partial
    m.allocate("b", 20)  # 4, 5 uncached
    m.free("a")
    assert m.pool.free_queue_order().tolist() == [3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 2, 1]
    m.free("b")
    assert m.pool.free_queue_order().tolist() == [4, 5, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 2, 1]
    assert m.num_free_blocks == 15 and m.usage == 0.0


def test_cached_free_blocks_are_revived_by_a_hit_and_evicted_when_needed():
    m = make(num_blocks=6)
    hashes = hash_prompt(prompt(48), 16)
    m.allocate("a", 48, hashes)  # 1, 2, 3 all cached (full)
    m.free("a")
    assert m.pool.free_queue_order().tolist() == [4, 5, 3, 2, 1]
    r = m.allocate("b", 40, hashes[:2])  # hits 1, 2 (revived); needs one more block
    assert r.block_ids.tolist() == [1, 2, 4] and r.num_cached_tokens == 32
    m.free("b")
    r = m.allocate("c", 80)  # 5 blocks: everything, evicting all three cached blocks
    assert r.block_ids.tolist() == [4, 5, 3, 2, 1]
    assert m.stats()["evictions"] == 3 and m.pool.caches.get(1, {}) == {}


def test_no_space_leaves_everything_unchanged():
    m = make(num_blocks=6)
    m.allocate("a", 48, hash_prompt(prompt(48), 16))
    before = snapshot(m)
    assert m.can_allocate(40) == AllocStatus.LATER
    r = m.allocate("b", 40)
    assert r.status == STATUS_NO_SPACE and not r.ok
    assert snapshot(m) == before
    assert m.append_slots("a", 40).status == STATUS_NO_SPACE
    assert snapshot(m) == before


def test_never_when_bigger_than_the_pool_or_the_model():
    m = make(num_blocks=6)
    assert m.can_allocate(80) == AllocStatus.OK
    assert m.can_allocate(81) == AllocStatus.NEVER
    assert m.allocate("a", 81).status == AllocStatus.NEVER  # as can_allocate said: never retry
    # longer than the model: both raise the same typed error (an argument error, not a status)
    with pytest.raises(errors.InvalidArgument, match="num_tokens must be in"):
        m.can_allocate(257)
    with pytest.raises(errors.InvalidArgument, match="num_tokens must be in"):
        m.allocate("a", 257)
    assert m.num_requests == 0 and m.num_free_blocks == 5
    # a step's admissions answer the same, batched or one by one
    res = m.step(StepBatch(admit=[AdmitRequest("n", 81), AdmitRequest("o", 80), AdmitRequest("p", 16)]))
    assert res.admit_status.tolist() == [AllocStatus.NEVER, AllocStatus.OK, AllocStatus.LATER]


def test_batched_admission_hits_its_own_new_blocks_without_paying_for_them_twice():
    """A request of a step that hits blocks an earlier request of the same step registered owes no
    block for them: they are that earlier request's new blocks, not cached ones it revives. With an
    evictable block in the pool the batch used to count them as revived and refuse (found by the
    sharing machine)."""
    m = make(num_blocks=10, max_model_len=40, groups=(GroupSpec(4),))
    x = prompt(4)
    m.allocate("x", 4, hash_prompt(x, 4))
    m.free("x")  # block 1: cached, evictable; 8 fresh blocks
    a, b = prompt(5), prompt(17, 100)
    res = m.step(StepBatch(admit=[AdmitRequest("a", 5, hash_prompt(a, 4)),  # hits block 1, takes 1 more
                                  AdmitRequest("b", 9, hash_prompt(b[:9], 4)),  # 3 new, registers 2
                                  AdmitRequest("c", 17, hash_prompt(b, 4))]))  # hits b's 2, 3 new
    assert res.admit_status.tolist() == [STATUS_OK] * 3
    assert res.admit_cached_tokens.tolist() == [4, 0, 8]
    assert m.block_table("a").tolist() == [1, 2]
    assert m.block_table("b").tolist() == [3, 4, 5]
    assert m.block_table("c").tolist() == [3, 4, 6, 7, 8]
    assert m.pool.ref_cnt[1:10].tolist() == [1, 1, 2, 2, 1, 1, 1, 1, 0]
    assert m.num_free_blocks == 1 and m.pool.free_queue_order().tolist() == [9]


def test_watermark_makes_admission_wait_but_not_appends():
    m = make(num_blocks=11, watermark=0.2)  # 10 usable blocks, 2 of them watermark
    assert m.can_allocate(16 * 9) == AllocStatus.NEVER
    assert m.allocate("n", 16 * 9).status == AllocStatus.NEVER
    m.allocate("x", 16)
    assert m.can_allocate(16 * 7) == AllocStatus.OK
    assert m.can_allocate(16 * 8) == AllocStatus.LATER
    assert m.allocate("a", 16 * 8).status == STATUS_NO_SPACE == AllocStatus.LATER
    m.allocate("a", 16 * 7)
    assert m.append_slots("a", 32).ok and m.num_free_blocks == 0  # appends may use the watermark


def test_append_registers_filled_blocks_with_the_given_hashes():
    m = make()
    tokens = prompt(64)
    hashes = hash_prompt(tokens, 16)
    m.allocate("a", 20, hashes[:1])
    r = m.append_slots("a", 12, hashes[1:2])  # 32 tokens: block 2 becomes full
    assert r.ok and r.new_block_ids.tolist() == []
    assert m.pool.cache_key[2] == 1
    r = m.append_slots("a", 1)
    assert r.new_block_ids.tolist() == [3]
    m.append_slots("a", 31, hashes[2:4])
    assert m.block_table("a").tolist() == [1, 2, 3, 4] and m.pool.cache_key[1:5].tolist() == [1, 1, 1, 1]
    assert m.lookup(hashes) == 4


def test_registration_may_lag_but_not_run_ahead():
    m = make()
    hashes = hash_prompt(prompt(64), 16)
    m.allocate("a", 33)
    assert m.pool.cache_key[1] == 0
    m.append_slots("a", 0, hashes[:2])  # catch up on blocks 1 and 2
    assert m.pool.cache_key[1:3].tolist() == [1, 1]
    before = snapshot(m)
    with pytest.raises(errors.BadHashes):
        m.append_slots("a", 0, hashes[2:3])  # block 3 is not full
    assert snapshot(m) == before


def test_lookahead_slots_are_reserved_never_cached_and_reused():
    m = make()
    r = m.allocate("a", 16, hash_prompt(prompt(16), 16), num_lookahead_tokens=20)
    assert r.block_ids.tolist() == [1, 2, 3]  # 36 slots
    r = m.append_slots("a", 20, num_lookahead_tokens=0)  # the reserved slots are used
    assert r.new_block_ids.tolist() == []
    assert m.pool.cache_key[2:4].tolist() == [0, 0]


def test_misuse_raises_typed_errors_and_changes_nothing():
    m = make()
    m.allocate("a", 20)
    before = snapshot(m)
    cases = [
        (errors.UnknownRequest, lambda: m.free("zzz")),
        (errors.UnknownRequest, lambda: m.append_slots("zzz", 1)),
        (errors.DuplicateRequest, lambda: m.allocate("a", 10)),
        (errors.InvalidArgument, lambda: m.allocate("b", 0)),
        (errors.InvalidArgument, lambda: m.allocate("b", -5)),
        (errors.InvalidArgument, lambda: m.allocate("b", 10**9)),
        (errors.InvalidArgument, lambda: m.allocate("b", 10, num_lookahead_tokens=-1)),
        (errors.InvalidArgument, lambda: m.allocate("b", 10, priority=101)),
        (errors.InvalidArgument, lambda: m.allocate(["unhashable"], 10)),
        (errors.InvalidArgument, lambda: m.append_slots("a", -1)),
        (errors.InvalidArgument, lambda: m.append_slots("a", 10**6)),
        (errors.BadHashes, lambda: m.allocate("b", 20, hash_prompt(prompt(48), 16))),
        (errors.BadHashes, lambda: m.allocate("b", 20, [b"short"])),
        (errors.BadHashes, lambda: m.allocate("b", 20, np.zeros((1, 8), np.uint8))),
        (errors.InvalidArgument, lambda: m.block_table("a", group=3)),
    ]
    for error, call in cases:
        with pytest.raises(error):
            call()
        assert snapshot(m) == before, error


def test_step_applies_frees_forks_appends_admissions_in_order_with_per_request_status():
    m = make()
    m.allocate("old", 16)
    m.allocate("run", 15)
    batch = StepBatch(
        free=["old", "ghost"],
        append_ids=["run", "nobody"],
        append_num_tokens=np.array([2, 1]),
        admit=[AdmitRequest("new", 20), AdmitRequest("run", 5), AdmitRequest("big", 10**6)],
    )
    res = m.step(batch)
    assert res.free_status.tolist() == [STATUS_OK, errors.UnknownRequest.code]
    assert res.append_status.tolist() == [STATUS_OK, errors.UnknownRequest.code]
    assert res.admit_status.tolist() == [STATUS_OK, errors.DuplicateRequest.code, errors.InvalidArgument.code]
    # "old" freed block 1 first, so the append and the admission reuse it.
    assert m.block_table("run").tolist() == [2, 1]
    assert m.block_table("new").tolist() == [3, 4]
    run_row, new_row = m.row_of("run"), m.row_of("new")
    assert res.sched_rows.tolist() == [run_row, new_row]
    assert res.sched_start.tolist() == [15, 0] and res.sched_len.tolist() == [2, 20]
    assert res.freed_rows.tolist() == [0]


def test_step_no_space_for_one_request_does_not_fail_the_others():
    m = make(num_blocks=5)
    m.allocate("a", 16)
    m.allocate("b", 16)
    res = m.step(StepBatch(append_ids=["a", "b"], append_num_tokens=np.array([40, 1])))
    assert res.append_status.tolist() == [STATUS_NO_SPACE, STATUS_OK]
    assert m.block_table("a").tolist() == [1] and m.num_tokens[m.row_of("a")] == 16
    assert m.block_table("b").tolist() == [2, 3]


def test_batched_admission_equals_one_by_one():
    tokens = [prompt(40), np.concatenate([prompt(32), prompt(9, 500)]), prompt(40), prompt(70, 900), prompt(33)]
    admits = [AdmitRequest(i, len(t), hash_prompt(t, 16)) for i, t in enumerate(tokens)]
    batched, single = make(num_blocks=32), make(num_blocks=32)
    res = batched.step(StepBatch(admit=admits))
    for a in admits:
        single.allocate(a.req_id, a.num_tokens, a.block_hashes)
    assert snapshot(batched) == snapshot(single)
    assert res.admit_cached_tokens.tolist() == [0, 32, 32, 0, 32]


def test_batched_admission_stops_before_eviction_and_finishes_one_by_one():
    def setup():
        m = make(num_blocks=9)
        m.allocate("x", 48, hash_prompt(prompt(48, 100), 16))
        m.free("x")  # 3 cached free blocks at the back
        return m
    admits = [AdmitRequest(i, 32, hash_prompt(prompt(32, 200 + 40 * i), 16)) for i in range(4)]
    batched, single = setup(), setup()
    res = batched.step(StepBatch(admit=admits))
    for a in admits:
        single.allocate(a.req_id, a.num_tokens, a.block_hashes)
    assert res.admit_status.tolist() == [STATUS_OK, STATUS_OK, STATUS_OK, STATUS_OK]
    assert snapshot(batched) == snapshot(single)
    assert batched.stats()["evictions"] == 3


def test_reset_prefix_cache_only_when_nothing_is_held():
    m = make()
    hashes = hash_prompt(prompt(32), 16)
    m.allocate("a", 33, hashes)
    assert not m.reset_prefix_cache()
    m.free("a")
    assert m.reset_prefix_cache()
    assert m.lookup(hashes) == 0 and m.pool.num_evictable == 0


def test_namespaces_do_not_see_each_others_prefixes():
    m = make()
    hashes = hash_prompt(prompt(40), 16)
    m.allocate("a", 40, hashes, namespace=1)
    assert m.lookup(hashes, namespace=1) == 2
    assert m.lookup(hashes, namespace=2) == 0
    assert m.allocate("b", 40, hashes, namespace=2).num_cached_tokens == 0


def test_block_ids_never_include_the_null_block_under_churn():
    m = make(num_blocks=10)
    rng = np.random.default_rng(1)
    live = []
    for i in range(300):
        if live and rng.random() < 0.4:
            m.free(live.pop(rng.integers(len(live))))
            continue
        n = int(rng.integers(1, 60))
        r = m.allocate(i, n, hash_prompt(prompt(n, 7), 16)[:1])
        if r.ok:
            assert 0 not in r.block_ids
            live.append(i)
    for req in live:
        m.free(req)
    assert m.num_free_blocks == 9


def test_deferred_registration_is_finished_before_anything_reads_the_cache():
    m = BlockManager(ManagerConfig(num_gpu_blocks=16, max_model_len=256, max_num_reqs=8,
                                   defer_cache_registration=True))
    hashes = hash_prompt(prompt(32), 16)
    m.allocate("a", 15, ())
    res = m.step(StepBatch(append_rows=m.rows_of(["a"]), append_num_tokens=1,
                           append_hashes=(hashes[:1],), append_hash_counts=(np.array([1]),)))
    assert res.append_status.tolist() == [0]
    assert m.pool.caches.get(1, {}) == {}  # left for after the reply
    assert m.lookup(hashes) == 1  # ... but any call finishes it first
    m.step(StepBatch(append_rows=m.rows_of(["a"]), append_num_tokens=16,
                     append_hashes=(hashes[1:2],), append_hash_counts=(np.array([1]),)))
    m.free("a")  # block 2 must go to the back as a cached block, block 1 likewise
    assert m.pool.free_queue_order()[-2:].tolist() == [2, 1]
    m.check_invariants(heavy=True)


def test_step_with_malformed_admissions_reports_them_and_admits_the_rest():
    m = make()
    res = m.step(StepBatch(admit=[AdmitRequest("a", 5), AdmitRequest("b", "abc"), ("not", "a request")]))
    assert res.admit_status.tolist() == [STATUS_OK, errors.InvalidArgument.code, errors.InvalidArgument.code]
    assert res.sched_rows.tolist() == [m.row_of("a")] and res.sched_len.tolist() == [5]
    assert m.num_requests == 1


def test_step_with_a_bad_lookahead_is_a_typed_error_and_changes_nothing():
    m = make()
    m.allocate("a", 5)
    before = snapshot(m)
    for bad in ("2", -1, 10**6, True):
        with pytest.raises(errors.InvalidArgument):
            m.step(StepBatch(append_rows=m.rows_of(["a"]), num_lookahead_tokens=bad))
        assert snapshot(m) == before


def test_step_with_non_integer_inputs_is_a_typed_error_and_changes_nothing():
    m = make()
    m.allocate("a", 5)
    m.allocate("b", 5)
    before = snapshot(m)
    rows = m.rows_of(["a"])
    bad_batches = [
        StepBatch(free=["b"], append_rows=np.array([0.5])),
        StepBatch(free=["b"], append_rows=rows, append_num_tokens=np.array(["x"])),
        StepBatch(free=["b"], append_ids=["a"], append_num_tokens=[1.5]),
    ]
    for batch in bad_batches:
        with pytest.raises(errors.InvalidArgument):
            m.step(batch)
        assert snapshot(m) == before
    with pytest.raises(errors.BadHashes):
        m.step(StepBatch(free=["b"], append_rows=rows, append_hashes=(hash_prompt(prompt(16), 16),),
                         append_hash_counts=(["one"],)))
    assert snapshot(m) == before


def test_hash_counts_that_add_up_but_hold_a_negative_are_bad_hashes_and_change_nothing():
    m = make()
    m.allocate("a", 16, hash_prompt(prompt(16), 16))
    m.allocate("b", 16, hash_prompt(prompt(16) + 1, 16))
    rows = m.rows_of(["a", "b"])
    m.step(StepBatch(append_rows=rows, append_num_tokens=16))  # each fills a second block
    before = snapshot(m)
    one = hash_prompt(prompt(32), 16)[1:]
    for dtype in (np.int32, np.int64):  # int32: checked through count_total's uint32 view
        for path in ({"append_rows": rows}, {"append_ids": ["a", "b"]}):  # the decode path and the general one
            with pytest.raises(errors.BadHashes):
                m.step(StepBatch(**path, append_num_tokens=0, append_hashes=(one,),
                                 append_hash_counts=(np.array([2, -1], dtype),)))
            assert snapshot(m) == before
    res = m.step(StepBatch(append_rows=rows, append_num_tokens=0, append_hashes=(one,),
                           append_hash_counts=(np.array([1, 0], np.int32),)))
    assert res.append_status.tolist() == [0, 0]
    m.flush_deferred()
    assert m.lookup(hash_prompt(prompt(32), 16)) == 2


def test_a_hash_narrower_than_the_index_mixes_or_not_of_whole_words_is_refused_with_a_typed_error():
    with pytest.raises(errors.InvalidArgument, match="hash_width must be a multiple of 8 bytes, at least 16, got 8"):
        BlockManager(ManagerConfig(num_gpu_blocks=16, hash_width=8))
    with pytest.raises(errors.InvalidArgument, match="got 20"):  # the index reads hashes as 64-bit words
        BlockManager(ManagerConfig(num_gpu_blocks=16, hash_width=20))
    assert BlockManager(ManagerConfig(num_gpu_blocks=16, hash_width=24)).hash_dtype == np.dtype("S24")


@pytest.mark.parametrize("extra", [0, 3])  # a few admissions (scheduled over scalars) or more (arrays)
def test_an_admissions_only_step_schedules_each_admitted_request_from_its_cached_prefix(extra):
    m = make(num_blocks=64)
    shared = prompt(40)
    m.allocate("a", 40, hash_prompt(shared, 16))
    admits = [AdmitRequest("hit", 40, hash_prompt(shared, 16)), AdmitRequest("a", 5),  # a duplicate id
              AdmitRequest("cold", 21)] + [AdmitRequest(f"x{i}", 3) for i in range(extra)]
    res = m.step(StepBatch(admit=admits))
    assert res.admit_status.tolist() == [STATUS_OK, errors.DuplicateRequest.code] + [STATUS_OK] * (1 + extra)
    ok = ["hit", "cold"] + [f"x{i}" for i in range(extra)]
    assert res.sched_rows.tolist() == [m.row_of(r) for r in ok]
    assert res.sched_start.tolist() == [32, 0] + [0] * extra  # "hit" found 2 whole blocks of "a"
    assert res.sched_len.tolist() == [8, 21] + [3] * extra
    assert res.sched_rows.dtype == res.sched_start.dtype == res.sched_len.dtype == np.int32


def test_decode_rows_is_a_decode_step_without_the_batch_and_result_objects():
    def fresh():
        m = make(num_blocks=16)
        m.allocate("a", 16)  # a full block: its next token takes a new one
        m.allocate("b", 5)
        m.fork("b", "c")  # b and c share a partial block: the first writer copies it
        return m

    via_step, direct = fresh(), fresh()
    rows = via_step.rows_of(["a", "b", "c"])
    res = via_step.step(StepBatch(append_rows=rows, append_num_tokens=2))
    old, grown, copies = direct.decode_rows(direct.rows_of(["a", "b", "c"]), 2)
    assert old.tolist() == res.sched_start.tolist() == [16, 5, 5]
    assert grown.tolist() == res.changed_rows.tolist() == direct.rows_of(["a", "b"]).tolist()  # a grew, b copied
    assert copies.tolist() == res.copies.tolist() == [[2, 4]]  # b copies the block it shares with c
    assert direct.tick == via_step.tick
    assert snapshot(direct) == snapshot(via_step)
    direct.check_invariants(heavy=True)


@pytest.mark.parametrize("defer", [False, True])
def test_decode_rows_registers_the_blocks_that_filled_as_a_decode_step_does(defer):
    toks_a, toks_b = prompt(16), prompt(32, 100)

    def fresh():  # without debug checks, whose invariant check runs deferred work
        m = BlockManager(ManagerConfig(num_gpu_blocks=16, max_model_len=256, max_num_reqs=8,
                                       defer_cache_registration=defer))
        m.allocate("a", 15)  # the next token fills its first block
        m.allocate("b", 31, hash_prompt(toks_b[:31], 16))  # one block registered, the next fills
        return m

    hashes = np.concatenate([hash_prompt(toks_a, 16)[-1:], hash_prompt(toks_b, 16)[-1:]])
    counts = np.ones(2, np.int32)
    via_step, direct = fresh(), fresh()
    res = via_step.step(StepBatch(append_rows=via_step.rows_of(["a", "b"]), append_num_tokens=1,
                                  append_hashes=(hashes,), append_hash_counts=(counts,)))
    old, grown, copies = direct.decode_rows(direct.rows_of(["a", "b"]), 1, 0, hashes, counts)
    assert old.tolist() == res.sched_start.tolist() == [15, 31]
    assert grown.tolist() == res.changed_rows.tolist() == []  # both filled the block they had
    assert copies.tolist() == res.copies.tolist() == []
    assert direct.tick == via_step.tick
    assert direct.num_deferred == via_step.num_deferred == (1 if defer else 0)
    assert snapshot(direct) == snapshot(via_step)
    for m in (direct, via_step):
        m.flush_deferred()
        assert m.lookup(hash_prompt(toks_a, 16)) == 1 and m.lookup(hash_prompt(toks_b, 16)) == 2  # blocks
    assert snapshot(direct) == snapshot(via_step)
    direct.check_invariants(heavy=True)


def test_decode_rows_declines_hashes_it_cannot_take_and_changes_nothing():
    m = make(num_blocks=8, defer_cache_registration=True)
    m.allocate("a", 15)
    m.allocate("b", 31)  # both fill a block with their next token (room for everything)
    rows = m.rows_of(["a", "b"])
    good_h = np.concatenate([hash_prompt(prompt(16), 16), hash_prompt(prompt(32, 100), 16)[1:]])
    good_c = np.ones(2, np.int32)
    before, tick = snapshot(m), m.tick
    assert m.decode_rows(rows, 1, 0, good_h.astype("S32"), good_c) is None  # another hash width
    assert m.decode_rows(rows, 1, 0, good_h, good_c.astype(np.int64)) is None  # not the daemon's int32 counts
    assert m.decode_rows(rows, 1, 0, good_h, np.array([2, 1], np.int32)) is None  # counts do not add up
    assert m.decode_rows(rows, 1, 0, good_h, np.array([-1, 3], np.int32)) is None  # a negative count
    assert m.decode_rows(rows, 1, 0, good_h, np.ones(3, np.int32)) is None  # one count per row
    assert m.decode_rows(rows, 1, 0, good_h, np.array([2, 0], np.int32)) is None  # a has one full block, not 2
    assert snapshot(m) == before and m.tick == tick and m.num_deferred == 0
    with pytest.raises(errors.BadHashes):  # the step says why
        m.step(StepBatch(append_rows=rows, append_num_tokens=1, append_hashes=(good_h,),
                         append_hash_counts=(np.array([2, 1], np.int32),)))
    assert snapshot(m) == before
    assert m.decode_rows(rows, 1, 0, good_h, good_c) is not None  # what was declined above was the hashes
    assert m.num_tokens[rows].tolist() == [16, 32] and m.lookup(good_h[:1]) == 1


def test_decode_rows_declines_unusual_steps_and_changes_nothing():
    m = make(num_blocks=3)
    m.allocate("a", 16)
    m.allocate("b", 16)  # both full: the next token of each needs a block, one is left
    rows = m.rows_of(["a", "b"])
    before, tick = snapshot(m), m.tick
    assert m.decode_rows(rows, 1) is None  # no space for both: step decides request by request
    assert m.decode_rows(rows[:0], 1) is None  # nothing to append
    assert m.decode_rows(rows, np.int64(1)) is None  # a count that is not an int
    assert m.decode_rows(rows, 1, lookahead=10**6) is None  # past max lookahead: step raises
    assert m.decode_rows(rows.astype(np.int64), 1) is None  # not the int32 rows of the daemon
    assert snapshot(m) == before and m.tick == tick


def test_deferred_registrations_keep_their_hashes_when_the_caller_reuses_its_arrays():
    """defer_cache_registration: what a step registers after its return is what the step was given,
    whatever the caller writes into its hash arrays meanwhile."""
    m = BlockManager(ManagerConfig(num_gpu_blocks=16, max_model_len=256, max_num_reqs=8,
                                   defer_cache_registration=True))
    toks_a, toks_b = prompt(48), prompt(32, 100)
    given = hash_prompt(toks_a, 16)  # a lone admission: 3 full blocks
    m.step(StepBatch(admit=[AdmitRequest("a", 48, given)]))
    given[:] = hash_prompt(prompt(48, 7), 16)  # the caller's buffer, reused
    m.allocate("b", 31, hash_prompt(toks_b[:31], 16))  # the next token fills b's second block
    filled = hash_prompt(toks_b, 16)[1:]
    counts = np.ones(1, np.int64)
    m.step(StepBatch(append_rows=m.rows_of(["b"]), append_num_tokens=1, append_hashes=(filled,),
                     append_hash_counts=(counts,)))
    filled[:] = given[:1]
    counts[:] = 0
    assert m.num_deferred == 1
    m.flush_deferred()
    assert m.lookup(hash_prompt(toks_a, 16)) == 3 and m.lookup(hash_prompt(toks_b, 16)) == 2
    m.check_invariants(heavy=True)


def test_a_step_naming_more_rows_than_the_manager_has_reports_the_repeats_and_changes_nothing_else():
    m = make(num_blocks=16)  # max_num_reqs 8
    m.allocate("a", 3)
    m.allocate("b", 3)
    rows = np.array(m.rows_of(["a", "b"]).tolist() * 5, np.int32)  # 10 entries > 8 rows
    res = m.step(StepBatch(append_rows=rows, append_num_tokens=1))
    assert res.append_status.tolist() == [0, 0] + [errors.InvalidArgument.code] * 8  # each repeat refused
    assert m.num_tokens[rows[:2]].tolist() == [4, 4]
    res = m.step(StepBatch(free=["a", "b"] * 5))
    assert res.free_status.tolist() == [0, 0] + [errors.InvalidArgument.code] * 8  # each repeat refused
    assert m.num_free_blocks == 15 and not m.pool.ref_cnt.any()


def test_rows_and_counts_that_do_not_fit_their_type_are_refused_not_wrapped():
    m = make(num_blocks=16)
    m.allocate("a", 3)
    row = int(m.rows_of(["a"])[0])
    with pytest.raises(errors.InvalidArgument):  # 2**32 + row would wrap to a's row as int32
        m.step(StepBatch(append_rows=np.array([2**32 + row], np.int64), append_num_tokens=1))
    res = m.step(StepBatch(append_ids=["a"], append_num_tokens=np.array([2**32 + 1], np.int64)))
    assert res.append_status.tolist() == [errors.InvalidArgument.code]
    with pytest.raises(errors.InvalidArgument):  # uint64 beyond int64 would wrap negative
        m.step(StepBatch(append_ids=["a"], append_num_tokens=np.array([2**64 - 1], np.uint64)))
    assert m.num_tokens[row] == 3


@pytest.mark.parametrize("lone", [True, False])
def test_a_step_refused_for_its_confirmation_makes_no_registration_space(lone):
    m = make()
    m.step(StepBatch(admit=[AdmitRequest("a", 4)]), namespace=0, writer=1)
    spaces = (dict(m._spaces), dict(m._space_info), m._next_space, m.tick)
    extra = {} if lone else {"free": ["a"]}  # (a free too: the general path)
    with pytest.raises(errors.InvalidArgument, match="computed tick"):
        m.step(StepBatch(admit=[AdmitRequest("b", 4)], computed_through=m.tick + 1, **extra), namespace=7, writer=2)
    assert (dict(m._spaces), dict(m._space_info), m._next_space, m.tick) == spaces
    assert "a" in m and "b" not in m
