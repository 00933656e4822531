"""The engine's packed step inputs (examples/kvd_engine/inputs.py): exact values on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine_common import BLOCK  # noqa: F401  (puts examples/ on sys.path)

import torch  # noqa: E402

from kvd_engine.inputs import Staging, varlen_layout  # noqa: E402


def test_varlen_layout_of_decode_prefill_and_chunks():
    qsl, seq_lens, pos = varlen_layout(np.array([7, 0, 40]), np.array([1, 3, 2]))
    assert qsl.dtype == np.int32 and qsl.tolist() == [0, 1, 4, 6]
    assert seq_lens.dtype == np.int32 and seq_lens.tolist() == [8, 3, 42]
    assert pos.dtype == np.int64 and pos.tolist() == [7, 0, 1, 2, 40, 41]
    qsl, seq_lens, pos = varlen_layout(np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert qsl.tolist() == [0] and seq_lens.size == 0 and pos.size == 0


@pytest.mark.parametrize("with_rep", [False, True])
def test_pack_lays_out_every_array_and_reuses_the_buffer(with_rep):
    st = Staging(torch.device("cpu"))
    qsl, seq_lens, pos = varlen_layout(np.array([7, 0, 40]), np.array([1, 3, 2]))
    rep = np.repeat(np.arange(3), [1, 3, 2]) if with_rep else None
    x = st.pack([11, 12, 13, 14, 15, 16], pos, np.array([0, 3, 5]), rep, np.array([9, 2, 5], np.int32),
                seq_lens, qsl)
    assert x.ids.tolist() == [11, 12, 13, 14, 15, 16] and x.ids.dtype == torch.int64
    assert x.positions.tolist() == [7, 0, 1, 2, 40, 41]
    assert x.keep.tolist() == [0, 3, 5]
    assert (x.rep is None) if not with_rep else x.rep.tolist() == [0, 1, 1, 1, 2, 2]
    assert x.rows.dtype == torch.int32 and x.rows.tolist() == [9, 2, 5]
    assert x.seq_lens.tolist() == [8, 3, 42] and x.qsl.tolist() == [0, 1, 4, 6]
    cap = st.cap
    y = st.pack([3], np.array([4]), np.array([0]), None, np.array([1], np.int32), np.array([5], np.int32),
                np.array([0, 1], np.int32))
    assert st.cap == cap and y.ids.data_ptr() == x.ids.data_ptr()  # one buffer, rewritten
    assert (y.ids.tolist(), y.positions.tolist(), y.rows.tolist(), y.seq_lens.tolist(), y.qsl.tolist()) == \
        ([3], [4], [1], [5], [0, 1])


def test_pack_grows_past_its_capacity():
    st = Staging(torch.device("cpu"))
    t = 3000
    qsl, seq_lens, pos = varlen_layout(np.array([0]), np.array([t]))
    x = st.pack(np.arange(t), pos, np.array([t - 1]), None, np.array([4], np.int32), seq_lens, qsl)
    assert st.cap >= 2 * t + 1 + 2 and x.ids.tolist() == list(range(t)) and x.qsl.tolist() == [0, t]


def test_graph_bucket_pads_every_array():
    """A (Tp=8, Bp=4) bucket holding a step of 5 tokens of 3 requests: padding tokens have id 0,
    position 0, belong to no request; padding requests are empty; the padding logits row is a
    padding token's."""
    from kvd_engine.graphs import Bucket, pow2

    assert [pow2(n) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    bk = Bucket(8, 4, 2, torch.device("cpu"))
    assert not bk.advances and bk.next_ids is None  # more tokens than requests: no decode step to advance
    qsl, seq_lens, pos = varlen_layout(np.array([7, 0, 40]), np.array([1, 3, 1]))
    bk.stage([11, 12, 13, 14, 15], pos, np.array([0, 3, 4]), np.array([0, 1, 1, 1, 2]), np.array([9, 2, 5], np.int32),
             seq_lens, qsl)
    assert bk.ids.tolist() == [11, 12, 13, 14, 15, 0, 0, 0]
    assert bk.positions.tolist() == [7, 0, 1, 2, 40, 0, 0, 0]
    assert bk.keep.tolist() == [0, 3, 4, 7]
    assert bk.rep.tolist() == [0, 1, 1, 1, 2, 0, 0, 0]
    assert bk.rows.tolist() == [9, 2, 5, 0] and bk.seq_lens.tolist() == [8, 3, 41, 0]
    assert bk.qsl.tolist() == [0, 1, 4, 5, 5]
    assert bk.slots.shape == (2, 8) and bool((bk.slots == -1).all())
    # a smaller step in the same bucket overwrites every padded position
    qsl, seq_lens, pos = varlen_layout(np.array([3]), np.array([2]))
    bk.stage([21, 22], pos, np.array([1]), np.array([0, 0]), np.array([6], np.int32), seq_lens, qsl)
    assert bk.ids.tolist() == [21, 22, 0, 0, 0, 0, 0, 0] and bk.positions.tolist() == [3, 4, 0, 0, 0, 0, 0, 0]
    assert bk.keep.tolist() == [1, 7, 7, 7] and bk.rep.tolist() == [0] * 8
    assert bk.rows.tolist() == [6, 0, 0, 0] and bk.seq_lens.tolist() == [5, 0, 0, 0]
    assert bk.qsl.tolist() == [0, 2, 2, 2, 2]


def test_steady_layout_stages_moving_arrays_then_advances_on_the_device():
    """A steady decode batch's layout: the first step stages every array, the next ones only ids,
    positions and seq_lens; a decode bucket's graph then advances its inputs after the forward
    (``Bucket.advance``: each real token's id becomes its row's argmax, its position and its request's
    seq_len grow by one, padding stays), and a step marked prestaged stages nothing at ``prepare``."""
    from kvd_engine.graphs import GraphRunner

    g = GraphRunner(None, torch.zeros(1), [0], 1, 16, max_tokens=64)
    ar = np.arange(3, dtype=np.int64)
    qsl = np.arange(4, dtype=np.int32)
    rows = np.array([7, 2, 5], np.int32)
    bk = g.prepare([11, 12, 13], np.array([4, 9, 20]), ar, ar, rows, np.array([5, 10, 21], np.int32), qsl, [], 42)
    assert (bk.tp, bk.bp) == (4, 4) and bk.advances
    assert bk.layout == 42 and bk.prestaged == 0
    assert bk.ids.tolist() == [11, 12, 13, 0] and bk.rows.tolist() == [7, 2, 5, 0] and bk.qsl.tolist() == [0, 1, 2, 3, 3]
    bk.rows[0] = 99  # a moving-only staging leaves the rest alone
    assert g.prepare([21, 22, 23], np.array([5, 10, 21]), ar, ar, rows, np.array([6, 11, 22], np.int32), qsl,
                     [], 42) is bk
    assert bk.ids.tolist() == [21, 22, 23, 0] and bk.positions.tolist() == [5, 10, 21, 0]
    assert bk.seq_lens.tolist() == [6, 11, 22, 0] and bk.rows.tolist() == [99, 2, 5, 0] and bk.keep.tolist() == [0, 1, 2, 3]
    logits = torch.full((4, 50), -1.0)
    for row, tok in enumerate([31, 32, 33, 44]):  # the padding row's argmax (44) is no token's id
        logits[row, tok] = 1.0
    bk.advance(logits)
    assert bk.next_ids.tolist() == [31, 32, 33, 44]
    assert bk.ids.tolist() == [31, 32, 33, 0] and bk.positions.tolist() == [6, 11, 22, 0]
    assert bk.seq_lens.tolist() == [7, 12, 23, 0] and bk.rows.tolist() == [99, 2, 5, 0] and bk.qsl.tolist() == [0, 1, 2, 3, 3]
    bk.prestaged = 42
    # the prepare of that step writes nothing (these arguments would be wrong on purpose)
    g.prepare([0, 0, 0], np.array([0, 0, 0]), ar, ar, rows, np.array([1, 1, 1], np.int32), qsl, [], 42)
    assert bk.prestaged == 0 and bk.ids.tolist() == [31, 32, 33, 0] and bk.seq_lens.tolist() == [7, 12, 23, 0]
    assert bk.positions.tolist() == [6, 11, 22, 0]
    # another layout (the batch compacted) stages everything again
    g.prepare([1, 2, 3], np.array([7, 12, 23]), ar, ar, rows, np.array([8, 13, 24], np.int32), qsl, [], 43)
    assert bk.layout == 43 and bk.rows.tolist() == [7, 2, 5, 0] and bk.ids.tolist() == [1, 2, 3, 0]


def test_a_bucket_stages_the_scheduled_rows_used_columns_of_host_tables():
    """``Bucket.stage_tables`` (host block tables, one per group): the step's rows in step order, their
    first ``width`` columns; every other entry of the bucket's tables keeps what it held."""
    from kvd_engine.graphs import Bucket, TableRows

    bk = Bucket(8, 4, 2, torch.device("cpu"), table_width=6)
    assert bk.tables_host is bk.tables  # without CUDA the bucket's tables are their own staging
    for t in bk.tables:
        t.fill_(-5)
    host = [np.arange(60, dtype=np.int32).reshape(10, 6) + 100 * g for g in range(2)]
    bk.stage_tables(TableRows(host, np.array([7, 2, 9], np.int32), 4))
    for g, t in enumerate(bk.tables):
        assert t[:3, :4].tolist() == host[g][[7, 2, 9], :4].tolist()
        assert (t[:3, 4:] == -5).all() and (t[3:] == -5).all()
