"""A small run of scripts/bench_finish.py: it finishes, its honesty checks hold (every timed step
took its path: the decode_free op or the JSON step) and both kinds are reported. Not timed."""

from __future__ import annotations

from tests.test_bench_handle import run_script


def test_small_run_reports_both_kinds_on_both_paths_and_its_checks_hold():
    out = run_script("bench_finish.py", "-R", "8", "--chunks", "2", "--chunk", "4", "-P", "64", "--pause-us", "0")
    assert out["ok"] and out["checks"] == {"statuses_ok": True, "timed_steps_take_their_path": True,
                                           "pool_empty_after": True}
    assert set(out["figures"]) == {f"{kind}_{path}_{q}_us" for kind in ("finish", "mixed")
                                   for path in ("json_step", "decode_free") for q in ("p50", "p90")}
    assert all(v > 0 for v in out["figures"].values())
