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


def _manager(groups, blocks: int) -> BlockManager:
    return BlockManager(ManagerConfig(num_gpu_blocks=blocks, groups=groups, max_model_len=96, max_num_reqs=12))


def _state(m: BlockManager):
    p = m.pool
    groups = [(g.table.tobytes(), g.num_blocks.tobytes(), g.last_block.tobytes(), g.num_registered.tobytes(),
               g.num_skipped.tobytes()) for g in m.groups]
    return (p.ref_cnt.tobytes(), p.cache_key.tobytes(), p.block_hash.tobytes(), p.free_queue_order().tobytes(),
            copy.deepcopy(p.caches), groups, m.num_tokens.tobytes(), dict(m._row_of), m.tick, dict(m.counters))


_RESULT_FIELDS = ("free_status", "fork_status", "append_status", "admit_status", "admit_rows", "admit_cached_tokens",
                  "copies", "changed_rows", "sched_rows", "sched_start", "sched_len", "freed_rows", "tick")


class _Run:
    def __init__(self, seed: int, groups, blocks: int):
        self.rng = np.random.default_rng(seed)
        self.groups = groups
        self.fast, self.slow = _manager(groups, blocks), _manager(groups, blocks)
        self.prefix = self.rng.integers(1, 300, 24).astype(np.int32)
        self.tokens: dict[str, np.ndarray] = {}
        self.registered: dict[str, list[int]] = {}
        self.n = 0
        self.taken = 0  # steps whose appends the several-groups path took whole

        real = self.fast._append_fast_groups

        def counted(*a, **k):
            out = real(*a, **k)
            self.taken += out is not None
            return out
        self.fast._append_fast_groups = counted

    def hashes(self, tokens: np.ndarray, start: list[int]) -> list[np.ndarray]:
        return [hash_prompt(tokens, g.block_size)[s:] for g, s in zip(self.groups, start)]

    def step(self, batch: StepBatch):
        """The step on both managers: the same result, or the same error."""
        try:
            a = self.fast.step(batch)
        except errors.KvdError as e:
            a = e
        with _request_by_request():
            try:
                b = self.slow.step(batch)
            except errors.KvdError as e:
                b = e
        if isinstance(b, Exception):
            assert type(a) is type(b), (a, b)
            return None
        assert not isinstance(a, Exception), a
        for f in _RESULT_FIELDS:
            assert np.array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f))), f
        return a

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
        self.fast.mark_computed(0, self.fast.tick)
        self.slow.mark_computed(0, self.slow.tick)

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


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", range(6))
def test_the_several_groups_path_does_what_the_request_by_request_path_does(name, seed):
    run = _Run(seed, CONFIGS[name], blocks=40)
    ops = [run.admit, run.admit, run.fork, run.confirm, run.decode, run.decode, run.decode, run.decode]
    for _ in range(90):
        ops[int(run.rng.integers(0, len(ops)))]()
        run.fast.check_invariants(heavy=True)
        assert _state(run.fast) == _state(run.slow)
    for m in (run.fast, run.slow):
        m.check_invariants(heavy=True)
    assert run.taken >= 5, run.taken
    assert run.fast.pool.num_evictions, "the pool never evicted: a run too small to test the order of takes"
