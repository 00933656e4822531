"""Packaging: the wheel, installed alone in a fresh virtual environment (base dependencies only:
numpy, pyzmq, orjson; no torch, triton, numba), serves a daemon, talks to it with the client and
runs ``kvd bench --help`` and ``kvd status``.

Takes its dependencies (numpy, pyzmq, orjson; setuptools for the build) from PyPI, as CI can.
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

CLIENT_SCRIPT = r"""
import sys
import numpy as np
from kvd.api import StepBatch
from kvd_client import Client

with Client(sys.argv[1], name="wheel-test") as c:
    r = c.allocate("a", 20)
    assert r.ok, r
    t = c.block_table("a")
    assert c.slot_mappings[0][:20].tolist() == [int(t[p // 16]) * 16 + p % 16 for p in range(20)]
    res = c.step(StepBatch(append_rows=np.array([c.row_of("a")], np.int32)))
    assert res.sched_start.tolist() == [20] and res.append_status.tolist() == [0]
    c.free("a")
    assert c.stats()["num_used_blocks"] == 0
print("CLIENT OK")
"""


def _run(argv, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, capture_output=True, text=True, **kw)
    assert p.returncode == 0, f"{argv}: rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_without_torch():
    tmp = Path(tempfile.mkdtemp(prefix="kvdw", dir="/tmp"))
    daemon = None
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVD_", "PYTHON", "VIRTUAL_ENV"))}
        env.pop("NOTIFY_SOCKET", None)
        _run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-q", "-w", str(tmp / "dist")],
             env=env, timeout=600)
        wheel = next((tmp / "dist").glob("kvd-*.whl"))
        _run([sys.executable, "-m", "venv", str(tmp / "venv")], env=env, timeout=300)
        py, kvd = str(tmp / "venv" / "bin" / "python"), str(tmp / "venv" / "bin" / "kvd")
        _run([py, "-m", "pip", "install", "-q", str(wheel)], env=env, timeout=600, cwd=str(tmp))
        absent = _run([py, "-c", "import importlib.util as u; print([m for m in ('torch', 'triton', 'numba', "
                                 "'prometheus_client', 'msgpack', 'xxhash') if u.find_spec(m)])"],
                      env=env, cwd=str(tmp))
        assert absent.stdout.strip() == "[]"
        base = _run([py, "-c", "import importlib.metadata as m; print(sorted(r.split('>')[0] for r in "
                               "m.requires('kvd') if 'extra ==' not in r))"], env=env, cwd=str(tmp))
        assert base.stdout.strip() == "['numpy', 'orjson', 'pyzmq']"
        meta = _run([py, "-c", "import importlib.metadata as m, importlib.util as u, pathlib; d = m.distribution('kvd'); "
                               "print(sorted(d.metadata.get_all('Project-URL'))[0]); "
                               "print(any(f.name == 'LICENSE' for f in d.files)); "
                               "print(all((pathlib.Path(u.find_spec(p).origin).parent / 'py.typed').is_file() "
                               "for p in ('kvd', 'kvd_client', 'kvd_kernels')))"], env=env, cwd=str(tmp))
        assert meta.stdout.split("\n")[:3] == ["Documentation, https://github.com/kvd-project/kvd/blob/main/README.md",
                                               "True", "True"]
        help_ = _run([kvd, "bench", "--help"], env=env, cwd=str(tmp), timeout=120)
        assert "--clients" in help_.stdout

        run_dir = tmp / "run"
        daemon = subprocess.Popen(
            [kvd, "serve", "--runtime-dir", str(run_dir), "--num-gpu-blocks", "256", "--max-num-reqs", "16",
             "--max-reqs-per-session", "8", "--max-num-batched-tokens", "256", "--max-model-len", "512",
             "--log-level", "warning"], env=env, cwd=str(tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)  # fmt: skip
        sock = run_dir / "kvd.sock"
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert daemon.poll() is None, daemon.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "daemon did not start"
            time.sleep(0.05)
        out = _run([py, "-c", CLIENT_SCRIPT, f"ipc://{sock}"], env=env, cwd=str(tmp), timeout=120)
        assert "CLIENT OK" in out.stdout
        status = _run([kvd, "status", "--runtime-dir", str(run_dir)], env=env, cwd=str(tmp), timeout=60)
        assert status.stdout.splitlines()[2].split()[:4] == ["gpu", "255", "255", "0"]
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0
        assert "numba is not installed" in daemon.communicate()[1]  # the plain-Python loops, said once
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.kill()
            daemon.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
