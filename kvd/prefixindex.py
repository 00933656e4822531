"""The prefix-cache index: (cache key, hash) -> block for every prefix-cache map of one pool, one
open-addressing table over numpy arrays, probed and changed by compiled loops (numba).

Why not a dict per map: a registration of 256 blocks into a map of ~50k entries took the daemon
~250-550 µs on a 2-core host, nearly all of it cache misses on the dict's index, its entries and the
bytes key objects (~1 µs a key), plus one bytes object made per hash. Here a probe reads one slot
(block id and tag side by side) and, only when the tags match, the block's own hash: about one
miss a key, and no Python object per hash.

The entries are the pool's own arrays (``kvd.pool``): block ``b`` is in map ``k`` under hash ``h``
exactly when ``cache_key[b] == k`` and ``block_hash[b] == h``. The table only finds them:

    slots  uint64[cap]  (tag << 32) | block: a cached block and the low 32 bits of its hash's
                        mix (a probe compares tags first), or EMPTY_SLOT (0: the null block is
                        never cached); one word, so a probe is one memory access

``cap`` is a power of two at least twice the pool, so the table is at most half full and never
grows (a block is in at most one map). Linear probing from ``tag & (cap - 1)``; deletion shifts the
rest of the cluster back (no tombstones). The mix is keyed by a random per-process seed, as
Python's dict is: hashes come from clients, and a client that could choose colliding hashes would
otherwise make every probe walk one long cluster. Only the first 16 bytes of a hash are mixed
(every scheme's hash is at least that wide and random); equality compares all of it.

The loops read hashes as 64-bit words (a hash of ``width`` bytes is ``width // 8`` uint64s: every
scheme's width is a multiple of 8): a tag mixes two loads, equality compares and a store copies
two or four words, not 16 or 32 bytes one at a time.

Invariants (``check``): every block with ``cache_key != 0`` sits in exactly one slot of its probe
chain, nothing else does, and ``count[k]`` is the number of blocks of map ``k``.
"""

from __future__ import annotations

import os

import numpy as np

try:
    import numba
    from numba import njit
except ImportError:  # numba is an optional extra (kvd[fast]): the same loops as plain Python
    numba = njit = None

EMPTY_SLOT = 0
"""A free slot of the table (block 0, the null block, is never cached)."""
_BLOCK = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
NOT_FOUND = -1
"""What ``find`` answers for a hash the map does not hold."""
MIX_BYTES = 16
_NUM_KEYS = 1 << 16  # cache keys are uint16 (kvd.pool)

_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_LOW32 = np.uint64(0xFFFFFFFF)


def _compiled(fn):
    """numba's njit, or the plain function with uint64 wrap-around allowed (numpy warns on scalar
    overflow, which the mix relies on)."""
    if njit is not None and not numba.config.DISABLE_JIT:
        return njit(cache=True, nogil=True, boundscheck=False)(fn)

    def run(*args):
        with np.errstate(over="ignore"):
            return fn(*args)
    run.py_func = fn
    return run


@_compiled
def _fmix(x):
    x ^= x >> _S33
    x *= _M1
    x ^= x >> _S33
    x *= _M2
    x ^= x >> _S33
    return x


@_compiled
def _tag(h, i, seed):
    """The mix of row ``i`` of ``h`` (uint64 words, at least two a row), as uint32."""
    return np.uint32(_fmix(_fmix(h[i, 0] ^ seed) ^ h[i, 1]) & _LOW32)


@_compiled
def _same(h, i, bh, b):
    for j in range(h.shape[1]):
        if h[i, j] != bh[b, j]:
            return False
    return True


@_compiled
def _probe_tagged(h, i, tag, key, slots, bh, cache_key):
    """The block of map ``key`` under hash ``h[i]`` (whose tag is ``tag``), or NOT_FOUND."""
    mask = slots.size - 1
    s = tag & mask
    while True:
        e = slots[s]
        if e == EMPTY_SLOT:
            return NOT_FOUND
        if np.uint32(e >> _S32) == tag:
            b = np.int64(e & _BLOCK)
            if cache_key[b] == key and _same(h, i, bh, b):
                return b
        s = (s + 1) & mask


@_compiled
def _probe(h, i, key, seed, slots, bh, cache_key):
    """The block of map ``key`` under hash ``h[i]``, or NOT_FOUND."""
    return _probe_tagged(h, i, _tag(h, i, seed), key, slots, bh, cache_key)


@_compiled
def _tags(h, seed, tags):
    """Every row's tag into ``tags``, in a loop of its own before the probes. Why: a batch's home
    slots are random lines of a table far larger than the caches, and a probe that mixes its tag
    itself (two rounds over 16 bytes) is a long iteration, so the processor has only a few probes'
    misses in flight at once; probes that read a precomputed tag are short and overlap many more.
    Inserting 4,096 new hashes into a 2M-slot table: 0.53-0.64x the time."""
    for i in range(h.shape[0]):
        tags[i] = _tag(h, i, seed)


@_compiled
def _touch(tags, n, slots):
    """Read the home slot of each of the first ``n`` tags, in a loop of a load and an xor, and
    store what was read at ``tags[n]`` (a store: the compiler cannot drop the loop). For lookups of
    hashes that are there: each such probe is a chain of dependent misses (slot, then the block's
    key and hash), so reading all slots first takes one link off every chain. Finding 4,096 present
    hashes at random blocks: ~0.6x the time. For inserts it has the misses in flight together that
    the insert loop, its stores and branches between them, would take one or two at a time. With
    the one-pass insert and the words (2-core box, 1,024 new 16-byte hashes into a 57k-entry map of
    a 64k-block pool): 47 -> 27 µs with the table out of the caches, 34 -> 22 µs with it in them."""
    mask = slots.size - 1
    acc = np.uint64(0)
    for i in range(n):
        acc ^= slots[tags[i] & mask]
    tags[n] = np.uint32(acc & _LOW32)


@_compiled
def find_each(h, key, seed, slots, bh, cache_key, out, tags):
    """``out[i]``: the block of map ``key`` under ``h[i]``, or NOT_FOUND; every hash looked up.
    ``tags``: scratch, a uint32 per row and one more."""
    _tags(h, seed, tags)
    _touch(tags, h.shape[0], slots)
    for i in range(h.shape[0]):
        out[i] = _probe_tagged(h, i, tags[i], key, slots, bh, cache_key)


@_compiled
def find_run(h, key, seed, slots, bh, cache_key, out, tags):
    """The leading run of ``h`` that map ``key`` holds: its length, its blocks in ``out``."""
    _tags(h, seed, tags)
    _touch(tags, h.shape[0], slots)
    for i in range(h.shape[0]):
        b = _probe_tagged(h, i, tags[i], key, slots, bh, cache_key)
        if b == NOT_FOUND:
            return i
        out[i] = b
    return h.shape[0]


@_compiled
def _put_tagged(h, i, tag, b, key, slots, bh, cache_key, count):
    """Store block ``b`` under ``h[i]`` (tag ``tag``) in map ``key`` (the caller knows the hash is absent)."""
    mask = slots.size - 1
    s = tag & mask
    while slots[s] != EMPTY_SLOT:
        s = (s + 1) & mask
    slots[s] = (np.uint64(tag) << _S32) | np.uint64(b)
    for j in range(h.shape[1]):
        bh[b, j] = h[i, j]
    cache_key[b] = key
    count[key] += 1


@_compiled
def _put(h, i, b, key, seed, slots, bh, cache_key, count):
    """Store block ``b`` under ``h[i]`` in map ``key`` (the caller knows the hash is absent)."""
    _put_tagged(h, i, _tag(h, i, seed), b, key, slots, bh, cache_key, count)


@_compiled
def insert_new(h, blocks, key, seed, slots, bh, cache_key, count, tags):
    """Store ``blocks[i]`` (uncached) under ``h[i]`` in map ``key``, all or nothing: returns the
    first index whose hash the map holds already or an earlier row of the batch repeats (or whose
    block is cached or repeated), having stored nothing, or -1 when it stored them all. Writes the
    blocks' hashes and keys. ``tags``: scratch, a uint32 per row and one more.

    One pass that stores as it goes and undoes the stores on a conflict (misuse, or a registration
    the caller then does block by block): a conflict-free batch, the usual one, probes each home
    slot once more after ``_touch`` instead of twice."""
    n = h.shape[0]
    _tags(h, seed, tags)
    _touch(tags, n, slots)
    stop = n
    for i in range(n):
        b = blocks[i]
        if cache_key[b] != 0 or _probe_tagged(h, i, tags[i], key, slots, bh, cache_key) != NOT_FOUND:
            stop = i
            break
        _put_tagged(h, i, tags[i], b, key, slots, bh, cache_key, count)
    if stop == n:
        return -1
    for k in range(stop):  # (outside the loop above: its body stays small)
        _remove_tagged(blocks[k], tags[k], slots, cache_key, count)
        cache_key[blocks[k]] = 0
    return stop


@_compiled
def insert_one(h, i, b, key, seed, slots, bh, cache_key, count):
    """Store block ``b`` under ``h[i]`` unless map ``key`` holds that hash; True when stored."""
    if _probe(h, i, key, seed, slots, bh, cache_key) != NOT_FOUND:
        return False
    _put(h, i, b, key, seed, slots, bh, cache_key, count)
    return True


@_compiled
def insert_each(h, blocks, start, key, side_key, mark, seed, slots, bh, cache_key, count, in_main, in_side):
    """``kvd.pool.BlockPool.register``'s block-by-block rule, in order from ``start``: block
    ``blocks[i]`` (skipped if cached, e.g. repeated in the batch) goes into map ``key`` when it has
    no entry under ``h[i]`` (``in_main[i]``), into side map ``side_key`` when the entry awaits
    another writer's confirmation (``in_side[i]``); nothing when the writer of ``side_key`` sees
    that hash already (its own entry, or one confirmed). ``mark``: the pool's ``unconfirmed_by``.
    Returns -1 when done, or the first ``i`` whose confirmed registration (``side_key`` 0) meets an
    unconfirmed entry: the caller uncaches that entry, stores ``blocks[i]`` and goes on from i + 1."""
    for i in range(start, h.shape[0]):
        b = blocks[i]
        if cache_key[b] != 0:
            continue
        if side_key and count[side_key] and _probe(h, i, side_key, seed, slots, bh, cache_key) != NOT_FOUND:
            continue
        old = _probe(h, i, key, seed, slots, bh, cache_key) if count[key] else NOT_FOUND
        if old == NOT_FOUND:
            _put(h, i, b, key, seed, slots, bh, cache_key, count)
            in_main[i] = True
        elif not side_key:
            if mark[old]:
                return i
        elif mark[old] != 0 and mark[old] != side_key:
            _put(h, i, b, side_key, seed, slots, bh, cache_key, count)
            in_side[i] = True
    return -1


@_compiled
def _remove_tagged(b, tag, slots, cache_key, count):
    """Take block ``b`` (whose hash's tag is ``tag``) out of the table, if it is there.
    Backward-shift deletion keeps every later member of the cluster reachable from its home."""
    mask = slots.size - 1
    entry = (np.uint64(tag) << _S32) | np.uint64(b)
    s = np.int64(tag) & mask
    while slots[s] != entry:
        if slots[s] == EMPTY_SLOT:
            return
        s = (s + 1) & mask
    count[cache_key[b]] -= 1
    hole = s
    s = (s + 1) & mask
    while slots[s] != EMPTY_SLOT:
        home = np.int64(slots[s] >> _S32) & mask
        # the entry at s may fill the hole unless its home lies cyclically within (hole, s]
        if (s - home) & mask >= (s - hole) & mask:
            slots[hole] = slots[s]
            hole = s
        s = (s + 1) & mask
    slots[hole] = EMPTY_SLOT


@_compiled
def remove(blocks, seed, slots, bh, cache_key, count, tags):
    """Take cached ``blocks`` out of the table (their ``cache_key`` is the caller's to clear).
    ``tags``: scratch, a uint32 per block: their hashes' tags first, as ``_tags`` does."""
    for k in range(blocks.size):
        tags[k] = _tag(bh, blocks[k], seed)
    for k in range(blocks.size):
        _remove_tagged(blocks[k], tags[k], slots, cache_key, count)


@_compiled
def rebuild(seed, slots, bh, cache_key, count):
    """Index every block whose ``cache_key`` is set, from an empty table."""
    slots[:] = EMPTY_SLOT
    count[:] = 0
    mask = slots.size - 1
    for b in range(cache_key.size):
        key = cache_key[b]
        if key:
            tag = _tag(bh, b, seed)
            s = tag & mask
            while slots[s] != EMPTY_SLOT:
                s = (s + 1) & mask
            slots[s] = (np.uint64(tag) << _S32) | np.uint64(b)
            count[key] += 1


def capacity(num_blocks: int) -> int:
    """Slots of the table of a pool of ``num_blocks``: a power of two, at least twice as many."""
    cap = 16
    while cap < 2 * num_blocks:
        cap *= 2
    return cap


def nbytes(num_blocks: int) -> int:
    """Memory of the index of a pool of ``num_blocks``."""
    return 8 * capacity(num_blocks) + 8 * _NUM_KEYS


class PrefixIndex:
    """The index of one pool's prefix-cache maps over its ``block_hash`` and ``cache_key`` arrays
    (which it reads, and writes when it stores a block). Hashes are given as ``S{width}`` arrays."""

    def __init__(self, block_hash: np.ndarray, cache_key: np.ndarray) -> None:
        width = block_hash.dtype.itemsize
        assert block_hash.dtype.kind == "S" and width >= MIX_BYTES and width % 8 == 0 and cache_key.dtype == np.uint16
        self.width = width
        self.block_hash = block_hash
        self.cache_key = cache_key
        self._bh = block_hash.view(np.uint64).reshape(block_hash.size, width // 8)
        cap = capacity(block_hash.size)
        self.slots = np.zeros(cap, np.uint64)
        self.count = np.zeros(_NUM_KEYS, np.int64)
        self.seed = np.uint64(int.from_bytes(os.urandom(8), "little"))
        self._out = np.empty(0, np.int32)
        self._tags = np.empty(0, np.uint32)

    def _rows(self, hashes: np.ndarray) -> np.ndarray:
        """``hashes`` as rows of uint64 words; copied where a frame's bytes are not 8-byte aligned
        (numba types unaligned arrays apart: a loop compiled during a step)."""
        assert hashes.dtype.itemsize == self.width and hashes.ndim == 1, (hashes.dtype, hashes.shape)
        words = np.ascontiguousarray(hashes).view(np.uint64)
        if not words.flags.aligned:
            words = words.copy()
        return words.reshape(hashes.size, self.width // 8)

    def _scratch(self, n: int) -> np.ndarray:
        if self._out.size < n:
            self._out = np.empty(max(n, 2 * self._out.size), np.int32)
        return self._out[:n]

    def _tag_scratch(self, n: int) -> np.ndarray:
        """Room for ``n`` tags and ``_touch``'s one word after them."""
        if self._tags.size <= n:
            self._tags = np.empty(max(n + 1, 2 * self._tags.size), np.uint32)
        return self._tags

    def _args(self):
        return self.seed, self.slots, self._bh, self.cache_key

    def find(self, key: int, hashes: np.ndarray) -> np.ndarray:
        """Per hash the block map ``key`` holds under it, or NOT_FOUND (int32, a new array)."""
        out = np.empty(hashes.size, np.int32)
        if hashes.size:
            find_each(self._rows(hashes), key, *self._args(), out, self._tag_scratch(hashes.size))
        return out

    def run(self, key: int, hashes: np.ndarray) -> np.ndarray:
        """The blocks of the leading run of ``hashes`` that map ``key`` holds (a new array)."""
        if not hashes.size or not self.count[key]:
            return np.empty(0, np.int32)
        out = self._scratch(hashes.size)
        n = find_run(self._rows(hashes), key, *self._args(), out, self._tag_scratch(hashes.size))
        return out[:n].copy()

    def get_at(self, key: int, hashes: np.ndarray, i: int) -> int | None:
        """The block map ``key`` holds under ``hashes[i]`` (or None)."""
        if not self.count[key]:
            return None
        b = _probe(self._rows(hashes[i : i + 1]), 0, key, *self._args())
        return None if b == NOT_FOUND else int(b)

    def insert_new(self, key: int, hashes: np.ndarray, blocks: np.ndarray) -> int:
        """Store ``blocks`` under ``hashes`` in map ``key`` (writing the blocks' hash and key), all
        or nothing: -1 when stored, else the index of the first hash held already or repeated."""
        if not hashes.size:
            return -1
        return int(insert_new(self._rows(hashes), np.ascontiguousarray(blocks, np.int32), key,
                              *self._args(), self.count, self._tag_scratch(hashes.size)))

    def insert_one(self, key: int, hashes: np.ndarray, i: int, block: int) -> bool:
        """Store ``block`` under ``hashes[i]`` in map ``key`` unless it holds that hash already."""
        return bool(insert_one(self._rows(hashes), i, block, key, *self._args(), self.count))

    def insert_each(self, key: int, side_key: int, hashes: np.ndarray, blocks: np.ndarray, mark: np.ndarray,
                    in_main: np.ndarray, in_side: np.ndarray, start: int = 0) -> int:
        """The compiled ``insert_each`` from ``start``: -1 when done, else where the caller must
        replace an unconfirmed entry itself."""
        return int(insert_each(self._rows(hashes), np.ascontiguousarray(blocks, np.int32), start, key, side_key, mark,
                               *self._args(), self.count, in_main, in_side))

    def remove(self, blocks: np.ndarray) -> None:
        """Take cached ``blocks`` out of their maps' index; their ``cache_key`` is the caller's to
        clear (or to set to another map, followed by ``insert_new``)."""
        if blocks.size:
            remove(np.ascontiguousarray(blocks, np.int32), *self._args(), self.count, self._tag_scratch(blocks.size))

    def rebuild(self) -> None:
        """Index exactly the blocks whose ``cache_key`` is set (after a bulk change of the arrays)."""
        rebuild(*self._args(), self.count)

    def __len__(self) -> int:
        return int(self.count.sum())

    def size_of(self, key: int) -> int:
        return int(self.count[key])

    def blocks_of(self, key: int) -> np.ndarray:
        """The blocks of map ``key``, by id."""
        return np.flatnonzero(self.cache_key == key).astype(np.int32) if self.count[key] else np.empty(0, np.int32)

    def check(self) -> None:
        """Every cached block exactly once, in reach of its home slot; the counts."""
        cached = np.flatnonzero(self.cache_key).astype(np.int32)
        held = (self.slots[self.slots != EMPTY_SLOT] & _BLOCK).astype(np.int32)
        assert np.array_equal(np.sort(held), cached), "the index and the cached blocks differ"
        assert np.array_equal(np.bincount(self.cache_key[cached], minlength=_NUM_KEYS), self.count)
        for b in cached.tolist():
            key = int(self.cache_key[b])
            row = self._bh[b : b + 1]
            assert _probe(row, 0, key, *self._args()) == b, f"block {b} is out of its probe chain"


def warm_up() -> None:
    """Compile (or load from numba's cache) every loop, as the daemon does at start: for hashes in
    arrays of its own and for read-only ones (a message's frames), numba's two array types."""
    bh = np.zeros(4, "S16")
    index = PrefixIndex(bh, np.zeros(4, np.uint16))
    for writeable in (True, False):
        h = np.array([b"w" * 16], "S16")
        h.flags.writeable = writeable
        index.insert_new(1, h, np.array([1], np.int32))
        index.insert_one(1, h, 0, 2)
        flags = np.zeros(1, bool)
        index.insert_each(1, 2, h, np.array([3], np.int32), np.zeros(4, np.uint16), flags, flags.copy())
        index.find(1, h)
        index.run(1, h)
        index.remove(np.array([1, 2, 3], np.int32))
        index.cache_key[:] = 0
    index.rebuild()
