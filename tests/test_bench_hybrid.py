"""A small run of scripts/bench_hybrid.py: kvd's manager and vLLM 0.33.0's on a hybrid pool (the
vLLM column when vLLM is installed, as in CI): its checks hold, among them that both hold the same
blocks after the decode steps (their sliding windows release the same ones). Not timed."""

from __future__ import annotations

import importlib.util

from tests.test_bench_handle import run_script


def test_small_run_of_both_managers_holds_the_same_blocks_and_its_checks_hold():
    out = run_script("bench_hybrid.py", "-R", "16", "-P", "64", "--steps", "40", "--warmup", "5",
                     "--pools", "4,4:8;4,8:16")
    assert out["ok"]
    for pool in ("4,4:8", "4,8:16"):
        r = out["pools"][pool]
        assert r["kvd"]["allocs_ok"] and r["kvd"]["blocks_held_after_decode"] > 0
        if importlib.util.find_spec("vllm") is not None:
            assert r["vllm"] is not None, r["vllm_why"]
            assert out["checks"][f"{pool}: same_blocks_held_after_decode"]
            assert r["vllm"]["blocks_held_after_decode"] == r["kvd"]["blocks_held_after_decode"]
