"""GPU session buffers: each session's block tables, counts and slot mapping on the daemon's GPU,
exported to the client over CUDA IPC.

With ``--device cuda:N`` every session gets, besides its shared-memory segment (``kvd.shm``, always
written first, so CPU readers see exactly what they saw before), one device allocation (the
*arena*) that holds, each at a 256-byte aligned offset::

    table_g   int32[max_reqs, max_blocks_g]   per group, same contents as the segment's table_g
    counts    int32[G, max_reqs]              row g = the segment's counts_g
    slots     int64[G, max_tokens]            the segment's slots (PAD_SLOT_ID padded)

The arena never moves for the life of the session (CUDA graphs replay on it). It is exported once
with ``storage._share_cuda_()`` and the handle travels in the hello/attach reply (see
``kvd.protocol``, field ``gpu``); the client rebuilds the storage with
``torch.UntypedStorage._new_shared_cuda`` (torch's own recipe, torch/multiprocessing/reductions.py)
and makes the three kinds of views from the ``arrays`` layout.

Per reply the daemon mirrors onto the GPU exactly the shared-memory writes the reply announces:

* block-table and count writes are recorded as (group, row, [start, end)) regions while the CPU
  segment is written (:class:`ChangeTracker`; its staging, like the slot inputs below, is a compiled
  loop of ``kvd.rowloops`` when numba is installed, else the numpy reference here); before the
  reply they are staged CSR-style as ``(group, row, start, ids)`` changes into pinned host memory (the ids are read back from the
  segment, so a region written twice, or a little wider than needed, still gets the final values)
  and applied by ONE ``apply_block_table_updates`` launch for all groups (the counts are one more
  "table" ``[G, max_reqs]`` of that launch; up to 3 groups fit one launch, 4 tables per launch);
* the step's slot mapping is computed by the Triton kernel over the session's GPU tables, its
  inputs (session rows, query start locations, positions) staged in pinned memory too;
* both kernels run through persistent launch plans (Triton's per-call binder skipped; the apply
  kernel's grid is a power-of-two bucket, unused programs see empty changes); on CUDA each apply
  bucket's launch is captured once per session as a CUDA graph, and a flush replays it;
* the session's interprocess CUDA event (``done``, exported beside the arena) is recorded after
  them and the reply goes out at once: the client makes its stream wait on that event after every
  reply unless it has completed by then (``kvd_client.GpuBuffers.wait``), so its kernels read
  complete data and nobody waits on the host. Measured on an H100 host (an engine decoding 256
  requests, a step every ~15 ms): the flush's p50 went from 299 us (synchronized) to 191 us. The
  staging buffers are pool-wide: every write to them first waits for the previous flush's event
  (:meth:`GpuPool.settle`), by then normally long complete.
  ``KVDSRV_GPU_SYNC=1`` (environment, debugging aid) synchronizes before every reply instead.

Warm-up: :meth:`GpuPool.warm` builds a throwaway session with the same layout and runs every
launch variant a session can use (every slot-mapping REQ_CHUNK bucket, every apply grid bucket), so
Triton compiles everything before READY; each new session prebuilds its own plans at hello (cache
hits, no compilation).

Sharing caveats: an arena is at least ``ARENA_MIN_BYTES`` and a multiple of 2 MiB so that torch's
caching allocator gives it a cudaMalloc of its own (an IPC handle exposes a whole cudaMalloc block,
never only a tensor); when the session ends the daemon drops the arena and torch keeps it in its IPC
"limbo" until the client released its mapping (torch's cross-process ref count); the daemon calls
``torch.cuda.ipc_collect()`` now and then.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from kvd import rowloops

log = logging.getLogger("kvd.gpu")

ALIGN = 256
MiB = 1 << 20
#: torch's caching allocator gives requests of >= 10 MiB (rounded to 2 MiB) their own cudaMalloc
ARENA_MIN_BYTES = 10 * MiB
ARENA_ROUND = 2 * MiB
_BIG_INT = 2**31 - 1  # an empty region's start (ChangeTracker)
_BIG = np.int32(_BIG_INT)
PAD_SLOT_ID = -1


#: Where the CUDA driver keeps the file behind a process's interprocess events: it creates
#: ``cuda.shm.<n>.<pid in hex>.<n>`` there when the process first exports an event handle and leaves
#: it when the process exits (80 KiB a process; seen on the H200 hosts: one file per GPU daemon run).
IPC_EVENT_SHM_DIR = "/dev/shm"


def ipc_event_files(pid: int | None = None, shm_dir: str = IPC_EVENT_SHM_DIR) -> list[str]:
    """The names of the CUDA driver's interprocess-event files of process ``pid`` (default: this
    one), sorted."""
    tag = f"{os.getpid() if pid is None else pid:x}"
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if _is_event_file_of(n.split("."), tag))


def _is_event_file_of(parts: list[str], pid_hex: str) -> bool:
    return len(parts) == 5 and parts[:2] == ["cuda", "shm"] and parts[3] == pid_hex


def remove_ipc_event_files(pid: int | None = None, shm_dir: str = IPC_EVENT_SHM_DIR) -> list[str]:
    """Unlink the CUDA driver's interprocess-event files of process ``pid`` (default: this one);
    their names. For a process that exports event handles, once nobody will open them again (the
    daemon at exit: its clients mapped theirs when they opened them)."""
    removed = []
    for name in ipc_event_files(pid, shm_dir):
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def _round(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def arena_layout(max_reqs: int, max_blocks: list[int], max_tokens: int) -> tuple[dict, int]:
    """{name: [byte offset, dtype str, shape]} of a session arena and its size in bytes."""
    G = len(max_blocks)
    arrays: dict[str, list] = {}
    off = 0

    def put(name: str, dt: str, shape: list[int]) -> None:
        nonlocal off
        arrays[name] = [off, dt, shape]
        off += _round(int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize, ALIGN)

    put("slots", "<i8", [G, max_tokens])
    put("counts", "<i4", [G, max_reqs])
    for g in range(G):
        put(f"table_{g}", "<i4", [max_reqs, max_blocks[g]])
    return arrays, max(ARENA_MIN_BYTES, _round(off, ARENA_ROUND))


# ---- pure host logic (tested on the CPU) -----------------------------------------------------

class ChangeTracker:
    """Regions of the shared-memory tables/counts written since the last :meth:`stage`.

    ``mark(g, rows, start, end)``: table_g[rows[i], start[i]:end[i]] was written (rows unique within
    one call); regions of one row are merged into their hull (the ids are read from the segment at
    stage time, so the hull carries the right values). ``mark_counts(rows)``: counts_g[rows] written
    for every group (one contiguous range per group is staged)."""

    def __init__(self, num_groups: int, max_reqs: int):
        self.G = num_groups
        self.st = [np.full(max_reqs, _BIG, np.int32) for _ in range(num_groups)]
        self.en = [np.zeros(max_reqs, np.int32) for _ in range(num_groups)]
        self.clo = max_reqs
        self.chi = 0
        self.dirty = False

    def mark(self, g: int, rows: np.ndarray, start, end) -> None:
        if rows.size == 0:
            return
        st, en = self.st[g], self.en[g]
        st[rows] = np.minimum(st[rows], start)
        en[rows] = np.maximum(en[rows], end)
        self.dirty = True

    def mark_counts(self, rows: np.ndarray) -> None:
        if rows.size == 0:
            return
        if rows.size <= 64:  # numpy's reductions cost ~4 µs each on a few values
            vals = rows.tolist()
            lo, hi = min(vals), max(vals) + 1
        else:
            lo, hi = int(rows.min()), int(rows.max()) + 1
        if lo < self.clo:
            self.clo = lo
        if hi > self.chi:
            self.chi = hi
        self.dirty = True

    def max_changes(self) -> int:
        return self.G * (self.st[0].shape[0] + 1)

    def stage(self, tables: list[np.ndarray], counts: list[np.ndarray], groups: np.ndarray,
              rows: np.ndarray, starts: np.ndarray, offsets: np.ndarray, ids: np.ndarray) -> tuple[int, int]:
        """Write the pending changes as CSR ``(groups, rows, starts, offsets, ids)`` (preallocated
        int32 arrays) and clear them. Tables are groups 0..G-1; the counts are "group" G with
        row g. Returns (number of changes, number of ids)."""
        n = 0
        k = 0
        offsets[0] = 0
        for g in range(self.G):
            n, k = _stage_group(self.st[g], self.en[g], g, tables[g], groups, rows, starts, offsets, ids, n, k,
                                _BIG_INT)
        if self.chi > self.clo:
            lo, hi = self.clo, self.chi
            for g in range(self.G):
                ids[k:k + hi - lo] = counts[g][lo:hi]
                groups[n] = self.G
                rows[n] = g
                starts[n] = lo
                k += hi - lo
                offsets[n + 1] = k
                n += 1
            self.clo, self.chi = self.st[0].shape[0], 0
        self.dirty = False
        return n, k


def stage_group_ref(st, en, g, table, groups, rows, starts, offsets, ids, n, k, big):
    """One group's part of ``ChangeTracker.stage`` in numpy (the reference of the compiled
    ``rowloops.stage_changes``): the rows with a recorded region, in row order, appended as changes
    from n and ids from k; the regions reset to (``big``, 0). Returns the new (n, k)."""
    r = np.flatnonzero(en > st)
    m = r.size
    if not m:
        return n, k
    s = st[r]
    e = en[r]
    lens = e - s
    st[r] = big
    en[r] = 0
    W = table.shape[1]
    tot = int(lens.sum())
    flat = r * W + s
    if tot == m:  # one id per change (decode): no expansion
        idx = flat
    else:
        first = np.cumsum(lens) - lens
        idx = np.repeat(flat - first, lens) + np.arange(tot)
    ids[k:k + tot] = table.reshape(-1).take(idx)
    groups[n:n + m] = g
    rows[n:n + m] = r
    starts[n:n + m] = s
    np.cumsum(lens, out=offsets[n + 1:n + m + 1])
    offsets[n + 1:n + m + 1] += k
    return n + m, k + tot


def stage_slot_inputs_ref(srows: np.ndarray, start: np.ndarray, lens: np.ndarray, req_rows: np.ndarray,
                      qsl: np.ndarray, positions: np.ndarray) -> int:
    """The daemon's (session row, first position, token count) per scheduled request -> the slot
    kernel's vLLM-style inputs in preallocated int32 buffers: req_rows[:B], query_start_loc[:B+1],
    positions[:min(T, len(positions))]. Returns B."""
    B = srows.shape[0]
    req_rows[:B] = srows
    qsl[0] = 0
    if B == 0:
        return 0
    np.cumsum(lens, out=qsl[1:B + 1])
    T = int(qsl[B])
    cap = positions.shape[0]
    if T == B and int(lens.min()) == 1:  # decode: one token per request
        positions[:B] = start
        return B
    first = qsl[:B].astype(np.int64)
    pos = np.arange(min(T, cap), dtype=np.int64)
    req = np.searchsorted(first, pos, side="right") - 1  # request of each token
    positions[:pos.size] = pos - first[req] + start[req]
    return B


# the compiled loops when numba is there (kvd[fast]); the numpy references above otherwise
stage_slot_inputs = rowloops.slot_inputs if rowloops.HAVE_NUMBA else stage_slot_inputs_ref
_stage_group = rowloops.stage_changes if rowloops.HAVE_NUMBA else stage_group_ref


# ---- device side -------------------------------------------------------------------------------

def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class GpuPool:
    """Daemon-wide GPU state: device, pinned staging buffers, kernels, timing."""

    def __init__(self, device: str, block_sizes: list[int], max_blocks: list[int], max_reqs: int,
                 max_tokens: int):
        import torch

        import kvd_kernels as K

        self.torch = torch
        self.K = K
        self.device = torch.device(device)
        # device "cpu": the CPU tests' emulation under TRITON_INTERPRET=1 (no pinning, no IPC)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            if not torch.cuda.is_available():
                raise RuntimeError(f"device {device}: CUDA is not available")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            self.uuid = str(torch.cuda.get_device_properties(self.device).uuid)
            # the daemon launches, records and synchronizes on this one stream for its life: the
            # launch plans take its handle instead of looking the current stream up per launch
            self.stream = torch.cuda.current_stream(self.device)
            self.stream_handle = self.stream.cuda_stream
        elif os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"device {device}: a GPU pool needs cuda (cpu only under TRITON_INTERPRET=1)")
        else:
            self.uuid = ""
            self.stream = self.stream_handle = None
        self.block_sizes = list(block_sizes)
        self.max_blocks = list(max_blocks)
        self.G = len(max_blocks)
        self.max_reqs = max_reqs
        self.max_tokens = max_tokens
        self.layout, self.arena_bytes = arena_layout(max_reqs, self.max_blocks, max_tokens)
        G, R = self.G, max_reqs
        self.max_changes = G * (R + 1)
        id_cap = sum(R * mb for mb in self.max_blocks) + G * R
        sizes = dict(groups=self.max_changes, rows=self.max_changes, starts=self.max_changes,
                     offsets=self.max_changes + 1, req_rows=max(R, 1), qsl=R + 1,
                     positions=max_tokens, ids=id_cap)
        total = sum(_round(v, 64) for v in sizes.values())
        # the kernels read the staged arrays straight from pinned host memory (mapped, UVA): no
        # separate copy; the stream is synchronized before the host writes them again
        self.stage_t = torch.zeros(total, dtype=torch.int32, pin_memory=self.cuda)
        self.stage_np = self.stage_t.numpy()
        # KVD_GPU_STAGE=copy: one H2D copy of the used staging prefix per flush, kernels read device
        # memory (default "pinned": kernels read the pinned buffer over the bus, no copy)
        self.copy_mode = self.cuda and os.environ.get("KVD_GPU_STAGE", "pinned") == "copy"
        src = torch.zeros(total, dtype=torch.int32, device=self.device) if self.copy_mode else self.stage_t
        self.stage_dev = src
        self.t: dict = {}
        self.np: dict = {}
        off = 0
        for name, n in sizes.items():  # ids last: a flush copies [0, ids_off + number of ids)
            self.t[name] = src[off:off + n]
            self.np[name] = self.stage_np[off:off + n]
            if name == "ids":
                self.ids_off = off
            off += _round(n, 64)
        # synchronize before every reply (the old protocol) instead of the session's event
        self.sync_reply = self.cuda and os.environ.get("KVDSRV_GPU_SYNC") == "1"
        # KVD_GPU_GRAPHS=0: launch the apply kernel through its plan each flush instead of replaying
        # the session's CUDA graph of it
        self.graphs = self.cuda and os.environ.get("KVD_GPU_GRAPHS", "1") != "0"
        self.graph_pool = None
        self.apply_replays = self.apply_launches = 0  # flushes' apply kernels: graph replays, plan launches
        self.inflight = None  # the event of the last flush nobody has waited for yet
        self.times = np.zeros(1 << 16, np.float64)  # flush host seconds (ring)
        self.n_flush = 0
        self.last_collect = time.monotonic()

    # -- session arenas ----------------------------------------------------------------------------
    def new_session(self) -> "GpuSession":
        return GpuSession(self)

    def warm(self) -> None:
        """Compile and run every kernel variant a session can use (before READY)."""
        t0 = time.perf_counter()
        s = GpuSession(self, export=False)
        # one real step through the whole path too (an admission-like change and a decode)
        tr = s.tracker
        tables = [np.zeros((self.max_reqs, mb), np.int32) for mb in self.max_blocks]
        counts = [np.zeros(self.max_reqs, np.int32) for _ in range(self.G)]
        rows = np.arange(min(2, self.max_reqs), dtype=np.int32)
        for g in range(self.G):
            tr.mark(g, rows, 0, 1)
        tr.mark_counts(rows)
        s.stage_slots(rows, np.zeros(rows.size, np.int64), np.ones(rows.size, np.int32))
        s.flush(tables, counts)
        s.close()
        self.sync()
        log.info("GPU kernels warmed in %.2f s", time.perf_counter() - t0)

    def sync(self) -> None:
        if self.cuda:
            self.stream.synchronize()
        self.inflight = None

    def settle(self) -> None:
        """Wait until the last flush's kernels have read the staging buffers (before rewriting them)."""
        ev = self.inflight
        if ev is not None:
            ev.synchronize()
            self.inflight = None

    def collect(self, now: float) -> None:
        if self.cuda and now - self.last_collect > 5.0:
            self.last_collect = now
            try:
                self.torch.cuda.ipc_collect()
            except Exception:  # pragma: no cover
                pass

    def stats(self) -> dict:
        n = min(self.n_flush, self.times.size)
        launches = {"apply_graph_replays": self.apply_replays, "apply_plan_launches": self.apply_launches}
        if not n:
            return {"flushes": 0, **launches}
        a = self.times[:n] * 1e6
        return {"flushes": self.n_flush, "p50_us": float(np.percentile(a, 50)),
                "p99_us": float(np.percentile(a, 99)), "mean_us": float(a.mean()), **launches}


class GpuSession:
    """One session's arena, its IPC export, its change tracker and launch plans."""

    def __init__(self, pool: GpuPool, export: bool = True):
        torch, K = pool.torch, pool.K
        pool.settle()  # the plan prebuild below writes the staging buffers
        self.pool = pool
        G = pool.G
        # recorded after every flush; the client's stream waits on it (interprocess: no timing)
        self.done = torch.cuda.Event(interprocess=True) if pool.cuda else None
        self.G = G
        self.arena = torch.empty(pool.arena_bytes, dtype=torch.uint8, device=pool.device)
        views = {}
        for name, (off, dt, shape) in pool.layout.items():
            tdt = torch.int64 if dt == "<i8" else torch.int32
            n = int(np.prod(shape))
            views[name] = self.arena[off:off + n * np.dtype(dt).itemsize].view(tdt).view(*shape)
        self.slots = views["slots"]
        self.counts = views["counts"]
        self.tables = [views[f"table_{g}"] for g in range(G)]
        self.slots.fill_(PAD_SLOT_ID)
        self.counts.zero_()
        for t in self.tables:
            t.zero_()
        self.tracker = ChangeTracker(G, pool.max_reqs)
        self.slot_B = -1  # staged slot-mapping request count (-1: none this reply)
        self.handle = None
        t = pool.t
        self.slot_plan = K.SlotMappingPlan(self.tables, pool.block_sizes, t["req_rows"], t["qsl"],
                                           t["positions"], self.slots, stream=pool.stream_handle)
        self._apply_targets = self.tables + [self.counts]
        self._apply_plans: dict[int, list] = {}
        self._apply_graphs: dict = {}
        # prebuild every plan variant (cache hits after the daemon's warm-up): REQ_CHUNK buckets of
        # the slot kernel (a zero token count: it only pads) and the apply kernel's grid buckets
        # (empty changes)
        np_ = pool.np
        np_["qsl"][:] = 0
        b = 1
        while True:
            self.slot_plan(min(b, pool.max_reqs))
            if b >= min(256, _pow2(pool.max_reqs)):
                break
            b *= 2
        np_["offsets"][:] = 0
        b = 1
        while True:
            self._apply(min(b, pool.max_changes))
            if b >= pool.max_changes:
                break
            b *= 2
        pool.sync()
        self._apply_graphs = self._capture_apply() if pool.graphs else {}
        if export and pool.cuda:
            self.export()

    def export(self) -> dict:
        st = self.arena.untyped_storage()
        (dev, handle, size, off, rc, rco, ev, evs) = st._share_cuda_()
        if off != 0:
            log.warning("session arena at offset %d of its allocation: the IPC handle exposes the "
                        "whole allocation", off)
        self.handle = {
            "dev": int(dev), "uuid": self.pool.uuid, "h": bytes(handle).hex(), "sz": int(size),
            "off": int(off), "rc": bytes(rc).hex(), "rco": int(rco),
            "ev": None if ev is None else bytes(ev).hex(), "evs": bool(evs),
            "arrays": self.pool.layout, "done": bytes(self.done.ipc_handle()).hex(),
        }
        return self.handle

    def _capture_apply(self) -> dict:
        """One CUDA graph per apply bucket, of the bucket's plans: a replay is one graph launch,
        where a plan's launch passes its ~25 arguments through Triton's launcher (80-113 µs of a
        daemon's host time per flush of a 256-request decode step on an H100 host, measured).
        Empty (the plans launch) if a capture fails."""
        torch, pool = self.pool.torch, self.pool
        if pool.graph_pool is None:
            pool.graph_pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(pool.device)
        side.wait_stream(pool.stream)
        graphs = {}
        try:
            for bucket, plans in self._apply_plans.items():
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool.graph_pool, stream=side):
                    for p in plans:
                        p.launch_on(side.cuda_stream)
                graphs[bucket] = g
        except Exception as e:  # pragma: no cover - depends on the driver
            log.warning("no CUDA graph of the apply kernel (%s): its plans launch instead", e)
            graphs = {}
        pool.stream.wait_stream(side)
        return graphs

    # -- per reply ---------------------------------------------------------------------------------
    def _apply(self, n: int) -> None:
        """Launch the apply kernel over the first n staged changes (grid: power-of-two bucket;
        offsets past n must equal offsets[n]): the bucket's CUDA graph, else its plans."""
        pool = self.pool
        bucket = min(_pow2(n), pool.max_changes)
        graph = self._apply_graphs.get(bucket)
        if graph is not None:
            graph.replay()
            pool.apply_replays += 1
            return
        plans = self._apply_plans.get(bucket)
        if plans is None:
            from kvd_kernels._triton import MAX_GROUPS_PER_LAUNCH, Relauncher, group_args
            from kvd_kernels.block_table import UPDATE_BLOCK, _apply_updates_kernel, _num_cols

            t = pool.t
            plans = []
            tgt = self._apply_targets
            for g0 in range(0, len(tgt), MAX_GROUPS_PER_LAUNCH):
                tables = tgt[g0:g0 + MAX_GROUPS_PER_LAUNCH]
                names = ("t0", "s0", "t1", "s1", "t2", "s2", "t3", "s3")
                kw = dict(groups_ptr=t["groups"], rows_ptr=t["rows"], starts_ptr=t["starts"],
                          offsets_ptr=t["offsets"], ids_ptr=t["ids"], group_base=g0,
                          **dict(zip(names, group_args(tables))),
                          **dict(zip(("n0", "n1", "n2", "n3"), _num_cols(tables))),
                          NUM_GROUPS=len(tables), BLOCK=UPDATE_BLOCK)
                plans.append(Relauncher(_apply_updates_kernel, (bucket,), kw, stream=pool.stream_handle))
            self._apply_plans[bucket] = plans
            return
        pool.apply_launches += 1
        for p in plans:
            p()

    def stage_slots(self, srows: np.ndarray, start: np.ndarray, lens: np.ndarray) -> None:
        self.pool.settle()
        np_ = self.pool.np
        self.slot_B = stage_slot_inputs(srows, start, lens, np_["req_rows"], np_["qsl"],
                                        np_["positions"])

    @property
    def pending(self) -> bool:
        return self.tracker.dirty or self.slot_B >= 0

    def flush(self, tables: list[np.ndarray], counts: list[np.ndarray]) -> None:
        """Stage the recorded table/count changes, launch, slot-map, record ``done`` (or, with
        ``KVDSRV_GPU_SYNC=1``, synchronize)."""
        pool = self.pool
        t0 = time.perf_counter()
        pool.settle()
        n = 0
        if self.tracker.dirty:
            np_ = pool.np
            n, k = self.tracker.stage(tables, counts, np_["groups"], np_["rows"], np_["starts"],
                                      np_["offsets"], np_["ids"])
            if n:
                bucket = min(_pow2(n), pool.max_changes)
                np_["offsets"][n + 1:bucket + 1] = k
        if pool.copy_mode and (n or self.slot_B >= 0):
            used = pool.ids_off + (k if n else 0)
            pool.stage_dev[:used].copy_(pool.stage_t[:used], non_blocking=True)
        if n:
            self._apply(n)
        if self.slot_B >= 0:
            self.slot_plan(self.slot_B)
            self.slot_B = -1
        if self.done is None or pool.sync_reply:
            pool.sync()
        else:
            self.done.record(pool.stream)
            pool.inflight = self.done
        i = pool.n_flush & (pool.times.size - 1)
        pool.times[i] = time.perf_counter() - t0
        pool.n_flush += 1

    def close(self) -> None:
        self.pool.settle()
        self.slot_plan = None
        self._apply_graphs = {}
        self._apply_plans = {}
        self.tables = self.counts = self.slots = self._apply_targets = None
        self.arena = None
