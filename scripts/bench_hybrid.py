#!/usr/bin/env python3
"""A hybrid model's decode step (full attention beside a sliding window) in process: kvd's
``BlockManager`` against vLLM 0.33.0's ``KVCacheManager`` (its hybrid coordinator) on the same pool
and the same steps.

R requests of staggered lengths (``--prompt`` + i % 16 tokens: every step some fill a block) each
decode one token a step, ``--steps`` times after ``--warmup``:

* kvd: ``decode_rows`` (the daemon's entry: appends by row, each group's hashes of the blocks that
  filled, computed beforehand as kvd's client sends them), the writer's confirmation of the step,
  its deferred prefix-cache work run after the timing (the daemon runs it after its reply);
* vLLM: its ``Scheduler``'s calls (``kvd/bench/vllm_peer.py``'s step, which drives the one-group
  manager of the scaling table):
  the output phase, ``append_output_token_ids`` (which hashes a filled block), and the schedule
  phase, ``allocate_slots(req, 1)`` and the new block ids per request. The schedule phase is the
  figure to compare (kvd's time excludes hashing too).

vLLM runs in a process of its own (it imports torch). Prints a table and ONE JSON line with honesty
checks: every allocation succeeded on both sides, both hold the same number of blocks after the
decode steps (kvd's window release and vLLM's skipped-block removal free the same blocks), both
pools free after the requests are freed.

    python scripts/bench_hybrid.py                        # R = 256, 1,024-token prompts, 16,16:1024
    python scripts/bench_hybrid.py --pools "16,16;16,16:1024" -R 64
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from kvd.config import _parse_kv_groups  # noqa: E402


def _blocks(args, groups) -> int:
    longest = args.prompt + 16 + args.warmup + args.steps
    return args.requests * sum(-(-longest // bs) + 1 for bs, _ in groups) + 64


def _lengths(args) -> np.ndarray:
    return args.prompt + np.arange(args.requests) % 16


def run_kvd(args, groups) -> dict:
    from kvd.api import AdmitRequest, GroupSpec, ManagerConfig, StepBatch
    from kvd.manager import BlockManager

    R, sizes = args.requests, [bs for bs, _ in groups]
    m = BlockManager(ManagerConfig(num_gpu_blocks=_blocks(args, groups), max_num_reqs=R + 8, max_model_len=8192,
                                   groups=tuple(GroupSpec(bs, sliding_window=w or None) for bs, w in groups),
                                   defer_cache_registration=True))
    serial = [0]

    def new_hashes(k: int) -> np.ndarray:  # unique 16-byte values: what they hash does not matter here
        serial[0] += k
        return np.arange(serial[0] - k, serial[0], dtype=np.int64).astype("<i8").view("S8").astype("S16")

    writer = 1  # a daemon session's: its registrations wait for its confirmations
    lengths = _lengths(args)
    res = m.step(StepBatch(admit=[AdmitRequest(i, int(lengths[i]), [new_hashes(int(lengths[i]) // bs) for bs in sizes])
                                  for i in range(R)]), writer=writer)
    ok = not res.admit_status.any()
    m.flush_deferred()
    rows = m.rows_of(list(range(R)))
    times = []
    for d in range(args.warmup + args.steps):
        n = lengths + 1
        counts = tuple((n % bs == 0).astype(np.int32) for bs in sizes)
        hashes = tuple(new_hashes(int(c.sum())) for c in counts)
        t0 = time.perf_counter_ns()
        out = m.decode_rows(rows, 1, 0, hashes, counts)
        m.mark_computed(writer, m.tick)
        t1 = time.perf_counter_ns()
        ok &= out is not None
        m.flush_deferred()
        lengths = n
        if d >= args.warmup:
            times.append((t1 - t0) / 1e3)
    held = m.pool.num_blocks - 1 - m.pool.num_free
    for i in range(R):
        m.free(i)
    m.check_invariants(heavy=True)
    return dict(step_p50_us=float(np.median(times)), step_p99_us=float(np.percentile(times, 99)), allocs_ok=bool(ok),
                blocks_held_after_decode=int(held), pool_free_after=m.pool.num_free == m.pool.num_blocks - 1)


def run_vllm(args, groups) -> dict:
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.request import Request, RequestStatus

    from kvd.bench.vllm_peer import scheduler_step  # the Scheduler's calls of one decode step

    specs = []
    for i, (bs, w) in enumerate(groups):
        kw = dict(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)
        spec = SlidingWindowSpec(sliding_window=w, **kw) if w else FullAttentionSpec(**kw)
        specs.append(KVCacheGroupSpec([f"layer{i}"], spec))
    num_blocks = _blocks(args, groups)
    sizes = [bs for bs, _ in groups]
    kv = KVCacheManager(KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs),
                        max_model_len=8192, scheduler_block_size=math.lcm(*sizes), hash_block_size=math.gcd(*sizes),
                        enable_caching=True, log_stats=False)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(math.gcd(*sizes), hash_fn)
    params = SamplingParams(max_tokens=args.warmup + args.steps + 8)
    rng = np.random.default_rng(0)
    lengths = _lengths(args)
    reqs = [Request(f"r{i}", rng.integers(0, 50_000, int(lengths[i])).tolist(), params, None, block_hasher=hasher)
            for i in range(args.requests)]
    free0 = kv.block_pool.get_num_free_blocks()
    ok = True
    for r in reqs:
        blocks, hit, _ = kv.get_computed_blocks(r)
        ok &= kv.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
        r.status = RequestStatus.RUNNING
        r.num_computed_tokens = r.num_tokens
    gc.collect()
    gc.freeze()  # as vLLM's EngineCore does after start-up
    step, sched = [], []
    try:
        for d in range(args.warmup + args.steps):
            step_ns, sched_ns, step_ok = scheduler_step(kv, reqs, rng.integers(0, 50_000, args.requests).tolist())
            ok &= step_ok
            if d >= args.warmup:
                step.append(step_ns / 1e3)
                sched.append(sched_ns / 1e3)
        held = free0 - kv.block_pool.get_num_free_blocks()
        for r in reqs:
            kv.free(r)
    finally:
        gc.unfreeze()
    return dict(schedule_p50_us=float(np.median(sched)), schedule_p99_us=float(np.percentile(sched, 99)),
                step_p50_us=float(np.median(step)), allocs_ok=bool(ok), blocks_held_after_decode=int(held),
                pool_free_after=kv.block_pool.get_num_free_blocks() == free0)


def _vllm_child(args, groups, q) -> None:
    try:
        q.put(("ok", run_vllm(args, groups)))
    except Exception as e:  # noqa: BLE001 - reported: the JSON says why there is no vLLM column
        q.put(("error", f"{type(e).__name__}: {e}"))


def vllm_figures(args, groups) -> tuple[dict | None, str]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_vllm_child, args=(args, groups, q))
    p.start()
    try:
        kind, out = q.get(timeout=600)
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    return (out, "") if kind == "ok" else (None, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", "-R", type=int, default=256)
    ap.add_argument("--prompt", "-P", type=int, default=1024)
    ap.add_argument("--pools", default="16,16:1024", help="kvd serve --kv-groups specs, ';' between pools")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    args = ap.parse_args(argv)
    results, checks = {}, {}
    for spec in args.pools.split(";"):
        groups = _parse_kv_groups(spec)
        k = run_kvd(args, groups)
        v, why = vllm_figures(args, groups)
        results[spec] = {"kvd": k, "vllm": v, "vllm_why": why,
                         "vllm_schedule_over_kvd": round(v["schedule_p50_us"] / k["step_p50_us"], 2) if v else None}
        checks[f"{spec}: kvd_allocs_ok"] = k["allocs_ok"]
        checks[f"{spec}: kvd_pool_free_after"] = k["pool_free_after"]
        if v is not None:
            checks[f"{spec}: vllm_allocs_ok"] = v["allocs_ok"]
            checks[f"{spec}: vllm_pool_free_after"] = v["pool_free_after"]
            checks[f"{spec}: same_blocks_held_after_decode"] = k["blocks_held_after_decode"] == v["blocks_held_after_decode"]
    print(f"R={args.requests} P={args.prompt} (staggered), one token a step; median of {args.steps} steps (µs):")
    print(f"{'pool (--kv-groups)':20s} {'kvd decode_rows':>16s} {'vLLM schedule':>14s} {'vLLM step':>10s} {'vLLM / kvd':>10s}")
    for spec, r in results.items():
        v = r["vllm"] or {}
        print(f"{spec:20s} {r['kvd']['step_p50_us']:16.1f} {v.get('schedule_p50_us', float('nan')):14.1f} "
              f"{v.get('step_p50_us', float('nan')):10.1f} {r['vllm_schedule_over_kvd'] or float('nan'):10.2f}"
              + (f"   (vLLM: {r['vllm_why']})" if r["vllm"] is None else ""))
    out = {"bench": "hybrid", "config": vars(args), "pools": results, "checks": checks, "ok": all(checks.values())}
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
