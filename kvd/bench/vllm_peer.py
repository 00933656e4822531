"""vLLM 0.33.0's in-process ``KVCacheManager`` on kvd's standard workload: the scaling table's peer
column (``kvd bench --scale``, ``kvd.bench.scaling``).

The workload is kvd's own (``kvd.workload.make_workload(spec, 0)``: the same token ids, sharers and
decode tokens), driven the way vLLM's ``Scheduler`` drives its manager (vllm/v1/core/sched/
scheduler.py of 0.33.0):

  admission  per request, in order: ``Request(...)`` (its block hasher hashes the full prompt blocks:
             timed apart, as kvd's client hashing is), ``get_computed_blocks`` then
             ``allocate_slots(req, P - hit, hit, blocks)``, ``num_computed_tokens = P``, RUNNING;
  one step   the output phase of the step before (``update_from_output``):
             ``append_output_token_ids(tok)`` for every request (hashes the block a token fills), then
             the schedule phase: ``new_step_starts()``, per request ``allocate_slots(req, 1)`` and the
             new block ids the scheduler hands the model runner (``get_block_ids(allow_none=True)``),
             ``take_new_block_ids()`` (drained every step), ``num_computed_tokens += 1``
             (``_update_after_schedule``);
  free       ``free(req)`` for every request.

A step's time is both phases: what vLLM's scheduler process spends on the KV cache per decode step.
vLLM computes slot mappings in its model runner, so they are not part of it (kvd's in-process column
includes its slot mapping). At the p50 (a step where no block fills) hashing costs nothing on either
side; at a filling step vLLM's time includes hashing R blocks, kvd's does not (its client hashes
before it sends the step).

Like vLLM's EngineCore after start-up, the driver freezes the garbage collector's view of the manager
(``gc.collect(); gc.freeze()``) before the requests exist. The warm-up admits R requests of
``block_size - 1`` tokens outside the workload's vocabulary, runs ``warmup`` decode steps, frees them
and resets the prefix cache, so the timed run sees a warm interpreter and an empty cache.

The driver runs in its own process (``VllmPeer``): importing vLLM and torch takes ~10 s and ~1 GB
and must not sit in the process that times kvd's in-process manager. Without vLLM the peer says why
(``VllmPeer.why``) and the table's column reads n/a.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import time
import traceback

import numpy as np

from kvd.workload import WorkloadSpec, make_workload

# kvd's hash algorithm -> vLLM's prefix_caching_hash_algo of the same family (the two projects'
# sha256 schemes differ in what they feed the hash, not in cost class).
VLLM_HASH_ALGO = {"sha256": "sha256", "vllm_sha256": "sha256", "xxh3_128": "xxhash"}

# Token id of the warm-up requests: outside the workload's vocabulary [0, 50_000), so no warm-up block
# can ever be a prefix hit of the timed run.
WARM_TOKEN = 60_000

READY_TIMEOUT_S = 300.0  # importing vLLM on a loaded 2-core machine


# ---- the driver (runs in the worker process; imports vLLM) --------------------------------------

def _manager(spec: WorkloadSpec, num_blocks: int, max_model_len: int):
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    # One full-attention group, as vLLM's own tests build it; the manager never touches tensors.
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=spec.block_size, num_kv_heads=1, head_size=1,
                                     dtype=torch.float32))])
    return KVCacheManager(cfg, max_model_len=max_model_len, scheduler_block_size=spec.block_size,
                          hash_block_size=spec.block_size, enable_caching=True, log_stats=False)


def _admit(kv, req) -> int | None:
    """The scheduler's admission of one waiting request; the prefix-hit tokens, None when refused."""
    from vllm.v1.request import RequestStatus

    blocks, hit, _ = kv.get_computed_blocks(req)
    if kv.allocate_slots(req, req.num_tokens - hit, hit, blocks) is None:
        return None
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = req.num_tokens
    return hit


def scheduler_step(kv, reqs, toks) -> tuple[int, int, bool]:
    """One decode step; (ns of the whole step, ns of the schedule phase, every allocation ok)."""
    ok = True
    a = time.perf_counter_ns()
    for req, tok in zip(reqs, toks):
        req.append_output_token_ids(tok)
    b = time.perf_counter_ns()
    kv.new_step_starts()
    for req in reqs:
        new = kv.allocate_slots(req, 1)
        if new is None:
            ok = False
            continue
        new.get_block_ids(allow_none=True)
        req.num_computed_tokens += 1
    kv.take_new_block_ids()
    c = time.perf_counter_ns()
    return c - a, c - b, ok


def _warm_up(kv, spec: WorkloadSpec, steps: int, params, hasher) -> None:
    from vllm.v1.request import Request

    R, bs = spec.num_requests, spec.block_size
    reqs = [Request(f"warm-{i}", [WARM_TOKEN] * (bs - 1), params, None, block_hasher=hasher) for i in range(R)]
    live = [r for r in reqs if _admit(kv, r) is not None]
    for _ in range(steps):
        scheduler_step(kv, live, [WARM_TOKEN] * len(live))
    for r in live:
        kv.free(r)
    kv.reset_prefix_cache()


def run_workload(spec: WorkloadSpec, num_blocks: int, warmup: int) -> dict:
    """One run of the standard workload through vLLM's manager; figures and honesty counts."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    R, P, D, bs = spec.num_requests, spec.prompt_len, spec.decode_steps, spec.block_size
    work = make_workload(spec, 0)
    prompts = work.tokens[:, :P].tolist()
    decode = work.tokens[:, P:P + D].T.tolist()  # decode[d][i]: the token request i appends at step d
    hash_fn = get_hash_fn_by_name(VLLM_HASH_ALGO[spec.hash_algo])
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(bs, hash_fn)
    params = SamplingParams(max_tokens=D + warmup + 1)

    kv = _manager(spec, num_blocks, max(8192, P + D + 64))
    free0 = kv.block_pool.get_num_free_blocks()
    gc.collect()
    gc.freeze()
    try:
        _warm_up(kv, spec, warmup, params, hasher)
        t0 = time.perf_counter_ns()
        reqs = [Request(f"r{i}", prompts[i], params, None, block_hasher=hasher) for i in range(R)]
        t1 = time.perf_counter_ns()
        hits = [_admit(kv, r) for r in reqs]
        t2 = time.perf_counter_ns()
        live = [r for r, h in zip(reqs, hits) if h is not None]
        step = np.empty(D, np.int64)
        sched = np.empty(D, np.int64)
        allocs_ok = True
        for d in range(D):
            step[d], sched[d], ok = scheduler_step(kv, live, decode[d][: len(live)])
            allocs_ok &= ok
        peak = free0 - kv.block_pool.get_num_free_blocks()
        t3 = time.perf_counter_ns()
        for r in live:
            kv.free(r)
        t4 = time.perf_counter_ns()
        free_end = kv.block_pool.get_num_free_blocks()
    finally:
        gc.unfreeze()
    step_us, sched_us = step / 1e3, sched / 1e3
    return dict(
        step_p50_us=float(np.percentile(step_us, 50)), step_p99_us=float(np.percentile(step_us, 99)),
        step_max_us=float(step_us.max()),
        schedule_p50_us=float(np.percentile(sched_us, 50)), schedule_p99_us=float(np.percentile(sched_us, 99)),
        request_build_ms=(t1 - t0) / 1e6, admission_ms=(t2 - t1) / 1e6, free_ms=(t4 - t3) / 1e6,
        admitted=len(live), prefix_hit_tokens=int(sum(h for h in hits if h is not None)),
        peak_blocks_used=int(peak), pool_free_after=free_end == free0, decode_allocs_ok=bool(allocs_ok),
    )


def _worker_main(conn) -> None:
    """The peer process: import vLLM once, then run workloads on request until told to stop."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
        from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: F401
    except BaseException as e:  # noqa: BLE001 - any failure to import means: no vLLM column
        conn.send(("unavailable", f"vLLM is not importable: {type(e).__name__}: {e}"))
        return
    conn.send(("ready", vllm.__version__))
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the parent is gone
            job = None
        if job is None:
            break
        try:
            conn.send(("ok", run_workload(*job)))
        except Exception:  # noqa: BLE001 - reported to the parent, which fails its honesty check
            conn.send(("error", traceback.format_exc(limit=4)))
    conn.close()
    # No interpreter teardown: the triton bindings vLLM imports print hundreds of "nanobind: leaked"
    # lines there, and there is nothing left to flush or release.
    os._exit(0)


# ---- the parent's handle ------------------------------------------------------------------------

class VllmPeer:
    """A worker process holding vLLM. ``available`` / ``version`` / ``why`` after construction;
    ``run()`` returns ``run_workload``'s figures or raises RuntimeError (the worker's traceback)."""

    def __init__(self, enabled: bool = True, ready_timeout: float = READY_TIMEOUT_S):
        self.available, self.version, self.why = False, "", ""
        self.proc = self.conn = None
        if not enabled:
            self.why = "disabled (--no-vllm)"
            return
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        kind, value = self._recv(ready_timeout, "import vLLM")
        if kind == "ready":
            self.available, self.version = True, value
        else:
            self.why = value
            self.close()

    def _recv(self, timeout: float, what: str) -> tuple[str, object]:
        try:
            if self.conn.poll(timeout):
                return self.conn.recv()
        except (EOFError, OSError):
            pass
        code = self.proc.exitcode if self.proc is not None else None
        return "unavailable", f"the vLLM peer process did not {what} (exit code {code})"

    def run(self, spec: WorkloadSpec, num_blocks: int, warmup: int, timeout: float = 1800.0) -> dict:
        """An exception in the run leaves the peer usable; a dead or silent worker ends it
        (``available`` turns False, ``why`` says why): a late reply would answer the next run."""
        try:
            self.conn.send((spec, num_blocks, warmup))
        except (OSError, ValueError) as e:
            self._broken(f"the vLLM peer process is gone: {e}")
        kind, value = self._recv(timeout, "finish its run")
        if kind == "error":
            raise RuntimeError(str(value))
        if kind != "ok":
            self._broken(str(value))
        return value

    def _broken(self, why: str) -> None:
        self.available, self.why = False, why
        self.close()
        raise RuntimeError(why)

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.conn.close()
            self.conn = None
        if self.proc is not None:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(5)
            self.proc = None

    def __enter__(self) -> "VllmPeer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
