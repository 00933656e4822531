"""``kvd bench --scale`` (kvd.bench.scaling): a tiny scaling table through real daemons, the zmq echo,
the in-process manager and, where vLLM is installed, vLLM's manager in its own process.

No timing is asserted: the run's figures must be present and consistent with each other, every
backend must reproduce the workload's exact prefix hits and blocks in use, nothing may be left behind.
The vLLM column is checked where vLLM is installed, and its n/a path with a vLLM that fails to import.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_bench_zmq import _children, _segments

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_zmq.py"
TINY = ["-R", "8", "-P", "64", "-S", "32", "-D", "20", "--blocks", "512", "--repeat", "1", "--warmup", "2",
        "--floor-iters", "200", "--no-progress"]
# R=8: 4 sharers, the first computes the 2-block system prompt, 3 hit it; ceil(84 / 16) = 6 blocks each.
# R=16: 8 sharers, 7 hit.
EXPECTED = {"8": (3 * 32, 8 * 6 - 3 * 2), "16": (7 * 32, 16 * 6 - 7 * 2)}
COLUMNS = ("inproc", "daemon", "echo", "vllm")


def _run(args: list[str], pythonpath_first: str = "", timeout: float = 240) -> tuple[subprocess.CompletedProcess, dict]:
    before = _segments()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath_first, str(REPO), env.get("PYTHONPATH", "")) if p)
    p = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=str(REPO), env=env, capture_output=True,
                       text=True, timeout=timeout)
    lines = p.stdout.rstrip().splitlines()
    assert lines and lines[-1].startswith("{"), f"rc {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    leaked = {n for n in _segments() - before if not os.path.exists(f"/proc/{n.split('_')[1]}")}
    assert leaked == set(), f"shared-memory segments left behind: {leaked}"
    assert _children(os.getpid()) == [], "processes left behind"
    return p, json.loads(lines[-1])


def _check_row(R: str, row: dict, checks: dict, vllm: bool) -> None:
    for col in COLUMNS[:3] + (COLUMNS[3:] if vllm else ()):
        assert row[f"{col}_p50_us"] > 0 and row[f"{col}_p99_us"] >= row[f"{col}_p50_us"], (col, row)
    d, e, i = row["daemon_p50_us"], row["echo_p50_us"], row["inproc_p50_us"]
    # one repetition: the per-run figures are the reported ones
    assert row["runs_daemon_p50_us"] == [round(d, 1)]
    assert row["runs_echo_p50_us"] == [round(e, 1)]
    assert 0 < row["echo_sleeping_p50_us"]  # the sleeping echo beside the one that waits as kvd does
    assert math.isclose(row["extra_us"], d - e - i, rel_tol=1e-9, abs_tol=1e-9)
    assert math.isclose(row["daemon_over_inproc"], d / i, rel_tol=1e-9)
    assert math.isclose(row["extra_budget_us"], 25 + 0.05 * i, rel_tol=1e-9)
    assert row["blocks"] == 512 * int(R) // 8
    hits, blocks = EXPECTED[R]
    assert (checks["expected_prefix_hit_tokens"], checks["expected_blocks_after_decode"]) == (hits, blocks)
    for col in ("daemon", "inproc") + (("vllm",) if vllm else ()):
        assert checks[f"{col}_prefix_hit_tokens"] == [hits], col
        assert checks[f"{col}_peak_blocks_used"] == [blocks], col
    if vllm:
        assert math.isclose(row["vllm_over_inproc"], row["vllm_p50_us"] / i, rel_tol=1e-9)
        assert math.isclose(row["vllm_over_daemon"], row["vllm_p50_us"] / d, rel_tol=1e-9)
    else:
        assert row["vllm_p50_us"] is None and row["vllm_over_inproc"] is None and row["vllm_over_daemon"] is None
        assert checks["vllm_prefix_hit_tokens"] == []


@pytest.mark.timeout(300)
def test_scale_table_every_column_honest(tmp_path):
    has_vllm = importlib.util.find_spec("vllm") is not None
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    png = tmp_path / "scale.png"
    p, report = _run([*TINY, "--scale", "8,16", "--plot", str(png)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert report["bench"] == "scale" and report["config"]["R"] == [8, 16]
    assert report["ok"] is True and all(report["honest"].values()), report["honest"]
    assert report["vllm"]["available"] is has_vllm, report["vllm"]
    for R in ("8", "16"):
        _check_row(R, report["table"][R], report["checks"][R], has_vllm)
        for name in ("daemon_all_admitted", "daemon_hits_match", "daemon_blocks_match", "daemon_pool_free_after",
                     "daemon_no_errors", "daemon_slot_mapping_ok", "inproc_honest", "daemon_clean_exit"):
            assert report["honest"][f"R{R}_{name}"] is True, name
        assert (f"R{R}_vllm_hits_match" in report["honest"]) is has_vllm
    row8 = report["table"]["8"]
    assert report["targets"] == {
        f"R{R}_{k}": v for R in ("8", "16") for k, v in (
            ("extra_le_25us_plus_5pct", report["table"][R]["extra_us"] <= report["table"][R]["extra_budget_us"]),
            ("p99_le_2x_p50", report["table"][R]["daemon_p99_us"] <= 2 * report["table"][R]["daemon_p50_us"]))}
    # the Markdown table the README shows: one line per R, n/a only where vLLM is missing
    line8 = next(ln for ln in p.stdout.splitlines() if ln.startswith("| 8 |"))
    assert f"{row8['daemon_over_inproc']:,.2f}" in line8 and ("n/a" in line8) is (not has_vllm)
    if has_mpl:
        assert report["plot"] == {"path": str(png), "written": True}
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert report["plot"]["written"] is False and "matplotlib" in report["plot"]["why"]
        assert not png.exists() and "--plot skipped" in p.stderr


@pytest.mark.timeout(120)
def test_scale_without_vllm_says_why(tmp_path):
    shadow = tmp_path / "shadow"
    (shadow / "vllm").mkdir(parents=True)
    (shadow / "vllm" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    p, report = _run([*TINY, "--scale", "8"], pythonpath_first=str(shadow))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert report["vllm"] == {"available": False,
                              "why": "vLLM is not importable: ImportError: hidden by the test"}
    assert report["ok"] is True and not any("vllm" in k for k in report["honest"])
    _check_row("8", report["table"]["8"], report["checks"]["8"], vllm=False)
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("| 8 |"))
    assert "| n/a / n/a |" in line and line.rstrip().endswith("| n/a | n/a |")
    assert "plot" not in report


@pytest.mark.timeout(60)
def test_scale_failure_still_ends_with_the_json_line():
    before = set(glob.glob("/tmp/kvdb*"))
    p, report = _run([*TINY, "--scale", "8", "--no-vllm", "--daemon-arg=--no-such-option"])
    assert set(glob.glob("/tmp/kvdb*")) <= before  # the failed daemon's runtime directory is gone too
    assert p.returncode == 1
    assert report["ok"] is False and report["table"] == {} and "daemon exited with 2" in report["error"]
    assert report["vllm"] == {"available": False, "why": "disabled (--no-vllm)"}


@pytest.mark.parametrize("extra, message", [
    (["--clients", "4"], "--clients 4"),
    (["--endpoint", "ipc:///nonexistent"], "no --endpoint"),
    (["--micro"], "no --micro"),
])
def test_scale_refuses_what_it_cannot_measure(extra, message):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, str(SCRIPT), "--scale", *extra], cwd=str(REPO), env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and message in p.stderr and p.stdout == ""
    assert _children(os.getpid()) == []
