"""A small run of scripts/bench_handle.py: it finishes, its honesty checks hold, every step kind is
reported with its split. Not timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str) -> dict:
    """Run ``scripts/<name>`` with ``args``; it must exit 0; its last line, the JSON summary."""
    p = subprocess.run([sys.executable, str(REPO / "scripts" / name), *args], cwd=str(REPO), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_small_run_reports_every_step_kind_and_its_checks_hold():
    out = run_script("bench_handle.py", "-R", "16", "--steps", "20", "--warmup", "5", "-P", "64", "-S", "40")
    assert out["ok"] and out["checks"] == {"statuses_ok": True, "pool_empty_after": True,
                                           "shared_admissions_hit_the_system_prompt": True,
                                           "hits_cover_the_prefix": True,
                                           "finish_steps_take_the_decode_free_op": True}
    assert set(out["steps"]) == {"decode", "mixed", "free", "finish", "hit"}
    for f in out["steps"].values():  # each step's client time holds its handle, which holds its manager call
        assert f["client_step_us"] >= f["handle_us"] >= f["manager_us"] > 0
