"""A small run of scripts/bench_idle.py: it finishes, its honesty checks hold, every mode is reported
with its split, and it leaves no shared memory behind. Not timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _kvd_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("kvd_*")} if Path("/dev/shm").is_dir() else set()


def test_small_run_reports_every_mode_and_its_checks_hold():
    before = _kvd_segments()
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_idle.py"), "--rounds", "4", "--warmup", "1",
                        "--idle-ms", "0.3", "--warm-every-ms", "0.1", "--prefix", "64"], cwd=str(REPO),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["checks"] == {"statuses_ok": True, "every_hit_is_the_prefix": True,
                                           "pools_empty_after": True}
    assert list(out["modes"]) == ["back_to_back", "polled", "polled_warm", "spun"]
    assert set(out["ratios"]) == {"polled_over_back_to_back", "polled_warm_over_back_to_back", "spun_over_back_to_back"}
    for f in out["modes"].values():  # each admission's client time holds its handle, which holds its manager step
        assert f["client_step_p90_us"] >= f["client_step_p50_us"] >= f["handle_p50_us"]
        assert f["handle_p50_us"] > f["manager_p50_us"] > 0
    assert _kvd_segments() <= before  # both daemons' sessions ended: their segments are gone


def test_prefix_must_be_whole_blocks():
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_idle.py"), "--prefix", "70"], cwd=str(REPO),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "multiple of --block-size" in p.stderr
