"""A tiny run of scripts/bench_engine.py (CPU, float32): it finishes and its honesty checks hold
(tokens identical to HF, the cross-engine hit covers the prefix's full blocks, pools empty). Not timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[1]


def test_tiny_bench_runs_and_its_checks_hold():
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_engine.py"), "--tiny", "--batches", "4,6",
                        "--steps", "2"], cwd=str(REPO), capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["ok"] and set(out["checks"]) >= {"float32_tokens_identical", "hit_tokens_equal_prefix_blocks",
                                                 "hit_prefilled_only_suffix", "inproc_equals_daemon"}
    assert set(out["batches"]) == {"4", "6"}
    assert out["batches"]["6"]["identical_requests"] == "6/6"
    assert out["ttft"]["hit_tokens"] == 64 and out["ttft"]["hit_prefilled"] == 16
