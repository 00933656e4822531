#!/usr/bin/env python3
"""In-process benchmark of the BlockManager on the standard workload (docs/WORKLOAD.md).

Phases (each timed on its own): prompt hashing, admission (one step with every request), decode
(D steps: one token appended to every request, blocks that fill hashed and registered, slot
mapping of the step's tokens), free (one step). Variants: --blocks N (eviction), and the issue-3
figures (fork of one request into 8 children + a decode step; swap-out/in of 64 requests).

Prints a table per phase and one final JSON line with the figures and the honesty checks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from kvd import rowloops, sha256loop
from kvd.api import PAD_SLOT_ID, AdmitRequest, GroupSpec, ManagerConfig, StepBatch
from kvd.hashing import hash_next_blocks, hash_prompt
from kvd.manager import BlockManager, warm_up
from kvd.pool import BlockPool
from kvd.workload import WorkloadSpec, make_workload

try:
    from kvd_kernels import slot_mapping_from_ranges_ref
except ImportError:  # the kernels package is not installed: same formula, inline
    def slot_mapping_from_ranges_ref(block_tables, block_sizes, req_rows, start_pos, num_tokens, out):
        total = int(num_tokens.sum())
        rep = np.repeat(np.arange(req_rows.size), num_tokens)
        pos = np.repeat(start_pos, num_tokens) + (np.arange(total) - np.repeat(np.cumsum(num_tokens) - num_tokens, num_tokens))
        for g, (table, bs) in enumerate(zip(block_tables, block_sizes)):
            out[g, :total] = table[req_rows[rep], pos // bs].astype(np.int64) * bs + pos % bs
            out[g, total:] = PAD_SLOT_ID


def percentile_us(samples, q):
    return float(np.percentile(np.asarray(samples) * 1e6, q))


def build_manager(args, spec: WorkloadSpec, features: bool = False) -> BlockManager:
    """``features``: configure swap space, cross-attention and admission reserves too, unused by
    the workload, to show that their existence costs the standard workload nothing."""
    extra = dict(num_cpu_blocks=4096, max_encoder_len=2048, reserve_decode_blocks=False) if features else {}
    return BlockManager(
        ManagerConfig(
            num_gpu_blocks=args.blocks,
            groups=(GroupSpec(spec.block_size),),
            num_cpu_blocks=extra.pop("num_cpu_blocks", args.cpu_blocks),
            max_model_len=max(8192, spec.prompt_len + spec.decode_steps),
            max_num_reqs=max(1024, spec.num_requests + 16),
            **extra,
        )
    )


def hash_prompts(work, spec):
    sha256loop.warm_up()  # the compiled hashing loaded before it is timed, as the engines do
    t0 = time.perf_counter()
    hashes = [hash_prompt(work.tokens[i, : spec.prompt_len], spec.block_size, algo=spec.hash_algo) for i in range(spec.num_requests)]
    return hashes, time.perf_counter() - t0


def run_standard(args, features: bool = False) -> dict:
    spec = WorkloadSpec(
        block_size=args.block_size, num_blocks=args.blocks, num_requests=args.requests, prompt_len=args.prompt,
        system_len=args.system, shared=args.shared, decode_steps=args.decode, hash_algo=args.hash, seed=args.seed,
        max_num_batched_tokens=args.max_batched_tokens,
    )
    work = make_workload(spec)
    mgr = build_manager(args, spec, features)
    R, P, bs = spec.num_requests, spec.prompt_len, spec.block_size
    slot_out = np.empty((1, max(spec.max_num_batched_tokens, R)), np.int64)

    hashes, hashing_s = hash_prompts(work, spec)
    admits = [AdmitRequest(i, P, hashes[i]) for i in range(R)]
    t0 = time.perf_counter()
    res = mgr.step(StepBatch(admit=admits))
    admission_s = time.perf_counter() - t0
    admitted = res.admit_status == 0
    prefix_hit_tokens = int(res.admit_cached_tokens[admitted].sum())
    rows = res.admit_rows[admitted]
    ids = np.flatnonzero(admitted)
    never = int(np.count_nonzero(res.admit_status == 1))

    # Decode: the client side keeps each request's last block hash to extend the chain.
    last_hash = np.array([h[-1] for h in hashes], hashes[0].dtype)  # the workload's prompts fill blocks
    num_tokens = np.full(ids.size, P, np.int64)
    step_s, client_hash_s = [], []
    registered = 0
    decode_no_space = 0
    for d in range(spec.decode_steps):
        t_hash = time.perf_counter()
        num_tokens += 1
        filled = np.flatnonzero(num_tokens % bs == 0)
        counts = np.zeros(ids.size, np.int64)
        counts[filled] = 1
        reqs, ends = ids[filled], num_tokens[filled]
        flat = hash_next_blocks(work.tokens[reqs[:, None], ends[:, None] - bs + np.arange(bs)], last_hash[reqs],
                                algo=spec.hash_algo)
        last_hash[reqs] = flat
        t0 = time.perf_counter()
        client_hash_s.append(t0 - t_hash)
        out = mgr.step(StepBatch(append_rows=rows, append_num_tokens=1, append_hashes=(flat,), append_hash_counts=(counts,)))
        slot_mapping_from_ranges_ref(mgr.tables, mgr.block_sizes, out.sched_rows, out.sched_start, out.sched_len, slot_out)
        step_s.append(time.perf_counter() - t0)
        registered += int(counts.sum())
        stuck = out.append_status == 1
        if stuck.any():  # eviction variant: a request that cannot grow is preempted (freed)
            decode_no_space += int(stuck.sum())
            mgr.step(StepBatch(free=ids[stuck].tolist()))
            rows, ids, num_tokens = rows[~stuck], ids[~stuck], num_tokens[~stuck]
    blocks_after_decode = mgr.pool.num_used
    stats = mgr.stats()

    t0 = time.perf_counter()
    mgr.step(StepBatch(free=list(ids.tolist())))
    free_s = time.perf_counter() - t0
    # Eviction variant: the requests answered "later" come in now, over a pool full of cached blocks.
    later = np.flatnonzero(res.admit_status == 1)
    second_wave = {}
    if later.size:
        evictions_before = mgr.stats()["evictions"]
        t0 = time.perf_counter()
        res2 = mgr.step(StepBatch(admit=[admits[i] for i in later.tolist()]))
        second_wave = dict(
            second_wave_admission_ms=(time.perf_counter() - t0) * 1e3,
            second_wave_admitted=int(np.count_nonzero(res2.admit_status == 0)),
            second_wave_later=int(np.count_nonzero(res2.admit_status == 1)),
            second_wave_evictions=mgr.stats()["evictions"] - evictions_before,
        )
        mgr.step(StepBatch(free=later[res2.admit_status == 0].tolist()))
    mgr.check_invariants(heavy=True)
    return dict(
        hashing_ms=hashing_s * 1e3,
        admission_ms=admission_s * 1e3,
        admission_with_hashing_ms=(hashing_s + admission_s) * 1e3,
        admission_per_request_us=admission_s * 1e6 / R,
        decode_step_p50_us=percentile_us(step_s, 50),
        decode_step_p99_us=percentile_us(step_s, 99),
        decode_step_max_us=percentile_us(step_s, 100),
        decode_total_ms=sum(step_s) * 1e3,
        decode_client_hashing_ms=sum(client_hash_s) * 1e3,
        free_ms=free_s * 1e3,
        free_per_request_us=free_s * 1e6 / R,
        prefix_hit_tokens=prefix_hit_tokens,
        expected_prefix_hit_tokens=work.expected_prefix_hit_tokens(),
        peak_blocks_used=blocks_after_decode,
        expected_blocks_after_decode=work.expected_blocks_after_decode(),
        pool_free_after=mgr.pool.num_free == mgr.pool.num_blocks - 1,
        admitted=int(admitted.sum()),
        not_admitted=never,
        decode_no_space=decode_no_space,
        **second_wave,
        evictions=stats["evictions"],
        blocks_registered_in_decode=registered,
    )


def run_pool_build(num_blocks: int = 1_000_000) -> dict:
    t0 = time.perf_counter()
    pool = BlockPool(num_blocks)
    build = time.perf_counter() - t0
    return dict(pool_build_ms=build * 1e3, bytes_per_block=pool.nbytes_per_block())


def run_fork(args) -> dict:
    """Fork a 1,024-token request into 8 children, then one decode step for all 9."""
    mgr = build_manager(args, WorkloadSpec())
    samples = []
    honest = True
    for rep in range(200):
        parent = ("p", rep)
        mgr.allocate(parent, 1024 + 5)  # a partly filled last block: every child copies on write
        shared_last = int(mgr.block_table(parent)[-1])
        t0 = time.perf_counter()
        batch = StepBatch(forks=[(parent, (parent, c)) for c in range(8)],
                          append_ids=[parent] + [(parent, c) for c in range(8)], append_num_tokens=1)
        res = mgr.step(batch)
        samples.append(time.perf_counter() - t0)
        # The parent and the first 7 children copy; the last child keeps the shared block alone.
        honest &= bool(np.all(res.append_status == 0) and res.copies.shape[0] == 8
                       and np.all(res.copies[:, 0] == shared_last)
                       and int(mgr.block_table((parent, 7))[-1]) == shared_last
                       and int(mgr.pool.ref_cnt[shared_last]) == 1
                       and int(mgr.pool.ref_cnt[mgr.block_table(parent)[0]]) == 9)
        mgr.step(StepBatch(free=[parent] + [(parent, c) for c in range(8)]))
    mgr.check_invariants(heavy=True)
    return dict(fork8_step_p50_us=percentile_us(samples, 50), fork8_step_max_us=percentile_us(samples, 100),
                fork8_copies_exact=honest)


def run_swap(args) -> dict:
    """Swap-out then swap-in of 64 requests of 1,024 tokens."""
    ns = argparse.Namespace(**{**vars(args), "cpu_blocks": 64 * 64 + 16})
    mgr = build_manager(ns, WorkloadSpec())
    ids = list(range(64))
    for i in ids:
        mgr.allocate(i, 1024)
    outs, ins = [], []
    for _ in range(10):
        t0 = time.perf_counter()
        res = mgr.swap_out(ids)
        outs.append(time.perf_counter() - t0)
        assert res.ok and res.mapping.shape[0] == 64 * 64
        t0 = time.perf_counter()
        res = mgr.swap_in(ids)
        ins.append(time.perf_counter() - t0)
        assert res.ok
    mgr.check_invariants(heavy=True)
    return dict(swap_out_64_ms=float(np.median(outs)) * 1e3, swap_in_64_ms=float(np.median(ins)) * 1e3)


def _jit_disabled() -> bool:
    import os

    return os.environ.get("NUMBA_DISABLE_JIT", "0") not in ("", "0")


def _plain(obj):
    """numpy scalars (the plain-Python row loops return them) as JSON numbers."""
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=65536, help="GPU blocks in the pool (8192 = eviction variant)")
    ap.add_argument("--cpu-blocks", type=int, default=0)
    ap.add_argument("--requests", "-R", type=int, default=256)
    ap.add_argument("--prompt", "-P", type=int, default=1024)
    ap.add_argument("--system", "-S", type=int, default=512)
    ap.add_argument("--shared", type=float, default=0.5)
    ap.add_argument("--decode", "-D", type=int, default=128)
    ap.add_argument("--hash", default="sha256", choices=["sha256", "xxh3_128"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=3, help="runs of the standard workload; medians are reported")
    ap.add_argument("--skip-variants", action="store_true", help="skip pool build, fork and swap figures")
    args = ap.parse_args(argv)
    warm_up()  # compiled loops load before anything is timed, as at daemon start

    runs = [run_standard(args) for _ in range(args.repeat)]
    figures = {k: (float(np.median([r[k] for r in runs])) if isinstance(runs[0][k], float) else runs[0][k]) for k in runs[0]}
    if not args.skip_variants:
        idle = [run_standard(args, features=True) for _ in range(args.repeat)]
        for key in ("admission_ms", "decode_step_p50_us", "decode_step_p99_us", "free_ms"):
            figures[f"features_configured_{key}"] = float(np.median([r[key] for r in idle]))
        figures.update(run_pool_build())
        figures.update(run_fork(args))
        figures.update(run_swap(args))
    honest = dict(
        prefix_hits_match=figures["prefix_hit_tokens"] == figures["expected_prefix_hit_tokens"] or args.blocks < 65536,
        blocks_after_decode_match=figures["peak_blocks_used"] == figures["expected_blocks_after_decode"] or args.blocks < 65536,
        pool_free_after=all(r["pool_free_after"] for r in runs),
    )
    if "fork8_copies_exact" in figures:
        honest["fork8_copies_exact"] = figures.pop("fork8_copies_exact")
    print(f"{'phase':<28}{'value':>14}")
    for key, value in figures.items():
        print(f"{key:<28}{value:>14.3f}" if isinstance(value, float) else f"{key:<28}{value!s:>14}")
    figures.update(honest)
    figures["runs"] = args.repeat
    figures["numba_jit"] = rowloops.HAVE_NUMBA and not _jit_disabled()
    print(json.dumps(figures, default=_plain))
    return 0 if all(honest.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
