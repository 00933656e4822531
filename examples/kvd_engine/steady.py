"""A steady decode batch as arrays: the per-step host work of overlapped decode without a Python
loop per request (but the one that appends each sampled token to its request's output).

In steady decode (every running request decodes, nothing else happens) a step differs from the
last only by one token per request: positions and ``seq_lens`` move by 1, the input ids are the
tokens just sampled, rows, ``query_start_loc`` and the logits rows stay. ``SteadyBatch`` keeps what a
step needs in numpy arrays indexed by the request's row in the forward (its index in ``reqs``):

    rows      int32 [B]   kvd session rows
    pos       int64 [B]   the position the next forward computes (= ``Request.computed``)
    last      int64 [B]   that position's token (the last sampled one)
    left      int64 [B]   tokens still to sample
    nh, reg   int64 [B]   block hashes known / registered in kvd
    sent      int64 [B]   hashes taken into a message whose reply has not come back (a window's
                          message sent a step early: its next step runs before the reply)
    last_hash S{w}  [B]   the newest known block hash (the parent of the next one)
    recent    int64 [B, block_size]  the tokens of the block being filled, column position % block_size

so the blocks a step fills are hashed in one ``hash_next_blocks`` call from ``recent`` and
``last_hash``. Filled blocks queue; with ``register_every`` k > 1 a message k or more after the
last that registered some registers every queued block hashed by then (``prehash`` hashes them
during the forwards; a finishing request's go with its last message): the other messages carry no
hash, and an engine writes such a message as little more than a sequence number (``kvd.mailbox``),
while the blocks become hits for other engines about k messages later. With k = 1, ``cap`` of them
are hashed and registered per message, more
where needed to register every queued block by its request's last message at an even rate (earliest
deadline first; a finishing request's all at once): a batch that fills its blocks in lockstep (equal
prompt lengths) would otherwise put every request's hash and registration into one step's message,
longer than the forward it should hide behind, and finishing together, into its last one. An
engine that waits for its GPU after taking a reply moves the hashing out of the message's planning:
``prehash`` hashes, while the forward runs, what the next message registers (where it did not run,
the next message hashes as above). The ``Request`` objects stay the truth for everything else in the engine, with one
exception: the hashes computed here are appended to ``Request.hashes`` only by :meth:`flush`
(``Engine`` flushes before any step that is not a steady one, and when requests leave the batch),
because a concatenation per request and block would cost more than the hashing. ``output``,
``computed`` and ``registered`` are updated as they change.
"""

from __future__ import annotations

from itertools import count

import numpy as np

_stamps = count(1)


class SteadyBatch:
    """The arrays of one steady decode batch (see the module docstring)."""

    def __init__(self, reqs, rows: np.ndarray, block_size: int, hashes_dtype: str, per_message: int = 1,
                 register_every: int = 1):
        self.bs = block_size
        self.per_message = per_message  # steps a message covers (the engine's multi-step windows)
        # messages per registering one (see ``take``); messages since the last that registered
        self.register_every = register_every
        self.since_registered = 0
        self.reqs = list(reqs)
        self.rids = [r.rid for r in self.reqs]
        self.rows = np.ascontiguousarray(rows, np.int32)
        n = len(self.reqs)
        self.pos = np.fromiter((r.computed for r in self.reqs), np.int64, n)
        self.last = np.fromiter((r.output[-1] for r in self.reqs), np.int64, n)
        self.left = np.fromiter((r.max_new_tokens - len(r.output) for r in self.reqs), np.int64, n)
        self.nh = np.fromiter((len(r.hashes) for r in self.reqs), np.int64, n)
        self.reg = np.fromiter((r.registered for r in self.reqs), np.int64, n)
        self.sent = np.zeros(n, np.int64)
        self.last_hash = np.zeros(n, hashes_dtype)
        has = self.nh > 0
        if has.any():
            self.last_hash[has] = [r.hashes[-1] for r, h in zip(self.reqs, has) if h]
        self.recent = np.zeros((n, block_size), np.int64)
        for i, r in enumerate(self.reqs):  # the tokens of the block each request is filling
            base = r.computed - r.computed % block_size
            self.recent[i, :r.computed - base + 1] = r.tokens(base, r.computed - base + 1)
        self.forced = any(r.forced for r in self.reqs)
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []  # (rows, hashes) not in Request.hashes yet
        # filled blocks waiting for their hash and registration (FIFO): rows, tokens [Q, block_size]
        self.q_rows = np.zeros(0, np.int64)
        self.q_tokens = np.zeros((0, block_size), np.int64)
        # a queued block's hash computed ahead (``prehash``): its value, whether computed
        self.q_hash = np.zeros(0, hashes_dtype)
        self.q_hashed = np.zeros(0, bool)
        self.queued = np.zeros(n, np.int64)
        # ``prehash`` ran since the last ``take``: the next message registers what it hashed
        self.prehashed_since_take = False
        self._layout()

    def __len__(self) -> int:
        return len(self.reqs)

    def _layout(self) -> None:
        n = len(self.reqs)
        self.keep = np.arange(n, dtype=np.int64)  # every row samples; also each token's request
        self.qsl = np.arange(n + 1, dtype=np.int32)
        self.stamp = next(_stamps)  # a new layout: a graph bucket staged with another stages it all
        # blocks registered per message besides a finishing request's: twice the mean fill rate
        # (n / block_size a step, per_message steps a message), so a batch filling its blocks in
        # lockstep spreads their hashing and registration over block_size / 2 steps instead of one
        # long message
        self.cap = max(16, -(-2 * n * self.per_message // self.bs))

    def messages_left(self, left: np.ndarray) -> np.ndarray:
        """Messages a request with ``left`` (>= 1) tokens to sample has, the one sent during this
        forward included: one per step, or with multi-step windows this one and one per window of
        the ``left - 1`` tokens after it."""
        k = self.per_message
        return left if k == 1 else 1 + (left - 1 + k - 1) // k

    # ---- hashing ---------------------------------------------------------------------------------------
    def filled(self) -> np.ndarray | None:
        """Rows whose block the running forward completes (position ``pos`` ends it), or None when
        the hash bookkeeping is not the steady one (a block without hash besides those queued and
        this step's, a hash neither registered nor in flight, a first block with no parent): the
        caller falls back to the generic path."""
        pos1 = self.pos + 1
        fill = pos1 % self.bs == 0
        if not (np.array_equal(pos1 // self.bs - self.nh - self.queued, fill)
                and np.array_equal(self.nh, self.reg + self.sent)):
            return None
        idx = np.flatnonzero(fill)
        if (self.nh[(self.queued > 0) | fill] == 0).any():
            return None
        return idx

    def queue_filled(self) -> bool:
        """Queue the blocks the running forward completes (:meth:`filled`, :meth:`push`); False,
        queuing nothing, when the hash bookkeeping is not the steady one."""
        idx = self.filled()
        if idx is None:
            return False
        if idx.size:
            self.push(idx)
        return True

    def push(self, idx: np.ndarray) -> None:
        """Queue the blocks rows ``idx`` just filled (their tokens are copied out of ``recent``)."""
        self.q_rows = np.concatenate([self.q_rows, idx])
        self.q_tokens = np.concatenate([self.q_tokens, self.recent[idx]])
        self.q_hash = np.concatenate([self.q_hash, np.zeros(idx.size, self.q_hash.dtype)])
        self.q_hashed = np.concatenate([self.q_hashed, np.zeros(idx.size, bool)])
        self.queued[idx] += 1

    def prehash(self, hash_next, stop) -> int:
        """Hash queued blocks before a message takes them (called while this step's forward runs,
        so the next message registers them): ``cap`` in all, or as many as the next message's
        even rate needs (see :meth:`_also_take`), earliest deadline first, each row's oldest only
        (its parent, the row's newest hash, is known), 16 at a time until ``stop()`` (the
        engine: its forward has ended on the GPU). Returns how many it hashed."""
        q = self.q_rows
        self.prehashed_since_take = True
        if not q.size:
            return 0
        left = np.maximum(self.messages_left(np.maximum(self.left[q], 1)) - 1, 1)  # the next message's deadlines
        # registering every few messages: every queued block, hashed over the forwards in between
        want = q.size if self.register_every > 1 else max(self.cap, _even_rate(left))
        room = want - int(np.count_nonzero(self.q_hashed))
        if room <= 0:
            return 0
        _, first = np.unique(q, return_index=True)
        first = first[~self.q_hashed[first]]
        first = first[np.lexsort((first, left[first]))][:room]
        done = 0
        for i in range(0, first.size, 16):
            if stop():
                break
            at = first[i:i + 16]
            self.q_hash[at] = hash_next(self.q_tokens[at], self.last_hash[q[at]])
            self.q_hashed[at] = True
            done += at.size
        return done

    def take(self, must: np.ndarray, hash_next) -> tuple[np.ndarray, list[np.ndarray]]:
        """Hash the queued blocks this step registers: every block of the rows where ``must``, and
        those of :meth:`_also_take` on a message ``register_every`` or more after the last that
        registered some. Returns (rows, hashes of each row in chain order);
        ``hash_next(tokens, parents)`` is the client's ``hash_next_blocks``."""
        q = self.q_rows
        prehashed, self.prehashed_since_take = self.prehashed_since_take, False
        due = self.since_registered + 1 >= self.register_every
        if not q.size:
            self.since_registered += 1
            return q, []
        sel = must[q]
        if due:
            sel[self._also_take(q, sel, prehashed)] = True
        # registering every few messages: counted from the last message that registered queued blocks
        self.since_registered = 0 if due and sel.any() else self.since_registered + 1
        rows, tokens, pre, hashed = q[sel], self.q_tokens[sel], self.q_hash[sel], self.q_hashed[sel]
        self.q_rows, self.q_tokens = q[~sel], self.q_tokens[~sel]
        self.q_hash, self.q_hashed = self.q_hash[~sel], self.q_hashed[~sel]
        out: dict[int, list] = {}
        while rows.size:  # a row queued twice: its second block chains on its first
            _, first = np.unique(rows, return_index=True)
            now = np.zeros(rows.shape[0], bool)
            now[first] = True
            r = rows[now]
            new, miss = pre[now], ~hashed[now]  # a prehashed block is its row's oldest: in ``now``
            if miss.any():
                new[miss] = hash_next(tokens[now][miss], self.last_hash[r[miss]])
            self.last_hash[r] = new
            self.nh[r] += 1
            self.sent[r] += 1
            self.queued[r] -= 1
            self.pending.append((r, new))
            for i, h in zip(r.tolist(), new):
                out.setdefault(i, []).append(h)
            rows, tokens, pre, hashed = rows[~now], tokens[~now], pre[~now], hashed[~now]
        done = np.fromiter(out, np.int64, len(out))
        return done, [out[i] for i in done.tolist()]

    def _also_take(self, q: np.ndarray, sel: np.ndarray, prehashed: bool) -> np.ndarray:
        """Indices into the queue of the blocks registered now besides ``sel``. ``prehashed`` (a
        prehash ran since the last message): the prehashed ones (``prehash`` keeps up with the
        deadlines; a finishing row's ``must`` catches what it could not; registering every few
        messages, a due message finds none when its own forward filled the blocks, and the next,
        due still, takes them). Without a prehash, registering every few messages: every queued
        block, hashed now; else ``cap``, or more where an even rate is needed for every queued
        block to register by its request's last message (a request with ``left`` tokens to sample
        has ``left`` messages, this one included; with multi-step windows :meth:`messages_left`),
        earliest deadline first, oldest first among equals."""
        rest = np.flatnonzero(~sel)
        if prehashed or not rest.size:
            return rest[self.q_hashed[rest]]
        if self.register_every > 1:
            return rest
        left = np.where(sel, 1, self.messages_left(np.maximum(self.left[q], 1)))
        k = max(self.cap, _even_rate(left) - int(np.count_nonzero(sel)))
        return rest[np.argsort(left[rest], kind="stable")[:k]]

    def flush(self) -> None:
        """Append the hashes computed here to their requests' ``hashes`` (queued blocks not hashed
        yet are left to the generic path, which hashes what is missing)."""
        if not self.pending:
            return
        extra: dict[int, list] = {}
        for idx, new in self.pending:
            for i, h in zip(idx.tolist(), new):
                extra.setdefault(i, []).append(h)
        self.pending = []
        for i, hs in extra.items():
            r = self.reqs[i]
            r.hashes = np.concatenate([r.hashes, np.array(hs, r.hashes.dtype if len(r.hashes) else hs[0].dtype)])

    # ---- a step ----------------------------------------------------------------------------------------
    def registered(self, order: np.ndarray | None, counts: np.ndarray) -> None:
        """kvd registered ``counts[j]`` more blocks of row ``order[j]`` (``order`` None: every row)."""
        sel = np.arange(len(self.reqs)) if order is None else order
        self.reg[sel] += counts
        self.sent[sel] -= counts
        for i, c in zip(sel[counts > 0].tolist(), counts[counts > 0].tolist()):
            self.reqs[i].registered += c

    def advance(self, toks: np.ndarray) -> None:
        """The forward computed ``pos`` and sampled ``toks`` (int64 [B]), one per row."""
        self.recent[self.keep, (self.pos + 1) % self.bs] = toks
        self.pos += 1
        self.last = toks
        self.left -= 1

    def compact(self, keep: np.ndarray) -> None:
        """Keep only the rows where ``keep`` (bool [B]) is true (requests that finished leave)."""
        self.flush()
        new_index = np.cumsum(keep) - 1
        q = keep[self.q_rows]  # a request leaving had its blocks taken (``must``) at its last step
        self.q_rows, self.q_tokens = new_index[self.q_rows[q]], self.q_tokens[q]
        self.q_hash, self.q_hashed = self.q_hash[q], self.q_hashed[q]
        self.reqs = [r for r, k in zip(self.reqs, keep.tolist()) if k]
        self.rids = [r.rid for r in self.reqs]
        for name in ("rows", "pos", "last", "left", "nh", "reg", "sent", "last_hash", "recent", "queued"):
            setattr(self, name, getattr(self, name)[keep])
        self._layout()


def _even_rate(deadlines: np.ndarray) -> int:
    """The fewest blocks a message must register, the same number every message, for each queued
    block (``deadlines``: messages left to it, >= 1) to register by its deadline:
    max over i of ceil((i + 1) / d_i), d sorted."""
    d = np.sort(deadlines)
    return int(np.max(-(-np.arange(1, d.size + 1) // d))) if d.size else 0
