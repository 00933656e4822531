#!/usr/bin/env python3
"""What pinning buys a round trip: a bare ZeroMQ DEALER/ROUTER echo over ipc, both application
threads busy-polling (``sched_yield`` between polls, as kvd's client and daemon do), a message every
``--gap-ms`` (0: back to back; a few ms: a request after an idle spell, e.g. a new request's
admission), with each side's threads floating or pinned (the side's thread and its ZeroMQ I/O thread
on one CPU: ``kvd serve --pin-cpu``, ``Client(io_cpu=...)`` with the engine's thread pinned there).

Each (pinning, gap) runs in fresh processes (an I/O thread's CPU is fixed when its context starts);
the modes alternate ``--rounds`` times and the p50 / p90 are over all their round trips. Prints a
table and one JSON line; exit status 1 if an echo came back wrong (the honesty check)."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time

import numpy as np

MODES = ("floating", "server", "both")  # whose threads are pinned


def _pin(cpu: int | None, ctx) -> None:
    import zmq

    if cpu is not None:
        ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
        os.sched_setaffinity(0, {cpu})


def _server(endpoint: str, cpu: int | None, ready) -> None:
    import zmq

    ctx = zmq.Context()
    _pin(cpu, ctx)
    s = ctx.socket(zmq.ROUTER)
    s.bind(endpoint)
    ready.set()
    ev, pollin, yield_cpu = zmq.EVENTS, zmq.POLLIN, os.sched_yield
    while True:
        if not s.getsockopt(ev) & pollin:
            yield_cpu()
            continue
        m = s.recv_multipart(copy=False)
        if len(m) == 2 and m[1].bytes == b"stop":
            break
        s.send_multipart(m, copy=False)
    s.close(0)
    ctx.term()


def _client(endpoint: str, cpu: int | None, n: int, gap_s: float, size: int, out) -> None:
    import zmq

    ctx = zmq.Context()
    _pin(cpu, ctx)
    s = ctx.socket(zmq.DEALER)
    s.connect(endpoint)
    msg = os.urandom(size)
    ev, pollin, yield_cpu, pc = zmq.EVENTS, zmq.POLLIN, os.sched_yield, time.perf_counter
    rts, bad = [], 0
    for i in range(n + 20):  # 20 untimed: connection set up, code warm
        t_gap = pc()
        while pc() - t_gap < gap_s:  # idle as an engine between requests (its thread busy elsewhere)
            time.sleep(gap_s / 4)
        t0 = pc()
        s.send(msg, copy=False)
        while not s.getsockopt(ev) & pollin:
            yield_cpu()
        rep = s.recv(copy=False)
        if i >= 20:
            rts.append(pc() - t0)
            bad += rep.bytes != msg
    s.send(b"stop")
    out.put((rts, bad))
    s.close(0)
    ctx.term()


def run_mode(mode: str, cpus: tuple[int, int], n: int, gap_s: float, size: int) -> tuple[list[float], int]:
    d = tempfile.mkdtemp(prefix="kvdw", dir="/tmp")
    endpoint = "ipc://" + os.path.join(d, "echo.sock")
    mpc = mp.get_context("spawn")
    ready, out = mpc.Event(), mpc.Queue()
    srv_cpu = cpus[0] if mode in ("server", "both") else None
    cli_cpu = cpus[1] if mode == "both" else None
    server = mpc.Process(target=_server, args=(endpoint, srv_cpu, ready), daemon=True)
    client = None
    try:
        server.start()
        if not ready.wait(30):
            raise RuntimeError("echo server did not start")
        client = mpc.Process(target=_client, args=(endpoint, cli_cpu, n, gap_s, size, out), daemon=True)
        client.start()
        return out.get(timeout=120)
    finally:
        for p in (client, server):
            if p is not None:
                p.join(10)
                if p.is_alive():
                    p.terminate()
                    p.join(5)
        shutil.rmtree(d, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gap-ms", default="0,5", help="comma-separated gaps between messages (ms)")
    ap.add_argument("--iters", type=int, default=200, help="round trips per mode, gap and round")
    ap.add_argument("--rounds", type=int, default=2, help="times the modes alternate")
    ap.add_argument("--bytes", type=int, default=1024, help="message size")
    ap.add_argument("--cpus", default=None, help="server,client CPUs when pinned (default: the last two)")
    args = ap.parse_args(argv)
    allowed = sorted(os.sched_getaffinity(0))
    if args.cpus:
        cpus = tuple(int(x) for x in args.cpus.split(","))
    elif len(allowed) >= 2:
        cpus = (allowed[-1], allowed[-2])
    else:
        ap.error("pinning needs two CPUs")
    if len(cpus) != 2 or cpus[0] == cpus[1] or not set(cpus) <= set(allowed):
        ap.error(f"--cpus: two different CPUs of {allowed}")
    gaps = [float(x) for x in args.gap_ms.split(",")]
    samples = {(m, g): [] for m in MODES for g in gaps}
    bad = 0
    for _ in range(args.rounds):
        for g in gaps:
            for m in MODES:
                rts, b = run_mode(m, cpus, args.iters, g / 1e3, args.bytes)
                samples[(m, g)] += rts
                bad += b
    rows = {}
    print(f"{'gap ms':>7s} {'pinned':>9s} {'p50 us':>8s} {'p90 us':>8s}")
    for g in gaps:
        for m in MODES:
            x = np.array(samples[(m, g)]) * 1e6
            r = rows[f"{m}@{g:g}ms"] = {"p50_us": round(float(np.median(x)), 1),
                                        "p90_us": round(float(np.percentile(x, 90)), 1), "n": int(x.size)}
            print(f"{g:7g} {m:>9s} {r['p50_us']:8.1f} {r['p90_us']:8.1f}")
    honest = {"every_echo_intact": bad == 0,
              "every_round_trip_counted": all(len(v) == args.iters * args.rounds for v in samples.values())}
    print(json.dumps({"bench": "wakeup", "cpus": list(cpus), "host_cpus": len(allowed), "bytes": args.bytes,
                      "rows": rows, "honest": honest, "ok": all(honest.values())}))
    return 0 if all(honest.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
