"""A session's mailbox (kvd.mailbox): the binary step ops through shared memory.

The segment's layout and its checks on their own; the daemon's grant (hello, own uid only), its
refusals (another op, another session's header, a scribbled area: an error reply, nothing applied)
and a reply too large for the mailbox, in process; then real daemons: a mailbox client's steps equal
a socket client's byte for byte (replies, tables, slot mappings) on twin daemons, with the daemon
polling and with the daemon asleep (every message kicks it), a message too large for the mailbox
goes on the socket, a request resent on the socket while the daemon was stopped is applied once, and
the segment goes with the session (goodbye, a SIGKILLed client's lease).
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest_daemon import REPO, daemon_factory, shm_segments, short_tmp  # noqa: F401
from kvd import protocol as P
from kvd.api import AdmitRequest, StepBatch
from kvd.errors import ERROR_BY_CODE, ProtocolError
from kvd.mailbox import AREAS, KICK, Mailbox, drain_kicks, kick_writer, open_kick_fifo
from kvd.server import Daemon
from kvd.tenancy import Peer
from kvd_client import Client
from machine_settings import machine_settings
from test_decode_op import Cfg, InProc


@pytest.fixture
def box():
    name = f"kvd_{os.getpid()}_test_mb{time.monotonic_ns()}"
    mb = Mailbox.create(name, 256, 128)
    yield mb
    mb.unlink()
    mb.close()


def test_a_request_and_its_reply_travel_byte_for_byte(box):
    client = Mailbox.attach(box.name, 256, 128)
    try:
        assert stat.S_IMODE(os.stat(f"/dev/shm/{box.name}").st_mode) == 0o600
        assert not box.waiting()
        assert client.post(7, [b"head", np.arange(3, dtype=np.int32), b""])
        assert box.waiting()
        assert box.take_request() == (7, [b"head", np.arange(3, dtype=np.int32).tobytes(), b""])
        assert not box.waiting() and box.seen == 7
        assert not client.replied(7)
        assert box.answer(7, [b"reply", b"\x01\x02"])
        assert client.replied(7) and client.reply() == [b"reply", b"\x01\x02"]
        box.set_polling(True)
        assert client.daemon_polls()
        box.set_polling(False)
        assert not client.daemon_polls()
    finally:
        client.close()


def test_a_steady_decode_post_writes_what_a_whole_post_would(box):
    """A decode request like the last one (same session, counts and rows, no hash frames) rewrites
    only its sequence number and confirmation: the area then holds what a whole post writes."""
    big = Mailbox.create(box.name + "b", 4096, 128)
    mine = Mailbox.attach(big.name, 4096, 128)
    try:
        rows = np.array([3, 1, 2], np.int32).tobytes()
        hashes, counts = np.arange(4, dtype=np.uint64).view("S8")[:2], np.array([1, 0, 1], np.int32)

        def area(mb, rows_b, extra):  # the request's bytes: frame table, header, frames
            size = 12 + 4 * len(extra) + P.DECODE_REQUEST.size + len(rows_b) + sum(a.nbytes for a in extra)
            return bytes(mb._mm[AREAS:AREAS + size])

        posts = [(5, 7, 3, 1, 0, rows, ()), (6, 7, 4, 1, 0, rows, ()), (7, 7, -1, 1, 0, rows, (hashes, counts)),
                 (8, 7, 5, 1, 0, rows, ()), (9, 7, 6, 1, 0, rows, ()), (10, 7, 6, 2, 0, rows, ()),
                 (11, 7, 6, 2, 0, rows[:8], ()), (12, 8, 6, 2, 0, rows[:8], ()), (13, 8, 6, 2, 1, rows[:8], ())]
        steady = []
        for seq, sid, c, an, la, rows_b, extra in posts:
            was = mine._steady
            assert mine.post_decode(seq, sid, c, len(rows_b) // 4, an, la, rows_b, extra)
            steady.append(was == (sid, an, la, rows_b) and not extra)
            fresh = Mailbox.attach(big.name, 4096, 128)  # no memory of an earlier post: writes it whole
            try:
                before = bytes(mine._mm[AREAS:AREAS + 200])
                posted = area(mine, rows_b, extra)
                big._mm[AREAS:AREAS + 200] = bytes(200)
                assert fresh.post_decode(seq, sid, c, len(rows_b) // 4, an, la, rows_b, extra)
                assert area(fresh, rows_b, extra) == posted and int(big.req_seq[0]) == seq
            finally:
                fresh.close()
            big._mm[AREAS:AREAS + 200] = before  # (what the steady post left in place)
        assert steady == [False, True, False, False, True, False, False, False, False]
        mine.post(14, [b"other"])  # any other request: the next decode post is written whole
        assert mine._steady is None
    finally:
        mine.close()
        big.unlink()
        big.close()


def test_what_does_not_fit_is_not_written(box):
    client = Mailbox.attach(box.name, 256, 128)
    try:
        assert client.post(1, [b"x" * 100])
        before = bytes(client._mm[:])
        assert not client.post(2, [b"y" * 300])  # the request area holds 256 bytes
        assert not box.answer(1, [b"z" * 200])  # the reply area 128
        assert bytes(client._mm[:]) == before and int(client.req_seq[0]) == 1 and int(box.rep_seq[0]) == 0
    finally:
        client.close()


@pytest.mark.parametrize("words, why", [
    ([0], "0 frames"),
    ([P.MAX_FRAMES + 1], f"{P.MAX_FRAMES + 1} frames"),
    ([2, 100, 200], "longer than the area"),
    ([1, 0xFFFFFFFF], "longer than the area"),
])
def test_a_scribbled_area_is_a_protocol_error(box, words, why):
    box._mm[AREAS:AREAS + 4 * len(words)] = np.array(words, np.uint32).tobytes()
    box.req_seq[0] = 3
    with pytest.raises(ProtocolError, match=why):
        box.take_request()
    assert box.seen == 3 and not box.waiting()  # taken: the daemon does not read it again


_frames = st.lists(st.binary(max_size=120), min_size=1, max_size=6)


@machine_settings(200, 1)
@given(st.lists(st.tuples(st.booleans(), _frames), min_size=1, max_size=8))
def test_any_frames_travel_whole_or_not_at_all(program):
    """Requests and replies of any frames, one after another: each that fits its area comes out
    byte for byte under its sequence number; one that does not is refused and the area keeps the
    last one whole."""
    name = f"kvd_{os.getpid()}_test_mbh{time.monotonic_ns()}"
    daemon = Mailbox.create(name, 256, 200)
    client = Mailbox.attach(name, 256, 200)
    try:
        last_req = last_rep = None
        for seq, (is_request, frames) in enumerate(program, 1):
            size = 4 + 4 * len(frames) + sum(map(len, frames))
            if is_request:
                fits = size <= 256
                assert client.post(seq, frames) is fits
                if fits:
                    last_req = (seq, frames)
                if last_req is not None:
                    assert daemon.take_request() == last_req
            else:
                fits = size <= 200
                assert daemon.answer(seq, frames) is fits
                if fits:
                    last_rep = (seq, frames)
                if last_rep is not None:
                    assert client.replied(last_rep[0]) and client.reply() == last_rep[1]
    finally:
        client.close()
        daemon.unlink()
        daemon.close()


def test_attach_checks_the_announced_layout(box):
    with pytest.raises(ValueError, match="not the announced layout"):
        Mailbox.attach(box.name, 512, 128)


# ---- the daemon, in process ---------------------------------------------------------------------------

def _hello(d: Daemon, uid: int, mailbox=True) -> dict:
    rep = d.op_hello({"mailbox": mailbox}, [], b"id", 1, Peer(uid=uid, gid=os.getgid(), pid=os.getpid()))
    return P.parse_reply(rep[0])


def test_the_daemon_grants_a_mailbox_to_its_own_uid_only():
    d = Daemon(Cfg)
    try:
        mine = _hello(d, os.getuid())
        assert mine["mb"].startswith(f"kvd_{os.getpid()}_{d.epoch}_mb") and mine["mb_req"] > 0 and mine["mb_rep"] > 0
        assert d.handle([b"id", KICK]) is None  # a kick only wakes the loop: no reply
        assert "mb" not in _hello(d, os.getuid() + 1)  # another uid keeps the socket
        assert "mb" not in _hello(d, os.getuid(), mailbox=False)
        err = P.parse_reply(d.handle([b"id", P.request(P.HELLO, 0, 1, mailbox=1)])[0])
        assert ERROR_BY_CODE[err["err"]] is ProtocolError and "mailbox must be a boolean" in err["msg"]
        sess = d.sessions[mine["sid"]]
        assert d.mailboxes == [sess]
        d.end_session(sess, "test")
        assert d.mailboxes == [] and not os.path.exists(f"/dev/shm/{mine['mb']}")
    finally:
        for s in list(d.sessions.values()):
            d.end_session(s, "test")


class _MailboxInProc(InProc):
    """InProc whose hello asks for a mailbox from the daemon's own uid (no socket to read it from:
    its steps go through ``Daemon.handle``, and the tests post in the mailbox themselves)."""

    def _post_decode(self, batch):
        return None

    def __init__(self, d: Daemon):
        self._want_mailbox = True
        self.d, self.json, self.raw = d, False, []
        super(InProc, self).__init__("inproc://x", heartbeat=False, gpu=False, kv_shared=True)
        self._want_mailbox = True
        op, fields, frames = self._hello_msg()
        h = P.parse_reply(d.op_hello(P.parse_header(self._header(op, 0, self._next_seq(), fields)), [], b"id", 1,
                                     Peer(uid=os.getuid(), gid=os.getgid(), pid=os.getpid()))[0])
        self._on_session(h)
        assert self.mailbox


class _PostingInProc(_MailboxInProc):
    """A mailbox session in process whose decode steps take the client's mailbox lane
    (``Client._post_decode``), each answered by ``Daemon.serve_mailbox`` before its result is read;
    every other step goes through ``Daemon.handle``. ``posted`` counts the steps that went through
    the mailbox."""

    posted = 0
    _pending = None
    _posted_decode_reply = Client._posted_decode_reply

    def _post_decode(self, batch):
        return Client._post_decode(self, batch)

    def _kick(self):
        pass

    def step(self, batch):
        pending = self._post_decode(batch)
        if pending is None:
            return InProc.step(self, batch)
        self.posted += 1
        assert self.d.serve_mailbox(self.d.sessions[self.sid]) is None
        self.raw.append(self._mb.reply())
        return pending.result()

    def _done(self, spec, sent):  # an error reply (the lane reads decode replies only): raises it
        rep = self._mb.reply()
        h = Client._answer(self, spec[0], rep[0], sent[0])
        return self._result(spec[0], h, rep[1:], spec[3])


def _state(d: Daemon, c) -> tuple:
    m = d.manager
    return (m.pool.ref_cnt.tobytes(), m.pool.free_queue_order().tobytes(), m.tables[0].tobytes(),
            m.num_tokens.tobytes(), m.tick, c.shm.tables[0].tobytes(), c.shm.counts[0].tobytes())


def test_the_mailbox_refuses_other_ops_and_other_sessions_and_changes_nothing():
    d = Daemon(Cfg)
    try:
        c = _MailboxInProc(d)
        other = _MailboxInProc(d)
        c.step(StepBatch(admit=[AdmitRequest("a", 5)]))
        sess = d.sessions[c.sid]
        rows = np.array(c.rows_of(["a"]), np.int32)
        before = _state(d, c)
        admit_other = P.ADMIT_REQUEST.pack(P.ADMIT_MAGIC, other.sid, 53, P.NO_CONFIRM, 0, 1, 5, 0, 0, 0, 0, 7)
        free_other = P.DECODE_FREE_REQUEST.pack(P.DECODE_FREE_MAGIC, other.sid, 54, P.NO_CONFIRM, 0, 0, 0, 1, 0)
        cases = [
            ([P.request(P.STATS, c.sid, 50)], "binary step ops only"),
            ([P.decode_request(other.sid, 51, 1, 1, 0), rows.tobytes()], "its own session's"),
            ([b"kvD"], "binary step ops only"),
            ([P.decode_request(c.sid, 52, 1, 1, 0)[:-1], rows.tobytes()], "decode header of"),
            ([admit_other, P.EMPTY], "its own session's"),
            ([free_other, rows.tobytes(), P.EMPTY], "its own session's"),
        ]
        for k, (frames, why) in enumerate(cases):
            assert c._mb.post(100 + k, frames)
            assert d.serve_mailbox(sess) is None  # answered in the mailbox
            rep = c._mb.reply()
            h = P.parse_reply(rep[0])
            assert ERROR_BY_CODE[h["err"]] is ProtocolError and why in h["msg"], h
            assert _state(d, c) == before
        # and the session goes on through its mailbox
        seq = c._next_seq()
        assert c._mb.post(seq, [P.decode_request(c.sid, seq, 1, 1, 0), rows.tobytes()])
        assert d.serve_mailbox(sess) is None and c._mb.replied(seq)
        r = P.unpack_decode_reply(c._mb.reply()[0])
        assert r[0] == seq and int(c.shm.counts[0][rows[0]]) == 2  # 5 + 1 tokens in blocks of 4
    finally:
        for s in list(d.sessions.values()):
            d.end_session(s, "test")


def test_a_reply_too_large_for_the_mailbox_is_returned_for_the_socket():
    d = Daemon(Cfg)
    try:
        c = _MailboxInProc(d)
        c.step(StepBatch(admit=[AdmitRequest("a", 5)]))
        sess = d.sessions[c.sid]
        sess.mailbox.rep_cap = 16  # the daemon's view of its area: nothing fits
        rows = np.array(c.rows_of(["a"]), np.int32)
        seq = c._next_seq()
        assert c._mb.post(seq, [P.decode_request(c.sid, seq, 1, 1, 0), rows.tobytes()])
        reply = d.serve_mailbox(sess)
        assert reply is not None and P.unpack_decode_reply(reply[0])[0] == seq
        assert not c._mb.replied(seq) and sess.last_reply is reply  # a resend gets it again
    finally:
        for s in list(d.sessions.values()):
            d.end_session(s, "test")


# ---- real daemons --------------------------------------------------------------------------------------

FIELDS = ("append_status", "copies", "changed_rows", "sched_rows", "sched_start", "sched_len", "tick")


def _drive(c: Client, hashes: bool) -> list:
    """Admissions, decode steps (some registering filled blocks), a free: every result and the
    session's tables and slots after each step."""
    out = []
    ids = [f"r{i}" for i in range(6)]
    for i, rid in enumerate(ids):
        c.allocate(rid, 3 + 5 * i)
    rows = np.array(c.rows_of(ids), np.int32)
    for step in range(40):
        kw = {}
        if hashes and step % 4 == 3:  # one filled block of the first request, made-up hash
            kw = dict(append_hashes=[np.array([bytes([step]) * c.hash_width], f"S{c.hash_width}")],
                      append_hash_counts=[np.array([1, 0, 0, 0, 0, 0], np.int32)])
        res = c.step(StepBatch(append_rows=rows, append_num_tokens=1 + step % 2, **kw))
        out.append([np.asarray(getattr(res, f)).tobytes() if f != "tick" else res.tick for f in FIELDS])
        out.append((c.shm.tables[0].tobytes(), c.shm.counts[0].tobytes(), c.shm.slots[0].tobytes()))
    c.free(ids[0])
    return out


@pytest.mark.parametrize("busy_poll_us", [5000, 0])
def test_a_mailbox_client_gets_what_a_socket_client_gets(daemon_factory, busy_poll_us):
    results = []
    for mailbox in (True, False):
        d = daemon_factory(busy_poll_us=busy_poll_us)
        with Client(d.endpoint, mailbox=mailbox) as c:
            assert c.mailbox is mailbox
            results.append(_drive(c, hashes=True))
            if mailbox:
                assert int(c._mb.req_seq[0]) == int(c._mb.rep_seq[0]) == c._seq - 1  # the last decode step's
                # a sleeping daemon is kicked for every message; a polling one for those after a sleep
                assert (c.kicks == 40) if busy_poll_us == 0 else (c.kicks < 40)
            else:
                assert c.kicks == 0
        d.stop()
    assert results[0] == results[1]


ALL_FIELDS = ("free_status", "fork_status", "append_status", "admit_status", "admit_rows", "admit_cached_tokens",
              *FIELDS)


def _serve(c: Client) -> tuple[list, int]:
    """A serving engine's steps: decode steps, steps that free a request and admit another beside
    the others' appends (the decode_free op), lone admissions (the admit op). Every result and the
    session's tables and counts after each step, and how many of those messages took the mailbox."""
    out, posted = [], 0
    live = [f"r{i}" for i in range(5)]
    for i, rid in enumerate(live):
        c.allocate(rid, 3 + 5 * i)
    for step in range(30):
        if step % 5 == 4:
            rid = f"n{step}"
            batch = StepBatch(admit=[AdmitRequest(rid, 9)])
            live.append(rid)
        else:
            rows = np.array(c.rows_of(live), np.int32)
            free, admit = [], []
            if step % 5 == 2:
                free, admit = [live[0]], [AdmitRequest(f"m{step}", 6)]
            batch = StepBatch(free=free, append_rows=rows, append_num_tokens=1, admit=admit)
            live = [r for r in live if r not in free] + [a.req_id for a in admit]
        res = c.step(batch)
        if c.mailbox:
            posted += int(c._mb.req_seq[0]) == c._seq
        out.append([np.asarray(getattr(res, f)).tobytes() if f != "tick" else res.tick for f in ALL_FIELDS])
        out.append((c.shm.tables[0].tobytes(), c.shm.counts[0].tobytes()))
    return out, posted


def test_serving_steps_and_lone_admissions_take_the_mailbox_too(daemon_factory):
    """The decode_free and admit ops through the mailbox: the same results and shared memory as on
    the socket (twin daemons), every step posted there."""
    results = []
    for mailbox in (True, False):
        d = daemon_factory(block_size=4)
        with Client(d.endpoint, mailbox=mailbox) as c:
            out, posted = _serve(c)
            assert posted == (30 if mailbox else 0)
            results.append(out)
        d.stop()
    assert results[0] == results[1]


def _granted_run(c: Client) -> list:
    """Decode steps until the pool runs out, one after a fork (a copy on write): what ``granted()``
    says of each, whether it read the reply in place, and the result ``result()`` returns after it."""
    out = []
    for rid in ("a", "b", "c"):
        c.allocate(rid, 5)
    live = ["a", "b", "c"]
    for step in range(12):
        if step == 2:
            c.fork("a", "a2")
            live.append("a2")
        pending = c.start_step(StepBatch(append_rows=np.array(c.rows_of(live), np.int32), append_num_tokens=1))
        ok = pending.granted()
        in_place = pending._reply is not None and pending._result is None
        res = pending.result()
        assert pending.granted() is ok and pending.result() is res
        out.append((ok, in_place, [np.asarray(getattr(res, f)).tobytes() if f != "tick" else res.tick
                                   for f in ALL_FIELDS]))
    return out


def test_granted_says_whether_every_request_got_its_append(daemon_factory):
    """``PendingStep.granted()``: True exactly when every status is OK and nothing was copied; a
    mailbox client answers it from the decode reply in place and builds the same result as a
    socket client's on ``result()`` (twin daemons)."""
    runs = []
    for mailbox in (True, False):
        d = daemon_factory(block_size=4, num_gpu_blocks=15)
        with Client(d.endpoint, mailbox=mailbox) as c:
            runs.append(_granted_run(c))
        d.stop()
    (mb, sock) = runs
    assert [r[2] for r in mb] == [r[2] for r in sock] and [r[0] for r in mb] == [r[0] for r in sock]
    assert [r[1] for r in mb] == [True] * 12 and [r[1] for r in sock] == [False] * 12
    oks = [r[0] for r in mb]
    # step 2 copies a2's shared last block; the pool (14 blocks but the null one) runs out later
    assert oks[:2] == [True, True] and oks[2] is False and True in oks[3:] and oks[-1] is False
    for ok, _, fields in mb:
        status, copies = fields[ALL_FIELDS.index("append_status")], fields[ALL_FIELDS.index("copies")]
        assert ok == (not any(np.frombuffer(status, np.int16)) and not copies)


def test_a_message_too_large_for_the_mailbox_goes_on_the_socket(daemon_factory):
    d = daemon_factory(block_size=4)
    with Client(d.endpoint, mailbox=True) as c:
        c.allocate("a", 3)
        rows = np.array(c.rows_of(["a"]), np.int32)
        c.step(StepBatch(append_rows=rows, append_num_tokens=2))
        posted = int(c._mb.req_seq[0])
        c._mb.req_cap = 8  # the client's view of its area: nothing new fits
        res = c.step(StepBatch(append_rows=rows, append_num_tokens=1))
        assert res.append_status.tolist() == [0] and int(c._mb.req_seq[0]) == posted
        assert c.block_table("a").size == 2 and int(c.shm.counts[0][rows[0]]) == 2  # 6 tokens, blocks of 4


def test_a_request_resent_on_the_socket_is_applied_once(daemon_factory):
    d = daemon_factory(block_size=4)
    with Client(d.endpoint, mailbox=True, timeout_s=0.2, retries=10) as c:
        c.allocate("a", 4)
        rows = np.array(c.rows_of(["a"]), np.int32)
        os.kill(d.pid, signal.SIGSTOP)  # the mailbox request waits; the client resends on the socket
        try:
            pending = c.start_step(StepBatch(append_rows=rows, append_num_tokens=4))
            time.sleep(0.7)
            assert not pending.ready()
        finally:
            os.kill(d.pid, signal.SIGCONT)
        res = pending.result()
        assert res.append_status.tolist() == [0]
        assert c.block_table("a").size == 2  # 8 tokens: applied once, not once per attempt
        res = c.step(StepBatch(append_rows=rows, append_num_tokens=1))
        assert c.block_table("a").size == 3 and c.stats()["num_used_blocks"] == 3


def test_the_mailbox_goes_with_its_session(daemon_factory):
    d = daemon_factory(lease_s=0.5)
    with Client(d.endpoint, mailbox=True) as c:
        name = c._mb.name
        assert os.path.exists(f"/dev/shm/{name}")
    assert not os.path.exists(f"/dev/shm/{name}")  # goodbye
    code = ("import sys, time; sys.path.insert(0, %r); from kvd_client import Client; "
            "c = Client(%r, mailbox=True); print(c._mb.name, flush=True); time.sleep(60)" % (str(REPO), d.endpoint))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        name = child.stdout.readline().strip()
        assert os.path.exists(f"/dev/shm/{name}")
    finally:
        child.kill()
        child.wait()
    deadline = time.monotonic() + 5
    while os.path.exists(f"/dev/shm/{name}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/dev/shm/{name}")  # the lease expired
    d.stop()
    assert shm_segments(d.pid) == []


def test_a_daemon_without_mailboxes_serves_on_the_socket(daemon_factory):
    d = daemon_factory(block_size=4, mailbox=False)
    with Client(d.endpoint, mailbox=True) as c:
        assert not c.mailbox and "mb" not in c.info
        c.allocate("a", 4)
        res = c.step(StepBatch(append_rows=np.array(c.rows_of(["a"]), np.int32), append_num_tokens=1))
        assert res.append_status.tolist() == [0] and c.block_table("a").size == 2
    assert not [n for n in shm_segments(d.pid) if "_mb" in n]
    assert not (d.runtime_dir / "kvd.kick").exists()  # no mailboxes, no kick FIFO


def test_a_sleeping_daemon_is_kicked_through_its_fifo(short_tmp, daemon_factory):
    """A daemon that never polls (every mailbox request finds it asleep) is woken through its kick
    FIFO (kvd.kick beside its lock, 0600, a stale file there replaced): the client's socket never
    carries a kick. The FIFO goes with the daemon."""
    rd = short_tmp / "rtk"
    rd.mkdir(mode=0o700)
    (rd / "kvd.kick").write_text("stale")
    d = daemon_factory(runtime_dir=rd, block_size=4, busy_poll_us=0)
    fifo = rd / "kvd.kick"
    st = os.stat(fifo)
    assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    with Client(d.endpoint, mailbox=True) as c:
        assert c.mailbox and c.info["mb_kick"] == str(fifo) and c._mb.kick_fd is not None

        def no_socket_kick():
            raise AssertionError("a kick on the socket")

        c._kick_socket = no_socket_kick
        c.allocate("a", 3)
        rows = np.array(c.rows_of(["a"]), np.int32)
        for _ in range(10):
            assert c.step(StepBatch(append_rows=rows, append_num_tokens=1)).append_status.tolist() == [0]
        assert c.kicks == 10 and int(c._mb.req_seq[0]) == c._seq and c.block_table("a").size == 4  # 13 tokens
    assert d.stop() == 0 and not fifo.exists()


def test_a_client_kicks_only_through_a_fifo(short_tmp):
    """``kick_writer`` opens the daemon's FIFO, and nothing else a grant could name (a missing path,
    a regular file: a kick never writes into a file); ``drain_kicks`` empties the FIFO."""
    (short_tmp / "file").write_bytes(b"")
    assert kick_writer(str(short_tmp / "file")) is None and kick_writer(str(short_tmp / "none")) is None
    assert (short_tmp / "file").read_bytes() == b""
    rd = open_kick_fifo(str(short_tmp / "k"))
    fd = kick_writer(str(short_tmp / "k"))
    try:
        assert fd is not None
        box = Mailbox.__new__(Mailbox)
        box.kick_fd = fd
        assert box.kick() and box.kick()
        drain_kicks(rd)
        with pytest.raises(BlockingIOError):
            os.read(rd, 1)  # (both kicks read)
    finally:
        os.close(fd)
        os.close(rd)


def test_a_mailbox_reply_from_another_boot_raises_daemon_restarted(daemon_factory):
    """Read in place, a decode reply whose epoch is not the session's is left to the general wait,
    which raises DaemonRestarted (as on the socket)."""
    from kvd.errors import DaemonRestarted

    d = daemon_factory(block_size=4)
    with Client(d.endpoint, mailbox=True, retries=0, timeout_s=2.0) as c:
        c.allocate("a", 3)
        rows = np.array(c.rows_of(["a"]), np.int32)
        pending = c.start_step(StepBatch(append_rows=rows, append_num_tokens=1))
        deadline = time.monotonic() + 5
        while not pending.ready() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert c._mb.replied(c._seq)
        at = c._mb.rep_at + 12 + 4 + 8  # the reply's epoch: after the frame table, magic and seq
        assert c._mb._mm[at:at + P.EPOCH_BYTES] == c.epoch.encode("ascii")
        c._mb._mm[at:at + P.EPOCH_BYTES] = b"0" * P.EPOCH_BYTES
        with pytest.raises(DaemonRestarted):
            pending.result()


def _random_run(daemons, run_of, steps: int) -> None:
    """A seeded run (test_decode_op_random's) of a mailbox session in process against a session of
    a twin daemon whose every step is the general one (its own result builder), then both managers
    compared."""
    from test_decode_op_groups import _JsonSteps
    from test_decode_op_random import run_ops

    c = _PostingInProc(daemons[0])
    run = run_of([c, _JsonSteps(daemons[1], json=True)])
    run_ops(run, steps)
    assert c.posted >= 5 and sum(rep[0][:4] == P.DECODE_REPLY_MAGIC for rep in c.raw) >= 5


@pytest.mark.parametrize("seed", range(8))
def test_the_mailbox_and_the_json_step_agree_on_random_runs(seed):
    """test_decode_op_random's runs (admissions, forks, frees, decode steps of random sizes with
    lookahead and filled blocks' hashes, evictions) with the decode steps through the mailbox: every
    result, the session's shared memory and the manager the same as the general step's."""
    from test_decode_op_groups import _close
    from test_decode_op_random import _Run, assert_same_managers

    daemons = [Daemon(Cfg), Daemon(Cfg)]
    try:
        _random_run(daemons, lambda pair: _Run(seed, pair), 60)
        assert_same_managers(daemons)
    finally:
        _close(daemons)


@pytest.mark.parametrize("seed", range(4))
def test_the_mailbox_and_the_json_step_agree_with_a_window_group(seed):
    """The same with a full and a sliding-window group (each group's hashes and counts frames)."""
    from test_decode_op_groups import GROUPS, _cfg, _close, _manager_state, _Run
    from test_decode_op_random import assert_same_managers

    daemons = [Daemon(_cfg(GROUPS["full+window"])), Daemon(_cfg(GROUPS["full+window"]))]
    try:
        _random_run(daemons, lambda pair: _Run(seed, pair), 70)
        assert_same_managers(daemons, _manager_state)
    finally:
        _close(daemons)


def test_a_mailbox_the_client_cannot_map_leaves_it_on_the_socket(daemon_factory, monkeypatch):
    def refuse(*a, **k):
        raise PermissionError("no")

    monkeypatch.setattr(Mailbox, "attach", classmethod(lambda cls, *a: refuse()))
    d = daemon_factory(block_size=4)
    with Client(d.endpoint, mailbox=True) as c:
        assert "mb" in c.info and not c.mailbox
        c.allocate("a", 4)
        res = c.step(StepBatch(append_rows=np.array(c.rows_of(["a"]), np.int32), append_num_tokens=1))
        assert res.append_status.tolist() == [0] and c.block_table("a").size == 2


def test_a_restarted_daemon_is_detected_on_the_mailbox_lane_and_reconnect_opens_a_new_one(daemon_factory):
    """The old mailbox goes with its daemon (SIGTERM): a decode step posted there gets no answer,
    the resend on the socket reaches the new daemon, which does not know the session; reconnect()
    opens a session with a mailbox of its own."""
    from kvd.errors import SessionError

    d = daemon_factory(block_size=4)
    c = Client(d.endpoint, mailbox=True, timeout_s=0.5, retries=1)
    try:
        c.allocate("a", 4)
        rows = np.array(c.rows_of(["a"]), np.int32)
        old = c._mb.name
        assert d.stop() == 0 and shm_segments(d.pid) == []
        d2 = daemon_factory(runtime_dir=d.runtime_dir, block_size=4)
        with pytest.raises(SessionError):
            c.step(StepBatch(append_rows=rows, append_num_tokens=1))
        assert c.reconnect() is False and c.mailbox and c._mb.name != old
        c.allocate("b", 4)
        res = c.step(StepBatch(append_rows=np.array(c.rows_of(["b"]), np.int32), append_num_tokens=1))
        assert res.append_status.tolist() == [0] and c.block_table("b").size == 2
        assert [n for n in shm_segments(d2.pid) if "_mb" in n] == [c._mb.name]
    finally:
        c.close()
