"""The prefix-cache index (kvd.prefixindex) against a dict model: exact blocks, counts, slots."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvd import prefixindex as PI
from kvd.prefixindex import EMPTY_SLOT, NOT_FOUND, PrefixIndex
from machine_settings import machine_settings

W = 16


def hashes(*ids: int) -> np.ndarray:
    return np.array([bytes([i]) * W for i in ids], f"S{W}")


def make(num_blocks: int = 8):
    bh = np.zeros(num_blocks, f"S{W}")
    ck = np.zeros(num_blocks, np.uint16)
    return PrefixIndex(bh, ck), bh, ck


def test_the_table_is_a_power_of_two_at_least_twice_the_pool():
    assert [PI.capacity(n) for n in (1, 8, 9, 65536)] == [16, 16, 32, 131072]
    assert PI.nbytes(65536) == 8 * 131072 + 8 * 65536


def test_insert_new_writes_the_blocks_identity_and_finds_them_by_map():
    index, bh, ck = make()
    assert index.insert_new(3, hashes(1, 2), np.array([5, 6], np.int32)) == -1
    assert bh[5] == hashes(1)[0] and bh[6] == hashes(2)[0] and ck[5] == ck[6] == 3
    assert index.find(3, hashes(2, 1, 9)).tolist() == [6, 5, NOT_FOUND]
    assert index.find(4, hashes(1)).tolist() == [NOT_FOUND]  # another map: not there
    assert index.run(3, hashes(1, 2, 9, 1)).tolist() == [5, 6]  # the leading run only
    assert (index.size_of(3), index.size_of(4), len(index)) == (2, 0, 2)
    assert index.get_at(3, hashes(9, 2), 1) == 6 and index.get_at(3, hashes(9), 0) is None
    assert np.count_nonzero(index.slots) == 2
    index.check()


def test_insert_new_is_all_or_nothing():
    index, bh, ck = make()
    index.insert_new(1, hashes(1), np.array([1], np.int32))
    before = index.slots.copy()
    assert index.insert_new(1, hashes(2, 1), np.array([2, 3], np.int32)) == 1  # hash 1 is held
    assert index.insert_new(1, hashes(2, 3, 2), np.array([2, 3, 4], np.int32)) == 2  # repeated hash
    assert index.insert_new(1, hashes(2, 3), np.array([2, 2], np.int32)) == 1  # repeated block
    assert np.array_equal(index.slots, before) and ck[2:].tolist() == [0] * 6 and len(index) == 1
    index.check()
    # the same hash in another map is no conflict
    assert index.insert_new(2, hashes(1), np.array([2], np.int32)) == -1
    assert index.find(1, hashes(1)).tolist() == [1] and index.find(2, hashes(1)).tolist() == [2]


def test_insert_each_follows_the_pools_block_by_block_rule():
    """Map 1 is shared, map 2 writer A's side map (A's blocks are marked 2), 3 writer B's mark."""
    index, bh, ck = make(16)
    mark = np.zeros(16, np.uint16)
    index.insert_new(1, hashes(1, 2, 3), np.array([1, 2, 3], np.int32))
    mark[2], mark[3] = 3, 2  # hash 2 awaits B's confirmation, hash 3 A's own
    index.insert_new(2, hashes(4), np.array([4], np.int32))  # A's side copy of hash 4
    # as writer A: 8 cached already (skipped), 4 A's side copy, 2 B's unconfirmed -> side, 3 A's own,
    # 1 confirmed, 5 new -> shared, 5 again in the batch (its block 11 is then a duplicate: nothing)
    index.insert_new(1, hashes(9), np.array([8], np.int32))
    h = hashes(7, 4, 2, 3, 1, 5, 5)
    blocks = np.array([8, 9, 10, 11, 12, 13, 14], np.int32)
    in_main, in_side = np.zeros(7, bool), np.zeros(7, bool)
    assert index.insert_each(1, 2, h, blocks, mark, in_main, in_side) == -1
    assert np.flatnonzero(in_main).tolist() == [5] and np.flatnonzero(in_side).tolist() == [2]
    assert index.find(1, hashes(5)).tolist() == [13] and index.find(2, hashes(2, 4)).tolist() == [10, 4]
    assert ck[8:15].tolist() == [1, 0, 2, 0, 0, 1, 0] and (index.size_of(1), index.size_of(2)) == (5, 2)
    index.check()


def test_insert_each_stops_where_a_confirmed_block_meets_an_unconfirmed_entry():
    index, bh, ck = make(16)
    mark = np.zeros(16, np.uint16)
    index.insert_new(1, hashes(1, 2), np.array([1, 2], np.int32))
    mark[2] = 3
    in_main, in_side = np.zeros(3, bool), np.zeros(3, bool)
    h, blocks = hashes(6, 2, 7), np.array([5, 6, 7], np.int32)
    assert index.insert_each(1, 0, h, blocks, mark, in_main, in_side) == 1  # writer 0 vs block 2
    assert in_main.tolist() == [True, False, False] and ck[5:8].tolist() == [1, 0, 0]
    assert index.insert_each(1, 0, h, blocks, mark, in_main, in_side, 2) == -1  # the caller goes on
    assert in_main.tolist() == [True, False, True] and ck[5:8].tolist() == [1, 0, 1] and not in_side.any()
    index.check()


def test_insert_one_stores_only_an_absent_hash():
    index, bh, ck = make()
    h = hashes(1, 2)
    assert index.insert_one(1, h, 0, 4) and not index.insert_one(1, h, 0, 5)
    assert index.insert_one(1, h, 1, 5) and index.find(1, h).tolist() == [4, 5] and ck[5] == 1


def test_remove_keeps_the_rest_of_a_cluster_reachable_and_ignores_absent_blocks():
    # 15 blocks in 32 slots: clusters form; removing from their middles shifts entries back
    index, bh, ck = make(16)
    h = hashes(*range(1, 16))
    blocks = np.arange(1, 16, dtype=np.int32)
    assert index.insert_new(1, h, blocks) == -1
    for gone in ([7], [1, 15], [3, 4, 5]):
        index.remove(np.array(gone, np.int32))
        ck[gone] = 0
        index.check()
    index.remove(np.array([7], np.int32))  # not there any more: nothing changes
    left = [b for b in range(1, 16) if b not in (7, 1, 15, 3, 4, 5)]
    assert index.find(1, h).tolist() == [b if b in left else NOT_FOUND for b in range(1, 16)]
    assert len(index) == len(left) and np.count_nonzero(index.slots != EMPTY_SLOT) == len(left)


def test_rebuild_indexes_exactly_the_cached_blocks():
    index, bh, ck = make()
    bh[2], ck[2] = hashes(7)[0], 5
    bh[3], ck[3] = hashes(8)[0], 6
    index.rebuild()
    assert index.find(5, hashes(7, 8)).tolist() == [2, NOT_FOUND] and index.find(6, hashes(8)).tolist() == [3]
    assert (index.size_of(5), index.size_of(6)) == (1, 1)
    index.check()


def test_two_processes_mix_hashes_differently():
    a, _, _ = make()
    b, _, _ = make()
    assert a.seed != b.seed  # a client cannot aim its hashes at one cluster


ops = st.lists(st.tuples(st.sampled_from(["insert", "one", "remove"]), st.integers(1, 2),
                         st.lists(st.integers(0, 11), min_size=1, max_size=5)), max_size=40)


@machine_settings(150, 1)
@given(ops)
def test_the_index_agrees_with_a_dict_model(program):
    """Random stores and removals on a 12-block pool (a 32-slot table, so clusters): after every
    operation each map holds what a dict would, and the table is consistent."""
    index, bh, ck = make(12)
    model: dict[tuple[int, bytes], int] = {}
    for op, key, ids in program:
        free = [b for b in range(1, 12) if ck[b] == 0]
        if op == "remove":
            blocks = np.array(sorted({1 + i % 11 for i in ids}), np.int32)
            index.remove(blocks)
            for b in blocks.tolist():
                if ck[b]:
                    del model[(int(ck[b]), bytes(bh[b]))]
                ck[b] = 0
        elif op == "insert":
            h = hashes(*ids)
            blocks = np.array(free[: len(ids)], np.int32)
            if blocks.size < len(ids):
                continue
            fresh = [(key, bytes(x)) for x in h.tolist()]
            ok = len(set(fresh)) == len(fresh) and not any(f in model for f in fresh)
            assert (index.insert_new(key, h, blocks) == -1) == ok
            if ok:
                model.update(zip(fresh, blocks.tolist()))
        else:
            h = hashes(ids[0])
            if not free:
                continue
            ok = (key, bytes(h[0])) not in model
            assert index.insert_one(key, h, 0, free[0]) == ok
            if ok:
                model[(key, bytes(h[0]))] = free[0]
        index.check()
        for k in (1, 2):
            probe = hashes(*range(12))
            want = [model.get((k, bytes(x)), NOT_FOUND) for x in probe.tolist()]
            assert index.find(k, probe).tolist() == want
            lead = want.index(NOT_FOUND) if NOT_FOUND in want else len(want)
            assert index.run(k, probe).tolist() == want[:lead]
            assert index.size_of(k) == sum(1 for (kk, _) in model if kk == k)


def test_the_plain_python_loops_agree_with_the_compiled_ones():
    """Without numba (the base install) the same loops run as Python over numpy arrays, which
    check every index: a scratch array one word too small fails here, not only in a compiled run."""
    import subprocess
    import sys

    script = r"""
import numpy as np
from kvd.prefixindex import PrefixIndex, NOT_FOUND
bh = np.zeros(40, "S16"); ck = np.zeros(40, np.uint16)
index = PrefixIndex(bh, ck)
h = np.array([bytes([i]) * 16 for i in range(1, 13)], "S16")
assert index.insert_new(3, h[:8], np.arange(1, 9, dtype=np.int32)) == -1
assert index.find(3, h[:8]).tolist() == list(range(1, 9))  # as many hashes as the scratch has tags
assert index.insert_new(3, h[7:], np.arange(9, 14, dtype=np.int32)) == 0  # h[7] is held: nothing stored
assert index.find(3, h).tolist() == list(range(1, 9)) + [NOT_FOUND] * 4
assert index.run(3, h[2:]).tolist() == list(range(3, 9))
index.remove(np.array([2, 5], np.int32)); ck[[2, 5]] = 0
assert index.find(3, h[:6]).tolist() == [1, NOT_FOUND, 3, 4, NOT_FOUND, 6]
index.check()
print("ok")
"""
    env = {**__import__("os").environ, "NUMBA_DISABLE_JIT": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_hashes_at_an_unaligned_address_are_read_as_the_same_words():
    """A message frame's hashes may start at any byte: the index copies them to aligned words
    (numba would otherwise compile a loop for unaligned arrays during a step)."""
    index, bh, ck = make()
    raw = bytearray(1 + 2 * W)
    raw[1:] = hashes(7, 8).tobytes()
    unaligned = np.frombuffer(bytes(raw), f"S{W}", count=2, offset=1)
    assert not unaligned.view(np.uint64).flags.aligned
    assert index.insert_new(2, unaligned, np.array([3, 4], np.int32)) == -1
    assert index.find(2, hashes(8, 7)).tolist() == [4, 3] and bh[3] == hashes(7)[0]
    assert index.find(2, unaligned).tolist() == [3, 4]
    index.check()
