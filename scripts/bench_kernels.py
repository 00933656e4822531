#!/usr/bin/env python3
"""Time kvd's kernels on a GPU against the two ceilings they are judged by, checking each result.

Ceilings, measured in the same run: an empty Triton kernel launch, and a large device-to-device
copy (bytes read + written per second). Every kernel is timed as the median of
``triton.testing.do_bench`` (events around one launch, L2 flushed before each) and as CUDA-graph
replay (100 launches captured in one graph, time per launch), and its output is compared exactly
with the numpy reference (or with torch indexing for the big copies) at the benchmarked size.

Prints a table, then one JSON line with every figure, the targets and the honesty checks.
Usage: python3 scripts/bench_kernels.py [--only SECTION,...] [--no-sweep]
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
from kvd_kernels.attention import attention_config

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


def paged_cache(dev, num_reqs, ctx, h_kv, d=128, block_size=16, dtype=torch.bfloat16, seed=4):
    """One layer's paged cache holding num_reqs contexts of ctx tokens at random blocks, with the
    same K/V contiguous as [num_reqs, h_kv, ctx, d] (the layout SDPA reads best)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    per = -(-ctx // block_size)
    num_blocks = 1 + num_reqs * per
    k = torch.randn(num_reqs, h_kv, ctx, d, device=dev, dtype=dtype, generator=g)
    v = torch.randn(num_reqs, h_kv, ctx, d, device=dev, dtype=dtype, generator=g)
    ids = (torch.randperm(num_blocks - 1, device=dev, generator=g) + 1).to(torch.int32)
    table = ids.view(num_reqs, per)
    kv = torch.empty((2, num_blocks, block_size, h_kv, d), device=dev, dtype=dtype)
    kv[:, 0] = float("nan")  # the null block: never read
    pad = per * block_size - ctx
    for i, x in enumerate((k, v)):
        tok = torch.nn.functional.pad(x.transpose(1, 2), (0, 0, 0, 0, 0, pad))  # [R, per*bs, H, D]
        kv[i, table.long()] = tok.reshape(num_reqs, per, block_size, h_kv, d)
    return kv, table, k, v


@section
def write_kv(dev):
    h, d, bs = 8, 128, 16
    kv = torch.zeros((2, 8192, bs, h, d), dtype=torch.bfloat16, device=dev)  # 512 MiB layer
    d2d = results["figures"].get("d2d_copy_GBps")
    for t in (256, 8192, 65536):
        key = torch.randn(t, h, d, dtype=torch.bfloat16, device=dev)
        value = torch.randn(t, h, d, dtype=torch.bfloat16, device=dev)
        # prefill-like: each request's tokens fill whole blocks, blocks scattered over the pool
        blocks = torch.randperm(8192, device=dev)[:-(-t // bs)]
        slots = (blocks[:, None] * bs + torch.arange(bs, device=dev)).flatten()[:t].clone()
        slots[::97] = K.PAD_SLOT_ID
        fn = lambda: K.write_kv(key, value, kv, slots)  # noqa: E731
        us = bench_us(fn, rep=300)
        src = torch.cat([key.flatten(), value.flatten()])
        dst = torch.empty_like(src)
        copy_us = bench_us(lambda: dst.copy_(src), rep=300)
        moved = 2 * src.numel() * src.element_size()  # read + write
        rate = moved / (us * 1e-6) / 1e9
        pct = 100 * copy_us / us
        name = f"write_kv {t} tokens x {h}x{d} bf16"
        results["figures"][f"{name} GBps"] = round(rate, 1)
        results["figures"][f"{name} pct_of_copy"] = round(pct, 1)
        record(name, us, graph_us(fn), f"{rate:.0f} GB/s, {pct:.0f}% of the same bytes' copy "
               f"({copy_us:.1f} us)" + (f", d2d {d2d:.0f}" if d2d else ""))
        kv.zero_()
        want = torch.zeros_like(kv)
        K.write_kv_ref(key, value, want, slots)
        fn()
        torch.cuda.synchronize()
        results["checks"][f"{name} exact"] = bool(torch.equal(kv.view(torch.int16),
                                                              want.view(torch.int16)))
        del want


def sdpa_decode_us(q, k, v, scale):
    """Best of two SDPA formulations of the same decode attention on a contiguous cache."""
    r, h_q, d = q.shape
    h_kv = k.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # a decode query attends to its whole context: the GQA group can ride as the query length
    grouped = lambda: sdpa(q.view(r, h_kv, h_q // h_kv, d), k, v, scale=scale)  # noqa: E731
    gqa = lambda: sdpa(q.view(r, h_q, 1, d), k, v, scale=scale, enable_gqa=True)  # noqa: E731
    times = {"grouped": bench_us(grouped), "enable_gqa": bench_us(gqa)}
    best = min(times, key=times.get)
    out = grouped().reshape(r, h_q, d)
    return times, best, out


@section
def decode_attention(dev, sweep=True):
    d2d = results["figures"].get("d2d_copy_GBps")
    for num_reqs, ctx, h_q, h_kv in ((256, 1024, 32, 8), (64, 1024, 32, 8), (256, 1024, 16, 4),
                                     (64, 1024, 16, 4), (8, 16384, 32, 8)):
        kv, table, k, v = paged_cache(dev, num_reqs, ctx, h_kv)
        q = torch.randn(num_reqs, h_q, 128, dtype=torch.bfloat16, device=dev)
        scale = 128 ** -0.5
        lens = torch.full((num_reqs,), ctx, dtype=torch.int32, device=dev)
        qsl = torch.arange(num_reqs + 1, dtype=torch.int32, device=dev)
        out = torch.empty_like(q)
        name = f"decode attn {num_reqs}x{ctx} {h_q}/{h_kv} d128 bf16"
        sdpa_times, best, want = sdpa_decode_us(q, k, v, scale)
        cfg = attention_config(num_reqs, num_reqs, h_q, h_kv, table.shape[1] * 16, q.device)
        variants = {"default": {}}
        if sweep:
            for splits in (1, 2, 4, 8):
                for bn in (32, 64, 128):
                    variants[f"splits{splits}_bn{bn}"] = dict(num_splits=splits, block_n=bn)
        timing = {}
        for vname, tuning in variants.items():
            fn = lambda: K.paged_attention_triton(q, kv, table, lens, qsl, scale=scale,  # noqa
                                                  out=out, **tuning)
            try:
                timing[vname] = bench_us(fn)
            except Exception as e:  # a tiling that does not fit is reported, not fatal
                timing[vname] = None
                results["errors"][f"{name} {vname}"] = repr(e)[:300]
        fn = lambda: K.paged_attention(q, kv, table, lens, qsl, scale=scale, out=out)  # noqa
        us = timing["default"]
        g_us = graph_us(fn)
        nbytes = 2 * k.numel() * k.element_size()
        rate = nbytes / (us * 1e-6) / 1e9
        ratio = us / sdpa_times[best]
        results["figures"][name] = {
            "do_bench_us": round(us, 2), "graph_us": round(g_us, 2), "config": cfg,
            "GBps": round(rate, 1), "pct_of_d2d": round(100 * rate / d2d, 1) if d2d else None,
            "sdpa_us": {k_: round(x, 2) for k_, x in sdpa_times.items()}, "sdpa_best": best,
            "ratio_vs_sdpa": round(ratio, 3),
            "sweep_us": {k_: (None if x is None else round(x, 2)) for k_, x in timing.items()}}
        rows.append((name, f"{us:9.2f}", f"{g_us:9.2f}",
                     f"{rate:.0f} GB/s; SDPA {best} {sdpa_times[best]:.1f} us -> {ratio:.2f}x"))
        ok = [x for x in timing.values() if x is not None]
        rows.append((f"  sweep best of {len(ok)}", f"{min(ok):9.2f}", "",
                     min((x, n) for n, x in timing.items() if x is not None)[1]))
        fn()
        torch.cuda.synchronize()
        err = (out.float() - want.float()).abs().max().item()
        results["checks"][f"{name} vs SDPA max_abs_err {err:.4f} <= 1.5e-2"] = err <= 1.5e-2
        results["targets"][f"{name} <= 1.5x SDPA"] = {"ratio": round(ratio, 3), "met": ratio <= 1.5}
        del kv, k, v


@section
def prefill_attention(dev):
    """Prefill and chunked prefill (reported; no target): 8 requests x 1024 new tokens, GQA 32/8,
    against SDPA's causal flash on contiguous K/V; and 8 x 512 new tokens after 1536 cached."""
    for num_reqs, ctx, new in ((8, 1024, 1024), (8, 2048, 512)):
        h_q, h_kv = 32, 8
        kv, table, k, v = paged_cache(dev, num_reqs, ctx, h_kv)
        q = torch.randn(num_reqs * new, h_q, 128, dtype=torch.bfloat16, device=dev)
        scale = 128 ** -0.5
        lens = torch.full((num_reqs,), ctx, dtype=torch.int32, device=dev)
        qsl = torch.arange(0, num_reqs * new + 1, new, dtype=torch.int32, device=dev)
        out = torch.empty_like(q)
        fn = lambda: K.paged_attention(q, kv, table, lens, qsl, scale=scale, out=out)  # noqa
        us = bench_us(fn)
        sweep = {}
        for bm, bn, warps, stages in ((64, 32, 4, None), (64, 64, 4, None), (128, 32, 8, None),
                                      (128, 64, 8, None), (128, 64, 4, None), (64, 64, 4, 2),
                                      (128, 64, 8, 2), (128, 128, 8, 2)):
            vname = f"m{bm}_n{bn}_w{warps}_s{stages}"
            try:
                sweep[vname] = round(bench_us(lambda: K.paged_attention_triton(  # noqa
                    q, kv, table, lens, qsl, scale=scale, out=out, block_m=bm, block_n=bn,
                    num_warps=warps, num_stages=stages)), 2)
            except Exception as e:  # e.g. out of shared memory: reported, not fatal
                sweep[vname] = None
                results["errors"][f"prefill {vname}"] = repr(e)[:300]
        name = f"prefill attn {num_reqs}x{new} new of {ctx} {h_q}/{h_kv} d128 bf16"
        qd = q.view(num_reqs, new, h_q, 128).transpose(1, 2)
        mask = (torch.arange(ctx - new, ctx, device=dev)[:, None] >=
                torch.arange(ctx, device=dev)[None, :])
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if new == ctx:
            ref = lambda: sdpa(qd, k, v, scale=scale, is_causal=True, enable_gqa=True)  # noqa
        else:
            ref = lambda: sdpa(qd, k, v, scale=scale, attn_mask=mask, enable_gqa=True)  # noqa
        s_us = bench_us(ref)
        flops = 4 * num_reqs * h_q * 128 * (new * (ctx - new) + new * (new + 1) / 2)
        results["figures"][name] = {"do_bench_us": round(us, 2), "sdpa_us": round(s_us, 2),
                                    "TFLOPs": round(flops / (us * 1e-6) / 1e12, 1),
                                    "sweep_us": sweep}
        rows.append((name, f"{us:9.2f}", "", f"SDPA {s_us:.1f} us; "
                     f"{flops / (us * 1e-6) / 1e12:.0f} TFLOP/s"))
        ok = {k_: x for k_, x in sweep.items() if x is not None}
        if ok:
            rows.append((f"  sweep best of {len(ok)}", f"{min(ok.values()):9.2f}", "",
                         min(ok, key=ok.get)))
        fn()
        want = ref().transpose(1, 2).reshape(num_reqs * new, h_q, 128)
        torch.cuda.synchronize()
        err = (out.float() - want.float()).abs().max().item()
        results["checks"][f"{name} vs SDPA max_abs_err {err:.4f} <= 1.5e-2"] = err <= 1.5e-2
        del kv, k, v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated sections to run after the "
                    "ceilings (default: all), e.g. write_kv,decode_attention,prefill_attention")
    ap.add_argument("--no-sweep", action="store_true", help="decode attention: default tiling only")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    results["device"] = {"name": props.name, "sms": props.multi_processor_count,
                         "torch": torch.__version__, "triton": triton.__version__,
                         "interpret": os.environ.get("TRITON_INTERPRET", "")}
    ceilings(dev)
    for name, fn in (("slot_mapping", slot_mapping), ("block_tables", block_tables),
                     ("copy_blocks", copy_blocks), ("swap", swap), ("write_kv", write_kv),
                     ("decode_attention", lambda d: decode_attention(d, not args.no_sweep)),
                     ("prefill_attention", prefill_attention)):
        if not only or name in only:
            fn(dev)

    f = results["figures"]
    empty = f.get("empty_launch", {})

    def ratio(name, key):
        if name in f and empty.get(key):
            return round(f[name][key] / empty[key], 2)
        return None
    t = results["targets"]
    ran = lambda section: not only or section in only  # noqa: E731
    for name, limit in (("slot_mapping decode 256 plan", 1.3),
                        ("slot_mapping prefill 8x1024 plan", 1.3),
                        ("fused gather+slot decode 256 x 512 cols plan", 1.6),
                        ("slot_mapping decode 256", 1.3), ("slot_mapping prefill 8x1024", 1.3),
                        ("fused gather+slot decode 256 x 512 cols", 1.6)):
        for key in ("do_bench_us", "graph_us"):
            if not ran("block_tables" if "gather" in name else "slot_mapping"):
                continue
            r = ratio(name, key)
            t[f"{name} / empty ({key})"] = {"ratio": r, "limit": limit,
                                           "met": r is not None and r <= limit}
    pct = f.get("copy_blocks_default_pct_of_d2d")
    if ran("copy_blocks"):
        t["copy_blocks >= 90% of d2d"] = {"pct": pct, "met": pct is not None and pct >= 90}
    for d in ("d2h", "h2d") if ran("swap") else ():
        best = max(f.get(f"swap_{d}_kernel_GBps", 0), f.get(f"swap_{d}_dma_GBps", 0))
        t[f"swap {d} >= 50 GB/s"] = {"GBps_kernel": f.get(f"swap_{d}_kernel_GBps"),
                                     "GBps_dma": f.get(f"swap_{d}_dma_GBps"),
                                     "met": best >= 50}
    for name, v in f.items():
        if name.startswith("write_kv 65536") and name.endswith("pct_of_copy"):
            t["write_kv >= 80% of the copy ceiling (65536 tokens)"] = {"pct": v, "met": v >= 80}
    results["checks"]["all_exact"] = all(v for k, v in results["checks"].items() if k != "all_exact")

    print(f"\n{'case':58s} {'do_bench us':>11s} {'graph us':>9s}  note")
    for name, a, b, note in rows:
        print(f"{name:58s} {a:>11s} {b:>9s}  {note}")
    print(json.dumps(results, sort_keys=False, default=str))


if __name__ == "__main__":
    main()
