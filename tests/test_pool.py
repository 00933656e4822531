"""Exact-state tests of the block pool: ids handed out, ref counts, free-queue order, eviction."""

import numpy as np
import pytest

from kvd.hashing import HASH_DTYPE
from kvd.pool import BlockPool

KEY = 1


def h(*values):
    return np.array([bytes([v]) * 16 for v in values], HASH_DTYPE)


def ids(*values):
    return np.array(values, np.int32)


def test_fresh_pool_hands_out_1_2_3_and_never_the_null_block():
    pool = BlockPool(8)
    assert pool.num_free == 7
    assert pool.free_queue_order().tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert pool.take(7).tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert pool.num_free == 0 and pool.ref_cnt.tolist() == [0, 1, 1, 1, 1, 1, 1, 1]
    pool.check_invariants(heavy=True)


def test_uncached_blocks_go_to_the_front_in_freeing_order():
    pool = BlockPool(8)
    pool.take(5)  # 1..5
    pool.release(ids(3, 1))  # freed 3 then 1: 1 is now the very front
    assert pool.free_queue_order().tolist() == [1, 3, 6, 7]
    assert pool.take(2).tolist() == [1, 3]
    pool.check_invariants(heavy=True)


def test_cached_blocks_go_to_the_back_and_are_evicted_least_recently_freed_first():
    pool = BlockPool(8)
    blocks = pool.take(4)  # 1..4
    pool.register(KEY, h(10, 11, 12), blocks[:3])
    # a request frees tail first: 4 (uncached), 3, 2, 1 (cached)
    pool.release(ids(4, 3, 2, 1))
    assert pool.free_queue_order().tolist() == [4, 5, 6, 7, 3, 2, 1]
    assert pool.num_evictable == 3 and pool.num_fresh == 4
    taken = pool.take(5)
    assert taken.tolist() == [4, 5, 6, 7, 3]
    assert pool.num_evictions == 1
    assert bytes(h(12)[0]) not in pool.caches[KEY]  # block 3's hash is gone
    assert pool.caches[KEY] == {bytes(h(10)[0]): 1, bytes(h(11)[0]): 2}
    assert pool.cache_key[3] == 0
    pool.check_invariants(heavy=True)


def test_prefix_hit_takes_a_cached_block_out_of_the_middle():
    pool = BlockPool(8)
    blocks = pool.take(3)
    pool.register(KEY, h(1, 2, 3), blocks)
    pool.release(ids(3, 2, 1))
    assert pool.lookup(KEY, h(1, 2, 9)).tolist() == [1, 2]
    pool.touch(ids(2))
    assert pool.ref_cnt[2] == 1
    assert pool.free_queue_order().tolist() == [4, 5, 6, 7, 3, 1]
    pool.check_invariants(heavy=True)
    pool.release(ids(2))  # back to the tail
    assert pool.free_queue_order().tolist() == [4, 5, 6, 7, 3, 1, 2]
    pool.check_invariants(heavy=True)


def test_register_keeps_the_first_block_of_a_hash():
    pool = BlockPool(8)
    a, b = pool.take(2)
    pool.register(KEY, h(5), ids(a))
    pool.register(KEY, h(5), ids(b))
    assert pool.caches[KEY] == {bytes(h(5)[0]): a}
    assert pool.cache_key[b] == 0
    pool.release(ids(b, a))
    assert pool.free_queue_order().tolist() == [b, 3, 4, 5, 6, 7, a]


def test_release_with_repeats_frees_each_block_once_at_its_last_entry():
    pool = BlockPool(8)
    pool.take(3)  # 1, 2, 3
    pool.incref(ids(1, 2))  # 1 and 2 held twice
    pool.release(ids(3, 1, 2, 1, 2))
    assert pool.ref_cnt[1:4].tolist() == [0, 0, 0]
    assert pool.free_queue_order().tolist() == [2, 1, 3, 4, 5, 6, 7]
    pool.check_invariants(heavy=True)


def test_eviction_priorities_lowest_first_lru_within_one():
    pool = BlockPool(6)
    blocks = pool.take(5)
    pool.register(KEY, h(1, 2, 3, 4, 5), blocks)
    pool.release(ids(1), priority=50)
    pool.release(ids(2), priority=10)
    pool.release(ids(3), priority=50)
    pool.release(ids(4, 5), priority=np.array([90, 10]))
    assert pool.free_queue_order().tolist() == [2, 5, 1, 3, 4]
    assert pool.take(3).tolist() == [2, 5, 1]
    pool.check_invariants(heavy=True)


def test_eviction_queue_survives_compaction_and_growth():
    pool = BlockPool(3000)
    blocks = pool.take(2999)
    pool.register(KEY, np.array([i.to_bytes(16, "little") for i in range(1, 3000)], HASH_DTYPE), blocks)
    pool.release(blocks)
    for _ in range(5):  # revive and free again: tombstones pile up and get squeezed out
        pool.touch(blocks[::2])
        pool.release(blocks[::2])
        pool.check_invariants(heavy=True)
    order = pool.free_queue_order()
    assert order.tolist() == blocks[1::2].tolist() + blocks[::2].tolist()


def test_reset_cache_refuses_while_a_cached_block_is_held_then_frees_everything():
    pool = BlockPool(8)
    blocks = pool.take(3)
    pool.register(KEY, h(1, 2, 3), blocks)
    pool.release(ids(3, 2))
    assert not pool.reset_cache()
    pool.release(ids(1))
    assert pool.reset_cache()
    assert pool.caches == {} and pool.num_evictable == 0 and pool.num_free == 7
    pool.check_invariants(heavy=True)


def test_pool_of_a_million_blocks_stays_under_40_bytes_per_block():
    pool = BlockPool(1_000_000)
    assert pool.nbytes_per_block() <= 40
    assert pool.num_free == 999_999


def test_releasing_a_free_block_is_a_bug():
    pool = BlockPool(4)
    with pytest.raises(AssertionError):
        pool.release(ids(1))


def test_more_releases_than_references_is_a_bug_and_changes_no_count():
    pool = BlockPool(8)
    pool.take(3)  # 1, 2, 3
    pool.incref(ids(2))
    with pytest.raises(AssertionError):
        pool.release(ids(1, 2, 3, 2, 2))  # block 2 is held twice, released three times
    assert pool.ref_cnt[1:4].tolist() == [1, 2, 1] and pool.num_free == 4


def test_a_reset_clears_every_map_stored_into_even_through_the_one_by_one_path():
    pool = BlockPool(8)
    pool.event_log = []
    blocks = pool.take(3)
    in_main, _ = pool.register(KEY, h(1, 2, 1), blocks)  # a repeated hash: stored one by one
    assert in_main.tolist() == [True, True, False] and pool.caches == {KEY: {bytes(h(1)[0]): 1, bytes(h(2)[0]): 2}}
    pool.release(blocks)
    assert pool.reset_cache() and pool.caches == {}
    assert pool.event_log[-1] == ("cleared", KEY, [])
    assert pool.free_queue_order().tolist() == [2, 1, 3, 4, 5, 6, 7]
    pool.check_invariants(heavy=True)


def test_compiled_park_puts_every_block_where_the_array_version_does(monkeypatch):
    """``park`` in one compiled pass (numba, once the priority's eviction queue exists) and the array
    version: the same free-queue order, counts and priorities after every release of a random run of
    takes, registrations (some blocks cached, some not) and releases, and the same blocks handed out."""
    from kvd import pool as pool_mod

    def run(compiled: bool):
        monkeypatch.setattr(pool_mod.rowloops, "HAVE_NUMBA", compiled and pool_mod.rowloops.HAVE_NUMBA)
        rng = np.random.default_rng(5)
        pool, held, seen, n = BlockPool(64), [], [], 0
        for step in range(300):
            if held and (rng.random() < 0.45 or pool.num_free < 8):
                blocks = held.pop(int(rng.integers(len(held))))
                pool.release(blocks[::-1].copy(), int(rng.integers(0, 3)) if step % 7 == 0 else 0)
            else:
                blocks = pool.take(int(rng.integers(1, 6)))
                k = int(rng.integers(0, blocks.size + 1))  # the first k blocks get a prefix-cache entry
                if k:
                    pool.register(KEY, h(*[(n + i) % 251 for i in range(k)]), blocks[:k])
                    n += k
                held.append(blocks)
            seen.append((pool.free_queue_order().tolist(), pool.num_evictable, pool.num_fresh,
                         pool.ref_cnt.tolist(), pool.evict_prio.tolist()))
        pool.check_invariants(heavy=True)
        return seen

    assert run(compiled=True) == run(compiled=False)


def test_compiled_park_of_a_mixed_release_exact_order():
    """Once the default queue exists (first release), a release of cached and uncached blocks: the
    uncached ones go on the front in freeing order, the cached ones to the back in freeing order."""
    pool = BlockPool(10)
    first = pool.take(2)  # 1, 2
    pool.register(KEY, h(1), first[:1])
    pool.release(first[::-1].copy())  # 2 (uncached) to the front, 1 (cached) to the back: queue exists now
    assert pool.free_queue_order().tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 1]
    blocks = pool.take(4)  # 2, 3, 4, 5
    assert blocks.tolist() == [2, 3, 4, 5]
    pool.register(KEY, h(2, 3), blocks[[1, 3]])  # 3 and 5 cached
    pool.release(ids(5, 4, 3, 2))
    assert pool.free_queue_order().tolist() == [2, 4, 6, 7, 8, 9, 1, 5, 3]
    assert pool.num_evictable == 3 and pool.num_fresh == 6
    pool.check_invariants(heavy=True)


@pytest.mark.parametrize("compiled", [True, False])
def test_touch_revives_free_cached_blocks_of_each_priority_and_holds_the_rest_once_more(monkeypatch, compiled):
    from kvd import rowloops

    if compiled and not rowloops.HAVE_NUMBA:
        pytest.skip("numba not installed")
    monkeypatch.setattr(rowloops, "HAVE_NUMBA", compiled)
    pool = BlockPool(10)
    blocks = pool.take(5)  # 1..5
    pool.register(KEY, h(1, 2, 3, 4), blocks[:4])
    pool.release(ids(1, 2), priority=3)  # cached, priority 3: queue [1, 2]
    pool.release(ids(3), priority=7)  # cached, priority 7: queue [3]
    assert pool.num_evictable == 3 and pool.num_unheld(ids(1, 4, 3)) == 2
    pool.touch(ids(4, 2, 3))  # 4 is held already: one reference more; 2 and 3 are revived
    assert pool.ref_cnt[1:6].tolist() == [0, 1, 1, 2, 1]
    assert pool.num_evictable == 1 and pool.num_unheld(ids(1, 2, 3, 4)) == 1
    assert pool.free_queue_order().tolist() == [6, 7, 8, 9, 1]
    assert pool._per_prio.sum() == 0  # the scratch is left clean for the next touch
    pool.check_invariants(heavy=True)
    pool.release(ids(2, 3, 4, 4), priority=3)
    assert pool.free_queue_order().tolist() == [6, 7, 8, 9, 1, 2, 3, 4]  # revived blocks queue anew
    assert pool.num_evictable == 4 and pool.ref_cnt[1:6].tolist() == [0, 0, 0, 0, 1]
    pool.check_invariants(heavy=True)


@pytest.mark.parametrize("compiled", [True, False])
def test_take_hands_out_the_front_of_the_free_queue_across_priorities_and_tombstones(monkeypatch, compiled):
    """Every ``take`` (fresh blocks, then evictions that skip tombstones and cross from one priority's
    queue to the next, compiled or as arrays) hands out exactly the front of ``free_queue_order``,
    in that order, and uncaches what it evicts."""
    from kvd import rowloops

    if compiled and not rowloops.HAVE_NUMBA:
        pytest.skip("numba not installed")
    monkeypatch.setattr(rowloops, "HAVE_NUMBA", compiled)
    rng = np.random.default_rng(11)
    pool, held, n = BlockPool(48), [], 0
    for step in range(400):
        if held and (rng.random() < 0.5 or pool.num_free < 6):
            blocks = held.pop(int(rng.integers(len(held))))
            pool.release(blocks[::-1].copy(), int(rng.integers(0, 3)))
        elif rng.random() < 0.2 and pool.num_evictable:  # a prefix hit: a tombstone mid-queue
            cached = np.flatnonzero((pool.cache_key != 0) & (pool.ref_cnt == 0)).astype(np.int32)
            hit = cached[rng.integers(cached.size, size=1)]
            pool.touch(hit)
            held.append(hit)
        else:
            k = int(rng.integers(1, min(6, pool.num_free) + 1))
            front = pool.free_queue_order()[:k]
            were_cached = int(np.count_nonzero(pool.cache_key[front]))
            evictions = pool.num_evictions
            blocks = pool.take(k)
            assert blocks.tolist() == front.tolist() and blocks.dtype == np.int32
            assert pool.num_evictions - evictions == were_cached
            assert (pool.cache_key[blocks] == 0).all() and (pool.ref_cnt[blocks] == 1).all()
            fresh = rng.integers(0, k + 1)
            if fresh:
                pool.register(KEY, h(*[(n + i) % 251 for i in range(fresh)]), blocks[:fresh])
                n += fresh
            held.append(blocks)
        pool.check_invariants(heavy=True)
    assert pool.num_evictions > 50
