"""GPU session buffers (kvd.gpu_session): the host-side staging logic on the CPU (exact values), and,
marked ``cuda``, a real ``--device cuda:0`` daemon with two client processes whose CUDA-IPC views must
equal their shared-memory views after every call."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest_daemon import REPO, daemon_factory, shm_segments, short_tmp  # noqa: F401
from kvd.gpu_session import ChangeTracker, arena_layout, ipc_event_files, stage_slot_inputs


def _apply_ref(tables, counts2d, groups, rows, starts, offsets, ids, n):
    """kvd_kernels.apply_block_table_updates_ref over tables + the counts 'table' (group G)."""
    from kvd_kernels import apply_block_table_updates_ref

    apply_block_table_updates_ref(list(tables) + [counts2d], groups[:n], rows[:n], starts[:n],
                                  offsets[:n + 1], ids)


def _buffers(G, R, W):
    cap = G * (R + 1)
    return (np.zeros(cap, np.int32), np.zeros(cap, np.int32), np.zeros(cap, np.int32),
            np.zeros(cap + 1, np.int32), np.zeros(G * R * W + G * R, np.int32))


# ---- CPU: pure host logic ---------------------------------------------------------------------------

def test_change_tracker_exact_small():
    G, R, W = 2, 4, 5
    tables = [np.arange(R * W, dtype=np.int32).reshape(R, W) + 100 * g for g in range(G)]
    counts = [np.array([0, 3, 0, 5], np.int32), np.array([0, 1, 0, 2], np.int32)]
    tr = ChangeTracker(G, R)
    tr.mark(0, np.array([1], np.int32), 1, 3)        # row 1 cols 1..2
    tr.mark(0, np.array([1, 3], np.int32), 0, np.array([1, 5]))  # merged: row 1 -> 0..2, row 3 -> 0..4
    tr.mark(1, np.array([3], np.int32), np.array([1]), np.array([2]))
    tr.mark_counts(np.array([3, 1], np.int32))
    groups, rows, starts, offsets, ids = _buffers(G, R, W)
    n, k = tr.stage(tables, counts, groups, rows, starts, offsets, ids)
    assert n == 5 and k == 3 + 5 + 1 + 3 + 3
    assert groups[:n].tolist() == [0, 0, 1, 2, 2]
    assert rows[:n].tolist() == [1, 3, 3, 0, 1]
    assert starts[:n].tolist() == [0, 0, 1, 1, 1]
    assert offsets[:n + 1].tolist() == [0, 3, 8, 9, 12, 15]
    assert ids[:k].tolist() == [5, 6, 7, 15, 16, 17, 18, 19, 116, 3, 0, 5, 1, 0, 2]
    assert not tr.dirty
    # cleared: nothing staged the second time
    assert tr.stage(tables, counts, groups, rows, starts, offsets, ids) == (0, 0)


def test_change_tracker_mirrors_random_writes():
    rng = np.random.default_rng(1)
    G, R, W = 3, 16, 12
    src = [np.zeros((R, W), np.int32) for _ in range(G)]
    cnt = [np.zeros(R, np.int32) for _ in range(G)]
    mirror = [np.zeros((R, W), np.int32) for _ in range(G)]
    mcounts = np.zeros((G, R), np.int32)
    tr = ChangeTracker(G, R)
    bufs = _buffers(G, R, W)
    for step in range(200):
        for _ in range(int(rng.integers(1, 4))):  # several writes per reply, overlapping too
            g = int(rng.integers(0, G))
            rows = rng.choice(R, int(rng.integers(1, R)), replace=False).astype(np.int32)
            s = rng.integers(0, W, rows.size)
            e = np.minimum(W, s + rng.integers(0, 4, rows.size))
            for r, a, b in zip(rows, s, e):
                src[g][r, a:b] = rng.integers(1, 1000, b - a)
            tr.mark(g, rows, s, e)
            c = rows[: max(1, rows.size // 2)]
            for gg in range(G):
                cnt[gg][c] = rng.integers(0, W + 1, c.size)
            tr.mark_counts(c)
        n, k = tr.stage(src, cnt, *bufs)
        _apply_ref(mirror, mcounts, *bufs, n)
        for g in range(G):
            assert np.array_equal(mirror[g], src[g]), step
            assert np.array_equal(mcounts[g], cnt[g]), step


def test_stage_slot_inputs_matches_daemon_slot_mapping():
    from kvd_kernels import slot_mapping_from_ranges_ref, slot_mapping_ref

    rng = np.random.default_rng(2)
    R, W, bs, T = 8, 16, 4, 40
    table = rng.integers(1, 500, (R, W)).astype(np.int32)
    req_rows, qsl, pos = np.zeros(R, np.int32), np.zeros(R + 1, np.int32), np.zeros(T, np.int32)
    cases = [  # (rows, start, lens): decode, prefill mix with a zero-length entry, overflow of T
        (np.array([3, 0, 5], np.int32), np.array([7, 0, 33], np.int64), np.ones(3, np.int32)),
        (np.array([1, 2, 6, 4], np.int32), np.array([0, 5, 9, 60], np.int64), np.array([6, 0, 3, 1], np.int32)),
        (np.array([2, 7], np.int32), np.array([0, 4], np.int64), np.array([30, 20], np.int32)),
        (np.empty(0, np.int32), np.empty(0, np.int64), np.empty(0, np.int32)),
    ]
    for rows, start, lens in cases:
        B = stage_slot_inputs(rows, start, lens, req_rows, qsl, pos)
        assert B == rows.size
        assert qsl[:B + 1].tolist() == [0] + np.cumsum(lens).tolist()
        out = np.empty((1, T), np.int64)
        # what the kernel computes (tokens beyond T dropped) == what the daemon's CPU path writes
        total = int(qsl[B])
        if total > T:  # slot_mapping_ref insists the tokens fit: compare the first T
            n_fit = np.searchsorted(np.cumsum(lens), T, side="left") + 1
            q2 = np.minimum(qsl[:n_fit + 1], T)
            slot_mapping_ref([table], [bs], req_rows[:n_fit], q2, pos, out)
        else:
            slot_mapping_ref([table], [bs], req_rows[:B], qsl[:B + 1], pos, out)
        # what the daemon's CPU path writes: the reference, cut to the buffer when the step overflows it
        full = np.empty((1, max(total, T)), np.int64)
        slot_mapping_from_ranges_ref([table], [bs], rows, start, lens, full)
        assert np.array_equal(out[0], full[0, :T]), (rows, lens)


def test_arena_layout_is_aligned_and_owns_its_allocation():
    arrays, size = arena_layout(64, [128, 32], 2048)
    assert size % (2 << 20) == 0 and size >= 10 << 20
    ends = []
    for name, (off, dt, shape) in arrays.items():
        assert off % 256 == 0
        ends.append((off, off + int(np.prod(shape)) * np.dtype(dt).itemsize))
    ends.sort()
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])) and ends[-1][1] <= size
    assert set(arrays) == {"slots", "counts", "table_0", "table_1"}


# ---- CPU: the daemon's GPU path, emulated (tensors on the CPU, Triton interpreter) ----------------

def _inproc_client(d, **opts):
    """A kvd_client core that calls ``Daemon.handle`` directly (no socket)."""
    from kvd import protocol as P
    from kvd_client.client import Client, _Core

    class InProc(_Core):
        last_op = None

        def _call(self, op, fields, frames, sid=None):
            seq = self._next_seq()
            self.last_op = op
            rep = d.handle([b"id", self._header(op, self.sid if sid is None else sid, seq, fields), *frames])
            h = P.parse_reply(rep[0])
            assert self._check(h, seq)
            return h, rep[1:]

        _do = Client._do

    # gpu None: the emulated pool exports nothing to map, and the daemon mirrors the session
    c = InProc("inproc://x", heartbeat=False, **{"gpu": None, **opts})
    op, fields, frames = c._hello_msg()
    h, _ = c._call(op, fields, frames, sid=0)
    c._on_session(h)
    return c


def _emulated_daemon(groups):
    """An in-process daemon (block size 4, 256 blocks, 8 requests a session) whose GPU pool is CPU
    tensors written by the Triton kernels under the interpreter; skips without it."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("emulation runs under TRITON_INTERPRET=1 (a machine without a GPU)")
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    from kvd.gpu_session import GpuPool
    from kvd.server import Daemon

    class Cfg:
        block_size = 4
        num_gpu_blocks = 256
        max_model_len = 128
        max_num_reqs = 32
        max_reqs_per_session = 8
        max_num_batched_tokens = 64
        device = "cpu"

        @staticmethod
        def group_specs():
            return groups

    d = Daemon(Cfg)
    d.gpu_pool = GpuPool("cpu", d.block_sizes, d.max_blocks, d.max_reqs, d.max_tokens)
    return d


@pytest.mark.parametrize("groups", [((4, 0),), ((4, 0), (8, 16))], ids=["one-group", "full+window"])
def test_daemon_gpu_path_emulated(monkeypatch, groups):
    """Every op's shared-memory writes reach the session's GPU buffers (here CPU tensors written by
    the Triton kernels under the interpreter) exactly, through the tracker, the staging and the plans,
    for every KV-cache group."""
    from kvd.api import AdmitRequest, StepBatch
    from kvd.hashing import hash_prompt

    def hashes(p):
        hs = [hash_prompt(p, bs) for bs, _ in groups]
        return hs[0] if len(hs) == 1 else hs

    d = _emulated_daemon(groups)
    try:
        c = _inproc_client(d)
        sess = d.sessions[c.sid]
        g = sess.gpu
        assert g is not None and "gpu" not in c.info  # no IPC export in the emulation

        def check(tag):
            shm = sess.shm
            for k in range(len(groups)):
                assert np.array_equal(g.tables[k].numpy(), shm.tables[k]), (tag, k)
                assert np.array_equal(g.counts[k].numpy(), shm.counts[k]), (tag, k)
            assert np.array_equal(g.slots.numpy(), shm.slot_array), tag

        def step(batch):
            return c._do(c._req_step(batch))

        check("hello")
        rng = np.random.default_rng(3)
        prompts = {f"r{i}": rng.integers(0, 50, int(rng.integers(1, 20))).astype(np.int32) for i in range(5)}
        res = step(StepBatch(admit=[AdmitRequest(r, len(p), hashes(p)) for r, p in prompts.items()]))
        assert (np.asarray(res.admit_status) == 0).all()
        check("admit")
        live = list(prompts)
        for k in range(16):
            if k == 3:
                step(StepBatch(append_ids=live[1:], free=[live[0]], forks=[(live[1], "f")],
                               admit=[AdmitRequest("n", 9)]))
                live = live[1:] + ["f", "n"]
            elif k == 6:
                step(StepBatch(append_ids=live, append_num_tokens=[int(x) for x in rng.integers(1, 6, len(live))]))
            elif k == 8:
                c._do(c._req_allocate("solo", 10))
                check("allocate")
                c._do(c._req_append_slots("solo", 7))
                check("append")
                c._do(c._req_fork("solo", "solo2"))
                check("fork")
                c._do(c._req_free("solo"))
                check("free")
                step(StepBatch(append_ids=live + ["solo2"]))
                live.append("solo2")
            elif k % 2:  # by rows: the decode op (its own publishing of every group; windows slide)
                res = step(StepBatch(append_rows=c.rows_of(live), append_num_tokens=3))
                assert c.last_op == "decode" and not res.append_status.any()
            else:
                step(StepBatch(append_ids=live))
            check(f"step{k}")
        st = d.gpu_pool.stats()
        assert st["flushes"] > 15
        # no CUDA graphs on the CPU emulation: each flush with table changes launched the plans
        assert st["apply_graph_replays"] == 0 and 0 < st["apply_plan_launches"] <= st["flushes"]
        c._do((  # goodbye ends the session and drops its GPU buffers
            "goodbye", {}, [], lambda h, f: None))
        assert sess.gpu is None and c.sid not in d.sessions
    finally:
        for s in list(d.sessions.values()):
            d.end_session(s, "test")


def test_a_session_without_slot_mappings_launches_nothing_for_a_step_that_changes_no_table():
    """hello ``slots`` false: the GPU buffers still get every table change, the slot buffer is never
    written, and a decode step that grows no table (most of them) stages and launches nothing."""
    from kvd.api import AdmitRequest, StepBatch
    from kvd.gpu_session import PAD_SLOT_ID

    d = _emulated_daemon(((4, 0),))
    try:
        c = _inproc_client(d, slot_mapping=False)
        g = d.sessions[c.sid].gpu
        shm = d.sessions[c.sid].shm
        c._do(c._req_step(StepBatch(admit=[AdmitRequest("a", 6), AdmitRequest("b", 3)])))
        flushes = []
        for k in range(9):  # a (6 tokens) takes a block at positions 8, 12 (k = 2, 6); b (3) at 4, 8 (k = 1, 5)
            before = d.gpu_pool.stats()["flushes"]
            res = c._do(c._req_step(StepBatch(append_rows=c.rows_of(["a", "b"]), append_num_tokens=1)))
            assert res.num_scheduled_tokens == [0]
            flushes.append(d.gpu_pool.stats()["flushes"] - before)
            assert np.array_equal(g.tables[0].numpy(), shm.tables[0]) and np.array_equal(g.counts[0].numpy(), shm.counts[0])
        assert flushes == [0, 1, 1, 0, 0, 1, 1, 0, 0]
        assert (g.slots.numpy() == PAD_SLOT_ID).all() and (shm.slot_array == PAD_SLOT_ID).all()
    finally:
        for s in list(d.sessions.values()):
            d.end_session(s, "test")


def test_a_session_that_says_gpu_false_gets_no_device_buffers_and_costs_no_flush():
    """hello ``gpu`` false (``Client(gpu=False)``): the daemon keeps no device buffers for the
    session and flushes nothing after its replies, while a session beside it is mirrored as
    before; its shared memory is the same as the mirrored session's for the same steps."""
    from kvd.api import AdmitRequest, StepBatch

    d = _emulated_daemon(((4, 0),))
    try:
        host = _inproc_client(d, gpu=False)
        mirrored = _inproc_client(d)
        assert d.sessions[host.sid].gpu is None and d.sessions[mirrored.sid].gpu is not None
        flushes = d.gpu_pool.stats()["flushes"]
        for c in (host, mirrored):
            c._do(c._req_step(StepBatch(admit=[AdmitRequest("a", 6), AdmitRequest("b", 3)])))
            for _ in range(3):
                c._do(c._req_step(StepBatch(append_rows=c.rows_of(["a", "b"]), append_num_tokens=1)))
            if c is host:
                assert d.gpu_pool.stats()["flushes"] == flushes
        assert d.gpu_pool.stats()["flushes"] == flushes + 4  # each of its 4 steps wrote a slot mapping
        hs, ms = d.sessions[host.sid].shm, d.sessions[mirrored.sid].shm
        assert hs.counts[0].tolist()[:2] == ms.counts[0].tolist()[:2] == [3, 2]
        ra, rb = host.rows_of(["a", "b"])  # the last step's slots: a at position 8, b at 5
        assert hs.slot_array[0, :3].tolist() == [hs.tables[0][ra, 2] * 4, hs.tables[0][rb, 1] * 4 + 1, -1]
        g = d.sessions[mirrored.sid].gpu
        assert np.array_equal(g.tables[0].numpy(), ms.tables[0]) and np.array_equal(g.slots.numpy(), ms.slot_array)
    finally:
        for s in list(d.sessions.values()):
            d.end_session(s, "test")


def test_hello_gpu_must_be_a_boolean():
    from kvd import protocol as P
    from kvd.server import Daemon

    d = Daemon(_HelloCfg)
    try:
        rep = d.handle([b"id", P.request(P.HELLO, 0, 1, tenant="", name="x", pid=0, gpu="no")])
        h = P.parse_reply(rep[0])
        assert h.get("ok") != 1 and "gpu must be a boolean" in h["msg"] and not d.sessions
    finally:
        for s in list(d.sessions.values()):
            d.end_session(s, "test")


class _HelloCfg:
    block_size = 4
    num_gpu_blocks = 16
    max_model_len = 32
    max_num_reqs = 4
    max_reqs_per_session = 4
    max_num_batched_tokens = 32


def test_staging_waits_for_the_last_flushs_event():
    """The daemon replies before its flush has run on the GPU (the client's stream waits on the
    session's event); the pool-wide staging buffers are rewritten only after the last flush's event
    (here a stand-in for the CUDA event: the emulation's kernels are synchronous)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("emulation runs under TRITON_INTERPRET=1 (a machine without a GPU)")
    pytest.importorskip("triton")
    from kvd.gpu_session import GpuPool

    class Event:
        def __init__(self, pool):
            self.pool, self.seen = pool, []

        def synchronize(self):  # the staging as it is when the writer waits: not yet rewritten
            self.seen.append(int(self.pool.np["req_rows"][0]))

    pool = GpuPool("cpu", [4], [8], 4, 16)
    s = pool.new_session()
    ev = Event(pool)
    for row in (2, 3):
        pool.inflight = ev
        s.stage_slots(np.array([row], np.int32), np.array([5]), np.array([1], np.int32))
        assert pool.inflight is None and int(pool.np["req_rows"][0]) == row
    assert ev.seen == [0, 2]
    pool.inflight = ev
    s.tracker.mark(0, np.array([1], np.int32), 0, 1)
    s.flush([np.zeros((4, 8), np.int32)], [np.zeros(4, np.int32)])
    assert ev.seen == [0, 2, 3] and pool.inflight is None  # no CUDA event: the flush synchronized
    assert int(s.slots[0, 0]) == 1 and int(s.slots[0, 1]) == -1  # row 3 holds no block: 0 * 4 + 5 % 4
    pool.inflight = ev
    s.close()
    assert ev.seen == [0, 2, 3, 3]


# ---- CUDA: a real daemon, two client processes --------------------------------------------------

WORKER = r"""
import json, sys, time
import numpy as np
import torch
torch.cuda.init()  # before hello: the session's lease runs from there
from kvd_client import Client
from kvd.api import AdmitRequest, StepBatch
from kvd.hashing import hash_prompt

ep, seed, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
BS = 16
rng = np.random.default_rng(seed)
c = Client(ep, tenant="shared", gpu=mode == "gpu", timeout_s=30.0)
G = len(c.tables)
checks = 0

def check(tag):
    global checks
    if mode != "gpu":  # the CPU daemon baseline: same calls, no GPU views
        return
    # no synchronize: .cpu() runs on the current stream, which the client made wait on the
    # daemon's event of the reply
    for g in range(G):
        gt = c.gpu_tables[g].cpu().numpy()
        assert np.array_equal(gt, c.tables[g]), (tag, g, "table")
        assert np.array_equal(c.gpu_num_blocks[g].cpu().numpy(), c.num_blocks[g]), (tag, g, "counts")
        assert np.array_equal(c.gpu_slot_mappings[g].cpu().numpy(), c.slot_mappings[g]), (tag, g, "slots")
    checks += 1

check("hello")
assert mode != "gpu" or c.gpu_tables[0].is_cuda and c.gpu_slot_mappings[0].dtype == torch.int64
common = rng.integers(0, 1000, 64).astype(np.int32)  # a prefix both processes share
prompts = {}
for i in range(12):
    tail = rng.integers(0, 1000, int(rng.integers(1, 150))).astype(np.int32)
    prompts[f"r{i}"] = np.concatenate([common, tail]) if i % 2 else tail
ids = list(prompts)
# admissions: two steps
for part in (ids[:6], ids[6:]):
    res = c.step(StepBatch(admit=[AdmitRequest(r, len(prompts[r]), hash_prompt(prompts[r], BS)) for r in part]))
    assert (np.asarray(res.admit_status) == 0).all(), res.admit_status
    check("admit")
live = list(ids)
nxt = 0
for k in range(60):
    if k == 10:  # fork (CoW on the next append of the shared partial block), free, admit
        res = c.step(StepBatch(append_ids=live[1:], free=[live[0]], forks=[(live[1], "f0"), (live[2], "f1")],
                               admit=[AdmitRequest("n0", 40)]))
        live = live[1:] + ["f0", "f1", "n0"]
    elif k == 20:
        res = c.step(StepBatch(append_ids=live, append_num_tokens=[int(x) for x in rng.integers(1, 20, len(live))]))
    elif k == 30:  # the non-step ops write the same buffers
        a = c.allocate("solo", 50)
        check("allocate")
        c.append_slots("solo", 30)
        check("append")
        c.fork("solo", "solo2")
        check("fork")
        c.free("solo")
        check("free")
        c.free("solo2")
        res = c.step(StepBatch(append_ids=live))
    elif k == 40:
        res = c.step(StepBatch(free=live[:3]))
        live = live[3:]
    else:
        res = c.step(StepBatch(append_ids=live))
    check(f"step{k}")
# decode round trips, timed (checked after)
times = []
for k in range(300):
    t0 = time.perf_counter()
    c.step(StepBatch(append_ids=live))
    times.append(time.perf_counter() - t0)
check("timed")
st = c.stats()
a = np.array(times[20:]) * 1e6
waits = [c.gpu.waits, c.gpu.waits_skipped] if c.gpu is not None else None
print(json.dumps({"checks": checks, "decode_reqs": len(live), "rt_p50_us": float(np.percentile(a, 50)),
                  "rt_p99_us": float(np.percentile(a, 99)), "gpu_flush": st.get("gpu_flush"), "gpu_waits": waits}))
c.close()
"""


def _wait_ready(sock: socket.socket, timeout: float) -> float:
    t0 = time.monotonic()
    sock.settimeout(timeout)
    while True:
        msg = sock.recv(4096).decode()
        if "READY=1" in msg:
            return time.monotonic() - t0


def run_workers(daemon_factory, short_tmp, n_workers: int = 2, device: str = "cuda:0", env=None, **opts):
    """Start a daemon (waits for READY=1; ``env``: more of its environment), run n worker
    processes; returns (results, daemon, seconds to READY)."""
    path = str(short_tmp / f"notify{device[:3]}")
    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns.bind(path)
    try:
        d = daemon_factory(wait=False, env={"NOTIFY_SOCKET": path, **(env or {})}, device=device,
                           **{"lease_s": 5.0, **opts})
        ready_s = _wait_ready(ns, 300)
    finally:
        ns.close()
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    mode = "gpu" if device.startswith("cuda") else "cpu"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, d.endpoint, str(i), mode], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n_workers)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results, d, ready_s


@pytest.mark.cuda
def test_gpu_buffers_equal_shared_memory(daemon_factory, short_tmp):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("triton")
    results, d, ready_s = run_workers(daemon_factory, short_tmp)
    for r in results:
        assert r["checks"] == 68  # hello, 2 admissions, 60 steps, 4 single ops, after the timed loop
        # every reply (at least the 362 steps'): a stream wait, or none as its writes had run
        assert sum(r["gpu_waits"]) >= 362
        # every flush's apply kernel was a replay of the session's CUDA graph of it
        assert r["gpu_flush"]["apply_graph_replays"] > 15 and r["gpu_flush"]["apply_plan_launches"] == 0
        print(f"\nGPU daemon worker: ready {ready_s:.1f}s {json.dumps(r)}")
    assert d.stop() == 0, d.stderr[-3000:]
    assert shm_segments(d.pid) == []
    assert ipc_event_files(d.pid) == []  # the driver's file behind the daemon's events, unlinked at exit
    with pytest.raises(ProcessLookupError):
        os.kill(d.pid, 0)
    # the same client calls against a CPU daemon: the round-trip cost of the GPU mirror
    results, d2, ready2 = run_workers(daemon_factory, short_tmp, n_workers=1, device="cpu")
    print(f"\nCPU daemon worker: ready {ready2:.1f}s {json.dumps(results[0])}")
    assert d2.stop() == 0
    assert shm_segments(d2.pid) == []


@pytest.mark.cuda
def test_replies_whose_writes_have_run_need_no_stream_wait(daemon_factory, short_tmp):
    """A daemon that synchronizes before replying (``KVDSRV_GPU_SYNC=1``): every reply's event has
    completed when the client takes it, so ``GpuBuffers.wait`` never makes a stream wait, and the
    GPU views still equal shared memory after every step."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("triton")
    results, d, _ = run_workers(daemon_factory, short_tmp, n_workers=1, env={"KVDSRV_GPU_SYNC": "1"})
    r = results[0]
    assert r["checks"] == 68
    waits, skipped = r["gpu_waits"]
    assert waits == 0 and skipped >= 362, r["gpu_waits"]  # at least one per step
    assert d.stop() == 0, d.stderr[-3000:]


def test_remove_ipc_event_files_takes_only_that_process_files(tmp_path):
    """The CUDA driver's interprocess-event files are named ``cuda.shm.<n>.<pid hex>.<n>``: only the
    given process's go (another process's, kvd's own segments and look-alikes stay)."""
    from kvd.gpu_session import remove_ipc_event_files

    names = ["cuda.shm.0.fcb.1", "cuda.shm.1.fcb.2", "cuda.shm.0.fcbb.1", "cuda.shm.0.1fcb.1", "kvd_4043_a",
             "cuda.shm.0.fcb", "xcuda.shm.0.fcb.1"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    assert sorted(remove_ipc_event_files(0xFCB, str(tmp_path))) == ["cuda.shm.0.fcb.1", "cuda.shm.1.fcb.2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
    assert remove_ipc_event_files(0xFCB, str(tmp_path)) == []
    assert remove_ipc_event_files(1, str(tmp_path / "absent")) == []
