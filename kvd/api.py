"""Value types of the block manager's API: configuration, a scheduler step, and its results.

These are plain values shared by the core (``kvd.manager``), the daemon and the client. Arrays are
numpy; hashes are 16-byte values (``kvd.hashing.HASH_DTYPE``, numpy ``S16``), one per full block, or
``ManagerConfig.hash_width``-byte values (``S32`` under vLLM's scheme).

Per-request status codes (``STATUS_*`` below and the ``code`` of every ``kvd.errors`` class) share
one int16 space: 0 is OK, 1 is "no space" (a value, not an error), anything >= 2 is the code of the
typed error that request would have raised on its own.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

ReqId = Hashable

STATUS_OK = 0
STATUS_NO_SPACE = 1

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
    entries) until ``flush_deferred()`` or the next call: nothing in a step's result depends on
    it, so a daemon can reply first. Every public method flushes before it reads the cache."""
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


@dataclass
class StepBatch:
    """One scheduler step. Applied in this order: frees, forks, appends, admissions.

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


@dataclass(frozen=True)
class AllocResult:
    """Result of ``allocate``: ``ok`` or no space (then nothing changed)."""

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
