"""Deferring prefix-cache registrations (``ManagerConfig.defer_cache_registration``, the daemon's
setting) changes when they run, not what the cache holds: seeded random runs of two writers'
admissions (lone and batched), decode steps that fill and register blocks, confirmations, lookups,
frees and partial flushes (an idle daemon's slices), applied to a manager that defers and one that
does not, give the same step results, the same lookups and, once the deferred work has run, the
same cache: per map the hashes it holds, each one's confirmation and whether a request holds it,
the free queue's order of cached hashes and uncached blocks, the same KV events (stored with their
parents and token ids, removed). Which fresh block a step takes may differ (a confirmation that
waits has not yet uncached a free duplicate: the step takes another fresh block), so block ids are
not compared."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kvd.api import AdmitRequest, GroupSpec, ManagerConfig, StepBatch
from kvd.hashing import hash_prompt
from kvd.manager import BlockManager
from kvd.runs import expand

BS = 4
FIELDS = ("free_status", "append_status", "admit_status", "admit_rows", "admit_cached_tokens", "changed_rows",
          "sched_rows", "sched_start", "sched_len", "tick")


def _manager(defer: bool, events: bool) -> BlockManager:
    m = BlockManager(ManagerConfig(num_gpu_blocks=40, groups=(GroupSpec(BS),), max_model_len=64, max_num_reqs=12,
                                   defer_cache_registration=defer))
    m.log = m.enable_kv_events() if events else []  # without events: the compiled registration loops
    return m


def _cache_state(m: BlockManager):
    """The cache without block ids: {key: {hash: (unconfirmed, held)}}, the free queue as cached
    hashes and None for an uncached block, the counts, every request's size and block count."""
    p = m.pool
    cached = np.flatnonzero(p.cache_key)
    maps: dict = {}
    for b in cached.tolist():
        maps.setdefault(int(p.cache_key[b]), {})[bytes(p.block_hash[b])] = (int(p.unconfirmed_by[b]), p.ref_cnt[b] > 0)
    queue = [bytes(p.block_hash[b]) if p.cache_key[b] else None for b in p.free_queue_order().tolist()]
    return (maps, queue, p.num_free, p.num_used, p.num_unconfirmed, m.num_tokens.tobytes(), m.num_blocks[0].tobytes(),
            dict(m.counters))


def _events(m: BlockManager) -> list:
    out = []
    for e in expand(m.log):
        if e[0] == "stored":
            out.append((e[0], e[1], list(e[2]), e[3], None if e[4] is None else e[4].tolist()))
        else:
            out.append((e[0], e[1], sorted(bytes(h) for h in e[2])))
    m.log.clear()
    return out


class _Run:
    """One seeded sequence of calls, each applied to both managers and compared."""

    def __init__(self, seed: int, events: bool = True):
        self.rng = np.random.default_rng(seed)
        self.m = [_manager(True, events), _manager(False, events)]
        # a few shared prefixes, so that admissions hit each other's blocks
        self.prefixes = [self.rng.integers(1, 500, 12).astype(np.int32) for _ in range(3)]
        self.tokens: dict[str, np.ndarray] = {}
        self.writer: dict[str, int] = {}
        self.registered: dict[str, int] = {}
        self.next_id = 0

    def both(self, fn):
        out = [fn(m) for m in self.m]
        return out

    def same_results(self, results) -> None:
        a, b = results
        for f in FIELDS:
            assert np.array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f))), f
        assert a.copies.shape == b.copies.shape

    def new_prompt(self) -> np.ndarray:
        head = self.prefixes[int(self.rng.integers(0, len(self.prefixes)))][: int(self.rng.integers(0, 13))]
        tail = self.rng.integers(1, 500, int(self.rng.integers(1, 10))).astype(np.int32)
        return np.concatenate([head, tail])

    def admit(self, k: int) -> None:
        w = int(self.rng.integers(1, 3))
        reqs = []
        for _ in range(k):
            rid = f"r{self.next_id}"
            self.next_id += 1
            p = self.new_prompt()
            self.tokens[rid], self.writer[rid] = p, w
            reqs.append(AdmitRequest(rid, p.size, hash_prompt(p, BS), token_ids=p.copy()))
        res = self.both(lambda m: m.step(StepBatch(admit=[copy.copy(r) for r in reqs]), writer=w))
        self.same_results(res)
        for r, st in zip(reqs, res[0].admit_status.tolist()):
            if st == 0:
                self.registered[r.req_id] = r.num_tokens // BS
            else:
                del self.tokens[r.req_id], self.writer[r.req_id]

    def decode(self) -> None:
        w = int(self.rng.integers(1, 3))
        rids = [r for r in self.tokens if self.writer[r] == w and self.registered.get(r) is not None]
        if not rids:
            return
        hashes, counts, ids = [], [], []
        for r in rids:
            t = np.append(self.tokens[r], np.int32(self.rng.integers(1, 500)))
            self.tokens[r] = t
            full = t.size // BS
            new = hash_prompt(t, BS)[self.registered[r]: full]
            hashes.append(new)
            counts.append(new.size)
            ids.append(t[self.registered[r] * BS: full * BS])
        batch = dict(append_rows=None, append_num_tokens=1, append_hashes=(np.concatenate(hashes),),
                     append_hash_counts=(np.array(counts, np.int32),), append_token_ids=(np.concatenate(ids),))
        if not sum(counts) or self.rng.random() < 0.3:  # a step that registers nothing: the decode fast path
            batch.update(append_hashes=(), append_hash_counts=(), append_token_ids=())
            counts = [0] * len(rids)
        res = self.both(lambda m: m.step(StepBatch(**{**batch, "append_rows": m.rows_of(rids)}), writer=w))
        self.same_results(res)
        for r, st, c in zip(rids, res[0].append_status.tolist(), counts):
            if st == 0:
                self.registered[r] += c
            else:
                self.tokens[r] = self.tokens[r][:-1]

    def free(self) -> None:
        if not self.tokens:
            return
        rid = list(self.tokens)[int(self.rng.integers(0, len(self.tokens)))]
        self.same_results(self.both(lambda m: m.step(StepBatch(free=[rid]))))
        del self.tokens[rid], self.writer[rid], self.registered[rid]

    def confirm(self) -> None:
        w = int(self.rng.integers(1, 3))
        tick = int(self.rng.integers(0, self.m[0].tick + 1))
        self.both(lambda m: m.mark_computed(w, tick))

    def lookup(self) -> None:
        p, w = self.new_prompt(), int(self.rng.integers(0, 3))
        got = self.both(lambda m: m.lookup(hash_prompt(p, BS), writer=w))
        assert got[0] == got[1]

    def partial_flush(self) -> None:
        """An idle daemon's slice: about that many requests' registrations, the rest kept in order."""
        self.m[0].flush_deferred(int(self.rng.integers(1, 4)))

    def settle(self) -> None:
        self.m[0].flush_deferred()
        assert self.m[0].num_deferred == 0
        assert _cache_state(self.m[0]) == _cache_state(self.m[1])
        assert _events(self.m[0]) == _events(self.m[1])


@pytest.mark.parametrize("events", [True, False])
@pytest.mark.parametrize("seed", range(16))
def test_a_manager_that_defers_registrations_behaves_as_one_that_does_not(seed, events):
    run = _Run(seed, events)
    ops = [lambda: run.admit(1), lambda: run.admit(1), lambda: run.admit(int(run.rng.integers(2, 4))),
           run.decode, run.decode, run.decode, run.free, run.confirm, run.lookup, run.partial_flush]
    waited = 0  # calls after which work waited: the run exercised deferral
    for i in range(60):
        ops[int(run.rng.integers(0, len(ops)))]()
        waited += run.m[0].num_deferred > 0
        if i % 7 == 6:
            run.settle()
    run.settle()
    deferred = run.m[0]
    assert waited and deferred.stats() == run.m[1].stats()
    deferred.check_invariants(heavy=True)


def test_a_deferred_registering_decode_step_queues_behind_the_waiting_confirmations(monkeypatch):
    """With registrations deferred, a decode step that registers a filled block neither promotes
    the confirmations still waiting for a flush nor runs the registrations queued before it: its
    own registration queues behind them, and the flush runs all of it in order."""
    import kvd.manager

    monkeypatch.setattr(kvd.manager, "PROMOTE_BATCH", 2)  # a flush promotes two blocks at most
    m = _manager(defer=True, events=False)
    toks = np.arange(1, 41, dtype=np.int32)
    res = m.step(StepBatch(admit=[AdmitRequest("a", 15, hash_prompt(toks[:15], BS))]), writer=1)
    rows = res.admit_rows.astype(np.int32)
    m.flush_deferred()  # three full blocks registered, unconfirmed
    m.step(StepBatch(append_rows=rows, append_num_tokens=1, computed_through=m.tick), writer=1)
    m.flush_deferred()  # the confirmation promotes two blocks; the third waits
    assert (m.num_deferred, m.pool.num_unconfirmed) == (1, 1)
    filled = hash_prompt(toks[:16], BS)[3:]
    m.step(StepBatch(append_rows=rows, append_num_tokens=1, append_hashes=(filled,),
                     append_hash_counts=(np.ones(1, np.int32),)), writer=1)
    assert (m.num_deferred, m.pool.num_unconfirmed) == (2, 1)  # nothing ran: the waiting one, then the registration
    m.flush_deferred()
    assert (m.num_deferred, m.pool.num_unconfirmed) == (0, 1)  # the admission's last block confirmed, the new one not
    assert m.lookup(hash_prompt(toks[:16], BS), writer=2) == 3
    assert m.lookup(hash_prompt(toks[:16], BS), writer=1) == 4
    m.check_invariants(heavy=True)


@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("entry", ["step", "decode_rows"])
def test_a_registration_running_ahead_of_a_deferred_one_is_refused_as_without_deferral(window, entry):
    """A decode step registers a row's one full block (deferred: num_registered has not moved);
    the next registers another block of that row with no full block left: BadHashes (the fast
    entry refuses, and the step then reports it) whether or not the first registration ran, as
    without deferral. Groups: one, or full attention and a sliding window."""
    groups = (GroupSpec(BS), GroupSpec(BS, sliding_window=8)) if window else (GroupSpec(BS),)
    told = []
    for defer in (False, True):
        m = BlockManager(ManagerConfig(num_gpu_blocks=40, groups=groups, max_model_len=64, max_num_reqs=4,
                                       defer_cache_registration=defer))
        m.allocate("a", 3)
        rows = np.array([m.row_of("a")], np.int32)
        out = []
        for step, n in enumerate([2, 1]):  # 5 tokens (one full block, one hash due), then 6 (none due)
            h = np.frombuffer(bytes([step + 1]) * m.hash_width, m.hash_dtype)
            hashes, counts = [h] * len(groups), [np.array([1], np.int32)] * len(groups)
            if entry == "decode_rows":
                one = len(groups) == 1
                took = m.decode_rows(rows, n, 0, hashes[0] if one else tuple(hashes),
                                     counts[0] if one else tuple(counts))
                out.append(took is not None)
                if took is not None:
                    continue
            res = m.step(StepBatch(append_rows=rows, append_num_tokens=n, append_hashes=hashes,
                                   append_hash_counts=counts))
            out.append(res.append_status.tolist())
        m.flush_deferred()
        assert [int(g.num_registered[rows[0]]) for g in m.groups] == [1] * len(groups)
        m.check_invariants(heavy=True)
        told.append(out)
    assert told[0] == told[1]
    assert told[1] == ([True, False, [20]] if entry == "decode_rows" else [[0], [20]])
