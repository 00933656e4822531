"""The ``decode_free`` op (kvd.protocol): a step of frees, appends by row with one token count and
admissions (a serving engine's step after requests finished and others joined) with a binary header. Exact: two identical
daemons get the same calls, one client sending the binary op (``kvd_client.step.BINARY_DECODE_FREE``)
and one the general JSON step; every result, error, client row, shared-memory table, row tag,
slot mapping and manager table is the same after every call. A malformed binary header or frame
gets a typed error and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from kvd import protocol as P
from kvd.api import AdmitRequest, StepBatch
from kvd.errors import InvalidArgument, ProtocolError, UnknownRequest
from kvd.hashing import hash_prompt
from kvd.server import Daemon
from kvd_client.step import tag_of
from tests.test_decode_op import BS, InProc
from tests.test_lone_admission_op import Sender as _Sender
from tests.test_lone_admission_wire import Cfg
from tests.test_refusals_change_nothing import changed, state_of


def Sender(d: Daemon, binary: bool) -> InProc:
    """An in-process client whose decode steps with frees go as the binary op or not (``binary``)."""
    return _Sender(d, binary, flag="BINARY_DECODE_FREE")


@pytest.fixture
def pair(monkeypatch):
    ops = []
    real = Daemon.op_decode_free
    monkeypatch.setattr(Daemon, "op_decode_free", lambda self, *a: (ops.append(a[1][5]), real(self, *a))[1])
    daemons = [Daemon(Cfg), Daemon(Cfg)]
    try:
        yield Sender(daemons[0], binary=True), Sender(daemons[1], binary=False), ops
    finally:
        for d in daemons:
            for s in list(d.sessions.values()):
                d.end_session(s, "test")


def _outcome(c: InProc, batch: StepBatch):
    try:
        res = c.step(batch)
        return "ok", {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in vars(res).items()}
    except Exception as e:  # noqa: BLE001 - the two paths must fail alike
        return "error", type(e).__name__, str(e)


def _state(c: InProc):
    m, shm = c.d.manager, c.shm
    return (dict(c._row_of), sorted(c._free_rows), shm.tables[0].tolist(), shm.counts[0].tolist(),
            shm.row_tags.tolist(), shm.slot_array.tolist(), m.tables[0].tolist(), m.num_blocks[0].tolist(),
            m.num_tokens.tolist(), m.pool.ref_cnt.tolist(), m.tick)


_PREFIX = np.arange(101, 113)


def _next_batch(rng, k: int, live: list, c: InProc, ids) -> StepBatch | None:
    if not live or rng.random() < 0.3:
        n = int(rng.integers(1, 3))
        admits = []
        for _ in range(n):
            t = rng.integers(1, 300, int(rng.integers(1, 30)))
            if rng.random() < 0.5:
                t = np.concatenate([_PREFIX, t])[:Cfg.max_model_len - 2]
            admits.append(AdmitRequest(next(ids), t.size, hash_prompt(t, BS) if rng.random() < 0.6 else ()))
        return StepBatch(admit=admits)
    free = [r for r in live if rng.random() < 0.3] or live[:1]
    if rng.random() < 0.15:
        free = []  # (with admissions: a step where requests join and none finished)
    if free and rng.random() < 0.1:
        free = free + free[:1]  # a repeat: the manager refuses the second
    if free and rng.random() < 0.1:
        free = free + [("gone", k)]  # unknown to the client: the general way reports it
    app = [r for r in live if r not in free or rng.random() < 0.2]  # (a freed one: unknown by its append)
    an = int(rng.integers(0, 3))
    admits = []
    if rng.random() < 0.4:  # requests joining in the same step (maybe under a freed one's id)
        for _ in range(int(rng.integers(1, 3))):
            t = rng.integers(1, 300, int(rng.integers(1, 30)))
            if rng.random() < 0.5:  # a shared prefix: the cache holds its blocks once a sharer confirmed
                t = np.concatenate([_PREFIX, t])[:Cfg.max_model_len - 2]
            rid = free[0] if free and rng.random() < 0.2 else next(ids)
            admits.append(AdmitRequest(rid, t.size, hash_prompt(t, BS) if rng.random() < 0.6 else (),
                                       int(rng.integers(0, 2))))
    if free and rng.random() < 0.15:
        return StepBatch(free=free, admit=admits)  # frees alone (and admissions): the same op without appends
    batch = StepBatch(free=free, append_rows=np.asarray(c.rows_of([r for r in app if r in c._row_of]), np.int32),
                      append_num_tokens=an, num_lookahead_tokens=int(rng.integers(0, 3)), admit=admits)
    if rng.random() < 0.4 and batch.append_rows.size:  # hashes of the blocks the appends fill
        m = c.d.manager
        mrows = c.d.sessions[c.sid].mrow[batch.append_rows]
        n = np.where(mrows >= 0, m.num_tokens[np.maximum(mrows, 0)], 0)
        cnt = ((n + an) // BS - n // BS).astype(np.int32)
        if rng.random() < 0.2:
            cnt[0] += 1  # counts that do not add up: a ProtocolError on both paths
        batch.append_hashes = (np.frombuffer(rng.bytes(16 * int(cnt.sum())), "S16"),)
        batch.append_hash_counts = (cnt,)
    return batch


@pytest.mark.parametrize("seed", range(12))
def test_the_binary_op_replies_and_changes_as_the_general_step(pair, seed):
    binary, general, ops = pair
    rng = np.random.default_rng(seed)
    ids = iter(range(1000, 100000))
    live: list = []
    hits = [0]
    for k in range(70):
        batch = _next_batch(rng, k, live, binary, ids)
        n = len(ops)
        outs = [_outcome(c, batch) for c in (binary, general)]
        assert outs[0] == outs[1], (k, batch)
        if len(ops) > n and ops[-1] and outs[0][0] == "ok":
            hits[0] += sum(x > 0 for x in outs[0][1]["admit_cached_tokens"])
        assert _state(binary) == _state(general), k
        live = [r for r in binary._row_of]
    assert len(ops) >= 15, len(ops)  # the binary op did run (and only on one daemon)
    assert sum(nd > 0 for nd in ops) >= 4, ops  # with admissions too
    assert hits[0] >= 2, hits  # admissions in the op that hit the cache


def _live(c: InProc, n: int) -> list[int]:
    prompts = [np.arange(1, 6 + i, dtype=np.int32) * (i + 2) for i in range(n)]
    res = c.step(StepBatch(admit=[AdmitRequest(i, len(p), hash_prompt(p, BS)) for i, p in enumerate(prompts)]))
    assert res.admit_status.tolist() == [0] * n
    return list(range(n))


def test_a_step_that_frees_one_request_and_appends_to_the_others_replies_exactly(pair):
    binary, general, ops = pair
    ids = _live(binary, 3)
    rows = binary.rows_of(ids).tolist()
    mrows = binary.d.sessions[binary.sid].mrow[rows].tolist()
    held = binary.d.manager.tables[0][mrows[1], :2].tolist()
    res = binary.step(StepBatch(free=[1], append_rows=np.array([rows[0], rows[2]], np.int32), append_num_tokens=1))
    rep = binary.raw[-1]
    assert rep[0][:4] == P.DECODE_REPLY_MAGIC and ops == [0]
    assert np.frombuffer(rep[1], P.I16, 1, 0).tolist() == [0]  # the body starts with the free's status
    assert res.free_status.tolist() == [0] and res.freed_rows.tolist() == [rows[1]]
    assert res.append_status.tolist() == [0, 0] and res.sched_rows.tolist() == [rows[0], rows[2]]
    assert 1 not in binary._row_of and rows[1] in binary._free_rows
    sess = binary.d.sessions[binary.sid]
    assert sess.mrow[rows[1]] == -1 and binary.shm.row_tags[rows[1]] == 0 and binary.shm.counts[0][rows[1]] == 0
    m = binary.d.manager
    assert not m.active[mrows[1]] and int(m.num_tokens[mrows[0]]) == 6  # 5 + 1
    # the freed request's blocks: its prompt's were cached (hashed), so they wait in the evictable queue
    assert all(int(m.pool.ref_cnt[b]) == 0 for b in held)


def test_a_free_the_daemon_refuses_leaves_the_request_in_place(pair):
    binary, general, ops = pair
    for c in (binary, general):
        _live(c, 2)
    # the same request freed twice in one step: the second is the manager's InvalidArgument
    outs = [_outcome(c, StepBatch(free=[0, 0], append_rows=np.asarray(c.rows_of([1]), np.int32),
                                  append_num_tokens=1)) for c in (binary, general)]
    assert outs[0] == outs[1] and outs[0][1]["free_status"] == [0, InvalidArgument.code]
    # appending to a request the same step frees: unknown by its append (frees go first)
    row1 = binary.row_of(1)
    outs = [_outcome(c, StepBatch(free=[1], append_rows=np.array([row1], np.int32), append_num_tokens=1))
            for c in (binary, general)]
    assert outs[0] == outs[1]
    assert outs[0][1]["free_status"] == [0] and outs[0][1]["append_status"] == [UnknownRequest.code]
    assert _state(binary) == _state(general) and binary._row_of == {}
    assert ops == [0, 0]


def _raw(c: InProc, free_rows, rows, fields=None, frames=None):
    f = {"c": P.NO_CONFIRM, "na": len(rows), "an": 1, "la": 0, "nf": len(free_rows), "nd": 0, **(fields or {})}
    head = P.DECODE_FREE_REQUEST.pack(P.DECODE_FREE_MAGIC, c.sid, c._next_seq(), *(f[k] for k in P.DECODE_FREE_FIELDS))
    if frames is None:
        frames = [np.asarray(free_rows, np.int32).tobytes(), np.asarray(rows, np.int32).tobytes()]
    return c.d.handle([b"id", head, *frames])


@pytest.mark.parametrize("case", [
    dict(free_rows=[Cfg.max_reqs_per_session], rows=[0]),
    dict(free_rows=[-1], rows=[0]),
    dict(free_rows=[0], rows=[1], fields={"nf": 2}),
    dict(free_rows=[0], rows=[1], fields={"nf": 10 ** 6}),
    dict(free_rows=[0], rows=[1], fields={"na": 3}),
    dict(free_rows=[0], rows=[1], frames=[np.array([0], np.int32).tobytes()]),
    dict(free_rows=[0], rows=[1], frames=[np.array([0], np.int32).tobytes(), np.array([1], np.int32).tobytes(), b"x"]),
    dict(free_rows=[0], rows=[1], frames=[b"\0\0", np.array([1], np.int32).tobytes()]),
    dict(free_rows=[0], rows=[1], fields={"an": 1 << 20}),
    dict(free_rows=[0], rows=[1], fields={"c": 10 ** 9}),
], ids=lambda c: ",".join(f"{k}" for k in c))
def test_a_malformed_binary_step_gets_a_typed_error_and_changes_nothing(pair, case):
    _refused_and_unchanged(pair[0], lambda c: _raw(c, **case))


def _refused_and_unchanged(c: InProc, send) -> None:
    """``send(c)`` (a raw message, two requests live) gets one typed error frame and changes
    nothing."""
    _live(c, 2)
    before = state_of(c.d)
    rep = send(c)
    h = P.parse_reply(rep[0])
    assert h.get("err") in (ProtocolError.code, InvalidArgument.code), h
    assert len(rep) == 1
    assert changed(before, state_of(c.d)) == []


def test_a_retried_binary_step_gets_the_same_reply_applied_once(pair):
    binary, _, _ = pair
    _live(binary, 2)
    seq = binary._next_seq()
    head = P.DECODE_FREE_REQUEST.pack(P.DECODE_FREE_MAGIC, binary.sid, seq, P.NO_CONFIRM, 1, 1, 0, 1, 0)
    msg = [b"id", head, np.array([0], np.int32).tobytes(), np.array([1], np.int32).tobytes()]
    first = binary.d.handle(msg)
    tick = binary.d.manager.tick
    again = binary.d.handle(msg)
    assert again == first and binary.d.manager.tick == tick


def test_a_step_that_frees_appends_and_admits_replies_exactly(pair):
    binary, general, ops = pair
    prompt = np.arange(1, 14, dtype=np.int32)
    results = []
    for c in (binary, general):
        _live(c, 3)
        rows = c.rows_of([0, 2])
        batch = StepBatch(free=[1], append_rows=rows, append_num_tokens=1,
                          admit=[AdmitRequest("x", 13, hash_prompt(prompt, BS)), AdmitRequest(1, 3)])
        results.append(_outcome(c, batch))
    assert results[0] == results[1] and ops == [2]
    res = results[0][1]
    xrow, again = binary.row_of("x"), binary.row_of(1)  # (1 was freed first: its id is admitted again)
    assert res["free_status"] == [0] and res["append_status"] == [0, 0] and res["admit_status"] == [0, 0]
    assert res["admit_rows"] == [xrow, again] and res["admit_cached_tokens"] == [0, 0]
    assert res["sched_rows"] == [*binary.rows_of([0, 2]).tolist(), xrow, again]
    assert res["sched_start"] == [5, 7, 0, 0] and res["sched_len"] == [1, 1, 13, 3]
    assert binary.shm.row_tags[xrow] == tag_of("x") and binary.shm.counts[0][xrow] == 4
    rep = binary.raw[-1]
    body = rep[1]  # free status, append status, admit status, cached, (no copies), changed, sched start
    assert np.frombuffer(body, P.I16, 5, 0).tolist() == [0, 0, 0, 0, 0]
    assert np.frombuffer(body, P.I32, 2, 10).tolist() == [0, 0]
    assert _state(binary) == _state(general)


def _raw_admit(c: InProc, cols=None, hashes=None, counts=None, nd=None, frames=None):
    adm = np.array(cols or [[4, 8, 0, 0, 0, 0, 9]], np.int64)
    hs = hash_prompt(np.arange(1, 9, dtype=np.int32), BS) if hashes is None else hashes
    cnt = np.array(counts or [len(hs)] + [0] * (adm.shape[0] - 1), np.int32)
    f = (P.NO_CONFIRM, 0, 1, 0, 0, adm.shape[0] if nd is None else nd)
    head = P.DECODE_FREE_REQUEST.pack(P.DECODE_FREE_MAGIC, c.sid, c._next_seq(), *f)
    if frames is None:
        frames = [P.EMPTY, P.EMPTY, P.EMPTY, P.EMPTY, adm.tobytes(), hs.tobytes(), cnt.tobytes()]
    return c.d.handle([b"id", head, *frames])


@pytest.mark.parametrize("case", [
    dict(cols=[[Cfg.max_reqs_per_session, 8, 0, 0, 0, 0, 9]]),
    dict(cols=[[4, -1, 0, 0, 0, 0, 9]]),
    dict(cols=[[4, 8, 0, 0, 0, 0, 9], [4, 4, 0, 0, 0, 0, 7]]),
    dict(counts=[7]),
    dict(hashes=np.zeros(3, "S7")),
    dict(nd=2),
    dict(nd=10 ** 6),
    dict(frames=[P.EMPTY] * 6),
    dict(frames=[P.EMPTY, P.EMPTY, P.EMPTY, P.EMPTY, b"\0" * 8, P.EMPTY, np.zeros(1, np.int32).tobytes()]),
], ids=lambda c: ",".join(f"{k}" for k in c))
def test_a_malformed_admission_in_the_binary_step_gets_a_typed_error_and_changes_nothing(pair, case):
    _refused_and_unchanged(pair[0], lambda c: _raw_admit(c, **case))


def test_a_valid_raw_admission_in_the_binary_step_is_mapped_with_its_tag(pair):
    binary, _, _ = pair
    rep = _raw_admit(binary)
    assert rep[0][:4] == P.DECODE_REPLY_MAGIC
    assert np.frombuffer(rep[1], P.I16, 1, 0).tolist() == [0]
    sess = binary.d.sessions[binary.sid]
    assert sess.mrow[4] >= 0 and binary.shm.row_tags[4] == 9 and binary.shm.counts[0][4] == 2
