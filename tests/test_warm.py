"""kvd.warm: the shadow daemon's passes (a prefix hit's admission and free) leave the shadow as they
found it and never touch the real daemon; a serving daemon with ``warm_every_us`` runs them while it
polls an idle socket, and its shadow shows no segment in /dev/shm."""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest_daemon import daemon_factory, shm_segments, short_tmp  # noqa: F401
from kvd import protocol as P
from kvd.api import AdmitRequest, StepBatch
from kvd.config import ServeConfig
from kvd.server import Daemon, _group_specs
from kvd.warm import TAIL, Warmer
from kvd_client import Client


class Cfg:
    block_size = 16
    num_gpu_blocks = 512
    max_model_len = 2048
    max_num_reqs = 16
    max_reqs_per_session = 8
    max_num_batched_tokens = 2048


def _pool_state(d: Daemon):
    m = d.manager
    return (m.pool.ref_cnt.copy(), m.tables[0].copy(), m.num_tokens.copy(), m.stats(), m.tick)


def test_a_pass_is_a_whole_block_hit_and_leaves_the_shadow_and_the_real_daemon_as_they_were():
    real = Daemon(Cfg)
    w = Warmer(Cfg, Daemon, _group_specs(Cfg))
    try:
        assert w.shared_tokens == 64 * 16 and w.num_tokens == 64 * 16 + TAIL
        real_before = _pool_state(real)
        names = [s.shm.name for s in w.d.sessions.values()]
        assert len(names) == 2 and not set(names) & set(shm_segments())  # unlinked at once, still mapped
        w.run()  # the first pass may leave the B's partial block cached: compare from the second on
        before = _pool_state(w.d)[:3]
        for _ in range(5):
            w.run()
            after = _pool_state(w.d)[:3]
            assert all(np.array_equal(x, y) for x, y in zip(before, after))
        assert w.passes == 6
        # B's admission as a pass sends it: the prompt's 64 whole blocks are a hit, one fresh block
        w.seq_b += 1
        msg = w.admit_message(w.sid_b, w.seq_b)
        assert msg[0][:4] == P.ADMIT_MAGIC  # the op clients send for a lone admission
        rep = w.d.handle([b"warm-b", *msg])
        h = P.parse_reply(rep[0])
        assert h["ok"] == 1 and h["ns"] == 1
        assert np.frombuffer(rep[1], np.int16, 1, 0).tolist() == [0]  # admitted
        assert np.frombuffer(rep[1], np.int32, 1, 2).tolist() == [w.shared_tokens]  # cached tokens
        after_real = _pool_state(real)
        assert all(np.array_equal(x, y) for x, y in zip(real_before[:3], after_real[:3]))
        assert real_before[3:] == after_real[3:]
    finally:
        w.close()
        for s in list(real.sessions.values()):
            real.end_session(s, "test")
    assert not w.d.sessions


def test_a_short_max_model_len_shares_fewer_blocks_and_one_with_no_whole_block_is_refused():
    cfg = type("Short", (Cfg,), dict(max_model_len=100))
    w = Warmer(cfg, Daemon, _group_specs(cfg))
    try:
        assert w.shared_tokens == 5 * 16 and w.num_tokens == 5 * 16 + TAIL
        w.run()
        assert w.passes == 1
    finally:
        w.close()
    tiny = type("Tiny", (Cfg,), dict(max_model_len=TAIL + 15))
    with pytest.raises(ValueError):
        Warmer(tiny, Daemon, _group_specs(tiny))


@pytest.mark.parametrize("algo", ["vllm_sha256", "xxh3_128"])
def test_every_hash_scheme_warms_with_a_whole_block_hit(algo):
    cfg = type("Algo", (Cfg,), dict(hash_algo=algo))
    w = Warmer(cfg, Daemon, _group_specs(cfg))  # its first pass checks the hit: a wrong hash raises
    try:
        assert w.d.hash_algo == algo
        w.run()
        assert w.passes == 1
    finally:
        w.close()


def test_a_hybrid_pool_warms_both_groups():
    class Hybrid(Cfg):
        @staticmethod
        def group_specs():
            return ((16, 0), (16, 64))

    w = Warmer(Hybrid, Daemon, _group_specs(Hybrid))
    try:
        assert w.d.G == 2
        w.run()
        assert w.passes == 1
    finally:
        w.close()


def test_a_daemon_whose_pool_cannot_warm_serves_without_warming(daemon_factory):  # noqa: F811
    d = daemon_factory(busy_poll_us=50000, warm_every_us=500, max_model_len=TAIL + 15, max_num_batched_tokens=64)
    with Client(d.endpoint, tenant="t") as c:
        time.sleep(0.01)
        assert c.daemon_status()["daemon"]["warm_passes"] == 0
        assert c.step(StepBatch(admit=[AdmitRequest("r", 20)])).admit_status.tolist() == [0]


def test_a_daemon_warms_while_it_polls_an_idle_socket_and_serves_unchanged(daemon_factory):  # noqa: F811
    d = daemon_factory(busy_poll_us=50000, warm_every_us=500)
    assert ServeConfig().warm_every_us == 2000  # on by default
    with Client(d.endpoint, tenant="t") as c:
        st0 = c.daemon_status()
        time.sleep(0.03)  # the daemon polls (50 ms after each message): passes every 0.5 ms
        st1 = c.daemon_status()
        assert st1["daemon"]["warm_passes"] > st0["daemon"]["warm_passes"]
        assert st1["pool"]["num_used_blocks"] == st0["pool"]["num_used_blocks"] == 0
        res = c.step(StepBatch(admit=[AdmitRequest("r", 40)]))
        assert res.admit_status.tolist() == [0] and c.stats()["num_used_blocks"] == 3
        names = [s["name"] for s in c.daemon_status()["sessions"]]
        assert "kvd-warm" not in names  # the shadow's sessions are the shadow daemon's, not this one's
        assert len(shm_segments(d.proc.pid)) == 1  # this session's: the shadow's two are unlinked
    pid = d.proc.pid
    assert d.stop() == 0
    assert shm_segments(pid) == []


def test_warm_every_us_0_warms_nothing(daemon_factory):  # noqa: F811
    d = daemon_factory(busy_poll_us=50000, warm_every_us=0)
    with Client(d.endpoint, tenant="t") as c:
        time.sleep(0.01)
        assert c.daemon_status()["daemon"]["warm_passes"] == 0


def test_a_pass_whose_admission_is_refused_raises():
    w = Warmer(Cfg, Daemon, _group_specs(Cfg))
    try:
        w.run()
        w.seq_b += 1  # B admits row 0 outside a pass: the next pass's admission of row 0 is refused
        w.admit(b"warm-b", w.sid_b, w.seq_b)
        with pytest.raises(RuntimeError, match="refused a pass's admission"):
            w.run()
        assert w.passes == 1
    finally:
        w.close()
