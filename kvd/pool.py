"""The block pool: struct-of-arrays over every block, with an array-backed LRU free queue.

Per block (numpy arrays, no Python object per block):

    ref_cnt     int32   holders of the block (requests, forks, swap copies)
    block_hash  S16     its prefix-cache hash while cache_key != 0; for a block a request registered
                        but that stayed uncached (its hash was cached already) the hash of its
                        content too, so swapped-in chains know their parents (kvd.runs)
    cache_key   uint16  which prefix-cache map holds it; 0 = not cached
    unconfirmed_by uint16  side key of the writer whose confirmation it awaits; 0 = confirmed (or
                        not cached)
    evict_prio  uint8   eviction priority it was freed with
    queue_pos   int32   its index in an eviction queue's buffer, or -1

The free queue, front to back, is two array-backed parts:

    1. the *fresh stack*: free blocks with no hash. Freed ones are pushed on top, so they are reused
       first (front of the queue). Initially 1, 2, 3, ... come off in that order.
    2. one *eviction queue* per priority (lowest first): free blocks that are still in the prefix
       cache, in the order they were freed (least recently freed first). Taking one evicts it from
       the cache. A prefix hit takes a block out of the middle in O(1) by leaving a tombstone
       (queue_pos = -1); tombstones are skipped when popping and squeezed out on compaction.

This is the order vLLM's doubly linked free list gives (uncached blocks at the head, cached blocks
appended at the tail), but every operation works on arrays of blocks at once: popping k blocks is a
slice, not k pointer hops. Block 0 is the null block: never free, never handed out, never counted.

Prefix-cache maps (hash -> block, one per cache key; ``kvd.prefixindex`` finds their entries, which
are the blocks' own ``block_hash`` and ``cache_key``) come in two kinds. A *shared* map
is what lookups of a namespace see. Several writers may fill one shared map; a block whose KV its
writer has not yet confirmed as written is *unconfirmed*: ``unconfirmed_by[block]`` names the writer
(by the cache key of its side map, below; 0 = confirmed) and only that writer's lookups may hit it.
Confirming is one array write: no entry moves between maps. A writer that computes a hash another
writer's unconfirmed entry holds keeps its copy in its own *side* map (``side_of[side key]`` = the
shared map's key; lookups of that writer consult it after the shared map), because its own later
lookups must hit the copy it computed; a side entry moves into the shared map when confirmed,
replacing the other writer's unconfirmed block if that is still there. A confirmed registration
always takes the place of an unconfirmed one: the unconfirmed block stops being cached. An
unconfirmed block is cached in every other respect (it has a hash, sits in an eviction queue when
free, is evicted like any other); KV events are published for confirmed shared entries only.

Conservation, always: fresh + evictable + in use == num_blocks - 1.
"""

from __future__ import annotations

import numpy as np

from kvd import rowloops
from kvd.api import DEFAULT_PRIORITY, MAX_PRIORITY, NULL_BLOCK
from kvd.hashing import HASH_DTYPE
from kvd.prefixindex import PrefixIndex
from kvd.runs import Runs

NO_CACHE_KEY = 0
_NO_MASK = np.zeros(0, bool)
_NO_BLOCKS = np.zeros(0, np.int32)  # take(0)'s (writable: a read-only array is another compiled signature)
ALL_SHARED = None
"""What ``BlockPool.register`` returns when every block it was given went into the shared map."""
_MIN_QUEUE_CAPACITY = 1024
_EMPTY_I32 = np.empty(0, np.int32)


class _EvictionQueue:
    """FIFO of cached free blocks of one priority, with tombstones for O(1) removal.

    An entry is live when the block's ``queue_pos`` points back at it *and* the block's
    ``evict_prio`` is this queue's: positions are shared by all queues, so a tombstone here could
    otherwise match the block's live entry at the same index of another priority's queue.
    """

    __slots__ = ("buf", "head", "tail", "live", "prio", "evict_prio")

    def __init__(self, capacity: int, prio: int, evict_prio: np.ndarray) -> None:
        self.prio = prio
        self.evict_prio = evict_prio
        self.buf = np.empty(capacity, np.int32)
        self.head = 0
        self.tail = 0
        self.live = 0

    def push(self, blocks: np.ndarray, queue_pos: np.ndarray) -> None:
        k = blocks.size
        if self.tail + k > self.buf.size:
            self._compact(queue_pos, k)
        self.buf[self.tail : self.tail + k] = blocks
        queue_pos[blocks] = np.arange(self.tail, self.tail + k, dtype=np.int32)
        self.evict_prio[blocks] = self.prio
        self.tail += k
        self.live += k

    def _compact(self, queue_pos: np.ndarray, extra: int) -> None:
        alive = self.members(queue_pos)
        capacity = self.buf.size
        while capacity < 2 * (alive.size + extra):
            capacity *= 2
        if capacity != self.buf.size:
            self.buf = np.empty(capacity, np.int32)
        self.buf[: alive.size] = alive
        queue_pos[alive] = np.arange(alive.size, dtype=np.int32)
        self.head, self.tail = 0, alive.size

    def members(self, queue_pos: np.ndarray) -> np.ndarray:
        """Live blocks, oldest first."""
        span = self.buf[self.head : self.tail]
        return span[self._valid(span, self.head, self.tail, queue_pos)]

    def _valid(self, span, start, end, queue_pos) -> np.ndarray:
        valid = queue_pos[span] == np.arange(start, end, dtype=np.int32)
        valid &= self.evict_prio[span] == self.prio
        return valid

    def pop_into(self, k: int, queue_pos: np.ndarray, out: np.ndarray, o: int) -> None:
        """``pop`` into ``out[o:o + k]`` (one compiled loop with numba)."""
        assert 0 < k <= self.live
        if rowloops.HAVE_NUMBA:
            self.head = rowloops.pop_queue(self.buf, self.head, queue_pos, self.evict_prio, self.prio, k, out, o)
            self.live -= k
        else:
            out[o : o + k] = self.pop(k, queue_pos)

    def pop(self, k: int, queue_pos: np.ndarray) -> np.ndarray:
        """Take the k oldest live blocks (k <= live)."""
        assert 0 < k <= self.live
        taken = []
        need = k
        chunk = max(2 * k, 64)
        while need:
            end = min(self.head + chunk, self.tail)
            span = self.buf[self.head : end]
            idx = np.flatnonzero(self._valid(span, self.head, end, queue_pos))
            if idx.size >= need:
                idx = idx[:need]
                self.head += int(idx[-1]) + 1
            else:
                self.head = end
            taken.append(span[idx])
            need -= idx.size
            chunk *= 2
        blocks = taken[0] if len(taken) == 1 else np.concatenate(taken)
        queue_pos[blocks] = -1
        self.live -= k
        return blocks


class BlockPool:
    """Reference counts, prefix-cache maps and the free queue of one pool (GPU or CPU)."""

    def __init__(self, num_blocks: int, hash_dtype: np.dtype = HASH_DTYPE, prefix_cache: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("a pool needs at least the null block")
        self.num_blocks = num_blocks
        self.ref_cnt = np.zeros(num_blocks, np.int32)
        self.block_hash = np.zeros(num_blocks, hash_dtype)
        self.cache_key = np.zeros(num_blocks, np.uint16)
        self.evict_prio = np.zeros(num_blocks, np.uint8)
        self.queue_pos = np.full(num_blocks, -1, np.int32)
        self._per_prio = np.zeros(256, np.int64)  # touch's scratch: blocks revived per priority (uint8)
        # Top of the stack is the end: the reversed range hands out 1, 2, 3, ... first.
        self._stack = np.arange(num_blocks - 1, 0, -1, dtype=np.int32)
        self._stack_top = num_blocks - 1
        self._queues: dict[int, _EvictionQueue] = {}
        self._queue_order: list[int] = []
        self.unconfirmed_by = np.zeros(num_blocks, np.uint16)
        self.num_unconfirmed = 0
        # (kvd.prefixindex) None for a pool that caches nothing (the CPU pool: swapped blocks)
        self.index = PrefixIndex(self.block_hash, self.cache_key) if prefix_cache else None
        self.known_keys: set[int] = set()  # maps ever stored into since their last reset (events)
        self.side_of: dict[int, int] = {}  # a writer's side key -> its shared map's key
        self.num_evictions = 0
        # Prefix-cache changes, recorded only when a KV events publisher (kvd.events) asks for them:
        # ("stored", cache key, [hash, ...][, parent hash or None, token ids int32 [n, bs] or None]),
        # ("runs", cache key, hashes, kvd.runs.Runs) (a registration's blocks, one event per
        # request run: kvd.runs.expand), ("removed", cache key, [hash, ...]) or ("cleared", cache key, []).
        self.event_log: list[tuple] | None = None
        # Conservation is checked against these counts on every call that changes them.
        self._num_evictable = 0
        for arr in (self.ref_cnt, self.block_hash, self.cache_key, self.evict_prio, self.unconfirmed_by):
            arr.fill(0)  # touch every page now rather than on the first step that writes it

    # ---------------------------------------------------------------- counts
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (fresh + evictable cached)."""
        return self._stack_top + self._num_evictable

    @property
    def num_fresh(self) -> int:
        return self._stack_top

    @property
    def num_evictable(self) -> int:
        return self._num_evictable

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - self.num_free

    def nbytes_per_block(self) -> float:
        queues = sum(q.buf.nbytes for q in self._queues.values())
        arrays = (
            self.ref_cnt.nbytes
            + self.block_hash.nbytes
            + self.cache_key.nbytes
            + self.unconfirmed_by.nbytes
            + self.evict_prio.nbytes
            + self.queue_pos.nbytes
            + self._stack.nbytes
        )
        return (arrays + queues) / self.num_blocks

    # ---------------------------------------------------------------- taking blocks
    def take(self, k: int) -> np.ndarray:
        """Hand out k blocks from the front of the free queue (ref count 1). k <= num_free."""
        assert 0 <= k <= self.num_free, (k, self.num_free)
        if not k:  # (most groups' appends in most decode steps: one shared empty array, not three calls)
            return _NO_BLOCKS
        from_stack = min(k, self._stack_top)
        top = self._stack_top
        self._stack_top = top - from_stack
        blocks = np.empty(k, np.int32)
        blocks[:from_stack] = self._stack[top - from_stack : top][::-1]
        if from_stack < k:
            self._evict_into(blocks, from_stack)
        self.ref_cnt[blocks] = 1
        return blocks

    @property
    def fresh_stack(self) -> np.ndarray:
        """The fresh stack's buffer, for compiled callers (``kvd.rowloops``) that take blocks
        themselves: entries [0, num_fresh) are free; taking k hands out the top k, topmost first."""
        return self._stack

    def took_fresh(self, k: int) -> None:
        """A compiled caller took the top k fresh blocks and set their reference counts to 1."""
        assert 0 <= k <= self._stack_top, (k, self._stack_top)
        self._stack_top -= k

    def _evict_into(self, out: np.ndarray, start: int) -> None:
        """Evict ``out.size - start`` blocks from the front of the eviction queues (lowest priority
        first) into ``out[start:]``."""
        o = start
        for prio in self._queue_order:
            queue = self._queues[prio]
            if not queue.live:
                continue
            n = min(out.size - o, queue.live)
            queue.pop_into(n, self.queue_pos, out, o)
            o += n
            if o == out.size:
                break
        assert o == out.size
        blocks = out[start:]
        self._num_evictable -= blocks.size
        self._uncache(blocks)
        self.num_evictions += blocks.size

    def _uncache(self, blocks: np.ndarray) -> None:
        keys = self.cache_key[blocks]
        self.index.remove(blocks)
        self.cache_key[blocks] = NO_CACHE_KEY
        published = self._forget_unconfirmed(blocks)
        if self.event_log is not None:
            removed: dict[int, list[bytes]] = {}
            for key, h, pub in zip(keys.tolist(), self.block_hash[blocks].tolist(), published.tolist()):
                if pub and key not in self.side_of:
                    removed.setdefault(key, []).append(h)
            self.event_log.extend(("removed", key, hashes) for key, hashes in removed.items())

    def _forget_unconfirmed(self, blocks: np.ndarray) -> np.ndarray:
        """Clear the unconfirmed mark of blocks leaving the cache; returns which were confirmed."""
        if not self.num_unconfirmed:
            return np.ones(blocks.size, bool)
        marked = self.unconfirmed_by[blocks] != 0
        n = int(np.count_nonzero(marked))
        if n:
            self.unconfirmed_by[blocks] = 0
            self.num_unconfirmed -= n
        return ~marked

    def touch(self, blocks: np.ndarray) -> None:
        """Take a reference on blocks found in the prefix cache (unique ids), reviving free ones."""
        if rowloops.HAVE_NUMBA and blocks.dtype == np.int32:  # an admission's hits: one loop
            n = rowloops.hold_blocks(blocks, self.ref_cnt, self.queue_pos, self.evict_prio, self._per_prio)
            if n:
                self._left_queues(self._per_prio, n)
                self._per_prio[:] = 0
            return
        self._dequeue(blocks[self.ref_cnt[blocks] == 0])
        self.ref_cnt[blocks] += 1

    def num_unheld(self, blocks: np.ndarray) -> int:
        """How many of ``blocks`` nobody holds (what a ``touch`` of them would revive)."""
        if rowloops.HAVE_NUMBA and blocks.dtype == np.int32:
            return rowloops.count_unheld(self.ref_cnt, blocks)
        return int(np.count_nonzero(self.ref_cnt[blocks] == 0))

    def _dequeue(self, free: np.ndarray) -> None:
        """Take free cached blocks out of their eviction queues (tombstones: O(1) each)."""
        if free.size:
            self.queue_pos[free] = -1
            self._left_queues(np.bincount(self.evict_prio[free]), free.size)  # np.unique sorts: ~5x the cost

    def _left_queues(self, per_prio: np.ndarray, n: int) -> None:
        """``n`` blocks left the eviction queues (tombstoned), ``per_prio[p]`` of them priority ``p``'s."""
        for prio in np.flatnonzero(per_prio).tolist():
            self._queues[prio].live -= int(per_prio[prio])
        self._num_evictable -= n

    def incref(self, blocks: np.ndarray) -> None:
        """Another holder of blocks already in use (fork, shared swap copy); ids may repeat."""
        np.add.at(self.ref_cnt, blocks, 1)

    # ---------------------------------------------------------------- returning blocks
    def release(self, blocks: np.ndarray, priority: int | np.ndarray = DEFAULT_PRIORITY) -> None:
        """Drop one reference per entry, in freeing order (ids may repeat). Blocks whose count
        reaches zero join the free queue at their last entry's place in that order: uncached ones
        at the front, cached ones at the back of their priority's eviction queue. ``priority`` is one
        value or one per entry."""
        if not blocks.size:
            return
        blocks = np.ascontiguousarray(blocks, np.int32)
        last = np.empty(blocks.size, bool)
        n_freed = rowloops.drop_refs(blocks, self.ref_cnt, last)
        assert n_freed >= 0, "more releases than references"
        if n_freed == blocks.size:
            self.park(blocks, priority)
        else:
            self.park(blocks[last], priority if np.isscalar(priority) else np.asarray(priority)[last])

    def park(self, freed: np.ndarray, prio: int | np.ndarray) -> None:
        """Blocks whose count just reached zero, in freeing order, join the free queue (what
        ``release`` does after dropping the references; ``prio``: one value or one per block)."""
        if not freed.size:
            return
        queue = self._queues.get(int(prio)) if rowloops.HAVE_NUMBA and np.isscalar(prio) else None
        if queue is not None:
            return self._park_compiled(freed, queue, int(prio))  # one pass, not ~12 array operations
        cached = self.cache_key[freed] != NO_CACHE_KEY
        if not cached.any():
            self._push_fresh(freed)
            return
        fresh = freed[~cached]
        if fresh.size:
            self._push_fresh(fresh)
        self._enqueue(freed[cached], prio if np.isscalar(prio) else prio[cached])

    def _park_compiled(self, freed: np.ndarray, queue: "_EvictionQueue", prio: int) -> None:
        if queue.tail + freed.size > queue.buf.size:  # room for all of them, cached or not
            queue._compact(self.queue_pos, freed.size)
        tail0 = queue.tail
        self._stack_top, queue.tail = rowloops.park_blocks(
            np.ascontiguousarray(freed, np.int32), self.cache_key, NO_CACHE_KEY, self._stack, self._stack_top,
            queue.buf, queue.tail, self.queue_pos, self.evict_prio, prio)
        queued = queue.tail - tail0
        queue.live += queued
        self._num_evictable += queued

    def _push_fresh(self, blocks: np.ndarray) -> None:
        top = self._stack_top
        self._stack[top : top + blocks.size] = blocks
        self._stack_top = top + blocks.size

    def _enqueue(self, blocks: np.ndarray, priority) -> None:
        if np.isscalar(priority):
            self._queue(int(priority)).push(blocks, self.queue_pos)
        else:
            for prio in np.unique(priority).tolist():
                self._queue(prio).push(blocks[priority == prio], self.queue_pos)
        self._num_evictable += blocks.size

    def _queue(self, prio: int) -> _EvictionQueue:
        queue = self._queues.get(prio)
        if queue is None:
            assert 0 <= prio <= MAX_PRIORITY
            queue = _EvictionQueue(min(_MIN_QUEUE_CAPACITY, 2 * self.num_blocks), prio, self.evict_prio)
            self._queues[prio] = queue
            self._queue_order = sorted(self._queues)
        return queue

    # ---------------------------------------------------------------- prefix cache
    @property
    def caches(self) -> dict[int, dict[bytes, int]]:
        """A snapshot of every map that holds a block, ``{key: {hash: block}}`` (introspection and
        tests: it reads the whole pool)."""
        cached = np.flatnonzero(self.cache_key)
        out: dict[int, dict[bytes, int]] = {}
        for key, h, b in zip(self.cache_key[cached].tolist(), self.block_hash[cached].tolist(), cached.tolist()):
            out.setdefault(key, {})[h] = b
        return out

    def map_size(self, key: int) -> int:
        """How many blocks map ``key`` holds."""
        return self.index.size_of(key) if self.index is not None else 0

    def lookup(self, key: int, hashes: np.ndarray, side_key: int = NO_CACHE_KEY) -> np.ndarray:
        """Blocks of the leading run of ``hashes`` that the writer of side map ``side_key`` (0: a
        writer whose blocks are confirmed at once) sees in shared map ``key``: confirmed entries,
        its own unconfirmed ones, then its side map."""
        run = self.visible_run(self.index.run(key, hashes), side_key)
        if side_key and run.size < hashes.size and self.index.size_of(side_key):
            return self.lookup_from(key, hashes, side_key, run)
        return run

    def hidden(self, blocks: np.ndarray, side_key: int) -> np.ndarray:
        """Which cached ``blocks`` the writer of ``side_key`` may not hit (another's unconfirmed)."""
        mark = self.unconfirmed_by[blocks]
        return (mark != 0) & (mark != side_key)

    def visible_run(self, run: np.ndarray, side_key: int) -> np.ndarray:
        """A leading run of cached blocks cut at the first one the writer may not hit."""
        if self.num_unconfirmed and run.size:
            hidden = self.hidden(run, side_key)
            if hidden.any():
                return run[: int(np.argmax(hidden))]
        return run

    def lookup_from(self, key: int, hashes: np.ndarray, side_key: int, head: np.ndarray) -> np.ndarray:
        """``lookup`` going on after the blocks ``head`` found for ``hashes[:len(head)]``: per hash
        the shared map's block where the writer may hit it, else its side map's, up to the first
        hash neither holds."""
        blocks = self.visible(key, hashes[head.size :], side_key)
        miss = np.flatnonzero(blocks < 0)
        return np.concatenate([head, blocks[: miss[0] if miss.size else blocks.size]]).astype(np.int32)

    def visible(self, key: int, hashes: np.ndarray, side_key: int = NO_CACHE_KEY) -> np.ndarray:
        """Block per hash (or -1, int64) that the writer of ``side_key`` sees, every hash looked up."""
        blocks = self.index.find(key, hashes).astype(np.int64)
        if self.num_unconfirmed and blocks.size:
            found = np.flatnonzero(blocks >= 0)
            blocks[found[self.hidden(blocks[found], side_key)]] = -1
        if side_key and self.index.size_of(side_key):
            miss = np.flatnonzero(blocks < 0)
            blocks[miss] = self.index.find(side_key, hashes[miss])
        return blocks

    def register(self, key: int, hashes: np.ndarray, blocks: np.ndarray, side_key: int = NO_CACHE_KEY,
                 runs: Runs | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """Put full blocks in shared map ``key`` under their hashes: confirmed at once (``side_key``
        0), or unconfirmed by the writer of ``side_key``, whose copies of hashes another writer's
        unconfirmed entry holds go into its side map. Returns which of the given blocks it stored:
        (mask in the shared map, mask in the side map), or ALL_SHARED when it stored every one in
        the shared map (the usual case: no mask to build). A hash the writer already sees keeps its
        block, and a block already cached keeps its hash (forks share blocks, and each sharer may
        register them): such entries are dropped. A confirmed entry replaces an unconfirmed one.
        ``runs``: the blocks' requests and parents (kvd.runs), for the KV events of what is
        stored confirmed."""
        n = blocks.size
        if not n:
            return _NO_MASK, _NO_MASK
        if self._register_new(key, hashes, blocks, side_key, runs):  # it also declines cached blocks
            return ALL_SHARED
        uncached = self.cache_key[blocks] == NO_CACHE_KEY
        if not uncached.all():
            idx = np.flatnonzero(uncached)
            in_main, in_side = np.zeros(n, bool), np.zeros(n, bool)
            if idx.size:
                sub = self.register(key, hashes[idx], blocks[idx], side_key, None if runs is None else runs.take(idx))
                in_main[idx], in_side[idx] = (True, False) if sub is ALL_SHARED else sub
            return in_main, in_side
        return self._register_each(key, hashes, blocks, side_key, runs)

    def _register_new(self, key: int, hashes: np.ndarray, blocks: np.ndarray, side_key: int,
                      runs: Runs | None) -> bool:
        """``register`` when every block is uncached and goes into the shared map (no hash held,
        no hash or block repeated, no side map to consult); False, having changed nothing, otherwise."""
        if side_key and self.index.size_of(side_key) or self.index.insert_new(key, hashes, blocks) >= 0:
            return False
        self.known_keys.add(key)
        self._mark_unconfirmed(blocks, side_key)
        if not side_key:
            self.log_stored(key, hashes, runs)
        return True

    def _register_each(self, key, hashes, blocks, side_key, runs):
        self.known_keys.add(key)
        index = self.index
        in_main, in_side = np.zeros(blocks.size, bool), np.zeros(blocks.size, bool)
        blocks = np.ascontiguousarray(blocks, np.int32)
        i = index.insert_each(key, side_key, hashes, blocks, self.unconfirmed_by, in_main, in_side)
        while i >= 0:  # a confirmed registration replaces an unconfirmed entry (rare: not compiled)
            self._forget(np.array([index.get_at(key, hashes, i)], np.int32))
            index.insert_one(key, hashes, i, int(blocks[i]))
            in_main[i] = True
            i = index.insert_each(key, side_key, hashes, blocks, self.unconfirmed_by, in_main, in_side, i + 1)
        if in_side.any():
            self.known_keys.add(side_key)
        dup = ~(in_main | in_side) & (self.cache_key[blocks] == NO_CACHE_KEY)
        if dup.any():  # not cached, but its request's chain goes through it (kvd.runs: parents)
            self.block_hash[blocks[dup]] = hashes[dup]
        self._mark_unconfirmed(blocks[in_main], side_key)
        self._mark_unconfirmed(blocks[in_side], side_key)
        if not side_key and in_main.any():
            self.log_stored(key, hashes[in_main], None if runs is None else runs.take(in_main))
        return in_main, in_side

    def _mark_unconfirmed(self, blocks: np.ndarray, side_key: int) -> None:
        if side_key and blocks.size:
            self.unconfirmed_by[blocks] = side_key
            self.num_unconfirmed += blocks.size

    def log_stored(self, key: int, hashes: np.ndarray, runs: Runs | None = None) -> None:
        """Record blocks stored (confirmed) under shared map ``key``, in chain order: with ``runs``
        (kvd.runs: their requests and parents) one ("runs", key, hashes, runs) entry that the
        publisher turns into one event per request run, else one ("stored", key, hashes) entry."""
        if self.event_log is None or key in self.side_of or not hashes.size:
            return
        if runs is None:
            self.event_log.append(("stored", key, hashes.tolist()))
        else:
            self.event_log.append(("runs", key, hashes, runs))

    def confirm(self, blocks: np.ndarray) -> None:
        """Unconfirmed shared entries become visible to all (their KV events are the caller's)."""
        self.unconfirmed_by[blocks] = 0
        self.num_unconfirmed -= blocks.size

    def promote(self, side_key: int, blocks: np.ndarray) -> np.ndarray:
        """Move confirmed side entries (all still in the side map) into its shared map. A hash the
        shared map holds confirmed keeps that block: the side copy stops being cached (a free one
        goes to the front of the free queue, like any uncached block); an unconfirmed one gives way
        to the side copy. Returns which of ``blocks`` moved (their KV events are the caller's)."""
        key = self.side_of[side_key]
        self.index.remove(blocks)  # out of the side map
        self.confirm(blocks)
        hashes = self.block_hash[blocks]
        old = self.index.find(key, hashes)
        held = old >= 0
        unconfirmed = np.zeros(blocks.size, bool)
        unconfirmed[held] = self.unconfirmed_by[old[held]] != 0
        keep = ~held | unconfirmed
        self._forget(old[unconfirmed])
        self.cache_key[blocks] = NO_CACHE_KEY  # (out of the index already)
        self._forget(blocks[~keep])
        moved = blocks[keep]
        if moved.size:
            self.known_keys.add(key)
            stored = self.index.insert_new(key, hashes[keep], moved)
            assert stored < 0, "a side map holds each hash once, and the shared map gave way"
        return keep

    def cached_in(self, key: int, hashes: np.ndarray) -> np.ndarray:
        """Block per hash (or -1) that registrations into ``key`` (a shared map, or a writer's side
        key) would find: what swapped-in content may reuse."""
        shared = self.side_of.get(key)
        if shared is None:
            return self.visible(key, hashes)
        return self.visible(shared, hashes, key)

    def _forget(self, blocks: np.ndarray) -> None:
        """Uncache blocks no map holds any more; free ones leave their eviction queue."""
        if not blocks.size:
            return
        self.index.remove(blocks)
        self.cache_key[blocks] = NO_CACHE_KEY
        self._forget_unconfirmed(blocks)
        free = blocks[self.ref_cnt[blocks] == 0]
        if free.size:
            self._dequeue(free)
            self._push_fresh(free)

    def reset_cache(self, keys: set[int] | None = None, side_keys: set[int] = frozenset()) -> bool:
        """Forget cached hashes (of ``keys`` only, if given; and the shared entries the writers of
        ``side_keys`` have not confirmed) provided no request holds any such block; evictable ones
        become fresh free blocks. Returns whether it reset."""
        cached = np.flatnonzero(self.cache_key != NO_CACHE_KEY)
        if keys is not None:
            chosen = np.isin(self.cache_key[cached], list(keys))
            if side_keys and self.num_unconfirmed:
                chosen |= np.isin(self.unconfirmed_by[cached], list(side_keys))
            cached = cached[chosen]
        if np.any(self.ref_cnt[cached] > 0):
            return False
        # In eviction order, so that pushing them makes the most recently freed the front.
        evictable = self.free_queue_order()[self._stack_top :]
        cached = evictable[np.isin(evictable, cached)]
        # (with ``keys``, another writer's shared map loses only the entries the dropped unconfirmed)
        dropped = set(keys) if keys is not None else set(self.known_keys)
        self.known_keys -= dropped
        if self.event_log is not None:
            self.event_log.extend(("cleared", key, []) for key in sorted(dropped) if key not in self.side_of)
        self.index.remove(cached)
        self.cache_key[cached] = NO_CACHE_KEY
        self._forget_unconfirmed(cached)
        self.queue_pos[cached] = -1
        for queue in self._queues.values():
            queue.live = len(queue.members(self.queue_pos))
        self._num_evictable -= cached.size
        self._push_fresh(cached)
        return True

    # ---------------------------------------------------------------- introspection
    def free_queue_order(self) -> np.ndarray:
        """Every free block, front (next handed out) to back (last evicted)."""
        parts = [self._stack[: self._stack_top][::-1]]
        parts += [self._queues[p].members(self.queue_pos) for p in self._queue_order]
        return np.concatenate(parts)

    def check_invariants(self, heavy: bool = False) -> None:
        """Conservation always; with ``heavy``, every array against every other."""
        assert self.ref_cnt[NULL_BLOCK] == 0 and self.cache_key[NULL_BLOCK] == NO_CACHE_KEY
        assert self._num_evictable == sum(q.live for q in self._queues.values())
        in_use = int(np.count_nonzero(self.ref_cnt))
        assert self._stack_top + self._num_evictable + in_use == self.num_blocks - 1, (
            self._stack_top,
            self._num_evictable,
            in_use,
        )
        if not heavy:
            return
        free = self.free_queue_order()
        assert np.unique(free).size == free.size
        assert NULL_BLOCK not in free
        assert np.all(self.ref_cnt[free] == 0)
        stack = self._stack[: self._stack_top]
        assert np.all(self.cache_key[stack] == NO_CACHE_KEY)
        evictable = free[self._stack_top :]
        assert np.all(self.cache_key[evictable] != NO_CACHE_KEY)
        for prio in self._queue_order:
            members = self._queues[prio].members(self.queue_pos)
            assert members.size == self._queues[prio].live
            assert np.all(self.evict_prio[members] == prio)
        in_queue = np.flatnonzero(self.queue_pos >= 0)
        assert np.array_equal(np.sort(in_queue), np.sort(evictable))
        cached = np.flatnonzero(self.cache_key)
        if self.index is None:
            assert not cached.size, "a pool without a prefix cache caches nothing"
            return
        self.index.check()
        entries = set(zip(self.cache_key[cached].tolist(), self.block_hash[cached].tolist()))
        assert len(entries) == cached.size, "a map holds one block per hash"
        assert set(self.cache_key[cached].tolist()) <= self.known_keys
        for key, b in zip(self.cache_key[cached].tolist(), cached.tolist()):
            if key in self.side_of:
                assert self.unconfirmed_by[b] == key, "a side entry is its writer's, unconfirmed"
            elif self.unconfirmed_by[b]:
                assert self.side_of.get(int(self.unconfirmed_by[b])) == key
        assert not np.any(self.unconfirmed_by[self.cache_key == NO_CACHE_KEY])
        assert self.num_unconfirmed == np.count_nonzero(self.unconfirmed_by)
