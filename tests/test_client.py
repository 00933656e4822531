"""The client library against a real daemon: same answers as the in-process BlockManager."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from conftest_daemon import SMALL, daemon, daemon_factory, shm_segments, short_tmp  # noqa: F401
from kvd import protocol as P
from kvd.api import PAD_SLOT_ID, AdmitRequest, AllocStatus, GroupSpec, ManagerConfig, StepBatch
from kvd.errors import DuplicateRequest, InvalidArgument, UnknownRequest
from kvd.hashing import hash_prompt
from kvd.manager import BlockManager
from kvd_client import AsyncClient, Client

BS = 16


def local_manager(**over) -> BlockManager:
    o = {**SMALL, **over}
    return BlockManager(ManagerConfig(num_gpu_blocks=o["num_gpu_blocks"], groups=(GroupSpec(BS),),
                                      num_cpu_blocks=o.get("num_cpu_blocks", 0), max_model_len=o["max_model_len"],
                                      max_num_reqs=o["max_num_reqs"]))


def expected_slots(m: BlockManager, ids, starts, lens) -> np.ndarray:
    out = []
    for rid, s, n in zip(ids, starts, lens):
        t = m.block_table(rid)
        for pos in range(s, s + n):
            out.append(int(t[pos // BS]) * BS + pos % BS)
    return np.array(out, np.int64)


def test_parity_with_in_process_manager(daemon):
    m = local_manager()
    c = Client(daemon.endpoint, tenant="p")
    try:
        rng = np.random.default_rng(0)
        prompts = {i: rng.integers(0, 1000, int(rng.integers(20, 120))).astype(np.int32) for i in range(6)}
        prompts[6] = prompts[0].copy()  # a full prefix hit
        for i in range(7):
            hs = hash_prompt(prompts[i], BS)
            a = c.allocate(f"r{i}", len(prompts[i]), hs)
            b = m.allocate(f"r{i}", len(prompts[i]), hs)
            assert a.status == b.status and a.num_cached_tokens == b.num_cached_tokens
            assert (a.block_ids == b.block_ids).all()
            assert (c.block_table(f"r{i}") == m.block_table(f"r{i}")).all()
        assert c.lookup(hash_prompt(prompts[0], BS)) == m.lookup(hash_prompt(prompts[0], BS))
        assert c.can_allocate(100) == m.can_allocate(100) == AllocStatus.OK
        for ask in (c.can_allocate, m.can_allocate):  # longer than max_model_len: allocate's error
            with pytest.raises(InvalidArgument, match="num_tokens must be in"):
                ask(10**6)

        # decode steps through `step`, with frees, forks and admissions mixed in
        ids = [f"r{i}" for i in range(7)]
        for k in range(40):
            batch = StepBatch(append_ids=list(ids))
            if k == 5:
                batch = StepBatch(append_ids=list(ids[1:]), free=[ids[0]], forks=[("r1", "f1")],
                                  admit=[AdmitRequest("n1", 70, hash_prompt(prompts[2][:70], BS))])
            ra = c.step(batch)
            rb = m.step(batch)
            for name in ("free_status", "fork_status", "append_status", "admit_status", "admit_cached_tokens"):
                assert (getattr(ra, name) == getattr(rb, name)).all(), name
            assert (np.sort(ra.copies.reshape(-1)) == np.sort(rb.copies.reshape(-1))).all()
            if k == 5:
                ids = ids[1:] + ["f1", "n1"]
                assert ra.freed_rows.tolist() == [0]
            for rid in ids:
                assert (c.block_table(rid) == m.block_table(rid)).all(), (k, rid)
            # the slot mapping in shared memory is the step's schedule, padded
            exp = expected_slots(m, [m.req_id_of_row(r) for r in rb.sched_rows], rb.sched_start, rb.sched_len)
            sm = c.slot_mappings[0]
            assert (sm[: exp.size] == exp).all()
            assert (sm[exp.size:] == PAD_SLOT_ID).all()
            assert ra.num_scheduled_tokens == [exp.size]
        st_c, st_m = c.stats(), m.stats()
        for key in ("num_used_blocks", "num_requests", "cow_copies"):
            assert st_c[key] == st_m[key], key

        # append_slots / free / fork through the single-request API
        ar, br = c.append_slots("r3", 17), m.append_slots("r3", 17)
        assert ar.status == br.status and (ar.new_block_ids == br.new_block_ids).all()
        c.fork("r3", "f3")
        m.fork("r3", "f3")
        assert (c.block_table("f3") == m.block_table("f3")).all()
        for rid in list(c.request_ids):
            c.free(rid)
            m.free(rid)
        assert c.stats()["num_used_blocks"] == m.stats()["num_used_blocks"] == 0
        assert c.request_ids == []
    finally:
        c.close()


def test_typed_errors_and_row_bookkeeping(daemon):
    c = Client(daemon.endpoint)
    try:
        c.allocate("a", 10)
        with pytest.raises(DuplicateRequest):
            c.allocate("a", 10)
        with pytest.raises(UnknownRequest):
            c.free("nope")
        with pytest.raises(InvalidArgument):
            c.allocate("big", 10**7)  # longer than max_model_len: typed error from the daemon
        assert c.request_ids == ["a"]  # the failed allocate gave its row back
        res = c.step(StepBatch(admit=[AdmitRequest("b", 10), AdmitRequest("c", 10**7)]))
        assert res.admit_status[0] == 0 and res.admit_status[1] == InvalidArgument.code
        assert res.admit_rows[1] == -1
        assert sorted(c.request_ids) == ["a", "b"]
        assert c.row_of("b") == res.admit_rows[0]
        assert c.id_of(int(res.admit_rows[0])) == "b"
        assert c.shm.row_tags[c.row_of("b")] != 0
        # one error channel in a step: unknown ids are statuses, the rest of the batch applies
        before = c.block_table("a").copy()
        res = c.step(StepBatch(free=["zzz", "b"], append_ids=["nope", "a"], append_num_tokens=[3, 2],
                               forks=[("ghost", "k1"), ("a", "a")], admit=[AdmitRequest("a", 5)]))
        assert res.free_status.tolist() == [UnknownRequest.code, 0]
        assert res.append_status.tolist() == [UnknownRequest.code, 0]
        assert res.fork_status.tolist() == [UnknownRequest.code, DuplicateRequest.code]
        assert res.admit_status.tolist() == [DuplicateRequest.code] and res.admit_rows.tolist() == [-1]
        assert sorted(c.request_ids) == ["a"]
        ra = c.row_of("a")
        assert res.sched_rows.tolist() == [ra] and res.sched_len.tolist() == [2]
        assert res.sched_start.tolist() == [10]  # "a" had 10 tokens
        assert c.block_table("a").tolist() == before.tolist()  # 12 tokens still fit one block
        # the session's views are read-only
        with pytest.raises(ValueError):
            c.tables[0][0, 0] = 5
    finally:
        c.close()
    assert shm_segments(daemon.pid) == []


def test_tenants_are_isolated_and_shared_blocks_are_hits_once_confirmed(daemon):
    a = Client(daemon.endpoint, tenant="alice", kv_shared=True)
    b = Client(daemon.endpoint, tenant="bob", kv_shared=True)
    a2 = Client(daemon.endpoint, tenant="alice", kv_shared=True)
    own = Client(daemon.endpoint, tenant="alice")  # its KV memory is its own: a private namespace
    try:
        assert (a.shared, own.shared) == (True, False) and a.info["tenant"] == "alice"
        toks = np.arange(64, dtype=np.int32)
        hs = hash_prompt(toks, BS)
        a.allocate("x", 64, hs)
        assert a.lookup(hs) == 4  # its own blocks: at once
        assert a2.lookup(hs) == 0  # a's forward pass has not confirmed them yet
        a.mark_computed()
        assert a2.lookup(hs) == 4 and b.lookup(hs) == 0 and own.lookup(hs) == 0
        assert b.allocate("y", 64, hs).num_cached_tokens == 0
        assert a2.allocate("z", 64, hs).num_cached_tokens == 48
        assert a2.block_table("z")[:3].tolist() == a.block_table("x")[:3].tolist()
        b.reset_prefix_cache()  # only bob's namespace
        assert a2.lookup(hs) == 4
        nxt = np.arange(64, 80, dtype=np.int32)  # the block a decode step fills next, as one batch
        assert a.hash_next_blocks(nxt[None, :], hs[-1:]).tolist() == hash_prompt(np.r_[toks, nxt], BS)[-1:].tolist()
    finally:
        for x in (a, b, a2, own):
            x.close()


def test_swap_out_and_in(daemon_factory):
    d = daemon_factory(num_cpu_blocks=64)
    c = Client(d.endpoint)
    try:
        c.allocate("s", 40)
        before = c.block_table("s").copy()
        # swapping no requests is a no-op either way (swap_in of none was an internal error)
        assert c.can_swap_out([]) is AllocStatus.OK and c.can_swap_in([]) is AllocStatus.OK
        for r in (c.swap_out([]), c.swap_in([])):
            assert r.ok and r.mapping.shape == (0, 2)
        assert (c.block_table("s") == before).all() and c.stats()["num_free_cpu_blocks"] == 63
        assert c.can_swap_out("s") is AllocStatus.OK
        r = c.swap_out(["s"])
        assert r.ok and r.mapping.shape == (3, 2)
        assert (r.mapping[:, 0] == before).all()
        assert c.can_swap_in("s") is AllocStatus.OK
        r2 = c.swap_in("s")
        assert r2.ok and r2.mapping.shape == (3, 2)
        assert c.block_table("s").size == 3
    finally:
        c.close()


def test_async_client(daemon, monkeypatch):
    ops = []
    header = AsyncClient._header
    monkeypatch.setattr(AsyncClient, "_header", staticmethod(lambda op, *a: (ops.append(op), header(op, *a))[1]))

    async def main():
        c = await AsyncClient.connect(daemon.endpoint, tenant="async")
        try:
            res = await c.step(StepBatch(admit=[AdmitRequest(i, 33) for i in range(4)]))
            assert (res.admit_status == 0).all()
            for _ in range(3):
                res = await c.step(StepBatch(append_ids=[0, 1, 2, 3]))
                assert (res.append_status == 0).all()
            assert c.block_table(0).size == 3
            assert c.slot_mappings[0][3] == c.block_table(3)[35 // BS] * BS + 35 % BS
            rows = c.rows_of([0, 1, 2, 3])  # the decode op: its reply parsed as a dict here
            res = await c.step(StepBatch(append_rows=rows, append_num_tokens=1))
            assert (res.append_status == 0).all() and res.sched_start.tolist() == [36] * 4
            assert res.num_scheduled_tokens == [4] and res.tick == c.tick
            assert c.slot_mappings[0][3] == c.block_table(3)[36 // BS] * BS + 36 % BS
            st = await c.stats()
            assert st["num_requests"] == 4
            # a lone admission: the admit op, its binary reply parsed as a dict here
            prompt = np.arange(40, dtype=np.int32)
            res = await c.step(StepBatch(admit=[AdmitRequest("h", 40, c.hash_prompt(prompt))]))
            assert ops[-1] == P.ADMIT
            row = c.row_of("h")
            assert res.admit_status.tolist() == [0] and res.admit_rows.tolist() == [row]
            assert res.admit_cached_tokens.tolist() == [0] and res.tick == c.tick
            assert res.sched_rows.tolist() == [row] and res.sched_start.tolist() == [0]
            assert res.sched_len.tolist() == [40] and res.num_scheduled_tokens == [40]
            assert c.block_table("h").size == 3
            # frees, then appends of the others: the decode_free op, its reply parsed as a dict here
            hrow = c.row_of("h")
            res = await c.step(StepBatch(free=["h", 0], append_rows=c.rows_of([1, 2]), append_num_tokens=1))
            assert ops[-1] == P.DECODE_FREE
            assert res.free_status.tolist() == [0, 0] and sorted(res.freed_rows.tolist()) == sorted([hrow, rows[0]])
            assert res.append_status.tolist() == [0, 0] and res.sched_start.tolist() == [37, 37]
            assert res.tick == c.tick and "h" not in c.request_ids and 0 not in c.request_ids
            assert c.slot_mappings[0][1] == c.block_table(2)[37 // BS] * BS + 37 % BS
            await c.step(StepBatch(free=[1, 2, 3]))
            assert ops[-1] == P.DECODE_FREE and c.request_ids == []
            r = await c.allocate("z", 5)
            assert r.ok
            await c.free("z")
        finally:
            await c.close()

    asyncio.run(main())


def test_child_forked_in_a_step_can_append_in_the_same_step(daemon):
    m = local_manager()
    c = Client(daemon.endpoint, tenant="forks")
    try:
        for mgr in (c, m):
            mgr.allocate("p", 21)
        batch = StepBatch(forks=[("p", "k")], append_ids=["p", "k"])
        a, b = c.step(batch), m.step(batch)
        assert a.append_status.tolist() == b.append_status.tolist() == [0, 0]
        assert a.copies.tolist() == b.copies.tolist() == [[2, 3]]
        assert c.block_table("k").tolist() == m.block_table("k").tolist() == [1, 2]
        assert c.block_table("p").tolist() == m.block_table("p").tolist() == [1, 3]
    finally:
        c.close()


def test_two_kv_groups_are_served_like_the_in_process_manager(daemon_factory):
    """A hybrid pool (kv_groups "16,32:64": full attention beside a 64-token window of 32-token
    blocks): tables, slot mappings and statuses equal the in-process manager's, group by group."""
    d = daemon_factory(kv_groups="16,32:64")
    groups = (GroupSpec(16), GroupSpec(32, sliding_window=64))
    m = BlockManager(ManagerConfig(num_gpu_blocks=SMALL["num_gpu_blocks"], groups=groups,
                                   max_model_len=SMALL["max_model_len"], max_num_reqs=SMALL["max_num_reqs"]))
    c = Client(d.endpoint, tenant="hybrid")
    try:
        assert c.block_sizes == (16, 32) and c.sliding_windows == (0, 64) == m.sliding_windows
        rng = np.random.default_rng(1)
        prompts = [rng.integers(0, 1000, n).astype(np.int32) for n in (100, 150, 70)]
        prompts.append(prompts[1].copy())  # a prefix hit both groups must agree on
        for i, p in enumerate(prompts):
            hs = [c.hash_prompt(p, group=g) for g in range(2)]
            assert all((h == hash_prompt(p, gs.block_size)).all() for h, gs in zip(hs, groups))
            a, b = c.allocate(i, len(p), hs), m.allocate(i, len(p), hs)
            assert (a.status, a.num_cached_tokens) == (b.status, b.num_cached_tokens)
            assert a.num_cached_tokens == (128 if i == 3 else 0)  # 4 blocks of 32 inside both groups
        ids = list(range(4))
        for k in range(70):  # long enough for the window to release blocks
            batch = StepBatch(append_ids=ids, forks=[(1, "f")] if k == 10 else ())
            ra, rb = c.step(batch), m.step(batch)
            assert ra.append_status.tolist() == rb.append_status.tolist() == [0] * len(ids)
            assert ra.copies.tolist() == rb.copies.tolist()
            if k == 10:
                ids = ids + ["f"]
            for g, gs in enumerate(groups):
                for rid in ids:
                    assert (c.block_table(rid, g) == m.block_table(rid, g)).all(), (k, rid, g)
                slots = []
                for row, start, n in zip(rb.sched_rows, rb.sched_start, rb.sched_len):
                    t = m.block_table(m.req_id_of_row(row), g)
                    slots += [int(t[pos // gs.block_size]) * gs.block_size + pos % gs.block_size
                              for pos in range(start, start + n)]
                assert c.slot_mappings[g][: len(slots)].tolist() == slots
        assert (c.block_table(0, 1)[:3] == 0).all()  # blocks that left the window are the null block
        assert c.stats()["num_used_blocks"] == m.stats()["num_used_blocks"]
    finally:
        c.close()


@pytest.mark.parametrize("cpus, poll_s", [(1, 0.0), (2, 0.001), (8, 0.001)])
def test_the_default_busy_poll_depends_on_the_cpus_the_engine_may_run_on(daemon, monkeypatch, cpus, poll_s):
    import kvd_client.client as C

    monkeypatch.setattr(C.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    c = Client(daemon.endpoint)
    try:
        assert c._poll_s == poll_s
        with pytest.raises(InvalidArgument):
            Client(daemon.endpoint, busy_poll_us=-1)
    finally:
        c.close()


def test_a_session_without_slot_mappings_gets_tables_and_no_slots(daemon):
    """``slot_mapping=False``: the daemon writes no slot mapping for that session (its buffer stays
    PAD_SLOT_ID, replies say nt = 0), its tables are exactly the manager's; a session beside it with
    the default still gets its slots."""
    m = local_manager()
    own = Client(daemon.endpoint, tenant="a", slot_mapping=False)
    usual = Client(daemon.endpoint, tenant="b")
    try:
        assert own.info["slots"] is False and not own.slot_mapping and own.slot_mappings is None
        assert usual.slot_mapping and usual.slot_mappings is not None
        pad = np.full_like(own.shm.slots[0], PAD_SLOT_ID)
        ids = ["a", "b"]
        res = own.step(StepBatch(admit=[AdmitRequest("a", 40), AdmitRequest("b", 17)]))
        m.step(StepBatch(admit=[AdmitRequest("a", 40), AdmitRequest("b", 17)]))
        assert res.num_scheduled_tokens == [0] and res.sched_len.tolist() == [40, 17]
        for k in range(20):  # decode steps: the fast path, blocks filling on the way
            res = own.step(StepBatch(append_rows=own.rows_of(ids), append_num_tokens=1))
            m.step(StepBatch(append_ids=ids))
            assert res.num_scheduled_tokens == [0] and res.append_status.tolist() == [0, 0]
        for rid in ids:
            assert (own.block_table(rid) == m.block_table(rid)).all()
        assert own.shm.slots[0].tobytes() == pad.tobytes()
        r2 = usual.step(StepBatch(admit=[AdmitRequest("x", 20)]))
        assert r2.num_scheduled_tokens == [20]
        t = usual.block_table("x")
        assert usual.slot_mappings[0][:20].tolist() == [int(t[p // BS]) * BS + p % BS for p in range(20)]
    finally:
        own.close()
        usual.close()


def test_a_started_step_is_the_step_and_the_client_refuses_calls_meanwhile(daemon):
    """``start_step`` + ``result()`` gives what ``step`` gives (the same tables and statuses as the
    in-process manager); while a step waits for its reply every other call is refused and changes
    nothing; ``result()`` returns the same result again; close drops a pending step."""
    m = local_manager()
    c = Client(daemon.endpoint, tenant="p")
    try:
        prompt = np.arange(40, dtype=np.int32)
        hs = hash_prompt(prompt, BS)
        admit = StepBatch(admit=[AdmitRequest("a", 40, hs[:2]), AdmitRequest("b", 33, ())])
        pending = c.start_step(admit)
        with pytest.raises(InvalidArgument, match="result"):
            c.step(StepBatch(append_ids=["a"]))
        with pytest.raises(InvalidArgument, match="result"):
            c.start_step(StepBatch(append_ids=["a"]))
        res = pending.result()
        assert pending.ready() and pending.result() is res
        want = m.step(admit)
        assert res.admit_status.tolist() == want.admit_status.tolist() == [0, 0]
        for rid in ("a", "b"):
            assert c.block_table(rid).tolist() == m.block_table(rid).tolist()
        for k in range(20):  # decode steps, half started and taken later
            batch = StepBatch(append_rows=c.rows_of(["a", "b"]).astype(np.int32), append_num_tokens=1)
            res = c.start_step(batch).result() if k % 2 else c.step(batch)
            want = m.step(StepBatch(append_ids=["a", "b"]))
            assert res.append_status.tolist() == want.append_status.tolist() == [0, 0]
            assert res.sched_start.tolist() == want.sched_start.tolist()
            for rid in ("a", "b"):
                assert c.block_table(rid).tolist() == m.block_table(rid).tolist()
        assert c.stats()["num_requests"] == 2  # the refused calls changed nothing
        left = c.start_step(StepBatch(free=["a", "b"]))
    finally:
        c.close()
    from kvd.errors import SessionError
    with pytest.raises(SessionError, match="closed"):
        left.result()
    with Client(daemon.endpoint, tenant="p") as c2:  # the goodbye freed the session's requests
        assert c2.stats()["num_requests"] == 0


def _zmq_io_threads() -> set[int]:
    tasks = f"/proc/{os.getpid()}/task"
    return {int(t) for t in os.listdir(tasks) if open(f"{tasks}/{t}/comm").read().strip().startswith("ZMQbg/IO")}


def test_io_cpu_pins_the_clients_zmq_io_thread_and_nothing_else(daemon):
    cpu = min(os.sched_getaffinity(0))
    before, others = os.sched_getaffinity(0), _zmq_io_threads()
    c = Client(daemon.endpoint, io_cpu=cpu)
    try:
        c.allocate("a", 16)
        mine = _zmq_io_threads() - others
        assert len(mine) == 1  # this client's I/O thread
        (io,) = mine
        assert os.sched_getaffinity(io) == {cpu}
        assert os.sched_getscheduler(io) == os.SCHED_BATCH  # never preempts the engine's thread
        assert os.sched_getaffinity(0) == before  # the caller's thread is the caller's to pin
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
    finally:
        c.close()


def test_a_process_that_may_not_set_the_io_policy_keeps_the_normal_one(daemon, monkeypatch):
    """libzmq aborts when it cannot set its thread's policy: the client asks only after a probe."""
    import kvd_client.client as C

    def refuse(*a):
        raise PermissionError("seccomp")

    monkeypatch.setattr(C, "_io_policy_ok", None)
    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    others = _zmq_io_threads()
    with Client(daemon.endpoint, io_cpu=min(os.sched_getaffinity(0))) as c:
        c.allocate("a", 16)
        (io,) = _zmq_io_threads() - others
        assert os.sched_getscheduler(io) == os.SCHED_OTHER and C._io_policy_ok is False


def test_an_unpinned_clients_io_thread_keeps_the_normal_policy(daemon):
    others = _zmq_io_threads()
    with Client(daemon.endpoint) as c:
        c.allocate("a", 16)
        (io,) = _zmq_io_threads() - others
        assert os.sched_getscheduler(io) == os.SCHED_OTHER


@pytest.mark.parametrize("bad", [-1, 1 << 20, 1.0, True, "0"])
def test_io_cpu_must_be_one_of_the_process_cpus(daemon, bad):
    with pytest.raises(InvalidArgument, match="io_cpu"):
        Client(daemon.endpoint, io_cpu=bad)


def test_decode_lane_skips_stale_replies_and_detects_another_boot(daemon):
    """The blocking client reads a decode reply as a tuple: one answering an earlier request is
    skipped, one from another boot raises DaemonRestarted (as a JSON reply's epoch does)."""
    import threading

    import zmq

    from kvd import protocol as P
    from kvd.errors import DaemonRestarted

    c = Client(daemon.endpoint, heartbeat=False, retries=0, timeout_s=5.0)
    real = c._sock
    router = c._ctx.socket(zmq.ROUTER)
    router.bind("inproc://decode-lane")
    fake = c._ctx.socket(zmq.DEALER)
    fake.connect("inproc://decode-lane")
    fake.setsockopt(zmq.RCVTIMEO, 5000)  # a failing serve() fails the step, not the run

    def serve(replies):  # one request; (seq offset, epoch) per reply, all with tick 40 + k
        ident, hdr, rows_b = router.recv_multipart()
        _, seq, _, na, an, _ = P.parse_decode_request(hdr)
        assert (na, an) == (2, 1) and np.frombuffer(rows_b, np.int32).tolist() == [0, 1]
        for k, (dq, epoch) in enumerate(replies):
            body = bytes(2 * na) + np.array([5, 9], np.int32).tobytes()
            router.send_multipart([ident, P.decode_reply(seq + dq, epoch, 40 + k, 0, 0, na, [na]), body])

    try:
        c.step(StepBatch(admit=[AdmitRequest("a", 5), AdmitRequest("b", 9)]))
        rows = c.rows_of(["a", "b"])
        c._sock = fake
        mine = c.epoch.encode("ascii")
        t = threading.Thread(target=serve, args=([(-1, mine), (0, mine)],))
        t.start()
        res = c.step(StepBatch(append_rows=rows, append_num_tokens=1))
        t.join()
        assert res.tick == c.tick == 41  # the stale reply (tick 40) was skipped
        assert res.append_status.tolist() == [0, 0] and res.sched_start.tolist() == [5, 9]
        assert res.sched_rows.tolist() == [0, 1] and res.sched_len.tolist() == [1, 1]
        assert res.num_scheduled_tokens == [2]
        t = threading.Thread(target=serve, args=([(0, b"f" * P.EPOCH_BYTES)],))
        t.start()
        with pytest.raises(DaemonRestarted):
            c.step(StepBatch(append_rows=rows, append_num_tokens=1))
        t.join()
    finally:
        c._sock = real
        fake.close(0)
        router.close(0)
        c.close()


def test_the_asyncio_client_and_the_blocking_one_agree_on_a_random_run(daemon_factory):
    """The same seeded random steps (lone and batched admissions, decode ops, appends by id with
    counts, forks, frees, now and then an unknown id or a bad count) through the blocking client to
    one daemon and the asyncio client to another: the same results, errors and tables."""
    rng = np.random.default_rng(7)
    d1, d2 = daemon_factory(), daemon_factory()
    fields = ("free_status", "fork_status", "append_status", "admit_status", "admit_cached_tokens", "copies",
              "sched_start", "sched_len", "tick")

    async def main():
        a = Client(d1.endpoint, tenant="t")
        b = await AsyncClient.connect(d2.endpoint, tenant="t")
        live: list[str] = []
        prefix = rng.integers(1, 300, 40).astype(np.int32)
        try:
            for k in range(80):
                op = int(rng.integers(0, 5))
                if op == 0 or not live:
                    admit = []
                    for j in range(int(rng.integers(1, 3))):
                        p = np.concatenate([prefix[: int(rng.integers(0, 41))], rng.integers(1, 300, 5).astype(np.int32)])
                        admit.append(AdmitRequest(f"r{k}.{j}", p.size, hash_prompt(p, BS)))
                    batch = StepBatch(admit=admit)
                elif op == 1:  # the decode op
                    batch = StepBatch(append_rows=a.rows_of(live), append_num_tokens=int(rng.integers(1, 3)))
                elif op == 2:  # appends by id, some counts bad, some ids unknown
                    ids = [live[int(i)] for i in rng.integers(0, len(live), 3)] + (["ghost"] if rng.random() < 0.3 else [])
                    batch = StepBatch(append_ids=ids, append_num_tokens=rng.choice([1, 2, -1], len(ids)))
                elif op == 3:
                    batch = StepBatch(forks=[(live[int(rng.integers(0, len(live)))], f"f{k}")])
                else:
                    batch = StepBatch(free=[live[int(rng.integers(0, len(live)))], "ghost"])
                got = []
                for step in (lambda: a.step(batch), None):
                    try:
                        got.append(step() if step else await b.step(batch))
                    except Exception as e:  # noqa: BLE001 - both must raise the same
                        got.append(e)
                if isinstance(got[0], Exception):
                    assert type(got[0]) is type(got[1]), (got, batch)
                    continue
                for f in fields:
                    assert np.array_equal(np.asarray(getattr(got[0], f)), np.asarray(getattr(got[1], f))), (f, batch)
                live = sorted(a.request_ids)
                assert live == sorted(b.request_ids)
                for rid in live:
                    assert a.block_table(rid).tolist() == b.block_table(rid).tolist()
                if len(live) > 40:
                    a.step(StepBatch(free=live[:20]))
                    await b.step(StepBatch(free=live[:20]))
                    live = live[20:]
        finally:
            a.close()
            await b.close()

    asyncio.run(main())


def test_a_hybrid_pool_agrees_with_the_in_process_manager_on_a_random_run(daemon_factory):
    """kv_groups "16,32:64" in a pool small enough to evict: seeded random admissions sharing a
    prefix, appends of random sizes, forks and frees through a daemon and in process give the same
    statuses, cached tokens, copies and every group's tables."""
    blocks = 160
    d = daemon_factory(kv_groups="16,32:64", num_gpu_blocks=blocks)
    groups = (GroupSpec(16), GroupSpec(32, sliding_window=64))
    m = BlockManager(ManagerConfig(num_gpu_blocks=blocks, groups=groups, max_model_len=SMALL["max_model_len"],
                                   max_num_reqs=SMALL["max_num_reqs"]))
    c = Client(d.endpoint, tenant="hybrid")
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, 1000, 160).astype(np.int32)
    live: list = []
    try:
        for k in range(90):
            op = int(rng.integers(0, 6))
            if op == 0 or not live:
                admit = []
                for j in range(int(rng.integers(1, 3))):
                    p = np.concatenate([prefix[: int(rng.integers(0, 161))], rng.integers(0, 1000, 9).astype(np.int32)])
                    admit.append(AdmitRequest(f"r{k}.{j}", p.size, [hash_prompt(p, g.block_size) for g in groups]))
                batch = StepBatch(admit=admit)
            elif op == 1:
                batch = StepBatch(forks=[(live[int(rng.integers(0, len(live)))], f"f{k}")])
            elif op == 2:
                batch = StepBatch(free=[live[int(rng.integers(0, len(live)))]])
            else:
                ids = [r for r in live if rng.random() < 0.7] or live[:1]
                batch = StepBatch(append_ids=ids, append_num_tokens=rng.choice([1, 1, 1, 5, 17], len(ids)))
            ra, rb = c.step(batch), m.step(batch)
            for f in ("free_status", "fork_status", "append_status", "admit_status", "admit_cached_tokens", "copies",
                      "sched_start", "sched_len"):
                assert np.asarray(getattr(ra, f)).tolist() == np.asarray(getattr(rb, f)).tolist(), (k, f, batch)
            live = sorted(m._row_of)
            assert live == sorted(c.request_ids)
            for rid in live:
                for g in range(len(groups)):
                    assert c.block_table(rid, g).tolist() == m.block_table(rid, g).tolist(), (k, rid, g)
        assert m.pool.num_evictions > 0 and c.stats()["num_used_blocks"] == m.stats()["num_used_blocks"]
    finally:
        c.close()


def test_swaps_through_a_daemon_agree_with_the_manager_in_process_on_a_random_run(daemon_factory):
    """Seeded random admissions, appends, swap-outs (some refused: no CPU room, or already out),
    swap-ins (some refused: no GPU room) and frees in small GPU and CPU pools: the daemon's
    statuses, mappings and tables equal the in-process manager's."""
    gpu, cpu = 48, 8
    d = daemon_factory(num_gpu_blocks=gpu, num_cpu_blocks=cpu)
    m = local_manager(num_gpu_blocks=gpu, num_cpu_blocks=cpu)
    c = Client(d.endpoint)
    rng = np.random.default_rng(5)
    live: list[str] = []
    out: set[str] = set()
    counts = {"swap_out": 0, "swap_in": 0, "refused": 0}
    try:
        for k in range(120):
            op = int(rng.integers(0, 5))
            if op == 0 or not live:
                n = int(rng.integers(1, 80))
                a, b = c.allocate(f"r{k}", n), m.allocate(f"r{k}", n)
                assert (a.status, a.num_cached_tokens) == (b.status, b.num_cached_tokens), k
                if b.ok:
                    live.append(f"r{k}")
            elif op == 1:
                rid = live[int(rng.integers(0, len(live)))]
                try:
                    a = c.swap_out([rid])
                except Exception as e:  # noqa: BLE001 - e.g. already swapped out: the same error both ways
                    with pytest.raises(type(e)):
                        m.swap_out([rid])
                    continue
                b = m.swap_out([rid])
                assert a.status == b.status and a.mapping.tolist() == b.mapping.tolist(), k
                counts["swap_out" if b.ok else "refused"] += 1
                out |= {rid} if b.ok else set()
            elif op == 2 and out:
                rid = sorted(out)[int(rng.integers(0, len(out)))]
                a, b = c.swap_in([rid]), m.swap_in([rid])
                assert a.status == b.status and a.mapping.tolist() == b.mapping.tolist(), k
                counts["swap_in" if b.ok else "refused"] += 1
                out -= {rid} if b.ok else set()
            elif op == 3:
                ids = [r for r in live if r not in out]
                if ids:
                    ra, rb = c.step(StepBatch(append_ids=ids, append_num_tokens=3)), m.step(
                        StepBatch(append_ids=ids, append_num_tokens=3))
                    assert ra.append_status.tolist() == rb.append_status.tolist(), k
            else:
                rid = live.pop(int(rng.integers(0, len(live))))
                c.free(rid), m.free(rid)
                out.discard(rid)
            for rid in live:
                if rid not in out:
                    assert c.block_table(rid).tolist() == m.block_table(rid).tolist(), (k, rid)
        assert counts["swap_out"] and counts["swap_in"] and counts["refused"], counts
        assert c.stats()["num_used_blocks"] == m.stats()["num_used_blocks"]
    finally:
        c.close()
