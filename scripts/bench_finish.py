#!/usr/bin/env python3
"""A serving engine's step after a request finished, through a real daemon: the ``decode_free`` op
against the same step as the general JSON ``step`` (``kvd_client.step.BINARY_DECODE_FREE`` off),
alternating chunks of steps on one client so that both meet the same host moments.

R requests (``--prompt``-token prompts, hashed) decode; each timed step frees the oldest and
appends one token to the other R - 1 after a ``--pause-us`` pause (an engine's forward). Kinds:

* ``finish``: frees and appends; the next request is admitted in an untimed step after it;
* ``mixed``: the next request's admission (a 1,024-token prompt) travels in the same step.

Reports each kind's client step p50 / p90 in µs per path. Ends with ONE JSON line: the figures and
honesty checks (every status OK, every timed step sent as the op on one path and as a JSON step on
the other, the pool empty after the run).

    python scripts/bench_finish.py                 # R = 256, 12 chunks of 25 steps per kind and path
    python scripts/bench_finish.py -R 8 --chunks 2 --chunk 4 -P 64 --pause-us 0   # a quick run (a test)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from kvd import protocol as P  # noqa: E402
from kvd.api import AdmitRequest, StepBatch  # noqa: E402
from kvd.bench.zmq_bench import DaemonProcess  # noqa: E402
from kvd.workload import WorkloadSpec  # noqa: E402
from kvd_client import Client  # noqa: E402
from kvd_client import step as step_mod  # noqa: E402


class _Counted(Client):
    """A client that notes the op of every message it sends."""

    def __init__(self, *a, **kw):
        self.ops: list[str] = []
        super().__init__(*a, **kw)

    def _send_first(self, op, fields, frames, sid=None):
        self.ops.append(op)
        return super()._send_first(op, fields, frames, sid)


def _run(c: _Counted, args, kind: str, checks: dict) -> dict[bool, list[float]]:
    rng = np.random.default_rng(args.seed)
    next_id = [0]

    def admission() -> AdmitRequest:
        next_id[0] += 1
        return AdmitRequest((kind, next_id[0]), args.prompt, c.hash_prompt(rng.integers(1, 32000, args.prompt)))

    for i in range(0, args.requests, 8):
        res = c.step(StepBatch(admit=[admission() for _ in range(min(8, args.requests - i))]))
        checks["statuses_ok"] &= not res.admit_status.any()
    order = list(c.request_ids)
    times: dict[bool, list[float]] = {False: [], True: []}
    pc = time.perf_counter
    try:
        for _ in range(args.chunks):
            for binary in (False, True):
                step_mod.BINARY_DECODE_FREE = binary
                for k in range(args.chunk):
                    victim, new = order.pop(0), admission()
                    batch = StepBatch(free=[victim], append_rows=np.asarray(c.rows_of(order), np.int32),
                                      append_num_tokens=1, admit=[new] if kind == "mixed" else [])
                    if args.pause_us:
                        time.sleep(args.pause_us / 1e6)
                    n = len(c.ops)
                    t0 = pc()
                    res = c.step(batch)
                    times[binary].append(pc() - t0)
                    checks["timed_steps_take_their_path"] &= c.ops[n:] == [P.DECODE_FREE if binary else P.STEP]
                    checks["statuses_ok"] &= not (res.free_status.any() or res.append_status.any()
                                                  or res.admit_status.any())
                    if kind == "finish":
                        res = c.step(StepBatch(admit=[new]))
                        checks["statuses_ok"] &= not res.admit_status.any()
                    order.append(new.req_id)
    finally:
        step_mod.BINARY_DECODE_FREE = True
    res = c.step(StepBatch(free=order))
    checks["statuses_ok"] &= not res.free_status.any()
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", "-R", type=int, default=256)
    ap.add_argument("--prompt", "-P", type=int, default=1024)
    ap.add_argument("--chunks", type=int, default=12)
    ap.add_argument("--chunk", type=int, default=25, help="steps per chunk (each path, alternating)")
    ap.add_argument("--pause-us", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    spec = WorkloadSpec(num_requests=args.requests + 1, num_blocks=256 * (args.requests + 1))
    daemon = DaemonProcess(types.SimpleNamespace(blocks=spec.num_blocks, lease_s=30.0, daemon_arg=[], events=False),
                           spec, 1).start()
    checks = {"statuses_ok": True, "timed_steps_take_their_path": True}
    figures: dict = {}
    try:
        with _Counted(daemon.endpoint, tenant="", name="bench-finish", timeout_s=30.0, kv_shared=True) as c:
            for kind in ("finish", "mixed"):
                times = _run(c, args, kind, checks)
                for binary, name in ((False, "json_step"), (True, "decode_free")):
                    a = np.array(times[binary][args.chunk:]) * 1e6  # the first chunk warms up
                    figures[f"{kind}_{name}_p50_us"] = round(float(np.median(a)), 1)
                    figures[f"{kind}_{name}_p90_us"] = round(float(np.percentile(a, 90)), 1)
            stats = c.stats()
        checks["pool_empty_after"] = int(stats["num_used_blocks"]) == 0 and int(stats["num_requests"]) == 0
    finally:
        daemon.stop()
    print(f"R={args.requests} P={args.prompt}, client step through a daemon (µs, p50 / p90):")
    for kind in ("finish", "mixed"):
        print(f"{kind:7s} JSON step {figures[f'{kind}_json_step_p50_us']:8.1f} / {figures[f'{kind}_json_step_p90_us']:8.1f}"
              f"   decode_free op {figures[f'{kind}_decode_free_p50_us']:8.1f} / {figures[f'{kind}_decode_free_p90_us']:8.1f}")
    ok = all(checks.values())
    print(json.dumps({"bench": "finish", "config": vars(args), "figures": figures, "checks": checks, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
