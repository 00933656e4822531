#!/usr/bin/env python3
"""A serving engine's decode step on pools of several KV-cache groups (a hybrid model: full
attention beside a sliding window) without sockets: a client core calls ``Daemon.handle`` in one
process, as ``scripts/bench_handle.py`` does.

R running requests of staggered lengths (so that every step some of them fill a block: the
engine's usual step, not a lockstep batch) append one token each, with each group's hash of every
block that filled. For each pool (``--pools``, kvd serve's ``--kv-groups`` syntax, ``;`` between
pools) two daemons get the same steps, alternating step by step so that the machine's drift falls
on both:

* ``op``: the binary decode op carrying each group's hashes, into the manager's several-groups
  append path (``BlockManager._append_fast_groups``);
* ``before``: what a step cost before both (a JSON step message, the manager's request-by-request
  append path).

Medians in µs: the client's whole step, ``Daemon.handle``, the manager's part. Ends with ONE JSON
line: the figures and honesty checks (every status OK, every ``op`` step went as the decode op and
every ``before`` step as the JSON step, both daemons in the same state after every step's run (the
blocks' references, the prefix cache, every group's tables), the blocks registered equal to the
blocks that filled, the pools empty at the end).

    python scripts/bench_groups.py                          # R = 256, pools 16 / 16,16 / 16,16:1024
    python scripts/bench_groups.py -R 16 --steps 20 --warmup 5 --pools "4;4,4:8"   # a quick run (a test)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvd.manager as M  # noqa: E402
from bench_handle import _InProc, restore_manager_entries, time_manager_entries  # noqa: E402
from kvd import protocol as P  # noqa: E402
from kvd.api import AdmitRequest, StepBatch  # noqa: E402
from kvd.config import _parse_kv_groups  # noqa: E402
from kvd.server import Daemon  # noqa: E402


class _Before(_InProc):
    """The client as it was: several groups' hashes go as the JSON step message."""

    def _req_decode(self, *args, **kw):
        return None


def _config(args, groups):
    rows = args.requests + 8
    longest = args.prompt + max(bs for bs, _ in groups) + args.warmup + args.steps + 1
    blocks = rows * sum(-(-longest // bs) + 1 for bs, _ in groups) + 64
    return type("Cfg", (), dict(group_specs=staticmethod(lambda: groups), num_gpu_blocks=blocks,
                                max_model_len=longest, max_num_reqs=2 * rows, max_reqs_per_session=rows,
                                max_num_batched_tokens=args.prompt + rows))


def _state(d: Daemon) -> tuple:
    m = d.manager
    p = m.pool
    return (p.ref_cnt.tobytes(), p.cache_key.tobytes(), p.free_queue_order().tobytes(),
            [(g.table.tobytes(), g.num_blocks.tobytes(), g.num_registered.tobytes()) for g in m.groups])


def _run_pool(args, groups) -> tuple[dict, dict]:
    daemons = [Daemon(_config(args, groups)), Daemon(_config(args, groups))]
    clients = [_InProc(daemons[0]), _Before(daemons[1])]
    sizes = [bs for bs, _ in groups]
    checks = {"statuses_ok": True, "op_steps_go_as_the_decode_op": True, "before_steps_go_as_json": True}
    manager_s: list[float] = []
    R, bs_max = args.requests, max(sizes)
    lengths = args.prompt + np.arange(R) % bs_max  # staggered: blocks fill on different steps
    # the hashes are unique 16-byte values (what they hash does not matter to the cost)
    serial = [0]

    def new_hashes(k: int) -> np.ndarray:
        serial[0] += k
        return np.arange(serial[0] - k, serial[0], dtype=np.int64).astype("<i8").view("S8").astype("S16")

    prompts = []
    for i in range(R):
        prompts.append([new_hashes(int(lengths[i]) // bs) for bs in sizes])
    for c in clients:
        res = c.step(StepBatch(admit=[AdmitRequest(i, int(lengths[i]), prompts[i]) for i in range(R)]))
        checks["statuses_ok"] &= not res.admit_status.any()
    rows = [c.rows_of(list(range(R))) for c in clients]
    times = {"op": [], "before": []}
    registered = 0
    real = time_manager_entries(manager_s)
    try:
        for k in range(args.warmup + args.steps):
            n = lengths + 1
            counts = [(n % bs == 0).astype(np.int32) for bs in sizes]
            hashes = tuple(new_hashes(int(c.sum())) for c in counts)
            registered += sum(int(c.sum()) for c in counts)
            for c, r, label in zip(clients, rows, ("op", "before")):
                M._GROUPS_FAST_PATH = label == "op"
                manager_s.clear()
                t0 = time.perf_counter()
                res = c.step(StepBatch(append_rows=r, append_num_tokens=1, append_hashes=hashes,
                                       append_hash_counts=tuple(counts)))
                client_s = time.perf_counter() - t0
                checks["statuses_ok"] &= not res.append_status.any()
                if label == "op":
                    checks["op_steps_go_as_the_decode_op"] &= c.last_op is P.DECODE
                else:
                    checks["before_steps_go_as_json"] &= c.last_op is P.STEP
                if k >= args.warmup:
                    times[label].append((client_s, c.handle_s, sum(manager_s)))
            lengths = n
    finally:
        M._GROUPS_FAST_PATH = True
        restore_manager_entries(real)
    for d in daemons:
        d.manager.flush_deferred()
    checks["same_state"] = _state(daemons[0]) == _state(daemons[1])
    m = daemons[0].manager
    checks["registered_what_filled"] = int(sum(g.num_registered[rows[0]].sum() for g in m.groups)) == (
        sum(int(p.size) for pr in prompts for p in pr) + registered)
    for c in clients:
        c.step(StepBatch(free=list(range(R))))
    for d in daemons:
        d.manager.flush_deferred()
        checks["pools_empty_after"] = checks.get("pools_empty_after", True) and int(d.manager.stats()["num_used_blocks"]) == 0
        for s in list(d.sessions.values()):
            d.end_session(s, "bench done")
    figures = {}
    for label, t in times.items():
        med = np.median(np.array(t) * 1e6, axis=0)
        figures[label] = {"client_step_us": round(float(med[0]), 1), "handle_us": round(float(med[1]), 1),
                          "manager_us": round(float(med[2]), 1)}
    return figures, checks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", "-R", type=int, default=256)
    ap.add_argument("--prompt", "-P", type=int, default=1024)
    ap.add_argument("--pools", default="16;16,16;16,16:1024", help="kvd serve --kv-groups specs, ';' between pools")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    args = ap.parse_args(argv)
    results, checks = {}, {}
    for spec in args.pools.split(";"):
        figures, ok = _run_pool(args, _parse_kv_groups(spec))
        results[spec] = figures
        checks.update({f"{spec}: {k}": v for k, v in ok.items()})
    print(f"R={args.requests} P={args.prompt} (staggered), one token a step, each group's filled blocks hashed; "
          f"median of {args.steps} steps (µs):")
    print(f"{'pool (--kv-groups)':20s} {'path':8s} {'client.step':>12s} {'handle':>8s} {'manager':>8s}")
    for spec, figures in results.items():
        for label, f in figures.items():
            print(f"{spec:20s} {label:8s} {f['client_step_us']:12.1f} {f['handle_us']:8.1f} {f['manager_us']:8.1f}")
    out = {"bench": "groups", "config": vars(args), "pools": results, "checks": checks, "ok": all(checks.values())}
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
