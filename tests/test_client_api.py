"""The client surface a newcomer reads (issue 15): slot mappings from allocate/append_slots, the
step's schedule, statuses that agree, one error channel per call, clear connection errors, the
documented methods, the config caps."""

from __future__ import annotations

import inspect
import os
import time

import numpy as np
import pytest

from conftest_daemon import DaemonProc, daemon_factory, short_tmp  # noqa: F401
from kvd.api import PAD_SLOT_ID, AllocStatus, StepBatch
from kvd.errors import (
    FIRST_ERROR_CODE,
    ERROR_BY_CODE,
    DaemonUnavailable,
    InvalidArgument,
    PermissionDenied,
    SessionError,
)
from kvd.hashing import hash_prompt
from kvd_client import AsyncClient, Client

BS = 16


@pytest.fixture(scope="module")
def daemon():
    """One default daemon for this module's tests (each test closes its sessions)."""
    import shutil
    import tempfile
    from pathlib import Path

    rd = Path(tempfile.mkdtemp(prefix="kvdapi", dir="/tmp"))
    d = DaemonProc(rd / "rt")
    try:
        yield d.start()
    finally:
        d.cleanup()
        shutil.rmtree(rd, ignore_errors=True)


def expected_slots(table: np.ndarray, start: int, n: int) -> list[int]:
    pos = np.arange(start, start + n)
    return (table[pos // BS].astype(np.int64) * BS + pos % BS).tolist()


def test_status_and_error_code_spaces_do_not_collide():
    assert [int(s) for s in AllocStatus] == [0, 1, 2]
    assert min(ERROR_BY_CODE) == FIRST_ERROR_CODE == 16
    assert len(set(ERROR_BY_CODE)) == len(ERROR_BY_CODE)


def test_allocate_and_append_slots_write_the_slot_mapping(daemon):
    with Client(daemon.endpoint) as c:
        prompt = np.arange(40, dtype=np.int32)
        hs = hash_prompt(prompt, BS)
        r = c.allocate("a", 40, hs)
        table = c.block_table("a").copy()
        slots = c.slot_mappings[0]
        assert r.ok and slots[:40].tolist() == expected_slots(table, 0, 40)
        assert (slots[40:] == PAD_SLOT_ID).all()
        # a prefix hit: only the uncached tokens are scheduled (32 cached, 8 to compute)
        r2 = c.allocate("b", 40, hs)
        assert r2.num_cached_tokens == 32
        assert slots[:8].tolist() == expected_slots(c.block_table("b"), 32, 8)
        assert (slots[8:48] == PAD_SLOT_ID).all()
        # append_slots: the new tokens' slots, across a block boundary
        ap = c.append_slots("a", 10)
        assert ap.ok and ap.new_block_ids.size == 1
        assert slots[:10].tolist() == expected_slots(c.block_table("a"), 40, 10)
        assert (slots[10:] == PAD_SLOT_ID).all()


def test_step_schedule_comes_back_through_the_client(daemon):
    with Client(daemon.endpoint) as c:
        c.allocate("a", 20)
        c.allocate("b", 33)
        rows = np.array([c.row_of("a"), c.row_of("b")], np.int32)
        res = c.step(StepBatch(append_rows=rows, append_num_tokens=1))  # the decode fast path
        assert res.sched_rows.tolist() == rows.tolist()
        assert res.sched_start.tolist() == [20, 33] and res.sched_len.tolist() == [1, 1]
        res = c.step(StepBatch(append_ids=["b", "a"], append_num_tokens=[2, 3]))  # general path
        assert res.sched_rows.tolist() == [c.row_of("b"), c.row_of("a")]
        assert res.sched_start.tolist() == [34, 21] and res.sched_len.tolist() == [2, 3]
        s = c.slot_mappings[0]
        assert s[:5].tolist() == expected_slots(c.block_table("b"), 34, 2) + expected_slots(c.block_table("a"), 21, 3)


def test_decode_schedule_skips_requests_without_space(daemon_factory):
    d = daemon_factory(num_gpu_blocks=4)  # 3 usable blocks
    with Client(d.endpoint) as c:
        c.allocate("a", 16)
        c.allocate("b", 16)
        c.allocate("c", 8)
        rows = np.array([c.row_of(x) for x in "abc"], np.int32)
        res = c.step(StepBatch(append_rows=rows, append_num_tokens=1))
        # "a" and "b" need a new block and there is none; "c" fits in its own block
        assert res.append_status.tolist() == [AllocStatus.LATER, AllocStatus.LATER, 0]
        assert res.sched_rows.tolist() == [c.row_of("c")]
        assert res.sched_start.tolist() == [8] and res.sched_len.tolist() == [1]


def test_can_allocate_and_allocate_agree(daemon_factory):
    d = daemon_factory(num_gpu_blocks=5, max_model_len=2048)  # 4 usable blocks: 64 tokens
    with Client(d.endpoint) as c:
        assert c.can_allocate(65) is AllocStatus.NEVER
        assert c.allocate("big", 65).status == AllocStatus.NEVER
        c.allocate("x", 48)
        assert c.can_allocate(32) is AllocStatus.LATER
        assert c.allocate("y", 32).status == AllocStatus.LATER
        assert c.request_ids == ["x"]
        with pytest.raises(InvalidArgument):
            c.can_allocate(5000)  # longer than max_model_len: the error allocate raises
        with pytest.raises(InvalidArgument):
            c.allocate("z", 5000)


def test_can_swap_returns_alloc_status(daemon):
    with Client(daemon.endpoint) as c:
        c.allocate("s", 40)
        assert c.can_swap_out("s") is AllocStatus.NEVER  # no CPU pool configured
        assert c.swap_out("s").status == AllocStatus.NEVER


def test_bad_sizes_are_invalid_argument_and_change_nothing(daemon):
    with Client(daemon.endpoint) as c:
        c.allocate("r", 20)
        before = c.stats()
        for bad in (-1, 1.5, True):
            with pytest.raises(InvalidArgument, match="num_new_tokens"):
                c.append_slots("r", bad)
        with pytest.raises(InvalidArgument, match="num_tokens"):
            c.allocate("q", -3)
        with pytest.raises(InvalidArgument, match="num_lookahead_tokens"):
            c.can_allocate(10, num_lookahead_tokens=-1)
        assert c.stats() == before and c.request_ids == ["r"]


def test_expired_lease_names_the_lease_and_the_option(daemon_factory):
    d = daemon_factory(lease_s=0.3)
    c = Client(d.endpoint, heartbeat=False, name="idle-engine")
    try:
        c.allocate("a", 10)
        time.sleep(1.0)
        with pytest.raises(SessionError, match=r"'idle-engine'.*lease expired.*lease_s=0.3 s.*--lease-s"):
            c.stats()
    finally:
        c.close(goodbye=False)


def test_missing_socket_fails_at_once_naming_the_path(short_tmp):
    path = str(short_tmp / "nothing.sock")
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable, match=path):
        Client("ipc://" + path, timeout_s=5.0)
    assert time.monotonic() - t0 < 1.0


def test_socket_without_permission_is_a_typed_error(short_tmp, monkeypatch):
    path = short_tmp / "kvd.sock"
    path.touch(mode=0o600)
    real_access = os.access
    # root may open anything: stand in for an unprivileged user's access() answer
    monkeypatch.setattr(os, "access", lambda p, m: False if str(p) == str(path) else real_access(p, m))
    with pytest.raises(PermissionDenied, match=str(path)):
        Client("ipc://" + str(path))


def test_readme_links_point_into_the_repo():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    assert "../shared" not in text
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert {"docs/DESIGN.md", "docs/WORKLOAD.md"} <= set(links)
    assert all((root / link).is_file() for link in links if not link.startswith("http")), links


def test_public_methods_are_documented_and_typed():
    from kvd.api import ManagerConfig

    assert "num_gpu_blocks" in ManagerConfig.__doc__ and "NEVER" in AllocStatus.__doc__
    sig = inspect.signature(Client.__init__)
    assert not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    assert {"tenant", "name", "timeout_s", "retries", "heartbeat", "gpu"} <= set(sig.parameters)
    names = ("lookup", "can_allocate", "allocate", "append_slots", "free", "fork", "can_swap_out",
             "swap_out", "can_swap_in", "swap_in", "reset_prefix_cache", "num_common_prefix_blocks",
             "cross_block_table", "stats", "daemon_status", "step", "block_table", "hash_prompt",
             "reconnect", "close")
    for cls in (Client, AsyncClient):
        for n in names:
            fn = getattr(cls, n)
            assert fn.__doc__ and fn.__doc__.strip(), (cls, n)
            params = inspect.signature(fn).parameters
            assert "namespace" not in params, (cls, n)
            assert "return" in fn.__annotations__, (cls, n)
        for n in names[:17]:
            assert inspect.iscoroutinefunction(getattr(AsyncClient, n)) or n in ("block_table", "hash_prompt")


def test_common_prefix_and_cross_table_match_the_manager(daemon_factory):
    d = daemon_factory(max_encoder_len=64, encoder_block_size=16)
    with Client(d.endpoint) as c:
        c.allocate("p", 40, num_encoder_tokens=40)
        c.fork("p", "k")
        assert c.num_common_prefix_blocks("p", 2) == 3
        assert c.num_common_prefix_blocks("p", 1) == 0
        cross = c.cross_block_table("p")
        assert cross.shape == (3,) and len(set(cross.tolist()) & set(c.block_table("p").tolist())) == 0
        assert c.cross_block_table("k").tolist() == cross.tolist()  # a fork shares the cross table
        with pytest.raises(InvalidArgument, match=r"num_encoder_tokens must be in \[0, 64\]"):
            c.allocate("q", 10, num_encoder_tokens=65)


def test_lookahead_cap_is_a_config_key(daemon_factory):
    d = daemon_factory(max_lookahead_tokens=200)
    with Client(d.endpoint) as c:
        r = c.allocate("a", 16, num_lookahead_tokens=200)
        assert r.ok and c.block_table("a").size == 14  # ceil(216 / 16)
        with pytest.raises(InvalidArgument, match=r"num_lookahead_tokens must be in \[0, 200\]"):
            c.append_slots("a", 1, num_lookahead_tokens=201)


def test_daemon_status_lists_sessions_and_tenants(daemon):
    with Client(daemon.endpoint, tenant="alice", name="eng-a") as a, Client(daemon.endpoint, name="eng-b") as b:
        a.allocate("x", 40)
        a.allocate("y", 17)
        b.allocate("z", 1)
        st = b.daemon_status()
        by_name = {s["name"]: s for s in st["sessions"]}
        assert by_name["eng-a"]["requests"] == 2 and by_name["eng-a"]["tenant"] == "alice"
        assert by_name["eng-a"]["pid"] == os.getpid() and by_name["eng-b"]["requests"] == 1
        tenants = {t["tenant"]: t for t in st["tenants"]}
        assert tenants["alice"] == {"tenant": "alice", "sessions": 1, "requests": 2, "block_refs": 5}
        me = f"uid:{os.getuid()}"  # no tenant named: the process's own
        assert tenants[me] == {"tenant": me, "sessions": 1, "requests": 1, "block_refs": 1}
        assert st["pool"]["num_used_blocks"] == 6 and st["daemon"]["pid"] == daemon.pid
        # everything built before READY was frozen out of the collector's reach (imports alone are
        # tens of thousands of objects); the collector itself still runs on what came after
        gc_st = st["daemon"]["gc"]
        assert gc_st["frozen"] > 10_000 and len(gc_st["collections"]) == 3


def test_segment_without_permission_is_a_typed_error(daemon, monkeypatch):
    import kvd_client.client as cc

    def refuse(name):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cc.SessionBuffers, "attach", staticmethod(refuse))
    with pytest.raises(PermissionDenied, match=r"/dev/shm/kvd_\d+_"):
        Client(daemon.endpoint)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_daemon_metrics_count_no_space_swaps_and_lease_expiries(daemon_factory):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    port = _free_port()
    d = daemon_factory(num_gpu_blocks=5, metrics_port=port, lease_s=0.3)
    with Client(d.endpoint, tenant="alice") as c:
        c.allocate("x", 48)
        assert c.allocate("y", 32).status == AllocStatus.LATER
        assert c.allocate("z", 65).status == AllocStatus.NEVER
        rows = np.array([c.row_of("x")], np.int32)
        c.step(StepBatch(append_rows=rows, append_num_tokens=32))  # needs 2 blocks, 1 is free
        assert c.swap_out("x").status == AllocStatus.NEVER  # no CPU pool
        idle = Client(d.endpoint, heartbeat=False)
        idle._release_local()  # goes silent without a goodbye: its lease expires
        time.sleep(1.0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
            assert resp.status == 200 and resp.read() == b"ok\n"
    s = {(x.name, tuple(sorted(x.labels.items()))): x.value
         for fam in text_string_to_metric_families(text) for x in fam.samples}
    assert s[("kvd_no_space_answers_total", (("tenant", "alice"),))] == 3
    assert s[("kvd_swap_requests_total", (("direction", "out"), ("result", "never")))] == 1
    assert s[("kvd_lease_expiries_total", ())] == 1
    assert s[("kvd_tenant_requests", (("tenant", "alice"),))] == 1
    assert s[("kvd_tenant_block_refs", (("tenant", "alice"),))] == 3


def test_async_client_has_the_same_surface(daemon):
    import asyncio

    from kvd.errors import UnknownRequest

    async def run():
        c = await AsyncClient.connect(daemon.endpoint, name="async-api")
        try:
            r = await c.allocate("a", 20)
            assert r.ok and c.slot_mappings[0][:20].tolist() == expected_slots(c.block_table("a"), 0, 20)
            res = await c.step(StepBatch(free=["nope"], append_ids=["a"], append_num_tokens=2))
            assert res.free_status.tolist() == [UnknownRequest.code] and res.append_status.tolist() == [0]
            assert res.sched_start.tolist() == [20] and res.sched_len.tolist() == [2]
            assert await c.can_swap_out("a") is AllocStatus.NEVER
            assert await c.num_common_prefix_blocks("a", 1) == 2
            st = await c.daemon_status()
            assert [s["requests"] for s in st["sessions"] if s["name"] == "async-api"] == [1]
        finally:
            await c.close()

    asyncio.run(run())
