"""Staged block-table writes, batch-order gather, and gather fused with the slot mapping."""

import numpy as np
import pytest

from kvd_kernels import (NULL_BLOCK, PAD_SLOT_ID, apply_block_table_updates_ref,
                         gather_block_tables_ref, gather_slot_mapping_ref, slot_mapping_ref)

POISON32 = 0x5A5A5A5A
POISON64 = 0x5A5A5A5A5A5A5A5A


def staged_changes(rng, tables, num_changes):
    """Non-overlapping appends: distinct (group, row) pairs, each a run of columns."""
    pairs = [(g, r) for g, t in enumerate(tables) for r in range(t.shape[0])]
    chosen = rng.permutation(len(pairs))[:num_changes]
    groups, rows, starts, lens = [], [], [], []
    for k in chosen:
        g, r = pairs[k]
        cols = tables[g].shape[1]
        start = int(rng.integers(0, cols))
        groups.append(g), rows.append(r), starts.append(start)
        lens.append(int(rng.integers(0, cols - start + 1)))
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ids = rng.integers(1, 2**31 - 1, int(offsets[-1]), dtype=np.int32)
    return [np.array(x, np.int32) for x in (groups, rows, starts)] + [offsets, ids]


def expected_updates(tables, groups, rows, starts, offsets, ids):
    want = [t.copy() for t in tables]
    for i in range(len(groups)):
        for j in range(offsets[i + 1] - offsets[i]):
            want[groups[i]][rows[i], starts[i] + j] = ids[offsets[i] + j]
    return want


def test_update_ref_hand_computed():
    tables = [np.zeros((2, 4), np.int32), np.zeros((2, 2), np.int32)]
    apply_block_table_updates_ref(tables, np.array([0, 1, 0]), np.array([1, 0, 0]),
                                  np.array([1, 0, 3]), np.array([0, 2, 4, 5]),
                                  np.array([5, 6, 7, 8, 9], np.int32))
    np.testing.assert_array_equal(tables[0], [[0, 0, 0, 9], [0, 5, 6, 0]])
    np.testing.assert_array_equal(tables[1], [[7, 8], [0, 0]])


@pytest.mark.parametrize("num_groups,num_changes", [(1, 0), (1, 1), (3, 20), (5, 30)])
def test_updates(device, num_groups, num_changes):
    import torch

    from kvd_kernels import apply_block_table_updates
    rng = np.random.default_rng(num_groups * 100 + num_changes)
    tables = [rng.integers(0, 2**31 - 1, (8, int(rng.integers(1, 150))), dtype=np.int32)
              for _ in range(num_groups)]
    changes = staged_changes(rng, tables, num_changes)
    want = expected_updates(tables, *changes)
    ref = [t.copy() for t in tables]
    apply_block_table_updates_ref(ref, *changes)
    for r, w in zip(ref, want):
        np.testing.assert_array_equal(r, w)
    dev_tables = [torch.from_numpy(t).to(device) for t in tables]
    staged = [torch.from_numpy(a) for a in changes]
    if device == "cuda":  # the daemon stages changes in pinned host memory; the kernel reads them
        staged = [a.pin_memory() for a in staged]
    apply_block_table_updates(dev_tables, *staged)
    for got, w in zip(dev_tables, want):
        np.testing.assert_array_equal(got.cpu().numpy(), w)


def test_updates_from_device_staging_with_spare_capacity(device):
    import torch

    from kvd_kernels import apply_block_table_updates
    rng = np.random.default_rng(9)
    tables = [rng.integers(0, 100, (4, 40), dtype=np.int32) for _ in range(2)]
    groups, rows, starts, offsets, ids = staged_changes(rng, tables, 3)
    want = expected_updates(tables, groups, rows, starts, offsets, ids)
    # persistent staging buffers: longer than the step's changes, num_changes says how many count
    pad = lambda a, v: torch.from_numpy(np.concatenate([a, np.full(5, v, a.dtype)])).to(device)  # noqa: E731,E501
    dev_tables = [torch.from_numpy(t).to(device) for t in tables]
    apply_block_table_updates(dev_tables, pad(groups, 0), pad(rows, 0), pad(starts, 0),
                              pad(offsets, offsets[-1]), pad(ids, 1), num_changes=3)
    for got, w in zip(dev_tables, want):
        np.testing.assert_array_equal(got.cpu().numpy(), w)


def gather_case(rng, num_groups, num_reqs, max_batch):
    tables = [rng.integers(1, 2**31 - 1, (20, int(rng.integers(1, 700))), dtype=np.int32)
              for _ in range(num_groups)]
    req_rows = rng.permutation(20)[:num_reqs].astype(np.int32)
    # the forward pass may keep fewer columns than the daemon's tables
    out_cols = [max(1, t.shape[1] - int(rng.integers(0, 3))) for t in tables]
    want = []
    for t, cols in zip(tables, out_cols):
        w = np.full((max_batch, cols), NULL_BLOCK, np.int32)
        for i, r in enumerate(req_rows):
            w[i] = t[r, :cols]
        want.append(w)
    return tables, req_rows, out_cols, want


@pytest.mark.parametrize("num_groups,num_reqs,max_batch", [(1, 0, 4), (1, 1, 1), (2, 7, 12),
                                                           (5, 20, 20)])
def test_gather(device, num_groups, num_reqs, max_batch):
    import torch

    from kvd_kernels import gather_block_tables
    rng = np.random.default_rng(num_groups + 10 * num_reqs)
    tables, req_rows, out_cols, want = gather_case(rng, num_groups, num_reqs, max_batch)
    ref = [np.full_like(w, POISON32) for w in want]
    gather_block_tables_ref(tables, req_rows, ref)
    got = [torch.full(w.shape, POISON32, dtype=torch.int32, device=device) for w in want]
    gather_block_tables([torch.from_numpy(t).to(device) for t in tables],
                        torch.from_numpy(req_rows).to(device), got)
    for r, g, w in zip(ref, got, want):
        np.testing.assert_array_equal(r, w)
        np.testing.assert_array_equal(g.cpu().numpy(), w)


@pytest.mark.parametrize("num_groups,lens,max_batch,width", [
    (1, [], 3, 16), (1, [1], 1, 1), (2, [1] * 9 + [200], 16, 300), (5, [3, 0, 17], 4, 40)])
def test_fused_gather_slot_mapping(device, num_groups, lens, max_batch, width):
    import torch

    from kvd_kernels import gather_slot_mapping
    rng = np.random.default_rng(len(lens) + width)
    block_sizes = [16, 32, 12, 64, 8][:num_groups]
    tables, req_rows, out_cols, want_tables = gather_case(rng, num_groups, len(lens), max_batch)
    # block ids bounded so positions stay inside each table's columns
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    max_pos = min(t.shape[1] * bs for t, bs in zip(tables, block_sizes))
    positions = rng.integers(0, max_pos, int(qsl[-1])).astype(np.int64)
    want_slots = np.full((num_groups, width), PAD_SLOT_ID, np.int64)
    slot_mapping_ref(tables, block_sizes, req_rows, qsl, positions, want_slots)
    ref_tables = [np.full_like(w, POISON32) for w in want_tables]
    ref_slots = np.full_like(want_slots, POISON64)
    gather_slot_mapping_ref(tables, block_sizes, req_rows, qsl, positions, ref_tables, ref_slots)
    np.testing.assert_array_equal(ref_slots, want_slots)
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    got_tables = [torch.full(w.shape, POISON32, dtype=torch.int32, device=device)
                  for w in want_tables]
    got_slots = torch.full(want_slots.shape, POISON64, dtype=torch.int64, device=device)
    gather_slot_mapping([t(x) for x in tables], block_sizes, t(req_rows), t(qsl), t(positions),
                        got_tables, got_slots)
    np.testing.assert_array_equal(got_slots.cpu().numpy(), want_slots)
    for r, g, w in zip(ref_tables, got_tables, want_tables):
        np.testing.assert_array_equal(r, w)
        np.testing.assert_array_equal(g.cpu().numpy(), w)
