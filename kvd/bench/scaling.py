"""``kvd bench --scale``: issue 13's scaling table, every column measured in one sitting.

For each R (requests per client; default 64, 256, 1,024, 4,096; the rest of the standard workload,
docs/WORKLOAD.md, as the other flags say) a daemon with a pool scaled to R (``--blocks`` x R / ``-R``:
65,536 blocks per 256 requests by default, so nothing is ever evicted) and ``--repeat`` repetitions
of, back to back:

  daemon    the decode step round trip of 1 client through that daemon (``zmq_bench.run_clients``);
  echo      a bare ZeroMQ echo of the same step's message sizes (``zmq_bench.run_floor``), waiting as
            kvd's client and daemon do (polling where they poll); the echo with both sides sleeping
            in recv is in the JSON (``echo_sleeping_p50_us``) and the table;
  in-proc   kvd's BlockManager in this process, step + slot mapping (``zmq_bench.run_inproc``);
  vLLM      vLLM 0.33.0's KVCacheManager driven like its Scheduler (``kvd.bench.vllm_peer``, in its
            own process); n/a, with the reason in the JSON, when vLLM is not importable or --no-vllm.

Each column's p50/p99 is the median over the repetitions. Ratios and the daemon's "extra" cost
(daemon p50 - echo p50 - in-process p50: per-message work that is neither transport nor manager)
are taken per repetition, from the runs measured back to back, and their median reported.

Targets (issue 13), per R, in the final JSON line's ``targets``: ``R<n>_extra_le_25us_plus_5pct``
(extra <= 25 us + 5 % of the in-process p50) and ``R<n>_p99_le_2x_p50`` (the daemon's p99 <= 2x its
p50). The 4-client target is ``kvd bench --clients 4``'s.

Honesty (``honest``; exit status 1 when one fails): per R and backend, every request admitted, the
prefix-hit tokens and the blocks in use after decode equal the workload's expected figures, the pool
entirely free at the end, no error replies; the daemon's last slot mapping matches its tables; the
vLLM checks only where vLLM ran. A run that fails (a daemon or client error) still prints the rows
measured so far and the JSON line, with ``error``; exit status 1.

``--plot FILE.png`` draws the table (``kvd.bench.plots.scaling``); without matplotlib (the optional
``kvd[plot]`` extra) the plot is skipped with a message and the JSON says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import threading

import numpy as np

from kvd.bench import plots
from kvd.bench import zmq_bench as Z
from kvd.bench.vllm_peer import VllmPeer

DEFAULT_SCALE = (64, 256, 1024, 4096)
EXTRA_BUDGET_US = 25.0  # the allowance for the daemon's own work per message
EXTRA_BUDGET_FRAC = 0.05  # ... plus 5 % of the in-process step: work per request must not grow past it
P99_OVER_P50_MAX = 2.0
COLUMNS = [("inproc", "kvd in-process"), ("daemon", "kvd daemon, 1 client"), ("echo", "zmq echo"),
           ("vllm", "vLLM 0.33 in-process")]


def parse_scale(s: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--scale: expected R,R,...; got {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError("--scale: request counts must be >= 1")
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("scaling table (--scale; kvd.bench.scaling)")
    g.add_argument("--scale", type=parse_scale, nargs="?", const=DEFAULT_SCALE, default=None, metavar="R,R,...",
                   help="print the scaling table for these R (default 64,256,1024,4096): kvd in-process, "
                        "through the daemon (1 client), the zmq echo floor and vLLM's manager; the pool "
                        "scales with R (--blocks per -R requests)")
    g.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True,
                   help="the vLLM column of --scale (n/a without vLLM 0.33)")


def _refused(args) -> str:
    if args.endpoint:
        return "--scale starts a daemon per R (its pool scales with R): no --endpoint"
    if args.micro:
        return "--scale runs the standard workload: no --micro"
    if args.clients != [1]:
        return "--scale measures 1 client; the 4-client target is `kvd bench --clients 4`"
    if args.events:
        return "--scale does not measure KV events"
    return ""


def blocks_for(args, R: int) -> int:
    """The pool for R requests: --blocks per -R requests (65,536 per 256 by default)."""
    return math.ceil(args.blocks * R / args.requests)


# ---- one R ----------------------------------------------------------------------------------------

def _one_repetition(a, spec, daemon, peer: VllmPeer, label: str) -> dict:
    d = Z.run_clients(a, spec, daemon.endpoint, daemon.pid, 1, label)
    e = Z.run_floor(a, spec, a.floor_iters)
    i = Z.run_inproc(a, spec)
    v, v_error = None, ""
    if peer.available:
        try:
            v = peer.run(spec, a.blocks, a.warmup)
        except RuntimeError as exc:
            v_error = str(exc)
    return {"daemon": d, "echo": e, "inproc": i, "vllm": v, "vllm_error": v_error}


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.median(xs)) if xs else None


def _row(reps: list[dict], blocks: int, vllm_ran: bool) -> dict:
    d = [r["daemon"] for r in reps]
    e = [r["echo"] for r in reps]
    i = [r["inproc"] for r in reps]
    v = [r["vllm"] for r in reps] if vllm_ran else []
    row = {
        "blocks": blocks,
        "inproc_p50_us": _median(x["inproc_step_p50_us"] for x in i),
        "inproc_p99_us": _median(x["inproc_step_p99_us"] for x in i),
        "daemon_p50_us": _median(x["decode_step_p50_us"] for x in d),
        "daemon_p99_us": _median(x["decode_step_p99_us"] for x in d),
        "echo_p50_us": _median(x["echo_p50_us"] for x in e),
        "echo_p99_us": _median(x["echo_p99_us"] for x in e),
        "echo_sleeping_p50_us": _median(x["echo_sleeping_p50_us"] for x in e),
        "vllm_p50_us": _median(x["step_p50_us"] for x in v) if vllm_ran else None,
        "vllm_p99_us": _median(x["step_p99_us"] for x in v) if vllm_ran else None,
        "vllm_schedule_p50_us": _median(x["schedule_p50_us"] for x in v) if vllm_ran else None,
        "daemon_cpu_per_step_us": _median(x.get("daemon_cpu_per_step_us") for x in d),
    }
    per_rep = [(dd["decode_step_p50_us"], ee["echo_p50_us"], ii["inproc_step_p50_us"]) for dd, ee, ii in zip(d, e, i)]
    extras = [dp - ep - ip for dp, ep, ip in per_rep]
    row["daemon_over_inproc"] = _median(dp / ip for dp, _, ip in per_rep)
    row["extra_us"] = _median(extras)
    row["extra_budget_us"] = EXTRA_BUDGET_US + EXTRA_BUDGET_FRAC * row["inproc_p50_us"]
    row["daemon_target_p50_us"] = row["echo_p50_us"] + row["inproc_p50_us"] + row["extra_budget_us"]
    # v is empty when vLLM did not run: the ratios are then None (n/a)
    row["vllm_over_inproc"] = _median(vv["step_p50_us"] / ip for vv, (_, _, ip) in zip(v, per_rep))
    row["vllm_over_daemon"] = _median(vv["step_p50_us"] / dp for vv, (dp, _, _) in zip(v, per_rep))
    row["runs_daemon_p50_us"] = [round(x[0], 1) for x in per_rep]
    row["runs_echo_p50_us"] = [round(x[1], 1) for x in per_rep]  # the floor varies run to run too
    row["runs_extra_us"] = [round(x, 1) for x in extras]
    return row


def _honesty(R: int, spec, reps: list[dict], vllm_ran: bool, mailbox: bool = False) -> dict:
    exp = Z.expected_figures(spec, 1)
    hits, blocks = exp["prefix_hit_tokens"], exp["blocks_after_decode"]
    d = [r["daemon"] for r in reps]
    h = {
        f"R{R}_daemon_all_admitted": all(x["admitted"] == R for x in d),
        f"R{R}_daemon_hits_match": all(x["prefix_hit_tokens"] == hits for x in d),
        f"R{R}_daemon_blocks_match": all(x["peak_blocks_used"] == blocks for x in d),
        f"R{R}_daemon_pool_free_after": all(x["pool_free_after"] for x in d),
        f"R{R}_daemon_no_errors": all(x["errors"] == 0 and x["append_no_space"] == 0 for x in d),
        f"R{R}_daemon_slot_mapping_ok": all(x["slot_mapping_ok"] for x in d),
        # hits, blocks after decode, slot mapping, no errors, pool free, manager invariants
        f"R{R}_inproc_honest": all(r["inproc"]["inproc_honest"] for r in reps),
    }
    if mailbox:
        h[f"R{R}_daemon_mailbox_granted"] = all(x["mailbox"] for x in d)
    if vllm_ran or any(r["vllm_error"] for r in reps):
        v = [r["vllm"] for r in reps]
        h[f"R{R}_vllm_ran"] = all(x is not None for x in v)
        v = [x for x in v if x is not None]
        h[f"R{R}_vllm_all_admitted"] = bool(v) and all(x["admitted"] == R and x["decode_allocs_ok"] for x in v)
        h[f"R{R}_vllm_hits_match"] = bool(v) and all(x["prefix_hit_tokens"] == hits for x in v)
        h[f"R{R}_vllm_blocks_match"] = bool(v) and all(x["peak_blocks_used"] == blocks for x in v)
        h[f"R{R}_vllm_pool_free_after"] = bool(v) and all(x["pool_free_after"] for x in v)
    return h


def measure(args, R: int, peer: VllmPeer) -> tuple[dict, dict, dict]:
    """(row, honesty, figures kept for the JSON) for R requests."""
    a = argparse.Namespace(**{**vars(args), "requests": R, "blocks": blocks_for(args, R)})
    spec = Z.spec_of(a)
    daemon = Z.DaemonProcess(a, spec, 1).start()
    reps = []
    try:
        for k in range(args.repeat):
            label = f"R={R} run {k + 1}/{args.repeat}"
            print(f"scale: {label}", file=sys.stderr, flush=True)
            reps.append(_one_repetition(a, spec, daemon, peer, label))
    except RuntimeError as exc:
        raise RuntimeError(f"R={R}: {exc}\ndaemon log tail:\n{daemon.tail()}") from None
    finally:
        exit_code = daemon.stop()
    vllm_ran = all(r["vllm"] is not None for r in reps)
    row = _row(reps, a.blocks, vllm_ran)
    honest = _honesty(R, spec, reps, vllm_ran, a.mailbox)
    honest[f"R{R}_daemon_clean_exit"] = exit_code == 0
    errors = sorted({r["vllm_error"] for r in reps if r["vllm_error"]})
    if errors:
        row["vllm_error"] = errors[0]
    exp = Z.expected_figures(spec, 1)
    checks = {"expected_prefix_hit_tokens": exp["prefix_hit_tokens"],
              "expected_blocks_after_decode": exp["blocks_after_decode"],
              "daemon_prefix_hit_tokens": [r["daemon"]["prefix_hit_tokens"] for r in reps],
              "daemon_peak_blocks_used": [r["daemon"]["peak_blocks_used"] for r in reps],
              "inproc_prefix_hit_tokens": [r["inproc"]["inproc_prefix_hit_tokens"] for r in reps],
              "inproc_peak_blocks_used": [r["inproc"]["inproc_peak_blocks_used"] for r in reps],
              "vllm_prefix_hit_tokens": [r["vllm"]["prefix_hit_tokens"] for r in reps if r["vllm"]],
              "vllm_peak_blocks_used": [r["vllm"]["peak_blocks_used"] for r in reps if r["vllm"]]}
    return row, honest, checks


# ---- the table ------------------------------------------------------------------------------------

def targets(table: dict) -> dict:
    t = {}
    for R, row in table.items():
        t[f"R{R}_extra_le_25us_plus_5pct"] = row["extra_us"] <= row["extra_budget_us"]
        t[f"R{R}_p99_le_2x_p50"] = row["daemon_p99_us"] <= P99_OVER_P50_MAX * row["daemon_p50_us"]
    return t


def _us(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}"


def _x(v) -> str:
    return "n/a" if v is None else f"{v:,.2f}"


def markdown(table: dict) -> str:
    """The table as Markdown (what the README shows)."""
    head = ["R", "kvd in-process p50 / p99 µs", "kvd daemon p50 / p99 µs", "zmq echo p50 / p99 µs (sleeping p50)",
            "vLLM p50 / p99 µs", "daemon / in-process", "extra µs (target)", "vLLM / kvd in-process",
            "vLLM / daemon"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for R, r in sorted(table.items(), key=lambda kv: int(kv[0])):
        ok = "met" if r["extra_us"] <= r["extra_budget_us"] else "missed"
        lines.append(
            f"| {int(R):,} | {_us(r['inproc_p50_us'])} / {_us(r['inproc_p99_us'])} "
            f"| {_us(r['daemon_p50_us'])} / {_us(r['daemon_p99_us'])} "
            f"| {_us(r['echo_p50_us'])} / {_us(r['echo_p99_us'])} ({_us(r['echo_sleeping_p50_us'])}) "
            f"| {_us(r['vllm_p50_us'])} / {_us(r['vllm_p99_us'])} | {_x(r['daemon_over_inproc'])} "
            f"| {_us(r['extra_us'])} ({_us(r['extra_budget_us'])}: {ok}) | {_x(r['vllm_over_inproc'])} "
            f"| {_x(r['vllm_over_daemon'])} |")
    return "\n".join(lines)


def _plot(path: str, table: dict) -> dict:
    if plots.pyplot() is None:
        return {"path": path, "written": False, "why": f"matplotlib is not installed: {plots.PLOT_HINT}"}
    plots.scaling(path, table, COLUMNS, target_key="daemon_target_p50_us")
    return {"path": path, "written": True}


def _on_term(signum, frame):
    raise KeyboardInterrupt  # stops the daemon and the peer like Ctrl-C does


def run_scale(args) -> int:
    """The ``--scale`` mode of ``kvd bench``: measure, print the table, one final JSON line."""
    why = _refused(args)
    if why:
        print(f"kvd bench: {why}", file=sys.stderr)
        return 2
    if args.plot and plots.pyplot() is None:  # said before the run, not after it
        print(f"kvd bench: --plot skipped: matplotlib is not installed; {plots.PLOT_HINT}", file=sys.stderr)
    spec = Z.spec_of(args)
    workload = {k: v for k, v in dataclasses.asdict(spec).items() if k not in ("num_requests", "num_blocks")}
    report: dict = {"bench": "scale", "load_avg_before": Z.load_avg(), "cpus": os.cpu_count(),
                    "config": {**workload, "R": list(args.scale), "blocks_per_requests": [args.blocks, args.requests],
                               "clients": 1, "repeat": args.repeat, "warmup": args.warmup,
                               "floor_iters": args.floor_iters, "mailbox": args.mailbox}}
    table, honest, checks = {}, {}, {}
    peer = None
    prev_term = signal.getsignal(signal.SIGTERM)
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        signal.signal(signal.SIGTERM, _on_term)
    try:
        peer = VllmPeer(enabled=args.vllm)
        report["vllm"] = ({"available": True, "version": peer.version} if peer.available
                          else {"available": False, "why": peer.why})
        if not peer.available:
            print(f"scale: vLLM column n/a: {peer.why}", file=sys.stderr)
        for R in args.scale:
            row, h, c = measure(args, R, peer)
            table[str(R)] = row
            honest.update(h)
            checks[str(R)] = c
    except KeyboardInterrupt:
        print("\nkvd bench: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:  # the rows measured so far still go out, with the error
        print(f"kvd bench: {e}", file=sys.stderr)
        report["error"] = str(e)
    finally:
        if peer is not None:
            if report.get("vllm", {}).get("available") and not peer.available:
                report["vllm"]["failed"] = peer.why  # it broke during the sitting
            peer.close()
        if main_thread:
            signal.signal(signal.SIGTERM, prev_term)
    report["load_avg_after"] = Z.load_avg()
    report["table"] = table
    report["checks"] = checks
    report["targets"] = targets(table)
    print(f"\nscaling table: 1 client, P={spec.prompt_len} S={spec.system_len} D={spec.decode_steps}, "
          f"{spec.hash_algo}, pool {args.blocks:,} blocks per {args.requests:,} requests, "
          f"median of {args.repeat} (extra = daemon - echo - in-process; target 25 µs + 5 % of in-process)\n")
    print(markdown(table))
    Z.print_table("targets (issue 13)", report["targets"])
    Z.print_table("honesty checks", honest)
    if args.plot and table:
        report["plot"] = _plot(args.plot, table)
    report["honest"] = honest
    report["ok"] = all(honest.values()) and "error" not in report
    print(json.dumps(report, default=float))
    return 0 if report["ok"] else 1
