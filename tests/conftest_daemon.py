"""Helpers to run real kvd daemons in tests (import from test modules; the lead owns conftest.py).

Every daemon started here is stopped (SIGTERM, then SIGKILL) and its shared-memory segments are
unlinked when the test ends, even on failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Named tenants the tests take, all open to the uid running them (kvd.tenancy).
TEST_TENANTS = ("p", "t", "g", "a", "b", "A", "B", "x", "alice", "bob", "async", "forks", "hybrid", "shared", "observer",
                "good", "fuzz", "sharer", "engine", "ta", "tb", "tc")
SMALL = dict(num_gpu_blocks=1024, max_num_reqs=256, max_reqs_per_session=64, max_sessions=16,
             max_num_batched_tokens=2048, max_model_len=2048, lease_s=1.5,
             tenants=" ".join(f"{name}=uid:{os.getuid()}" for name in TEST_TENANTS))


def shm_segments(pid: int | None = None) -> list[str]:
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return []
    pre = "kvd_" if pid is None else f"kvd_{pid}_"
    return sorted(n for n in names if n.startswith(pre))


class DaemonProc:
    """One ``python -m kvd serve`` process on ipc://<runtime_dir>/kvd.sock."""

    def __init__(self, runtime_dir: Path, env: dict | None = None, **opts):
        self.extra_env = dict(env or {})
        self.runtime_dir = Path(runtime_dir)
        self.opts = {**SMALL, **opts}
        self.endpoint = "ipc://" + str(self.runtime_dir / "kvd.sock")
        self.proc: subprocess.Popen | None = None
        self.pids: list[int] = []

    def argv(self) -> list[str]:
        args = [sys.executable, "-m", "kvd", "serve", "--runtime-dir", str(self.runtime_dir),
                "--log-level", "warning", "--exit-with-parent"]  # a killed test run leaves no daemon
        for k, v in self.opts.items():
            if isinstance(v, bool):
                args.append(("--" if v else "--no-") + k.replace("_", "-"))
            else:
                args += ["--" + k.replace("_", "-"), str(v)]
        return args

    def start(self, wait: bool = True, timeout: float = 20.0) -> "DaemonProc":
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        for k in list(env):
            if k.startswith("KVD_") and k != "KVD_CONFIG":
                env.pop(k)
        for k in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "RUNTIME_DIRECTORY"):
            env.pop(k, None)
        env.update(self.extra_env)
        self.proc = subprocess.Popen(self.argv(), cwd=str(REPO), env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.pids.append(self.proc.pid)
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        sock = self.runtime_dir / "kvd.sock"
        lock = self.runtime_dir / "kvd.lock"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out, err = self.proc.communicate()
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {err[-2000:]}")
            if sock.exists() and lock.exists():
                try:
                    if int(lock.read_text().strip() or 0) == self.proc.pid:
                        return
                except ValueError:
                    pass
            time.sleep(0.02)
        raise RuntimeError("daemon did not become ready")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        try:
            self.stdout, self.stderr = p.communicate(timeout=5)
        except (ValueError, subprocess.TimeoutExpired):
            self.stdout = self.stderr = ""
        return p.returncode

    def cleanup(self) -> None:
        self.stop()
        for pid in self.pids:
            for name in shm_segments(pid):
                try:
                    os.unlink("/dev/shm/" + name)
                except FileNotFoundError:
                    pass


@pytest.fixture
def short_tmp():
    """A short temp dir (ipc socket paths are limited to ~107 bytes)."""
    d = tempfile.mkdtemp(prefix="kvdt", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon_factory(short_tmp):
    """``start(**opts) -> DaemonProc`` (started and ready); stops and cleans every one at the end."""
    made: list[DaemonProc] = []

    def start(runtime_dir: Path | None = None, wait: bool = True, env: dict | None = None, **opts) -> DaemonProc:
        rd = runtime_dir or (short_tmp / f"rt{len(made)}")
        d = DaemonProc(rd, env=env, **opts)
        made.append(d)
        return d.start(wait=wait)

    yield start
    for d in made:
        d.cleanup()


@pytest.fixture
def daemon(daemon_factory):
    return daemon_factory()
