"""Smoke test of scripts/bench_zmq.py (wrapper of kvd.bench.zmq_bench): a tiny workload through a
real daemon it starts and stops.

Checks the final JSON line (honesty checks pass, figures present, baselines and micro mode run) and
that nothing is left behind: no daemon or client process, no /dev/shm kvd_* segment of the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_zmq.py"
TINY = ["-R", "8", "-P", "64", "-S", "32", "-D", "20", "--blocks", "512", "--repeat", "1", "--warmup", "2",
        "--no-progress"]


def _segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("kvd_")}
    except FileNotFoundError:
        return set()


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and not _is_resource_tracker(d):
            out.append(int(d))
    return out


def _is_resource_tracker(pid: str) -> bool:
    """multiprocessing's resource tracker, which lives as long as the process that started it
    (this one, when an earlier test used multiprocessing): not something a bench left behind."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def _run(args: list[str], timeout: float = 60) -> tuple[subprocess.CompletedProcess, dict]:
    before = _segments()
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=str(REPO), env=env, capture_output=True,
                       text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON line (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    report = json.loads(lines[-1])
    assert p.stdout.rstrip().splitlines()[-1] == lines[-1], "the JSON line must be the last line"
    # left behind = new segments whose daemon is gone (a test suite running beside this one may
    # have live daemons of its own)
    leaked = {n for n in _segments() - before if not os.path.exists(f"/proc/{n.split('_')[1]}")}
    assert leaked == set(), f"shared-memory segments left behind: {leaked}"
    assert _children(os.getpid()) == [], "processes left behind"
    return p, report


@pytest.mark.timeout(60)
def test_standard_workload_two_clients_with_baselines():
    p, report = _run([*TINY, "--clients", "1,2", "--floor", "--floor-iters", "200", "--inproc"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert report["ok"] is True and all(report["honest"].values()), report["honest"]
    for n in ("1", "2"):
        r = report["results"][n]
        assert r["errors"] == 0 and r["slot_mapping_ok"] and r["pool_free_after"]
        assert r["prefix_hit_tokens"] == r["expected_prefix_hit_tokens"] > 0
        assert r["peak_blocks_used"] == r["expected_blocks_after_decode"]
        assert r["decode_step_p50_us"] > 0 and r["decode_steps_per_s"] > 0
        # D = 20 from 64 tokens: growth at steps 0 and 16, registering at 15, the rest plain
        assert all(r[f"decode_step_{k}_p50_us"] > 0 for k in ("plain", "growth", "register"))
        assert r["decode_first_step_us"] > 0
        assert len(r["per_client"]) == int(n)
        assert r["daemon_cpu_per_step_us"] > 0
    # 2 clients: 4 sharers each, admitted at once: each client's first sharer computes the 32-token
    # system prompt (2 blocks); no client can hit blocks another engine has not yet written
    assert report["results"]["2"]["expected_prefix_hit_tokens"] == 2 * (4 - 1) * 32
    assert report["floor"]["echo_p50_us"] > 0 and report["inproc"]["inproc_step_p50_us"] > 0
    # the floor waits as the clients and the daemon do (their defaults here); the sleeping echo beside it
    from kvd_client.client import default_busy_poll_us
    assert report["floor"]["echo_client_poll_us"] == default_busy_poll_us()
    assert report["floor"]["echo_server_poll_us"] == 5000
    assert report["floor"]["echo_sleeping_p50_us"] > 0
    assert len(report["floor"]["runs_echo_p50_us"]) == 2  # one floor after each run (1 and 2 clients)
    assert set(report["ratios"]) == {"c1_step_p50_over_inproc", "c1_step_p50_over_echo", "c1_extra_us",
                                     "c2_step_p50_over_inproc", "c2_step_p50_over_echo", "c2_extra_us",
                                     "c2_steps_per_s_over_echo_c2"}
    # the 2-client echo floor: both clients' round trips at once against one echo server
    assert report["floor"]["echo_c2_msgs_per_s"] > 0 and report["floor"]["echo_c2_worst_p99_us"] > 0
    assert set(report["targets"]) == {"c1_extra_le_25us_plus_5pct_inproc", "c1_p99_le_2x_p50"}
    assert report["daemon_exit"] == 0


@pytest.mark.timeout(60)
def test_micro_mode_forces_no_space():
    p, report = _run(["--micro", "--micro-ops", "300", "--blocks", "128", "-R", "16", "-S", "64", "-P", "256",
                      "--repeat", "1", "--no-progress"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = report["results"]["1"]
    assert r["ops"] == 300 and r["ops_per_s"] > 0 and r["pool_free_after"] and r["errors"] == 0
    assert r["allocate_later"] + r["allocate_never"] + r["append_no_space"] > 0, r


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.timeout(90)
def test_a_killed_client_fails_the_run_at_once():
    """A client killed by a signal never reaches the phase barrier: the run fails within seconds
    (not after the barrier's 600 s timeout) and still stops the daemon."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    bench = subprocess.Popen([sys.executable, str(SCRIPT), "-R", "8", "-P", "64", "-S", "32", "-D", "50000",
                              "--blocks", "512", "--repeat", "1", "--warmup", "0", "--no-progress"],
                             cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client = None
        deadline = time.monotonic() + 60
        while client is None and time.monotonic() < deadline:
            kids = [p for p in _children(bench.pid) if "spawn_main" in _cmdline(p)
                    and "resource_tracker" not in _cmdline(p)]
            client = kids[0] if kids else None
            time.sleep(0.2)
        assert client is not None, "no client process appeared"
        time.sleep(2)  # in the decode phase (50,000 steps take more than 5 s) or before it: either way no barrier
        os.kill(client, signal.SIGKILL)
        t0 = time.monotonic()
        out, err = bench.communicate(timeout=30)
        assert time.monotonic() - t0 < 15
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.communicate()
    assert bench.returncode == 1 and "a client failed" in err, err[-2000:]
    assert _children(os.getpid()) == []


def test_the_echo_floor_waits_as_the_client_and_the_daemon_do(monkeypatch):
    from types import SimpleNamespace

    import kvd_client.client as C
    from kvd.bench.zmq_bench import floor_polls

    monkeypatch.setattr(C.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("KVD_BUSY_POLL_US", raising=False)
    args = SimpleNamespace(client_busy_poll_us=None, daemon_arg=[])
    assert floor_polls(args) == (0.001, 0.005)  # the Client's default on 2 CPUs, the daemon's config default
    monkeypatch.setattr(C.os, "sched_getaffinity", lambda pid: {0})
    assert floor_polls(args) == (0.0, 0.005)
    args = SimpleNamespace(client_busy_poll_us=250, daemon_arg=["--log-level", "info", "--busy-poll-us=0"])
    assert floor_polls(args) == (0.00025, 0.0)
    args = SimpleNamespace(client_busy_poll_us=0, daemon_arg=["--busy-poll-us", "2000"])
    assert floor_polls(args) == (0.0, 0.002)
    monkeypatch.setenv("KVD_BUSY_POLL_US", "300")  # the daemon the bench starts inherits it; a flag wins
    assert floor_polls(args) == (0.0, 0.002)
    assert floor_polls(SimpleNamespace(client_busy_poll_us=0, daemon_arg=[])) == (0.0, 0.0003)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs")
def test_bench_wakeup_runs_every_mode_and_checks_its_echoes():
    cpus = sorted(os.sched_getaffinity(0))
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_wakeup.py"), "--iters", "5", "--rounds", "1",
                        "--gap-ms", "0,1"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["cpus"] == [cpus[-1], cpus[-2]]
    assert set(out["rows"]) == {f"{m}@{g}ms" for m in ("floating", "server", "both") for g in (0, 1)}
    assert all(r["n"] == 5 and 0 < r["p50_us"] <= r["p90_us"] for r in out["rows"].values())
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_wakeup.py"), "--cpus", f"{cpus[0]},{cpus[0]}"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "two different CPUs" in bad.stderr
