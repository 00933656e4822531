#!/usr/bin/env python3
"""What polling between messages costs the next one: a cross-session prefix hit's admission (the
time-to-first-token step of issue 11) through ``Daemon.handle`` in one process, no sockets.

Each round, session A admits a fresh ``--prefix`` + 16-token prompt and confirms it (its blocks
become hits for B), then session B admits the same prefix with another tail, timed, in one of three
ways (the modes alternate round by round, so a host's drift spreads over all three):

* ``back_to_back``: B's admission right after A's messages (the hot path just ran);
* ``polled``: first ``--idle-ms`` of what the daemon and a blocking client do while they wait for a
  message: ``kvd.protocol.busy_poll`` (``has_input`` and ``sched_yield``) on a ZeroMQ socket;
* ``polled_warm``: the same polling, with a warm pass every ``--warm-every-ms``: a shadow daemon (its
  own manager, sessions and shared memory) runs the same kind of hit admission and frees it;
* ``spun``: the same idle time spent in a native loop that reads one word and makes no call (numba,
  ``kvd[fast]``; without numba a bare Python loop): no interpreter, no system call while waiting.

A round's B admission is split as in ``bench_handle.py``: the client core's ``step``, the daemon's
``handle`` in it, the manager's ``step`` in that. What ``polled`` adds over ``back_to_back`` is the
state the loop leaves behind (caches, branch predictors: nothing of kvd's data changes meanwhile),
the part of the round trip in situ that neither the transport nor the warm code explains; what
``polled_warm`` takes back is what keeping the path warm could. ``spun`` against ``polled`` says
whether that state is the waiting loop's doing or the idle time's (the box, session 24: the same
for both at every idle time, and growing with it: +3 % after 0.2 ms, +30 % after 2, +70-100 % after 8).

Medians in µs; ONE final JSON line with the figures and honesty checks (every B admission hit the
prefix's whole blocks, every status OK, both pools empty at the end). Exit 1 if a check fails.

    python scripts/bench_idle.py                          # 60 rounds of each, 2 ms idle
    python scripts/bench_idle.py --rounds 5 --idle-ms 0.2 --prefix 64   # a quick run (a test)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvd.manager as M  # noqa: E402
from bench_handle import _InProc  # noqa: E402
from kvd import protocol as P  # noqa: E402
from kvd.api import AdmitRequest, StepBatch  # noqa: E402
from kvd.server import Daemon  # noqa: E402

MODES = ("back_to_back", "polled", "polled_warm", "spun")
TAIL = 16  # tokens after the shared prefix


class _Pair:
    """A daemon and two sessions of one tenant: A computes a prefix, B hits it."""

    def __init__(self, args, vocab_rng):
        tokens = args.prefix + TAIL
        blocks = 8 * (tokens // args.block_size + 2)  # room for a few prompts: nothing is ever refused
        self.d = Daemon(type("Cfg", (), dict(block_size=args.block_size, num_gpu_blocks=blocks, max_model_len=tokens,
                                             max_num_reqs=8, max_reqs_per_session=4, max_num_batched_tokens=tokens)))
        try:
            self.a = _InProc(self.d, "A", steps_in_flight=0)
            self.b = _InProc(self.d, "B", steps_in_flight=0)
        except BaseException:
            self.end()
            raise
        self.rng, self.prefix, self.n = vocab_rng, args.prefix, 0

    def prompts(self):
        prefix = self.rng.integers(1, 32000, self.prefix)
        return [np.concatenate([prefix, self.rng.integers(1, 32000, TAIL)]) for _ in range(2)]

    def prime(self, pa) -> str:
        """A admits ``pa`` and confirms it (its next message), the deferred work runs (as it does
        in an idle daemon): B can hit it now."""
        self.n += 1
        rid = f"a{self.n}"
        self.a.step(StepBatch(admit=[AdmitRequest(rid, len(pa), self.a.hash_prompt(pa))]))
        self.a.step(StepBatch())
        self.d.manager.flush_deferred()
        return rid

    def hit(self, pb, hb):
        rid = f"b{self.n}"
        res = self.b.step(StepBatch(admit=[AdmitRequest(rid, len(pb), hb)]))
        return rid, res

    def free(self, a_rid: str, b_rid: str) -> bool:
        r1 = self.b.step(StepBatch(free=[b_rid]))
        r2 = self.a.step(StepBatch(free=[a_rid]))
        return not (r1.free_status.any() or r2.free_status.any())

    def empty(self) -> bool:
        self.d.manager.flush_deferred()
        return int(self.d.manager.stats()["num_used_blocks"]) == 0

    def end(self) -> None:
        """End the sessions (their shared memory goes with them), whatever happened."""
        for s in list(self.d.sessions.values()):
            self.d.end_session(s, "bench done")


try:
    from numba import njit
except ImportError:  # numba is optional (kvd[fast]): then a bare Python loop
    njit = None

_SPIN_SLICE_S = 100e-6  # the native loop returns to check the clock this often


def _spin_loop(word, n: int) -> int:
    """``n`` turns that only read ``word[0]`` (native with numba: no interpreter, no system call)."""
    v = word[0]
    for i in range(n):
        if word[0] != v:
            return i
    return n


if njit is not None:
    _spin_loop = njit(nogil=True, cache=False)(_spin_loop)


class _Spinner:
    """Waits by ``_spin_loop``, its turns per second measured once."""

    def __init__(self):
        self.word = np.zeros(1, np.int64)
        _spin_loop(self.word, 10)  # compiled before it is timed
        n = 1_000_000
        t0 = time.perf_counter()
        _spin_loop(self.word, n)
        self.turns = max(1, int(n / max(time.perf_counter() - t0, 1e-9) * _SPIN_SLICE_S))

    def wait(self, seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            _spin_loop(self.word, self.turns)


def _poll(sock, seconds: float, warm=None, every: float = 0.0) -> None:
    """What a waiting daemon or client does (``kvd.protocol.busy_poll``: ``has_input`` and
    ``sched_yield``; no message ever comes) for ``seconds``, with ``warm()`` first and then every
    ``every`` seconds when given."""
    end = time.perf_counter() + seconds
    while (left := end - time.perf_counter()) > 0:
        if warm is not None:
            warm()
            left = min(every, left)
        P.busy_poll(sock, left)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=60, help="timed rounds of each mode (after --warmup)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--idle-ms", type=float, default=2.0, help="polling before B's admission")
    ap.add_argument("--warm-every-ms", type=float, default=0.5)
    ap.add_argument("--prefix", type=int, default=1024, help="shared prefix tokens (whole blocks hit)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.prefix % args.block_size or args.prefix <= 0:
        ap.error("--prefix must be a positive multiple of --block-size")
    pairs = []
    try:
        pairs.append(_Pair(args, np.random.default_rng(args.seed)))
        pairs.append(_Pair(args, np.random.default_rng(args.seed + 1)))
        return _run(args, *pairs)
    finally:
        for pair in pairs:
            pair.end()


def _run(args, main_pair: _Pair, shadow: _Pair) -> int:
    manager_s: list[float] = []
    real_step = M.BlockManager.step

    def timed_step(self, *a, **k):
        t0 = time.perf_counter()
        out = real_step(self, *a, **k)
        if self is main_pair.d.manager:
            manager_s.append(time.perf_counter() - t0)
        return out

    checks = {"statuses_ok": True, "every_hit_is_the_prefix": True}
    sa, sb = shadow.prompts()
    shadow_a = shadow.prime(sa)
    shadow_hb = shadow.b.hash_prompt(sb)

    def warm():
        rid, res = shadow.hit(sb, shadow_hb)
        checks["statuses_ok"] &= not res.admit_status.any()
        checks["statuses_ok"] &= not shadow.b.step(StepBatch(free=[rid])).free_status.any()

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"inproc://bench-idle-{os.getpid()}")
    times = {m: [] for m in MODES}
    spinner = _Spinner()
    M.BlockManager.step = timed_step
    try:
        for k in range(args.warmup + args.rounds):
            for mode in MODES:
                pa, pb = main_pair.prompts()
                a_rid = main_pair.prime(pa)
                hb = main_pair.b.hash_prompt(pb)
                if mode == "spun":
                    spinner.wait(args.idle_ms / 1e3)
                elif mode != "back_to_back":
                    _poll(sock, args.idle_ms / 1e3, warm if mode == "polled_warm" else None, args.warm_every_ms / 1e3)
                manager_s.clear()
                t0 = time.perf_counter()
                b_rid, res = main_pair.hit(pb, hb)
                split = (time.perf_counter() - t0, main_pair.b.handle_s, sum(manager_s))
                checks["statuses_ok"] &= not res.admit_status.any()
                checks["every_hit_is_the_prefix"] &= int(res.admit_cached_tokens[0]) == args.prefix
                checks["statuses_ok"] &= main_pair.free(a_rid, b_rid)
                if k >= args.warmup:
                    times[mode].append(split)
    finally:
        M.BlockManager.step = real_step
        sock.close(0)
        ctx.term()
    checks["statuses_ok"] &= not shadow.a.step(StepBatch(free=[shadow_a])).free_status.any()
    checks["pools_empty_after"] = main_pair.empty() and shadow.empty()
    figures = {}
    for mode, ts in times.items():
        a = np.array(ts) * 1e6
        figures[mode] = {"client_step_p50_us": round(float(np.median(a[:, 0])), 1),
                         "client_step_p90_us": round(float(np.percentile(a[:, 0], 90)), 1),
                         "handle_p50_us": round(float(np.median(a[:, 1])), 1),
                         "manager_p50_us": round(float(np.median(a[:, 2])), 1)}
    base = figures["back_to_back"]["client_step_p50_us"]
    ratios = {f"{m}_over_back_to_back": round(figures[m]["client_step_p50_us"] / base, 3) for m in MODES[1:]}
    print(f"a {args.prefix}-token prefix hit's admission, {args.rounds} rounds of each mode, "
          f"{args.idle_ms} ms idle, a warm pass every {args.warm_every_ms} ms (µs):")
    print(f"{'mode':14s} {'client.step p50':>16s} {'p90':>8s} {'handle p50':>11s} {'manager p50':>12s}")
    for mode, f in figures.items():
        print(f"{mode:14s} {f['client_step_p50_us']:16.1f} {f['client_step_p90_us']:8.1f} {f['handle_p50_us']:11.1f} "
              f"{f['manager_p50_us']:12.1f}")
    native = njit is not None and os.environ.get("NUMBA_DISABLE_JIT", "0") in ("", "0")
    out = {"bench": "idle", "config": vars(args), "spun_native": native, "modes": figures, "ratios": ratios,
           "checks": checks,
           "ok": all(checks.values())}
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
