"""The binary decode ops (``decode``, and ``decode_free`` for steps that also free) on a daemon of
several KV-cache groups (full attention beside a sliding window, two block sizes): each group's
filled-block hashes travel as a pair of frames. Seeded random runs of admissions with every group's
prompt hashes, forks, frees (alone and beside appends) and decode steps of random sizes, lookahead
and hashes, in a pool small enough to evict, go to two daemons, one client sending the binary ops
and the other JSON steps: every reply, each group's tables and counts and the slot mapping in shared
memory, and each manager's state (every group) must be the same after every call. Malformed group
frames are refused with nothing changed."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kvd import protocol as P
from kvd.api import AdmitRequest, StepBatch
from kvd.errors import KvdError, ProtocolError
from kvd.hashing import hash_prompt
from kvd.server import Daemon
from test_decode_op import Cfg, InProc
from test_decode_op_random import FIELDS
from test_decode_op_random import _Run as RandomRun
from test_decode_op_random import assert_same_managers, run_ops
from test_refusals_change_nothing import changed, state_of

GROUPS = {"full+window": ((4, 0), (4, 8)), "two sizes": ((4, 0), (8, 16))}  # (block size, window) each


def _cfg(groups):
    return type("GroupsCfg", (Cfg,), {"group_specs": staticmethod(lambda: groups), "num_gpu_blocks": 96})


def _manager_state(d: Daemon):
    m = d.manager
    p = m.pool
    groups = [(g.table.tobytes(), g.num_blocks.tobytes(), g.num_registered.tobytes(), g.num_skipped.tobytes())
              for g in m.groups]
    return (p.ref_cnt.tobytes(), p.cache_key.tobytes(), p.free_queue_order().tobytes(), copy.deepcopy(p.caches),
            groups, m.num_tokens.tobytes(), m.tick, m.num_deferred)


class _Run(RandomRun):
    """test_decode_op_random's run on daemons of several groups, with frees beside decode steps;
    its own check of a step (the op's changed rows, the deferred work run before comparing)."""

    FREES = True
    ADMITS = True
    PREFIX = 16
    N_NEW = (0, 1, 1, 1, 2, 3, 5, 9)  # (9: two blocks of 8 at once; a step over the token budget is refused by both)

    def step(self, batch: StepBatch):
        """The step through both clients: the same results, or the same error."""
        shm = self.c[0].shm
        before = [(t.copy(), n.copy()) for t, n in zip(shm.tables, shm.counts)]
        res = []
        for c in self.c:
            try:
                res.append(c.step(batch))
            except KvdError as e:
                res.append(e)
        a, b = res
        self.check_same()
        if isinstance(b, KvdError):
            assert type(a) is type(b), (a, b)
            return None
        for f in FIELDS:
            if f != "changed_rows":
                assert np.array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f))), f
        # the general step names every row it scheduled; the decode ops the appended rows whose
        # tables or counts changed (grown, copied on write, slid out of a window): all of them
        moved = set()
        for (t, n), t1, n1 in zip(before, shm.tables, shm.counts):
            moved |= set(np.flatnonzero((t != t1).any(axis=1) | (n != n1)).tolist())
        moved &= set(() if batch.append_rows is None else np.asarray(batch.append_rows).tolist())
        assert moved <= set(a.changed_rows.tolist()) <= set(b.changed_rows.tolist()) | moved, (moved, a.changed_rows)
        return a

    def check_same(self) -> None:
        for c in self.c:  # the op defers its registration, the general step does not: run it
            c.d.manager.flush_deferred()
        s0, s1 = self.c[0].shm, self.c[1].shm
        for g in range(len(self.sizes)):
            assert np.array_equal(s0.tables[g], s1.tables[g]) and np.array_equal(s0.counts[g], s1.counts[g])
        assert np.array_equal(s0.slot_array, s1.slot_array)
        assert _manager_state(self.c[0].d) == _manager_state(self.c[1].d)
        for c in self.c:  # both publish the manager's own rows, every group
            sess = c.d.sessions[c.sid]
            srows = np.flatnonzero(sess.mrow >= 0)
            mrows = sess.mrow[srows]
            for g in range(len(self.sizes)):
                counts = c.d.manager.num_blocks[g][mrows]
                assert np.array_equal(c.shm.counts[g][srows], counts)
                for sr, mr, n in zip(srows.tolist(), mrows.tolist(), counts.tolist()):
                    assert np.array_equal(c.shm.tables[g][sr, :n], c.d.manager.tables[g][mr, :n]), (g, sr, mr)

class _JsonSteps(InProc):
    """Every step as the general JSON step message (what a client sent before the binary ops took
    several groups' hashes)."""

    def _req_decode(self, *args, **kw):
        return None


def _pair(groups):
    daemons = [Daemon(_cfg(groups)), Daemon(_cfg(groups))]
    return daemons, [InProc(daemons[0], json=False), _JsonSteps(daemons[1], json=True)]


def _close(daemons) -> None:
    for d in daemons:
        for s in list(d.sessions.values()):
            d.end_session(s, "test")


@pytest.mark.parametrize("groups", list(GROUPS))
@pytest.mark.parametrize("seed", range(8))
def test_the_decode_ops_and_the_json_step_agree_with_several_groups(groups, seed):
    daemons, pair = _pair(GROUPS[groups])
    try:
        sent = []
        real = daemons[0].handle

        def recording(msg):
            sent.append((msg[1][:3], len(msg)))
            return real(msg)
        daemons[0].handle = recording
        run = _Run(seed, pair)
        run_ops(run, 70)
        G = len(run.sizes)
        decodes = [n for magic, n in sent if magic == b"kvD"]
        with_frees = [n for magic, n in sent if magic == b"kvF"]
        # (id, header, rows[, each group's hashes and counts]); decode_free: the free rows first,
        # with admissions after the appends' group frames the admissions and each group's hashes
        assert len(decodes) >= 5 and decodes.count(3 + 2 * G) >= 3, decodes
        assert len(with_frees) >= 2 and with_frees.count(4 + 2 * G) >= 1, with_frees
        assert with_frees.count(2 + P.decode_free_admit_frames(G)) >= 2, with_frees
        assert not any(rep[0][:4] == P.DECODE_REPLY_MAGIC for rep in pair[1].raw)
        assert_same_managers(daemons, _manager_state)
    finally:
        _close(daemons)


def _decode_msg(c: InProc, rows, frames, nf: int | None = None, an: int = 1) -> list[bytes]:
    """A raw decode op (or, with ``nf`` free rows first in ``frames``, a decode_free op)."""
    seq = c._next_seq()
    rows = np.asarray(rows, np.int32)
    if nf is None:
        head = P.DECODE_REQUEST.pack(P.DECODE_MAGIC, c.sid, seq, P.NO_CONFIRM, rows.size, an, 0)
    else:
        head = P.DECODE_FREE_REQUEST.pack(P.DECODE_FREE_MAGIC, c.sid, seq, P.NO_CONFIRM, rows.size, an, 0, nf, 0)
    return [b"id", head, *frames]


def _two_live(c: InProc) -> np.ndarray:
    """Two requests of 7 tokens (their next token fills a block of 4 and of 8): their rows."""
    p = np.arange(1, 8, dtype=np.int32)
    res = c.step(StepBatch(admit=[AdmitRequest(i, 7, [hash_prompt(p, bs) for bs in c.d.block_sizes])
                                  for i in range(2)]))
    assert res.admit_status.tolist() == [0, 0]
    return c.rows_of([0, 1])


def _frames_of(c: InProc, rows: np.ndarray) -> list[bytes]:
    """Each group's hashes and counts frames for appending token 8 to both requests (a block of
    4 fills in group 0, one of 8 in group 1)."""
    h = [hash_prompt(np.arange(1, 9, dtype=np.int32), bs)[-1:] for bs in c.d.block_sizes]
    return [np.concatenate([h[0], h[0]]).tobytes(), np.array([1, 1], np.int32).tobytes(),
            np.concatenate([h[1], h[1]]).tobytes(), np.array([1, 1], np.int32).tobytes()]


@pytest.mark.parametrize("case", ["one group's frames", "token ids", "counts short", "counts do not add up",
                                  "hashes of another width", "decode_free: one group's frames"])
def test_malformed_group_frames_get_a_typed_error_and_change_nothing(case):
    daemons, pair = _pair(GROUPS["two sizes"])
    try:
        c = pair[0]
        rows = _two_live(c)
        groups = _frames_of(c, rows)
        rows_b = rows.tobytes()
        frames = {
            "one group's frames": [rows_b, *groups[:2]],
            "token ids": [rows_b, *groups, np.zeros(8, np.int32).tobytes()],
            "counts short": [rows_b, *groups[:3], np.array([1], np.int32).tobytes()],
            "counts do not add up": [rows_b, *groups[:3], np.array([1, 2], np.int32).tobytes()],
            "hashes of another width": [rows_b, groups[0] + b"x", *groups[1:]],
            "decode_free: one group's frames": [P.EMPTY, rows_b, *groups[:2]],
        }[case]
        before = state_of(c.d)
        rep = c.d.handle(_decode_msg(c, rows, frames, nf=0 if case.startswith("decode_free") else None))
        assert P.parse_reply(rep[0]).get("err") == ProtocolError.code and len(rep) == 1
        assert changed(before, state_of(c.d)) == []
        # and the well-formed message then does what it says: each group registers its filled block
        rep = c.d.handle(_decode_msg(c, rows, [rows_b, *groups]))
        assert rep[0][:4] == P.DECODE_REPLY_MAGIC
        m = c.d.manager
        m.flush_deferred()  # (registered after the reply)
        mrows = c.d.sessions[c.sid].mrow[rows]
        assert m.groups[0].num_registered[mrows].tolist() == [2, 2] and m.groups[1].num_registered[mrows].tolist() == [1, 1]
    finally:
        _close(daemons)


@pytest.mark.parametrize("cut", ["the one-group layout", "a group's admit frames missing"])
def test_decode_free_admissions_need_every_groups_frames(cut):
    """decode_free with admissions on two groups carries each group's append and admit hashes
    (3 + 4G frames); a message with one group's layout, or missing a group's admit frames, gets a
    ProtocolError and changes nothing; the client's own message then frees, appends and admits."""
    daemons, pair = _pair(GROUPS["full+window"])
    try:
        c = pair[0]
        rows = _two_live(c)
        real = c.d.handle
        refused = []

        def malformed_first(msg):
            f = msg[2:]
            assert msg[1][:3] == b"kvF" and len(f) == P.decode_free_admit_frames(2) == 11
            bad = [*f[:4], *f[6:9]] if cut == "the one-group layout" else f[:-2]
            before = state_of(c.d)
            rep = real([*msg[:2], *bad])
            refused.append(P.parse_reply(rep[0]).get("err") == ProtocolError.code and changed(before, state_of(c.d)) == [])
            return real(msg)
        c.d.handle = malformed_first
        p = np.arange(1, 12, dtype=np.int32)
        res = c.step(StepBatch(free=[0], append_rows=rows[1:], append_num_tokens=1,
                               admit=[AdmitRequest("new", p.size, [hash_prompt(p, bs) for bs in c.d.block_sizes])]))
        assert refused == [True]
        assert res.free_status.tolist() == [0] and res.append_status.tolist() == [0] and res.admit_status.tolist() == [0]
        assert c.row_of("new") == res.admit_rows[0] and 0 not in c._row_of and c.d.manager.num_requests == 2
    finally:
        _close(daemons)
