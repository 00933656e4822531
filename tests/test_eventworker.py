"""The KV events worker process (kvd.eventworker): the log travels to it unchanged, and it never
outlives its daemon."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from conftest_daemon import daemon_factory, short_tmp  # noqa: F401
from kvd.eventworker import decode_log, encode_log
from kvd.events import KvEventPublisher
from kvd.runs import NO_PARENT, NO_TOKENS, Runs


def _payloads(pub: KvEventPublisher, log: list) -> list[tuple[bytes, bytes]]:
    """(topic, payload after its timestamp) of what publishing ``log`` sends."""
    start = pub.seq
    pub.publish(log)
    return [(topic, payload[10:]) for seq, topic, payload in pub.buffer if seq >= start]


def test_the_log_reaches_the_worker_as_it_was_logged():
    rng = np.random.default_rng(3)
    width = 32
    h = np.array([rng.bytes(width) for _ in range(6)], f"S{width}")
    tokens = rng.integers(0, 70_000, (6, 4)).astype(np.int32)
    tokens[3:] = NO_TOKENS
    runs = Runs(np.array([NO_PARENT, h[0], h[1], rng.bytes(width), h[3], h[4]], f"S{width}"),
                np.array([True, False, False, True, False, False]), tokens)
    log = [("runs", 7, h, runs), ("removed", 7, [h[0].rstrip(b"\0"), h[1]]), ("cleared", 9, []),
           ("stored", 9, [h[2]], h[1], tokens[:1]), ("stored", 7, [h[5]])]
    describe = {7: ("alice", 4, 0), 9: ("bob#2", 4, 1)}.__getitem__
    frames = encode_log(log, describe, width)
    back = decode_log(frames, width)
    assert [e[1] for e in back] == [describe(e[1]) for e in log]
    ctx = zmq.Context.instance()
    direct = KvEventPublisher(ctx, "inproc://kvd-worker-direct", describe, hash_width=width, group_windows=[None, 16])
    relayed = KvEventPublisher(ctx, "inproc://kvd-worker-relayed", lambda key: key, hash_width=width,
                               group_windows=[None, 16])
    try:
        assert _payloads(relayed, back) == _payloads(direct, list(log))
    finally:
        direct.close()
        relayed.close()


def _children(pid: int, timeout: float = 20.0) -> list[int]:
    """The processes whose parent is ``pid``, once there is one (the daemon starts its worker
    after binding its socket)."""
    deadline = time.monotonic() + timeout
    while True:
        kids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry.name))
        if kids or time.monotonic() > deadline:
            return kids
        time.sleep(0.05)


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie is gone too (its parent, init, reaps it)
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_worker_ends_with_its_daemon(daemon_factory, short_tmp, sig):
    d = daemon_factory(num_gpu_blocks=16, kv_events_endpoint=f"ipc://{short_tmp}/events.sock")
    (worker,) = _children(d.pid)
    inbox = Path(d.runtime_dir) / f"kvd-events-{d.pid}.sock"
    deadline = time.monotonic() + 20
    while not inbox.exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the worker binds it a moment after it started
    assert (inbox.stat().st_mode & 0o777) == 0o600  # only the daemon's user may push
    d.stop(sig)
    assert _gone(worker), "the events worker outlived its daemon"
    assert not inbox.exists()  # the worker removed it, however its daemon ended
