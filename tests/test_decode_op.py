"""The ``decode`` op (kvd.protocol): a decode step with a binary header. Exact: it does what the same
step sent as a JSON ``step`` does (replies, shared memory bytes), a retry gets the same reply, and a
malformed binary header gets a typed error and changes nothing."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvd import protocol as P
from kvd import rowloops
from kvd.api import AdmitRequest, GroupSpec, ManagerConfig, StepBatch
from kvd.errors import InvalidArgument, ProtocolError, SessionError, UnknownRequest
from kvd.hashing import hash_prompt
from kvd.manager import BlockManager
from kvd.server import Daemon
from kvd_client.client import Client, _Core
from kvd_client import step as step_mod
from kvd_client.step import tag_of

BS = 4


class Cfg:
    block_size = BS
    num_gpu_blocks = 64
    max_model_len = 64
    max_num_reqs = 16
    max_reqs_per_session = 8
    max_num_batched_tokens = 64


class InProc(_Core):
    """A client core calling ``Daemon.handle`` directly; ``json`` sends decode steps, lone admissions and frees
    as JSON steps."""

    def __init__(self, d: Daemon, json: bool, confirm: str = "auto"):
        super().__init__("inproc://x", heartbeat=False, gpu=False, kv_shared=True, confirm=confirm)  # a writer
        self.d, self.json = d, json
        self.raw: list[list[bytes]] = []
        op, fields, frames = self._hello_msg()
        h, _ = self._call(op, fields, frames, sid=0)
        self._on_session(h)

    def _call(self, op, fields, frames, sid=None):
        seq = self._next_seq()
        sid = self.sid if sid is None else sid
        if op is P.DECODE and self.json:  # the same step the old way: a JSON header, step frames
            named = dict(zip(P.DECODE_FIELDS, fields))
            if named["c"] == P.NO_CONFIRM:
                del named["c"]
            hdr = P.request(P.STEP, sid, seq, nf=0, nk=0, nd=0, **named)
            frames = [P.EMPTY, P.EMPTY, P.EMPTY, frames[0], P.EMPTY, *frames[1:]]
        else:
            hdr = self._header(op, sid, seq, fields)
        rep = self.d.handle([b"id", hdr, *frames])
        self.raw.append(rep)
        h = P.parse_reply(rep[0])
        assert self._check(h, seq), h
        return h, rep[1:]

    _do = Client._do

    def step(self, batch):
        if not self.json:
            return Client.step(self, batch)
        # a lone admission, and frees with appends, as the JSON step
        old = step_mod.BINARY_ADMIT, step_mod.BINARY_DECODE_FREE
        step_mod.BINARY_ADMIT = step_mod.BINARY_DECODE_FREE = False
        try:
            return Client.step(self, batch)
        finally:
            step_mod.BINARY_ADMIT, step_mod.BINARY_DECODE_FREE = old


@pytest.fixture
def pair():
    daemons = [Daemon(Cfg), Daemon(Cfg)]
    try:
        yield [InProc(daemons[0], json=False), InProc(daemons[1], json=True)]
    finally:
        for d in daemons:
            for s in list(d.sessions.values()):
                d.end_session(s, "test")


def _strip(h: dict) -> dict:
    return {k: v for k, v in h.items() if k not in ("v", "e")}


def test_the_decode_op_does_exactly_what_the_json_step_does(pair):
    prompts = [np.arange(n, dtype=np.int32) + 7 * n for n in (5, 9, 14)]
    for c in pair:
        res = c.step(StepBatch(admit=[AdmitRequest(i, len(p), hash_prompt(p, BS)) for i, p in enumerate(prompts)]))
        assert res.admit_status.tolist() == [0, 0, 0]
    rows = pair[0].rows_of([0, 1, 2])
    assert np.array_equal(rows, pair[1].rows_of([0, 1, 2]))
    tokens = [p.tolist() for p in prompts]
    for k in range(9):
        hashes, counts = [], []
        for i, t in enumerate(tokens):
            t.append(100 + k)
            full = hash_prompt(np.array(t, np.int32), BS)
            filled = len(t) % BS == 0
            hashes.append(full[-1:] if filled else full[:0])
            counts.append(int(filled))
        batch = StepBatch(append_rows=rows, append_num_tokens=1, append_hashes=(np.concatenate(hashes),),
                          append_hash_counts=(np.array(counts, np.int32),))
        results = [c.step(batch) for c in pair]
        binary, json = pair[0].raw[-1], pair[1].raw[-1]
        assert binary[0][:4] == P.DECODE_REPLY_MAGIC and json[0][:1] == b"{"
        assert _strip(P.parse_reply(binary[0])) == _strip(P.parse_reply(json[0]))
        assert binary[1:] == json[1:]  # the body, byte for byte
        for name in ("append_status", "sched_rows", "sched_start", "sched_len", "changed_rows", "copies"):
            assert np.array_equal(getattr(results[0], name), getattr(results[1], name)), name
        assert results[0].tick == results[1].tick == pair[0].tick
        assert np.array_equal(pair[0].shm.tables[0], pair[1].shm.tables[0])
        assert np.array_equal(pair[0].shm.counts[0], pair[1].shm.counts[0])
        assert np.array_equal(pair[0].shm.slot_array, pair[1].shm.slot_array)
    m0, m1 = pair[0].d.manager, pair[1].d.manager
    m0.flush_deferred(), m1.flush_deferred()
    assert m0.pool.caches == m1.pool.caches and len(m0.pool.caches[1]) == sum(len(t) // BS for t in tokens)



def _bytes_base(arr: np.ndarray) -> bool:
    while isinstance(arr, np.ndarray) and arr.base is not None:
        arr = arr.base
    return isinstance(arr, bytes)


def test_the_daemons_deferred_registrations_keep_views_of_the_message_and_the_manager_copies_a_callers_arrays(pair):
    """What a daemon defers registers the message's own bytes (no copy on its hot path); an
    in-process caller's writeable arrays are copied (kvd.manager._kept)."""
    c = pair[0]
    m = c.d.manager
    p = np.arange(11, dtype=np.int32)
    c.step(StepBatch(admit=[AdmitRequest("a", 11, hash_prompt(p, BS))]))  # a lone admission: deferred
    (kind, _, hash_lists, *_), = m._deferred
    assert len(hash_lists) == 1 and _bytes_base(hash_lists[0]) and not hash_lists[0].flags.writeable
    m.flush_deferred()
    full = hash_prompt(np.append(p, 100), BS)
    c.step(StepBatch(append_rows=c.rows_of(["a"]), append_num_tokens=1, append_hashes=(full[-1:],),
                     append_hash_counts=(np.ones(1, np.int32),)))  # the decode op: fills a block
    (_, rows, hashes, counts, *_), = m._deferred
    assert _bytes_base(hashes) and hashes.tolist() == full[-1:].tolist() and counts.tolist() == [1]
    m.flush_deferred()
    sess = next(iter(c.d.sessions.values()))
    assert m.lookup(full, sess.namespace, sess.writer) == 3  # both registered (unconfirmed: its own)
    given = hash_prompt(p + 1, BS)
    m.step(StepBatch(admit=[AdmitRequest("b", 11, given)]))  # in process: the caller's array, copied
    (_, _, hash_lists, *_), = m._deferred
    assert hash_lists[0] is not given and hash_lists[0].tolist() == given.tolist()

def test_a_retried_decode_gets_the_same_reply_applied_once(pair):
    c = pair[0]
    c.step(StepBatch(admit=[AdmitRequest("a", 3)]))
    rows = c.rows_of(["a"])
    seq = c._next_seq()
    msg = [b"id", P.decode_request(c.sid, seq, 1, 1, 0), rows.tobytes()]
    first, again = c.d.handle(msg), c.d.handle(msg)
    assert first == again and P.parse_reply(first[0])["q"] == seq
    assert c.d.manager.num_tokens[c.d.sessions[c.sid].mrow[rows[0]]] == 4  # one token, not two


def _error(rep) -> dict:
    h = P.parse_reply(rep[0])
    assert "err" in h and len(rep) == 1, h
    return h



def test_a_step_naming_an_append_row_out_of_range_is_refused_whole_and_a_one_row_free_unmaps_exactly(pair):
    """The general step (a free and appends): its append rows are mapped by one range-checked
    gather. A row past the session's rows, or negative, refuses the whole step (the free in it
    too: nothing changes); the same step with good rows frees its one request and unmaps exactly
    that row (the scalar path), leaving the others mapped."""
    c = pair[0]
    d = c.d
    c.step(StepBatch(admit=[AdmitRequest("a", 3), AdmitRequest("b", 6), AdmitRequest("x", 5)]))
    ra, rb, rx = (int(r) for r in c.rows_of(["a", "b", "x"]))
    sess = d.sessions[c.sid]
    mx = int(sess.mrow[rx])

    def state():
        return (d.manager.num_tokens.copy(), d.manager.pool.ref_cnt.copy(), c.shm.counts[0].copy(),
                c.shm.row_tags.copy(), sess.mrow.copy(), d.owner_sid.copy(), d.owner_srow.copy())

    before = state()
    free = np.array([rx], np.int32).tobytes()
    for bad in (Cfg.max_reqs_per_session, -1):
        hdr = P.request(P.STEP, c.sid, c._next_seq(), nf=1, nk=0, na=2, nd=0)
        h = _error(d.handle([b"id", hdr, free, P.EMPTY, P.EMPTY, np.array([ra, bad], np.int32).tobytes()]))
        assert h["err"] == InvalidArgument.code
        assert h["msg"] == f"append rows: row out of range [0, {Cfg.max_reqs_per_session})"
    assert all(np.array_equal(x, y) for x, y in zip(before, state()))
    res = c.step(StepBatch(free=["x"], append_rows=c.rows_of(["a", "b"]), append_num_tokens=1))
    assert res.free_status.tolist() == [0] and res.append_status.tolist() == [0, 0]
    assert sess.mrow[rx] == -1 and d.owner_sid[mx] == 0 and d.owner_srow[mx] == -1
    assert c.shm.row_tags[rx] == 0 and c.shm.counts[0][rx] == 0
    for r in (ra, rb):
        m = int(sess.mrow[r])
        assert m >= 0 and d.owner_srow[m] == r and d.owner_sid[m] == c.sid


def test_malformed_decode_headers_get_typed_errors_and_change_nothing(pair):
    c = pair[0]
    d = c.d
    c.step(StepBatch(admit=[AdmitRequest("a", 3), AdmitRequest("b", 6)]))
    rows = c.rows_of(["a", "b"]).tobytes()
    before = (d.manager.num_tokens.copy(), d.manager.pool.ref_cnt.copy(), c.shm.slot_array.copy())
    sid = c.sid
    good = P.decode_request(sid, 10**6, 2, 1, 0)
    cases = [
        (good[:-1], ProtocolError),  # short header
        (good + b"\0", ProtocolError),
        (P.DECODE_REQUEST.pack(P.DECODE_MAGIC, 0, 10**6, -1, 2, 1, 0), ProtocolError),  # session 0
        (P.DECODE_REQUEST.pack(P.DECODE_MAGIC, sid, -5, -1, 2, 1, 0), ProtocolError),  # negative seq
        (P.DECODE_REQUEST.pack(P.DECODE_MAGIC, sid, 10**6, -2, 2, 1, 0), ProtocolError),  # bad confirmation
        (P.DECODE_REQUEST.pack(P.DECODE_MAGIC, sid, 10**6, -1, 2, 2**31, 0), ProtocolError),  # token count
        (P.DECODE_REQUEST.pack(P.DECODE_MAGIC, sid, 10**6, -1, 3, 1, 0), ProtocolError),  # 3 rows, 2 sent
        (P.DECODE_REQUEST.pack(P.DECODE_MAGIC, sid, 10**6, -1, 2, 40, 0), InvalidArgument),  # 80 > 64 tokens
        (P.DECODE_REQUEST.pack(P.DECODE_MAGIC, sid + 1, 10**6, -1, 2, 1, 0), SessionError),
        (P.DECODE_REQUEST.pack(P.DECODE_MAGIC, sid, 10**6, d.manager.tick + 5, 2, 1, 0), InvalidArgument),
    ]
    for hdr, err in cases:
        assert _error(d.handle([b"id", hdr, rows]))["err"] == err.code, (hdr, err)
    # frames: hashes without counts, a row out of range
    assert _error(d.handle([b"id", good, rows, b"x" * 16]))["err"] == ProtocolError.code
    # counts that add up to the hashes sent but one is negative (a sum alone would pass them)
    neg = np.array([2, -1], np.int32).tobytes()
    rep = _error(d.handle([b"id", P.decode_request(sid, 10**6 + 2, 2, 1, 0), rows, b"x" * 16, neg]))
    assert rep["err"] == ProtocolError.code and rep["msg"] == "negative hash count"
    rep = _error(d.handle([b"id", P.decode_request(sid, 10**6 + 3, 2, 1, 0), rows, b"x" * 16,
                           np.array([1, 1], np.int32).tobytes()]))
    assert rep["err"] == ProtocolError.code and rep["msg"] == "append hash counts do not add up"
    bad_rows = np.array([0, 99], np.int32).tobytes()
    assert _error(d.handle([b"id", P.decode_request(sid, 10**6 + 1, 2, 1, 0), bad_rows]))["err"] == InvalidArgument.code
    after = (d.manager.num_tokens, d.manager.pool.ref_cnt, c.shm.slot_array)
    assert all(np.array_equal(x, y) for x, y in zip(before, after))
    # the session still works
    res = c.step(StepBatch(append_rows=c.rows_of(["a", "b"]), append_num_tokens=1))
    assert res.append_status.tolist() == [0, 0]


def test_a_step_whose_hash_counts_are_wrong_is_a_protocol_error_on_both_paths_and_changes_nothing(pair):
    prompts = [np.arange(16, dtype=np.int32) + 3 * k for k in range(2)]
    for c in pair:  # binary decode op and JSON step: the daemon checks the counts either way
        c.step(StepBatch(admit=[AdmitRequest(i, 15, hash_prompt(p, BS)[:0]) for i, p in enumerate(prompts)]))
        rows = c.rows_of([0, 1])
        d = c.d
        before = (d.manager.num_tokens.copy(), d.manager.pool.ref_cnt.copy(), c.shm.slot_array.copy(), d.manager.tick)
        one = hash_prompt(prompts[0], BS)[:1]  # the first block of request 0 (registration may lag)
        for counts in ([2, -1], [1, 1], [0, 0]):
            with pytest.raises(ProtocolError):
                c.step(StepBatch(append_rows=rows, append_num_tokens=1, append_hashes=(one,),
                                 append_hash_counts=(np.array(counts, np.int32),)))
            after = (d.manager.num_tokens, d.manager.pool.ref_cnt, c.shm.slot_array, d.manager.tick)
            assert all(np.array_equal(x, y) for x, y in zip(before, after))
        res = c.step(StepBatch(append_rows=rows, append_num_tokens=1, append_hashes=(one,),
                               append_hash_counts=(np.array([1, 0], np.int32),)))
        assert res.append_status.tolist() == [0, 0] and c.d.manager.num_tokens[c.d.sessions[c.sid].mrow[rows]].tolist() == [16, 16]


def test_the_reply_header_round_trips_and_rejects_junk():
    raw = P.decode_reply(7, b"0123456789ab", 42, 1, 2, 3, [5, 6])
    assert len(raw) == P.DECODE_REPLY.size + 8
    assert P.parse_reply(raw) == {"v": P.VERSION, "q": 7, "e": "0123456789ab", "ok": 1, "t": 42, "nt": [5, 6],
                                  "nc": 1, "nch": 2, "nfr": 0, "ns": 3}
    for junk in (raw[:-1], raw[:20], raw[:P.DECODE_REPLY.size - 4] + struct.pack("<I", 0), b"\x00\x01", b"[1]"):
        with pytest.raises(ProtocolError):
            P.parse_reply(junk)


_NO_COMPILE_AFTER_WARM_UP = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from kvd import prefixindex, rowloops
from kvd.api import AdmitRequest, StepBatch
from kvd.hashing import hash_next_blocks, hash_prompt
from kvd.server import Daemon
from test_decode_op import Cfg, InProc

def compiled():
    return {f"{m.__name__}.{n}": len(f.signatures) for m in (rowloops, prefixindex) for n, f in vars(m).items()
            if hasattr(f, "signatures")}

d = Daemon(Cfg)  # warms the compiled loops up, as the daemon does at start
before = compiled()
try:
    c = InProc(d, json=False)
    toks = np.arange(1, 1 + 4 * 12, dtype=np.int64).reshape(4, 12)
    c.step(StepBatch(admit=[AdmitRequest(i, 7, hash_prompt(toks[i, :7], 4)) for i in range(4)]))
    rows = np.ascontiguousarray(c.rows_of(list(range(4))), np.int32)
    c.step(StepBatch(append_rows=rows, append_num_tokens=1))  # 8 tokens: each request filled its second block
    last = np.array([hash_prompt(toks[i, :8], 4)[-1] for i in range(4)])
    c.step(StepBatch(append_rows=rows, append_num_tokens=1))
    c.step(StepBatch(append_rows=rows, append_num_tokens=1, append_hashes=(hash_next_blocks(toks[:, 8:12], last),),
                     append_hash_counts=(np.ones(4, np.int32),)))
    c.step(StepBatch(free=[3], forks=[(0, "f0")]))  # a serving step: a free and a fork
    c.step(StepBatch(append_rows=np.ascontiguousarray(c.rows_of([0, 1, 2, "f0"]), np.int32), append_num_tokens=1))
    c.step(StepBatch(admit=[AdmitRequest(9, 8, hash_prompt(toks[0, :8], 4))]))  # a prefix hit
    c.step(StepBatch(free=[0, 1, 2, "f0", 9]))
    d.manager.flush_deferred()
    after = compiled()
finally:  # the session's shared memory goes with it
    for sess in list(d.sessions.values()):
        d.end_session(sess, "test")
print(sorted(n for n, k in after.items() if k > before.get(n, 0)))
"""


@pytest.mark.skipif(not rowloops.HAVE_NUMBA, reason="numba not installed")
def test_a_warmed_daemons_steps_compile_nothing():
    """The daemon's warm-up compiles every signature its steps use (admissions, plain and
    registering decode steps, frees, forks, copy-on-write, a prefix hit; a frame's arrays are
    read-only: a signature of their own), so that no step a client times pays a compilation: a
    registering step's hash counts once cost the first of them ~2.7 ms at 4,096 requests."""
    out = subprocess.run([sys.executable, "-c", _NO_COMPILE_AFTER_WARM_UP, str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _step_frames(**over) -> list[bytes]:
    """A one-group step's ten frames after the header, all empty but ``over`` (by name)."""
    names = ["free", "forks", "tags", "app_rows", "app_counts", "app_hashes", "app_hash_counts", "admit",
             "admit_hashes", "admit_hash_counts"]
    return [over.get(n, P.EMPTY) for n in names]


def test_a_lone_admission_maps_its_row_and_tag_exactly_and_stray_frames_of_empty_sections_are_refused(pair):
    """A step that only admits parses only its admission section and publishes the one row by
    scalars: the session row -> manager row map, the owner maps and the row's 64-bit tag (one with
    the top bit set too). A frame of a section the header says is empty (fork tags, append rows,
    admission hashes) is a ProtocolError that changes nothing, as before; so is one admission whose
    hash count is not its hashes'. (A stray free, fork or fork-tag frame once took the decode path,
    which ignored it.)"""
    c = pair[0]
    d = c.d
    sess = d.sessions[c.sid]
    tokens = np.arange(12, dtype=np.int32) + 5
    hs = hash_prompt(tokens, BS)
    res = c.step(StepBatch(admit=[AdmitRequest("h", 12, hs)]))
    srow = int(c.row_of("h"))
    mrow = int(sess.mrow[srow])
    assert res.admit_status.tolist() == [0] and mrow >= 0
    assert d.owner_sid[mrow] == c.sid and d.owner_srow[mrow] == srow
    assert int(c.shm.row_tags[srow]) == tag_of("h")
    assert c.shm.counts[0][srow] == 3 and c.shm.tables[0][srow, :3].tolist() == d.manager.tables[0][mrow, :3].tolist()

    def state():
        return (d.manager.num_tokens.copy(), d.manager.pool.ref_cnt.copy(), c.shm.counts[0].copy(),
                c.shm.row_tags.copy(), sess.mrow.copy(), d.owner_sid.copy(), d.owner_srow.copy(), d.manager.tick)

    before = state()
    row = np.array([srow], np.int32).tobytes()
    adm = np.array([[5, 8, 0, 0, 0, 0, 7]], np.int64).tobytes()
    two = hash_prompt(np.arange(8, dtype=np.int32) + 100, BS)
    cases = [
        (dict(nf=0, nk=0, na=0, nd=0), _step_frames(tags=np.array([1], np.uint64).tobytes())),
        (dict(nf=0, nk=0, na=0, nd=0), _step_frames(free=row)),
        (dict(nf=0, nk=0, na=0, nd=0), _step_frames(forks=row + row)),
        (dict(nf=0, nk=0, na=0, nd=0), _step_frames(app_rows=row)),
        (dict(nf=0, nk=0, na=0, nd=0), _step_frames(admit_hashes=two.tobytes())),
        (dict(nf=0, nk=0, na=0, nd=1), _step_frames(admit=adm, admit_hashes=two.tobytes(),
                                                    admit_hash_counts=np.array([1], np.int32).tobytes())),
        (dict(nf=0, nk=0, na=0, nd=1), _step_frames(admit=adm, admit_hashes=two[:1].tobytes(),
                                                    admit_hash_counts=np.array([2], np.int32).tobytes())),
    ]
    for fields, frames in cases:
        rep = _error(d.handle([b"id", P.request(P.STEP, c.sid, c._next_seq(), **fields), *frames]))
        assert rep["err"] == ProtocolError.code, (fields, rep)
        assert all(np.array_equal(x, y) for x, y in zip(before, state()))
    # one admission in a raw message with a tag of the top bit set: stored as its uint64
    adm = np.array([[5, 8, 0, 0, 0, 0, -2]], np.int64).tobytes()
    hdr = P.request(P.STEP, c.sid, c._next_seq(), nf=0, nk=0, na=0, nd=1)
    rep = d.handle([b"id", hdr, *_step_frames(admit=adm, admit_hashes=two.tobytes(),
                                              admit_hash_counts=np.array([2], np.int32).tobytes())])
    assert P.parse_reply(rep[0])["ok"] == 1
    m5 = int(sess.mrow[5])
    assert m5 >= 0 and m5 != mrow and d.owner_sid[m5] == c.sid and d.owner_srow[m5] == 5
    assert int(c.shm.row_tags[5]) == (1 << 64) - 2 and c.shm.counts[0][5] == 2


def test_a_packed_step_and_its_frames_one_by_one_do_the_same_thing(monkeypatch):
    """The client sends a general step packed (one body frame, ``fl``); the same step sent frame by
    frame to another daemon gives the same reply bytes (but the epoch) and the same tables and
    pool, and a packed step with a bad ``fl`` changes nothing."""
    monkeypatch.setattr(step_mod, "BINARY_ADMIT", False)  # the JSON step, sent packed and frame by frame
    daemons = [Daemon(Cfg), Daemon(Cfg)]
    try:
        cores = [InProc(d, json=False) for d in daemons]
        tokens = np.arange(20, dtype=np.int32) + 9
        most = P.step_frame_count(1, token_ids=True)
        steps = [StepBatch(admit=[AdmitRequest("a", 20, hash_prompt(tokens, BS)), AdmitRequest("b", 7)]),
                 StepBatch(free=["b"], append_ids=["a"], append_num_tokens=2,
                           admit=[AdmitRequest("c", 9, hash_prompt(tokens[:8], BS))])]
        for k, batch in enumerate(steps):
            reps = []
            for j, c in enumerate(cores):
                op, fields, frames, post, _ = c._req_step(batch)
                assert len(frames) == 1 and sum(fields["fl"]) == len(frames[0])
                if j:
                    fields = dict(fields)
                    frames = P.unpack_frames(fields.pop("fl"), frames, most)
                seq = c._next_seq()
                rep = c.d.handle([b"id", P.request(op, c.sid, seq, **fields), *frames])
                post(P.parse_reply(rep[0]), rep[1:])
                reps.append((_strip(P.parse_reply(rep[0])), rep[1:]))
            assert reps[0] == reps[1], k
        m0, m1 = (d.manager for d in daemons)
        assert np.array_equal(m0.tables[0], m1.tables[0]) and np.array_equal(m0.pool.ref_cnt, m1.pool.ref_cnt)
        assert np.array_equal(cores[0].shm.tables[0], cores[1].shm.tables[0])
        c, d = cores[0], daemons[0]
        before = (d.manager.num_tokens.copy(), d.manager.pool.ref_cnt.copy(), c.shm.counts[0].copy(), d.manager.tick)
        op, fields, frames, _, undo = c._req_step(StepBatch(admit=[AdmitRequest("d", 5)]))
        undo()
        for fl in ([*fields["fl"][:-1], fields["fl"][-1] + 1], fields["fl"][:3], "x"):
            hdr = P.request(op, c.sid, c._next_seq(), **{**fields, "fl": fl})
            assert _error(d.handle([b"id", hdr, *frames]))["err"] == ProtocolError.code
        assert all(np.array_equal(x, y) for x, y in zip(before, (d.manager.num_tokens, d.manager.pool.ref_cnt,
                                                                   c.shm.counts[0], d.manager.tick)))
    finally:
        for d in daemons:
            for s in list(d.sessions.values()):
                d.end_session(s, "test")


def test_the_client_refuses_rows_and_counts_that_do_not_fit_as_the_manager_does(pair):
    """Rows and token counts are judged as the in-process manager judges them, never wrapped into
    int32: a row past int32 makes the batch malformed; a count below 0 or past the wire's
    MAX_COUNT is its append's InvalidArgument, the rest of the batch applied."""
    c = pair[0]
    c.step(StepBatch(admit=[AdmitRequest("a", 3), AdmitRequest("b", 3)]))
    ra, rb = (int(r) for r in c.rows_of(["a", "b"]))
    mrow = c.d.sessions[c.sid].mrow
    ma, mb = int(mrow[ra]), int(mrow[rb])
    sizes = lambda: [int(c.d.manager.num_tokens[r]) for r in (ma, mb)]  # noqa: E731
    for rows in (np.array([2**32 + ra], np.int64), [2**32 + ra], np.array([ra], np.float64)):
        with pytest.raises(InvalidArgument):
            c.step(StepBatch(append_rows=rows, append_num_tokens=1))
    assert sizes() == [3, 3]
    res = c.step(StepBatch(append_ids=["a", "b"], append_num_tokens=np.array([2**32 + 1, 1], np.int64)))
    assert res.append_status.tolist() == [InvalidArgument.code, 0] and sizes() == [3, 4]
    res = c.step(StepBatch(append_rows=np.array([ra, rb], np.int32), append_num_tokens=np.array([-1, 1])))
    assert res.append_status.tolist() == [InvalidArgument.code, 0] and sizes() == [3, 5]
    res = c.step(StepBatch(append_rows=np.array([ra, rb], np.int32), append_num_tokens=-1, free=["b"]))
    # b is freed first: its append is unknown by then, as in process; a's count is refused
    assert res.append_status.tolist() == [InvalidArgument.code, UnknownRequest.code] and res.free_status.tolist() == [0]
    assert sorted(c._row_of) == ["a"] and int(c.d.manager.num_tokens[ma]) == 3


def test_a_step_may_free_a_request_and_admit_or_fork_its_id_again_as_in_process(pair):
    """Frees go first in a step (the manager's order), so a step may free a request and reuse its
    id for an admission (preemption by recomputation) or a fork's child; an append of it in that
    step names a request that is gone. The client's rows follow."""
    c = pair[0]
    m = BlockManager(ManagerConfig(num_gpu_blocks=Cfg.num_gpu_blocks, max_model_len=Cfg.max_model_len,
                                   max_num_reqs=Cfg.max_num_reqs, groups=(GroupSpec(BS),)))
    first = [StepBatch(admit=[AdmitRequest("a", 5), AdmitRequest("p", 6)])]
    again = StepBatch(free=["a", "p"], admit=[AdmitRequest("a", 9)], forks=[("p", "q")], append_ids=["a"],
                      append_num_tokens=1)
    for b in first:
        c.step(b), m.step(b)
    old = int(c.rows_of(["a"])[0])
    res, want = c.step(again), m.step(again)
    for f in ("free_status", "fork_status", "append_status", "admit_status"):
        assert getattr(res, f).tolist() == getattr(want, f).tolist(), f
    assert res.free_status.tolist() == [0, 0] and res.fork_status.tolist() == [UnknownRequest.code]
    assert res.append_status.tolist() == [UnknownRequest.code] and res.admit_status.tolist() == [0]
    assert sorted(c._row_of) == ["a"] and int(c.rows_of(["a"])[0]) != old and old in c._free_rows
    assert c.block_table("a").tolist() == m.block_table("a").tolist() and c.block_table("a").size == 3
    res = c.step(StepBatch(free=["a"], forks=[("a", "a")]))  # a child may not be its freed parent
    assert res.free_status.tolist() == [0] and res.fork_status.tolist() == [UnknownRequest.code]
    assert not c._row_of and len(c._free_rows) == Cfg.max_reqs_per_session
