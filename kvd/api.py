"""Value types of the block manager's API: configuration, a scheduler step, and its results.

These are plain values shared by the core (``kvd.manager``), the daemon and the client. Arrays are
numpy; hashes are 16-byte values (``kvd.hashing.HASH_DTYPE``, numpy ``S16``), one per full block, or
``ManagerConfig.hash_width``-byte values (``S32`` under vLLM's scheme).

Status codes. Per-request statuses (the ``*_status`` arrays of a step, ``AllocResult.status`` ...)
and the ``code`` of every ``kvd.errors`` class share one int16 space, split so they never collide:

- 0..15: statuses, the values of ``AllocStatus``: 0 OK, 1 LATER (no space now: retry after
  requests finish; nothing changed), 2 NEVER (the request can never fit this pool, however much is
  freed: do not retry). ``STATUS_OK`` and ``STATUS_NO_SPACE`` (== LATER) name the first two.
- 16 and up (``kvd.errors.FIRST_ERROR_CODE``): the code of the typed error the request would have
  raised on its own (16..31 misuse, 32..63 transport and session errors).

``can_allocate`` and ``allocate`` agree: for the same request in the same pool state both answer
OK, LATER or NEVER, and both raise the same typed error for invalid arguments. ``can_swap_out`` /
``can_swap_in`` answer ``AllocStatus`` the same way.

Once several engines share one daemon's pool, every ``can_*`` answer is advisory: another engine may
take or free blocks between the question and the call. Act on the status of the call itself
(``allocate``, ``swap_in``, a step's ``admit_status``), which is atomic.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvd.errors import InvalidArgument

ReqId = Hashable


def int_array(values, dtype, what: str) -> np.ndarray:
    """``values`` as an integer array of ``dtype``, or ``kvd.errors.InvalidArgument``: no float
    truncated, and no value wrapped into a narrower type (row 2**32 is not row 0). An empty sequence
    of any type is an empty array. The manager and the client judge rows and counts by it."""
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError, OverflowError):
        raise InvalidArgument(f"{what} must be integers") from None
    if not arr.size:
        return arr.astype(dtype)
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"{what} must be integers, got {arr.dtype}")
    out = arr.astype(dtype, copy=False)
    if out is not arr and not np.can_cast(arr.dtype, dtype):
        info = np.iinfo(dtype)
        if int(arr.min()) < info.min or int(arr.max()) > info.max:
            raise InvalidArgument(f"{what}: a value out of the range of {np.dtype(dtype)}")
    return out

STATUS_OK = 0
STATUS_NO_SPACE = 1
"""No space now (== ``AllocStatus.LATER``): nothing changed; may succeed after requests finish."""
STATUS_NEVER = 2
"""Can never fit this pool (== ``AllocStatus.NEVER``): nothing changed; retrying is useless."""

NULL_BLOCK = 0
"""Block 0 of every pool: never handed out, never freed; padded rows and out-of-window slots point
at it."""

PAD_SLOT_ID = -1
"""Slot-mapping value of padding tokens (from the step's real token count up to the buffer end)."""

MIN_PRIORITY = 0
MAX_PRIORITY = 100
DEFAULT_PRIORITY = 50
"""Eviction priority of a request's cached blocks: lower priorities are evicted first, LRU within
one priority. Requests that never set it all share the default, which is plain LRU."""


class AllocStatus(enum.IntEnum):
    """Answer of ``can_allocate`` / ``can_swap_in`` / ``can_swap_out`` (vLLM v0's ``AllocStatus``)
    and the status values of results: OK (it fits now), LATER (not now: wait for requests to
    finish), NEVER (never in this pool: e.g. more blocks than the pool has; do not retry)."""

    OK = 0
    LATER = 1
    NEVER = 2


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group: its block size and, for sliding-window attention, its window in tokens."""

    block_size: int = 16
    sliding_window: int | None = None


@dataclass(frozen=True)
class ManagerConfig:
    """Configuration of one ``BlockManager`` (the daemon builds it from ``kvd.config.ServeConfig``).

    ``num_gpu_blocks`` includes the null block 0 (so ``num_gpu_blocks - 1`` are usable);
    ``groups``: one ``GroupSpec`` per KV-cache group (a hybrid model has several);
    ``num_cpu_blocks``: the swap space (0: no swapping); ``max_model_len``: most tokens of one
    request; ``max_num_reqs``: most live requests (rows) at once.
    """

    num_gpu_blocks: int
    groups: tuple[GroupSpec, ...] = (GroupSpec(),)
    num_cpu_blocks: int = 0
    max_model_len: int = 8192
    max_num_reqs: int = 1024
    max_lookahead_tokens: int = 64
    """Most lookahead (speculative) slots one request may reserve beyond its tokens."""
    enable_prefix_caching: bool = True
    watermark: float = 0.0
    """Fraction of the pool that admission (``can_allocate``/``allocate``) leaves free."""
    admit_full_sequence: bool = False
    """Admission counts prompt + ``max_new_tokens`` instead of the prompt alone."""
    reserve_decode_blocks: bool = False
    """Admission keeps one block free for each running request whose last block is full."""
    max_encoder_len: int = 0
    """Largest encoder input (tokens) of encoder-decoder requests; 0 disables cross-attention."""
    encoder_block_size: int = 16
    defer_cache_registration: bool = False
    """On the decode fast path, leave the prefix-cache bookkeeping of newly full blocks (their map
    entries) until ``flush_deferred()`` or the next call, and so the registration of a step's lone
    admission: nothing in a step's result depends on it, so a daemon can reply first. Every public
    method flushes before it reads the cache. What waits keeps copies of the caller's writeable
    arrays (hashes, counts, token ids): a caller may reuse its buffers once the call returned."""
    debug_checks: bool = False
    """Run the heavy invariant check after every mutation (tests turn it on)."""
    hash_width: int = 16
    """Bytes of one block hash (kvd.hashing.hash_width of the scheme): 16, or 32 for vLLM's."""


@dataclass(frozen=True)
class AdmitRequest:
    """A new request of a step. ``block_hashes``: one S16 array per group (or one array when there is
    one group) with the hashes of the prompt's full blocks."""

    req_id: ReqId
    num_tokens: int
    block_hashes: object = ()
    num_lookahead_tokens: int = 0
    priority: int = DEFAULT_PRIORITY
    num_encoder_tokens: int = 0
    max_new_tokens: int = 0
    token_ids: object = None
    """Optional: the prompt's token ids (at least those of its hashed full blocks, at most
    ``num_tokens``), published in the KV events' ``BlockStored.token_ids`` of the blocks it
    registers. Only a manager that publishes KV events keeps them (a client sends them only to such
    a daemon: the hello reply's ``kv_events``); invalid ones are an InvalidArgument either way."""


@dataclass
class StepBatch:
    """One scheduler step. Applied in this order: the confirmation, frees, forks, appends, admissions.

    Appends name their requests either by id (``append_ids``) or by manager row (``append_rows``,
    what the daemon uses). ``append_num_tokens`` is an int for all or an array, one per request.
    ``append_hashes[g]`` holds, for group g, the hashes of the blocks that became full, request after
    request; ``append_hash_counts[g][i]`` says how many of them belong to request i. Registration may
    lag (fewer hashes than full blocks) but never run ahead.
    """

    free: Sequence[ReqId] = ()
    forks: Sequence[tuple[ReqId, ReqId]] = ()
    append_ids: Sequence[ReqId] = ()
    append_rows: np.ndarray | None = None
    append_num_tokens: object = 1
    append_hashes: Sequence[np.ndarray] = ()
    append_hash_counts: Sequence[np.ndarray] = ()
    num_lookahead_tokens: int = 0
    admit: Sequence[AdmitRequest] = ()
    computed_through: int | None = None
    """The writer's confirmation, applied before anything else: the forward passes of its calls up
    to this tick (a ``StepResult.tick``) have finished, so the blocks they registered may become hits
    for other writers (see ``kvd.manager``). None: nothing confirmed by this step."""
    append_token_ids: Sequence[np.ndarray] = ()
    """Optional, for KV events (as ``AdmitRequest.token_ids``): ``append_token_ids[g]`` holds the
    token ids of the blocks ``append_hashes[g]`` names, block_size of group g per hash in the same
    order (flat, or one row per block; with one group the array itself may be given)."""

    def is_lone_admission(self) -> bool:
        """One admission and nothing else (but a confirmation): no frees, forks or appends, the
        append fields at their defaults' kinds. A new request's first step, its time to first token:
        the manager (``_lone_admission_step``) and the client (``LoneAdmission``) take lean paths."""
        rows = self.append_rows
        return (len(self.admit) == 1 and not len(self.free) and not len(self.forks) and not len(self.append_ids)
                and (rows is None or (type(rows) is np.ndarray and rows.size == 0))
                and type(self.append_num_tokens) is int and not len(self.append_hashes)
                and not len(self.append_hash_counts) and not len(self.append_token_ids))


@dataclass
class StepResult:
    """What a step did. Status arrays use the STATUS_* / error-code space described above.

    The schedule (``sched_*``) lists, in batch order (appends then admissions, successful ones only),
    each request's row, the position of its first token to compute this step and how many tokens:
    exactly what the slot-mapping kernels need. ``changed_rows`` are rows whose block tables or
    block counts may have changed: exact on the decode fast path (rows that got a new block), a
    superset (every scheduled row and new child) otherwise.
    """

    free_status: np.ndarray
    fork_status: np.ndarray
    append_status: np.ndarray
    admit_status: np.ndarray
    admit_rows: np.ndarray
    admit_cached_tokens: np.ndarray
    copies: np.ndarray
    changed_rows: np.ndarray
    sched_rows: np.ndarray
    sched_start: np.ndarray
    sched_len: np.ndarray
    freed_rows: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    tick: int = 0
    """The manager's call counter after this step: what the writer confirms once the step's
    forward pass has finished (``StepBatch.computed_through``)."""

    def granted(self) -> bool:
        """Whether every request of the step got ``STATUS_OK`` (frees, forks, appends, admissions)
        and nothing was copied on write."""
        return not (len(self.copies) or self.free_status.any() or self.fork_status.any()
                    or self.append_status.any() or self.admit_status.any())


@dataclass(frozen=True)
class AllocResult:
    """Result of ``allocate``: ``ok``, or ``status`` LATER / NEVER (then nothing changed).
    ``group_block_ids``: the request's table per group; ``num_cached_tokens``: prefix-cache hit."""

    status: int
    group_block_ids: tuple[np.ndarray, ...] = ()
    num_cached_tokens: int = 0
    row: int = -1

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK

    @property
    def block_ids(self) -> np.ndarray:
        return self.group_block_ids[0]


@dataclass(frozen=True)
class AppendResult:
    """Result of ``append_slots``: the blocks added to each group's table (maybe none), the
    copy-on-write copies it caused, or no space (then nothing changed)."""

    status: int
    group_new_block_ids: tuple[np.ndarray, ...] = ()
    copies: np.ndarray = field(default_factory=lambda: np.empty((0, 2), np.int32))

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK

    @property
    def new_block_ids(self) -> np.ndarray:
        return self.group_new_block_ids[0]


@dataclass(frozen=True)
class SwapResult:
    """Result of ``swap_out``/``swap_in``: the ``(src, dst)`` block pairs to copy, or no space
    (then nothing changed)."""

    status: int
    mapping: np.ndarray = field(default_factory=lambda: np.empty((0, 2), np.int32))

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK
