"""The compiled row loops on hand-made arrays: exact plans, exact writes, and planning that
declines changes nothing (reference counts and the scratch mark are as they were)."""

import os

import numpy as np
import pytest

from kvd import rowloops

BS = 4
R = 6


def state():
    """Rows 0..2 active; row 0 (7 tokens: blocks 1, 2) forked into row 1, both sharing the
    partial block 2; row 2 (8 tokens: blocks 3, 4, both full)."""
    s = dict(
        num_tokens=np.array([7, 7, 8, 0, 0, 0], np.int64),
        appendable=np.array([1, 1, 1, 0, 0, 0], bool),
        forked=np.array([1, 1, 0, 0, 0, 0], bool),
        mark=np.zeros(R, np.int32),
        table=np.zeros((R, 4), np.int32),
        num_blocks=np.array([2, 2, 2, 0, 0, 0], np.int32),
        last_block=np.array([2, 2, 4, 0, 0, 0], np.int32),
        num_registered=np.array([1, 1, 2, 0, 0, 0], np.int32),
        ref_cnt=np.array([0, 2, 2, 1, 1, 0, 0, 0, 0, 0], np.int32),
    )
    s["table"][0, :2] = [1, 2]
    s["table"][1, :2] = [1, 2]
    s["table"][2, :2] = [3, 4]
    return s


def plan(s, rows, n=1, n_array=(), hash_counts=(), lookahead=0, max_len=16):
    k = len(rows)
    out = dict(old=np.full(k, -9, np.int64), grow=np.full(k, -9, np.int64), cow=np.zeros(k, bool))
    need = rowloops.plan_appends(
        np.array(rows, np.int32), n, np.array(n_array, np.int64), lookahead, np.array(hash_counts, np.int64), max_len,
        s["num_tokens"], s["appendable"], s["forked"], True, s["mark"], s["table"], s["num_blocks"],
        s["num_registered"], s["ref_cnt"], BS, out["old"], out["grow"], out["cow"],
    )
    return need, out


def test_plan_copies_the_first_writers_of_a_shared_block_and_counts_growth():
    s = state()
    ref_before = s["ref_cnt"].copy()
    need, out = plan(s, [1, 2, 0], n=2)
    # row 1 writes first into shared block 2: copies; row 0, the last holder, writes in place.
    # 7 + 2 = 9 tokens need 3 blocks: rows 1 and 0 grow by one; row 2 (8 + 2) too.
    assert out["cow"].tolist() == [True, False, False]
    assert out["grow"].tolist() == [1, 1, 1] and out["old"].tolist() == [7, 8, 7]
    assert need == 4
    assert np.array_equal(s["ref_cnt"], ref_before)



def test_plan_counts_blocks_to_add_at_each_side_of_a_block_boundary():
    # rows 0-2 hold 7, 7 and 8 tokens in 2 blocks of 4: each adds what it lacks, rounded up to blocks
    for n, lookahead, grow in ((1, 0, [0, 0, 1]), (4, 0, [1, 1, 1]), (5, 0, [1, 1, 2]), (9, 0, [2, 2, 3]),
                               (1, 4, [1, 1, 2]), (1, 5, [2, 2, 2]), (1, 9, [3, 3, 3])):
        need, out = plan(state(), [0, 1, 2], n=n, lookahead=lookahead, max_len=64)
        shared_copy = int(out["cow"].sum())
        assert out["grow"].tolist() == grow, (n, lookahead)
        assert need == sum(grow) + shared_copy

@pytest.mark.parametrize(
    "rows, kw",
    [
        ([0, 7], {}),  # a row out of range
        ([0, 3], {}),  # a row that is not appendable
        ([0, 1, 0], {}),  # a row named twice
        ([1, 0], dict(n_array=[1, -1])),  # a negative count, after a planned copy
        ([1, 0], dict(n_array=[1, 10])),  # past max_model_len, after a planned copy
        ([1, 2], dict(hash_counts=[0, 3])),  # more hashes than full, unregistered blocks
        ([1, 2], dict(hash_counts=[0, 2**62])),  # one whose bound would overflow int64
    ],
)
def test_a_declined_plan_changes_nothing(rows, kw):
    s = state()
    before = {k: v.copy() for k, v in s.items() if k != "mark"}  # mark is scratch
    need, _ = plan(s, rows, **kw)
    assert need == rowloops.DECLINED
    for k, v in before.items():
        assert np.array_equal(s[k], v), k


def test_plan_accepts_hashes_up_to_the_full_unregistered_blocks_exactly():
    # row 1: 7 + 1 = 8 tokens, 2 full blocks, 1 registered: one hash may come, not two
    assert plan(state(), [1], hash_counts=[1])[0] >= 0
    assert plan(state(), [1], hash_counts=[2])[0] == rowloops.DECLINED
    # row 2: 8 + 4 = 12 tokens, 3 full blocks, 2 registered
    assert plan(state(), [2], n=4, hash_counts=[1])[0] >= 0
    assert plan(state(), [2], n=4, hash_counts=[2])[0] == rowloops.DECLINED


def test_apply_hands_out_copy_then_growth_blocks_in_batch_order():
    s = state()
    rows = np.array([1, 2, 0], np.int32)
    need, out = plan(s, rows.tolist(), n=2)
    blocks = np.array([5, 6, 7, 8], np.int32)
    s["ref_cnt"][blocks] = 1
    copies, changed = np.zeros((R, 2), np.int32), np.zeros(R, np.int32)
    n_copies, n_changed = rowloops.apply_appends(
        rows, 2, np.empty(0, np.int64), out["old"], out["grow"], out["cow"], blocks, s["num_tokens"], s["table"],
        s["num_blocks"], s["last_block"], s["ref_cnt"], BS, copies, changed,
    )
    assert (n_copies, n_changed) == (1, 3)
    assert copies[:1].tolist() == [[2, 5]] and changed[:3].tolist() == [1, 2, 0]
    assert s["table"][:3, :3].tolist() == [[1, 2, 8], [1, 5, 6], [3, 4, 7]]
    assert s["num_blocks"][:3].tolist() == [3, 3, 3] and s["num_tokens"][:3].tolist() == [9, 9, 10]
    assert s["last_block"].tolist() == [8, 6, 7, 0, 0, 0]  # each changed row's new last column
    assert s["ref_cnt"][:9].tolist() == [0, 2, 1, 1, 1, 1, 1, 1, 1]


def test_mirror_appends_writes_the_mirror_rows_exactly_where_the_tables_changed():
    """A daemon's session segment as the mirror: request i of the batch is mirror row m_rows[i];
    the entries the appends wrote (copy-on-write and growth), each changed row's count and its
    tracked range, nothing else."""
    s = state()
    rows = np.array([1, 2, 0], np.int32)
    _, out = plan(s, rows.tolist(), n=2)
    m_table = np.full((4, 4), -7, np.int32)  # the published tables: session rows 3, 0, 1
    m_table[3, :2], m_table[0, :2], m_table[1, :2] = [1, 2], [3, 4], [1, 2]
    m_counts = np.array([2, 2, -7, 2], np.int32)
    m_rows = np.array([3, 0, 1], np.int32)
    m_start, m_end = np.full(4, 99, np.int32), np.zeros(4, np.int32)
    s["ref_cnt"][[5, 6, 7, 8]] = 1
    rowloops.apply_appends(
        rows, 2, np.empty(0, np.int64), out["old"], out["grow"], out["cow"], np.array([5, 6, 7, 8], np.int32),
        s["num_tokens"], s["table"], s["num_blocks"], s["last_block"], s["ref_cnt"], BS,
        np.zeros((R, 2), np.int32), np.zeros(R, np.int32),
    )
    rowloops.mirror_appends(m_table, m_counts, m_rows, m_start, m_end, rows, out["old"], out["grow"], out["cow"],
                            s["table"], s["num_blocks"], s["last_block"], BS)
    assert m_table.tolist() == [[3, 4, 7, -7], [1, 2, 8, -7], [-7] * 4, [1, 5, 6, -7]]
    assert m_table[[3, 0, 1], :3].tolist() == s["table"][[1, 2, 0], :3].tolist()
    assert m_counts.tolist() == [3, 3, -7, 3]
    assert m_start.tolist() == [2, 2, 99, 1] and m_end.tolist() == [3, 3, 0, 3]  # row 3: its copy at column 1


def test_append_batch_takes_the_top_of_the_fresh_stack_or_declines_to_apply():
    s = state()
    fresh = np.array([9, 8, 7, 6, 5], np.int32)  # the top (5) is handed out first
    bufs = dict(old=np.zeros(2, np.int64), grow=np.zeros(2, np.int64), cow=np.zeros(2, bool),
                copies=np.zeros((2, 2), np.int32), changed=np.zeros(2, np.int32))

    def call(num_fresh):
        return rowloops.append_batch(
            np.array([1, 0], np.int32), 1, np.empty(0, np.int64), 0, np.empty(0, np.int64), 16,
            s["num_tokens"], s["appendable"], s["forked"], True, s["mark"], s["table"], s["num_blocks"],
            s["last_block"], s["num_registered"], s["ref_cnt"], BS, fresh, num_fresh, bufs["old"], bufs["grow"], bufs["cow"],
            bufs["copies"], bufs["changed"],
        )

    assert call(0) == (1, False, 0, 0)  # one copy needed, no fresh block: nothing applied
    assert s["ref_cnt"][2] == 2 and s["table"][1, 1] == 2
    assert call(5) == (1, True, 1, 1)
    assert bufs["copies"][0].tolist() == [2, 5] and s["table"][1, :2].tolist() == [1, 5]
    assert s["ref_cnt"][[2, 5]].tolist() == [1, 1] and s["num_tokens"][:2].tolist() == [8, 8]
    assert s["last_block"][:3].tolist() == [2, 5, 4]  # row 1's copy replaced its last block


def test_fork_rows_copies_row_state_and_shares_blocks_up_to_the_last_token():
    s = state()
    s["num_blocks"][2] = 3  # row 2 holds a lookahead block 9 past its 8 tokens: it stays its own
    s["table"][2, 2] = 9
    s["last_block"][2] = 9
    s["ref_cnt"][9] = 1
    prio, ns = np.array([0, 0, 7, 0, 0, 0], np.uint8), np.array([0, 0, 3, 0, 0, 0], np.int64)
    skipped = np.zeros(R, np.int32)
    newly = rowloops.fork_rows(
        np.array([2], np.int32), np.array([4, 5], np.int32), s["num_tokens"], prio, ns, s["appendable"].copy(),
        s["appendable"], s["forked"], s["table"], s["num_blocks"], s["last_block"], skipped, s["num_registered"],
        s["ref_cnt"], BS,
    )
    assert newly == 3  # the parent and both children
    assert s["table"][4:, :3].tolist() == [[3, 4, 0], [3, 4, 0]]
    assert s["num_blocks"][4:].tolist() == [2, 2] and s["num_registered"][4:].tolist() == [2, 2]
    assert s["last_block"].tolist() == [2, 2, 9, 0, 4, 4]  # the children's last shared block, not the lookahead
    assert s["num_tokens"][4:].tolist() == [8, 8] and prio[4:].tolist() == [7, 7] and ns[4:].tolist() == [3, 3]
    assert s["ref_cnt"][[3, 4, 9]].tolist() == [3, 3, 1]
    assert s["forked"].tolist() == [True, True, True, False, True, True]


def test_sync_appended_rows_copies_only_new_entries_of_owned_rows_and_widens_dirty_ranges():
    table = np.arange(1, 25, dtype=np.int32).reshape(4, 6)  # manager rows
    counts = np.array([3, 5, 2, 6], np.int32)
    owner_sid = np.array([7, 7, 9, 7], np.int64)
    owner_srow = np.array([2, 0, 1, 1], np.int32)
    out_table = np.full((3, 6), -5, np.int32)  # session rows: what was published before
    out_counts = np.array([4, 6, 1], np.int32)  # srow 0 <- mrow 1 had 4; srow 1 <- mrow 3 had 6
    start = np.full(3, 1000, np.int32)
    end = np.zeros(3, np.int32)
    srows = np.full(3, -9, np.int32)
    last_block = table[np.arange(4), counts - 1]
    k = rowloops.sync_appended_rows(np.array([1, 2, 3], np.int32), owner_sid, owner_srow, 7, table, counts,
                                    last_block, out_table, out_counts, start, end, srows)
    assert k == 2 and srows[:2].tolist() == [0, 1]  # mrow 2 belongs to session 9: untouched
    assert out_table[0].tolist() == [-5, -5, -5, -5, table[1, 4], -5]  # entry 4 only: it grew 4 -> 5
    assert out_table[1].tolist() == [-5] * 6  # unchanged count: nothing copied
    assert out_counts.tolist() == [5, 6, 1]
    assert start.tolist() == [4, 1000, 1000] and end.tolist() == [5, 0, 0]


def test_sync_appended_rows_takes_a_one_block_growth_from_last_block_and_longer_ones_from_the_table():
    table = np.arange(1, 25, dtype=np.int32).reshape(4, 6)
    counts = np.array([3, 5, 4, 2], np.int32)
    last_block = np.array([-1, -2, -3, -4], np.int32)  # deliberately not the table's: pins the source
    owner_sid = np.full(4, 7, np.int64)
    owner_srow = np.arange(4, dtype=np.int32)
    out_table = np.zeros((4, 6), np.int32)
    out_counts = np.array([2, 2, 4, 0], np.int32)  # rows grow by 1, 3, 0 and 2 blocks
    k = rowloops.sync_appended_rows(np.arange(4, dtype=np.int32), owner_sid, owner_srow, 7, table, counts,
                                    last_block, out_table, out_counts, np.empty(0, np.int32),
                                    np.empty(0, np.int32), np.zeros(4, np.int32))
    assert k == 4 and out_counts.tolist() == [3, 5, 4, 2]
    assert out_table.tolist() == [[0, 0, -1, 0, 0, 0],  # one block: last_block's entry
                                  [0, 0, table[1, 2], table[1, 3], table[1, 4], 0],  # three: the table's
                                  [0] * 6,  # unchanged
                                  [table[3, 0], table[3, 1], 0, 0, 0, 0]]


def test_sync_appended_rows_of_a_window_group_writes_the_released_entries_and_marks_from_the_first():
    """``whole``: of a sliding window's published entries, those it released at the front (now
    null) are written and the changed range starts at the first of them; entries from the published
    count on are written and marked even where the shared row holds their value already (left by
    the row's earlier request: the GPU copy may not have it)."""
    table = np.array([[0, 0, 3, 4, 0],   # slid two blocks, count unchanged
                      [0, 0, 7, 8, 9],   # entry 0 was null already: slid one (entry 1), grew by one
                      [0, 11, 12, 0, 0],  # nothing changed
                      [0, 14, 15, 16, 0]],  # grew by one; the shared row holds 16 there already
                     np.int32)
    counts = np.array([4, 5, 3, 4], np.int32)
    out_table = np.array([[1, 2, 3, 4, -5], [0, 6, 7, 8, -5], [0, 11, 12, -5, -5], [0, 14, 15, 16, -5]], np.int32)
    out_counts = np.array([4, 4, 3, 3], np.int32)
    start, end = np.full(4, 1000, np.int32), np.zeros(4, np.int32)
    k = rowloops.sync_appended_rows(np.arange(4, dtype=np.int32), np.full(4, 7, np.int64), np.arange(4, dtype=np.int32),
                                    7, table, counts, table[np.arange(4), counts - 1], out_table, out_counts, start, end,
                                    np.zeros(4, np.int32), True)
    assert k == 4 and out_counts.tolist() == [4, 5, 3, 4]
    assert out_table.tolist() == [[0, 0, 3, 4, -5], [0, 0, 7, 8, 9], [0, 11, 12, -5, -5], [0, 14, 15, 16, -5]]
    assert start.tolist() == [0, 1, 1000, 3] and end.tolist() == [4, 5, 0, 4]


def test_confirm_in_place_confirms_only_blocks_still_held_by_their_registration_or_declines():
    block_reg = np.array([0, 5, 5, 6, 5, 7], np.int64)  # block -> its latest registration
    unconfirmed_by = np.array([0, 2, 2, 2, 3, 2], np.uint16)
    cache_key = np.array([0, 1, 1, 1, 1, 1], np.uint16)  # all in shared map 1
    blocks = np.array([1, 2, 3, 4, 5], np.int32)
    sizes = np.array([4, 1], np.int64)  # entry 0: reg 5 by key 2 (blocks 1-4), entry 1: reg 7 by 2 (block 5)
    n = rowloops.confirm_in_place(blocks, sizes, np.array([5, 7], np.int64), np.array([2, 2], np.uint16),
                                  block_reg, unconfirmed_by, cache_key)
    # block 3 was registered again (reg 6), block 4 is another writer's: both stay as they were
    assert n == 3 and unconfirmed_by.tolist() == [0, 0, 0, 2, 3, 0]
    cache_key[3] = 2  # block 3 now in writer 2's side map, still its reg 6: moving it is the pool's
    before = unconfirmed_by.copy()
    unconfirmed_by[3] = 2
    assert rowloops.confirm_in_place(np.array([3], np.int32), np.array([1], np.int64), np.array([6], np.int64),
                                     np.array([2], np.uint16), block_reg, unconfirmed_by, cache_key) == rowloops.DECLINED
    assert unconfirmed_by.tolist() == before.tolist()


def test_range_slots_equals_the_kernels_reference_for_ranges_of_any_length():
    from kvd_kernels import slot_mapping_from_ranges_ref

    rng = np.random.default_rng(4)
    table = rng.integers(1, 1 << 20, (8, 10)).astype(np.int32)
    rows = np.array([3, 0, 6, 1], np.int32)
    start = np.array([5, 0, 17, 30], np.int32)
    lens = np.array([7, 0, 3, 9], np.int32)  # a request with no token takes no slot
    # rows 3 and 6 end in the ranges' last blocks; row 1 holds lookahead blocks past its range
    num_blocks = np.array([1, 10, 0, 3, 0, 0, 5, 0], np.int32)
    last_block = np.where(num_blocks > 0, table[np.arange(8), np.maximum(num_blocks - 1, 0)], 0).astype(np.int32)
    want = np.full((1, 32), 77, np.int64)
    slot_mapping_from_ranges_ref([table], [4], rows, start, lens, want, prev_tokens=24)
    got = np.full(32, 77, np.int64)
    assert rowloops.range_slots(table, num_blocks, last_block, 4, rows, start, lens, -1, 24, got) == 19
    assert got.tolist() == want[0].tolist()
    assert got[:2].tolist() == [table[3, 1] * 4 + 1, table[3, 1] * 4 + 2]
    assert got[19:25].tolist() == [-1] * 5 + [77]  # padded up to what the last step wrote, no further


def test_range_slots_reads_a_rows_last_block_from_last_block_not_the_table():
    """The contract the manager keeps (last_block == the table's last column): a decode step's
    tokens in the last block come from the dense array; earlier blocks from the table."""
    table = np.array([[3, 5, 7, 0], [2, 4, 0, 0]], np.int32)
    num_blocks = np.array([3, 2], np.int32)
    last_block = np.array([9, 8], np.int32)  # deliberately not the table's 7 and 4
    got = np.full(5, 77, np.int64)
    n = rowloops.range_slots(table, num_blocks, last_block, 4, np.array([0, 1, 0], np.int32),
                             np.array([7, 5, 2], np.int32), np.array([2, 1, 1], np.int32), -1, 5, got)
    # row 0: position 7 in block 5 (table), 8 in its last block; row 1's one token in its last
    # block; a lone token before the last block (as with lookahead) from the table
    assert n == 4 and got.tolist() == [5 * 4 + 3, 9 * 4 + 0, 8 * 4 + 1, 3 * 4 + 2, -1]


def test_next_blocks_names_each_requests_next_block_or_declines_unchanged():
    table = np.array([[1, 2, 0], [3, 4, 0], [5, 6, 7], [8, 0, 0]], np.int32)
    num_blocks = np.array([2, 2, 3, 1], np.int32)
    last_block = np.array([2, 4, 7, 8], np.int32)  # each row's last block, as the manager keeps it
    num_registered = np.array([1, 1, 2, 0], np.int32)
    namespace = np.array([2, 2, 2, 3], np.int64)
    cache_key = np.zeros(9, np.uint16)
    rows = np.array([2, 0, 1], np.int32)

    def run(counts, n, rows=rows, cache_key=cache_key, stop=None):
        blocks, srows, ns = np.full(n, -9, np.int32), np.full(n, -9, np.int32), np.full(1, -9, np.int64)
        k = rowloops.next_blocks(rows, np.array(counts, np.int64), len(counts) if stop is None else stop, namespace,
                                 table, num_blocks, last_block, num_registered, cache_key, blocks, srows, ns)
        return k, int(ns[0]), blocks.tolist(), srows.tolist()

    assert run([1, 0, 1], 2) == (2, 2, [7, 4], [2, 1])  # in batch order, requests of count 0 skipped
    assert run([1, 1, 1], 3) == (3, 2, [7, 2, 4], [2, 0, 1])
    assert run([1, 1, 1], 3, stop=2) == (2, 2, [7, 2, -9], [2, 0, -9])  # the first two requests only
    assert run([1, 0, 0], 2) == (1, 2, [7, -9], [2, -9])
    assert run([0, 0, 0], 1)[:2] == (0, -1)
    declined = rowloops.DECLINED
    assert run([2, 0, 0], 2)[0] == declined  # two blocks of one request
    assert run([1, 1, 1], 2)[0] == declined  # more than there is room for
    assert run([1, 1], 2, rows=np.array([0, 3], np.int32))[0] == declined  # two namespaces
    cached = cache_key.copy()
    cached[4] = 1
    assert run([1, 1, 1], 3, cache_key=cached)[0] == declined  # a block cached already
    assert run([1, 1, 1], 3, cache_key=cached, stop=2)[0] == 2  # ... not among the first two
    assert run([1], 1, rows=np.array([3], np.int32))[:2] == (1, 3)
    num_registered[2] = 1  # a block added after the one that filled (lookahead): from the table
    assert run([1], 1, rows=np.array([2], np.int32)) == (1, 2, [6], [2])
    num_registered[2] = 2
    num_registered[3] = 1
    assert run([1], 1, rows=np.array([3], np.int32))[0] == declined  # the null block
    assert num_registered.tolist() == [1, 1, 2, 1] and not cache_key.any()  # nothing written


def test_add_one_counts_each_named_row_once():
    counts = np.array([5, 0, 7, 1], np.int32)
    rowloops.add_one(counts, np.array([2, 0, 3, 1], np.int32), 3)  # the first three only
    assert counts.tolist() == [6, 0, 8, 2]


def test_drop_row_refs_drops_each_rows_blocks_tail_first_and_lists_those_freed():
    table = np.array([[1, 2, 3, 0], [0, 2, 4, 5], [6, 7, 0, 0]], np.int32)
    ref_cnt = np.array([0, 1, 2, 1, 1, 3, 1, 1], np.int32)
    rows = np.array([1, 0], np.int32)
    starts, stops = np.array([0, 1], np.int32), np.array([3, 3], np.int32)  # row 1: [0, 3), row 0: [1, 3)
    freed, rep = np.full(6, -9, np.int32), np.full(6, -9, np.int32)
    n = rowloops.drop_row_refs(table, rows, starts, stops, ref_cnt, freed, rep, 1)  # appends after entry 0
    # row 1 tail first: 4 (1 -> 0, freed), 2 (2 -> 1), null skipped; row 0: 3 (freed), 2 (1 -> 0, freed)
    assert n == 4 and freed.tolist() == [-9, 4, 3, 2, -9, -9] and rep.tolist() == [-9, 0, 1, 1, -9, -9]
    assert ref_cnt.tolist() == [0, 1, 0, 0, 0, 3, 1, 1]  # block 5 (past row 1's stop) and row 2 untouched
    # the same as drop_refs over the entries gathered in that order
    again = np.array([0, 1, 2, 1, 1, 3, 1, 1], np.int32)
    last = np.zeros(4, bool)
    assert rowloops.drop_refs(np.array([4, 2, 3, 2], np.int32), again, last) == 3 and last.tolist() == [True, False, True, True]
    assert rowloops.drop_row_refs(table, np.array([2], np.int32), np.zeros(1, np.int32), np.array([2], np.int32),
                                  np.zeros(8, np.int32), freed, rep, 0) == rowloops.DECLINED  # a count below zero


def test_slot_inputs_equal_the_numpy_reference_with_empty_and_long_ranges_and_a_short_buffer():
    from kvd.gpu_session import stage_slot_inputs_ref

    rng = np.random.default_rng(5)
    cases = [([4, 9, 2], [1, 0, 2], [100, 7, 0], 16),  # 1 + 0 + 2 tokens: as many as requests, not all ones
             ([3], [1040], [0], 64),  # a prompt longer than the positions buffer: its first 64
             ([1, 2], [1, 1], [5, 9], 8), ([], [], [], 8)]
    cases += [(rng.permutation(50)[:n].tolist(), rng.integers(0, 5, n).tolist(), rng.integers(0, 300, n).tolist(), 40)
              for n in (1, 7, 30)]
    for srows, lens, start, cap in cases:
        a = [np.array(x, np.int32) for x in (srows, start, lens)]
        got = [np.full(64, -7, np.int32), np.full(65, -7, np.int32), np.full(cap, -7, np.int32)]
        want = [x.copy() for x in got]
        assert rowloops.slot_inputs(*a, *got) == stage_slot_inputs_ref(*a, *want) == len(srows)
        for g, w in zip(got, want):
            assert g.tolist() == w.tolist(), (srows, lens, start)
    ref = [np.zeros(4, np.int32), np.zeros(5, np.int32), np.zeros(8, np.int32)]
    stage_slot_inputs_ref(*(np.array(x, np.int32) for x in ([4, 9, 2], [100, 7, 0], [1, 0, 2])), *ref)
    assert ref[2][:3].tolist() == [100, 0, 1]  # as many tokens as requests is not one token each
    out = [np.zeros(4, np.int32), np.zeros(5, np.int32), np.zeros(8, np.int32)]
    rowloops.slot_inputs(np.array([2, 3], np.int32), np.array([10, 20], np.int32), np.array([2, 3], np.int32), *out)
    assert out[0][:2].tolist() == [2, 3] and out[1][:3].tolist() == [0, 2, 5] and out[2][:5].tolist() == [10, 11, 20, 21, 22]


def test_stage_changes_equals_the_numpy_reference_and_resets_the_regions():
    from kvd.gpu_session import stage_group_ref

    rng = np.random.default_rng(6)
    table = rng.integers(1, 1000, (12, 9)).astype(np.int32)
    big = 2**31 - 1
    for trial in range(20):
        st = np.full(12, big, np.int32)
        en = np.zeros(12, np.int32)
        marked = rng.permutation(12)[: rng.integers(0, 12)]
        st[marked] = rng.integers(0, 5, marked.size)
        en[marked] = st[marked] + rng.integers(0, 5, marked.size)  # some empty regions
        bufs = [[np.full(30, -7, np.int32) for _ in range(4)] + [np.full(120, -7, np.int32)] for _ in range(2)]
        for b in bufs:
            b[3][0] = 0
        args = [(st.copy(), en.copy()), (st.copy(), en.copy())]
        got = rowloops.stage_changes(*args[0], 1, table, *bufs[0], 2, 3, big)
        want = stage_group_ref(*args[1], 1, table, *bufs[1], 2, 3, big)
        assert tuple(got) == tuple(want)
        for x, y in zip(bufs[0] + list(args[0]), bufs[1] + list(args[1])):
            assert x.tolist() == y.tolist()
        assert not (args[0][1] > args[0][0]).any()  # every region staged and reset
    st = np.array([big, 1, big], np.int32)
    en = np.array([0, 3, 0], np.int32)
    groups, rows, starts, offsets, ids = (np.zeros(4, np.int32) for _ in range(5))
    assert rowloops.stage_changes(st, en, 0, table[:3], groups, rows, starts, offsets, ids, 0, 0, big) == (1, 2)
    assert (groups[0], rows[0], starts[0], offsets[1]) == (0, 1, 1, 2) and ids[:2].tolist() == table[1, 1:3].tolist()
    assert st.tolist() == [big, big, big] and en.tolist() == [0, 0, 0]


@pytest.mark.parametrize("compiled", [True, False])
def test_map_rows_gathers_or_refuses_a_row_out_of_range(monkeypatch, compiled):
    if compiled and not rowloops.HAVE_NUMBA:
        pytest.skip("numba not installed")
    monkeypatch.setattr(rowloops, "HAVE_NUMBA", compiled)
    mapping = np.array([7, -1, 9, 4], np.int32)
    got = rowloops.map_rows(mapping, np.array([3, 0, 1, 3], np.int32))
    assert got.dtype == np.int32 and got.tolist() == [4, 7, -1, 4]
    for bad in ([0, 4], [-1], [2, 2**31 - 1]):
        assert rowloops.map_rows(mapping, np.array(bad, np.int32)) is None
    frame = np.frombuffer(np.array([2, 1], np.int32).tobytes(), np.int32)  # read-only, as from a message
    assert rowloops.map_rows(mapping, frame).tolist() == [9, -1]
    assert rowloops.map_rows(mapping, frame[:0]).size == 0


@pytest.mark.parametrize("compiled", [True, False])
def test_widened_counts_widens_and_totals_or_flags_a_negative_count(monkeypatch, compiled):
    if compiled and not rowloops.HAVE_NUMBA:
        pytest.skip("numba not installed")
    monkeypatch.setattr(rowloops, "HAVE_NUMBA", compiled)
    frame = np.frombuffer(np.array([1, 0, 2**31 - 1, 3], np.int32).tobytes(), np.int32)  # read-only
    wide, total = rowloops.widened_counts(frame)
    assert wide.dtype == np.int64 and wide.tolist() == [1, 0, 2**31 - 1, 3] and total == 2**31 + 3
    empty, total = rowloops.widened_counts(frame, keep=False)
    assert empty.size == 0 and total == 2**31 + 3
    assert rowloops.widened_counts(np.array([4, -1, 2], np.int32))[1] == -1
    assert rowloops.widened_counts(np.array([-2**31], np.int32), keep=False)[1] == -1
    assert rowloops.widened_counts(frame[:0])[1] == 0


_COLD_LOOPS = """
import json
from kvd import prefixindex, rowloops
from kvd.manager import warm_up

def cold(mod):
    return sorted(n for n, v in vars(mod).items()
                  if hasattr(v, "py_func") and hasattr(v, "signatures") and not v.signatures)

before = cold(rowloops) + cold(prefixindex)
warm_up()
print(json.dumps([before, cold(rowloops), cold(prefixindex)]))
"""


@pytest.mark.skipif(not rowloops.HAVE_NUMBA or os.environ.get("NUMBA_DISABLE_JIT", "0") != "0",
                    reason="numba is not installed or NUMBA_DISABLE_JIT is set: nothing compiles")
def test_manager_warm_up_loads_every_loop_that_python_calls():
    """numba loads a loop at its first call (4-10 ms, inside whatever step calls it first): after
    ``kvd.manager.warm_up`` none is left to load but the helpers only compiled code calls (a fresh
    process, whose loops start unloaded)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _COLD_LOOPS], capture_output=True, text=True, timeout=300, check=True)
    before, rows_cold, index_cold = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"append_batch", "plan_appends", "insert_new", "find_run", "rebuild"} <= set(before)
    assert rows_cold == ["_window_skip", "fork_row_state"]  # inlined into their callers
    assert index_cold and all(n.startswith("_") for n in index_cold)  # the index's inner helpers


def _slide_reference(rows, num_computed, window, block_size, table, num_blocks, num_skipped, ref_cnt):
    """What kvd.manager released before ``slide_windows``: each moved row's entries [old skip, new
    skip) gathered tail first (``_row_blocks``), their references dropped in that order
    (``drop_refs``: a block is freed at its last entry), then nulled."""
    from kvd.manager import _row_blocks

    skip = np.minimum(np.maximum(num_computed - window + 1, 0) // block_size, num_blocks[rows]).astype(np.int32)
    starts = num_skipped[rows]
    moved = np.flatnonzero(skip > starts)
    blocks, rep = _row_blocks(table, rows[moved], starts[moved], skip[moved], True)
    live = blocks != 0
    last = np.zeros(int(live.sum()), bool)
    assert rowloops.drop_refs(blocks[live], ref_cnt, last) >= 0
    freed, freed_rows = blocks[live][last], rows[moved][rep][live][last]
    for i in moved.tolist():
        table[rows[i], starts[i]:skip[i]] = 0
        num_skipped[rows[i]] = skip[i]
    return freed, freed_rows, moved


@pytest.mark.parametrize("seed", range(20))
def test_slide_windows_releases_what_the_gathered_release_did(seed):
    rng = np.random.default_rng(seed)
    R, W, B, bs = 6, 9, 30, 4
    window = int(rng.choice([4, 8, 13]))
    table = rng.integers(1, B, (R, W)).astype(np.int32)
    num_blocks = rng.integers(1, W + 1, R).astype(np.int32)
    num_skipped = np.array([rng.integers(0, n) for n in num_blocks], np.int32)
    for r in range(R):
        table[r, :num_skipped[r]] = 0
        table[r, num_blocks[r]:] = 0
        table[r, rng.random(W) < 0.1] = 0  # a null entry inside the window range: skipped
    ref_cnt = np.bincount(table.ravel(), minlength=B).astype(np.int32) + rng.integers(0, 2, B).astype(np.int32)
    ref_cnt[0] = 0
    rows = rng.permutation(R)[: int(rng.integers(1, R + 1))].astype(np.int32)
    # tokens computed: anywhere up to the row's last block (a window never releases that one)
    num_computed = np.array([rng.integers(0, (num_blocks[r] - 1) * bs + window) for r in rows], np.int64)
    before = num_skipped.copy()
    expect = [a.copy() for a in (table, num_skipped, ref_cnt)]
    freed_ref, rows_ref, moved_ref = _slide_reference(rows, num_computed, window, bs, expect[0], num_blocks,
                                                      expect[1], expect[2])
    total, _ = rowloops.window_slides(rows, num_computed, window, bs, num_blocks, num_skipped, table, num_blocks, np.zeros(B, np.uint16))
    assert total == int((expect[1] - before).sum())  # the entries released, null ones included
    freed, rep, moved = np.full(total, -9, np.int32), np.full(total, -9, np.int32), np.full(R, -9, np.int32)
    n, m = rowloops.slide_windows(rows, num_computed, window, bs, table, num_blocks, num_skipped, ref_cnt,
                                  freed, rep, moved)
    assert freed[:n].tolist() == freed_ref.tolist() and rep[:n].tolist() == rows_ref.tolist()
    assert moved[:m].tolist() == moved_ref.tolist()
    assert np.array_equal(table, expect[0]) and np.array_equal(num_skipped, expect[1])
    assert np.array_equal(ref_cnt, expect[2])


def test_slide_windows_declines_a_count_below_zero_or_a_rows_last_block():
    table = np.array([[5, 6, 7]], np.int32)
    out = [np.zeros(3, np.int32) for _ in range(3)]
    args = (np.array([0], np.int32), np.array([12], np.int64), 4, 4)  # skip (12 - 4 + 1) // 4 = 2 blocks
    assert rowloops.slide_windows(*args, table.copy(), np.array([3], np.int32), np.zeros(1, np.int32),
                                  np.array([0, 0, 0, 0, 0, 1, 0, 1], np.int32), *out)[0] == rowloops.DECLINED
    assert rowloops.slide_windows(*args, table.copy(), np.array([2], np.int32), np.zeros(1, np.int32),
                                  np.ones(8, np.int32), *out)[0] == rowloops.DECLINED  # would skip block 6, the last
    ref = np.ones(8, np.int32)
    t = table.copy()
    assert rowloops.slide_windows(*args, t, np.array([3], np.int32), np.zeros(1, np.int32), ref, *out) == (2, 1)
    assert t.tolist() == [[0, 0, 7]] and out[0][:2].tolist() == [6, 5] and ref[5:8].tolist() == [0, 0, 1]
