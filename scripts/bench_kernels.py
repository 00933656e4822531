#!/usr/bin/env python3
"""Time kvd's kernels on a GPU against the two ceilings they are judged by, checking each result.

Ceilings, measured in the same run: an empty Triton kernel launch, and a large device-to-device
copy (bytes read + written per second). Every kernel is timed as the median of
``triton.testing.do_bench`` (events around one launch, L2 flushed before each) and as CUDA-graph
replay (100 launches captured in one graph, time per launch), and its output is compared exactly
with the numpy reference (or with torch indexing for the big copies) at the benchmarked size.

Prints a table, then one JSON line with every figure, the targets and the honesty checks.
Usage: python3 scripts/bench_kernels.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

import kvd_kernels as K
from kvd_kernels import copy as kcopy
from kvd_kernels import swap as kswap

MIB = 1 << 20
GRAPH_LAUNCHES = 100
results: dict = {"figures": {}, "checks": {}, "targets": {}, "errors": {}}
rows: list[tuple[str, str, str, str]] = []


@triton.jit
def _empty_kernel(x_ptr):
    pass


def bench_us(fn, rep=200):
    return do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e3


def graph_us(fn, launches=GRAPH_LAUNCHES):
    """Per-launch time of ``launches`` calls captured in one CUDA graph, median of 20 replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # compile and warm outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / launches)
    return statistics.median(times)


def host_us(fn, calls=2000):
    """Host time per call when launches are only enqueued: the wrapper's Python cost."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def record(name, us_bench, us_graph=None, note=""):
    results["figures"][name] = {"do_bench_us": round(us_bench, 3),
                                "graph_us": None if us_graph is None else round(us_graph, 3)}
    rows.append((name, f"{us_bench:9.2f}", "" if us_graph is None else f"{us_graph:9.2f}", note))


def section(fn):
    def run(*a, **kw):
        try:
            fn(*a, **kw)
        except Exception:  # keep measuring the others; the JSON says what broke
            results["errors"][fn.__name__] = traceback.format_exc(limit=4)
            print(traceback.format_exc(), file=sys.stderr)
    return run


@section
def ceilings(dev):
    x = torch.empty(1, device=dev)
    empty = lambda: _empty_kernel[(1,)](x)  # noqa: E731
    h = host_us(empty)
    results["figures"]["empty_launch_host_us"] = round(h, 2)
    record("empty_launch", bench_us(empty), graph_us(empty),
           f"ceiling: one Triton launch; host {h:.1f} us/launch")
    n = 1 << 30  # 1 GiB each side
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    a.random_()
    us = bench_us(lambda: b.copy_(a), rep=300)
    rate = 2 * n / (us * 1e-6) / 1e9
    results["figures"]["d2d_copy_GBps"] = round(rate, 1)
    rows.append(("d2d_copy 1 GiB", f"{us:9.2f}", "", f"ceiling: {rate:.0f} GB/s (read+write)"))
    results["checks"]["d2d_copy_equal"] = bool(torch.equal(a, b))
    del a, b
    pin = torch.empty(512 * MIB, dtype=torch.uint8).pin_memory()
    d = torch.empty(512 * MIB, dtype=torch.uint8, device=dev)
    for name, fn in (("h2d", lambda: d.copy_(pin, non_blocking=True)),
                     ("d2h", lambda: pin.copy_(d, non_blocking=True))):
        us = bench_us(fn, rep=300)
        rate = 512 * MIB / (us * 1e-6) / 1e9
        results["figures"][f"dma_{name}_512MiB_GBps"] = round(rate, 1)
        rows.append((f"dma {name} 512 MiB", f"{us:9.2f}", "", f"bus ceiling: {rate:.1f} GB/s"))


def slot_case(rng, dev, num_reqs, tokens_per_req, block_sizes=(16,), max_reqs=1024,
              max_model_len=8192, width=8192):
    tables = [rng.integers(0, 1 << 22, (max_reqs, max_model_len // bs), dtype=np.int32)
              for bs in block_sizes]
    rows_ = rng.permutation(max_reqs)[:num_reqs].astype(np.int32)
    lens = np.full(num_reqs, tokens_per_req, np.int32)
    starts = rng.integers(0, max_model_len - tokens_per_req + 1, num_reqs).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)]).astype(np.int64)
    want = np.empty((len(block_sizes), width), np.int64)
    K.slot_mapping_from_ranges_ref(tables, block_sizes, rows_, starts, lens, want)
    t = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
    return dict(tables=[t(x) for x in tables], np_tables=tables, rows=t(rows_), np_rows=rows_,
                qsl=t(qsl), pos=t(pos), want=want, block_sizes=list(block_sizes),
                starts=starts, lens=lens)


@section
def slot_mapping(dev):
    rng = np.random.default_rng(0)
    for name, b, n, bss in (("slot_mapping decode 256", 256, 1, (16,)),
                            ("slot_mapping prefill 8x1024", 8, 1024, (16,)),
                            ("slot_mapping prefill 1x8192", 1, 8192, (16,)),
                            ("slot_mapping decode 256, 2 groups", 256, 1, (16, 32))):
        c = slot_case(rng, dev, b, n, bss)
        out = torch.full(c["want"].shape, 0x5A5A5A5A, dtype=torch.int64, device=dev)
        fn = lambda: K.slot_mapping(c["tables"], c["block_sizes"], c["rows"], c["qsl"],  # noqa
                                    c["pos"], out)
        fn()
        torch.cuda.synchronize()
        results["checks"][f"{name} exact"] = bool(np.array_equal(out.cpu().numpy(), c["want"]))
        h = host_us(fn)
        results["figures"][f"{name} host_us"] = round(h, 2)
        record(name, bench_us(fn), graph_us(fn), f"wrapper; host {h:.1f} us/call")
        plan = K.SlotMappingPlan(c["tables"], c["block_sizes"], c["rows"], c["qsl"], c["pos"], out)
        pfn = lambda: plan(b)  # noqa: E731
        pfn()
        out.fill_(0x5A5A5A5A)
        pfn()
        torch.cuda.synchronize()
        results["checks"][f"{name} plan exact"] = bool(np.array_equal(out.cpu().numpy(), c["want"]))
        h = host_us(pfn)
        results["figures"][f"{name} plan host_us"] = round(h, 2)
        record(f"{name} plan", bench_us(pfn), graph_us(pfn),
               f"target <= 1.3x empty; host {h:.1f} us/call")
    # the daemon's CPU path, measured on this host's CPU
    c = slot_case(rng, "cpu", 256, 1)
    out = np.empty((1, 8192), np.int64)
    f = lambda: K.slot_mapping_from_ranges_ref(c["np_tables"], [16], c["np_rows"], c["starts"],  # noqa
                                               c["lens"], out)
    for _ in range(1000):
        f()
    t0 = time.perf_counter()
    for _ in range(20000):
        f()
    us = (time.perf_counter() - t0) / 20000 * 1e6
    results["figures"]["numpy from_ranges decode 256 (host CPU) us"] = round(us, 2)
    rows.append(("numpy from_ranges decode 256", f"{us:9.2f}", "", "host CPU, not GPU"))


@section
def block_tables(dev):
    rng = np.random.default_rng(1)
    c = slot_case(rng, dev, 256, 1)
    out_tables = [torch.full((256, t.shape[1]), -7, dtype=torch.int32, device=dev)
                  for t in c["tables"]]
    out_slots = torch.full((1, 8192), 0x5A5A5A5A, dtype=torch.int64, device=dev)
    fused = lambda: K.gather_slot_mapping(c["tables"], c["block_sizes"], c["rows"], c["qsl"],  # noqa
                                          c["pos"], out_tables, out_slots)
    fused()
    torch.cuda.synchronize()
    want_tables = [t[c["np_rows"]] for t in c["np_tables"]]
    results["checks"]["fused gather+slot exact"] = bool(
        np.array_equal(out_slots.cpu().numpy(), c["want"]) and
        all(np.array_equal(o.cpu().numpy(), w) for o, w in zip(out_tables, want_tables)))
    record("fused gather+slot decode 256 x 512 cols", bench_us(fused), graph_us(fused),
           f"wrapper; host {host_us(fused):.1f} us/call")
    plan = K.GatherSlotMappingPlan(c["tables"], c["block_sizes"], c["rows"], c["qsl"], c["pos"],
                                   out_tables, out_slots)
    pfn = lambda: plan(256)  # noqa: E731
    pfn()
    out_slots.fill_(0x5A5A5A5A)
    for o in out_tables:
        o.fill_(-7)
    pfn()
    torch.cuda.synchronize()
    results["checks"]["fused gather+slot plan exact"] = bool(
        np.array_equal(out_slots.cpu().numpy(), c["want"]) and
        all(np.array_equal(o.cpu().numpy(), w) for o, w in zip(out_tables, want_tables)))
    record("fused gather+slot decode 256 x 512 cols plan", bench_us(pfn), graph_us(pfn),
           f"target <= 1.6x empty; host {host_us(pfn):.1f} us/call")
    gather = lambda: K.gather_block_tables(c["tables"], c["rows"], out_tables)  # noqa
    record("gather 256 rows x 512 cols", bench_us(gather), graph_us(gather))

    # a decode step's appends: 256 changes of one block each, staged in pinned memory
    groups = np.zeros(256, np.int32)
    rows_ = c["np_rows"]
    starts = rng.integers(0, 512, 256).astype(np.int32)
    offsets = np.arange(257, dtype=np.int32)
    ids = rng.integers(0, 1 << 22, 256).astype(np.int32)
    staged = [torch.from_numpy(a).pin_memory() for a in (groups, rows_, starts, offsets, ids)]
    on_dev = [a.to(dev) for a in staged]
    want = [t.copy() for t in c["np_tables"]]
    K.apply_block_table_updates_ref(want, groups, rows_, starts, offsets, ids)
    for name, args in (("pinned", staged), ("device", on_dev)):
        tables = [t.clone() for t in c["tables"]]
        fn = lambda: K.apply_block_table_updates(tables, *args)  # noqa
        fn()
        torch.cuda.synchronize()
        results["checks"][f"updates from {name} exact"] = bool(
            all(np.array_equal(t.cpu().numpy(), w) for t, w in zip(tables, want)))
        record(f"table updates 256x1 from {name}", bench_us(fn),
               graph_us(fn) if name == "device" else None)


def kv_pool(dev, num_blocks, layers=32, pin=False):
    pool = torch.empty((layers, 2, num_blocks, 16, 8, 128), dtype=torch.bfloat16,
                       device="cpu" if pin else dev)
    if pin:  # the host pool is written before it is read; its initial bytes do not matter
        return pool.pin_memory()
    pool.view(torch.int16).random_(-30000, 30000)
    return pool


@section
def copy_blocks(dev):
    pool = kv_pool(dev, 1024)  # 2 GiB
    rng = np.random.default_rng(2)
    ids = rng.permutation(1024)[:512]
    mapping = torch.from_numpy(np.stack([ids[:256], ids[256:]], 1).astype(np.int64)).to(dev)
    src, dst = mapping[:, 0], mapping[:, 1]
    moved = 2 * 256 * 2 * MIB  # bytes read + written
    d2d = results["figures"].get("d2d_copy_GBps")
    best = None
    for block, warps in ((1024, 4), (2048, 4), (4096, 8), (8192, 8)):
        fn = lambda: K.copy_blocks(pool, mapping, 2, block=block, num_warps=warps)  # noqa
        us = bench_us(fn, rep=300)
        rate = moved / (us * 1e-6) / 1e9
        results["figures"][f"copy_blocks_{block}x{warps}w_GBps"] = round(rate, 1)
        pct = f"{100 * rate / d2d:.0f}% of d2d" if d2d else ""
        rows.append((f"copy 256x2MiB BLOCK={block} warps={warps}", f"{us:9.2f}", "",
                     f"{rate:.0f} GB/s {pct}"))
        if best is None or rate > best[0]:
            best = (rate, block, warps)
    results["figures"]["copy_blocks_best"] = {"GBps": round(best[0], 1), "block": best[1],
                                              "warps": best[2]}
    if d2d:
        results["figures"]["copy_blocks_default_pct_of_d2d"] = round(
            100 * results["figures"][f"copy_blocks_{kcopy.COPY_BLOCK}x{kcopy.COPY_WARPS}w_GBps"]
            / d2d, 1)
    # correctness: against torch indexing on a copy of the pool, every element compared
    before = pool.clone()
    before[:, :, dst] = before[:, :, src]
    K.copy_blocks(pool, mapping, 2)
    torch.cuda.synchronize()
    results["checks"]["copy_blocks exact (whole pool)"] = bool(
        torch.equal(pool.view(torch.int16), before.view(torch.int16)))
    del before

    def torch_index():
        pool[:, :, dst] = pool[:, :, src]
    us = bench_us(torch_index, rep=300)
    rate = moved / (us * 1e-6) / 1e9
    results["figures"]["copy_torch_indexing_GBps"] = round(rate, 1)
    rows.append(("copy 256x2MiB torch indexing", f"{us:9.2f}", "", f"{rate:.0f} GB/s baseline"))


@section
def swap(dev):
    gpu = kv_pool(dev, 1024)
    host = kv_pool(dev, 512, pin=True)  # 1 GiB pinned
    rng = np.random.default_rng(3)
    n = 256
    out_map = torch.from_numpy(np.stack([rng.permutation(1024)[:n], rng.permutation(512)[:n]],
                                        1).astype(np.int64)).pin_memory()
    in_map = torch.from_numpy(np.stack([out_map[:, 1].numpy(),
                                        rng.permutation(1024)[:n]], 1)).pin_memory()
    nbytes = n * 2 * MIB
    for direction, (src, dst, m) in (("d2h", (gpu, host, out_map)),
                                     ("h2d", (host, gpu, in_map))):
        for method in ("kernel", "dma"):
            fn = lambda: K.swap_blocks(src, dst, m, 2, method=method)  # noqa
            us = bench_us(fn, rep=500)
            rate = nbytes / (us * 1e-6) / 1e9
            results["figures"][f"swap_{direction}_{method}_GBps"] = round(rate, 1)
            rows.append((f"swap {direction} 256x2MiB {method} (32 KiB regions)", f"{us:9.2f}",
                         "", f"{rate:.1f} GB/s"))
    # correctness of the round trip: GPU blocks -> host -> other GPU blocks, for both methods
    o, i = out_map.numpy(), in_map.numpy()
    for method in ("kernel", "dma"):
        gpu.view(torch.int16).random_(-30000, 30000)
        before = gpu[:, :, torch.from_numpy(o[:, 0]).to(dev)].clone()
        K.swap_blocks(gpu, host, out_map, 2, method=method)
        K.swap_blocks(host, gpu, in_map, 2, method=method)
        torch.cuda.synchronize()
        results["checks"][f"swap round trip exact ({method})"] = bool(torch.equal(
            before.view(torch.int16), gpu[:, :, torch.from_numpy(i[:, 1]).to(dev)].view(torch.int16)))
        del before
    del gpu, host

    # the baseline of the issue: one copy per block, block-major pools (2 MiB contiguous blocks)
    gpu_bm = torch.empty((1024, 2 * MIB // 8), dtype=torch.int64, device=dev).random_()
    host_bm = torch.empty((512, 2 * MIB // 8), dtype=torch.int64).pin_memory()
    o = out_map.numpy()

    def per_block_loop():
        for s, d in o.tolist():
            host_bm[d].copy_(gpu_bm[s], non_blocking=True)
    us = bench_us(per_block_loop, rep=300)
    results["figures"]["swap_d2h_loop_per_block_GBps"] = round(nbytes / (us * 1e-6) / 1e9, 1)
    rows.append(("swap d2h per-block copy_ loop", f"{us:9.2f}", "",
                 f"{nbytes / (us * 1e-6) / 1e9:.1f} GB/s baseline"))
    del gpu_bm, host_bm

    # crossover: contiguous region size at which DMA calls beat the zero-copy kernel
    total = 256 * MIB
    cross = {}
    for region in (32 * 1024, 128 * 1024, 512 * 1024, 2 * MIB, 8 * MIB):
        nb = total // region
        g = torch.empty((2 * nb, region // 8), dtype=torch.int64, device=dev).random_()
        h = torch.empty((2 * nb, region // 8), dtype=torch.int64).pin_memory()
        mp = torch.from_numpy(np.stack([rng.permutation(2 * nb)[:nb], rng.permutation(2 * nb)[:nb]],
                                       1).astype(np.int64)).pin_memory()
        entry = {}
        for direction, (src, dst) in (("d2h", (g, h)), ("h2d", (h, g))):
            for method in ("kernel", "dma"):
                us = bench_us(lambda: K.swap_blocks(src, dst, mp, 0, method=method), rep=300)
                entry[f"{direction}_{method}_GBps"] = round(total / (us * 1e-6) / 1e9, 1)
        cross[region] = entry
        rows.append((f"swap crossover region {region // 1024} KiB", "", "",
                     " ".join(f"{k}={v}" for k, v in entry.items())))
        del g, h
    results["figures"]["swap_crossover"] = cross


def main():
    ap = argparse.ArgumentParser()
    ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    results["device"] = {"name": props.name, "sms": props.multi_processor_count,
                         "torch": torch.__version__, "triton": triton.__version__,
                         "interpret": os.environ.get("TRITON_INTERPRET", "")}
    ceilings(dev)
    slot_mapping(dev)
    block_tables(dev)
    copy_blocks(dev)
    swap(dev)

    f = results["figures"]
    empty = f.get("empty_launch", {})

    def ratio(name, key):
        if name in f and empty.get(key):
            return round(f[name][key] / empty[key], 2)
        return None
    t = results["targets"]
    for name, limit in (("slot_mapping decode 256 plan", 1.3),
                        ("slot_mapping prefill 8x1024 plan", 1.3),
                        ("fused gather+slot decode 256 x 512 cols plan", 1.6),
                        ("slot_mapping decode 256", 1.3), ("slot_mapping prefill 8x1024", 1.3),
                        ("fused gather+slot decode 256 x 512 cols", 1.6)):
        for key in ("do_bench_us", "graph_us"):
            r = ratio(name, key)
            t[f"{name} / empty ({key})"] = {"ratio": r, "limit": limit,
                                           "met": r is not None and r <= limit}
    pct = f.get("copy_blocks_default_pct_of_d2d")
    t["copy_blocks >= 90% of d2d"] = {"pct": pct, "met": pct is not None and pct >= 90}
    for d in ("d2h", "h2d"):
        best = max(f.get(f"swap_{d}_kernel_GBps", 0), f.get(f"swap_{d}_dma_GBps", 0))
        t[f"swap {d} >= 50 GB/s"] = {"GBps_kernel": f.get(f"swap_{d}_kernel_GBps"),
                                     "GBps_dma": f.get(f"swap_{d}_dma_GBps"),
                                     "met": best >= 50}
    results["checks"]["all_exact"] = all(v for k, v in results["checks"].items() if k != "all_exact")

    print(f"\n{'case':58s} {'do_bench us':>11s} {'graph us':>9s}  note")
    for name, a, b, note in rows:
        print(f"{name:58s} {a:>11s} {b:>9s}  {note}")
    print(json.dumps(results, sort_keys=False, default=str))


if __name__ == "__main__":
    main()
