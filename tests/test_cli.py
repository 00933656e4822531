"""The kvd command: --version, --help, serve/status/bench dispatch, exit codes; status against a
real daemon (skipped until kvd.server.serve exists)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types

import pytest

import kvd
from kvd import cli
from kvd.config import ServeConfig


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvd {kvd.__version__}"


def test_python_dash_m_kvd_version():
    out = subprocess.run([sys.executable, "-m", "kvd", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"kvd {kvd.__version__}"


def test_help_reads_well(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for word in ("serve", "status", "bench", "--version", "KVD_<KEY>"):
        assert word in out
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--num-gpu-blocks" in out and "KVD_NUM_GPU_BLOCKS" in out and "--config" in out
    assert max(len(line) for line in out.splitlines()) <= 100


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "serve" in capsys.readouterr().err


def fake_module(monkeypatch, name: str, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, mod)
    if "." in name:
        parent, child = name.rsplit(".", 1)
        monkeypatch.setattr(sys.modules[parent], child, mod, raising=False)
    return mod


def test_serve_calls_server_with_the_effective_config(monkeypatch, tmp_path):
    seen = []
    fake_module(monkeypatch, "kvd.server", serve=lambda cfg: seen.append(cfg) or 0)
    path = tmp_path / "kvd.toml"
    path.write_text("num_cpu_blocks = 64\nblock_size = 8\n")
    monkeypatch.setenv("KVD_BLOCK_SIZE", "32")
    monkeypatch.setattr(cli, "setup_logging", lambda level: None)
    assert cli.main(["serve", "--config", str(path), "--max-sessions", "3"]) == 0
    (cfg,) = seen
    assert isinstance(cfg, ServeConfig)
    assert (cfg.num_cpu_blocks, cfg.block_size, cfg.max_sessions) == (64, 32, 3)


def test_serve_passes_the_exit_code(monkeypatch):
    fake_module(monkeypatch, "kvd.server", serve=lambda cfg: 5)
    monkeypatch.setattr(cli, "setup_logging", lambda level: None)
    assert cli.main(["serve"]) == 5


def test_bad_config_exits_78_naming_the_key(monkeypatch, capsys):
    fake_module(monkeypatch, "kvd.server", serve=lambda cfg: pytest.fail("must not start"))
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert cli.main(["serve", "--hash-algo", "md5"]) == cli.EXIT_CONFIG
    assert "'hash_algo'" in capsys.readouterr().err


STATS = {
    "pools": {
        "gpu": dict(num_blocks=1000, num_free_blocks=600, num_used_blocks=400, num_cached_blocks=100,
                    prefix_queries=10, prefix_hits=4, evictions=3, swaps_out=2, swaps_in=1, cow_copies=5),
    },
    "sessions": [{"id": "abc", "name": "engine-0", "reqs": 7}],
}  # fmt: skip

DAEMON_STATUS = {  # the daemon's `status` answer (kvd.protocol)
    "daemon": {"pid": 4242, "epoch": "e0e0", "lease_s": 1.5, "steps": 17},
    "pool": dict(STATS["pools"]["gpu"], usage=0.4, hit_rate=0.4, num_requests=9, num_cpu_blocks=0,
                 num_free_cpu_blocks=0),
    "sessions": [
        {"name": "engine-0", "pid": 11, "tenant": "alice", "requests": 7, "idle_s": 0.1},
        {"name": "engine-1", "pid": 12, "tenant": "", "requests": 2, "idle_s": 0.25},
        {"name": "kvd status", "pid": os.getpid(), "tenant": "", "requests": 0, "idle_s": 0.0},
    ],
    "tenants": [{"tenant": "", "sessions": 2, "requests": 2, "block_refs": 3},
                {"tenant": "alice", "sessions": 1, "requests": 7, "block_refs": 400}],
}  # fmt: skip


def test_status_uses_the_resolved_endpoint(monkeypatch, capsys, tmp_path):
    calls = []

    class FakeClient:
        def __init__(self, endpoint, **kw):
            calls.append((endpoint, kw))

        def daemon_status(self):
            return DAEMON_STATUS

        def close(self):
            calls.append("closed")

    fake_module(monkeypatch, "kvd_client", Client=FakeClient)
    (tmp_path / "kvd.sock").touch()
    assert cli.main(["status", "--runtime-dir", str(tmp_path)]) == 0
    assert calls == [(f"ipc://{tmp_path}/kvd.sock", {"name": "kvd status", "heartbeat": False}), "closed"]
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"kvd at ipc://{tmp_path}/kvd.sock (pid 4242, epoch e0e0, steps 17)"
    assert out[2].split()[:7] == ["gpu", "1000", "600", "400", "100", "40.0%", "40.0%"]
    i = out.index("sessions: 2")  # this command's own session is left out
    assert out[i + 1].split() == ["name", "pid", "tenant", "requests", "idle", "s"]
    assert out[i + 2].split() == ["engine-0", "11", "alice", "7", "0.1"]
    assert out[i + 3].split() == ["engine-1", "12", "''", "2", "0.25"]
    j = out.index("tenants: 2")
    assert out[j + 2].split() == ["''", "1", "2", "3"] and out[j + 3].split() == ["alice", "1", "7", "400"]
    assert cli.main(["status", "--runtime-dir", str(tmp_path), "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["pools"]["gpu"] == STATS["pools"]["gpu"] and js["daemon"]["steps"] == 17
    assert [s["name"] for s in js["sessions"]] == ["engine-0", "engine-1"]
    assert js["tenants"][0] == {"tenant": "", "sessions": 1, "requests": 2, "block_refs": 3}


def test_status_accepts_a_flat_stats_dict():
    flat = dict(STATS["pools"]["gpu"], usage=0.4, hit_rate=0.4, num_cpu_blocks=64, num_free_cpu_blocks=60,
                sessions=2, num_requests=9)  # fmt: skip
    norm = cli.normalize_stats(flat)
    assert norm["pools"]["gpu"] == STATS["pools"]["gpu"]
    assert norm["pools"]["cpu"] == {"num_blocks": 64, "num_free_blocks": 60, "num_used_blocks": 4}
    assert norm["sessions"] == 2 and norm["num_requests"] == 9
    assert cli.normalize_stats(STATS) is STATS
    text = cli.format_status_table(norm, "ipc:///x")
    assert "sessions: 2" in text and "num_requests: 9" in text


def test_status_unreachable(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "SYSTEM_SOCKET", str(tmp_path / "none"))
    assert cli.main(["status", "--runtime-dir", str(tmp_path)]) == cli.EXIT_UNREACHABLE
    assert "no daemon socket" in capsys.readouterr().err

    class DeadClient:
        def __init__(self, endpoint, **kw):
            pass

        def daemon_status(self):
            raise TimeoutError("no reply")

    fake_module(monkeypatch, "kvd_client", Client=DeadClient)
    (tmp_path / "kvd.sock").touch()
    assert cli.main(["status", "--runtime-dir", str(tmp_path)]) == cli.EXIT_UNREACHABLE
    assert "no reply" in capsys.readouterr().err


def test_bench_forwards_arguments(monkeypatch, tmp_path, capsys):
    script = tmp_path / "bench_zmq.py"
    script.write_text(
        "import sys\n"
        "def main(argv=None):\n"
        "    print('ARGS', argv, sys.argv[1:])\n"
        "    return 7\n"
    )
    monkeypatch.setenv("KVD_BENCH_SCRIPT", str(script))
    assert cli.main(["bench", "--steps", "10", "--help"]) == 7
    out = capsys.readouterr().out
    assert "ARGS ['--steps', '10', '--help'] ['--steps', '10', '--help']" in out
    script.write_text("import argparse\ndef main():\n    argparse.ArgumentParser().parse_args()\n")
    assert cli.main(["bench", "--nope"]) == 2  # the benchmark's own argparse error


def test_bench_without_script(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KVD_BENCH_SCRIPT", str(tmp_path / "missing.py"))
    assert cli.main(["bench"]) == 1
    assert "not found" in capsys.readouterr().err


def test_default_bench_is_the_packaged_one(monkeypatch, capsys):
    monkeypatch.delenv("KVD_BENCH_SCRIPT", raising=False)
    assert cli._bench_script() is None
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--clients" in out and "--endpoint" in out  # kvd.bench.zmq_bench's own parser


# ---------------------------------------------------------------------------------------------------
# Integration: kvd status against a real daemon


def test_status_against_a_real_daemon():
    try:
        import kvd.server as server
    except ImportError as exc:
        pytest.skip(f"kvd.server not importable yet: {exc}")
    if not hasattr(server, "serve"):
        pytest.skip("kvd.server has no serve() yet")
    pytest.importorskip("kvd_client")

    tmp = tempfile.mkdtemp(prefix="kvds-", dir="/tmp")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    proc = None
    try:
        notify.bind(os.path.join(tmp, "n"))
        runtime_dir = os.path.join(tmp, "run")
        os.mkdir(runtime_dir)
        env = dict(os.environ, NOTIFY_SOCKET=os.path.join(tmp, "n"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvd", "serve", "--device", "cpu", "--runtime-dir", runtime_dir,
             "--num-gpu-blocks", "512", "--num-cpu-blocks", "64", "--max-num-reqs", "32",
             "--max-reqs-per-session", "16", "--max-sessions", "4", "--max-num-batched-tokens", "128",
             "--max-model-len", "512", "--log-level", "warning"],
            env=env,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while True:
            notify.settimeout(max(deadline - time.monotonic(), 0.01))
            if "READY=1" in notify.recv(65536).decode().splitlines():
                break
        out = subprocess.run(
            [sys.executable, "-m", "kvd", "status", "--runtime-dir", runtime_dir, "--json"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        stats = json.loads(out.stdout)
        gpu = stats["pools"]["gpu"]
        assert gpu["num_blocks"] in (511, 512)  # with or without the null block
        for key in ("num_free_blocks", "num_used_blocks", "num_cached_blocks", "prefix_queries", "prefix_hits",
                    "evictions", "swaps_out", "swaps_in", "cow_copies"):  # fmt: skip
            assert key in gpu, key
        assert stats["sessions"] == [] and stats["tenants"] == []  # its own session left out
        assert stats["daemon"]["pid"] == proc.pid
        human = subprocess.run(
            [sys.executable, "-m", "kvd", "status", "--runtime-dir", runtime_dir],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert human.returncode == 0 and "gpu" in human.stdout, human.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        notify.close()
        shutil.rmtree(tmp, ignore_errors=True)
