"""The binary decode op against the JSON step, through ``Daemon.handle``, on seeded random runs:
admissions (lone and batched, sharing prefixes), forks (copy-on-write), frees and decode steps of
random sizes, lookahead and filled-block hashes, in a pool small enough to evict. One client sends
its decode steps as the decode op, the other as JSON steps, each to a daemon of its own: every
reply, the session's shared memory (tables, counts, slot mapping) and each manager's state must be
the same after every call."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kvd import protocol as P
from kvd.api import AdmitRequest, StepBatch
from kvd.hashing import hash_prompt
from kvd.server import Daemon
from test_decode_op import Cfg, InProc

FIELDS = ("free_status", "fork_status", "append_status", "admit_status", "admit_rows", "admit_cached_tokens",
          "copies", "changed_rows", "sched_rows", "sched_start", "sched_len", "tick")


def _manager_state(d: Daemon):
    m = d.manager
    p = m.pool
    return (p.ref_cnt.tobytes(), p.cache_key.tobytes(), p.free_queue_order().tobytes(), copy.deepcopy(p.caches),
            m.tables[0].tobytes(), m.num_tokens.tobytes(), m.tick, m.num_deferred)


class _Run:
    """A seeded run on a pair of clients, each to a daemon of its own, of any number of KV-cache
    groups (each group's hashes of every prompt and filled block). ``FREES``: decode steps free a
    request now and then (the decode_free op); ``PREFIX``: the shared prefix's tokens; ``N_NEW``: the
    token counts a decode step draws from."""

    FREES = False
    ADMITS = False  # decode steps admit new requests now and then (the decode_free op with admissions)
    PREFIX = 12
    N_NEW = (0, 1, 1, 1, 2, 3, 5, 7)  # tokens a decode step appends to each (5 and 7: two blocks of 4 at once)

    def __init__(self, seed: int, pair):
        self.rng = np.random.default_rng(seed)
        self.c = pair
        self.sizes = list(pair[0].d.block_sizes)
        self.prefix = self.rng.integers(1, 300, self.PREFIX).astype(np.int32)
        self.tokens: dict[str, np.ndarray] = {}
        self.registered: dict[str, list[int]] = {}  # each group's registered blocks
        self.n = 0

    def hashes(self, tokens, start):
        """Each group's hashes of ``tokens``' full blocks from ``start[g]`` on (one array for one group)."""
        hs = [hash_prompt(tokens, bs)[s:] for bs, s in zip(self.sizes, start)]
        return hs[0] if len(hs) == 1 else hs

    def step(self, batch: StepBatch):
        res = [c.step(batch) for c in self.c]
        a, b = res
        for f in FIELDS:
            assert np.array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f))), f
        s0, s1 = self.c[0].shm, self.c[1].shm
        assert np.array_equal(s0.tables[0], s1.tables[0]) and np.array_equal(s0.counts[0], s1.counts[0])
        assert np.array_equal(s0.slot_array, s1.slot_array)
        assert _manager_state(self.c[0].d) == _manager_state(self.c[1].d)
        for c in self.c:  # and both are the manager's own rows (the decode op's mirror, the step's publish)
            sess = c.d.sessions[c.sid]
            srows = np.flatnonzero(sess.mrow >= 0)
            mrows = sess.mrow[srows]
            counts = c.d.manager.num_blocks[0][mrows]
            assert np.array_equal(c.shm.counts[0][srows], counts)
            for sr, mr, n in zip(srows.tolist(), mrows.tolist(), counts.tolist()):
                assert np.array_equal(c.shm.tables[0][sr, :n], c.d.manager.tables[0][mr, :n]), (sr, mr)
        return a

    def admit(self) -> None:
        reqs = self._new_admissions()
        if not reqs:
            return
        self._admitted(reqs, self.step(StepBatch(admit=reqs)))

    def _new_admissions(self) -> list[AdmitRequest]:
        reqs = []
        for _ in range(int(self.rng.integers(1, 3))):
            if len(self.tokens) + len(reqs) >= Cfg.max_reqs_per_session:
                break
            rid = f"r{self.n}"
            self.n += 1
            p = np.concatenate([self.prefix[: int(self.rng.integers(0, self.PREFIX + 1))],
                                self.rng.integers(1, 300, int(self.rng.integers(1, 9))).astype(np.int32)])
            self.tokens[rid], self.registered[rid] = p, [p.size // bs for bs in self.sizes]
            reqs.append(AdmitRequest(rid, p.size, self.hashes(p, [0] * len(self.sizes))))
        return reqs

    def _admitted(self, reqs: list[AdmitRequest], res) -> None:
        for r, st in zip(reqs, res.admit_status.tolist() if res is not None else [1] * len(reqs)):
            if st:
                del self.tokens[r.req_id], self.registered[r.req_id]

    def fork(self) -> None:
        if not self.tokens or len(self.tokens) >= Cfg.max_reqs_per_session:
            return
        parent = list(self.tokens)[int(self.rng.integers(0, len(self.tokens)))]
        child = f"r{self.n}"
        self.n += 1
        res = self.step(StepBatch(forks=[(parent, child)]))
        if res is not None and res.fork_status.tolist() == [0]:
            self.tokens[child], self.registered[child] = self.tokens[parent].copy(), list(self.registered[parent])

    def _pick_free(self) -> list[str]:
        if not self.tokens:
            return []
        rid = list(self.tokens)[int(self.rng.integers(0, len(self.tokens)))]
        del self.tokens[rid], self.registered[rid]
        return [rid]

    def free(self) -> None:
        frees = self._pick_free()
        if frees:
            self.step(StepBatch(free=frees))

    def decode(self) -> None:
        frees = self._pick_free() if self.FREES and self.rng.random() < 0.25 else []
        rids = [r for r in self.tokens if self.rng.random() < 0.8]
        if not rids:
            return
        n_new = int(self.rng.choice(self.N_NEW))
        lookahead = int(self.rng.choice([0, 0, 1]))
        new = {r: self.rng.integers(1, 300, n_new).astype(np.int32) for r in rids}
        G = len(self.sizes)
        hashes, counts = [[] for _ in range(G)], [[] for _ in range(G)]
        for r in rids:
            hs = self.hashes(np.concatenate([self.tokens[r], new[r]]), self.registered[r])
            for g, h in enumerate([hs] if G == 1 else hs):
                hashes[g].append(h)
                counts[g].append(h.size)
        rows = self.c[0].rows_of(rids)
        with_hashes = sum(map(sum, counts)) > 0 and self.rng.random() < 0.8
        admits = self._new_admissions() if self.ADMITS and self.rng.random() < 0.3 else []
        batch = StepBatch(free=frees, append_rows=rows, append_num_tokens=n_new, num_lookahead_tokens=lookahead,
                          append_hashes=tuple(np.concatenate(h) for h in hashes) if with_hashes else (),
                          append_hash_counts=tuple(np.array(c, np.int32) for c in counts) if with_hashes else (),
                          admit=admits)
        res = self.step(batch)
        if admits:
            self._admitted(admits, res)
        if res is None:
            return
        for i, (r, st) in enumerate(zip(rids, res.append_status.tolist())):
            if st == 0:
                self.tokens[r] = np.concatenate([self.tokens[r], new[r]])
                if with_hashes:
                    self.registered[r] = [reg + c[i] for reg, c in zip(self.registered[r], counts)]



def run_ops(run: _Run, n: int) -> None:
    """``n`` random calls of a run: admissions, forks, frees and (half of them) decode steps."""
    ops = [run.admit, run.admit, run.fork, run.free, run.decode, run.decode, run.decode, run.decode]
    for _ in range(n):
        ops[int(run.rng.integers(0, len(ops)))]()


def assert_same_managers(daemons, state=_manager_state) -> None:
    """Both daemons' managers, their deferred work done, sound and in the same state."""
    for d in daemons:
        d.manager.flush_deferred()
        d.manager.check_invariants(heavy=True)
    assert state(daemons[0]) == state(daemons[1])


@pytest.mark.parametrize("seed", range(12))
def test_the_decode_op_and_the_json_step_agree_on_random_runs(seed):
    daemons = [Daemon(Cfg), Daemon(Cfg)]
    try:
        run = _Run(seed, [InProc(daemons[0], json=False), InProc(daemons[1], json=True)])
        run_ops(run, 60)
        decode_ops = sum(rep[0][:4] == P.DECODE_REPLY_MAGIC for rep in run.c[0].raw)
        assert decode_ops >= 5 and not any(rep[0][:4] == P.DECODE_REPLY_MAGIC for rep in run.c[1].raw)
        assert_same_managers(daemons)
    finally:
        for d in daemons:
            for s in list(d.sessions.values()):
                d.end_session(s, "test")
