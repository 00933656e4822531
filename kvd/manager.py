"""BlockManager: the request-level KV-cache block manager. Synchronous, deterministic, no I/O.

Requests live in *rows* of fixed-size arrays (``max_num_reqs`` of them); a request id maps to its row.
Per row: ``num_tokens`` (tokens whose KV is computed or being computed), and per KV-cache group a
block-table row, its block count, how many leading full blocks have been registered in the prefix
cache, and how many leading entries a sliding window has turned into the null block.

Decode steps, frees, forks and (in the one-group case) admissions work on arrays of rows at once;
an admission's prefix lookup is a dict walk per request, and whatever the fast paths decline
(misuse, shortage, several groups, evictions mid-batch) goes one request at a time.

Semantics worth knowing:
- a batch of appends runs in three phases: every request grows (decided in batch order, greedily:
  a request fits if its blocks fit in what is left), then the blocks that became full are
  registered in the prefix cache, then blocks that fell out of a sliding window are returned (only
  for requests that grew: a no-space request stays exactly as it was, and a 0-token append, which
  registers a prefill chunk's blocks, releases nothing). So a cached block evicted
  to grow one request is gone before another request of the batch registers the same content;
- blocks of one batch are taken group by group, and within a group in batch order (a request's
  copy-on-write block first, then its new blocks);
- admission (``allocate``, ``can_allocate``, step admissions, ``swap_in``) keeps the watermark
  (and, as configured, decode reserves) free; appends of running requests may use every block;
- prefix hits never cover the whole prompt: at most ``(num_tokens - 1) // block_size`` blocks hit,
  so the engine computes at least one token.

Who may hit a cached block (the *computed* state). Every request has a namespace (whose cache its
lookups read) and a *writer*: who computes its KV. Writer 0 means "computed by the time anyone else
looks": its full blocks are registered straight into the namespace's shared map (the in-process
manager, and sessions with private memory). A writer > 0 is one of several engines sharing a
namespace: the blocks it registers go into the shared map *unconfirmed* (``kvd.pool``), visible to its
own later lookups only (its forward passes run in order, and within one pass K/V are written before
attention reads them), and become visible to all when the writer confirms with
``mark_computed(writer, tick)`` that every step up to ``tick`` (``StepResult.tick``, ``self.tick``)
has finished its forward pass. Until then another writer's lookup misses them and it computes the
blocks itself (keeping its copies in its side map); the first copy confirmed is the one kept. A writer
that ends (``drop_writer``) forgets what it never confirmed.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvd import errors, prefixindex, rowloops
from kvd.api import (
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    MIN_PRIORITY,
    NULL_BLOCK,
    STATUS_NO_SPACE,
    STATUS_OK,
    AdmitRequest,
    AllocResult,
    AllocStatus,
    AppendResult,
    ManagerConfig,
    ReqId,
    StepBatch,
    StepResult,
    SwapResult,
    int_array,
)
from kvd.hashing import as_hash_array, count_total, hash_dtype
from kvd.pool import ALL_SHARED, BlockPool
from kvd.runs import NO_PARENT, Runs

_EMPTY_I32 = np.empty(0, np.int32)
_EMPTY_I64 = np.empty(0, np.int64)
_EMPTY_I16 = np.empty(0, np.int16)
_EMPTY_COPIES = np.empty((0, 2), np.int32)
_FEW_ADMITS = 4  # a step admitting at most this many (and nothing else) is scheduled over scalars


def _plain_counts(counts: np.ndarray) -> np.ndarray:
    """Hash counts as append_batch_groups' tuple takes them: every group's of one type (contiguous,
    writable int64), so that the compiled loop has one signature (a read-only array is another)."""
    counts = np.ascontiguousarray(counts, np.int64)
    return counts if counts.flags.writeable else counts.copy()


_NO_REQ_ID = object()
"""Stands for the request of ``can_allocate`` (which has no id) in the checks ``allocate`` makes."""


def warm_up() -> None:
    """Compile (or load from numba's disk cache) every compiled loop a manager runs. numba loads a
    loop on its first call, 4-10 ms each on the box: a process that times or serves steps calls
    this once first (the daemon at start), or its first step of each kind pays for it."""
    rowloops.warm_up()
    prefixindex.warm_up()


def _cdiv(a, b):
    return -(-a // b)


@dataclass
class _Swapped:
    """A swapped-out request: its CPU blocks per group, in table positions [skip, skip + n)."""

    cpu_blocks: list[np.ndarray]
    num_skipped: list[int]
    cross: np.ndarray


def _refuses_misuse(method):
    """A public method whose misuse changes nothing: its checks come before its changes, a typed
    error puts back the tick it may have taken, and an argument of the wrong kind
    (``errors.ARGUMENT_ERRORS``) is InvalidArgument."""
    what = method.__name__

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        tick = self.tick
        try:
            return method(self, *args, **kwargs)
        except errors.KvdError:
            self.tick = tick
            raise
        except errors.ARGUMENT_ERRORS as e:
            self.tick = tick
            raise errors.invalid_argument(e, what) from e

    return call


def _check_batch(batch: StepBatch) -> None:
    """A step's lists are lists (tuples, lists or arrays; forks: pairs), else the step is refused
    before it changes anything; a bad item of a list is that item's status."""
    for name in ("free", "append_ids", "forks", "admit"):
        items = getattr(batch, name)
        if type(items) is tuple or type(items) is list:
            continue
        if type(items) is not np.ndarray or items.ndim != (2 if name == "forks" else 1):
            raise errors.InvalidArgument(f"{name} must be a tuple, list or array, got {type(items).__name__}")


class _Group:
    """Per-group arrays over every row."""

    def __init__(self, block_size: int, window: int | None, max_reqs: int, max_blocks: int) -> None:
        self.block_size = block_size
        self.window = window or 0
        self.table = np.zeros((max_reqs, max_blocks), np.int32)
        self.table.fill(NULL_BLOCK)  # touch every page now, not on the first step that writes it
        self.num_blocks = np.zeros(max_reqs, np.int32)
        # table[row, num_blocks[row] - 1], or NULL_BLOCK for a row without blocks: every path that
        # writes a row's table or block count keeps it (the heavy invariant check recomputes it).
        # A decode step's slot mapping reads it (rowloops.range_slots): 4 bytes per row in one
        # dense array instead of one table entry per row, each on its own cache line and page.
        self.last_block = np.zeros(max_reqs, np.int32)
        self.num_registered = np.zeros(max_reqs, np.int32)
        self.num_skipped = np.zeros(max_reqs, np.int32)

    def last_block_of(self, rows: np.ndarray) -> np.ndarray:
        """What ``last_block`` of ``rows`` must hold, from the table."""
        nb = self.num_blocks[rows]
        return np.where(nb > 0, self.table[rows, np.maximum(nb - 1, 0)], NULL_BLOCK)

    def refresh_last_block(self, rows: np.ndarray) -> None:
        """``last_block`` of ``rows`` from the table, after a path wrote it."""
        self.last_block[rows] = self.last_block_of(rows)

    def skip_for(self, num_computed):
        """Leading blocks no longer needed once ``num_computed`` tokens are computed."""
        if not self.window:
            return np.zeros_like(num_computed) if isinstance(num_computed, np.ndarray) else 0
        return np.maximum(num_computed - self.window + 1, 0) // self.block_size


def _row_blocks(table: np.ndarray, rows: np.ndarray, starts: np.ndarray, stops: np.ndarray, reverse: bool,
                need_rep: bool = True):
    """Entries table[row, start:stop] of every row, concatenated row after row (each row's entries
    reversed if asked), and for each entry its index into ``rows`` (or None when not needed).

    Whole rows up to the longest stop are gathered and masked: a few large copies instead of one
    fancy index per entry."""
    width = int(stops.max()) if stops.size else 0
    if width <= 0:
        return _EMPTY_I32, (_EMPTY_I32 if need_rep else None)
    sub = table[rows, :width]
    cols = np.arange(width)
    mask = cols < stops[:, None]
    if starts.any():
        mask &= cols >= starts[:, None]
    if reverse:
        sub, mask = sub[:, ::-1], mask[:, ::-1]
    return sub[mask], (np.nonzero(mask)[0] if need_rep else None)


#: ``BlockManager.step`` takes ``_lone_admission_step`` for a step that only admits one request
#: (tests switch it off to compare with the general path).
_LONE_ADMISSION_PATH = True

#: ``_append_rows`` and ``decode_rows`` of a pool of several groups or a sliding window take
#: ``_append_fast_groups`` (tests and scripts/bench_groups.py switch it off: the request-by-request path).
_GROUPS_FAST_PATH = True


class BlockManager:
    @staticmethod
    def estimate_bytes(config: ManagerConfig) -> int:
        """Memory the manager's arrays will take, from above by a few percent (per GPU block 42
        bytes: the pool's 33 and a registration serial, and the prefix-cache index; per CPU block 36,
        per request row 120 + 16 per group, plus the block tables)."""
        R = config.max_num_reqs
        tables = sum(_cdiv(config.max_model_len + config.max_lookahead_tokens, g.block_size) for g in config.groups)
        cross = _cdiv(config.max_encoder_len, config.encoder_block_size)
        return (42 * config.num_gpu_blocks + prefixindex.nbytes(config.num_gpu_blocks) + 36 * max(config.num_cpu_blocks, 1)
                + R * (120 + 16 * len(config.groups) + 4 * (tables + cross)))

    def __init__(self, config: ManagerConfig) -> None:
        _validate_config(config)
        self.config = config
        self.hash_width = config.hash_width
        self.hash_dtype = hash_dtype(config.hash_width)
        self._empty_hashes = np.empty(0, self.hash_dtype)
        self.pool = BlockPool(config.num_gpu_blocks, self.hash_dtype)
        self.cpu_pool = BlockPool(max(config.num_cpu_blocks, 1), self.hash_dtype, prefix_cache=False)
        self._cpu_carry_key = np.zeros(self.cpu_pool.num_blocks, np.uint16)
        R = config.max_num_reqs
        self.max_lookahead = config.max_lookahead_tokens
        self.groups = [
            _Group(g.block_size, g.sliding_window, R, _cdiv(config.max_model_len + self.max_lookahead, g.block_size))
            for g in config.groups
        ]
        self.block_sizes = tuple(g.block_size for g in self.groups)
        self.sliding_windows = tuple(g.window for g in self.groups)  # tokens per group; 0: full attention
        self.tables = tuple(g.table for g in self.groups)
        self.num_blocks = tuple(g.num_blocks for g in self.groups)
        self.last_blocks = tuple(g.last_block for g in self.groups)
        self.num_tokens = np.zeros(R, np.int64)
        self.priority = np.zeros(R, np.uint8)
        self.namespace = np.zeros(R, np.int64)  # the row's registration space (see _space)
        self.active = np.zeros(R, bool)
        self.swapped = np.zeros(R, bool)
        self.appendable = np.zeros(R, bool)  # active and resident: what an append may name
        self.forked = np.zeros(R, bool)  # took part in a fork: may share a partly filled block
        self._num_forked = 0
        self._arange = np.arange(R, dtype=np.int32)
        self._mark = np.zeros(R, np.int32)
        # Scratch for the compiled append loops (kvd.rowloops); they share _mark.
        self._plan_old = np.empty(R, np.int64)
        self._plan_grow = np.empty(R, np.int64)
        self._plan_cow = np.empty(R, bool)
        self._copies_buf = np.empty((len(self.groups) * R, 2), np.int32)  # (each group copies a request's block)
        self._changed_buf = np.empty(R, np.int32)
        self._no_skip = np.zeros(R, np.int32)  # the cross table's (absent) skip and registered counts
        self._cross_last_scratch = np.zeros(R, np.int32)
        self._freed_buf = np.empty(0, np.int32)  # scratch of _release_held: blocks it freed
        self._freed_rep = np.empty(0, np.int32)  # and the index of the row that freed each
        self._simple = len(self.groups) == 1 and not self.groups[0].window
        # Scratch of the several-groups append path (_append_fast_groups): per group its plan.
        self._gplan_grow = np.empty((len(self.groups), R), np.int64)
        self._gplan_cow = np.empty((len(self.groups), R), bool)
        self._gplan_needs = np.empty(len(self.groups), np.int64)
        self._gplan_changed = np.empty(R, bool)
        # every group's arrays as tuples, and block sizes as an array: rowloops.append_batch_groups'
        self._group_arrays = (self.tables, self.num_blocks, self.last_blocks,
                              tuple(g.num_registered for g in self.groups))
        self._group_block_sizes = np.array(self.block_sizes, np.int64)
        if len(self.groups) > 1:
            rowloops.warm_up_groups(len(self.groups))  # (one group's loops load in warm_up)
        self.max_cross_blocks = _cdiv(config.max_encoder_len, config.encoder_block_size)
        self.cross_table = np.zeros((R, self.max_cross_blocks), np.int32)
        self.cross_num_blocks = np.zeros(R, np.int32)
        self._row_of: dict[ReqId, int] = {}
        self._id_of: dict[int, ReqId] = {}
        self._free_rows = list(range(R - 1, -1, -1))
        self._swapped: dict[int, _Swapped] = {}
        self._cache_keys: dict[tuple[int, int], int] = {}  # (space, group) -> pool cache key
        self._free_key_ids: list[int] = []
        self._next_key_id = 1
        # Registration spaces: space id -> (namespace, writer, id of the space (namespace, 0)).
        self._spaces: dict[tuple[int, int], int] = {(0, 0): 0}
        self._space_info: dict[int, tuple[int, int, int]] = {0: (0, 0, 0)}
        self._next_space = 1
        self._key_writer: dict[int, int] = {}  # side key -> its writer
        # writer -> (tick, registration, side key, blocks) in registration order
        self._unconfirmed: dict[int, deque] = {}
        # the registration (a serial number) that cached a block unconfirmed, meaningful while it
        # is: a confirmation confirms a block only for that registration
        self._block_reg = np.zeros(config.num_gpu_blocks, np.int64)
        self._num_regs = 0
        self.tick = 0
        """Counts the calls that may register blocks (step, allocate, append_slots, swap_in)."""
        self._copies: list[np.ndarray] = []
        self._deferred: list[tuple] = []  # (_APPENDS, ...), (_ADMITTED, ...) or (_CONFIRM, writer, tick): see below
        # Confirmations a flush ran out of promotion budget for, writer -> through tick, in the
        # order they first waited; they go before everything in _deferred. A writer's later ones
        # merge into its waiting one: one entry per writer, however long a backlog lasts.
        self._waiting: dict[int, int] = {}
        self._ns_out = np.zeros(1, np.int64)  # rowloops.next_blocks's namespace
        # With KV events on (enable_kv_events), per group and row the hash of the row's last
        # registered block (NO_PARENT: none yet): the parent of its next registration (kvd.runs).
        self._tails: list[np.ndarray] | None = None
        self._watermark_blocks = int(config.watermark * config.num_gpu_blocks)
        self._no_hashes = [self._empty_hashes] * len(self.groups)
        self.counters = dict(prefix_queries=0, prefix_hits=0, swaps_out=0, swaps_in=0, cow_copies=0)

    # ================================================================== ids and rows
    def row_of(self, req_id: ReqId) -> int:
        try:
            return self._row_of[req_id]
        except (KeyError, TypeError):
            raise errors.UnknownRequest(f"unknown request {req_id!r}") from None

    def rows_of(self, req_ids: Sequence[ReqId]) -> np.ndarray:
        get = self._row_of.get
        rows = np.fromiter((get(r, -1) for r in req_ids), np.int32, count=len(req_ids))
        if rows.size and rows.min() < 0:
            bad = req_ids[int(np.argmin(rows))]
            raise errors.UnknownRequest(f"unknown request {bad!r}")
        return rows

    def req_id_of_row(self, row: int) -> ReqId | None:
        return self._id_of.get(row)

    def __contains__(self, req_id: ReqId) -> bool:
        return req_id in self._row_of

    @property
    def num_requests(self) -> int:
        return len(self._row_of)

    def _space(self, namespace: int, writer: int) -> int:
        """The registration space of (namespace, writer): what a row stores in ``self.namespace``."""
        space = self._spaces.get((namespace, writer))
        if space is None:
            for name, value in (("namespace", namespace), ("writer", writer)):
                if type(value) is not int and not isinstance(value, np.integer) or value < 0:
                    raise errors.InvalidArgument(f"{name} must be a non-negative integer, got {value!r}")
            shared = self._space(namespace, 0) if writer else self._next_space
            space = self._next_space
            self._next_space += 1
            self._spaces[(namespace, writer)] = space
            self._space_info[space] = (int(namespace), int(writer), shared)
        return space

    def _cache_key(self, space: int, group: int) -> int:
        """The pool cache key a space registers under: the namespace's shared map for writer 0,
        the writer's side key otherwise (its blocks go into the shared map, unconfirmed)."""
        key = self._cache_keys.get((space, group))
        if key is None:
            _, writer, shared = self._space_info[space]
            shared_key = self._cache_key(shared, group) if writer else 0
            if self._free_key_ids:
                key = self._free_key_ids.pop()
            else:
                key = self._next_key_id
                if key > np.iinfo(np.uint16).max:
                    raise errors.CapacityExceeded("too many prefix-cache namespaces")
                self._next_key_id += 1
            self._cache_keys[(space, group)] = key
            if writer:
                self.pool.side_of[key] = shared_key
                self._key_writer[key] = writer
        return key

    def _lookup_keys(self, space: int, group: int) -> tuple[int, int]:
        """(shared key, side key or 0) that lookups of a space read."""
        _, writer, shared = self._space_info[space]
        if not writer:
            return self._cache_key(space, group), 0
        return self._cache_key(shared, group), self._cache_key(space, group)

    def cache_keys_of(self, namespace: int) -> list[tuple[int, int]]:
        """(cache key, group) of every prefix-cache map of a namespace, shared maps and side keys."""
        return [(k, g) for (space, g), k in self._cache_keys.items() if self._space_info[space][0] == namespace]

    def cache_key_owner(self, key: int) -> tuple[int, int]:
        """(namespace, group) of a prefix-cache key (the pool's ``cache_key``)."""
        for (space, group), k in self._cache_keys.items():
            if k == key:
                return self._space_info[space][0], group
        raise errors.InvalidArgument(f"no prefix-cache key {key}")

    def enable_kv_events(self) -> list:
        """Record prefix-cache changes for a KV events publisher (kvd.events) from now on; returns
        the pool's event log. Each stored entry is then one request's run of blocks in chain order
        with its parent hash, and the token ids of those blocks when the caller supplied them
        (``AdmitRequest.token_ids``, ``StepBatch.append_token_ids``). Call it before admitting
        anything: a request's chain is followed from its admission on."""
        if self._tails is None:
            if self._row_of:
                raise errors.InvalidArgument("enable KV events before admitting requests")
            self._tails = [np.zeros(self.num_tokens.size, self.hash_dtype) for _ in self.groups]
            self.pool.event_log = []
        return self.pool.event_log

    def _set_tails(self, gi: int, rows, hashes) -> None:
        """Rows' last registered hashes of group ``gi`` (events on only)."""
        self._tails[gi][rows] = hashes

    # ================================================================== computed state
    def _register_in(self, key: int, hashes: np.ndarray, blocks: np.ndarray, tick: int | None = None,
                     runs: Runs | None = None) -> None:
        """Register full blocks under cache key ``key``; what a writer's side key stores waits for
        its confirmation of the tick of the call that filled them (``tick``, default this one).
        ``runs`` (events on): the blocks' request runs and parents (kvd.runs)."""
        self._store(key, hashes, blocks, self.tick if tick is None else tick, runs)

    def _store(self, key: int, hashes: np.ndarray, blocks: np.ndarray, tick: int, runs: Runs | None = None) -> None:
        shared = self.pool.side_of.get(key)
        if shared is None:
            self.pool.register(key, hashes, blocks, runs=runs)
            return
        masks = self.pool.register(shared, hashes, blocks, key)
        if masks is ALL_SHARED:
            if blocks.size:
                self._note_unconfirmed(self._key_writer[key], key, blocks, tick, runs)
            return
        stored = masks[0] | masks[1]
        if stored.any():  # in chain order: the events of its confirmation follow the chains
            self._note_unconfirmed(self._key_writer[key], key, blocks[stored], tick,
                                   None if runs is None else runs.take(stored))

    def _note_unconfirmed(self, writer: int, key: int, blocks: np.ndarray, tick: int, runs: Runs | None = None) -> None:
        """Queue blocks ``writer`` stored (under side key ``key``) at ``tick`` for confirmation
        when it confirms that tick. ``_block_reg`` remembers each block's registration: an entry
        evicted (its block reused, perhaps stored again) must not be confirmed by the earlier
        registration's turn."""
        fifo = self._unconfirmed.get(writer)
        if fifo is None:
            fifo = self._unconfirmed[writer] = deque()
        self._num_regs += 1
        fifo.append((tick, self._num_regs, key, blocks, runs))
        self._block_reg[blocks] = self._num_regs

    def _check_computed(self, through_tick) -> None:
        if type(through_tick) is not int and not isinstance(through_tick, np.integer) or not 0 <= through_tick <= self.tick:
            raise errors.InvalidArgument(f"computed tick must be in [0, {self.tick}], got {through_tick!r}")

    def mark_computed(self, writer: int, through_tick: int) -> None:
        """Writer ``writer`` has finished the forward passes of every call up to ``through_tick``:
        the blocks it registered in them become visible to every lookup of their namespace."""
        self._check_computed(through_tick)
        try:  # (inline, not _refuses_misuse: a daemon's decode step confirms every time)
            fifo = self._unconfirmed.get(writer)
        except TypeError:
            raise errors.InvalidArgument(f"writer must be an int, got {writer!r}") from None
        if not self._deferred and not self._waiting and (not fifo or fifo[0][0] > through_tick):
            return  # (deferred registrations join the queue when flushed, before this confirmation)
        if self.config.defer_cache_registration:
            # like a decode step's registrations: after the reply, before anything reads the cache
            self._deferred.append((_CONFIRM, writer, through_tick))
        else:
            self.flush_deferred()
            self._promote(writer, through_tick)

    def _promote(self, writer: int, through_tick: int, budget: int | None = None) -> int | None:
        """Confirm what ``writer`` confirmed, at most ``budget`` blocks (None: all). Returns the
        budget left, or None when it ran out first."""
        fifo = self._unconfirmed.get(writer)
        taken = []
        while fifo and fifo[0][0] <= through_tick:
            tick, reg, key, blocks, runs = fifo[0]
            if budget is not None and blocks.size > budget:
                if budget <= 0:
                    break
                rest = None if runs is None else runs.take(slice(budget, None))
                fifo[0] = (tick, reg, key, blocks[budget:], rest)  # the rest stays queued
                blocks = blocks[:budget]
                runs = None if runs is None else runs.take(slice(None, budget))
            else:
                fifo.popleft()
            if budget is not None:
                budget -= blocks.size
            taken.append((reg, key, blocks, runs))
        if taken:
            self._confirm_entries(taken)
        if budget is None:
            return 0
        return None if budget <= 0 and fifo and fifo[0][0] <= through_tick else budget

    def _confirm_entries(self, taken: list) -> None:
        """Make registrations' blocks that are still cached by those very registrations visible:
        shared entries in place (one array write), side entries by moving them."""
        pool = self.pool
        sizes = [e[2].size for e in taken]
        blocks = taken[0][2] if len(taken) == 1 else np.concatenate([e[2] for e in taken])
        if pool.event_log is None and rowloops.HAVE_NUMBA:  # the usual case, in one loop
            n = rowloops.confirm_in_place(
                blocks.astype(np.int32, copy=False), np.array(sizes, np.int64),
                np.array([e[0] for e in taken], np.int64), np.array([e[1] for e in taken], np.uint16),
                self._block_reg, pool.unconfirmed_by, pool.cache_key)
            if n != rowloops.DECLINED:
                pool.num_unconfirmed -= n
                return
        regs = np.repeat(np.array([e[0] for e in taken], np.int64), sizes)
        keys = np.repeat(np.array([e[1] for e in taken], np.uint16), sizes)
        live = (self._block_reg[blocks] == regs) & (pool.unconfirmed_by[blocks] == keys)
        in_side = live & (pool.cache_key[blocks] == keys)
        in_shared = live & ~in_side
        if not in_side.any():
            confirmed = blocks[in_shared]
            pool.confirm(confirmed)
            if pool.event_log is not None and confirmed.size:
                self._log_confirmed(taken, confirmed, in_shared)
            return
        ends = np.cumsum(sizes)
        for (reg, key, entry, runs), end, size in zip(taken, ends.tolist(), sizes):
            sl = slice(end - size, end)
            shared, side = in_shared[sl], in_side[sl]
            pool.confirm(entry[shared])
            published = shared
            if side.any():
                moved = pool.promote(key, entry[side])
                published = shared.copy()
                published[np.flatnonzero(side)[moved]] = True
            if pool.event_log is not None and published.any():
                pool.log_stored(pool.side_of[key], pool.block_hash[entry[published]],
                                None if runs is None else runs.take(published))

    def _log_confirmed(self, taken: list, confirmed: np.ndarray, mask: np.ndarray) -> None:
        """KV events of confirmed blocks (``mask`` over the taken entries' blocks), in one log
        entry when the entries share a map (one writer's: they do unless it has several groups)."""
        pool = self.pool
        key = pool.side_of[taken[0][1]]
        if len(taken) > 1 and any(pool.side_of[e[1]] != key for e in taken):
            start = 0
            for _, side_key, entry, runs in taken:
                sub = mask[start : start + entry.size]
                start += entry.size
                if sub.any():
                    pool.log_stored(pool.side_of[side_key], pool.block_hash[entry[sub]],
                                    None if runs is None else runs.take(sub))
            return
        runs = [e[3] for e in taken]
        joined = None if any(r is None for r in runs) else Runs.concat(runs).take(mask)
        pool.log_stored(key, pool.block_hash[confirmed], joined)

    def drop_writer(self, writer: int) -> None:
        """Forget a writer that has gone (its session ended): blocks it never confirmed leave the
        cache (their KV may never have been written). It must hold no request."""
        self._drop_spaces([s for (ns, w), s in self._spaces.items() if w == writer and w])

    def drop_namespace(self, namespace: int) -> None:
        """Forget a namespace whose KV memory is gone (e.g. a session's private one): its cached
        blocks become fresh. No request may be in it."""
        self._drop_spaces([s for (ns, w), s in self._spaces.items() if ns == namespace and s != 0])

    def _drop_spaces(self, spaces: list[int]) -> None:
        if not spaces:
            return
        self.flush_deferred()
        held = np.isin(self.namespace[self.active], spaces)
        if held.any():
            raise errors.InvalidArgument("cannot drop a namespace or writer that still holds requests")
        doomed = {(s, g): k for (s, g), k in self._cache_keys.items() if s in spaces}
        side_keys = {k for k in doomed.values() if k in self._key_writer}
        ok = self.pool.reset_cache(set(doomed.values()), side_keys)
        assert ok, "blocks of a dropped space are still held"
        dropped = set(doomed.values())
        for writer in {self._key_writer[k] for k in dropped if k in self._key_writer}:
            # Entries of dropped keys must go: a recycled key id would otherwise be promoted early.
            kept = deque(e for e in self._unconfirmed.get(writer, ()) if e[2] not in dropped)
            if kept:
                self._unconfirmed[writer] = kept
            else:
                self._unconfirmed.pop(writer, None)
        for owner, key in doomed.items():
            del self._cache_keys[owner]
            self.pool.side_of.pop(key, None)
            self._key_writer.pop(key, None)
            self._free_key_ids.append(key)
        for space in spaces:
            ns, writer, _ = self._space_info.pop(space)
            del self._spaces[(ns, writer)]

    def _check_pending(self) -> None:
        """Every unconfirmed block waits in its writer's queue under its latest registration."""
        queued = {(key, int(b), reg) for w, fifo in self._unconfirmed.items()
                  for _, reg, key, blocks, _ in fifo for b in blocks.tolist() if self._key_writer.get(key) == w}
        pool = self.pool
        for b in np.flatnonzero(pool.unconfirmed_by).tolist():
            key = int(pool.unconfirmed_by[b])
            assert key in self._key_writer and key in pool.side_of
            assert (key, b, int(self._block_reg[b])) in queued, "an unconfirmed block would never be confirmed"

    # ================================================================== validation helpers
    def _hash_lists(self, block_hashes, num_tokens: int) -> list[np.ndarray]:
        """One validated S16 array per group. Accepts one array (or list of bytes) when there is
        one group, or a sequence with one array per group; empty means no hashes."""
        G = len(self.groups)
        try:
            empty = len(block_hashes) == 0
        except TypeError:
            raise errors.BadHashes("block hashes must be a sequence") from None
        if empty:
            return [self._empty_hashes] * G
        if isinstance(block_hashes, (list, tuple)) and all(
            isinstance(x, (np.ndarray, list, tuple)) for x in block_hashes
        ):
            per_group = list(block_hashes)
        else:
            per_group = [block_hashes]
        if len(per_group) != G:
            raise errors.BadHashes(f"expected block hashes for {G} group(s), got {len(per_group)}")
        out = []
        for g, hashes in zip(self.groups, per_group):
            arr = as_hash_array(hashes, self.hash_width) if len(hashes) else self._empty_hashes
            if arr.size > num_tokens // g.block_size:
                raise errors.BadHashes(
                    f"{arr.size} hashes for {num_tokens} tokens: more than the {num_tokens // g.block_size} full blocks"
                )
            out.append(arr)
        return out

    def _token_ids(self, token_ids, what: str) -> np.ndarray:
        """Token ids as a 1-D int32 array, or InvalidArgument."""
        if type(token_ids) is np.ndarray and token_ids.dtype == np.int32:  # what the daemon passes on
            arr = token_ids.reshape(-1)
            if arr.size and int(arr.min()) < 0:
                raise errors.InvalidArgument(f"{what} must be in [0, {_MAX_TOKEN_ID}]")
            return arr
        arr = int_array(token_ids, np.int64, what).reshape(-1)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN_ID):
            raise errors.InvalidArgument(f"{what} must be in [0, {_MAX_TOKEN_ID}]")
        return arr.astype(np.int32)

    def _admit_tokens(self, token_ids, hash_lists: list[np.ndarray], num_tokens: int) -> list[np.ndarray] | None:
        """An admission's token ids per group as [blocks, block_size] rows of its hashed blocks
        (None when no KV events are published: checked, then not kept)."""
        arr = self._token_ids(token_ids, "token_ids")
        need = max(h.size * g.block_size for g, h in zip(self.groups, hash_lists))
        if not need <= arr.size <= num_tokens:
            raise errors.InvalidArgument(
                f"token_ids: {arr.size} ids for a prompt of {num_tokens} tokens whose hashed blocks hold {need}")
        if self._tails is None:
            return None
        arr = _kept(arr)  # events may go out after the call (a writer's, at its confirmation)
        return [arr[: h.size * g.block_size].reshape(-1, g.block_size) for g, h in zip(self.groups, hash_lists)]

    def _block_tokens(self, token_lists, hash_lists: list[np.ndarray], what: str) -> list[np.ndarray] | None:
        """Per group the token ids of the blocks ``hash_lists`` name, [n, block_size] (None when no
        KV events are published: checked, then not kept)."""
        per_group = isinstance(token_lists, (list, tuple)) and all(
            isinstance(t, (np.ndarray, list, tuple)) for t in token_lists)
        if len(self.groups) == 1 and not (per_group and len(token_lists) == 1):
            token_lists = [token_lists]  # one group: its ids, flat or one row per block
        if len(token_lists) != len(self.groups):
            raise errors.InvalidArgument(f"{what} must be given for all {len(self.groups)} groups")
        out = []
        for g, h, t in zip(self.groups, hash_lists, token_lists):
            arr = self._token_ids(t, what)
            if arr.size != h.size * g.block_size:
                raise errors.InvalidArgument(
                    f"{what}: {arr.size} ids for {h.size} block(s) of {g.block_size} tokens")
            out.append(arr.reshape(-1, g.block_size))
        return [_kept(t) for t in out] if self._tails is not None else None  # kept: see _admit_tokens

    def _check_sizes(self, num_tokens: int, lookahead: int, what: str = "num_tokens") -> None:
        if not isinstance(num_tokens, (int, np.integer)) or isinstance(num_tokens, bool):
            raise errors.InvalidArgument(f"{what} must be an integer")
        if num_tokens < 0:
            raise errors.InvalidArgument(f"{what} must not be negative, got {num_tokens}")
        if not isinstance(lookahead, (int, np.integer)) or not 0 <= lookahead <= self.max_lookahead:
            raise errors.InvalidArgument(f"num_lookahead_tokens must be in [0, {self.max_lookahead}], got {lookahead}")

    def _check_new_request(self, req_id, num_tokens, lookahead, priority, num_encoder_tokens, max_new_tokens):
        try:
            known = req_id in self._row_of
        except TypeError:
            raise errors.InvalidArgument(f"request id {req_id!r} is not hashable") from None
        if known:
            raise errors.DuplicateRequest(f"request {req_id!r} already exists")
        self._check_sizes(num_tokens, lookahead)
        for name, value in (("priority", priority), ("num_encoder_tokens", num_encoder_tokens), ("max_new_tokens", max_new_tokens)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise errors.InvalidArgument(f"{name} must be an integer")
        if num_tokens < 1 or num_tokens > self.config.max_model_len:
            raise errors.InvalidArgument(f"num_tokens must be in [1, {self.config.max_model_len}], got {num_tokens}")
        if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise errors.InvalidArgument(f"priority must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority}")
        if not 0 <= num_encoder_tokens <= self.config.max_encoder_len:
            raise errors.InvalidArgument(
                f"num_encoder_tokens must be in [0, {self.config.max_encoder_len}], got {num_encoder_tokens}"
            )
        if max_new_tokens < 0:
            raise errors.InvalidArgument(f"max_new_tokens must not be negative, got {max_new_tokens}")

    # ================================================================== prefix cache
    def _cached_prefix(self, hash_lists: list[np.ndarray], num_tokens: int | None, space: int):
        """(cached tokens, per-group hit blocks for positions [skip, hit)) agreed by every group,
        as the lookups of registration space ``space`` see them."""
        if self._simple:  # one full-attention group (without the per-group lists: an admission's µs)
            hashes, g = hash_lists[0], self.groups[0]
            if not self.config.enable_prefix_caching or not hashes.size:
                return 0, [_EMPTY_I32]
            limit = hashes.size if num_tokens is None else min(hashes.size, (num_tokens - 1) // g.block_size)
            key, side_key = self._lookup_keys(space, 0)
            hits = self.pool.lookup(key, hashes[:limit], side_key)
            return hits.size * g.block_size, [hits]
        G = len(self.groups)
        if not self.config.enable_prefix_caching or not all(h.size for h in hash_lists):
            return 0, [_EMPTY_I32] * G
        limits = [
            h.size if num_tokens is None else min(h.size, (num_tokens - 1) // g.block_size)
            for g, h in zip(self.groups, hash_lists)
        ]
        if G == 1 and not self.groups[0].window:
            key, side_key = self._lookup_keys(space, 0)
            hits = self.pool.lookup(key, hash_lists[0][: limits[0]], side_key)
            return hits.size * self.groups[0].block_size, [hits]
        found = [self._hit_mask(gi, hash_lists[gi][: limits[gi]], space) for gi in range(G)]
        length = min(lim * g.block_size for lim, g in zip(limits, self.groups))
        while True:
            new_length = length
            for g, (mask, blocks) in zip(self.groups, found):
                new_length = min(new_length, self._longest_hit(g, mask, new_length))
            if new_length == length:
                break
            length = new_length
        hits = []
        for g, (mask, blocks) in zip(self.groups, found):
            end = length // g.block_size
            hits.append(blocks[int(g.skip_for(length)) : end].astype(np.int32))
        return length, hits

    def _hit_mask(self, g: int, hashes: np.ndarray, space: int):
        """Per-block hit flags and block ids (every block looked up: windows need no leading run)."""
        key, side_key = self._lookup_keys(space, g)
        blocks = self.pool.visible(key, hashes, side_key)
        if not self.groups[g].window:
            miss = np.flatnonzero(blocks < 0)
            if miss.size:
                blocks[miss[0] :] = -1
        return blocks >= 0, blocks

    @staticmethod
    def _longest_hit(g: _Group, mask: np.ndarray, cap_tokens: int) -> int:
        """Longest cached length <= cap (a multiple of the block size) this group can serve."""
        end = min(cap_tokens // g.block_size, mask.size)
        if not g.window:  # its leading run of hits (``_hit_mask`` cut it at the first miss)
            return min(end, int(np.count_nonzero(mask))) * g.block_size
        while end > 0:
            start = int(g.skip_for(end * g.block_size))
            if mask[start:end].all():
                return end * g.block_size
            end -= 1
        return 0

    @_refuses_misuse
    def lookup(self, block_hashes, namespace: int = 0, writer: int = 0) -> int:
        """Leading blocks (of group 0) already cached for ``writer`` in ``namespace``; changes nothing."""
        self.flush_deferred()
        hash_lists = self._hash_lists(block_hashes, 1 << 62)
        tokens, _ = self._cached_prefix(hash_lists, None, self._space(namespace, writer))
        return tokens // self.groups[0].block_size

    # ================================================================== admission
    def _admission_headroom(self) -> int:
        """Blocks admission may use now."""
        reserve = self._watermark_blocks
        if self.config.reserve_decode_blocks:
            g = self.groups[0]
            running = self.active & ~self.swapped
            reserve += int(np.count_nonzero(running & (self.num_tokens % g.block_size == 0)))
        return self.pool.num_free - reserve

    def _plan_admission(self, num_tokens, hash_lists, lookahead, space, max_new_tokens, num_encoder_tokens):
        """The admission decision: (AllocStatus, cached tokens, hit blocks per group, new blocks
        per group). Changes nothing."""
        if self._never_fits(num_tokens, lookahead, max_new_tokens, num_encoder_tokens):
            return AllocStatus.NEVER, 0, None, None
        cached, hits = self._cached_prefix(hash_lists, num_tokens, space)
        if self._simple:
            bs = self.groups[0].block_size
            new = [_cdiv(num_tokens + lookahead, bs) - cached // bs]
            need = new[0] + _cdiv(num_encoder_tokens, self.config.encoder_block_size)
            if hits[0].size:
                need += self.pool.num_unheld(hits[0])  # revived hits
        else:
            new = [_cdiv(num_tokens + lookahead, g.block_size) - cached // g.block_size for g in self.groups]
            need = sum(new) + _cdiv(num_encoder_tokens, self.config.encoder_block_size)
            need += sum(self.pool.num_unheld(h) for h in hits if h.size)  # revived hits
        if self.config.admit_full_sequence:
            need += sum(
                _cdiv(num_tokens + max_new_tokens, g.block_size) - _cdiv(num_tokens, g.block_size) for g in self.groups
            )
        if not self._free_rows or need > self._admission_headroom():
            return AllocStatus.LATER, cached, hits, new
        return AllocStatus.OK, cached, hits, new

    def _never_fits(self, num_tokens, lookahead, max_new_tokens, num_encoder_tokens) -> bool:
        tokens = num_tokens + (max_new_tokens if self.config.admit_full_sequence else 0)
        if tokens > self.config.max_model_len:
            return True
        blocks = sum(_cdiv(tokens + lookahead, g.block_size) for g in self.groups)
        blocks += _cdiv(num_encoder_tokens, self.config.encoder_block_size)
        return blocks > self.pool.num_blocks - 1 - self._watermark_blocks

    @_refuses_misuse
    def can_allocate(
        self,
        num_tokens: int,
        block_hashes=(),
        num_lookahead_tokens: int = 0,
        *,
        namespace: int = 0,
        writer: int = 0,
        max_new_tokens: int = 0,
        num_encoder_tokens: int = 0,
    ) -> AllocStatus:
        self.flush_deferred()
        # the checks allocate makes, so that both answer alike (a request id is not needed)
        self._check_new_request(_NO_REQ_ID, num_tokens, num_lookahead_tokens, DEFAULT_PRIORITY,
                                num_encoder_tokens, max_new_tokens)
        hash_lists = self._hash_lists(block_hashes, num_tokens)
        status, *_ = self._plan_admission(
            num_tokens, hash_lists, num_lookahead_tokens, self._space(namespace, writer), max_new_tokens,
            num_encoder_tokens,
        )
        return status

    @_refuses_misuse
    def allocate(
        self,
        req_id: ReqId,
        num_tokens: int,
        block_hashes=(),
        num_lookahead_tokens: int = 0,
        *,
        namespace: int = 0,
        writer: int = 0,
        priority: int = DEFAULT_PRIORITY,
        num_encoder_tokens: int = 0,
        max_new_tokens: int = 0,
        token_ids=None,
    ) -> AllocResult:
        """Admit a request. ``namespace``: whose prefix cache it reads and fills; ``writer``: who
        computes its KV (0: visible to every lookup at once; see the module doc). ``token_ids``:
        the prompt's token ids, for KV events (see ``AdmitRequest.token_ids``)."""
        self.flush_deferred()
        self.tick += 1
        result = self._admit(
            AdmitRequest(req_id, num_tokens, block_hashes, num_lookahead_tokens, priority, num_encoder_tokens,
                         max_new_tokens, token_ids),
            (namespace, writer),
        )
        self._debug_check()
        return result

    def _admit(self, req: AdmitRequest, space: int | tuple[int, int], defer: bool = False) -> AllocResult:
        """``space``: the registration space, or (namespace, writer) to find (or make) it once the
        request is found well formed. ``defer``: the prompt's cache registration waits for
        ``flush_deferred`` (a step's lone admission, ``defer_cache_registration``): nothing in the
        result depends on it."""
        num_tokens, lookahead = req.num_tokens, req.num_lookahead_tokens
        self._check_new_request(req.req_id, num_tokens, lookahead, req.priority, req.num_encoder_tokens, req.max_new_tokens)
        hash_lists = self._hash_lists(req.block_hashes, num_tokens)
        tokens = None if req.token_ids is None else self._admit_tokens(req.token_ids, hash_lists, num_tokens)
        if type(space) is tuple:
            space = self._space(*space)
        status, cached, hits, new = self._plan_admission(
            num_tokens, hash_lists, lookahead, space, req.max_new_tokens, req.num_encoder_tokens
        )
        if status != AllocStatus.OK:
            return AllocResult(int(status))  # LATER or NEVER, as can_allocate answers

        row = self._free_rows.pop()
        self._row_of[req.req_id] = row
        self._id_of[row] = req.req_id
        self.active[row] = True
        self.appendable[row] = True
        self.swapped[row] = False
        self.num_tokens[row] = num_tokens
        self.priority[row] = req.priority
        self.namespace[row] = space
        # every group's hits first: one group's fresh blocks may not evict a block another hits
        for hit in hits:
            if hit.size:
                self.pool.touch(hit)
        out = []
        for gi, g in enumerate(self.groups):
            hit = hits[gi]
            skip = int(g.skip_for(cached))
            end = cached // g.block_size
            fresh = self.pool.take(new[gi])
            g.table[row, :skip] = NULL_BLOCK
            g.table[row, skip:end] = hit
            g.table[row, end : end + fresh.size] = fresh
            g.num_blocks[row] = end + fresh.size
            g.last_block[row] = g.table[row, end + fresh.size - 1] if end + fresh.size else NULL_BLOCK
            g.num_skipped[row] = skip
            g.num_registered[row] = end
            if not defer:
                self._register(gi, row, hash_lists[gi], num_tokens, None if tokens is None else tokens[gi])
            out.append(g.table[row, : end + fresh.size].copy())
        if defer and self.config.enable_prefix_caching:
            self._deferred.append((_ADMITTED, row, [_kept(h) for h in hash_lists], num_tokens, tokens, self.tick))
        if req.num_encoder_tokens:
            cross = self.pool.take(_cdiv(req.num_encoder_tokens, self.config.encoder_block_size))
            self.cross_table[row, : cross.size] = cross
            self.cross_num_blocks[row] = cross.size
        if self.config.enable_prefix_caching:
            self.counters["prefix_queries"] += num_tokens
            self.counters["prefix_hits"] += cached
        return AllocResult(STATUS_OK, tuple(out), cached, row)

    def _register(self, gi: int, row: int, hashes: np.ndarray, num_tokens: int, tokens=None,
                  tick: int | None = None) -> None:
        """Register the row's full blocks [num_registered, len(hashes)) that are still present
        (``tokens``: their token ids, [len(hashes), block_size], or None; ``tick``: of the call
        that admitted the row, when a flush registers them later)."""
        if not self.config.enable_prefix_caching:
            return
        g = self.groups[gi]
        start = int(g.num_registered[row])
        stop = min(hashes.size, num_tokens // g.block_size)
        if self._tails is not None:
            self._set_tails(gi, row, hashes[max(start, stop) - 1] if max(start, stop) else NO_PARENT)
        if stop <= start:
            return
        blocks = g.table[row, start:stop]
        present = blocks != NULL_BLOCK
        runs = None
        if self._tails is not None:
            runs = Runs.chain(hashes[start:stop], hashes[start - 1] if start else NO_PARENT,
                              None if tokens is None else tokens[start:stop])
            runs = runs if present.all() else runs.take(present)
        self._register_in(self._cache_key(int(self.namespace[row]), gi), hashes[start:stop][present], blocks[present],
                          tick, runs)
        g.num_registered[row] = stop

    # ================================================================== appends
    @_refuses_misuse
    def append_slots(
        self, req_id: ReqId, num_new_tokens: int, new_block_hashes=(), num_lookahead_tokens: int = 0, *,
        new_block_token_ids=None,
    ) -> AppendResult:
        """Grow a request by ``num_new_tokens`` tokens (plus lookahead slots), registering
        ``new_block_hashes`` of blocks that became full; ``new_block_token_ids``: those blocks'
        token ids for KV events (see ``StepBatch.append_token_ids``)."""
        self.flush_deferred()
        row = self.row_of(req_id)
        self._check_sizes(num_new_tokens, num_lookahead_tokens, "num_new_tokens")
        if self.swapped[row]:
            raise errors.RequestSwapped(f"request {req_id!r} is swapped out; swap it in first")
        total = int(self.num_tokens[row]) + num_new_tokens
        if total > self.config.max_model_len:
            raise errors.InvalidArgument(f"request {req_id!r} would hold {total} tokens > max_model_len {self.config.max_model_len}")
        hash_lists = self._hash_lists(new_block_hashes, total)
        for g, hashes in zip(self.groups, hash_lists):
            unregistered = total // g.block_size - int(g.num_registered[row])
            if hashes.size > unregistered:
                raise errors.BadHashes(f"{hashes.size} hashes for {unregistered} full, unregistered block(s)")
        tokens = None
        if new_block_token_ids is not None:
            tokens = self._block_tokens(new_block_token_ids, hash_lists, "new_block_token_ids")
        counts = [np.array([h.size], np.int32) for h in hash_lists]
        self.tick += 1  # after the checks: misuse changes nothing, the tick included
        before = [int(g.num_blocks[row]) for g in self.groups]
        copies_before = len(self._copies)
        rows, n_new = np.array([row], np.int32), np.array([num_new_tokens], np.int64)
        code = int(self._append_rows(rows, n_new, hash_lists, counts, num_lookahead_tokens, tokens)[0][0])
        assert code in (STATUS_OK, STATUS_NO_SPACE), code  # misuse was rejected above
        if code == STATUS_NO_SPACE:
            return AppendResult(STATUS_NO_SPACE)
        new_ids = tuple(g.table[row, b : g.num_blocks[row]].copy() for g, b in zip(self.groups, before))
        copies = self._copies_since(copies_before)
        self._debug_check()
        return AppendResult(STATUS_OK, new_ids, copies)

    def _appends_look_valid(self, rows, n_new, lookahead, hash_counts) -> bool:
        """Whole-batch checks that the usual step passes with a few array operations: int32 rows in
        range, resident and distinct, sizes in bounds, hash counts not running ahead. False when
        any check fails (the caller then finds out which request is at fault)."""
        if rows.dtype != np.int32 or not 0 <= lookahead <= self.max_lookahead:
            return False
        if rows.size > self.num_tokens.size or rows.view(np.uint32).max() >= self.num_tokens.size \
                or not self.appendable[rows].all():
            return False  # (more rows than the manager has: one repeats)
        idx = self._arange[: rows.size]
        self._mark[rows] = idx
        if not (self._mark[rows] == idx).all():
            return False  # a row named twice
        if n_new.min() < 0:
            return False
        new = self.num_tokens[rows] + n_new
        if new.max() > self.config.max_model_len:
            return False
        for g, counts in zip(self.groups, hash_counts):
            if counts.any() and (counts.min() < 0 or (counts > new // g.block_size - g.num_registered[rows]).any()):
                return False
        return True

    def _validate_appends(self, rows, n_new, lookahead, hash_counts, status):
        """Mark per-request misuse in ``status`` (vectorized)."""
        if self._appends_look_valid(rows, n_new, lookahead, hash_counts):
            return
        R = self.num_tokens.size
        in_range = (rows >= 0) & (rows < R)
        safe = np.where(in_range, rows, 0)
        unknown = ~in_range | ~self.active[safe]
        status[unknown] = errors.UnknownRequest.code
        status[(status == 0) & self.swapped[safe]] = errors.RequestSwapped.code
        total = self.num_tokens[safe] + n_new
        bad_size = (n_new < 0) | (total > self.config.max_model_len)
        status[(status == 0) & bad_size] = errors.InvalidArgument.code
        if rows.size > 1:
            order = np.argsort(rows, kind="stable")
            dup = np.zeros(rows.size, bool)
            dup[order[1:]] = rows[order[1:]] == rows[order[:-1]]
            status[(status == 0) & dup] = errors.InvalidArgument.code
        for g, counts in zip(self.groups, hash_counts):
            allowed = total // g.block_size - g.num_registered[safe]
            status[(status == 0) & ((counts < 0) | (counts > allowed))] = errors.BadHashes.code
        if lookahead < 0 or lookahead > self.max_lookahead:
            status[status == 0] = errors.InvalidArgument.code

    def _append_rows(self, rows, n_new, hash_lists, hash_counts, lookahead, token_lists=None, defer: bool = False):
        """Grow many requests at once (``n_new``: an int for all, or one each). Returns the int16
        status per request and, when the fast path took the whole batch, the tokens each request
        had before and the rows whose tables changed (else None, None). ``token_lists``: per group
        the token ids of the hashed blocks (events on), or None. ``defer``: the fast path's
        registration may wait for ``flush_deferred`` (nothing later in the call reads the cache)."""
        n = rows.size
        if not n:
            return _EMPTY_I16, None, None
        fast = None
        if self._simple:
            fast = self._append_fast(rows, n_new, hash_lists[0], hash_counts and hash_counts[0], lookahead, defer,
                                     tokens=token_lists and token_lists[0])
        elif _GROUPS_FAST_PATH:  # (token ids register now: the deferred item of several groups has none)
            fast = self._append_fast_groups(rows, n_new, hash_lists, hash_counts, lookahead, token_lists,
                                            defer=defer and token_lists is None)
        if fast is not None:
            return np.zeros(n, np.int16), fast[0], fast[1].copy()
        if not isinstance(n_new, np.ndarray):
            n_new = np.full(n, n_new, np.int64)
        if hash_counts is None:
            hash_counts = [np.zeros(n, np.int64)] * len(self.groups)
        else:
            self._settle_registrations(rows, n_new, hash_counts)
        status = np.zeros(n, np.int16)
        self._validate_appends(rows, n_new, lookahead, hash_counts, status)
        valid = status == 0
        vrows = rows[valid]
        old = self.num_tokens[vrows]
        new = old + n_new[valid]
        grow = []
        need = np.zeros(vrows.size, np.int64)
        cow_cand = []
        for g in self.groups:
            want = _cdiv(new + lookahead, g.block_size)
            g_grow = np.maximum(want - g.num_blocks[vrows], 0)
            grow.append(g_grow)
            need += g_grow
            partial = (old % g.block_size != 0) & (new > old)
            last = g.table[vrows, np.minimum(old // g.block_size, g.table.shape[1] - 1)]
            cand = partial & (self.pool.ref_cnt[last] > 1)
            cow_cand.append(cand)
        any_cow = any(c.any() for c in cow_cand)
        avail = self.pool.num_free
        if any_cow:
            cow = [self._cow_plan(g, vrows, c, old) for g, c in zip(self.groups, cow_cand)]
            if int(need.sum()) + sum(int(c.sum()) for c in cow) <= avail:
                ok = np.ones(vrows.size, bool)
            else:  # short of blocks: decide one by one, as the greedy order needs
                ok, cow = self._decide_with_cow(vrows, need, cow_cand, avail, old)
        else:
            cow = None
            ok = self._greedy(need, avail) if int(need.sum()) > avail else np.ones(vrows.size, bool)
        vstatus = np.where(ok, STATUS_OK, STATUS_NO_SPACE).astype(np.int16)
        status[valid] = vstatus
        if not ok.any():
            return status, None, None
        orows, oold, onew = vrows[ok], old[ok], new[ok]
        no_copy = np.zeros(orows.size, bool)
        for gi, g in enumerate(self.groups):
            self._grow_group(g, orows, oold, onew - oold, grow[gi][ok], cow[gi][ok] if cow is not None else no_copy)
        self.num_tokens[orows] = onew
        self._register_appends(rows, status, hash_lists, hash_counts, token_lists=token_lists)
        grew = onew > oold  # a 0-token append (registering a prefill chunk's blocks) releases nothing
        for g in self.groups:
            if g.window:
                self._release_out_of_window(g, orows[grew], oold[grew])
        return status, None, None

    def _append_fast(self, rows, n_new, hashes, counts, lookahead, defer: bool = False, tokens=None,
                     own_counts: bool = False, mirror: tuple | None = None):
        """A batch of appends to the one full-attention group, copy-on-write included, in two
        compiled loops (``kvd.rowloops``). Returns (the tokens each request had before, the rows
        whose tables changed), or None, having changed nothing, whenever anything is unusual
        (misuse, no space): the general path then decides request by request. ``mirror``: the
        first five arguments of ``rowloops.mirror_appends``, written when the appends are applied."""
        n = rows.size
        if rows.dtype != np.int32 or n > self.num_tokens.size or not 0 <= lookahead <= self.max_lookahead:
            return None
        if hashes.size:
            self._settle_registrations(rows, n_new, (counts,))
        scalar = not isinstance(n_new, np.ndarray)
        n_scalar, n_array = (int(n_new), _EMPTY_I64) if scalar else (0, n_new)
        g = self.groups[0]
        old, grow, cow = self._plan_old[:n], self._plan_grow[:n], self._plan_cow[:n]
        pool = self.pool
        need, applied, n_copies, n_changed = rowloops.append_batch(
            rows, n_scalar, n_array, lookahead, counts if hashes.size else _EMPTY_I64, self.config.max_model_len,
            self.num_tokens, self.appendable, self.forked, self._num_forked > 0, self._mark,
            g.table, g.num_blocks, g.last_block, g.num_registered, pool.ref_cnt, g.block_size,
            pool.fresh_stack, pool.num_fresh, old, grow, cow, self._copies_buf, self._changed_buf,
        )
        if need < 0 or need > pool.num_free:
            return None
        if applied:
            pool.took_fresh(need)
        else:  # some of the blocks must be evicted from the prefix cache first
            if self._deferred or self._waiting:
                # which blocks are evicted depends on the cache's state: the deferred work first (a
                # confirmation reorders the free queue), as it would have run without deferral
                self.flush_deferred()
            n_copies, n_changed = rowloops.apply_appends(
                rows, n_scalar, n_array, old, grow, cow, pool.take(need), self.num_tokens, g.table, g.num_blocks,
                g.last_block, pool.ref_cnt, g.block_size, self._copies_buf, self._changed_buf,
            )
        self._record_copies(n_copies)
        if mirror is not None and n_changed:
            rowloops.mirror_appends(*mirror, rows, old, grow, cow, g.table, g.num_blocks, g.last_block, g.block_size)
        if hashes.size:
            if defer:  # the whole registration after the reply (the tables do not change before)
                kept_counts = counts if own_counts else _kept(counts)  # own: decode_rows widened them
                self._deferred.append((_APPENDS, rows.copy(), _kept(hashes), kept_counts, self.tick, tokens, 0))
            else:
                self._register_appends(rows, np.zeros(n, np.int16), [hashes], [counts],
                                       token_lists=None if tokens is None else [tokens])
        return old, self._changed_buf[:n_changed]  # views of scratch: valid until the next append

    def _append_fast_groups(self, rows, n_new, hash_lists, hash_counts, lookahead, token_lists=None,
                            defer: bool = False):
        """``_append_fast`` for a pool of several KV-cache groups or a sliding window: each group's
        plan in one compiled call (``rowloops.append_batch_groups``: one group's loops, group after
        group), all of them applied or none, then the
        general path's registration and window release; the same blocks, references, free queue and
        prefix cache as ``_append_rows``' request-by-request path (tests/test_group_fast_path.py).
        Returns (the tokens each request had before, a view of scratch; the rows whose tables
        changed: grown, copied on write, or a block slid out of a window) or None, having changed
        nothing, whenever anything is unusual (misuse, no space): the general path decides then.
        ``defer``: each group's registration queues behind the deferred work (one item per group)
        instead of running now. Either way the deferred work runs before blocks are evicted or
        slide out of a window: what both do depends on it (the general path runs it first)."""
        n = rows.size
        if rows.dtype != np.int32 or n > self.num_tokens.size or not 0 <= lookahead <= self.max_lookahead:
            return None
        scalar = not isinstance(n_new, np.ndarray)
        n_scalar, n_array = (int(n_new), _EMPTY_I64) if scalar else (0, n_new)
        pool = self.pool
        old = self._plan_old[:n]
        counts = tuple(_plain_counts(hash_counts[gi]) if hash_counts is not None and hash_lists[gi].size else _EMPTY_I64
                       for gi in range(len(self.groups)))
        if hash_counts is not None:
            self._settle_registrations(rows, n_new, [c if c.size else None for c in counts])
        changed = self._gplan_changed[:n]
        # every group planned, and applied at once when the fresh stack holds all their blocks
        total, applied, n_copies = rowloops.append_batch_groups(
            rows, n_scalar, n_array, lookahead, counts, self.config.max_model_len,
            self.num_tokens, self.appendable, self.forked, self._num_forked > 0, self._mark,
            *self._group_arrays, pool.ref_cnt, self._group_block_sizes, pool.fresh_stack, pool.num_fresh,
            old, self._gplan_grow, self._gplan_cow, self._gplan_needs, self._copies_buf, self._changed_buf, changed)
        if total < 0 or total > pool.num_free:
            return None
        if applied:
            pool.took_fresh(total)
            self._record_copies(n_copies)
        else:  # blocks to evict from the prefix cache first: group after group, as the pool hands them out
            if self._deferred or self._waiting:
                self.flush_deferred()  # which blocks are evicted depends on the cache's state
            changed[:] = False
            for gi, g in enumerate(self.groups):
                grow, cow = self._gplan_grow[gi, :n], self._gplan_cow[gi, :n]
                n_copies, _ = rowloops.apply_appends(
                    rows, n_scalar, n_array, old, grow, cow, pool.take(int(self._gplan_needs[gi])), self.num_tokens,
                    g.table, g.num_blocks, g.last_block, pool.ref_cnt, g.block_size, self._copies_buf,
                    self._changed_buf)
                self._record_copies(n_copies)
                if self._gplan_needs[gi]:
                    changed |= (grow > 0) | cow
        old = old.copy()  # (returned: the scratch is shared with _append_fast)
        if hash_counts is not None and defer:  # (decode_rows: no token ids)
            for gi, (hashes, counts) in enumerate(zip(hash_lists, hash_counts)):
                if hashes.size:
                    self._deferred.append((_APPENDS, rows.copy(), _kept(hashes), _kept(counts), self.tick, None, gi))
        elif hash_counts is not None:
            self._register_appends(rows, np.zeros(n, np.int16), hash_lists, hash_counts, token_lists=token_lists)
        grew = None if scalar else np.flatnonzero(n_array > 0)  # a 0-token append releases nothing
        for g in self.groups:
            if g.window and (not scalar or n_scalar > 0):
                slid = self._release_out_of_window(g, rows if scalar else rows[grew], old if scalar else old[grew])
                if slid is not None:
                    changed[slid if scalar else grew[slid]] = True
        return old, rows[changed]

    @staticmethod
    def _greedy(need: np.ndarray, avail: int) -> np.ndarray:
        """In batch order, each request fits if its need fits in what is left."""
        ok = np.ones(need.size, bool)
        for i in np.flatnonzero(need).tolist():
            if need[i] <= avail:
                avail -= int(need[i])
            else:
                ok[i] = False
        return ok

    def _cow_plan(self, g: _Group, vrows, cand, old) -> np.ndarray:
        """Which writers copy their shared partial block when every request fits: in batch order,
        the first ``ref - 1`` writers of a block copy it; a later one finds itself the only holder
        left and writes in place."""
        cow = np.zeros(vrows.size, bool)
        idx = np.flatnonzero(cand)
        if not idx.size:
            return cow
        blocks = g.table[vrows[idx], old[idx] // g.block_size]
        order = np.argsort(blocks, kind="stable")
        sorted_blocks = blocks[order]
        new_run = np.empty(idx.size, bool)
        new_run[0] = True
        np.not_equal(sorted_blocks[1:], sorted_blocks[:-1], out=new_run[1:])
        run_start = np.flatnonzero(new_run)
        run_len = np.diff(run_start, append=idx.size)
        rank = np.arange(idx.size) - np.repeat(run_start, run_len)
        cow[idx[order]] = rank < self.pool.ref_cnt[sorted_blocks] - 1
        return cow

    def _decide_with_cow(self, vrows, need, cow_cand, avail, old):
        """Sequential decision when some writers share their partial last block: a later sharer
        may find itself the only holder left and write in place."""
        ok = np.ones(vrows.size, bool)
        cow = [np.zeros(vrows.size, bool) for _ in self.groups]
        pending: dict[int, int] = {}
        ref = self.pool.ref_cnt
        cand_any = np.zeros(vrows.size, bool)
        for c in cow_cand:
            cand_any |= c
        for i in np.flatnonzero((need > 0) | cand_any).tolist():
            extra = []
            for gi, g in enumerate(self.groups):
                if cow_cand[gi][i]:
                    block = int(g.table[vrows[i], old[i] // g.block_size])
                    if ref[block] - pending.get(block, 0) > 1:
                        extra.append((gi, block))
            total = int(need[i]) + len(extra)
            if total > avail:
                ok[i] = False
                continue
            avail -= total
            for gi, block in extra:
                cow[gi][i] = True
                pending[block] = pending.get(block, 0) + 1
        return ok, cow

    def _grow_group(self, g: _Group, rows, old, n_new, grow, cow) -> None:
        """Give each request its copy-on-write block (``cow``) and ``grow`` new blocks, taken
        together and handed out in batch order (``kvd.rowloops.apply_appends``)."""
        total = int(grow.sum()) + int(np.count_nonzero(cow))
        if not total:
            return
        n_copies, _ = rowloops.apply_appends(
            rows, 0, n_new, old, grow, cow, self.pool.take(total), self.num_tokens, g.table, g.num_blocks,
            g.last_block, self.pool.ref_cnt, g.block_size, self._copies_buf, self._changed_buf,
        )
        self._record_copies(n_copies)

    def _copies_since(self, mark: int) -> np.ndarray:
        """The (src, dst) copies recorded since ``len(self._copies)`` was ``mark``."""
        new = self._copies[mark:]
        return _EMPTY_COPIES if not new else new[0] if len(new) == 1 else np.concatenate(new)

    def _record_copies(self, n_copies: int) -> None:
        if n_copies:
            self._copies.append(self._copies_buf[:n_copies].copy())
            self.counters["cow_copies"] += n_copies

    def _register_one_each(self, gi: int, rows, hashes, counts, tick: int | None = None, tokens=None) -> bool:
        """Registration when each request filled at most one block (a decode step): a few array
        operations. False when the requests span several registration spaces (the general path then)."""
        g = self.groups[gi]
        if self._tails is None:
            n = self._register_decode_blocks(gi, rows, hashes, counts, tick, rows.size)
            if n != rowloops.DECLINED:
                assert n == hashes.size, "one block per request of count 1"
                return True
        sel = rows[counts.astype(bool)]
        ns = self.namespace[sel]
        if ns.min() != ns.max():
            return False
        reg = g.num_registered[sel]
        blocks = g.table[sel, reg]
        present = blocks != NULL_BLOCK
        runs = None
        if self._tails is not None:  # every block a run of its own, after its row's last one
            runs = Runs.one_each(self._tails[gi][sel], tokens)
            self._set_tails(gi, sel, hashes)
        if not present.all():
            blocks, hashes = blocks[present], hashes[present]
            runs = None if runs is None else runs.take(present)
        self._register_in(self._cache_key(int(ns[0]), gi), hashes, blocks, tick, runs)
        g.num_registered[sel] = reg + 1
        return True

    def _register_decode_blocks(self, gi: int, rows, hashes, counts, tick: int | None, stop: int) -> int:
        """Register the blocks the first ``stop`` requests filled when one compiled call finds them
        all (``rowloops.next_blocks``: at most one each, one namespace, none cached yet): how many,
        or DECLINED, having changed nothing. A decode step's usual case, and an idle slice's."""
        g = self.groups[gi]
        blocks = np.empty(stop, np.int32)
        srows = np.empty(stop, np.int32)
        n = rowloops.next_blocks(rows, counts, stop, self.namespace, g.table, g.num_blocks, g.last_block,
                                 g.num_registered, self.pool.cache_key, blocks, srows, self._ns_out)
        if n > 0:
            self._register_in(self._cache_key(int(self._ns_out[0]), gi), hashes[:n], blocks[:n], tick)
            rowloops.add_one(g.num_registered, srows, n)
        return n

    def _register_head(self, item: tuple, k: int) -> tuple | None:
        """Register the first ``k`` requests of a deferred registration; returns the rest of it
        (None when nothing is left)."""
        _, rows, hashes, counts, tick, _, gi = item
        if (self._tails is None and self.config.enable_prefix_caching
                and self._register_decode_blocks(gi, rows, hashes, counts, tick, min(k, rows.size)) != rowloops.DECLINED):
            return None if k >= rows.size else _split_appends(item, k)[1]
        if k >= rows.size:
            self._register_deferred(item)
            return None
        head, rest = _split_appends(item, k)
        self._register_deferred(head)
        return rest

    def _register_appends(self, rows, status, hash_lists, hash_counts, tick: int | None = None,
                          token_lists=None) -> None:
        """Register the blocks that became full, with the hashes given (``tick``: of the call that
        filled them, when a flush registers them later; ``token_lists``: per group their token ids,
        events on)."""
        if not self.config.enable_prefix_caching:
            return
        for gi, (g, hashes, counts) in enumerate(zip(self.groups, hash_lists, hash_counts)):
            if not hashes.size:
                continue
            tokens = None if token_lists is None else token_lists[gi]
            if counts.max() == 1 and not status.any() and self._register_one_each(gi, rows, hashes, counts, tick, tokens):
                continue
            take = counts * (status == STATUS_OK)
            sel = np.flatnonzero(take)
            if not sel.size:
                continue
            starts = np.cumsum(counts) - counts
            c = counts[sel]
            hash_idx = np.repeat(starts[sel], c) + (np.arange(int(c.sum())) - np.repeat(np.cumsum(c) - c, c))
            srows = rows[sel]
            blocks, rep = _row_blocks(g.table, srows, g.num_registered[srows], g.num_registered[srows] + counts[sel], False)
            ns = self.namespace[srows]
            present = blocks != NULL_BLOCK
            runs = None if self._tails is None else self._append_runs(gi, srows, hashes, hash_idx, c, tokens)
            if np.all(ns == ns[0]):
                self._register_in(self._cache_key(int(ns[0]), gi), hashes[hash_idx][present], blocks[present], tick,
                                  None if runs is None else runs.take(present))
            else:  # in batch order: writers of one namespace compete for its shared entries
                space = ns[rep]
                cuts = [0, *(np.flatnonzero(space[1:] != space[:-1]) + 1).tolist(), space.size]
                for lo, hi in zip(cuts[:-1], cuts[1:]):
                    m = np.arange(lo, hi)[present[lo:hi]]
                    self._register_in(self._cache_key(int(space[lo]), gi), hashes[hash_idx[m]], blocks[m], tick,
                                      None if runs is None else runs.take(m))
            g.num_registered[srows] += counts[sel]

    def _append_runs(self, gi: int, srows, hashes, hash_idx, counts, tokens) -> Runs:
        """The runs of appended blocks ``hashes[hash_idx]``, ``counts`` per row of ``srows``: each
        row's first one after the row's last registered block, the rest after each other."""
        firsts = np.cumsum(counts) - counts
        parents = hashes[np.maximum(hash_idx - 1, 0)]
        parents[firsts] = self._tails[gi][srows]
        first = np.zeros(hash_idx.size, bool)
        first[firsts] = True
        self._set_tails(gi, srows, hashes[hash_idx[firsts + counts - 1]])
        return Runs(parents, first, None if tokens is None else tokens[hash_idx])

    def _release_out_of_window(self, g: _Group, rows, num_computed) -> np.ndarray | None:
        """Release the blocks of ``rows`` that slid out of the window once ``num_computed`` tokens
        are computed (``rowloops.slide_windows``); returns the indices into ``rows`` of those whose
        tables changed (None: none)."""
        num_computed = np.asarray(num_computed, np.int64)
        total, waits = rowloops.window_slides(rows, num_computed, g.window, g.block_size, g.num_blocks, g.num_skipped,
                                              g.table, g.num_registered, self.pool.unconfirmed_by)
        if not total:
            return None
        if waits and (self._deferred or self._waiting):
            # a released block's registration or confirmation first (whether and where it parks
            # as cached depends on them), as if never deferred
            self.flush_deferred()
        freed, rep, moved = np.empty(total, np.int32), np.empty(total, np.int32), np.empty(rows.size, np.int32)
        n, m = rowloops.slide_windows(rows, num_computed, g.window, g.block_size, g.table, g.num_blocks, g.num_skipped,
                                      self.pool.ref_cnt, freed, rep, moved)
        assert n >= 0, "a window released more references than its blocks had, or a row's last block"
        if n:
            prio = self.priority[rep[:n]]
            # one priority for all (the usual case) parks in one compiled pass (kvd.pool.park)
            self.pool.park(freed[:n], int(prio[0]) if prio.min() == prio.max() else prio)
        return moved[:m]

    # ================================================================== free
    @_refuses_misuse
    def free(self, req_id: ReqId) -> None:
        self.flush_deferred()
        row = self.row_of(req_id)
        self._free_rows_now(np.array([row], np.int32))
        self._debug_check()

    def _release_held(self, rows: np.ndarray) -> None:
        """Drop the references resident ``rows`` hold (each group's table, then the cross-attention
        table; each row tail first), freeing blocks with their row's priority."""
        if not rows.size:
            return
        rows = rows.astype(np.int32, copy=False)
        prio_rows = self.priority[rows]
        tables = [(g.table, g.num_skipped[rows], g.num_blocks[rows]) for g in self.groups]
        if self.max_cross_blocks:
            tables.append((self.cross_table, self._no_skip[: rows.size], self.cross_num_blocks[rows]))
        # each block is freed once at most: no more than the entries, nor than the pool's blocks
        most = min(sum(int(stops.sum()) for _, _, stops in tables), self.pool.num_blocks)
        if most > self._freed_buf.size:
            size = min(2 * most, self.pool.num_blocks)
            self._freed_buf = np.empty(size, np.int32)
            self._freed_rep = np.empty(size, np.int32)
        n = 0
        for table, starts, stops in tables:
            n = rowloops.drop_row_refs(table, rows, starts, stops, self.pool.ref_cnt, self._freed_buf, self._freed_rep, n)
            assert n >= 0, "more releases than references"
        if rows.size == 1 or bool((prio_rows == prio_rows[0]).all()):
            self.pool.park(self._freed_buf[:n], int(prio_rows[0]))
        else:
            self.pool.park(self._freed_buf[:n], prio_rows[self._freed_rep[:n]])

    def _free_rows_now(self, rows: np.ndarray) -> None:
        """Return every block of these (distinct, active) rows, tail blocks before head blocks."""
        swapped = self.swapped[rows]
        if swapped.any():
            self._release_held(rows[~swapped])
            for row in rows[swapped].tolist():
                record = self._swapped.pop(row)
                self._release_cpu(np.concatenate([*record.cpu_blocks, record.cross]))
        else:
            self._release_held(rows)
        row_list = rows.tolist()
        at = row_list[0] if len(row_list) == 1 else rows  # an int index writes ~10x faster than an array
        for g in self.groups:
            g.num_blocks[at] = 0
            g.last_block[at] = NULL_BLOCK
            g.num_registered[at] = 0
            g.num_skipped[at] = 0
        self.cross_num_blocks[at] = 0
        self.num_tokens[at] = 0
        self.active[at] = False
        self.appendable[at] = False
        self.swapped[at] = False
        self._num_forked -= int(np.count_nonzero(self.forked[at]))
        self.forked[at] = False
        row_of, id_of = self._row_of, self._id_of
        for row in row_list:
            del row_of[id_of.pop(row)]
        self._free_rows.extend(row_list)

    # ================================================================== fork
    @_refuses_misuse
    def fork(self, parent_id: ReqId, child_id: ReqId) -> None:
        self.flush_deferred()
        self._fork(parent_id, child_id)
        self._debug_check()

    def _fork(self, parent_id: ReqId, child_id: ReqId) -> int:
        """One fork, misuse raising its typed error before anything changes. Returns the child's row."""
        parent = self.row_of(parent_id)
        if self.swapped[parent]:
            raise errors.RequestSwapped(f"request {parent_id!r} is swapped out")
        self._check_new_request(child_id, 1, 0, DEFAULT_PRIORITY, 0, 0)
        if not self._free_rows:
            raise errors.CapacityExceeded("no free request row for the child")
        return int(self._apply_forks(parent, [child_id])[0])

    def _fork_batch(self, forks) -> np.ndarray | None:
        """Many forks at once when every one is valid (else None, nothing changed: the caller
        forks one by one and reports each error). Returns the children's rows."""
        try:
            parents, children = zip(*forks, strict=True)  # ValueError unless every fork is a pair
            one_parent = len(set(parents)) == 1
            prows = self.row_of(parents[0]) if one_parent else self.rows_of(parents)
            if (
                len(set(children)) != len(children)
                or not self._row_of.keys().isdisjoint(children)
                or len(children) > len(self._free_rows)
                or not (self.appendable[prows] if one_parent else self.appendable[prows].all())
            ):
                return None
        except (errors.KvdError, TypeError, ValueError):
            return None
        return self._apply_forks(prows, children)

    def _apply_forks(self, parents: int | np.ndarray, children: list) -> np.ndarray:
        """Children share every block of their parents (validated by the caller): ``parents`` is
        one row per child, or one row for all of them. Lookahead blocks past a parent's last token
        stay the parent's: the child reserves its own."""
        crows = self._claim_rows(children)
        prows = parents if isinstance(parents, np.ndarray) else np.array([parents], np.int32)
        ref = self.pool.ref_cnt
        g = self.groups[0]
        self._num_forked += rowloops.fork_rows(
            prows, crows, self.num_tokens, self.priority, self.namespace, self.active, self.appendable, self.forked,
            g.table, g.num_blocks, g.last_block, g.num_skipped, g.num_registered, ref, g.block_size,
        )
        for g in self.groups[1:]:
            rowloops.share_blocks(prows, crows, g.table, g.num_blocks, g.last_block, g.num_skipped, g.num_registered,
                                  ref, self.num_tokens, g.block_size)
        if self.max_cross_blocks:  # the cross table keeps no last block: a scratch array takes them
            rowloops.share_blocks(prows, crows, self.cross_table, self.cross_num_blocks, self._cross_last_scratch,
                                  self._no_skip, self._no_skip,
                                  ref, self.num_tokens, 0)
        if self._tails is not None:  # a child's chain goes on from its parent's
            for tails in self._tails:
                tails[crows] = tails[prows]
        return crows

    def _claim_rows(self, req_ids: list) -> np.ndarray:
        """Rows for new requests (enough are free: checked by the caller)."""
        k = len(req_ids)
        taken = self._free_rows[-k:][::-1]
        del self._free_rows[-k:]
        self._row_of.update(zip(req_ids, taken))
        self._id_of.update(zip(taken, req_ids))
        return np.array(taken, np.int32)

    @property
    def num_deferred(self) -> int:
        """Registrations and confirmations waiting for ``flush_deferred`` (a daemon runs it when
        its socket is idle; every call that reads the prefix cache runs it first)."""
        return len(self._deferred) + len(self._waiting)

    def flush_deferred(self, max_rows: int | None = None) -> int:
        """Finish prefix-cache registrations a decode step or a lone admission left for later (see
        ``ManagerConfig.defer_cache_registration``). ``max_rows``: register about that many
        requests' blocks and keep the rest queued, in order (an idle daemon works in slices, so that
        a message arriving meanwhile waits for one slice only). Confirmations run PROMOTE_BATCH
        blocks per call either way. Returns how many requests' registrations ran."""
        if not self._deferred and not self._waiting:
            return 0
        budget = self._promote_waiting(PROMOTE_BATCH)  # for the whole flush
        unfinished = []
        items = self._deferred
        done = 0
        for i, item in enumerate(items):
            if item[0] is _APPENDS:
                k = item[1].size if max_rows is None else max_rows - done
                if k <= 0:
                    unfinished += items[i:]
                    break
                rest = self._register_head(item, k)
                if rest is not None:
                    done += item[1].size - rest[1].size
                    unfinished += [rest, *items[i + 1:]]
                    break
                done += item[1].size
            elif item[0] is _ADMITTED:
                if max_rows is not None and done >= max_rows:
                    unfinished += items[i:]
                    break
                _, row, hash_lists, num_tokens, tokens, tick = item
                for gi, hashes in enumerate(hash_lists):
                    self._register(gi, row, hashes, num_tokens, None if tokens is None else tokens[gi], tick)
                done += 1
            elif budget is None or (budget := self._promote(item[1], item[2], budget)) is None:
                self._wait(item[1], item[2])  # the next call (or reply) goes on with it
        self._deferred[:] = unfinished
        return done

    def _settle_registrations(self, rows, n_new, count_lists) -> None:
        """Before a step that registers blocks (``count_lists``: per group, a count per row of
        ``rows``, or None) is checked against ``num_registered``: run the deferred work when an
        append's registration waiting in it would change the outcome, i.e. when a row registers
        more blocks than it has full ones beyond those registered and those waiting. Deferral then
        never changes what a step is told (a registration running ahead of the full blocks is
        BadHashes, as it would be had the earlier one been registered at once), and costs nothing
        otherwise."""
        if not self._deferred:
            return
        for gi, counts in enumerate(count_lists or ()):
            if counts is None or np.shape(counts) != rows.shape or not np.any(counts):
                continue
            items = [it for it in self._deferred if it[0] is _APPENDS and it[6] == gi]
            if not items:
                continue
            sel = np.flatnonzero(np.asarray(counts) > 0)
            sel = sel[(rows[sel] >= 0) & (rows[sel] < self.num_tokens.size)]  # (misuse: checked after this)
            r = rows[sel]
            g = self.groups[gi]
            total = self.num_tokens[r] + (n_new[sel] if isinstance(n_new, np.ndarray) else n_new)
            slack = total // g.block_size - g.num_registered[r] - np.asarray(counts)[sel]
            if slack.size and slack.min() >= sum(int(it[3].max()) for it in items if it[3].size):
                continue  # more full blocks to spare than could be waiting for any row
            waiting = np.zeros(self.num_tokens.size, np.int64)
            for it in items:
                np.add.at(waiting, it[1], it[3])
            if (slack < waiting[r]).any():
                self.flush_deferred()
                return

    def _promote_waiting(self, budget: int) -> int | None:
        """Run waiting confirmations in order while the budget lasts (the rest keep waiting)."""
        waiting = self._waiting
        while waiting:
            writer, through = next(iter(waiting.items()))
            budget = self._promote(writer, through, budget)
            if budget is None:
                return None
            del waiting[writer]
        return budget

    def _wait(self, writer: int, through: int) -> None:
        waiting = self._waiting
        waiting[writer] = max(waiting.get(writer, through), through)

    def _register_deferred(self, item: tuple) -> None:
        _, rows, hashes, counts, tick, tokens, gi = item
        G = len(self.groups)
        hash_lists, count_lists, token_lists = [self._empty_hashes] * G, [None] * G, [None] * G
        hash_lists[gi], count_lists[gi], token_lists[gi] = hashes, counts, tokens
        self._register_appends(rows, np.zeros(rows.size, np.int16), hash_lists, count_lists, tick,
                               None if tokens is None else token_lists)

    def take_copies(self) -> np.ndarray:
        """Copy-on-write ``(src, dst)`` pairs since the last call; the KV owner performs them
        before the next forward pass."""
        if not self._copies:
            return _EMPTY_COPIES
        out = np.concatenate(self._copies)
        self._copies.clear()
        return out

    # ================================================================== swap
    def _swap_rows(self, req_ids) -> np.ndarray:
        ids = [req_ids] if not isinstance(req_ids, (list, tuple)) else list(req_ids)
        rows = self.rows_of(ids)
        if np.unique(rows).size != rows.size:
            raise errors.InvalidArgument("a request is named twice")
        return rows

    def _swap_out_plan(self, rows):
        """Each table's (blocks, blocks per row) for resident ``rows`` (groups, then cross), the
        distinct GPU blocks they hold, how many references each has among them, and whether the
        CPU pool has room for them."""
        parts = [(g.table, g.num_skipped[rows], g.num_blocks[rows]) for g in self.groups]
        parts.append((self.cross_table, np.zeros_like(rows), self.cross_num_blocks[rows]))
        entries = []
        for table, starts, stops in parts:
            blocks, _ = _row_blocks(table, rows, starts, stops, False, need_rep=False)
            entries.append((blocks, np.maximum(stops - starts, 0)))
        flat = np.concatenate([b for b, _ in entries])
        gpu, counts = np.unique(flat[flat != NULL_BLOCK], return_counts=True)
        if self.config.num_cpu_blocks <= 0 or gpu.size > self.cpu_pool.num_blocks - 1:
            status = AllocStatus.NEVER
        else:
            status = AllocStatus.OK if gpu.size <= self.cpu_pool.num_free else AllocStatus.LATER
        return entries, gpu, counts, status

    @_refuses_misuse
    def can_swap_out(self, req_ids) -> AllocStatus:
        """OK when the CPU pool has room for the requests' blocks now, LATER when it may after
        other requests are swapped in or freed, NEVER when it is too small (or absent)."""
        self.flush_deferred()
        return self._swap_out_plan(self._check_swap_out(req_ids))[3]

    def _check_swap_out(self, req_ids) -> np.ndarray:
        rows = self._swap_rows(req_ids)
        if self.swapped[rows].any():
            raise errors.RequestSwapped("request already swapped out")
        return rows

    @_refuses_misuse
    def swap_out(self, req_ids) -> SwapResult:
        """Move requests' blocks to the CPU pool; a block shared among them moves once and stays
        shared. Returns ``(gpu_block, cpu_block)`` pairs to copy."""
        self.flush_deferred()
        rows = self._check_swap_out(req_ids)
        entries, gpu, counts, status = self._swap_out_plan(rows)
        if status != AllocStatus.OK:
            return SwapResult(int(status))
        cpu = self.cpu_pool.take(gpu.size)
        self.cpu_pool.ref_cnt[cpu] = counts
        self.cpu_pool.block_hash[cpu] = self.pool.block_hash[gpu]
        self._cpu_carry_key[cpu] = self.pool.cache_key[gpu]
        # Each table's CPU ids, cut into one piece per row (entries are row after row).
        per_table = []
        for blocks, per_row in entries:
            ids = np.where(blocks == NULL_BLOCK, -1, cpu[np.minimum(np.searchsorted(gpu, blocks), gpu.size - 1)])
            per_table.append(np.split(ids, np.cumsum(per_row)[:-1]))
        for i, row in enumerate(rows.tolist()):
            self._swapped[row] = _Swapped(
                [pieces[i] for pieces in per_table[:-1]], [int(g.num_skipped[row]) for g in self.groups], per_table[-1][i]
            )
        self._release_rows_gpu(rows)
        self.swapped[rows] = True
        self.appendable[rows] = False
        self.counters["swaps_out"] += gpu.size
        self._debug_check()
        return SwapResult(STATUS_OK, np.stack([gpu, cpu], axis=1).astype(np.int32))

    def _release_rows_gpu(self, rows) -> None:
        self._release_held(rows)
        for g in self.groups:
            g.table[rows] = NULL_BLOCK
            g.num_blocks[rows] = 0
            g.last_block[rows] = NULL_BLOCK
        self.cross_table[rows] = NULL_BLOCK
        self.cross_num_blocks[rows] = 0

    def _check_swap_in(self, req_ids) -> np.ndarray:
        rows = self._swap_rows(req_ids)
        if not self.swapped[rows].all():
            raise errors.RequestNotSwapped("request is not swapped out")
        return rows

    def _swap_in_plan(self, rows):
        cpu_all = np.concatenate(
            [b for row in rows.tolist() for b in (*self._swapped[row].cpu_blocks, self._swapped[row].cross)]
        )
        cpu_live = cpu_all[cpu_all >= 0]
        cpu, counts = np.unique(cpu_live, return_counts=True)
        keys = self._cpu_carry_key[cpu]
        found = np.full(cpu.size, -1, np.int64)
        for key in np.unique(keys[keys != 0]).tolist():
            sel = np.flatnonzero(keys == key)
            found[sel] = self.pool.cached_in(key, self.cpu_pool.block_hash[cpu[sel]])
        # (two CPU blocks of the same content, swapped out by two requests, find the same block)
        revived = int(np.count_nonzero(self.pool.ref_cnt[np.unique(found[found >= 0])] == 0))
        need = int(np.count_nonzero(found < 0)) + revived
        return cpu, counts, found, need

    @_refuses_misuse
    def can_swap_in(self, req_ids) -> AllocStatus:
        """OK when the GPU pool has room for the requests' blocks now (admission's headroom),
        LATER when it may later, NEVER when they need more blocks than the pool can ever give."""
        self.flush_deferred()
        rows = self._check_swap_in(req_ids)
        if not rows.size:  # nothing to bring back (as swap_out of nothing)
            return AllocStatus.OK
        return self._swap_in_status(self._swap_in_plan(rows)[3])

    def _swap_in_status(self, need: int) -> AllocStatus:
        if need > self.pool.num_blocks - 1 - self._watermark_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if need <= self._admission_headroom() else AllocStatus.LATER

    @_refuses_misuse
    def swap_in(self, req_ids) -> SwapResult:
        """Bring swapped requests back. Content still in the GPU prefix cache is reused without a
        copy. Returns ``(cpu_block, gpu_block)`` pairs to copy."""
        self.flush_deferred()
        rows = self._check_swap_in(req_ids)
        if not rows.size:  # nothing to bring back: a no-op, as swap_out of nothing
            return SwapResult(STATUS_OK)
        self.tick += 1
        cpu, counts, found, need = self._swap_in_plan(rows)
        status = self._swap_in_status(need)
        if status != AllocStatus.OK:
            return SwapResult(int(status))
        hit = found >= 0
        gpu = np.empty(cpu.size, np.int32)
        if hit.any():
            # One reference per table entry; CPU blocks of the same content find the same cached
            # block, which takes all of theirs (touch wants unique ids, += adds once per id).
            reused, which = np.unique(found[hit], return_inverse=True)
            reused = reused.astype(np.int32)
            self.pool.touch(reused)
            self.pool.ref_cnt[reused] += np.bincount(which, counts[hit]).astype(np.int32) - 1
            gpu[hit] = found[hit]
        miss = np.flatnonzero(~hit)
        fresh = self.pool.take(miss.size)
        self.pool.ref_cnt[fresh] = counts[miss]
        gpu[miss] = fresh
        keys = self._cpu_carry_key[cpu[miss]]
        if self._tails is not None:
            self._register_swapped_in(rows, cpu, gpu, miss[keys != 0])
        for key in (np.unique(keys[keys != 0]).tolist() if self._tails is None else ()):
            sel = miss[keys == key]
            self._register_in(key, self.cpu_pool.block_hash[cpu[sel]], gpu[sel])
        records = [self._swapped.pop(row) for row in rows.tolist()]
        tables = [(g.table, g.num_blocks, [r.cpu_blocks[gi] for r in records], [r.num_skipped[gi] for r in records])
                  for gi, g in enumerate(self.groups)]
        tables.append((self.cross_table, self.cross_num_blocks, [r.cross for r in records], [0] * len(records)))
        for table, num_blocks, pieces, skips in tables:
            # The rows were nulled at swap-out: write each row's blocks back at [skip, skip + n).
            lens = np.fromiter((p.size for p in pieces), np.int64, count=len(pieces))
            skip = np.array(skips, np.int64)
            if lens.sum():
                ids = np.concatenate(pieces)
                gpu_ids = np.where(ids < 0, NULL_BLOCK, gpu[np.searchsorted(cpu, np.maximum(ids, 0))])
                within = np.arange(ids.size) - np.repeat(np.cumsum(lens) - lens, lens)
                table[np.repeat(rows, lens), np.repeat(skip, lens) + within] = gpu_ids
            num_blocks[rows] = skip + lens
        for g in self.groups:
            g.refresh_last_block(rows)
        self._release_cpu(np.repeat(cpu, counts))
        self.swapped[rows] = False
        self.appendable[rows] = True
        self.counters["swaps_in"] += cpu.size
        self._debug_check()
        return SwapResult(STATUS_OK, np.stack([cpu, gpu], axis=1).astype(np.int32))

    def _register_swapped_in(self, rows, cpu, gpu, new) -> None:
        """Events on: register swapped-in content (``cpu[new]``, now at ``gpu[new]``) in its
        requests' chain order, so each BlockStored is one request's run after the hash before it
        (the chain is not followed across blocks a sliding window released: such a run has no
        parent). No token ids: the daemon keeps none of swapped-out blocks."""
        pending = np.zeros(cpu.size, bool)
        pending[new] = True
        idx_parts, parent_parts, first_parts = [], [], []
        cpu_hash = self.cpu_pool.block_hash
        for row in rows.tolist():
            for ids in self._swapped[row].cpu_blocks:  # positions [skip, skip + n) of each group
                live = ids >= 0
                idx = np.searchsorted(cpu, np.where(live, ids, cpu[0] if cpu.size else 0))
                pos = np.flatnonzero(live & pending[np.minimum(idx, cpu.size - 1)])
                if not pos.size:
                    continue
                prev = ids[pos - 1]
                parents = np.where((pos > 0) & (prev >= 0), cpu_hash[np.maximum(prev, 0)], NO_PARENT)
                pending[idx[pos]] = False  # a block two requests share registers once, for the first
                first = np.zeros(pos.size, bool)
                first[0] = True
                idx_parts.append(idx[pos])
                parent_parts.append(parents.astype(self.hash_dtype))
                first_parts.append(first)
        if not idx_parts:
            return
        order = np.concatenate(idx_parts)
        runs = Runs(np.concatenate(parent_parts), np.concatenate(first_parts))
        keys = self._cpu_carry_key[cpu[order]]
        for key in np.unique(keys).tolist():
            sel = keys == key
            self._register_in(key, cpu_hash[cpu[order[sel]]], gpu[order[sel]], runs=runs.take(sel))

    def _release_cpu(self, blocks: np.ndarray) -> None:
        blocks = blocks[blocks >= 0].astype(np.int32)
        self.cpu_pool.release(blocks)
        gone = blocks[self.cpu_pool.ref_cnt[blocks] == 0]
        self._cpu_carry_key[gone] = 0

    # ================================================================== step
    def step(self, batch: StepBatch, namespace: int = 0, writer: int = 0) -> StepResult:
        """Apply one scheduler step: the writer's confirmation (``batch.computed_through``), then
        frees, forks, appends, admissions (in that order). ``namespace`` and ``writer`` apply to
        the step's admissions (see ``allocate``). Misuse of one request is reported in its status
        and does not stop the others."""
        tick = self.tick
        try:
            if not (type(batch.free) is tuple and type(batch.forks) is tuple
                    and type(batch.append_ids) is tuple and type(batch.admit) is tuple):
                _check_batch(batch)  # (a decode step's lists are the default empty tuples)
            decode = (self._simple and batch.append_rows is not None
                      and not (len(batch.free) or len(batch.forks) or len(batch.admit) or len(batch.append_ids)))
            la = batch.num_lookahead_tokens
            if (type(la) is not int and (not isinstance(la, np.integer) or isinstance(la, bool))
                    or not 0 <= la <= self.max_lookahead):
                raise errors.InvalidArgument(f"num_lookahead_tokens must be an integer in [0, {self.max_lookahead}]")
            if not decode and _LONE_ADMISSION_PATH and batch.is_lone_admission():
                return self._lone_step(batch, namespace, writer)
            # misuse of the step as a whole is refused before its confirmation counts: nothing changes
            n_new, given_rows, n = self._step_append_sizes(batch)
            hash_lists, hash_counts = (self._step_hashes(batch, n) if len(batch.append_hashes)
                                       else (self._no_hashes, None))
            tokens = None
            if len(batch.append_token_ids):
                tokens = self._block_tokens(batch.append_token_ids, hash_lists, "append_token_ids")
            if len(batch.admit):
                self._check_computed_first(batch)
                space = self._space(namespace, writer)
            else:
                space = 0
            self._confirm_then_flush(batch, writer, decode)
            self.tick += 1
            if decode:
                result = self._decode_step(batch, n_new, hash_lists, hash_counts, tokens)
                if result is not None:
                    return result
                self.flush_deferred()  # the general path reads the cache
            return self._general_step(batch, space, la, n_new, given_rows, hash_lists, hash_counts, tokens)
        except errors.KvdError:
            self.tick = tick  # misuse changes nothing, the tick included
            raise
        except errors.ARGUMENT_ERRORS as e:
            self.tick = tick
            raise errors.invalid_argument(e, "step") from e

    def _check_computed_first(self, batch: StepBatch) -> None:
        """A step's confirmation found in range before its admissions make their registration
        space (a refused step creates none)."""
        if batch.computed_through is not None:
            self._check_computed(batch.computed_through)

    def _confirm_then_flush(self, batch: StepBatch, writer: int, decode: bool) -> None:
        """The step's confirmation, then the deferred work, the confirmation last (frees, forks and
        admissions see the free queue as confirmed). A decode step that registers nothing neither
        reads the prefix cache nor changes what deferred work will do (it only grows tables at their
        ends): it may run before that work, unless it must evict (_append_fast runs it first then).
        Nor does one whose registration is deferred too: it queues behind that work, which runs in
        order. (Running it first made the first registering step after a large admission pay for a
        slice of the admission's confirmations: at 4,096 requests on the 2-core box that step's
        handle was 111-156 µs against 78-86 for the later ones, the largest step after the first.)"""
        if batch.computed_through is not None:
            self.mark_computed(writer, batch.computed_through)
        if (self._deferred or self._waiting) and not (
                decode and (not len(batch.append_hashes) or self.config.defer_cache_registration)):
            self.flush_deferred()

    def _lone_step(self, batch: StepBatch, namespace: int, writer: int) -> StepResult:
        """``step`` of a lone admission, after the checks: confirmation, deferred work, tick."""
        self._check_computed_first(batch)
        space = self._space(namespace, writer)
        self._confirm_then_flush(batch, writer, False)
        self.tick += 1
        return self._lone_admission_step(batch.admit[0], space)

    def _general_step(self, batch: StepBatch, space: int, la: int, n_new, given_rows, hash_lists, hash_counts,
                      tokens) -> StepResult:
        """``step`` after its checks, confirmation and tick, request by request."""
        free_status, freed_rows = self._step_frees(batch.free) if len(batch.free) else (_EMPTY_I16, _EMPTY_I32)
        fork_status, child_rows = self._step_forks(batch.forks) if len(batch.forks) else (_EMPTY_I16, _EMPTY_I32)
        rows = self._step_append_rows(batch, given_rows)  # after frees and forks: ids may name new children
        copies_before = len(self._copies)
        # the appends' registration waits when nothing after them in the step reads the cache
        defer = self.config.defer_cache_registration and not len(batch.admit)
        append_status, old, appended = self._append_rows(rows, n_new, hash_lists, hash_counts, la, tokens, defer)
        admit_status, admit_rows, admit_cached = (
            self._step_admits(batch.admit, space) if len(batch.admit) else (_EMPTY_I16, _EMPTY_I32, _EMPTY_I64)
        )
        sched_rows, sched_start, sched_len = self._schedule(
            batch.admit, rows, n_new, old, append_status, admit_status, admit_rows, admit_cached
        )
        copies = self._copies_since(copies_before)
        if self.config.debug_checks:
            self.check_invariants(heavy=True)
        return StepResult(
            free_status=free_status,
            fork_status=fork_status,
            append_status=append_status,
            admit_status=admit_status,
            admit_rows=admit_rows,
            admit_cached_tokens=admit_cached,
            copies=copies,
            changed_rows=self._changed_rows(sched_rows, child_rows, appended, rows.size),
            sched_rows=sched_rows,
            sched_start=sched_start,
            sched_len=sched_len,
            freed_rows=freed_rows,
            tick=self.tick,
        )

    @staticmethod
    def _changed_rows(sched_rows, child_rows, appended, num_appends: int) -> np.ndarray:
        """A step's rows whose tables changed: the appends' (``appended``, when the fast path took
        them all: the rows it grew, copied on write or slid; else every appended row scheduled),
        the admissions' and the forks' children."""
        parts = [sched_rows] if appended is None else [appended, sched_rows[num_appends:]]
        if child_rows.size:
            parts.append(child_rows)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _lone_admission_step(self, req: AdmitRequest, space: int) -> StepResult:
        """``step`` of one admission and nothing else (a new request's first step: its time to first
        token) without the append and batch machinery; the same result and state as the general
        path (``tests/test_lone_admission.py`` compares them)."""
        # a lone admission registers its prompt after the reply, as a decode step its blocks
        code, row, cached = self._try_admit(req, space, self.config.defer_cache_registration)
        if code == STATUS_OK:  # its tokens from the first one the cache did not hold
            sched_rows = np.array([row], np.int32)
            sched_start = np.array([cached], np.int32)
            sched_len = np.array([req.num_tokens - cached], np.int32)
        else:
            sched_rows = sched_start = sched_len = _EMPTY_I32
        if self.config.debug_checks:
            self.check_invariants(heavy=True)
        return StepResult(
            free_status=_EMPTY_I16,
            fork_status=_EMPTY_I16,
            append_status=_EMPTY_I16,
            admit_status=np.array([code], np.int16),
            admit_rows=np.array([row], np.int32),
            admit_cached_tokens=np.array([cached], np.int64),
            copies=_EMPTY_COPIES,  # an admission copies nothing
            changed_rows=sched_rows,
            sched_rows=sched_rows,
            sched_start=sched_start,
            sched_len=sched_len,
            freed_rows=_EMPTY_I32,
            tick=self.tick,
        )

    @staticmethod
    def _appends_schedule(rows, n_new, old):
        """The schedule when every append of the step succeeded and nothing was admitted."""
        if isinstance(n_new, np.ndarray):
            sched_len = n_new.astype(np.int32)
        else:
            sched_len = np.empty(rows.size, np.int32)
            sched_len.fill(n_new)
        return rows, old.astype(np.int32), sched_len

    def _schedule(self, admits, rows, n_new, old, append_status, admit_status, admit_rows, admit_cached):
        """(rows, first positions, token counts) of the step's work: successful appends, then
        admissions. ``old``: the appending requests' sizes before, when all of them succeeded."""
        if old is not None and not admit_status.size:
            return self._appends_schedule(rows, n_new, old)
        if not rows.size and not admit_status.size:
            return _EMPTY_I32, _EMPTY_I32, _EMPTY_I32
        if not rows.size and admit_status.size <= _FEW_ADMITS:  # a new request's first step
            return self._few_admits_schedule(admits, admit_status, admit_rows, admit_cached)
        admitted = np.flatnonzero(admit_status == STATUS_OK)
        # Only admitted requests' sizes are read: a rejected one may carry anything.
        admit_tokens = np.fromiter((admits[i].num_tokens for i in admitted.tolist()), np.int64, count=admitted.size)
        if not rows.size:  # admissions only (a new request's first step): no appends to put first
            sched_rows = admit_rows[admitted]
            sched_len = (admit_tokens - admit_cached[admitted]).astype(np.int32)
        else:
            ok_app = append_status == STATUS_OK
            n_app = n_new[ok_app] if isinstance(n_new, np.ndarray) else np.full(np.count_nonzero(ok_app), n_new, np.int64)
            sched_rows = np.concatenate([rows[ok_app], admit_rows[admitted]]).astype(np.int32)
            sched_len = np.concatenate([n_app, admit_tokens - admit_cached[admitted]]).astype(np.int32)
        sched_start = np.subtract(self.num_tokens[sched_rows], sched_len, dtype=np.int32, casting="unsafe")
        return sched_rows, sched_start, sched_len

    def _few_admits_schedule(self, admits, admit_status, admit_rows, admit_cached):
        """``_schedule`` of a step of a few admissions and nothing else, over Python scalars: a
        numpy call on arrays this small costs more than the loop (the TTFT of every request)."""
        ok = [i for i, st in enumerate(admit_status.tolist()) if st == STATUS_OK]
        rows, cached = admit_rows.tolist(), admit_cached.tolist()
        sched_rows = np.array([rows[i] for i in ok], np.int32)
        sched_len = np.array([admits[i].num_tokens - cached[i] for i in ok], np.int32)
        sched_start = np.array([int(self.num_tokens[rows[i]]) for i in ok], np.int32) - sched_len
        return sched_rows, sched_start, sched_len

    def _step_frees(self, ids):
        if not len(ids):
            return _EMPTY_I16, _EMPTY_I32
        status = np.zeros(len(ids), np.int16)
        rows = self._distinct_known_rows(ids)
        if rows is None:  # some id unknown, unhashable or named twice: one by one, with a status each
            rows = []
            seen = set()
            get = self._row_of.get
            for i, req_id in enumerate(ids):
                row = _safe_get(get, req_id)
                if row < 0:
                    status[i] = errors.UnknownRequest.code
                elif row in seen:
                    status[i] = errors.InvalidArgument.code
                else:
                    seen.add(row)
                    rows.append(row)
            rows = np.array(rows, np.int32)
        if rows.size:
            self._free_rows_now(rows)
        return status, rows

    def _distinct_known_rows(self, ids) -> np.ndarray | None:
        """Rows of ``ids`` when every id is known and none repeats, else None."""
        get = self._row_of.get
        try:
            rows = np.fromiter((get(r, -1) for r in ids), np.int32, count=len(ids))
        except TypeError:
            return None
        if rows.min() < 0:
            return None
        if rows.size == 1:
            return rows
        if rows.size > self.num_tokens.size:
            return None  # more ids than rows: one repeats
        idx = self._arange[: rows.size]
        self._mark[rows] = idx
        return rows if (self._mark[rows] == idx).all() else None

    def _step_forks(self, forks):
        if not len(forks):
            return _EMPTY_I16, _EMPTY_I32
        if len(forks) > 1:
            batched = self._fork_batch(forks)
            if batched is not None:
                return np.zeros(len(forks), np.int16), batched
        status = np.zeros(len(forks), np.int16)
        child_rows = []
        for i, pair in enumerate(forks):
            try:
                parent_id, child_id = pair
                child_rows.append(self._fork(parent_id, child_id))
            except errors.KvdError as exc:
                status[i] = exc.code
            except errors.ARGUMENT_ERRORS:
                status[i] = errors.InvalidArgument.code
        return status, np.array(child_rows, np.int32)

    def _decode_step(self, batch: StepBatch, n_new, hash_lists, hash_counts, tokens) -> StepResult | None:
        """A step of appends only, by row (its inputs checked by ``step``): the daemon's decode step."""
        rows = batch.append_rows
        if not isinstance(rows, np.ndarray) or rows.ndim != 1:
            return None
        n = rows.size
        hashes, counts = (self._empty_hashes, None) if hash_counts is None else (hash_lists[0], hash_counts[0])
        tokens = None if tokens is None else tokens[0]
        defer = self.config.defer_cache_registration
        copies_before = len(self._copies)
        fast = self._append_fast(rows, n_new, hashes, counts, batch.num_lookahead_tokens, defer, tokens) if n else None
        if fast is None:
            return None
        old, grown = fast
        sched_rows, sched_start, sched_len = self._appends_schedule(rows, n_new, old)
        self._debug_check()
        return StepResult(
            free_status=_EMPTY_I16,
            fork_status=_EMPTY_I16,
            append_status=np.zeros(n, np.int16),
            admit_status=_EMPTY_I16,
            admit_rows=_EMPTY_I32,
            admit_cached_tokens=_EMPTY_I64,
            copies=self._copies_since(copies_before),
            changed_rows=grown.copy(),
            sched_rows=sched_rows,
            sched_start=sched_start,
            sched_len=sched_len,
            tick=self.tick,
        )

    def decode_rows(self, rows: np.ndarray, n_new: int, lookahead: int = 0, hashes=None, counts=None,
                    mirror: tuple | None = None):
        """The daemon's decode step, without a ``StepBatch`` or a ``StepResult``: every request of
        ``rows`` (manager rows, int32) appends ``n_new`` tokens (an int) with ``lookahead`` slots,
        and with ``hashes`` (``hash_dtype``) and ``counts`` (int32, one per row) registers the
        blocks that filled, as a decode ``step`` does: one array each with one group, a tuple of one
        per group with several (``_decode_rows_groups``, which takes no ``mirror``). Returns (their sizes before,
        int64, a view of scratch valid until the next append; the rows whose tables changed, a new
        array; the copy-on-write copies), or None, having changed nothing (beyond running deferred
        prefix-cache work that was due anyway), whenever anything is unusual (misuse, no space,
        another configuration): ``step`` then decides request by request. Registering nothing, it
        may run before the deferred prefix-cache work (it reads no cache) unless it must evict;
        registering, after it, unless its registration is deferred too (it then queues behind that
        work, in order: see ``_confirm_then_flush``).
        Why one entry for both: the step that registers is one in 16 of a decode run, and on the
        general path its code is cold in the daemon (2-3x its warm cost). ``mirror``: the caller's
        copy of these rows' tables, written when the step is taken (``rowloops.mirror_appends``'
        first five arguments)."""
        if not rows.size or type(n_new) is not int or type(lookahead) is not int:
            return None
        if not self._simple:
            return self._decode_rows_groups(rows, n_new, lookahead, hashes, counts) if _GROUPS_FAST_PATH else None
        if hashes is None:
            hashes, counts = self._empty_hashes, None
        else:
            counts = self._decode_counts(hashes, counts, rows)
            if counts is None:
                return None
            if (self._deferred or self._waiting) and not self.config.defer_cache_registration:
                self.flush_deferred()  # registered now: after the work deferred before it
        copies_before = len(self._copies)
        self.tick += 1  # a deferred registration carries the step's tick
        fast = self._append_fast(rows, n_new, hashes, counts, lookahead, self.config.defer_cache_registration,
                                 own_counts=True, mirror=mirror)
        if fast is None:
            self.tick -= 1
            return None
        old, grown = fast
        self._debug_check()
        return old, grown.copy(), self._copies_since(copies_before)

    def _decode_counts(self, hashes, counts, rows: np.ndarray) -> np.ndarray | None:
        """One group's hash counts of a ``decode_rows`` call widened to int64 (the step path's, its
        compiled loops' type), or None when the hashes or counts are not the daemon's arrays (S{w}
        hashes, int32 counts, one per row) or do not add up."""
        if not (type(hashes) is np.ndarray and hashes.dtype == self.hash_dtype and hashes.ndim == 1
                and type(counts) is np.ndarray and counts.dtype == np.int32 and counts.shape == rows.shape):
            return None
        wide, total = rowloops.widened_counts(counts)
        return wide if total == hashes.size else None

    def _decode_rows_groups(self, rows: np.ndarray, n_new: int, lookahead: int, hashes, counts):
        """``decode_rows`` of a pool of several KV-cache groups or a sliding window: ``hashes`` and
        ``counts`` one array per group (or None), the rows whose tables changed (grown, copied on
        write, a block slid out of a window) come back; registration is deferred as a decode
        step's of one group is (``_append_fast_groups``)."""
        G = len(self.groups)
        hash_lists, count_lists = self._no_hashes, None
        if G == 1 and type(hashes) is np.ndarray:  # (one window group: its arrays as they come)
            hashes, counts = (hashes,), (counts,)
        if hashes is not None:
            if not (type(hashes) in (tuple, list) and type(counts) in (tuple, list) and len(hashes) == len(counts) == G):
                return None
            count_lists = [self._decode_counts(h, c, rows) for h, c in zip(hashes, counts)]
            if any(c is None for c in count_lists):
                return None
            hash_lists = list(hashes)
        defer = self.config.defer_cache_registration
        if hashes is not None and not defer and (self._deferred or self._waiting):
            self.flush_deferred()  # registered now: after the work deferred before it
        copies_before = len(self._copies)
        self.tick += 1  # a deferred registration carries the step's tick
        fast = self._append_fast_groups(rows, n_new, hash_lists, count_lists, lookahead, defer=defer)
        if fast is None:
            self.tick -= 1
            return None
        old, changed = fast
        self._debug_check()
        return old, changed, self._copies_since(copies_before)

    def _step_append_sizes(self, batch: StepBatch):
        """Validated append inputs, before anything is applied: (token counts: one int for all or
        an int64 array, rows or None when the appends are named by id and must be resolved after
        the step's forks, how many appends)."""
        if batch.append_rows is not None and len(batch.append_ids):
            raise errors.InvalidArgument("give append_ids or append_rows, not both")
        rows = batch.append_rows
        if rows is not None and not (type(rows) is np.ndarray and rows.dtype == np.int32 and rows.ndim == 1):
            rows = int_array(rows, np.int32, "append_rows").reshape(-1)
        n = len(batch.append_ids) if rows is None else rows.size
        n_new = batch.append_num_tokens
        if isinstance(n_new, (int, np.integer)) and not isinstance(n_new, bool):
            if not -(1 << 63) <= n_new < (1 << 63):  # (a count out of range is its requests' status)
                raise errors.InvalidArgument("append_num_tokens must fit 64 bits")
            return int(n_new), rows, n
        n_new = int_array(n_new, np.int64, "append_num_tokens")
        if n_new.shape != (n,):
            raise errors.InvalidArgument("append_num_tokens must be one per appended request")
        return n_new, rows, n

    def _step_append_rows(self, batch: StepBatch, rows) -> np.ndarray:
        if rows is not None:
            return rows
        if not len(batch.append_ids):
            return _EMPTY_I32
        get = self._row_of.get
        try:
            return np.array([get(r, -1) for r in batch.append_ids], np.int32).reshape(-1)
        except TypeError:  # an unhashable id: unknown, like any other id the manager does not hold
            return np.fromiter((_safe_get(get, r) for r in batch.append_ids), np.int32, count=len(batch.append_ids))

    def _step_hashes(self, batch: StepBatch, n: int):
        G = len(self.groups)
        if not len(batch.append_hashes):
            return [self._empty_hashes] * G, None
        if len(batch.append_hashes) != G or len(batch.append_hash_counts) != G:
            raise errors.BadHashes(f"append hashes must be given for all {G} groups")
        if G == 1:  # a decode step's usual case: no lists to build
            h, c = self._group_hashes(batch.append_hashes[0], batch.append_hash_counts[0], n)
            return [h], [c]
        checked = [self._group_hashes(h, c, n) for h, c in zip(batch.append_hashes, batch.append_hash_counts)]
        return [h for h, _ in checked], [c for _, c in checked]

    def _group_hashes(self, hashes, counts, n: int) -> tuple[np.ndarray, np.ndarray]:
        """One group's append hashes and their int64 counts, checked in one pass (``widen_counts``);
        the daemon's frame arrays (S{w} hashes, int32 counts) are taken as they are."""
        if not (type(hashes) is np.ndarray and hashes.dtype == self.hash_dtype and hashes.ndim == 1):
            hashes = as_hash_array(hashes, self.hash_width) if len(hashes) else self._empty_hashes
        if not (type(counts) is np.ndarray and counts.dtype == np.int32):
            try:
                counts = int_array(counts, np.int64, "append_hash_counts")
            except errors.InvalidArgument as exc:
                raise errors.BadHashes(str(exc)) from None
        if counts.shape != (n,):
            total = -1
        elif counts.dtype == np.int32:
            counts, total = rowloops.widened_counts(counts)
        else:
            total = count_total(counts)
        if total != hashes.size:
            raise errors.BadHashes("append_hash_counts must be one non-negative count per request summing to the hashes given")
        return hashes, counts.astype(np.int64, copy=False)

    def _step_admits(self, admits, space: int):
        m = len(admits)
        if not m:
            return _EMPTY_I16, _EMPTY_I32, _EMPTY_I64
        status = np.zeros(m, np.int16)
        rows = np.full(m, -1, np.int32)
        cached = np.zeros(m, np.int64)
        i = 0
        batching = m > 1 and self._simple and not self.config.admit_full_sequence and not self.config.reserve_decode_blocks
        while i < m:
            if batching:
                batch = _BatchAdmission(self, space)
                i = batch.run(admits, status, rows, cached, i)
                batching = batch.raced  # after a race, the batch goes on past that one request
                if i >= m:
                    break
            # a lone admission registers its prompt after the reply, as a decode step its blocks
            status[i], rows[i], cached[i] = self._try_admit(
                admits[i], space, m == 1 and self.config.defer_cache_registration)
            i += 1
        return status, rows, cached

    def _try_admit(self, req, space: int, defer: bool = False) -> tuple[int, int, int]:
        """(status, row, cached tokens) of one admission of a step: misuse is its status code
        (row -1, nothing cached), not an exception."""
        try:
            result = self._admit(req, space, defer)
        except errors.KvdError as exc:
            return exc.code, -1, 0
        except errors.ARGUMENT_ERRORS:
            return errors.InvalidArgument.code, -1, 0
        return result.status, result.row, result.num_cached_tokens

    # ================================================================== queries
    @_refuses_misuse
    def block_table(self, req_id: ReqId, group: int = 0) -> np.ndarray:
        row = self.row_of(req_id)
        if not 0 <= group < len(self.groups):
            raise errors.InvalidArgument(f"group must be in [0, {len(self.groups)})")
        if self.swapped[row]:
            raise errors.RequestSwapped(f"request {req_id!r} is swapped out")
        g = self.groups[group]
        return g.table[row, : g.num_blocks[row]].copy()

    @_refuses_misuse
    def cross_block_table(self, req_id: ReqId) -> np.ndarray:
        row = self.row_of(req_id)
        return self.cross_table[row, : self.cross_num_blocks[row]].copy()

    @_refuses_misuse
    def num_common_prefix_blocks(self, req_id: ReqId, num_running: int) -> int:
        """Leading blocks held by exactly ``num_running`` requests (for cascade attention)."""
        row = self.row_of(req_id)
        g = self.groups[0]
        blocks = g.table[row, : g.num_blocks[row]]
        shared = self.pool.ref_cnt[blocks] == num_running
        return int(blocks.size if shared.all() else np.argmin(shared))

    @_refuses_misuse
    def reset_prefix_cache(self, namespace: int | None = None) -> bool:
        self.flush_deferred()
        keys = None if namespace is None else {k for k, _ in self.cache_keys_of(namespace)}
        return self.pool.reset_cache(keys)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return self.pool.num_used / max(self.pool.num_blocks - 1, 1)

    def stats(self) -> dict:
        queries = self.counters["prefix_queries"]
        return {
            "num_blocks": self.pool.num_blocks - 1,
            "num_free_blocks": self.pool.num_free,
            "num_used_blocks": self.pool.num_used,
            "num_cached_blocks": self.pool.num_evictable,
            "usage": self.usage,
            "prefix_queries": queries,
            "prefix_hits": self.counters["prefix_hits"],
            "hit_rate": self.counters["prefix_hits"] / queries if queries else 0.0,
            "evictions": self.pool.num_evictions,
            "swaps_out": self.counters["swaps_out"],
            "swaps_in": self.counters["swaps_in"],
            "cow_copies": self.counters["cow_copies"],
            "num_requests": self.num_requests,
            "num_cpu_blocks": self.config.num_cpu_blocks,
            "num_free_cpu_blocks": self.cpu_pool.num_free if self.config.num_cpu_blocks else 0,
            "num_pending_blocks": self.pool.num_unconfirmed,
        }

    # ================================================================== invariants
    def _debug_check(self) -> None:
        if self.config.debug_checks:
            self.check_invariants(heavy=True)

    def check_invariants(self, heavy: bool = False) -> None:
        """Conservation (free + in use + cached-evictable == total) always; with ``heavy``, every
        reference count recomputed from every block table and swap record."""
        self.flush_deferred()
        self.pool.check_invariants(heavy)
        self.cpu_pool.check_invariants(heavy)
        if not heavy:
            return
        assert len(self._row_of) + len(self._free_rows) == self.num_tokens.size
        expected = np.zeros(self.pool.num_blocks, np.int64)
        owner = np.full(self.pool.num_blocks, -1, np.int64)  # the one group that holds each block
        resident = np.flatnonzero(self.active & ~self.swapped)
        for gi, g in enumerate(self.groups):
            blocks, _ = _row_blocks(g.table, resident, g.num_skipped[resident], g.num_blocks[resident], False)
            held = blocks[blocks != NULL_BLOCK]
            assert np.all((owner[held] == -1) | (owner[held] == gi)), "a block held by two KV-cache groups"
            owner[held] = gi
            assert np.all(g.table[resident[:, None], np.arange(g.table.shape[1])[None, :]][
                np.arange(g.table.shape[1])[None, :] < g.num_skipped[resident][:, None]] == NULL_BLOCK)
            np.add.at(expected, blocks[blocks != NULL_BLOCK], 1)
            assert np.all(g.num_registered[resident] <= self.num_tokens[resident] // g.block_size)
            assert np.all(g.num_blocks[resident] >= _cdiv(self.num_tokens[resident], g.block_size))
            assert np.array_equal(g.last_block, g.last_block_of(np.arange(g.num_blocks.size))), \
                "last_block disagrees with the block tables"
        cross, _ = _row_blocks(self.cross_table, resident, np.zeros_like(resident), self.cross_num_blocks[resident], False)
        np.add.at(expected, cross, 1)
        assert np.array_equal(expected, self.pool.ref_cnt), "GPU reference counts disagree with block tables"
        self._check_pending()
        cpu_expected = np.zeros(self.cpu_pool.num_blocks, np.int64)
        for record in self._swapped.values():
            for blocks in (*record.cpu_blocks, record.cross):
                np.add.at(cpu_expected, blocks[blocks >= 0], 1)
        assert np.array_equal(cpu_expected, self.cpu_pool.ref_cnt), "CPU reference counts disagree with swap records"
        assert set(self._swapped) == set(np.flatnonzero(self.swapped & self.active).tolist())


_MAX_TOKEN_ID = (1 << 31) - 1  # token ids travel as int32
_CONFIRM = object()  # a deferred confirmation in ``_deferred``: (_CONFIRM, writer, through_tick)
_APPENDS = object()  # a decode step's deferred registration: (_APPENDS, rows, hashes, counts, tick, tokens, group)
# a lone admission's deferred registration: (_ADMITTED, row, hash lists, num_tokens, token lists, tick)
_ADMITTED = object()
# Blocks a daemon's flush promotes at most: a confirmation of a whole admission wave (tens of
# thousands of prompt blocks) is spread over the next messages instead of pausing every client.
PROMOTE_BATCH = 1024


def _kept(arr: np.ndarray | None) -> np.ndarray | None:
    """A caller's array as deferred work keeps it: as is when nothing can change it (a read-only
    view of an immutable ``bytes``: the daemon's message frames), else a copy (an in-process caller
    may reuse its buffer once the call returned)."""
    if arr is None:
        return None
    if not arr.flags.writeable:
        base = arr.base
        while isinstance(base, np.ndarray):
            base = base.base
        if isinstance(base, bytes):
            return arr
    return arr.copy()


def _split_appends(item: tuple, k: int) -> tuple[tuple, tuple]:
    """A deferred registration of appends split after its first ``k`` requests (each request's
    hashes, and token ids, stay together and in order)."""
    kind, rows, hashes, counts, tick, tokens, gi = item
    h = int(counts[:k].sum())
    head = (kind, rows[:k], hashes[:h], counts[:k], tick, None if tokens is None else tokens[:h], gi)
    rest = (kind, rows[k:], hashes[h:], counts[k:], tick, None if tokens is None else tokens[h:], gi)
    return head, rest


class _BatchAdmission:
    """Admit many requests of the simple configuration (one full-attention group) together.

    Each request is still decided in batch order, exactly as ``_admit`` would. The batch only goes
    on while its blocks come off the fresh stack (no eviction: evicting could change what later
    lookups find), so every request's block ids are known before they are taken; its new full
    blocks go into the prefix-cache map at once, and later requests of the batch hit them like any
    cached block. The rest of the batch, from the first request that would evict, goes one by one.
    Tables, reference counts and per-block hashes are then written for the whole batch with a few
    array operations. Any unexpected exception removes the new cache entries again.

    ``cache`` is the shared map the batch registers into, unconfirmed by ``mark`` (the writer's side
    key; 0: confirmed at once). Lookups see its confirmed entries and the writer's own, then the
    writer's side map. A request whose blocks would need the side map or would replace another
    writer's unconfirmed entry (a race on one prefix) ends the batch: ``_admit`` does those.
    """

    def __init__(self, mgr: BlockManager, space: int) -> None:
        self.mgr = mgr
        self.space = space
        self.writer = mgr._space_info[space][1]
        self.key, side_key = mgr._lookup_keys(space, 0)
        self.mark = side_key
        self.index = mgr.pool.index
        self.has_side = mgr.pool.map_size(side_key) > 0 if side_key else False
        self.inserted: list[np.ndarray] = []  # blocks the batch stored (undone if it fails)
        self.raced = False
        self.events = mgr._tails is not None
        # events on, per request that registers: (hashes, parent, token ids) of its run, or its
        # Runs when some of its blocks were cached already (kvd.runs)
        self.runs: list = []
        self.tails: list[bytes] = []  # events on: per admitted request, its last registered hash
        self.dups: list[tuple[np.ndarray, np.ndarray]] = []  # (hashes, blocks) registered by another

    def run(self, admits, status, rows_out, cached_out, start: int = 0) -> int:
        """Decide ``admits[start:]`` in order; returns the index of the first one left undecided
        (``raced``: it stopped at a race on a prefix, not at an eviction or the end)."""
        try:
            return self._run(admits, status, rows_out, cached_out, start)
        except BaseException:
            pool = self.mgr.pool
            for blocks in self.inserted:
                self.index.remove(blocks)
                pool.cache_key[blocks] = 0
            raise

    def _visible_run(self, hashes: np.ndarray, hits: np.ndarray) -> np.ndarray:
        """``hits`` (the shared map's leading run for ``hashes``) cut to what this writer may see,
        then continued through its side map."""
        mgr_pool = self.mgr.pool
        if hits.size and mgr_pool.num_unconfirmed:
            hits = mgr_pool.visible_run(hits, self.mark)
        if self.has_side and hits.size < hashes.size:
            hits = mgr_pool.lookup_from(self.key, hashes, self.mark, hits)
        return hits

    def _races(self, hashes: np.ndarray) -> bool:
        """Whether registering ``hashes`` meets another writer's unconfirmed entry or this writer's
        side map (``pool.register``'s rules, not the batch's, decide those)."""
        if self.has_side and (self.index.find(self.mark, hashes) >= 0).any():
            return True
        pool = self.mgr.pool
        if not pool.num_unconfirmed:
            return False
        found = self.index.find(self.key, hashes)
        found = found[found >= 0]
        return bool(pool.hidden(found, self.mark).any())

    @staticmethod
    def _fast_valid(req, bs, max_len, max_la, known, seen, hdt) -> bool:
        n, la, prio, hashes = req.num_tokens, req.num_lookahead_tokens, req.priority, req.block_hashes
        return (
            type(n) is int and 1 <= n <= max_len and type(la) is int and 0 <= la <= max_la
            and type(prio) is int and MIN_PRIORITY <= prio <= MAX_PRIORITY
            and not req.max_new_tokens and not req.num_encoder_tokens
            and type(hashes) is np.ndarray and hashes.dtype == hdt and hashes.ndim == 1
            and hashes.size <= n // bs and req.req_id not in known and req.req_id not in seen
        )

    def _slow_valid(self, req, seen):
        """Full validation (typed errors) for requests the fast check did not accept."""
        mgr = self.mgr
        mgr._check_new_request(req.req_id, req.num_tokens, req.num_lookahead_tokens, req.priority,
                               req.num_encoder_tokens, req.max_new_tokens)
        if req.req_id in seen:
            raise errors.DuplicateRequest(f"request {req.req_id!r} already exists")
        return mgr._hash_lists(req.block_hashes, req.num_tokens)[0]

    def _register(self, hashes: np.ndarray, blocks: np.ndarray, reg_hashes, reg_blocks) -> np.ndarray | None:
        """Cache ``hashes`` -> ``blocks`` (still free: ``_apply`` takes them) unless a hash is cached
        already (the first block keeps it). Returns which were cached (None: all)."""
        index = self.index
        blocks = np.ascontiguousarray(blocks, np.int32)
        self.mgr.pool.known_keys.add(self.key)
        if index.insert_new(self.key, hashes, blocks) < 0:
            self.inserted.append(blocks)
            reg_hashes.append(hashes)
            reg_blocks.append(blocks)
            return None
        mask = np.zeros(hashes.size, bool)
        for j, b in enumerate(blocks.tolist()):
            mask[j] = index.insert_one(self.key, hashes, j, b)
        self.inserted.append(blocks[mask])
        reg_hashes.append(hashes[mask])
        reg_blocks.append(blocks[mask])
        self.dups.append((hashes[~mask], blocks[~mask]))
        return mask

    def _runs(self) -> Runs:
        """The runs of every request the batch registered, in order."""
        if all(type(r) is tuple for r in self.runs):
            return Runs.of_requests(*zip(*self.runs))
        return Runs.concat([Runs.chain(*r) if type(r) is tuple else r for r in self.runs])

    def _run(self, admits, status, rows_out, cached_out, start: int) -> int:
        mgr = self.mgr
        pool = mgr.pool
        bs = mgr.groups[0].block_size
        caching = mgr.config.enable_prefix_caching
        max_len, max_la = mgr.config.max_model_len, mgr.max_lookahead
        max_blocks = pool.num_blocks - 1 - mgr._watermark_blocks
        index = self.index
        ref = pool.ref_cnt
        check_revived = pool.num_evictable > 0
        # blocks the batch's headroom already pays for: revived cached ones, and (hit by later
        # requests of the batch) its own new ones, which still read ref 0 until _apply takes them
        counted: set[int] = set()
        headroom = mgr._admission_headroom()
        # The batch's blocks, in the order take() will hand them out.
        stack_top = pool.num_fresh
        upcoming = pool._stack[:stack_top][::-1]
        free_rows = len(mgr._free_rows)
        known = mgr._row_of
        seen: set = set()
        admitted, flat_hits, hit_counts, new_counts, reg_hashes, reg_blocks, reg_ends = [], [], [], [], [], [], []
        offset = 0
        done = start
        for i in range(start, len(admits)):
            req = admits[i]
            if not isinstance(req, AdmitRequest) or req.num_encoder_tokens:
                break
            try:
                if self._fast_valid(req, bs, max_len, max_la, known, seen, mgr.hash_dtype):
                    hashes = req.block_hashes
                else:
                    hashes = self._slow_valid(req, seen)
                tokens = None
                if req.token_ids is not None:
                    tokens = mgr._admit_tokens(req.token_ids, [hashes], req.num_tokens)
                    tokens = tokens and tokens[0]
            except errors.KvdError as exc:
                status[i] = exc.code
                done = i + 1
                continue
            except (TypeError, ValueError, AttributeError):
                status[i] = errors.InvalidArgument.code
                done = i + 1
                continue
            n = req.num_tokens
            total_blocks = -(-(n + req.num_lookahead_tokens) // bs)
            if total_blocks > max_blocks:
                status[i] = AllocStatus.NEVER
                done = i + 1
                continue
            if not caching:
                hashes = hashes[:0]
            lookup = hashes[: (n - 1) // bs]
            hit_blocks = index.run(self.key, lookup)
            if pool.num_unconfirmed or self.has_side:
                hit_blocks = self._visible_run(lookup, hit_blocks)
            hits = hit_blocks.tolist()
            nhit = len(hits)
            new = total_blocks - nhit
            extra = 0
            if check_revived:
                extra = sum(1 for b in hits if ref[b] == 0 and b not in counted)
            if not free_rows or new + extra > headroom:
                status[i] = STATUS_NO_SPACE
                done = i + 1
                continue
            if offset + new > stack_top:
                break  # would evict: the rest go one by one
            reg_end = min(hashes.size, n // bs)
            if reg_end > nhit and (pool.num_unconfirmed or self.has_side) and self._races(hashes[nhit:reg_end]):
                self.raced = True
                break
            if check_revived:
                counted.update(b for b in hits if ref[b] == 0)
                counted.update(upcoming[offset : offset + new].tolist())
            seen.add(req.req_id)
            free_rows -= 1
            headroom -= new + extra
            if reg_end > nhit:
                mask = self._register(hashes[nhit:reg_end], upcoming[offset : offset + reg_end - nhit],
                                      reg_hashes, reg_blocks)
                if self.events:
                    run = (hashes[nhit:reg_end], hashes[nhit - 1] if nhit else NO_PARENT,
                           None if tokens is None else tokens[nhit:reg_end])
                    self.runs.append(run if mask is None else Runs.chain(*run).take(mask))
            if self.events:
                last = max(reg_end, nhit)
                self.tails.append(hashes[last - 1] if last else NO_PARENT)
            admitted.append(i)
            flat_hits.extend(hits)
            hit_counts.append(nhit)
            new_counts.append(new)
            reg_ends.append(max(reg_end, nhit))
            offset += new
            done = i + 1
        if admitted:
            self._apply(admits, admitted, flat_hits, hit_counts, new_counts, reg_hashes, reg_blocks, reg_ends, offset,
                        status, rows_out, cached_out)
        self.inserted.clear()
        return done

    def _apply(self, admits, admitted, flat_hits, hit_counts, new_counts, reg_hashes, reg_blocks, reg_ends, total_new,
               status, rows_out, cached_out) -> None:
        mgr = self.mgr
        g = mgr.groups[0]
        bs = g.block_size
        pool = mgr.pool
        k = len(admitted)
        rows = np.array(mgr._free_rows[-k:][::-1], np.int32)
        del mgr._free_rows[-k:]
        blocks = pool.take(total_new)
        nhit = np.array(hit_counts, np.int64)
        nnew = np.array(new_counts, np.int64)
        if flat_hits:
            hits = np.array(flat_hits, np.int32)
            revive = np.unique(hits[pool.ref_cnt[hits] == 0])
            if revive.size:
                pool.touch(revive)
                pool.ref_cnt[revive] -= 1  # touch took one reference; the add below counts all
            np.add.at(pool.ref_cnt, hits, 1)
            hit_rows = np.repeat(rows, nhit)
            hit_cols = np.arange(hits.size) - np.repeat(np.cumsum(nhit) - nhit, nhit)
            g.table[hit_rows, hit_cols] = hits
        starts = np.cumsum(nnew) - nnew
        g.table[np.repeat(rows, nnew), np.repeat(nhit - starts, nnew) + np.arange(total_new)] = blocks
        g.num_blocks[rows] = nhit + nnew
        g.refresh_last_block(rows)
        g.num_skipped[rows] = 0
        if reg_blocks:
            reg = np.concatenate(reg_blocks)
            pool.block_hash[reg] = np.concatenate(reg_hashes)
            pool.cache_key[reg] = self.key
            if self.mark:
                pool.unconfirmed_by[reg] = self.mark
                pool.num_unconfirmed += reg.size
                mgr._note_unconfirmed(self.writer, self.mark, reg, mgr.tick, self._runs() if self.events else None)
            elif self.events:  # one entry: the publisher cuts it into one event per request
                pool.log_stored(self.key, np.concatenate(reg_hashes), self._runs())
            else:
                for hashes in reg_hashes:
                    pool.log_stored(self.key, hashes)
        for hashes, dup in self.dups:  # uncached, but their requests' chains go through them
            pool.block_hash[dup] = hashes
        if self.events:
            mgr._tails[0][rows] = np.array(self.tails, mgr.hash_dtype)
        tokens = np.fromiter((admits[i].num_tokens for i in admitted), np.int64, count=k)
        g.num_registered[rows] = reg_ends
        mgr.num_tokens[rows] = tokens
        mgr.priority[rows] = np.fromiter((admits[i].priority for i in admitted), np.int64, count=k)
        mgr.namespace[rows] = self.space
        mgr.active[rows] = True
        mgr.appendable[rows] = True
        mgr.swapped[rows] = False
        mgr.cross_num_blocks[rows] = 0
        ids = [admits[i].req_id for i in admitted]
        row_list = rows.tolist()
        mgr._row_of.update(zip(ids, row_list))
        mgr._id_of.update(zip(row_list, ids))
        idx = np.array(admitted)
        status[idx] = STATUS_OK
        rows_out[idx] = rows
        cached = nhit * bs
        cached_out[idx] = cached
        if mgr.config.enable_prefix_caching:
            mgr.counters["prefix_queries"] += int(tokens.sum())
            mgr.counters["prefix_hits"] += int(cached.sum())


def _safe_get(get, req_id) -> int:
    try:
        return get(req_id, -1)
    except TypeError:  # unhashable id
        return -1


def _validate_config(config: ManagerConfig) -> None:
    if config.num_gpu_blocks < 2:
        raise errors.InvalidArgument("num_gpu_blocks must be at least 2 (block 0 is the null block)")
    if not config.groups:
        raise errors.InvalidArgument("at least one KV-cache group is needed")
    if config.hash_width < prefixindex.MIX_BYTES or config.hash_width % 8:
        raise errors.InvalidArgument(f"hash_width must be a multiple of 8 bytes, at least {prefixindex.MIX_BYTES}, "
                                     f"got {config.hash_width}")
    for g in config.groups:
        if not 1 <= g.block_size <= 1024:
            raise errors.InvalidArgument(f"block_size must be in [1, 1024], got {g.block_size}")
        if g.sliding_window is not None and g.sliding_window < 1:
            raise errors.InvalidArgument("sliding_window must be positive or None")
    for name in ("max_model_len", "max_num_reqs"):
        if getattr(config, name) < 1:
            raise errors.InvalidArgument(f"{name} must be positive")
    if config.num_cpu_blocks < 0 or config.max_encoder_len < 0 or config.max_lookahead_tokens < 0:
        raise errors.InvalidArgument("sizes must not be negative")
    if not 0.0 <= config.watermark < 1.0:
        raise errors.InvalidArgument("watermark must be in [0, 1)")
    if config.encoder_block_size < 1:
        raise errors.InvalidArgument("encoder_block_size must be positive")
