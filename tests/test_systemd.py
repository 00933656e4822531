"""sd_notify over a real AF_UNIX datagram socket; watchdog interval; the daemon's notify order."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from kvd.systemd import format_status, notify, watchdog_interval


@contextlib.contextmanager
def notify_socket(abstract: bool = False):
    """A bound SOCK_DGRAM socket and the $NOTIFY_SOCKET value that names it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    tmp = tempfile.mkdtemp(prefix="kvdn-", dir="/tmp")  # short: sun_path is 108 bytes
    try:
        if abstract:
            name = f"kvd-test-{os.getpid()}-{time.monotonic_ns()}"
            sock.bind("\0" + name)
            value = "@" + name
        else:
            value = os.path.join(tmp, "notify")
            sock.bind(value)
        sock.settimeout(5)
        yield sock, value
    finally:
        sock.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_noop_outside_systemd(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_messages_arrive_in_order(monkeypatch, abstract):
    with notify_socket(abstract) as (sock, value):
        monkeypatch.setenv("NOTIFY_SOCKET", value)
        assert notify("READY=1", "STATUS=warm") is True
        assert notify("WATCHDOG=1") is True
        assert notify("WATCHDOG=1") is True
        assert notify("STOPPING=1") is True
        got = [sock.recv(4096).decode() for _ in range(4)]
    assert got == ["READY=1\nSTATUS=warm", "WATCHDOG=1", "WATCHDOG=1", "STOPPING=1"]


@pytest.mark.parametrize("value", ["/nonexistent/kvd/notify", "@kvd-nobody-listens-here", "relative", "@"])
def test_never_raises(monkeypatch, value):
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert notify("READY=1") is False
    assert notify() is False


def test_never_raises_on_a_non_datagram_socket(monkeypatch):
    tmp = tempfile.mkdtemp(prefix="kvdn-", dir="/tmp")
    stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        stream.bind(os.path.join(tmp, "s"))
        stream.listen(1)
        monkeypatch.setenv("NOTIFY_SOCKET", os.path.join(tmp, "s"))
        assert notify("READY=1") is False
    finally:
        stream.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_watchdog_interval():
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "10000000"}) == 5.0
    assert watchdog_interval({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": str(os.getpid())}) == 5.0
    assert watchdog_interval({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": str(os.getpid() + 1)}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "me"}) is None


def test_watchdog_interval_reads_environ(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "3000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert watchdog_interval() == 1.5


def test_format_status():
    stats = {
        "pools": {
            "gpu": {"num_blocks": 1000, "num_used_blocks": 250, "prefix_queries": 200, "prefix_hits": 50},
            "cpu": {"num_blocks": 0, "num_used_blocks": 0},
        },
        "sessions": 3,
    }
    assert format_status(stats) == "gpu 25.0% used, hit rate 25.0%; cpu 0.0% used; 3 sessions"
    assert format_status({"pools": {}, "sessions": [{"id": 1}]}) == "1 session"


# ---------------------------------------------------------------------------------------------------
# The daemon's own notifications (needs kvd.server.serve; skipped until it exists)


def _server_serve():
    try:
        import kvd.server as server
    except ImportError as exc:
        pytest.skip(f"kvd.server not importable yet: {exc}")
    if not hasattr(server, "serve"):
        pytest.skip("kvd.server has no serve() yet")
    return server.serve


def daemon_args(runtime_dir: str) -> list[str]:
    return [
        sys.executable, "-m", "kvd", "serve",
        "--device", "cpu", "--runtime-dir", runtime_dir,
        "--num-gpu-blocks", "1024", "--max-num-reqs", "64", "--max-sessions", "4",
        "--max-reqs-per-session", "16", "--max-num-batched-tokens", "256", "--max-model-len", "1024",
        "--status-interval-s", "0.2", "--log-level", "warning",
    ]  # fmt: skip


def recv_until(sock: socket.socket, predicate, timeout: float) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while not any(predicate(m) for m in got):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out; got {got!r}")
        sock.settimeout(left)
        got.append(sock.recv(65536).decode())
    return got


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def test_daemon_ready_watchdog_status_stopping():
    _server_serve()
    runtime_dir = tempfile.mkdtemp(prefix="kvdr-", dir="/tmp")
    with notify_socket() as (sock, value):
        env = dict(os.environ, NOTIFY_SOCKET=value, WATCHDOG_USEC="200000")
        env.pop("WATCHDOG_PID", None)
        proc = subprocess.Popen(daemon_args(runtime_dir), env=env, stderr=subprocess.PIPE)
        try:
            env["WATCHDOG_PID"] = str(proc.pid)
            got = recv_until(sock, lambda m: "READY=1" in m.splitlines(), timeout=120)
            assert os.path.exists(os.path.join(runtime_dir, "kvd.sock")), "READY=1 before the socket was bound"
            t0 = time.monotonic()
            after: list[str] = []
            while sum(m == "WATCHDOG=1" for m in after) < 2 or not any(m.startswith("STATUS=") for m in after):
                assert time.monotonic() - t0 < 10, f"no watchdog pings / STATUS after READY: {after!r}"
                sock.settimeout(10)
                after.append(sock.recv(65536).decode())
            proc.send_signal(signal.SIGTERM)
            tail = recv_until(sock, lambda m: "STOPPING=1" in m.splitlines(), timeout=10)
            assert proc.wait(timeout=30) == 0, proc.stderr.read().decode()
        finally:
            stop(proc)
            shutil.rmtree(runtime_dir, ignore_errors=True)
    messages = got + after + tail
    ready = next(i for i, m in enumerate(messages) if "READY=1" in m.splitlines())
    stopping = next(i for i, m in enumerate(messages) if "STOPPING=1" in m.splitlines())
    pings = [i for i, m in enumerate(messages) if m == "WATCHDOG=1"]
    assert stopping > ready and len([i for i in pings if ready < i < stopping]) >= 2
    assert not any("READY=1" in m.splitlines() for m in messages[ready + 1 :])
