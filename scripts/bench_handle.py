#!/usr/bin/env python3
"""The daemon's per-message work without sockets: a client core calls ``Daemon.handle`` in one
process, so each step's cost splits into the manager, the daemon around it (parsing, publishing to
shared memory, the reply) and the client around that (building the message, reading the reply).

Four kinds of step, each ``--steps`` times (after ``--warmup``), R = ``--requests`` running requests:

* ``decode``: every running request appends one token (the binary decode op);
* ``mixed``: a serving step: the R requests decode, the oldest is freed and a new one is admitted
  (a ``--prompt``-token prompt, every other one starting with the same ``--system``-token system
  prompt: its blocks are a prefix hit once the first sharer registered them);
* ``free``: one request is freed (the general step, nothing else in it; the refill admission after
  it, untimed, registers its prompt before the next free, as an idle daemon would);
* ``finish``: the oldest request is freed and the others decode (the binary ``decode_free`` op: a
  serving step after a request finished; refilled untimed as ``free``);
* ``hit``: a new request's first step in another session (the time to first token of issue 11's
  cross-engine hit): session A admits a ``--prompt``-token prefix plus 16 tokens and confirms it
  with its next step (its registration runs before B's message, as in an idle daemon), then session
  B (a writer of the same prefix cache) admits the same prefix plus 16 other tokens, a lone
  admission that hits the prefix's whole blocks; A and B free theirs untimed.

Medians in µs. Ends with ONE JSON line: the figures and honesty checks (every status OK, the
shared admissions hit exactly the system prompt's whole blocks, B's exactly the prefix's, the
finish steps went as the decode_free op, the pool empty at the end).

    python scripts/bench_handle.py                 # R = 256, 1,024-token prompts, 512 shared
    python scripts/bench_handle.py -R 16 --steps 20 --warmup 5 -P 64 -S 32   # a quick run (a test)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import kvd.manager as M  # noqa: E402
from kvd import protocol as P  # noqa: E402
from kvd.api import AdmitRequest, StepBatch  # noqa: E402
from kvd.server import Daemon  # noqa: E402
from kvd_client.client import Client, _Core  # noqa: E402


class _InProc(_Core):
    """A client core whose messages go straight to ``Daemon.handle`` (timed)."""

    def __init__(self, d: Daemon, name: str = "bench", **kw):
        super().__init__("inproc://bench", heartbeat=False, gpu=False, kv_shared=True, name=name, **kw)
        self.d, self.handle_s, self.ident = d, 0.0, name.encode()
        op, fields, frames = self._hello_msg()
        h, _ = self._call(op, fields, frames, sid=0)
        self._on_session(h)

    def _call(self, op, fields, frames, sid=None):
        seq = self._next_seq()
        self.last_op = op
        hdr = self._header(op, self.sid if sid is None else sid, seq, fields)
        t0 = time.perf_counter()
        rep = self.d.handle([self.ident, hdr, *frames])
        self.handle_s = time.perf_counter() - t0
        h = P.parse_reply(rep[0])
        if not self._check(h, seq):
            raise RuntimeError(f"daemon error: {h}")
        return h, rep[1:]

    _do = Client._do
    step = Client.step


def time_manager_entries(times: list[float]) -> dict:
    """Make BlockManager's two daemon entries (``step``, ``decode_rows``) append each call's seconds
    to ``times``; returns the originals for ``restore_manager_entries``."""
    real = {name: getattr(M.BlockManager, name) for name in ("step", "decode_rows")}

    def timed(fn):
        def call(self, *a, **k):
            t0 = time.perf_counter()
            out = fn(self, *a, **k)
            times.append(time.perf_counter() - t0)
            return out
        return call

    for name, fn in real.items():
        setattr(M.BlockManager, name, timed(fn))
    return real


def restore_manager_entries(real: dict) -> None:
    for name, fn in real.items():
        setattr(M.BlockManager, name, fn)


def _config(args):
    """A daemon whose pool and request length never refuse the run: a request lives through at most
    every step of the three kinds."""
    rows = args.requests + 8
    longest = args.prompt + 3 * (args.warmup + args.steps) + 1
    blocks = 2 * rows * (-(-longest // args.block_size) + 1)
    return type("Cfg", (), dict(block_size=args.block_size, num_gpu_blocks=blocks, max_model_len=longest,
                                max_num_reqs=2 * rows, max_reqs_per_session=rows,
                                max_num_batched_tokens=args.prompt + rows))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", "-R", type=int, default=256)
    ap.add_argument("--prompt", "-P", type=int, default=1024)
    ap.add_argument("--system", "-S", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    d = Daemon(_config(args))
    manager_s: list[float] = []
    real = time_manager_entries(manager_s)  # the daemon's two entries
    c = _InProc(d)
    system = rng.integers(1, 32000, args.system)
    order: list[int] = []
    next_id = [0]
    checks = {"statuses_ok": True}
    shared_hits, shared_n = [], [0]

    def admission():
        p = rng.integers(1, 32000, args.prompt)
        shared = next_id[0] % 2 == 0
        if shared:
            p[: args.system] = system
        rid = next_id[0]
        next_id[0] += 1
        return AdmitRequest(rid, args.prompt, c.hash_prompt(p)), shared

    def run(batch: StepBatch, client=None):
        client = client or c
        manager_s.clear()
        t0 = time.perf_counter()
        res = client.step(batch)
        client_s = time.perf_counter() - t0
        ok = not (res.free_status.any() or res.append_status.any() or res.admit_status.any())
        checks["statuses_ok"] &= bool(ok)
        return res, (client_s, client.handle_s, sum(manager_s))

    first = [admission() for _ in range(args.requests)]
    res, _ = run(StepBatch(admit=[a for a, _ in first]))
    order += [a.req_id for a, _ in first]
    figures: dict[str, dict] = {}
    # the hit kind's two sessions: each step confirms the one before (steps_in_flight=0)
    ca, cb = _InProc(d, "a", steps_in_flight=0), _InProc(d, "b", steps_in_flight=0)
    hit_tokens = []

    def hit_round(k: int):
        prefix = rng.integers(1, 32000, args.prompt)
        pa, pb = (np.concatenate([prefix, rng.integers(1, 32000, 16)]) for _ in range(2))
        ca.step(StepBatch(admit=[AdmitRequest(f"a{k}", pa.size, ca.hash_prompt(pa))]))
        ca.step(StepBatch(append_rows=ca.rows_of([f"a{k}"]), append_num_tokens=1))  # confirms the admission
        d.manager.flush_deferred()  # A's registration: an idle daemon runs it before B's message comes
        hashes = cb.hash_prompt(pb)
        res, t = run(StepBatch(admit=[AdmitRequest(f"b{k}", pb.size, hashes)]), cb)
        hit_tokens.append(int(res.admit_cached_tokens[0]))
        cb.step(StepBatch(free=[f"b{k}"]))
        ca.step(StepBatch(free=[f"a{k}"]))
        return res, t

    for kind in ("decode", "mixed", "free", "hit", "finish"):
        times = []
        for k in range(args.warmup + args.steps):
            if kind == "hit":
                res, t = hit_round(k)
            elif kind == "decode":
                res, t = run(StepBatch(append_rows=c.rows_of(order), append_num_tokens=1))
            elif kind == "mixed":
                victim = order.pop(0)
                adm, shared = admission()
                res, t = run(StepBatch(free=[victim], append_rows=c.rows_of(order), append_num_tokens=1, admit=[adm]))
                order.append(adm.req_id)
                if shared and k >= args.warmup:
                    shared_hits.append(int(res.admit_cached_tokens[0]))
            else:
                victim = order.pop(0)
                if kind == "free":
                    res, t = run(StepBatch(free=[victim]))
                else:
                    res, t = run(StepBatch(free=[victim], append_rows=c.rows_of(order), append_num_tokens=1))
                    checks["finish_steps_take_the_decode_free_op"] = (
                        checks.get("finish_steps_take_the_decode_free_op", True) and c.last_op is P.DECODE_FREE)
                adm, _ = admission()  # refill untimed, so that every free step sees R - 1 requests
                run(StepBatch(admit=[adm]))
                d.manager.flush_deferred()  # its registration, as an idle daemon runs it: not the next free's
                order.append(adm.req_id)
            if k >= args.warmup:
                times.append(t)
        a = np.array(times) * 1e6
        med = np.median(a, axis=0)
        figures[kind] = {"client_step_us": round(float(med[0]), 1), "handle_us": round(float(med[1]), 1),
                         "manager_us": round(float(med[2]), 1), "daemon_glue_us": round(float(med[1] - med[2]), 1),
                         "client_glue_us": round(float(med[0] - med[1]), 1),
                         "handle_p99_us": round(float(np.percentile(a[:, 1], 99)), 1)}
    c.step(StepBatch(free=order))
    d.manager.flush_deferred()
    st = d.manager.stats()
    checks["pool_empty_after"] = int(st["num_used_blocks"]) == 0
    whole = args.system // args.block_size * args.block_size
    checks["shared_admissions_hit_the_system_prompt"] = bool(shared_hits) and set(shared_hits) == {whole}
    checks["hits_cover_the_prefix"] = set(hit_tokens) == {args.prompt // args.block_size * args.block_size}
    for s in list(d.sessions.values()):
        d.end_session(s, "bench done")
    restore_manager_entries(real)
    print(f"R={args.requests} P={args.prompt} S={args.system}, median of {args.steps} steps (µs):")
    print(f"{'step':8s} {'client.step':>12s} {'handle':>8s} {'manager':>8s} {'daemon glue':>12s} {'client glue':>12s}")
    for kind, f in figures.items():
        print(f"{kind:8s} {f['client_step_us']:12.1f} {f['handle_us']:8.1f} {f['manager_us']:8.1f} "
              f"{f['daemon_glue_us']:12.1f} {f['client_glue_us']:12.1f}")
    out = {"bench": "handle", "config": vars(args), "steps": figures, "checks": checks, "ok": all(checks.values())}
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
