"""The daemon's decode entry (``BlockManager.decode_rows``, falling back to ``step`` whenever it
declines, as kvd.server does) against ``step`` alone: seeded random runs of admissions, forks
(copy-on-write), frees, confirmations and decode steps of random sizes, lookahead and filled-block
hashes (now and then a repeated row or hash counts that do not add up) on a pool small enough to
evict, applied to two managers, must leave both in the same state after every call, block ids
included, and give the same sizes, changed rows and copies."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kvd import errors
from kvd.api import AdmitRequest, GroupSpec, ManagerConfig, StepBatch
from kvd.hashing import hash_prompt
from kvd.manager import BlockManager

BS = 4


def _manager() -> BlockManager:
    return BlockManager(ManagerConfig(num_gpu_blocks=48, groups=(GroupSpec(BS),), max_model_len=96, max_num_reqs=12,
                                      defer_cache_registration=True))


def _state(m: BlockManager):
    p = m.pool
    return (p.ref_cnt.tobytes(), p.cache_key.tobytes(), p.block_hash.tobytes(), p.free_queue_order().tobytes(),
            copy.deepcopy(p.caches), m.tables[0].tobytes(), m.num_blocks[0].tobytes(), m.num_tokens.tobytes(),
            dict(m._row_of), m.tick, m.num_deferred)


class _Run:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.fast, self.slow = _manager(), _manager()
        self.prefix = self.rng.integers(1, 300, 16).astype(np.int32)
        self.tokens: dict[str, np.ndarray] = {}
        self.registered: dict[str, int] = {}
        self.n = 0
        self.taken = self.declined = 0  # decode_rows's answers: the run exercised both

    def both(self, fn):
        return fn(self.fast), fn(self.slow)

    def admit(self) -> None:
        reqs = []
        for _ in range(int(self.rng.integers(1, 3))):
            rid = f"r{self.n}"
            self.n += 1
            p = np.concatenate([self.prefix[: int(self.rng.integers(0, 17))],
                                self.rng.integers(1, 300, int(self.rng.integers(1, 12))).astype(np.int32)])
            self.tokens[rid], self.registered[rid] = p, p.size // BS
            reqs.append(AdmitRequest(rid, p.size, hash_prompt(p, BS)))
        a, b = self.both(lambda m: m.step(StepBatch(admit=reqs)))
        assert a.admit_status.tolist() == b.admit_status.tolist()
        for r, st in zip(reqs, a.admit_status.tolist()):
            if st:
                del self.tokens[r.req_id], self.registered[r.req_id]

    def fork(self) -> None:
        if not self.tokens:
            return
        parent = list(self.tokens)[int(self.rng.integers(0, len(self.tokens)))]
        child = f"r{self.n}"
        self.n += 1
        a, b = self.both(lambda m: m.step(StepBatch(forks=[(parent, child)])))
        assert a.fork_status.tolist() == b.fork_status.tolist()
        if a.fork_status.tolist() == [0]:
            self.tokens[child], self.registered[child] = self.tokens[parent].copy(), self.registered[parent]

    def free(self) -> None:
        if self.tokens:
            rid = list(self.tokens)[int(self.rng.integers(0, len(self.tokens)))]
            self.both(lambda m: m.step(StepBatch(free=[rid])))
            del self.tokens[rid], self.registered[rid]

    def confirm(self) -> None:
        self.both(lambda m: m.mark_computed(0, m.tick))

    def decode(self) -> None:
        if not self.tokens:
            return
        rids = [r for r in self.tokens if self.rng.random() < 0.8] or list(self.tokens)[:1]
        n_new = int(self.rng.choice([0, 1, 1, 1, 2, 5]))
        lookahead = int(self.rng.choice([0, 0, 1, 3]))
        new_tokens = {r: self.rng.integers(1, 300, n_new).astype(np.int32) for r in rids}
        hashes, counts = [], []
        for r in rids:
            t = np.concatenate([self.tokens[r], new_tokens[r]])
            h = hash_prompt(t, BS)[self.registered[r]:]
            hashes.append(h)
            counts.append(h.size)
        rows = self.fast.rows_of(rids)
        assert np.array_equal(rows, self.slow.rows_of(rids))
        if self.rng.random() < 0.1 and len(rids) > 1:
            rows = np.append(rows, rows[0]).astype(np.int32)  # a repeated row: both refuse it
            counts.append(0)
        hs = np.concatenate(hashes) if hashes else np.empty(0, "S16")
        cnt = np.array(counts, np.int32)
        if self.rng.random() < 0.1 and cnt.size:
            cnt[0] += 1  # counts that do not add up to the hashes: both refuse the step
        with_hashes = bool(hs.size) or self.rng.random() < 0.5
        batch = StepBatch(append_rows=rows, append_num_tokens=n_new, num_lookahead_tokens=lookahead,
                          append_hashes=(hs,) if with_hashes else (), append_hash_counts=(cnt,) if with_hashes else ())
        try:
            slow = self.slow.step(batch)
        except errors.KvdError as e:
            slow = e
        fast = self.fast.decode_rows(rows, n_new, lookahead, hs if with_hashes else None, cnt if with_hashes else None)
        self.taken += fast is not None
        self.declined += fast is None
        if fast is None:  # declined, nothing changed: the server's general path decides
            try:
                fres = self.fast.step(batch)
            except errors.KvdError as e:
                assert type(e) is type(slow)
                return
            for f in ("append_status", "sched_rows", "sched_start", "sched_len", "changed_rows", "copies", "tick"):
                assert np.array_equal(np.asarray(getattr(fres, f)), np.asarray(getattr(slow, f))), f
            ok = fres.append_status
        else:
            assert not isinstance(slow, Exception), slow
            old, grown, copies = fast
            assert slow.append_status.tolist() == [0] * rows.size
            assert old.tolist() == slow.sched_start.tolist() and grown.tolist() == slow.changed_rows.tolist()
            assert copies.tolist() == slow.copies.tolist()
            ok = np.zeros(rows.size, np.int16)
        for r, st, c in zip(rids, ok.tolist(), counts):
            if st == 0:
                self.tokens[r] = np.concatenate([self.tokens[r], new_tokens[r]])
                if with_hashes:
                    self.registered[r] += c


@pytest.mark.parametrize("seed", range(16))
def test_the_decode_entry_and_its_fallback_do_what_step_does(seed):
    run = _Run(seed)
    ops = [run.admit, run.admit, run.fork, run.free, run.confirm, run.decode, run.decode, run.decode, run.decode]
    for _ in range(80):
        ops[int(run.rng.integers(0, len(ops)))]()
        assert _state(run.fast) == _state(run.slow)
        assert run.fast.take_copies().tolist() == run.slow.take_copies().tolist()
    for m in (run.fast, run.slow):
        m.flush_deferred()
        m.check_invariants(heavy=True)
    assert _state(run.fast) == _state(run.slow)
    assert run.taken and run.declined and run.fast.pool.num_evictions, (run.taken, run.declined)
