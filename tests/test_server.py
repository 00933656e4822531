"""The daemon through real processes over ipc: sharing, reclamation, fuzzing, retries, restarts."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import orjson
import pytest
import zmq

from conftest_daemon import REPO, daemon, daemon_factory, shm_segments, short_tmp  # noqa: F401
from kvd import protocol as P
from kvd.api import AdmitRequest, StepBatch
from kvd.errors import DaemonRestarted, InvalidArgument, ProtocolError, SessionError, UnknownRequest
from kvd_client import Client
from kvd_client import step as step_mod

BS = 16


def run_client_script(endpoint: str, body: str, *args: str, **kw) -> subprocess.Popen:
    code = textwrap.dedent(
        """
        import sys, time, numpy as np
        from kvd_client import Client
        from kvd.api import StepBatch, AdmitRequest
        EP = sys.argv[1]
        ARGS = sys.argv[2:]
        """
    ) + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", code, endpoint, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kw)


def wait_until(fn, timeout: float, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(interval)


# ---- several engines share one pool -------------------------------------------------------------

SHARER = """
tenant = ARGS[0]
c = Client(EP, tenant=tenant, name="sharer", kv_shared=True)
prompt = np.arange(100, dtype=np.int32) + 1000
hs = c.hash_prompt(prompt)
r = c.allocate("req", 100, hs)
# (the engine's forward pass writes the K/V here)
c.mark_computed()
print(r.status, r.num_cached_tokens, flush=True)
c.free("req")
c.close()
"""


def test_prefix_shared_between_client_processes(daemon):
    obs = Client(daemon.endpoint, tenant="observer")
    try:
        before = obs.stats()
        first = run_client_script(daemon.endpoint, SHARER, "A")
        out, err = first.communicate(timeout=30)
        assert first.returncode == 0, err
        assert out.split() == ["0", "0"]  # the first sharer misses
        others = [run_client_script(daemon.endpoint, SHARER, "A") for _ in range(3)]
        for p in others:
            out, err = p.communicate(timeout=30)
            assert p.returncode == 0, err
            assert out.split() == ["0", "96"]  # 6 full blocks of 16 hit
        stranger = run_client_script(daemon.endpoint, SHARER, "B")
        out, err = stranger.communicate(timeout=30)
        assert out.split() == ["0", "0"]  # another tenant's namespace: no hit
        after = obs.stats()
        assert after["prefix_hits"] - before["prefix_hits"] == 3 * 96
        assert after["num_used_blocks"] == before["num_used_blocks"] == 0
    finally:
        obs.close()


# ---- killed and silent engines ------------------------------------------------------------------

DECODER = """
c = Client(EP, tenant="t")
batch = StepBatch(admit=[AdmitRequest(i, 200) for i in range(32)])
res = c.step(batch)
assert (res.admit_status == 0).all(), res.admit_status
rows = c.rows_of(list(range(32)))
print("ready", flush=True)
while True:
    c.step(StepBatch(append_rows=rows))
"""


def test_sigkill_mid_step_reclaims_within_2s(daemon):
    obs = Client(daemon.endpoint, tenant="observer")
    try:
        p = run_client_script(daemon.endpoint, DECODER)
        try:
            assert p.stdout.readline().strip() == "ready"
            time.sleep(0.3)  # decoding
            assert obs.stats()["num_used_blocks"] > 0
        finally:
            p.kill()
            p.wait()
        t0 = time.monotonic()
        ok = wait_until(lambda: (s := obs.stats())["num_used_blocks"] == 0 and s["num_requests"] == 0, 3.0)
        elapsed = time.monotonic() - t0
        assert ok and elapsed <= 2.0, elapsed
        assert len(shm_segments(daemon.pid)) == 1  # only the observer's segment is left
    finally:
        obs.close()


def test_silent_client_loses_lease_heartbeating_one_keeps_it(daemon):
    silent = Client(daemon.endpoint, heartbeat=False)
    alive = Client(daemon.endpoint)
    try:
        silent.allocate("x", 64)
        alive.allocate("y", 64)
        time.sleep(2.3)
        st = alive.stats()
        assert st["num_requests"] == 1 and st["num_used_blocks"] == 4
        with pytest.raises(SessionError):
            silent.stats()
        assert alive.block_table("y").size == 4
    finally:
        silent.close(goodbye=False)
        alive.close()


# ---- retries --------------------------------------------------------------------------------------

@pytest.mark.parametrize("binary", [False, True], ids=["json-step", "admit-op"])
def test_retried_step_applied_once(daemon, monkeypatch, binary):
    monkeypatch.setattr(step_mod, "BINARY_ADMIT", binary)
    c = Client(daemon.endpoint)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(daemon.endpoint)
    try:
        op, fields, frames, post, undo = c._req_step(StepBatch(admit=[AdmitRequest("a", 40)]))
        seq = c._next_seq()
        assert op is (P.ADMIT if binary else P.STEP)
        msg = [c._header(op, c.sid, seq, fields), *frames]
        replies = []
        for _ in range(3):  # the original and two retries (e.g. after a timeout)
            raw.send_multipart(msg)
            assert raw.poll(5000)
            replies.append(raw.recv_multipart())
        assert replies[0] == replies[1] == replies[2]
        res = post(P.parse_reply(replies[0][0]), replies[0][1:])
        assert res.admit_status.tolist() == [0]
        st = c.stats()
        assert st["num_requests"] == 1 and st["num_used_blocks"] == 3
        assert c.block_table("a").size == 3
        # an older sequence number is refused
        raw.send_multipart([P.request(P.STATS, c.sid, 1)])
        assert raw.poll(5000)
        h = orjson.loads(raw.recv_multipart()[0])
        assert h["err"] == ProtocolError.code == 32
    finally:
        raw.close(0)
        ctx.term()
        c.close()


# ---- isolation ----------------------------------------------------------------------------------

def test_sessions_cannot_touch_each_other(daemon):
    a = Client(daemon.endpoint, tenant="x")
    b = Client(daemon.endpoint, tenant="x")
    try:
        a.allocate("r", 64)
        # b names row 0 (a's row) directly: its session holds no request there
        with pytest.raises(UnknownRequest):
            b._call(P.FREE, {}, [np.array([0], np.int32).tobytes()])
        res = b.step(StepBatch(append_rows=np.array([0], np.int32)))
        assert res.append_status.tolist() == [UnknownRequest.code]
        assert a.block_table("r").size == 4
        assert a.stats()["num_requests"] == 1
    finally:
        a.close()
        b.close()


# ---- malformed input ----------------------------------------------------------------------------

def _valid_step_frames(rng, c: Client, next_ids) -> tuple[dict, list[bytes]]:
    admits = [AdmitRequest(next(next_ids), int(rng.integers(1, 200))) for _ in range(int(rng.integers(0, 3)))]
    live = list(c.request_ids)
    app = live[: int(rng.integers(0, len(live) + 1))]
    spec = c._req_step(StepBatch(admit=admits, append_ids=app))
    spec[4]()  # we do not let the client track these rows: the daemon may or may not apply them
    fields, frames = dict(spec[1]), spec[2]
    if rng.random() < 0.5:  # the packed step as the client sends it, else its frames one by one
        frames = P.unpack_frames(fields.pop("fl"), frames, P.step_frame_count(len(c.block_sizes), token_ids=True))
    return fields, frames


def _mutate(rng, fields: dict, frames: list[bytes]) -> tuple[dict, list[bytes]]:
    fields = dict(fields)
    frames = list(frames)
    for _ in range(int(rng.integers(1, 4))):
        k = int(rng.integers(0, 9))
        if k == 0 and frames:  # flip bytes
            i = int(rng.integers(0, len(frames)))
            b = bytearray(frames[i])
            if b:
                for _ in range(int(rng.integers(1, 8))):
                    b[int(rng.integers(0, len(b)))] = int(rng.integers(0, 256))
            frames[i] = bytes(b)
        elif k == 1 and frames:  # truncate
            i = int(rng.integers(0, len(frames)))
            frames[i] = frames[i][: int(rng.integers(0, len(frames[i]) + 1))]
        elif k == 2:  # change a count
            key = ["nf", "nk", "na", "nd", "la", "an", "fl"][int(rng.integers(0, 7))]
            fields[key] = [int(rng.integers(-5, 5)), 2**40, -(2**63), "x", None, 1.5, True, 100000, [0] * 4,
                           [-1, 1, 0, 0], [2**40] * 4, list(range(20))][int(rng.integers(0, 12))]
        elif k == 3:  # drop or add a frame
            if frames and rng.random() < 0.5:
                frames.pop(int(rng.integers(0, len(frames))))
            else:
                frames.insert(int(rng.integers(0, len(frames) + 1)), rng.bytes(int(rng.integers(0, 64))))
        elif k == 4 and frames:  # random int32 rows
            i = int(rng.integers(0, len(frames)))
            frames[i] = rng.integers(-(2**31), 2**31 - 1, size=int(rng.integers(0, 8)), dtype=np.int64).astype(
                np.int32).tobytes()
        elif k == 5:  # another op with these frames
            fields["op"] = [P.ALLOCATE, P.APPEND, P.FREE, P.FORK, P.SWAP_IN, P.LOOKUP, "nope"][int(rng.integers(0, 7))]
        elif k == 6:  # garbage header fields
            fields[str(rng.integers(0, 5))] = "y" * int(rng.integers(0, 300))
        elif k == 7 and frames:  # admissions of huge sizes
            i = int(rng.integers(0, len(frames)))
            frames[i] = rng.integers(-(2**62), 2**62, size=7 * int(rng.integers(0, 3))).astype(np.int64).tobytes()
        else:
            fields["row"] = int(rng.integers(-3, 100))
    return fields, frames


def test_fuzz_malformed_messages_pool_unchanged(daemon_factory, monkeypatch):
    monkeypatch.setattr(step_mod, "BINARY_ADMIT", False)  # JSON steps, their fields mutated
    d = daemon_factory(max_message_bytes=1 << 20)
    rng = np.random.default_rng(1234)
    good = Client(d.endpoint, tenant="good")
    fuzz = Client(d.endpoint, tenant="fuzz", heartbeat=True)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(d.endpoint)
    try:
        good.step(StepBatch(admit=[AdmitRequest(i, 50 + i) for i in range(8)]))
        tables_before = [good.block_table(i).copy() for i in range(8)]
        fuzz.allocate("base", 100)
        s0 = good.stats()

        def exchange(frames: list[bytes]) -> dict | None:
            raw.send_multipart(frames)
            if not raw.poll(2000):
                return None
            rep = raw.recv_multipart()
            return P.parse_reply(rep[0])

        # phase A: junk (random bytes, random JSON, unknown sessions)
        ops = sorted(P.OPS - {P.HELLO})
        n_err = 0
        for i in range(1500):
            kind = i % 5
            if kind == 4:  # binary decode headers: random fields, a random (unknown) session
                msg = [P.DECODE_MAGIC + rng.bytes(int(rng.choice([36, 35, 40])))]
                msg += [rng.bytes(int(rng.integers(0, 64))) for _ in range(int(rng.integers(0, 4)))]
            elif kind == 0:
                msg = [rng.bytes(int(rng.integers(0, 200))) for _ in range(int(rng.integers(1, 5)))]
            elif kind == 1:
                h = {"v": int(rng.integers(0, 3)), "op": ops[int(rng.integers(0, len(ops)))],
                     "s": int(rng.integers(0, 2**62)), "q": int(rng.integers(0, 100))}
                msg = [orjson.dumps(h)] + [rng.bytes(int(rng.integers(0, 64))) for _ in range(int(rng.integers(0, 12)))]
            elif kind == 2:
                msg = [orjson.dumps([1, 2, {"op": "step"}])] if rng.random() < 0.5 else [b"{}" * int(rng.integers(0, 3000))]
            else:
                msg = [b"\x00"] * int(rng.integers(1, 80))
            rep = exchange(msg)
            assert rep is not None and "err" in rep, (i, msg[:2], rep)
            n_err += 1
        s1 = good.stats()
        assert s1 == s0

        # phase B: mutations of valid steps (and other ops) on a live session of the fuzz client
        ids = iter(range(10**6, 10**7))
        seq = fuzz._seq + 1000
        for i in range(1500):
            fields, frames = _valid_step_frames(rng, fuzz, ids)
            fields, frames = _mutate(rng, fields, frames)
            op = fields.pop("op", P.STEP)
            seq += 1
            try:
                hdr = P.request(op, fuzz.sid, seq, **fields)
            except TypeError:
                continue
            rep = exchange([hdr, *frames])
            assert rep is not None
        # phase C: binary decode headers on the live session, random fields, rows and hash frames
        for i in range(600):
            seq += 1
            live = [fuzz._row_of[r] for r in fuzz.request_ids]
            na = int(rng.integers(0, 6))
            rows = [int(rng.choice(live)) if live and rng.random() < 0.8 else int(rng.integers(-3, 2**31 - 1))
                    for _ in range(na)]
            c = [-1, -1, 0, fuzz.tick, fuzz.tick + 3, -(2**40)][int(rng.integers(0, 6))]
            an, la = [int(x) for x in rng.choice([0, 1, 2, 7, 2**31, 2**32 - 1], 2)]
            try:
                hdr = P.DECODE_REQUEST.pack(P.DECODE_MAGIC, fuzz.sid, seq, c, int(rng.choice([na, na + 1, 2**32 - 1])),
                                            an, la)
            except struct.error:
                continue
            frames = [np.array(rows, np.int32).tobytes()]
            if rng.random() < 0.3:
                frames += [rng.bytes(16 * int(rng.integers(0, 3))), rng.bytes(4 * int(rng.integers(0, na + 2)))]
            assert exchange([hdr, *frames]) is not None
        # oversized: the daemon drops the message (ZMQ_MAXMSGSIZE) and keeps serving
        raw.send_multipart([P.request(P.LOOKUP, fuzz.sid, seq + 1), b"\x00" * (2 << 20)])
        assert good.stats()["num_requests"] >= s0["num_requests"]  # still serving
        fuzz._seq = seq + 10
        fuzz.close()  # goodbye frees everything the fuzz session managed to create
        s2 = good.stats()
        assert s2["num_used_blocks"] == s0["num_used_blocks"] - 7  # "base" (100 tokens) is gone too
        assert s2["num_requests"] == s0["num_requests"] - 1
        for i in range(8):
            assert (good.block_table(i) == tables_before[i]).all()
        res = good.step(StepBatch(append_ids=list(range(8))))
        assert (res.append_status == 0).all()
        assert d.proc.poll() is None
    finally:
        raw.close(0)
        ctx.term()
        good.close()


def test_admission_fields_out_of_range_get_typed_errors_and_change_nothing(daemon):
    c = Client(daemon.endpoint, tenant="x")
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(daemon.endpoint)
    try:
        c.allocate("keep", 40)
        before = c.stats()
        spec = c._req_step(StepBatch(admit=[AdmitRequest("n1", 20), AdmitRequest("n2", 30)]))
        spec[4]()  # the client does not track rows the daemon will refuse
        fields = dict(spec[1])  # the step's frames one by one (a daemon takes them packed or not)
        frames = P.unpack_frames(fields.pop("fl"), spec[2], P.step_frame_count(len(c.block_sizes), token_ids=True))
        k = 5 + 2 * len(c.block_sizes)  # the admissions frame (kvd.protocol)
        for col, value, why in ((0, c.info["max_reqs"], "admission row out of range"),
                                (0, -1, "admission row out of range"), (3, 101, "admission field out of range"),
                                (1, -2, "admission field out of range"), (5, P.MAX_COUNT + 1, "admission field out of range")):
            adm = np.frombuffer(frames[k], np.int64).reshape(2, P.ADMIT_COLS).copy()
            adm[1, col] = value
            bad = list(frames)
            bad[k] = adm.tobytes()
            c._seq += 1
            raw.send_multipart([P.request(P.STEP, c.sid, c._seq, **fields), *bad])
            assert raw.poll(2000)
            rep = P.parse_reply(raw.recv_multipart()[0])
            assert rep["err"] == InvalidArgument.code and rep["msg"] == why, rep
        assert c.stats() == before and c.request_ids == ["keep"]
    finally:
        raw.close(0)
        ctx.term()
        c.close()


# ---- daemon lifecycle -----------------------------------------------------------------------------

def test_second_daemon_refused_first_untouched(daemon, daemon_factory):
    c = Client(daemon.endpoint)
    try:
        c.allocate("a", 32)
        second = daemon_factory(runtime_dir=daemon.runtime_dir, wait=False)
        rc = second.proc.wait(20)
        _, err = second.proc.communicate()
        assert rc != 0
        assert "already serves" in err
        assert c.stats()["num_requests"] == 1
        assert daemon.proc.poll() is None
    finally:
        c.close()


def test_sigterm_cleans_up_and_restart_is_detected(daemon_factory):
    d = daemon_factory()
    c = Client(d.endpoint, timeout_s=1.0, retries=1)
    try:
        c.allocate("a", 32)
        assert len(shm_segments(d.pid)) == 1
        assert d.stop() == 0
        assert shm_segments(d.pid) == []
        assert not (d.runtime_dir / "kvd.sock").exists()
        d2 = daemon_factory(runtime_dir=d.runtime_dir)
        with pytest.raises(DaemonRestarted):
            c.stats()
        assert c.reconnect() is False
        assert c.request_ids == []
        r = c.allocate("a", 32)
        assert r.ok and c.block_table("a").size == 2
        assert c.reconnect() is True  # same daemon: the session survives
        assert c.block_table("a").size == 2
        assert c.stats()["num_requests"] == 1
    finally:
        c.close()


def test_stale_segments_swept_at_start(daemon_factory):
    from kvd.shm import SessionBuffers, segment_name

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    stale = SessionBuffers.create(segment_name(p.pid, "dead", 1), max_reqs=2, max_blocks=[2], max_tokens=4)
    try:
        daemon_factory()
        assert not os.path.exists("/dev/shm/" + stale.name)
    finally:
        stale.unlink()
        stale.close()


def test_systemd_notifications(daemon_factory, short_tmp):
    import socket

    path = str(short_tmp / "notify")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(10)
    try:
        d = daemon_factory(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"}, status_interval_s=0.2)
        got: list[str] = []

        def read_until(pred):
            while not any(pred(x) for x in got):
                got.extend(s.recv(4096).decode().splitlines())

        read_until(lambda x: x == "READY=1")
        assert any(x.startswith("STATUS=") for x in got)
        read_until(lambda x: x == "WATCHDOG=1")
        n_status = sum(x.startswith("STATUS=") for x in got)
        read_until(lambda x: x.startswith("STATUS=") and got.count(x) >= 0 and
                   sum(y.startswith("STATUS=") for y in got) > n_status)
        assert d.stop() == 0
        read_until(lambda x: x == "STOPPING=1")
    finally:
        s.close()


def test_idle_pacer_sizes_slices_to_the_expected_gap_and_runs_one_per_reply():
    from kvd.pacing import IdlePacer

    assert IdlePacer.MIN_ROWS == 256
    gap = 100.55e-6 / IdlePacer.FILL  # slices fill 100.55 µs of it (half a request over: no rounding edge)
    p = IdlePacer(gap_s=gap, row_s=0.1e-6)
    p.replied(1.0)
    assert p.rows(1.0 + 10e-6) == 905  # what fits before the next message is due
    assert p.rows(1.0 + 95e-6) == IdlePacer.MIN_ROWS  # the slice owed to this reply, however little fits
    p.ran(40e-6, 200)  # 0.2 µs a request
    assert p.row_s == pytest.approx(0.1e-6 + 0.1e-6 * IdlePacer.EWMA)
    assert p.rows(1.0 + 40e-6) == 504  # more only where it fits (60.55 µs at 0.12 µs a request) ...
    assert p.rows(1.0 + 80e-6) == 0  # ... and where at least MIN_ROWS fit (171 do): else wait for the message
    assert p.rows(1.0 + 2 * gap + 1e-6) == IdlePacer.IDLE_ROWS  # idle for twice the gap: no client is coming soon
    p.ran(30e-6, 0)  # only confirmations: the cost per request stays
    assert p.row_s == pytest.approx(0.12e-6)
    p.arrived(1.0 + 600e-6)
    assert p.gap_s == pytest.approx(600e-6)  # the first gap seen replaces the initial guess


def test_idle_pacer_expects_the_shortest_of_the_last_gaps():
    """One long gap (a client hashing before its registering step) does not size the slices after
    it; the gap expected follows the clients' pace within IdlePacer.GAPS messages."""
    from kvd.pacing import IdlePacer

    assert IdlePacer.GAPS == 16
    p = IdlePacer(gap_s=1e-3, row_s=0.1e-6)
    t = 1.0
    for gap in [60.1e-6] * 15 + [500e-6]:
        p.replied(t)
        t += gap
        p.arrived(t)
    assert p.gap_s == pytest.approx(60.1e-6)  # not the mean (87.6 µs), nor 500
    p.replied(t)
    assert p.rows(t) == 300  # FILL of 60.1 µs at 0.1 µs a request (300.5)
    for k in range(15):  # the clients slow down: gaps of 400 µs push the 60.1 µs ones out, oldest first
        p.replied(t)
        t += 400e-6
        p.arrived(t)
        assert p.gap_s == pytest.approx(60.1e-6 if k < 14 else 400e-6)  # (the 500 µs gap is still there)


def test_idle_pacer_slices_converge_to_the_size_that_fills_the_gap():
    """A slice of k requests costing a + b*k: the slices settle at (FILL * gap - a) / b requests."""
    from kvd.pacing import IdlePacer

    a, b, gap = 15e-6, 0.1e-6, 230e-6
    p = IdlePacer(gap_s=gap, row_s=5e-6)
    for i in range(60):
        p.replied(float(i))
        k = p.rows(float(i))
        p.ran(a + b * k, k)
    assert k == pytest.approx((IdlePacer.FILL * gap - a) / b, abs=2)
    assert k > IdlePacer.MIN_ROWS  # (not held up by the minimum)


def test_hello_slots_must_be_a_boolean(daemon):
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(daemon.endpoint)
    try:
        raw.send_multipart([P.request(P.HELLO, 0, 1, tenant="", name="raw", pid=1, nonce="n1", slots="no")])
        assert raw.poll(2000)
        rep = P.parse_reply(raw.recv_multipart()[0])
        assert rep["err"] == ProtocolError.code and rep["msg"] == "hello: slots must be a boolean", rep
        c = Client(daemon.endpoint)  # nothing was opened by the refused hello
        assert c.stats()["sessions"] == 1
        c.close()
    finally:
        raw.close(0)
        ctx.term()


def _thread_cpus(pid: int) -> dict[str, set[int]]:
    """name -> the CPUs of each thread of ``pid`` (several threads of one name: the union)."""
    out: dict[str, set[int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            name = f.read().strip()
        out.setdefault(name, set()).update(os.sched_getaffinity(int(tid)))
    return out


def test_pin_cpu_pins_the_loop_and_zmq_io_threads_only(daemon_factory):
    cpu = max(os.sched_getaffinity(0))
    d = daemon_factory(pin_cpu=cpu)
    c = Client(d.endpoint)
    try:
        c.allocate("a", 32)  # a served message: the loop runs
        main = os.sched_getaffinity(d.pid)  # the process's main thread: the loop
        threads = _thread_cpus(d.pid)
        assert main == {cpu}
        assert threads["ZMQbg/IO/0"] == {cpu}
        if len(os.sched_getaffinity(0)) > 1:  # threads started before the loop keep every CPU
            assert any(cpus == os.sched_getaffinity(0) for name, cpus in threads.items()
                       if not name.startswith("ZMQbg"))
        assert c.stats()["num_requests"] == 1
    finally:
        c.close()


def test_pin_cpu_outside_the_process_cpus_is_a_config_error(daemon_factory):
    bad = max(os.sched_getaffinity(0)) + 1
    d = daemon_factory(pin_cpu=bad, wait=False)
    rc = d.proc.wait(20)
    _, err = d.proc.communicate()
    assert rc == 78  # EX_CONFIG: systemd does not restart it
    assert f"pin_cpu {bad} is not among this process's CPUs" in err
    assert not (d.runtime_dir / "kvd.sock").exists()


def test_an_idle_daemon_sleeps_however_long_it_busy_polls(daemon_factory):
    """Busy polling lasts busy_poll_us after the socket's last work, not after every callback: the
    ticker's callback (every TICK_S) and the re-entry after _MAX_DRAIN_S used to open windows of
    their own, so a daemon polling 50 ms never slept (100 % of a CPU while idle); and a heartbeat
    (this client's, every 0.375 s here) opens none (it did: 13 % of a CPU)."""
    from kvd.bench.zmq_bench import proc_cpu_s

    d = daemon_factory(busy_poll_us=50000, warm_every_us=0)
    c = Client(d.endpoint)
    try:
        c.allocate("a", 32)  # the socket had work: the daemon polls for 50 ms, then sleeps
        time.sleep(0.3)
        c0, t0 = proc_cpu_s(d.pid)[0], time.monotonic()
        time.sleep(1.5)
        share = (proc_cpu_s(d.pid)[0] - c0) / (time.monotonic() - t0)
        assert share < 0.1, f"an idle daemon used {share:.0%} of a CPU"
        assert c.stats()["num_requests"] == 1  # and it still answers
    finally:
        c.close()


def test_exit_with_parent_a_killed_parent_leaves_no_daemon(short_tmp):
    """A daemon started with --exit-with-parent (as every test, bench and example daemon is) by a
    process that is then SIGKILLed shuts down as on SIGTERM: socket and session segments gone."""
    from conftest_daemon import DaemonProc

    rd = short_tmp / "orphan"
    rd.mkdir()
    argv = DaemonProc(rd).argv()
    assert "--exit-with-parent" in argv
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        p = subprocess.Popen({argv!r}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(p.pid, flush=True)
        time.sleep(120)
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=str(REPO), env=env, stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    c = None
    try:
        deadline = time.monotonic() + 30
        while not (rd / "kvd.sock").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        c = Client("ipc://" + str(rd / "kvd.sock"), heartbeat=False)
        c.allocate("a", 32)
        assert len(shm_segments(pid)) == 1
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(pid)
        assert shm_segments(pid) == [] and not (rd / "kvd.sock").exists()
    finally:
        if c is not None:
            c.close(goodbye=False)
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
        for name in shm_segments(pid):
            os.unlink("/dev/shm/" + name)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's new parent may reap it late)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
