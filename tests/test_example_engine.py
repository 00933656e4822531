"""examples/paged_engine.py end to end against a real daemon: the exact figures of its scenario,
every computed logit equal (float64, atol 1e-10) to a dense non-paged forward pass, and nothing
left behind (daemon process, /dev/shm kvd_* segments, runtime dir), even when the run fails."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from conftest_daemon import shm_segments

REPO = Path(__file__).resolve().parents[1]


def _load():
    name = "kvd_example_paged_engine"
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / "paged_engine.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


pe = _load()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def engine_daemon():
    """A daemon object that ``run`` starts and stops; stopped again here whatever happened."""
    d = pe.KvdDaemon()
    try:
        yield d
    finally:
        d.stop()
        if d.pid is not None:
            assert d.proc.poll() is not None and not _alive(d.pid)
            assert shm_segments(d.pid) == []
        assert not d.runtime_dir.exists()


def test_engine_matches_dense_reference(engine_daemon):
    r = pe.run(daemon=engine_daemon)
    # B shares A's first 40 prompt tokens (5 blocks); D shares A's first 48 tokens, whose 6th block
    # was filled by a decode step and registered with its hash then
    assert r.prefix_hit_tokens == {"A": 0, "C": 0, "C1": 0, "B": 40, "D": 48}
    assert r.shared_blocks == {"B": ("A", 5), "D": ("A", 6), "C1": ("C", 2)}  # zero copy
    assert r.cow_copies == 1  # C and C1 both wrote into C's partial third block
    # prefills 45 + 21 + (49 - 40) + (52 - 48), then one token per running request per decode step
    assert r.tokens_computed == 79 + 25
    assert r.tokens_total == 213 and r.logits_compared == 125
    assert {k: len(v) for k, v in r.outputs.items()} == {"A": 7, "C": 7, "C1": 7, "B": 6, "D": 3}
    assert r.outputs["C1"][0] != r.outputs["C"][0]  # the fork sampled the runner-up token
    assert r.tokens_match
    # every full block (5 of them filled by decode steps) is found by its chained hash
    assert r.registered_blocks == r.full_blocks == {"A": 6, "C": 3, "C1": 3, "B": 6, "D": 6}
    assert r.max_abs_diff <= pe.TOLERANCE
    assert r.null_block_clean and r.requests_after_free == 0
    assert r.ok
    # the daemon is gone with its segments (checked again by the fixture)
    assert r.daemon_pid == engine_daemon.pid and engine_daemon.proc.poll() is not None
    assert shm_segments(r.daemon_pid) == []


def test_a_missed_copy_on_write_is_caught(engine_daemon, monkeypatch):
    """The check has teeth: an engine that skips kvd's CoW copies diverges from the reference."""
    monkeypatch.setattr(pe, "copy_blocks_ref", lambda kv, mapping: None)
    r = pe.run(daemon=engine_daemon)
    assert r.cow_copies == 1 and not r.ok and r.max_abs_diff > 1e-3


def test_cleanup_when_the_run_fails(engine_daemon, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("engine crashed")

    monkeypatch.setattr(pe.PagedEngine, "_forward", boom)
    with pytest.raises(RuntimeError, match="engine crashed"):
        pe.run(daemon=engine_daemon)
    assert engine_daemon.proc.poll() is not None
    assert shm_segments(engine_daemon.pid) == []
    assert not engine_daemon.runtime_dir.exists()


def test_main_exits_zero(capsys):
    before = set(shm_segments())
    assert pe.main([]) == 0
    out = capsys.readouterr().out
    assert "copy-on-write copies: 1" in out and out.rstrip().endswith("OK")
    # new segments may only belong to daemons still running (another test suite's, on a shared box):
    # the example's own daemon has exited, so any of its segments left behind is a leak
    left = [n for n in set(shm_segments()) - before if not os.path.exists(f"/proc/{n.split('_')[1]}")]
    assert left == []


_NOTIFIER = """
import sys, time
from kvd.systemd import notify
time.sleep(float(sys.argv[1]))
if sys.argv[2] == "ready":
    notify("STATUS=warming")
    notify("READY=1", "STATUS=serving")
if sys.argv[2] != "exits":
    time.sleep(30)
"""


@pytest.mark.parametrize("kind", ["ready", "exits", "silent"])
def test_the_ready_listener_waits_for_ready_and_sees_an_early_exit(tmp_path, kind):
    """What ``KvdDaemon.start`` waits with: ``ReadyListener.wait`` returns on the child's READY=1
    (not on its socket file: a GPU daemon binds it before compiling its kernels), raises when the
    child exits first, gives up after the timeout; the notify socket is gone afterwards."""
    import subprocess
    import time

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with pe.ReadyListener(tmp_path / "n.sock") as ready:
        env["NOTIFY_SOCKET"] = ready.path
        argv = [sys.executable, "-c", _NOTIFIER, "0.5" if kind == "ready" else "0.2", kind]
        proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
        try:
            t0 = time.monotonic()
            if kind == "exits":
                with pytest.raises(RuntimeError, match="kvd exited with 0"):
                    ready.wait(proc, 20)
            else:
                got = ready.wait(proc, 20 if kind == "ready" else 1.0)
                took = time.monotonic() - t0
                assert got == (kind == "ready")
                assert took >= (0.5 if kind == "ready" else 1.0)
        finally:
            proc.kill()
            proc.wait()
    assert not (tmp_path / "n.sock").exists()
