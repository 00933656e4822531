"""A tiny run of scripts/bench_engine.py (CPU, float32): it finishes and its honesty checks hold
(tokens identical to HF, the cross-engine hit covers the prefix's full blocks, pools empty). Not timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from kvd_client.client import DEFAULT_BUSY_POLL_US  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_tiny_bench_runs_and_its_checks_hold():
    cpus = sorted(os.sched_getaffinity(0))
    pin = ["--pin"] if len(cpus) >= 2 else []  # the daemon on the last CPU, the engine on the one before
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_engine.py"), "--tiny", "--batches", "4,6",
                        "--steps", "2", "--steps-per-message", "3", *pin], cwd=str(REPO), capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["ok"] and set(out["checks"]) >= {"float32_tokens_identical", "hit_tokens_equal_prefix_blocks",
                                                 "hit_prefilled_only_suffix", "inproc_equals_daemon",
                                                 "windows_equal_daemon", "pool_empty_after_6_windows_3"}
    # the windowed run: 5 tokens a request (the prefill's, 2 untimed and 2 timed steps); the generic
    # first decode step sends one window of the last 3, with which they finish (nothing left to register)
    assert out["steps_per_message"] == [3] and set(out["batches"]["6"]["daemon_windows"]) == {"3"}
    assert out["batches"]["6"]["daemon_windows"]["3"]["messages"] == 1
    assert set(out["batches"]) == {"4", "6"}
    assert out["batches"]["6"]["identical_requests"] == "6/6"
    assert out["ttft"]["hit_tokens"] == 64 and out["ttft"]["hit_prefilled"] == 16
    assert out["pinned_cpus"] == ({"daemon": cpus[-1], "engine": cpus[-2]} if pin else None)
    # an engine with a CPU of its own polls for its replies (the client's default polling time)
    assert out["client_busy_poll_us"] == (DEFAULT_BUSY_POLL_US if pin else None)
    assert out["daemon_busy_poll_us"] == 20000 and out["daemon_warm_every_us"] == 2000  # kvd serve's default


def test_decode_run_counts_only_the_timed_steps():
    """kvd's round trips and metadata in the figures are those of the timed steps: the frees that
    ``run()`` sends after the wall clock stopped (the finished batch) are not in them."""
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_engine
    import torch

    class Counting:
        kvd_s = meta_s = kvd_exposed_s = meta_exposed_s = kvd_wall_s = 0.0
        steady_steps = ahead_steps = prehashed_blocks = 0
        graphs = None
        reqs: dict = {}
        phases: dict = {}

        def __init__(self):
            self.sends_s, self.takes_s = [0.5], [0.5]  # a message before the timed steps: not in the figures
            self.calls = 0

        def step(self):
            self.calls += 1
            self.sends_s.append(1e-5 * self.calls)  # 10, 20 µs in the two untimed steps, then 30 .. 60
            self.takes_s.append(4e-5)
            self.kvd_s += 0.001
            self.kvd_wall_s += 0.003
            self.kvd_exposed_s += 0.0002
            self.meta_s += 0.0005
            self.steady_steps += 1
            self.phases = {"rt_exposed": 0.0002}

        def run(self):  # the batch's frees, after the timed steps
            self.sends_s.append(1.0)
            self.kvd_s += 1.0
            self.kvd_wall_s += 1.0
            self.kvd_exposed_s += 1.0
            self.meta_exposed_s += 1.0

    out = bench_engine._decode_run(Counting(), {}, 4, torch.device("cpu"))
    assert out["round_trip_ms"] == pytest.approx(1.0) and out["round_trip_wall_ms"] == pytest.approx(3.0)
    assert out["round_trip_exposed_ms"] == pytest.approx(0.2)
    assert out["meta_ms"] == pytest.approx(0.5) and out["meta_exposed_ms"] == 0.0
    assert out["steady_steps"] == 4
    assert out["ahead_messages_timed"] == 4
    assert out["ahead_send_us_p50_max"] == [45.0, 60.0] and out["ahead_take_us_p50_max"] == [40.0, 40.0]
    assert out["overlap_exposed_ms_p50_p99_max"] == [0.2, 0.2, 0.2]


def test_tiny_bench_of_the_hybrid_model():
    """--window: the hybrid model (a sliding window on even layers) on two KV-cache groups, kvd's
    window 2 tokens longer; its decode runs past the window (16-token prompts + 9 tokens > 8), with
    a message per step and windows of 3: HF's tokens, the same tokens from every engine, pools empty."""
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_engine.py"), "--tiny", "--window", "8",
                        "--batches", "4", "--steps", "6", "--steps-per-message", "3", "--no-pin"], cwd=str(REPO),
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["ok"] and (out["model"], out["window"], out["kvd_window"]) == ("hybrid", 8, 10)
    assert out["checks"]["float32_tokens_identical"] and out["checks"]["windows_equal_daemon"]
    run = out["batches"]["4"]
    assert run["identical_requests"] == "4/4" and run["daemon"]["steady_steps"] == 6
    assert run["daemon_windows"]["3"]["messages"] < run["daemon"]["steps_sent_ahead"]
