"""Model-based test: BlockManager against a trivially correct model built from Python lists.

The model keeps the free queue as one list per part (fresh blocks front-inserted, cached blocks
appended per priority), requests as lists of block ids, and does everything one block at a time.
After every rule the two must agree exactly: block tables, token counts, every reference count, the
whole free-queue order, the prefix-cache map, and the CPU pool.
"""

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from kvd import errors
from kvd.api import STATUS_NEVER, STATUS_NO_SPACE, STATUS_OK, AdmitRequest, GroupSpec, ManagerConfig, StepBatch
from kvd.hashing import hash_prompt
from kvd.manager import BlockManager
from machine_settings import machine_settings

BS = 4
NUM_BLOCKS = 20
NUM_CPU = 12
MAX_LEN = 48
MAX_REQS = 6


def cdiv(a, b):
    return -(-a // b)


class ModelPool:
    def __init__(self, n):
        self.ref = [0] * n
        self.hash = [None] * n
        self.prio = [0] * n
        self.fresh = list(range(1, n))
        self.evict: dict[int, list[int]] = {}
        self.cache: dict[bytes, int] = {}
        self.evictions = 0

    def num_free(self):
        return len(self.fresh) + sum(len(v) for v in self.evict.values())

    def take(self, k):
        out = []
        for _ in range(k):
            if self.fresh:
                b = self.fresh.pop(0)
            else:
                prio = min(p for p, v in self.evict.items() if v)
                b = self.evict[prio].pop(0)
                del self.cache[self.hash[b]]
                self.hash[b] = None
                self.evictions += 1
            self.ref[b] = 1
            out.append(b)
        return out

    def touch(self, b):
        if self.ref[b] == 0:
            self.evict[self.prio[b]].remove(b)
        self.ref[b] += 1

    def release(self, b, prio=50):
        self.ref[b] -= 1
        assert self.ref[b] >= 0
        if self.ref[b] == 0:
            if self.hash[b] is not None:
                self.prio[b] = prio
                self.evict.setdefault(prio, []).append(b)
            else:
                self.fresh.insert(0, b)

    def register(self, h, b):
        if h not in self.cache and self.hash[b] is None:
            self.cache[h] = b
            self.hash[b] = h

    def order(self):
        return self.fresh + [b for p in sorted(self.evict) for b in self.evict[p]]


class Model:
    def __init__(self, window=0):
        self.window = window
        self.pool = ModelPool(NUM_BLOCKS)
        self.cpu = ModelPool(NUM_CPU)
        self.reqs = {}  # id -> dict(tokens, blocks, reg, prio, hashes, swapped, cpu, carried)
        self.copies = []

    def lookup(self, hashes, n):
        hits = []
        for h in hashes[: (n - 1) // BS]:
            b = self.pool.cache.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def skip_for(self, computed):
        return max(computed - self.window + 1, 0) // BS if self.window else 0

    def window_hits(self, hashes, n):
        """Longest cached length whose blocks inside the window are all cached."""
        limit = min(len(hashes), (n - 1) // BS)
        cached = [h in self.pool.cache for h in hashes[:limit]]
        end = limit
        while end > 0 and not all(cached[self.skip_for(end * BS) : end]):
            end -= 1
        skip = self.skip_for(end * BS)
        return [0] * skip + [self.pool.cache[h] for h in hashes[skip:end]]

    def allocate(self, rid, n, la, prio, hashes):
        hits = self.window_hits(hashes, n) if self.window else self.lookup(hashes, n)
        new = cdiv(n + la, BS) - len(hits)
        revived = len({b for b in hits if b and self.pool.ref[b] == 0})
        if cdiv(n + la, BS) > NUM_BLOCKS - 1 or len(self.reqs) >= MAX_REQS or new + revived > self.pool.num_free():
            return STATUS_NO_SPACE, 0
        for b in hits:
            if b:
                self.pool.touch(b)
        blocks = hits + self.pool.take(new)
        reg = len(hits)
        for i in range(reg, min(len(hashes), n // BS)):
            self.pool.register(hashes[i], blocks[i])
        self.reqs[rid] = dict(tokens=n, blocks=blocks, reg=max(reg, min(len(hashes), n // BS)), prio=prio,
                              swapped=False)
        return STATUS_OK, len(hits) * BS

    def append(self, rid, k, la, hashes):
        return self.append_batch([rid], k, la, [hashes])[0]

    def append_batch(self, rids, k, la, hash_lists):
        """A batch of appends in the manager's documented phases: every request grows (in batch
        order), then filled blocks are registered, then out-of-window blocks are returned."""
        statuses, olds = [], []
        for rid in rids:
            r = self.reqs[rid]
            old, new = r["tokens"], r["tokens"] + k
            olds.append(old)
            grow = max(cdiv(new + la, BS) - len(r["blocks"]), 0)
            cow = k > 0 and old % BS and self.pool.ref[r["blocks"][old // BS]] > 1
            if grow + cow > self.pool.num_free():
                statuses.append(STATUS_NO_SPACE)
                continue
            if cow:
                src = r["blocks"][old // BS]
                dst = self.pool.take(1)[0]
                self.pool.release(src)
                r["blocks"][old // BS] = dst
                self.copies.append([src, dst])
            r["blocks"] += self.pool.take(grow)
            r["tokens"] = new
            statuses.append(STATUS_OK)
        for rid, status, hashes in zip(rids, statuses, hash_lists):
            if status == STATUS_OK:
                r = self.reqs[rid]
                for i, h in enumerate(hashes):
                    if r["blocks"][r["reg"] + i]:
                        self.pool.register(h, r["blocks"][r["reg"] + i])
                r["reg"] += len(hashes)
        for rid, status, old in zip(rids, statuses, olds):
            if status == STATUS_OK and k > 0:  # only requests that grew
                r = self.reqs[rid]
                skip = min(self.skip_for(old), len(r["blocks"]))
                for i in reversed(range(skip)):
                    if r["blocks"][i]:
                        self.pool.release(r["blocks"][i], r["prio"])
                        r["blocks"][i] = 0
        return statuses

    def free(self, rid):
        r = self.reqs.pop(rid)
        if r["swapped"]:
            for c in r["cpu"]:
                if c is not None:
                    self.cpu.release(c)
            return
        for b in reversed(r["blocks"]):
            if b:
                self.pool.release(b, r["prio"])

    def fork(self, p, c):
        r = self.reqs[p]
        n = cdiv(r["tokens"], BS)
        blocks = r["blocks"][:n]
        for b in blocks:
            if b:
                self.pool.ref[b] += 1
        self.reqs[c] = dict(tokens=r["tokens"], blocks=list(blocks), reg=min(r["reg"], n), prio=r["prio"],
                            swapped=False)

    def swap_out(self, rid):
        r = self.reqs[rid]
        gpu = sorted(b for b in r["blocks"] if b)
        if len(gpu) > NUM_CPU - 1:  # more than the whole CPU pool (block 0 is null)
            return STATUS_NEVER
        if len(gpu) > self.cpu.num_free():
            return STATUS_NO_SPACE
        cpu = self.cpu.take(len(gpu))
        to_cpu = dict(zip(gpu, cpu))
        r["carried"] = {to_cpu[b]: self.pool.hash[b] for b in gpu}
        r["cpu"] = [to_cpu[b] if b else None for b in r["blocks"]]
        for b in reversed(r["blocks"]):
            if b:
                self.pool.release(b, r["prio"])
        r["blocks"] = []
        r["swapped"] = True
        return STATUS_OK

    def swap_in(self, rid):
        r = self.reqs[rid]
        cpu = sorted(c for c in r["cpu"] if c is not None)
        found = {c: self.pool.cache.get(r["carried"][c]) if r["carried"][c] is not None else None for c in cpu}
        misses = [c for c in cpu if found[c] is None]
        revived = len({found[c] for c in cpu if found[c] is not None and self.pool.ref[found[c]] == 0})
        if len(misses) + revived > self.pool.num_free():
            return STATUS_NO_SPACE
        for c in cpu:
            if found[c] is not None:
                self.pool.touch(found[c])
        for c, b in zip(misses, self.pool.take(len(misses))):
            found[c] = b
            if r["carried"][c] is not None:
                self.pool.register(r["carried"][c], b)
        r["blocks"] = [found[c] if c is not None else 0 for c in r["cpu"]]
        for c in cpu:
            self.cpu.release(c)
        r["swapped"] = False
        return STATUS_OK


tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=40)


class ManagerMachine(RuleBasedStateMachine):
    reqs = Bundle("reqs")
    WINDOW = 0

    def __init__(self):
        super().__init__()
        group = GroupSpec(BS, sliding_window=self.WINDOW or None)
        self.mgr = BlockManager(ManagerConfig(num_gpu_blocks=NUM_BLOCKS, num_cpu_blocks=NUM_CPU, max_model_len=MAX_LEN,
                                              groups=(group,), max_num_reqs=MAX_REQS, max_lookahead_tokens=8,
                                              defer_cache_registration=not self.WINDOW, debug_checks=True))
        self.model = Model(self.WINDOW)
        self.tokens = {}
        self.next_id = 0

    def _hashes(self, rid, start_block, end_block):
        toks = np.array(self.tokens[rid][: end_block * BS], np.int32)
        return hash_prompt(toks, BS)[start_block:end_block]

    # ------------------------------------------------------------------ rules
    @rule(target=reqs, toks=tokens_st, la=st.integers(0, 5), prio=st.sampled_from([10, 50, 90]),
          lag=st.integers(0, 2))
    def allocate(self, toks, la, prio, lag):
        rid = self.next_id
        self.next_id += 1
        n = len(toks)
        self.tokens[rid] = list(toks)
        hashes = self._hashes(rid, 0, max(n // BS - lag, 0))
        res = self.mgr.allocate(rid, n, hashes, la, priority=prio)
        status, cached = self.model.allocate(rid, n, la, prio, hashes.tolist())
        assert res.status == status
        if status == STATUS_OK:
            assert res.num_cached_tokens == cached
            return rid
        del self.tokens[rid]
        return -1

    @rule(rid=reqs, more=st.lists(st.integers(0, 2), max_size=9), la=st.integers(0, 5))
    def append(self, rid, more, la):
        if rid not in self.model.reqs:
            return
        r = self.model.reqs[rid]
        if r["swapped"]:
            try:
                self.mgr.append_slots(rid, 1)
            except errors.RequestSwapped:
                return
            raise AssertionError("append to a swapped request must raise")
        if r["tokens"] + len(more) > MAX_LEN:
            return
        self.tokens[rid] = self.tokens[rid][: r["tokens"]] + list(more)
        full = (r["tokens"] + len(more)) // BS
        hashes = self._hashes(rid, r["reg"], full)
        res = self.mgr.append_slots(rid, len(more), hashes, la)
        status = self.model.append(rid, len(more), la, hashes.tolist())
        assert res.status == status
        if status == STATUS_OK:
            assert res.copies.tolist() == self.model.copies
        self.model.copies = []
        self.mgr.take_copies()

    @rule(rid=consumes(reqs))
    def free(self, rid):
        if rid not in self.model.reqs:
            return
        self.mgr.free(rid)
        self.model.free(rid)

    @rule(rid=reqs, target=reqs)
    def fork(self, rid):
        if rid not in self.model.reqs or self.model.reqs[rid]["swapped"] or len(self.model.reqs) >= MAX_REQS:
            return -1
        child = self.next_id
        self.next_id += 1
        self.mgr.fork(rid, child)
        self.model.fork(rid, child)
        self.tokens[child] = list(self.tokens[rid])
        return child

    @rule(rid=reqs)
    def swap(self, rid):
        if rid not in self.model.reqs:
            return
        if self.model.reqs[rid]["swapped"]:
            res, status = self.mgr.swap_in(rid), self.model.swap_in(rid)
        else:
            res, status = self.mgr.swap_out(rid), self.model.swap_out(rid)
        assert res.status == status

    @precondition(lambda self: not self.WINDOW)
    @rule(toks=tokens_st)
    def lookup(self, toks):
        hashes = hash_prompt(np.array(toks, np.int32), BS)
        expected = 0
        for h in hashes.tolist():
            if h not in self.model.pool.cache:
                break
            expected += 1
        assert self.mgr.lookup(hashes) == expected

    @rule()
    def reset(self):
        held = any(self.model.pool.ref[b] for b in self.model.pool.cache.values())
        assert self.mgr.reset_prefix_cache() == (not held)
        if not held:
            pool = self.model.pool
            cached = [b for p in sorted(pool.evict) for b in pool.evict[p]]
            for b in cached:
                pool.hash[b] = None
            pool.evict = {}
            pool.cache = {}
            pool.fresh = cached[::-1] + pool.fresh

    @precondition(lambda self: any(not r["swapped"] for r in self.model.reqs.values()))
    @rule(data=st.data())
    def decode_step(self, data):
        """A step of appends by row (the daemon's fast path), against one-by-one model appends."""
        running = [rid for rid, r in self.model.reqs.items() if not r["swapped"]]
        chosen = data.draw(st.lists(st.sampled_from(running), min_size=1, unique=True))
        k = data.draw(st.integers(0, 2))
        if any(self.model.reqs[r]["tokens"] + k > MAX_LEN for r in chosen):
            return
        flat, counts = [], []
        for rid in chosen:
            r = self.model.reqs[rid]
            self.tokens[rid] = self.tokens[rid][: r["tokens"]] + [7] * k
            h = self._hashes(rid, r["reg"], (r["tokens"] + k) // BS)
            flat.append(h)
            counts.append(h.size)
        rows = self.mgr.rows_of(chosen)
        if data.draw(st.booleans()):  # the daemon's decode entry (registering what filled, if anything)
            if any(counts):
                fast = self.mgr.decode_rows(rows, k, 0, np.concatenate(flat), np.array(counts, np.int32))
            else:
                fast = self.mgr.decode_rows(rows, k)
            if fast is not None:  # (declined: nothing changed, and the step below decides)
                assert self.model.append_batch(chosen, k, 0, [h.tolist() for h in flat]) == [STATUS_OK] * len(chosen)
                assert fast[0].tolist() == [self.model.reqs[r]["tokens"] - k for r in chosen]
                assert fast[2].tolist() == self.model.copies
                self.model.copies = []
                self.mgr.take_copies()
                return
        res = self.mgr.step(StepBatch(append_rows=rows, append_num_tokens=k,
                                      append_hashes=(np.concatenate(flat),), append_hash_counts=(np.array(counts),)))
        expected = self.model.append_batch(chosen, k, 0, [h.tolist() for h in flat])
        assert res.append_status.tolist() == expected
        assert res.copies.tolist() == self.model.copies
        self.model.copies = []
        self.mgr.take_copies()

    @rule(rid=reqs, n=st.integers(2, 3), k=st.integers(0, 2))
    def fork_step(self, rid, n, k):
        """Forks of one parent and an append to every member, in one step."""
        if rid not in self.model.reqs or self.model.reqs[rid]["swapped"] or len(self.model.reqs) + n > MAX_REQS:
            return
        if self.model.reqs[rid]["tokens"] + k > MAX_LEN:
            return
        kids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        self.tokens[rid] = self.tokens[rid][: self.model.reqs[rid]["tokens"]] + [5] * k
        res = self.mgr.step(StepBatch(forks=[(rid, c) for c in kids], append_ids=[rid] + kids, append_num_tokens=k))
        assert res.fork_status.tolist() == [0] * n
        for c in kids:
            self.model.fork(rid, c)
            self.tokens[c] = list(self.tokens[rid])
        expected = self.model.append_batch([rid] + kids, k, 0, [[]] * (n + 1))
        assert res.append_status.tolist() == expected
        assert res.copies.tolist() == self.model.copies
        self.model.copies = []
        self.mgr.take_copies()
        for c in kids:  # keep the population bounded: the children leave again
            self.mgr.free(c)
            self.model.free(c)

    @rule(data=st.data())
    def mixed_step(self, data):
        """Frees then admissions in one step, against the model one by one."""
        live = list(self.model.reqs)
        frees = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=2)) if live else []
        admits, expect = [], []
        for toks in data.draw(st.lists(tokens_st, max_size=3)):
            rid = self.next_id
            self.next_id += 1
            self.tokens[rid] = list(toks)
            admits.append(AdmitRequest(rid, len(toks), self._hashes(rid, 0, len(toks) // BS)))
        res = self.mgr.step(StepBatch(free=frees, admit=admits))
        for rid in frees:
            self.model.free(rid)
        for a in admits:
            expect.append(self.model.allocate(a.req_id, a.num_tokens, 0, 50, a.block_hashes.tolist()))
        assert res.admit_status.tolist() == [s for s, _ in expect]
        ok = res.admit_status == STATUS_OK
        assert res.admit_cached_tokens[ok].tolist() == [c for s, c in expect if s == STATUS_OK]

    # ------------------------------------------------------------------ agreement
    @invariant()
    def agree(self):
        mgr, model = self.mgr, self.model
        mgr.check_invariants(heavy=True)  # flushes deferred registrations, as any call would
        assert mgr.pool.ref_cnt.tolist() == model.pool.ref
        assert mgr.pool.free_queue_order().tolist() == model.pool.order()
        assert mgr.pool.caches.get(1, {}) == model.pool.cache
        assert mgr.cpu_pool.ref_cnt.tolist() == model.cpu.ref
        assert mgr.cpu_pool.free_queue_order().tolist() == model.cpu.order()
        assert mgr.num_requests == len(model.reqs)
        for rid, r in model.reqs.items():
            row = mgr.row_of(rid)
            assert int(mgr.num_tokens[row]) == r["tokens"]
            if not r["swapped"]:
                assert mgr.block_table(rid).tolist() == r["blocks"], (rid, r)
        assert mgr.stats()["evictions"] == model.pool.evictions
        mgr.check_invariants(heavy=True)


class WindowMachine(ManagerMachine):
    """The same rules on a sliding-window group (window of two blocks)."""

    WINDOW = 2 * BS


ManagerMachine.TestCase.settings = machine_settings(150, 30)
WindowMachine.TestCase.settings = machine_settings(100, 30)
TestManagerMachine = ManagerMachine.TestCase
TestWindowMachine = WindowMachine.TestCase


def test_a_request_larger_than_the_whole_cpu_pool_can_never_be_swapped_out():
    """Found by exploring: 42 tokens and 3 lookahead slots hold 12 blocks; the CPU pool has 11
    (block 0 is null). Swapping out is NEVER (not NO_SPACE: no amount of waiting frees enough),
    and the request stays resident, its blocks and the pools untouched."""
    mgr = BlockManager(ManagerConfig(num_gpu_blocks=NUM_BLOCKS, num_cpu_blocks=NUM_CPU, max_model_len=MAX_LEN,
                                     groups=(GroupSpec(BS),), max_num_reqs=MAX_REQS, max_lookahead_tokens=8,
                                     debug_checks=True))
    assert mgr.allocate(0, 37, hash_prompt(np.zeros(36, np.int32), BS), 0).ok
    assert mgr.append_slots(0, 5, hash_prompt(np.zeros(40, np.int32), BS)[9:], 3).ok
    table = mgr.block_table(0).tolist()
    assert table == list(range(1, 13)) and mgr.cpu_pool.num_free == NUM_CPU - 1
    assert mgr.swap_out(0).status == STATUS_NEVER
    assert mgr.block_table(0).tolist() == table and mgr.cpu_pool.num_free == NUM_CPU - 1
    assert mgr.pool.ref_cnt[1:13].tolist() == [1] * 12 and not mgr.swapped[mgr.row_of(0)]
