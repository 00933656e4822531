"""The appends of a pool with several KV-cache groups or a sliding window
(``BlockManager._append_fast_groups``: each group planned in a compiled loop, all applied or none)
against the request-by-request path it replaces: seeded random runs of admissions with each group's
prompt hashes, forks (copy-on-write), frees, confirmations and steps that append tokens with each
group's filled-block hashes (now and then with frees beside them, a repeated row or counts that do
not add up), on pools small enough to evict and to refuse, applied to two managers, must leave both
in the same state after every step (every group's table, skip and registered counts, the free queue
and the prefix cache, block ids included) and give the same results."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import numpy as np
import pytest

import kvd.manager as M
from kvd import errors
from kvd.api import AdmitRequest, GroupSpec, ManagerConfig, StepBatch
from kvd.hashing import hash_prompt
from kvd.manager import BlockManager

CONFIGS = {
    "full+window": (GroupSpec(4), GroupSpec(4, sliding_window=8)),
    "two sizes": (GroupSpec(4), GroupSpec(8, sliding_window=16)),
    "two full": (GroupSpec(4), GroupSpec(8)),
    "one window": (GroupSpec(4, sliding_window=12),),
}


@contextmanager
def _request_by_request():
    M._GROUPS_FAST_PATH = False
    try:
        yield
    finally:
        M._GROUPS_FAST_PATH = True


def _manager(groups, blocks: int, defer: bool = False) -> BlockManager:
    return BlockManager(ManagerConfig(num_gpu_blocks=blocks, groups=groups, max_model_len=96, max_num_reqs=12,
                                      defer_cache_registration=defer))



def _state(m: BlockManager):
    p = m.pool
    groups = [(g.table.tobytes(), g.num_blocks.tobytes(), g.last_block.tobytes(), g.num_registered.tobytes(),
               g.num_skipped.tobytes()) for g in m.groups]
    return (p.ref_cnt.tobytes(), p.cache_key.tobytes(), p.block_hash.tobytes(), p.free_queue_order().tobytes(),
            copy.deepcopy(p.caches), groups, m.num_tokens.tobytes(), dict(m._row_of), m.tick, dict(m.counters))


_RESULT_FIELDS = ("free_status", "fork_status", "append_status", "admit_status", "admit_rows", "admit_cached_tokens",
                  "copies", "sched_rows", "sched_start", "sched_len", "freed_rows", "tick")


def _tables(m: BlockManager) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(g.table.copy(), g.num_blocks.copy()) for g in m.groups]


def _rows_changed(m: BlockManager, before) -> set[int]:
    """The live rows whose table or block count (any group) differs from ``before``."""
    moved = np.zeros(m.num_tokens.size, bool)
    for (t, n), g in zip(before, m.groups):
        moved |= (t != g.table).any(axis=1) | (n != g.num_blocks)
    return set(np.flatnonzero(moved & m.active).tolist())


class _Run:
    """``entry``: "step" (both managers step; the fast one takes the several-groups path inside the
    general step) or "decode_rows" (the fast one's decode steps go to ``decode_rows`` first, which
    defers registration, as the daemon does; it declines to ``step``)."""

    def __init__(self, seed: int, groups, blocks: int, entry: str = "step", writer: int = 0):
        self.rng = np.random.default_rng(seed)
        self.groups = groups
        self.entry = entry
        self.writer = writer  # not 0: its registrations wait for its confirmations (a daemon session's)
        defer = entry == "decode_rows"
        self.fast, self.slow = _manager(groups, blocks, defer), _manager(groups, blocks, defer)
        self.prefix = self.rng.integers(1, 300, 24).astype(np.int32)
        self.tokens: dict[str, np.ndarray] = {}
        self.registered: dict[str, list[int]] = {}
        self.n = 0
        self.taken = 0  # steps whose appends the several-groups path took whole
        self.pending = 0  # decode_rows calls made while deferred work waited

        real = self.fast._append_fast_groups

        def counted(*a, **k):
            out = real(*a, **k)
            self.taken += out is not None
            return out
        self.fast._append_fast_groups = counted

    def hashes(self, tokens: np.ndarray, start: list[int]) -> list[np.ndarray]:
        return [hash_prompt(tokens, g.block_size)[s:] for g, s in zip(self.groups, start)]

    def step(self, batch: StepBatch):
        """The step on both managers: the same result, or the same error. Changed rows: the
        request-by-request path names every row it scheduled, the fast one the rows whose tables
        changed (grown, copied on write, slid), which must be every one whose table did."""
        before = _tables(self.fast)
        try:
            a = self._fast_step(batch)
        except errors.KvdError as e:
            a = e
        with _request_by_request():
            try:
                b = self.slow.step(batch, writer=self.writer)
            except errors.KvdError as e:
                b = e
        if isinstance(b, Exception):
            assert type(a) is type(b), (a, b)
            return None
        assert not isinstance(a, Exception), a
        for f in _RESULT_FIELDS:
            assert np.array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f))), f
        changed = set(np.asarray(a.changed_rows).tolist())
        assert _rows_changed(self.fast, before) <= changed <= set(np.asarray(b.changed_rows).tolist())
        return a

    def _fast_step(self, batch: StepBatch):
        m = self.fast
        rows, n_new = batch.append_rows, batch.append_num_tokens
        if self.entry == "decode_rows" and rows is not None and not len(batch.free) and type(n_new) is int:
            self.pending += bool(m.num_deferred)  # it goes on top of deferred work
            hashes = (tuple(batch.append_hashes), tuple(batch.append_hash_counts)) if len(batch.append_hashes) else (None, None)
            out = m.decode_rows(rows, n_new, batch.num_lookahead_tokens, *hashes)
            if out is not None:
                old, changed, copies = out
                return M.StepResult(free_status=M._EMPTY_I16, fork_status=M._EMPTY_I16,
                                    append_status=np.zeros(rows.size, np.int16), admit_status=M._EMPTY_I16,
                                    admit_rows=M._EMPTY_I32, admit_cached_tokens=M._EMPTY_I64, copies=copies,
                                    changed_rows=changed, sched_rows=rows, sched_start=old.astype(np.int32),
                                    sched_len=np.full(rows.size, n_new, np.int32), freed_rows=M._EMPTY_I32,
                                    tick=m.tick)
        return m.step(batch, writer=self.writer)

    def admit(self) -> None:
        reqs = []
        for _ in range(int(self.rng.integers(1, 3))):
            rid = f"r{self.n}"
            self.n += 1
            p = np.concatenate([self.prefix[: int(self.rng.integers(0, 25))],
                                self.rng.integers(1, 300, int(self.rng.integers(1, 14))).astype(np.int32)])
            self.tokens[rid] = p
            self.registered[rid] = [p.size // g.block_size for g in self.groups]
            reqs.append(AdmitRequest(rid, p.size, self.hashes(p, [0] * len(self.groups))))
        res = self.step(StepBatch(admit=reqs))
        for r, st in zip(reqs, res.admit_status.tolist()):
            if st:
                del self.tokens[r.req_id], self.registered[r.req_id]

    def fork(self) -> None:
        if not self.tokens:
            return
        parent = list(self.tokens)[int(self.rng.integers(0, len(self.tokens)))]
        child = f"r{self.n}"
        self.n += 1
        res = self.step(StepBatch(forks=[(parent, child)]))
        if res.fork_status.tolist() == [0]:
            self.tokens[child], self.registered[child] = self.tokens[parent].copy(), list(self.registered[parent])

    def free(self) -> list[str]:
        if not self.tokens:
            return []
        rid = list(self.tokens)[int(self.rng.integers(0, len(self.tokens)))]
        del self.tokens[rid], self.registered[rid]
        return [rid]

    def confirm(self) -> None:
        tick = max(self.fast.tick - int(self.rng.integers(0, 3)), 0)  # the forward passes of a step or two run
        self.fast.mark_computed(self.writer, tick)
        self.slow.mark_computed(self.writer, tick)

    def decode(self) -> None:
        frees = self.free() if self.rng.random() < 0.2 else []
        rids = [r for r in self.tokens if self.rng.random() < 0.8] or list(self.tokens)[:1]
        if not rids:
            return
        n_new = int(self.rng.choice([0, 1, 1, 1, 2, 5]))
        per_row = self.rng.random() < 0.2  # one count per request
        counts_new = self.rng.choice([0, 1, 1, 3], len(rids)) if per_row else np.full(len(rids), n_new)
        lookahead = int(self.rng.choice([0, 0, 1, 3]))
        new_tokens = {r: self.rng.integers(1, 300, int(k)).astype(np.int32) for r, k in zip(rids, counts_new)}
        G = len(self.groups)
        hashes, counts = [[] for _ in range(G)], [[] for _ in range(G)]
        for r in rids:
            for g, h in enumerate(self.hashes(np.concatenate([self.tokens[r], new_tokens[r]]), self.registered[r])):
                hashes[g].append(h)
                counts[g].append(h.size)
        rows = self.fast.rows_of(rids)
        assert np.array_equal(rows, self.slow.rows_of(rids))
        if self.rng.random() < 0.05 and len(rids) > 1:
            rows = np.append(rows, rows[0]).astype(np.int32)  # a repeated row: its status says so
            for c in counts:
                c.append(0)
        hs = tuple(np.concatenate(h) if h else np.empty(0, "S16") for h in hashes)
        cnt = tuple(np.array(c, np.int32) for c in counts)
        if self.rng.random() < 0.05 and cnt[0].size:
            cnt[0][0] += 1  # counts that do not add up to the hashes: both refuse the step
        with_hashes = any(h.size for h in hs) or self.rng.random() < 0.5
        n_arg = counts_new[: rows.size].tolist() + [0] * (rows.size - len(rids)) if per_row else n_new
        res = self.step(StepBatch(free=frees, append_rows=rows, append_num_tokens=n_arg, num_lookahead_tokens=lookahead,
                                  append_hashes=hs if with_hashes else (), append_hash_counts=cnt if with_hashes else ()))
        if res is None:
            return
        for r, st, i in zip(rids, res.append_status.tolist(), range(len(rids))):
            if st == 0:
                self.tokens[r] = np.concatenate([self.tokens[r], new_tokens[r]])
                if with_hashes:
                    self.registered[r] = [reg + c[i] for reg, c in zip(self.registered[r], counts)]


@pytest.mark.parametrize("entry", ["step", "decode_rows"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", range(6))
def test_the_several_groups_path_does_what_the_request_by_request_path_does(name, seed, entry):
    # (odd seeds step as writer 1: registrations unconfirmed until its confirmations, as a daemon's sessions)
    run = _Run(seed, CONFIGS[name], blocks=48 if entry == "step" else 64, entry=entry, writer=seed % 2)
    ops = [run.admit, run.admit, run.fork, run.confirm, *[run.decode] * (4 if entry == "step" else 8)]
    for _ in range(120):
        ops[int(run.rng.integers(0, len(ops)))]()
        run.fast.check_invariants(heavy=True)
        if entry == "decode_rows":  # now and then the deferred work runs (between, it piles up)
            if run.rng.random() > 0.2:
                continue
            for m in (run.fast, run.slow):
                m.flush_deferred()
        assert _state(run.fast) == _state(run.slow)
    for m in (run.fast, run.slow):
        m.flush_deferred()
        m.check_invariants(heavy=True)
    assert _state(run.fast) == _state(run.slow)
    assert run.taken >= 5, run.taken
    assert run.fast.pool.num_evictions, "the pool never evicted: a run too small to test the order of takes"


def test_a_deferred_registration_runs_before_its_block_slides_out_of_the_window():
    """decode_rows defers a step's registration; a later decode_rows whose window releases that
    block runs it first, so the block parks as cached, as on the general path (which registers at
    once). Both managers' state after every step, without flushing the deferring one."""
    groups = (GroupSpec(4), GroupSpec(4, sliding_window=4))  # a one-block window: it slides every block
    fast, slow = _manager(groups, 32, defer=True), _manager(groups, 32, defer=True)
    prompt = np.arange(1, 4, dtype=np.int32)
    for m in (fast, slow):
        assert m.step(StepBatch(admit=[AdmitRequest("r", 3, [np.empty(0, "S16")] * 2)])).admit_status.tolist() == [0]
        m.flush_deferred()  # (the admission's own)
    rows = fast.rows_of(["r"])
    tokens = prompt
    for k in range(6):
        tokens = np.append(tokens, 10 + k).astype(np.int32)
        filled = tokens.size % 4 == 0
        hs = tuple(hash_prompt(tokens, 4)[-1:] if filled else np.empty(0, "S16") for _ in groups)
        cnt = tuple(np.array([int(filled)], np.int32) for _ in groups)
        out = fast.decode_rows(rows, 1, 0, hs, cnt)
        assert out is not None
        with _request_by_request():
            slow.step(StepBatch(append_rows=rows, append_num_tokens=1, append_hashes=hs, append_hash_counts=cnt))
        if k == 0:  # block 0 filled: its registration waits
            assert fast.num_deferred == 2  # one item per group
        if k < 4:
            continue
        # (k = 4: block 0 slid out of the window, its deferred registration ran first)
        assert fast.num_deferred == 0 and _state(fast) == _state(slow)
    assert int(fast.groups[1].num_skipped[rows[0]]) >= 1


def test_a_deferred_confirmation_runs_before_its_block_slides_out_of_the_window():
    """A writer's registered block waits for its confirmation (deferred, as in a daemon) when the
    window releases it: the confirmation runs first, as on the general path (the order the general
    path has; the deferred work otherwise waits while only confirmed, registered blocks slide)."""
    groups = (GroupSpec(4), GroupSpec(4, sliding_window=4))
    fast, slow = _manager(groups, 32, defer=True), _manager(groups, 32, defer=True)
    for m in (fast, slow):
        m.step(StepBatch(admit=[AdmitRequest("r", 3, [np.empty(0, "S16")] * 2)]), writer=1)
        m.flush_deferred()
    rows = fast.rows_of(["r"])
    tokens = np.arange(1, 4, dtype=np.int32)
    for k in range(6):
        tokens = np.append(tokens, 10 + k).astype(np.int32)
        filled = tokens.size % 4 == 0
        hs = tuple(hash_prompt(tokens, 4)[-1:] if filled else np.empty(0, "S16") for _ in groups)
        cnt = tuple(np.array([int(filled)], np.int32) for _ in groups)
        assert fast.decode_rows(rows, 1, 0, hs, cnt) is not None
        with _request_by_request():
            slow.step(StepBatch(append_rows=rows, append_num_tokens=1, append_hashes=hs, append_hash_counts=cnt))
        if k == 0:  # block 0 registered (not yet confirmed: writer 1), then confirmed, deferred
            for m in (fast, slow):
                m.flush_deferred()
                m.mark_computed(1, m.tick)
            assert fast.num_deferred == 1 and fast.pool.unconfirmed_by[fast.groups[1].table[rows[0], 0]]
        if k >= 4:  # (k = 4: block 0 slid out)
            assert fast.num_deferred == 0 and _state(fast) == _state(slow)


@pytest.mark.parametrize("groups", ["full+window", "two full"])
def test_every_row_copies_on_write_in_every_group(groups):
    """All 12 rows of the manager share one request's partly filled last block (a parent and 11
    forks): an append to all of them copies it for 11 rows in each group, more copies in one step
    than rows, which the one compiled call writes group after group. The copies, tables and
    references equal the request-by-request path's."""
    out = []
    for fast in (True, False):
        m = _manager(CONFIGS[groups], 200)
        p = np.arange(1, 7, dtype=np.int32)  # 6 tokens: one full block of 4, a partial one (and of 8: partial)
        m.allocate("p", p.size, [hash_prompt(p, g.block_size) for g in m.groups])
        res = m.step(StepBatch(forks=[("p", f"c{i}") for i in range(11)]))
        assert res.fork_status.tolist() == [0] * 11
        rows = m.rows_of(["p", *[f"c{i}" for i in range(11)]])
        if fast:
            res = m.step(StepBatch(append_rows=rows, append_num_tokens=1))
        else:
            with _request_by_request():
                res = m.step(StepBatch(append_rows=rows, append_num_tokens=1))
        assert res.append_status.tolist() == [0] * 12
        m.check_invariants(heavy=True)
        out.append((res.copies.copy(), _state(m)))
    (copies, state), (want_copies, want_state) = out
    assert copies.shape == (22, 2) and np.array_equal(copies, want_copies)
    assert state == want_state
