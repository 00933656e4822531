"""Several engine PROCESSES on one daemon with a daemon-owned KV cache: cross-engine prefix hits,
and an engine SIGKILLed mid-generation costing the others nothing."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from tests.conftest_daemon import daemon_factory, short_tmp  # noqa: F401
from tests.engine_common import DAEMON, LLAMA, model_of

from kvd_client import Client  # noqa: E402
from kvd_engine import hf_generate  # noqa: E402
from kvd_engine.worker import run_worker  # noqa: E402

CTX = mp.get_context("spawn")
# one resume event per engine: a process killed while waiting on a multiprocessing Event leaves it
# unusable for set() (its condition waits for the dead sleeper to wake)
EVENTS = ("confirmed", "admitted", "hold", "paused_a", "paused_b", "paused_c", "resume_a", "resume_b", "resume_c")


def _start(specs, d):
    """Start one worker per spec; returns (processes, events, queue)."""
    events = {name: CTX.Event() for name in EVENTS}
    queue = CTX.Queue()
    procs = []
    for spec in specs:
        spec = {"endpoint": d.endpoint, "tenant": "shared", "model": dict(LLAMA, seed=0), **spec}
        p = CTX.Process(target=run_worker, args=(spec, events, queue), daemon=True)
        p.start()
        procs.append(p)
    return procs, events, queue


def _results(queue, n, timeout=120):
    out = {}
    deadline = time.monotonic() + timeout
    while len(out) < n:
        r = queue.get(timeout=max(deadline - time.monotonic(), 0.1))
        assert "error" not in r, r
        out.setdefault(r["name"], {}).update(r)
    return out


def _stop(procs):
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)


def _check_hf(results, prompts, max_new):
    model = model_of(LLAMA)
    for res in results.values():
        for rid, out in res.get("outputs", {}).items():
            assert out == hf_generate(model, prompts[rid], max_new)[0], rid


def _prompts():
    rng = np.random.default_rng(7)
    system = rng.integers(1, 512, 100).tolist()   # 12 full blocks of 8 + 4 tokens
    return system, {"a": system + rng.integers(1, 512, 9).tolist(), "b": system + rng.integers(1, 512, 6).tolist()}


def test_cross_engine_prefix_hit_after_confirmation(daemon_factory):
    d = daemon_factory(**DAEMON)
    system, prompts = _prompts()
    procs, ev, q = _start([dict(name="A", requests=[("a", prompts["a"], 8)], confirmed="confirmed", warmup=True),
                           dict(name="B", requests=[("b", prompts["b"], 8)], wait="confirmed", warmup=True)], d)
    try:
        res = _results(q, 2)
    finally:
        _stop(procs)
    assert res["A"]["cached"]["a"] == 0 and res["A"]["prefilled"]["a"] == len(prompts["a"])
    assert res["B"]["cached"]["b"] == 96  # A's 12 full system-prompt blocks
    assert res["B"]["prefilled"]["b"] == len(prompts["b"]) - 96  # only its suffix
    _check_hf(res, prompts, 8)
    print(f"TTFT without hit {res['A']['ttft']['a'] * 1e3:.1f} ms, with cross-engine hit "
          f"{res['B']['ttft']['b'] * 1e3:.1f} ms")


def test_no_hit_on_blocks_admitted_but_not_yet_computed(daemon_factory):
    d = daemon_factory(**DAEMON)
    system, prompts = _prompts()
    # A stops between the reply that admitted its prompt and that step's forward; B admits then
    procs, ev, q = _start([dict(name="A", requests=[("a", prompts["a"], 8)], admitted="admitted", hold="hold"),
                           dict(name="B", requests=[("b", prompts["b"], 8)], wait="admitted")], d)
    try:
        res = _results(q, 1)  # B finishes while A holds
        ev["hold"].set()
        res.update(_results(q, 1))
    finally:
        _stop(procs)
    assert res["B"]["cached"]["b"] == 0 and res["B"]["prefilled"]["b"] == len(prompts["b"])
    _check_hf(res, prompts, 8)


def test_sigkilled_engine_costs_the_others_nothing(daemon_factory):
    d = daemon_factory(**DAEMON)
    rng = np.random.default_rng(8)
    prompts = {f"{e}{i}": rng.integers(1, 512, int(rng.integers(10, 40))).tolist() for e in "abc" for i in range(3)}
    specs = [dict(name=e.upper(), tenant=f"t{e}", requests=[(k, p, 12) for k, p in prompts.items() if k[0] == e],
                  pause_at=4, paused=f"paused_{e}", resume=f"resume_{e}") for e in "abc"]
    procs, ev, q = _start(specs, d)
    try:
        held = _results(q, 3)  # each paused mid-generation, reporting the blocks it holds
        for e in "abc":
            assert ev[f"paused_{e}"].wait(30)
        with Client(d.endpoint, tenant="observer") as obs:
            used = obs.stats()["num_used_blocks"]
            assert used == sum(held[n]["holding"] for n in "ABC")
            os.kill(procs[2].pid, signal.SIGKILL)
            t0 = time.monotonic()
            while obs.stats()["num_used_blocks"] != used - held["C"]["holding"]:
                assert time.monotonic() - t0 < 2.0, "the killed engine's blocks are not back within 2 s"
                time.sleep(0.02)
            back_s = time.monotonic() - t0
            ev["resume_a"].set()
            ev["resume_b"].set()
            res = _results(q, 2)
            assert obs.stats()["num_used_blocks"] == 0
    finally:
        _stop(procs)
    assert set(res) == {"A", "B"}
    _check_hf(res, prompts, 12)
    print(f"killed engine's {held['C']['holding']} blocks back in {back_s * 1e3:.0f} ms")
