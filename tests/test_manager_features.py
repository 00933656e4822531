"""Exact-state tests of the full manager: fork/CoW, swap, sliding windows, KV-cache groups,
admission options, eviction priority, common prefix, cross-attention tables, and combinations."""

import numpy as np
import pytest

from kvd import errors
from kvd.api import STATUS_NO_SPACE, AllocStatus, GroupSpec, ManagerConfig, StepBatch
from kvd.hashing import hash_prompt
from kvd.manager import BlockManager


def make(num_blocks=16, **kw):
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_reqs", 8)
    return BlockManager(ManagerConfig(num_gpu_blocks=num_blocks, debug_checks=True, **kw))


def prompt(n, start=0):
    return np.arange(start, start + n, dtype=np.int32)


# ---------------------------------------------------------------- fork and copy-on-write
def test_fork_shares_every_block_and_copies_nothing():
    m = make()
    m.allocate("p", 40)
    m.fork("p", "c")
    assert m.block_table("c").tolist() == [1, 2, 3]
    assert m.pool.ref_cnt[1:4].tolist() == [2, 2, 2]
    assert m.take_copies().shape == (0, 2)


def test_append_to_a_shared_partial_block_copies_once_then_writes_in_place():
    m = make()
    m.allocate("p", 40)
    m.fork("p", "c")
    r = m.append_slots("c", 1)
    assert r.copies.tolist() == [[3, 4]] and m.block_table("c").tolist() == [1, 2, 4]
    assert m.pool.ref_cnt[1:5].tolist() == [2, 2, 1, 1]
    r = m.append_slots("p", 1)  # the parent is now the only holder of block 3
    assert r.copies.shape == (0, 2) and m.block_table("p").tolist() == [1, 2, 3]
    assert m.take_copies().tolist() == [[3, 4]]
    assert m.take_copies().shape == (0, 2)
    assert m.stats()["cow_copies"] == 1


def test_full_shared_blocks_are_never_copied():
    m = make()
    m.allocate("p", 32)
    m.fork("p", "c")
    r = m.append_slots("c", 1)
    assert r.copies.shape == (0, 2) and r.new_block_ids.tolist() == [3]
    assert m.block_table("c").tolist() == [1, 2, 3]


def test_fork_in_a_step_then_every_sibling_appends():
    m = make(num_blocks=32, max_num_reqs=16)
    m.allocate("p", 1029 % 64 + 64)  # 69 tokens: partial block 5
    res = m.step(StepBatch(forks=[("p", c) for c in range(3)], append_ids=["p", 0, 1, 2], append_num_tokens=1))
    assert res.fork_status.tolist() == [0, 0, 0]
    assert res.copies.tolist() == [[5, 6], [5, 7], [5, 8]]  # the last sibling writes in place
    assert [m.block_table(r)[-1] for r in ("p", 0, 1, 2)] == [6, 7, 8, 5]
    assert m.pool.ref_cnt[5:9].tolist() == [1, 1, 1, 1]


def test_copies_and_growth_of_one_batch_take_blocks_in_batch_order():
    m = make(num_blocks=32, max_num_reqs=16)
    m.allocate("p", 40)  # blocks 1, 2 and the partial 3
    m.step(StepBatch(forks=[("p", "c1"), ("p", "c2")]))
    res = m.step(StepBatch(append_ids=["p", "c1", "c2"], append_num_tokens=[1, 30, 1]))
    # p copies block 3 into 4; c1 copies it into 5, then grows into 6 and 7; c2, the last
    # holder left, writes in place.
    assert res.copies.tolist() == [[3, 4], [3, 5]]
    assert [m.block_table(r).tolist() for r in ("p", "c1", "c2")] == [[1, 2, 4], [1, 2, 5, 6, 7], [1, 2, 3]]
    assert m.pool.ref_cnt[1:9].tolist() == [3, 3, 1, 1, 1, 1, 1, 0]
    assert res.sched_start.tolist() == [40, 40, 40] and res.sched_len.tolist() == [1, 30, 1]
    assert set(m.rows_of(["p", "c1"]).tolist()) <= set(res.changed_rows.tolist())


def test_copies_beyond_the_fresh_blocks_evict_cached_ones_in_queue_order():
    m = make(num_blocks=8)
    m.allocate("x", 32, hash_prompt(prompt(32), 16))  # blocks 1, 2, both registered
    m.free("x")  # cached and free: the eviction queue holds 2, then 1
    m.allocate("p", 40)  # fresh blocks 3, 4, 5
    m.step(StepBatch(forks=[("p", c) for c in range(3)]))
    res = m.step(StepBatch(append_ids=["p", 0, 1, 2], append_num_tokens=1))
    assert res.copies.tolist() == [[5, 6], [5, 7], [5, 2]]
    assert m.stats()["evictions"] == 1 and m.pool.cache_key[2] == 0 and m.pool.cache_key[1] != 0
    assert [m.block_table(r)[-1] for r in ("p", 0, 1, 2)] == [6, 7, 2, 5]


def test_copies_short_of_blocks_are_decided_in_batch_order():
    m = make(num_blocks=6)
    m.allocate("p", 40)  # blocks 1, 2, 3; free: 4, 5
    m.step(StepBatch(forks=[("p", "c1"), ("p", "c2")]))
    res = m.step(StepBatch(append_ids=["c1", "p", "c2"], append_num_tokens=[30, 1, 1]))
    # c1 needs a copy and two new blocks: no space, unchanged. p and c2 then both copy, since
    # c1 still holds block 3.
    assert res.append_status.tolist() == [STATUS_NO_SPACE, 0, 0]
    assert res.copies.tolist() == [[3, 4], [3, 5]]
    assert [m.block_table(r).tolist() for r in ("c1", "p", "c2")] == [[1, 2, 3], [1, 2, 4], [1, 2, 5]]
    assert m.pool.ref_cnt[1:6].tolist() == [3, 3, 1, 1, 1] and m.num_free_blocks == 0


def test_a_bad_append_beside_copies_changes_nothing_of_its_own():
    m = make(num_blocks=16)
    m.allocate("p", 40)
    m.step(StepBatch(forks=[("p", "c")]))
    res = m.step(StepBatch(append_ids=["p", "c"], append_num_tokens=[1, 10_000]))
    assert res.append_status.tolist() == [0, errors.InvalidArgument.code]
    assert res.copies.tolist() == [[3, 4]]  # p copies: c still holds block 3
    assert m.block_table("c").tolist() == [1, 2, 3] and m.pool.ref_cnt[1:5].tolist() == [2, 2, 1, 1]
    assert res.sched_rows.tolist() == [m.row_of("p")] and m.num_free_blocks == 11

    m = make(num_blocks=16)
    m.allocate("p", 40)
    m.step(StepBatch(forks=[("p", "c")]))
    res = m.step(StepBatch(append_ids=["c", "p", "c"], append_num_tokens=1))  # c named twice
    assert res.append_status.tolist() == [0, 0, errors.InvalidArgument.code]  # the repeat is refused
    assert res.copies.tolist() == [[3, 4]]  # c copies first; p, the last holder, writes in place
    assert m.block_table("c").tolist() == [1, 2, 4] and m.block_table("p").tolist() == [1, 2, 3]
    assert m.pool.ref_cnt[1:5].tolist() == [2, 2, 1, 1]


def test_fork_errors_change_nothing():
    m = make()
    m.allocate("p", 10)
    with pytest.raises(errors.UnknownRequest):
        m.fork("nope", "c")
    with pytest.raises(errors.DuplicateRequest):
        m.fork("p", "p")
    assert m.num_requests == 1 and m.pool.ref_cnt[1] == 1


def test_cow_after_a_prefix_hit():
    m = make()
    hashes = hash_prompt(prompt(40), 16)
    m.allocate("a", 40, hashes)
    r = m.allocate("b", 40, hashes)  # hits 1, 2; own partial block 4
    assert r.block_ids.tolist() == [1, 2, 4]
    m.fork("b", "c")
    r = m.append_slots("c", 1)
    assert r.copies.tolist() == [[4, 5]]
    assert m.pool.ref_cnt[1:6].tolist() == [3, 3, 1, 1, 1]


# ---------------------------------------------------------------- swap
def test_swap_round_trip_keeps_tables_and_prefix_cache():
    m = make(num_cpu_blocks=8)
    hashes = hash_prompt(prompt(40), 16)
    m.allocate("a", 40, hashes)
    assert m.can_swap_out("a") == AllocStatus.OK
    out = m.swap_out("a")
    assert out.ok and out.mapping.tolist() == [[1, 1], [2, 2], [3, 3]]
    assert m.num_free_blocks == 15 and m.cpu_pool.num_free == 4
    assert m.lookup(hashes) == 2  # cached blocks stay findable while free on the GPU
    with pytest.raises(errors.RequestSwapped):
        m.append_slots("a", 1)
    with pytest.raises(errors.InvalidArgument):
        m.swap_in(["a", "a"])
    m.allocate("z", 1)
    with pytest.raises(errors.RequestNotSwapped):
        m.swap_in("z")
    m.free("z")
    assert m.can_swap_in("a") == AllocStatus.OK
    back = m.swap_in("a")
    # Blocks 1 and 2 are still cached on the GPU: revived without a copy; CPU block 3 is copied
    # into the front of the free queue (GPU block 3 again, as "z" returned it there).
    assert back.ok and back.mapping.tolist() == [[1, 1], [2, 2], [3, 3]]
    assert m.block_table("a").tolist() == [1, 2, 3]
    assert m.cpu_pool.num_free == 7 and m.stats()["swaps_out"] == 3 and m.stats()["swaps_in"] == 3
    assert m.append_slots("a", 1).ok


def test_swapping_no_requests_is_a_no_op():
    m = make(num_cpu_blocks=8)
    m.allocate("a", 40)
    m.swap_out("a")
    tick, free, cpu_free = m.tick, m.num_free_blocks, m.cpu_pool.num_free
    assert m.can_swap_out([]) == AllocStatus.OK and m.can_swap_in([]) == AllocStatus.OK
    for r in (m.swap_out([]), m.swap_in([])):
        assert r.ok and r.mapping.shape == (0, 2)
    assert (m.tick, m.num_free_blocks, m.cpu_pool.num_free) == (tick, free, cpu_free)
    assert m.swap_in("a").mapping.tolist() == [[1, 1], [2, 2], [3, 3]]


def test_swapped_content_evicted_meanwhile_is_copied_back_and_re_registered():
    m = make(num_blocks=5, num_cpu_blocks=8)
    hashes = hash_prompt(prompt(32), 16)
    m.allocate("a", 32, hashes)
    m.swap_out("a")
    m.allocate("hog", 64)  # takes all four blocks: evicts 1 and 2
    m.free("hog")
    back = m.swap_in("a")
    assert back.ok and back.mapping[:, 0].tolist() == [1, 2]
    assert m.lookup(hashes) == 2


def test_forked_requests_swapped_together_move_shared_blocks_once():
    m = make(num_cpu_blocks=8)
    m.allocate("p", 40)
    m.fork("p", "c")
    m.append_slots("c", 1)  # c: 1, 2, 4 ; p: 1, 2, 3
    out = m.swap_out(["p", "c"])
    assert out.mapping.tolist() == [[1, 1], [2, 2], [3, 3], [4, 4]]
    assert m.cpu_pool.ref_cnt[1:5].tolist() == [2, 2, 1, 1]
    assert m.num_free_blocks == 15
    back = m.swap_in(["p", "c"])
    assert back.ok
    p, c = m.block_table("p"), m.block_table("c")
    assert p[:2].tolist() == c[:2].tolist() and p[2] != c[2]
    assert m.pool.ref_cnt[p].tolist() == [2, 2, 1] and m.pool.ref_cnt[c[2]] == 1
    assert m.cpu_pool.num_free == 7


def test_requests_swapped_out_apart_with_the_same_content_swap_in_together_onto_one_cached_copy():
    """Two swap-outs of the same content (a, then b, which hit a's cached blocks) leave two CPU
    copies of it; swapped in together, both find the same cached GPU blocks, which take every
    table entry of both (a's forked child shares a's copy: two entries)."""
    m = make(num_cpu_blocks=16)
    hashes = hash_prompt(prompt(40), 16)
    m.allocate("a", 40, hashes)
    m.fork("a", "a2")
    assert m.swap_out(["a", "a2"]).mapping.tolist() == [[1, 1], [2, 2], [3, 3]]
    assert m.allocate("b", 40, hashes).num_cached_tokens == 32  # GPU blocks 1 and 2, still cached
    assert m.swap_out("b").mapping.tolist() == [[1, 4], [2, 5], [3, 6]]
    assert m.cpu_pool.ref_cnt[1:7].tolist() == [2, 2, 2, 1, 1, 1]
    assert m.can_swap_in(["a", "a2", "b"]) == AllocStatus.OK
    back = m.swap_in(["a", "a2", "b"])
    # CPU 1 and 4 hold one block's content, as do 2 and 5: both pairs revive GPU blocks 1 and 2
    assert back.ok and back.mapping.tolist() == [[1, 1], [2, 2], [3, 3], [4, 1], [5, 2], [6, 4]]
    assert m.pool.ref_cnt[1:5].tolist() == [3, 3, 2, 1]
    assert [m.block_table(r).tolist() for r in ("a", "a2", "b")] == [[1, 2, 3], [1, 2, 3], [1, 2, 4]]
    m.check_invariants(heavy=True)
    for r in ("a", "a2", "b"):
        m.free(r)
    assert m.num_free_blocks == 15 and m.cpu_pool.num_free == 15


def test_swap_out_without_cpu_room_is_no_space_and_changes_nothing():
    m = make(num_cpu_blocks=2)
    m.allocate("a", 40)
    assert m.can_swap_out("a") == AllocStatus.NEVER  # 3 blocks, a CPU pool of 1 usable
    assert m.swap_out("a").status == AllocStatus.NEVER
    assert m.block_table("a").tolist() == [1, 2, 3] and m.cpu_pool.num_free == 1


def test_free_of_a_swapped_request_returns_its_cpu_blocks():
    m = make(num_cpu_blocks=8)
    m.allocate("a", 40)
    m.swap_out("a")
    m.free("a")
    assert m.cpu_pool.num_free == 7 and m.num_free_blocks == 15


# ---------------------------------------------------------------- sliding window
def window_mgr(**kw):
    return make(groups=(GroupSpec(16, sliding_window=32),), **kw)


def test_blocks_leaving_the_window_become_null_and_return_to_the_pool():
    m = window_mgr()
    m.allocate("a", 40)  # 1, 2, 3
    m.append_slots("a", 8)  # 40 computed: tokens < 9 are out of the window -> no whole block yet
    assert m.block_table("a").tolist() == [1, 2, 3]
    m.append_slots("a", 1)  # 48 computed: tokens < 17 out -> block 1 returns, after the new block 4
    assert m.block_table("a").tolist() == [0, 2, 3, 4]
    assert m.pool.ref_cnt[1] == 0 and m.num_free_blocks == 12
    m.append_slots("a", 32)  # 49 computed: still only block 1 out; 81 tokens need 2 more blocks
    assert m.block_table("a").tolist() == [0, 2, 3, 4, 1, 5]
    m.append_slots("a", 1)  # 81 computed: tokens < 50 out -> entries 1 and 2 (blocks 2, 3)
    assert m.block_table("a").tolist() == [0, 0, 0, 4, 1, 5]
    assert m.pool.free_queue_order()[:2].tolist() == [2, 3]  # freed tail first: 2 ends on top


def test_window_prefix_hit_needs_only_the_blocks_inside_the_window():
    m = window_mgr()
    hashes = hash_prompt(prompt(80), 16)
    m.allocate("a", 80, hashes)
    m.free("a")
    m.reset_prefix_cache() and None
    m2 = window_mgr()
    m2.allocate("a", 80, hashes)
    m2.free("a")
    r = m2.allocate("b", 80, hashes)
    # 64 cached tokens: only blocks for tokens >= 33 are taken (blocks 2 and 3); 0, 1 stay null.
    assert r.num_cached_tokens == 64
    assert m2.block_table("b").tolist() == [0, 0, 3, 4, 6]


# ---------------------------------------------------------------- KV-cache groups
def test_two_groups_with_different_block_sizes_agree_on_the_prefix():
    m = make(num_blocks=32, groups=(GroupSpec(16), GroupSpec(32, sliding_window=32)))
    t = prompt(100)
    hashes = (hash_prompt(t, 16), hash_prompt(t, 32))
    r = m.allocate("a", 100, hashes)
    assert [x.tolist() for x in r.group_block_ids] == [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11]]
    r = m.allocate("b", 100, hashes)
    # Full attention could hit 6 blocks (96 tokens); the window group 3 blocks (96): agree on 96.
    assert r.num_cached_tokens == 96
    assert m.block_table("b", 0).tolist() == [1, 2, 3, 4, 5, 6, 12]
    assert m.block_table("b", 1).tolist() == [0, 0, 10, 13]


def test_group_hashes_must_be_given_for_every_group():
    m = make(groups=(GroupSpec(16), GroupSpec(16)))
    with pytest.raises(errors.BadHashes):
        m.allocate("a", 40, hash_prompt(prompt(40), 16))


# ---------------------------------------------------------------- admission options
def test_full_sequence_admission_counts_max_new_tokens():
    m = make(num_blocks=11, admit_full_sequence=True)
    assert m.can_allocate(32, max_new_tokens=160) == AllocStatus.NEVER
    assert m.can_allocate(32, max_new_tokens=128) == AllocStatus.OK
    m.allocate("a", 32)
    assert m.can_allocate(32, max_new_tokens=128) == AllocStatus.LATER


def test_reserve_decode_blocks_for_requests_whose_last_block_is_full():
    m = make(num_blocks=6, reserve_decode_blocks=True)
    m.allocate("a", 16)  # full: will need a block at its next token
    m.allocate("b", 17)
    assert m.can_allocate(32) == AllocStatus.LATER  # 2 free, 1 reserved
    assert m.can_allocate(16) == AllocStatus.OK


# ---------------------------------------------------------------- eviction priority
def test_lower_priority_cached_blocks_are_evicted_first():
    m = make(num_blocks=7)
    m.allocate("hi", 32, hash_prompt(prompt(32), 16), priority=90)
    m.allocate("lo", 32, hash_prompt(prompt(32, 100), 16), priority=10)
    m.free("hi")
    m.free("lo")
    assert m.pool.free_queue_order().tolist() == [5, 6, 4, 3, 2, 1]
    r = m.allocate("x", 64)
    assert r.block_ids.tolist() == [5, 6, 4, 3]
    assert m.lookup(hash_prompt(prompt(32), 16)) == 2


def test_one_step_freeing_rows_of_several_priorities_queues_each_block_with_its_rows_priority():
    m = make(num_blocks=9)
    m.allocate("hi", 32, hash_prompt(prompt(32), 16), priority=90)
    m.allocate("lo", 32, hash_prompt(prompt(32, 100), 16), priority=10)
    m.allocate("mid", 16, hash_prompt(prompt(16, 200), 16), priority=50)
    res = m.step(StepBatch(free=["hi", "lo", "mid"]))  # one release of three rows, three priorities
    assert res.free_status.tolist() == [0, 0, 0]
    # fresh 6, 7, 8 first, then by priority (lowest first), each row's blocks tail first
    assert m.pool.free_queue_order().tolist() == [6, 7, 8, 4, 3, 5, 2, 1]
    assert m.pool.evict_prio[[1, 2, 3, 4, 5]].tolist() == [90, 90, 10, 10, 50]


# ---------------------------------------------------------------- cascade + encoder-decoder
def test_common_prefix_blocks_of_the_running_requests():
    m = make()
    hashes = hash_prompt(prompt(48), 16)
    for r in "abc":
        m.allocate(r, 48, hashes[:2])
    assert m.num_common_prefix_blocks("a", 3) == 2
    assert m.num_common_prefix_blocks("a", 2) == 0


def test_cross_attention_table_allocated_once_and_freed_with_the_request():
    m = make(max_encoder_len=64, encoder_block_size=16)
    r = m.allocate("a", 20, num_encoder_tokens=40)
    assert r.block_ids.tolist() == [1, 2] and m.cross_block_table("a").tolist() == [3, 4, 5]
    m.append_slots("a", 20)
    assert m.cross_block_table("a").tolist() == [3, 4, 5]
    m.free("a")
    assert m.num_free_blocks == 15
    with pytest.raises(errors.InvalidArgument):
        m.allocate("b", 20, num_encoder_tokens=65)


def test_a_shared_block_registered_twice_keeps_its_first_hash():
    m = make()
    m.allocate("p", 16)
    m.fork("p", "c")
    first, second = hash_prompt(prompt(16), 16), hash_prompt(prompt(16, 50), 16)
    m.append_slots("c", 0, first)
    m.append_slots("p", 0, second)  # a client bug: other hashes for the same block
    assert m.pool.caches[1] == {bytes(first[0]): 1}
    m.check_invariants(heavy=True)


def test_fork_batch_of_one_parent_with_two_groups_and_cross_blocks():
    m = make(num_blocks=32, groups=(GroupSpec(16), GroupSpec(8)), max_encoder_len=32)
    m.allocate("p", 40, num_encoder_tokens=20)  # group 0: 1-3, group 1: 4-8, cross: 9-10
    res = m.step(StepBatch(forks=[("p", "a"), ("p", "b")]))
    assert res.fork_status.tolist() == [0, 0]
    assert m.pool.ref_cnt[1:11].tolist() == [3] * 10
    assert m.block_table("b", 1).tolist() == [4, 5, 6, 7, 8]
    assert m.cross_block_table("a").tolist() == [9, 10]
    m.check_invariants(heavy=True)


def test_two_full_attention_groups_hit_only_what_both_have_cached():
    m = BlockManager(ManagerConfig(num_gpu_blocks=32, groups=(GroupSpec(block_size=4), GroupSpec(block_size=8)),
                                   max_model_len=64, max_num_reqs=8, debug_checks=True))
    p = np.arange(17)
    hashes = [hash_prompt(p, 4), hash_prompt(p, 8)]
    a = m.allocate("a", 17, hashes)  # nothing cached: a miss in both groups (was: a hit on -1)
    assert a.num_cached_tokens == 0 and [t.tolist() for t in a.group_block_ids] == [[1, 2, 3, 4, 5], [6, 7, 8]]
    b = m.allocate("b", 17, [hashes[0], hashes[1][:1]])  # group 1 has only its first block
    assert b.num_cached_tokens == 8 and b.group_block_ids[0][:2].tolist() == [1, 2]
    assert b.group_block_ids[1][:1].tolist() == [6]
