"""Model-based test of the computed state: several writers of one namespace against a list model.

The model keeps one shared map whose entries are confirmed or unconfirmed by one writer, one side
map per writer (its copies of hashes another writer's unconfirmed entry held), the registration
each cached block was last stored by, and each writer's confirmation queue; requests admit (one by
one or in a step), grow, fork, free; writers confirm any tick up to now and go away. After every rule
the manager and the model agree on every reference count, the whole free-queue order, every map
(and who each shared entry awaits), every block table, and what each writer's lookup finds.
"""

from collections import deque

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule

from kvd.api import STATUS_NO_SPACE, STATUS_OK, AdmitRequest, GroupSpec, ManagerConfig, StepBatch
from kvd.hashing import hash_prompt
from kvd.manager import BlockManager
from machine_settings import machine_settings

BS = 4
NUM_BLOCKS = 10
MAX_LEN = 40
MAX_REQS = 6
WRITERS = (0, 1, 2)
SHARED = "S"


def cdiv(a, b):
    return -(-a // b)


class Pool:
    """Free queue as lists (fresh blocks front-inserted, cached ones appended), the maps."""

    def __init__(self):
        self.ref = [0] * NUM_BLOCKS
        self.where = [None] * NUM_BLOCKS  # (map, hash) of a cached block
        self.unconf = [0] * NUM_BLOCKS  # writer whose confirmation a cached block awaits
        self.reg = [0] * NUM_BLOCKS  # registration that cached it unconfirmed
        self.fresh = list(range(1, NUM_BLOCKS))
        self.evict: list[int] = []
        self.maps = {SHARED: {}, 1: {}, 2: {}}

    def num_free(self):
        return len(self.fresh) + len(self.evict)

    def take(self, k):
        out = []
        for _ in range(k):
            b = self.fresh.pop(0) if self.fresh else self.evict.pop(0)
            if self.where[b] is not None:
                m, h = self.where[b]
                del self.maps[m][h]
                self.where[b] = None
                self.unconf[b] = 0
            self.ref[b] = 1
            out.append(b)
        return out

    def touch(self, b):
        if self.ref[b] == 0:
            self.evict.remove(b)
        self.ref[b] += 1

    def release(self, b):
        self.ref[b] -= 1
        if self.ref[b] == 0:
            (self.evict.append if self.where[b] is not None else lambda x: self.fresh.insert(0, x))(b)

    def cache(self, m, h, b, w):
        self.maps[m][h] = b
        self.where[b] = (m, h)
        self.unconf[b] = w

    def forget(self, b):
        """Uncache b (its map entry already gone); a free one goes to the front."""
        self.where[b] = None
        self.unconf[b] = 0
        if self.ref[b] == 0:
            self.evict.remove(b)
            self.fresh.insert(0, b)


class Model:
    def __init__(self):
        self.pool = Pool()
        self.tick = 0
        self.num_regs = 0
        self.fifo = {1: deque(), 2: deque()}
        self.reqs = {}  # id -> dict(tokens, blocks, reg, writer)
        self.pending = []  # confirmations the manager has deferred

    def seen_by(self, w, h):
        pool = self.pool
        b = pool.maps[SHARED].get(h)
        if b is not None and pool.unconf[b] in (0, w):
            return b
        return pool.maps[w].get(h) if w else None

    def lookup(self, w, hashes):
        hits = []
        for h in hashes:
            b = self.seen_by(w, h)
            if b is None:
                break
            hits.append(b)
        return hits

    def register(self, w, hashes, blocks):
        pool, stored = self.pool, []
        for h, b in zip(hashes, blocks):
            if not b or pool.where[b] is not None or (w and h in pool.maps[w]):
                continue
            old = pool.maps[SHARED].get(h)
            if old is None or (not w and pool.unconf[old]):
                if old is not None:  # a confirmed entry takes an unconfirmed one's place
                    del pool.maps[SHARED][h]
                    pool.forget(old)
                pool.cache(SHARED, h, b, w)
            elif w and pool.unconf[old] not in (0, w):
                pool.cache(w, h, b, w)
            else:
                continue
            stored.append(b)
        if w and stored:
            self.num_regs += 1
            for b in stored:
                pool.reg[b] = self.num_regs
            self.fifo[w].append((self.tick, self.num_regs, stored))

    def allocate(self, rid, w, n, hashes):
        hits = self.lookup(w, hashes[: (n - 1) // BS])
        new = cdiv(n, BS) - len(hits)
        revived = len({b for b in hits if self.pool.ref[b] == 0})
        if len(self.reqs) >= MAX_REQS or new + revived > self.pool.num_free():
            return STATUS_NO_SPACE, 0
        for b in hits:
            self.pool.touch(b)
        blocks = hits + self.pool.take(new)
        end = min(len(hashes), n // BS)
        self.register(w, hashes[len(hits):end], blocks[len(hits):end])
        self.reqs[rid] = dict(tokens=n, blocks=blocks, reg=max(len(hits), end), writer=w)
        return STATUS_OK, len(hits) * BS

    def append(self, rid, k, hashes):
        r = self.reqs[rid]
        old, new = r["tokens"], r["tokens"] + k
        grow = max(cdiv(new, BS) - len(r["blocks"]), 0)
        cow = k > 0 and old % BS and self.pool.ref[r["blocks"][old // BS]] > 1
        if grow + cow > self.pool.num_free():
            return STATUS_NO_SPACE
        if cow:
            src = r["blocks"][old // BS]
            r["blocks"][old // BS] = self.pool.take(1)[0]
            self.pool.release(src)
        r["blocks"] += self.pool.take(grow)
        r["tokens"] = new
        self.register_filled(rid, hashes)
        return STATUS_OK

    def register_filled(self, rid, hashes):
        r = self.reqs[rid]
        self.register(r["writer"], hashes, r["blocks"][r["reg"]: r["reg"] + len(hashes)])
        r["reg"] += len(hashes)

    def free(self, rid):
        for b in reversed(self.reqs.pop(rid)["blocks"]):
            self.pool.release(b)

    def fork(self, p, c):
        r = self.reqs[p]
        n = cdiv(r["tokens"], BS)
        for b in r["blocks"][:n]:
            self.pool.ref[b] += 1
        self.reqs[c] = dict(tokens=r["tokens"], blocks=r["blocks"][:n], reg=min(r["reg"], n), writer=r["writer"])

    def confirm(self, w, through):
        """The manager (defer_cache_registration, like a daemon's) applies a confirmation at its
        next flush: before any call except a decode step that registers nothing and takes only
        fresh blocks (one that must evict flushes first: which block it evicts depends on it)."""
        self.pending.append((w, through))

    def flush(self):
        pending, self.pending = self.pending, []
        for w, through in pending:
            self._confirm(w, through)

    def _confirm(self, w, through):
        fifo, pool = self.fifo[w], self.pool
        while fifo and fifo[0][0] <= through:
            _, reg, blocks = fifo.popleft()
            for b in blocks:
                if pool.reg[b] != reg or pool.unconf[b] != w:
                    continue  # evicted, or stored again later: that registration's turn confirms it
                m, h = pool.where[b]
                if m == SHARED:
                    pool.unconf[b] = 0
                    continue
                del pool.maps[w][h]  # a side copy moves into the shared map ...
                old = pool.maps[SHARED].get(h)
                if old is not None and not pool.unconf[old]:
                    pool.forget(b)  # ... unless a confirmed copy is there already
                    continue
                if old is not None:
                    pool.forget(old)
                pool.cache(SHARED, h, b, 0)

    def decode_need(self, rids, k):
        """Blocks a decode step of ``rids`` takes, growing and copying in batch order as ``append``
        does (a shared block's last appender writes in place once the others copied it)."""
        need, ref = 0, {}
        for rid in rids:
            r = self.reqs[rid]
            old, new = r["tokens"], r["tokens"] + k
            need += max(cdiv(new, BS) - len(r["blocks"]), 0)
            if k > 0 and old % BS:
                b = r["blocks"][old // BS]
                ref.setdefault(b, self.pool.ref[b])
                if ref[b] > 1:
                    ref[b] -= 1
                    need += 1
        return need

    def decode_fits(self, rids, k):
        return self.decode_need(rids, k) <= self.pool.num_free()

    def drop_writer(self, w):
        pool = self.pool
        for b in [b for b in pool.evict if pool.where[b] is not None and pool.unconf[b] == w]:
            m, h = pool.where[b]
            del pool.maps[m][h]
            pool.forget(b)
        assert not pool.maps[w]
        self.fifo[w].clear()


tokens_st = st.lists(st.integers(0, 1), min_size=1, max_size=24)


class SharingMachine(RuleBasedStateMachine):
    reqs = Bundle("reqs")

    def __init__(self):
        super().__init__()
        self.mgr = BlockManager(ManagerConfig(num_gpu_blocks=NUM_BLOCKS, max_model_len=MAX_LEN, groups=(GroupSpec(BS),),
                                              max_num_reqs=MAX_REQS, defer_cache_registration=True, debug_checks=True))
        self.model = Model()
        self.tokens = {}
        self.next_id = 0

    def _hashes(self, rid, start, end):
        return hash_prompt(np.array(self.tokens[rid][: end * BS], np.int32), BS)[start:end]

    def _new(self, toks):
        rid = self.next_id
        self.next_id += 1
        self.tokens[rid] = list(toks)
        return rid, self._hashes(rid, 0, len(toks) // BS)

    def _ticked(self):
        assert self.mgr.tick == self.model.tick + 1
        self.model.tick = self.mgr.tick

    @rule(target=reqs, w=st.sampled_from(WRITERS), toks=tokens_st)
    def allocate(self, w, toks):
        self.model.flush()
        rid, hashes = self._new(toks)
        res = self.mgr.allocate(rid, len(toks), hashes, writer=w)
        self._ticked()
        status, cached = self.model.allocate(rid, w, len(toks), hashes.tolist())
        assert (res.status, res.num_cached_tokens) == (status, cached)
        return rid if status == STATUS_OK else -1

    @rule(target=reqs, w=st.sampled_from(WRITERS), many=st.lists(tokens_st, min_size=1, max_size=3), data=st.data())
    def step_admit(self, w, many, data):
        """A step's batched admission, carrying the writer's confirmation of some earlier tick."""
        through = data.draw(st.one_of(st.none(), st.integers(0, self.mgr.tick)))
        new = [self._new(toks) for toks in many]
        res = self.mgr.step(StepBatch(admit=[AdmitRequest(rid, len(self.tokens[rid]), hashes) for rid, hashes in new],
                                      computed_through=through), writer=w)
        self.model.flush()
        if w and through is not None:
            self.model.confirm(w, through)
            self.model.flush()
        self._ticked()
        assert res.tick == self.mgr.tick
        admitted = []
        for i, (rid, hashes) in enumerate(new):
            status, cached = self.model.allocate(rid, w, len(self.tokens[rid]), hashes.tolist())
            assert (res.admit_status[i], res.admit_cached_tokens[i]) == (status, cached if status == STATUS_OK else 0)
            if status == STATUS_OK:
                admitted.append(rid)
        return multiple(*admitted)

    @rule(rid=reqs, more=st.lists(st.integers(0, 1), max_size=9))
    def append(self, rid, more):
        r = self.model.reqs.get(rid)
        if r is None or r["tokens"] + len(more) > MAX_LEN:
            return
        self.model.flush()
        self.tokens[rid] = self.tokens[rid][: r["tokens"]] + list(more)
        hashes = self._hashes(rid, r["reg"], (r["tokens"] + len(more)) // BS)
        res = self.mgr.append_slots(rid, len(more), hashes)
        self._ticked()
        assert res.status == self.model.append(rid, len(more), hashes.tolist())
        self.mgr.take_copies()

    @rule(k=st.integers(0, 5), data=st.data())
    def decode_step(self, k, data):
        """A daemon's decode step: appends by row, no hashes; it runs before deferred work."""
        live = sorted(self.model.reqs)
        rids = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=4)) if live else []
        if any(self.model.reqs[r]["tokens"] + k > MAX_LEN for r in rids) or not self.model.decode_fits(rids, k):
            return  # the general path (it flushes first) is another rule's business
        rows = np.array([self.mgr.row_of(r) for r in rids], np.int32)
        confirm = data.draw(st.one_of(st.none(), st.tuples(st.sampled_from(WRITERS[1:]), st.integers(0, self.mgr.tick))))
        if confirm is not None:  # deferred: applied after this step (the invariant flushes) ...
            self.mgr.mark_computed(*confirm)
            self.model.confirm(*confirm)
            if self.model.decode_need(rids, k) > len(self.model.pool.fresh):
                self.model.flush()  # ... unless the step evicts: then before it
        res = self.mgr.step(StepBatch(append_rows=rows, append_num_tokens=k))
        self._ticked()
        assert res.append_status.tolist() == [0] * len(rids)
        for rid in rids:
            self.tokens[rid] = self.tokens[rid][: self.model.reqs[rid]["tokens"]] + [0] * k
            assert self.model.append(rid, k, []) == STATUS_OK
        self.mgr.take_copies()

    @rule(k=st.integers(0, 5), data=st.data())
    def decode_step_that_registers(self, k, data):
        """A daemon's decode step whose requests fill blocks: their registration waits for the
        reply (no debug check flushes it here), then an idle daemon runs a slice of it; the
        invariant's flush does the rest. Every request's blocks are taken before any is registered
        (a block the step evicts frees its hash for a registration of the same step)."""
        live = sorted(self.model.reqs)
        rids = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=4)) if live else []
        if any(self.model.reqs[r]["tokens"] + k > MAX_LEN for r in rids) or not self.model.decode_fits(rids, k):
            return
        self.model.flush()
        hashes = []
        for rid in rids:
            r = self.model.reqs[rid]
            self.tokens[rid] = self.tokens[rid][: r["tokens"]] + data.draw(st.lists(st.integers(0, 1), min_size=k, max_size=k))
            hashes.append(self._hashes(rid, r["reg"], (r["tokens"] + k) // BS))
        rows = np.array([self.mgr.row_of(r) for r in rids], np.int32)
        flat = np.concatenate(hashes) if hashes else np.empty(0, "S16")
        batch = StepBatch(append_rows=rows, append_num_tokens=k, append_hashes=(flat,),
                          append_hash_counts=(np.array([h.size for h in hashes], np.int32),))
        self.mgr._debug_check = lambda: None  # the heavy check would flush at once
        try:
            res = self.mgr.step(batch)
            self.mgr.flush_deferred(max_rows=data.draw(st.integers(0, 3)))
        finally:
            del self.mgr._debug_check
        self._ticked()
        assert res.append_status.tolist() == [0] * len(rids)
        for rid in rids:
            assert self.model.append(rid, k, []) == STATUS_OK
        for rid, h in zip(rids, hashes):
            self.model.register_filled(rid, h.tolist())
        self.mgr.take_copies()

    @rule(rid=consumes(reqs))
    def free(self, rid):
        self.model.flush()
        if rid in self.model.reqs:
            self.mgr.free(rid)
            self.model.free(rid)

    @rule(rid=reqs, target=reqs)
    def fork(self, rid):
        self.model.flush()
        if rid not in self.model.reqs or len(self.model.reqs) >= MAX_REQS:
            return -1
        child = self.next_id
        self.next_id += 1
        self.mgr.fork(rid, child)
        self.model.fork(rid, child)
        self.tokens[child] = list(self.tokens[rid])
        return child

    @rule(w=st.sampled_from(WRITERS[1:]), data=st.data())
    def confirm(self, w, data):
        through = data.draw(st.integers(0, self.mgr.tick))
        self.mgr.mark_computed(w, through)
        self.model.confirm(w, through)

    @rule(w=st.sampled_from(WRITERS[1:]))
    def drop_writer(self, w):
        self.model.flush()
        if any(r["writer"] == w for r in self.model.reqs.values()):
            return
        self.mgr.drop_writer(w)
        self.model.drop_writer(w)

    @invariant()
    def agree(self):
        mgr, model = self.mgr, self.model
        mgr.flush_deferred()
        model.flush()
        mgr.check_invariants(heavy=True)
        assert mgr.pool.ref_cnt.tolist() == model.pool.ref
        assert mgr.pool.free_queue_order().tolist() == model.pool.fresh + model.pool.evict
        key = mgr._cache_keys.get((mgr._spaces.get((0, 0)), 0))
        assert mgr.pool.caches.get(key, {}) == model.pool.maps[SHARED]
        writer_of = {0: 0}
        for w in WRITERS[1:]:
            key = mgr._cache_keys.get((mgr._spaces.get((0, w)), 0))
            assert mgr.pool.caches.get(key, {}) == model.pool.maps[w], w
            if key is not None:
                writer_of[key] = w
        assert [writer_of[k] for k in mgr.pool.unconfirmed_by.tolist()] == model.pool.unconf
        for rid, r in model.reqs.items():
            assert mgr.block_table(rid).tolist() == r["blocks"], rid
        probe = hash_prompt(np.zeros(MAX_LEN, np.int32), BS).tolist()
        for w in WRITERS:
            assert mgr.lookup(probe, writer=w) == len(model.lookup(w, probe))


SharingMachine.TestCase.settings = machine_settings(200, 40)
TestSharingMachine = SharingMachine.TestCase


def test_a_block_the_decode_step_evicts_frees_its_hash_for_that_steps_registration():
    """Found by the machine: request 1 fills a block whose hash a cached, evictable block holds;
    request 0's growth in the same step evicts that block. The step takes every request's blocks
    before it registers any, so the filled block takes the hash over."""
    mgr = BlockManager(ManagerConfig(num_gpu_blocks=NUM_BLOCKS, max_model_len=MAX_LEN, groups=(GroupSpec(BS),),
                                     max_num_reqs=MAX_REQS, defer_cache_registration=True, debug_checks=True))

    def h(toks):
        return hash_prompt(np.array(toks, np.int32), BS)

    prompts = {0: [0, 0], 1: [0], 2: [0, 0, 1, 1], 3: [0] * 10}
    for rid, p in prompts.items():
        assert mgr.allocate(rid, len(p), h(p[: len(p) // BS * BS]), writer=0).ok
    mgr.fork(3, 4)
    mgr.free(2)  # block 3: cached as h(0011), evictable
    mgr.fork(1, 5)
    assert mgr.pool.free_queue_order().tolist() == [7, 8, 9, 3]
    filled = {3: h([0] * 12)[2:], 1: h([0, 0, 1, 1]), 0: h([0] * 4)}
    rows = np.array([mgr.row_of(r) for r in filled], np.int32)
    res = mgr.step(StepBatch(append_rows=rows, append_num_tokens=3,
                             append_hashes=(np.concatenate(list(filled.values())),),
                             append_hash_counts=(np.array([1, 1, 1], np.int32),)))
    assert res.append_status.tolist() == [STATUS_OK] * 3
    mgr.flush_deferred()
    # 3 copies its shared last block to 7 and grows 8; 1 copies its shared block to 9; 0 grows 3
    assert {r: mgr.block_table(r).tolist() for r in (3, 1, 0, 5)} == {3: [4, 5, 7, 8], 1: [9], 0: [1, 3], 5: [2]}
    cache = mgr.pool.caches[mgr._cache_keys[(mgr._spaces[(0, 0)], 0)]]
    assert cache == {h([0] * 4)[0]: 4, h([0] * 8)[1]: 5, h([0] * 12)[2]: 7, h([0, 0, 1, 1])[0]: 9}


def test_a_decode_step_of_several_writers_registers_in_batch_order():
    """Found by exploring: writers 2 and 1 fill blocks of one hash in one decode step, writer 2's
    request first in the batch. Writer 2's block takes the shared entry (awaiting its
    confirmation) and writer 1's goes to its side map: batch order decides, not which writer's
    registration space was made first."""
    mgr = BlockManager(ManagerConfig(num_gpu_blocks=NUM_BLOCKS, max_model_len=MAX_LEN, groups=(GroupSpec(BS),),
                                     max_num_reqs=MAX_REQS, defer_cache_registration=True, debug_checks=True))
    empty = np.empty(0, "S16")
    assert mgr.allocate(0, 1, empty, writer=1).ok
    for child in (1, 2, 3):
        mgr.fork(0, child)
    assert mgr.allocate(5, 1, empty, writer=2).ok
    assert mgr.block_table(0).tolist() == [1] and mgr.block_table(5).tolist() == [2]
    full = hash_prompt(np.zeros(BS, np.int32), BS)
    rows = np.array([mgr.row_of(5), mgr.row_of(0)], np.int32)
    res = mgr.step(StepBatch(append_rows=rows, append_num_tokens=3, append_hashes=(np.concatenate([full, full]),),
                             append_hash_counts=(np.array([1, 1], np.int32),)))
    assert res.append_status.tolist() == [STATUS_OK, STATUS_OK]
    mgr.flush_deferred()
    assert mgr.block_table(5).tolist() == [2] and mgr.block_table(0).tolist() == [3]  # 0 copied its shared block
    key = {w: mgr._cache_keys[(mgr._spaces[(0, w)], 0)] for w in (0, 1, 2)}  # 0: the shared map, else a side map
    assert mgr.pool.caches == {key[0]: {full[0]: 2}, key[1]: {full[0]: 3}}
    assert mgr.pool.unconfirmed_by[[2, 3]].tolist() == [key[2], key[1]]
    assert mgr.lookup(full, writer=2) == 1 and mgr.lookup(full, writer=1) == 1 and mgr.lookup(full, writer=0) == 0


class _Draws:
    """``data`` for calling the machine's rules directly: each ``draw`` returns the next value."""

    def __init__(self, *values):
        self.values = list(values)

    def draw(self, _strategy):
        return self.values.pop(0)


@pytest.mark.parametrize("case", [1, 2])
def test_a_decode_step_that_evicts_applies_a_confirmation_given_before_it_first(case):
    """Found by exploring the machine (session 27): a confirmation given just before a decode step
    that registers nothing waits for the next flush, unless the step must evict. Here writer 1's
    side copies (blocks 5-7 in case 1) are free and cached; its confirmation uncaches the copies that
    duplicate writer 2's confirmed blocks, which makes them fresh, so the step takes a fresh block
    instead of evicting the front of the queue: the manager runs the confirmation first (as a
    manager that does not defer would), and so must the model."""
    s = SharingMachine()
    if case == 1:
        _, r1, r2 = s.step_admit(data=_Draws(None), many=[[0] * 5, [0, 0, 0, 1, 0, 0, 0, 0], [0]], w=2).values
        s.agree()
        s.free(rid=r2)
        r3, _, _ = s.step_admit(data=_Draws(None), many=[[0] * 12, [0], [0]], w=1).values
        s.agree()
        s.free(rid=r3)
        grower, confirm = r1, (1, 2)
    else:
        r0, r1, r2 = s.step_admit(data=_Draws(None), many=[[0] * 7, [1, 1, 0, 0, 0, 0, 0, 0], [0]], w=2).values
        s.agree()
        s.free(rid=r2)
        s.free(rid=r1)
        s.append(more=[], rid=r0)
        s.step_admit(data=_Draws(None), many=[[0], [0], [1, 1, 0, 0, 0, 0, 0, 0, 0]], w=1)
        s.agree()
        grower, confirm = r0, (1, 3)
    s.confirm(data=_Draws(1), w=2)
    s.agree()
    fresh_before = s.mgr.pool.num_fresh
    s.decode_step(data=_Draws([grower], confirm), k=2 if case == 2 else 1)
    assert fresh_before == 0  # the step had to evict
    s.agree()
    s.teardown()
