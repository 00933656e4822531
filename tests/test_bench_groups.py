"""A small run of scripts/bench_groups.py: it finishes, its honesty checks hold for each pool (every
step took its path, both daemons ended in the same state, what filled was registered) and both
paths are reported. Not timed."""

from __future__ import annotations

from tests.test_bench_handle import run_script


def test_small_run_reports_both_paths_of_each_pool_and_its_checks_hold():
    out = run_script("bench_groups.py", "-R", "16", "--steps", "20", "--warmup", "5", "-P", "64",
                     "--pools", "4;4,8;4,4:8")
    assert out["ok"]
    assert set(out["checks"]) == {f"{pool}: {c}" for pool in ("4", "4,8", "4,4:8")
                                  for c in ("statuses_ok", "op_steps_go_as_the_decode_op", "before_steps_go_as_json",
                                            "same_state", "registered_what_filled", "pools_empty_after")}
    for pool in out["pools"].values():
        assert set(pool) == {"op", "before"}
        for f in pool.values():
            assert f["client_step_us"] >= f["handle_us"] >= f["manager_us"] > 0
