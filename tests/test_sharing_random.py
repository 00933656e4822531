"""Two sessions of one tenant sharing a daemon's prefix cache, against the manager in process with
one writer per session: seeded random admissions of prompts sharing prefixes, decode steps that fill
and register blocks, frees and confirmations of earlier ticks (a block is another session's hit only
once its writer confirmed it) give the same statuses, the same prefix hits and the same tables."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.api import AdmitRequest, GroupSpec, ManagerConfig, StepBatch
from kvd.hashing import hash_prompt
from kvd.manager import BlockManager
from kvd.server import Daemon
from test_decode_op import BS, Cfg, InProc

class _Run:
    def __init__(self, seed: int, d: Daemon):
        self.rng = np.random.default_rng(seed)
        self.c = [InProc(d, json=False), InProc(d, json=False)]
        for c in self.c:
            c._auto_confirm = False  # confirmations only where the run gives them
        self.m = BlockManager(ManagerConfig(num_gpu_blocks=Cfg.num_gpu_blocks, max_model_len=Cfg.max_model_len,
                                            max_num_reqs=Cfg.max_num_reqs, groups=(GroupSpec(BS),),
                                            defer_cache_registration=True))
        self.prefixes = [self.rng.integers(1, 300, 16).astype(np.int32) for _ in range(2)]
        self.tokens: list[dict[str, np.ndarray]] = [{}, {}]
        self.registered: list[dict[str, int]] = [{}, {}]
        self.ticks: list[list[int]] = [[], []]  # each session's step ticks, for its confirmations
        self.hits = 0
        self.n = 0

    def admit(self, s: int) -> None:
        if len(self.tokens[s]) >= Cfg.max_reqs_per_session - 1:
            return
        rid = f"r{self.n}"
        self.n += 1
        p = np.concatenate([self.prefixes[int(self.rng.integers(0, 2))][: int(self.rng.integers(4, 17))],
                            self.rng.integers(1, 300, int(self.rng.integers(1, 6))).astype(np.int32)])
        req = AdmitRequest(rid, p.size, hash_prompt(p, BS))
        got = self.c[s].step(StepBatch(admit=[req]))
        want = self.m.step(StepBatch(admit=[AdmitRequest(f"{s}:{rid}", p.size, hash_prompt(p, BS))]), writer=s + 1)
        for f in ("admit_status", "admit_cached_tokens", "tick"):
            assert np.asarray(getattr(got, f)).tolist() == np.asarray(getattr(want, f)).tolist(), (f, s)
        self.ticks[s].append(want.tick)
        self.hits += int(want.admit_cached_tokens.sum())
        if want.admit_status.tolist() == [0]:
            self.tokens[s][rid], self.registered[s][rid] = p, p.size // BS

    def decode(self, s: int) -> None:
        rids = list(self.tokens[s])
        if not rids:
            return
        hashes, counts, new = [], [], {}
        for r in rids:
            new[r] = np.int32(self.rng.integers(1, 300))
            h = hash_prompt(np.append(self.tokens[s][r], new[r]), BS)[self.registered[s][r]:]
            hashes.append(h)
            counts.append(h.size)
        # the same appends by id both ways: the session's rows are its own, the manager's are global
        got = self.c[s].step(StepBatch(append_ids=rids, append_hashes=(np.concatenate(hashes),),
                                       append_hash_counts=(np.array(counts, np.int32),)))
        want = self.m.step(StepBatch(append_ids=[f"{s}:{r}" for r in rids], append_hashes=(np.concatenate(hashes),),
                                     append_hash_counts=(np.array(counts, np.int32),)), writer=s + 1)
        assert got.append_status.tolist() == want.append_status.tolist() and got.tick == want.tick
        self.ticks[s].append(want.tick)
        for r, st, k in zip(rids, want.append_status.tolist(), counts):
            if st == 0:
                self.tokens[s][r] = np.append(self.tokens[s][r], new[r])
                self.registered[s][r] += k

    def free(self, s: int) -> None:
        if self.tokens[s]:
            rid = list(self.tokens[s])[int(self.rng.integers(0, len(self.tokens[s])))]
            got = self.c[s].step(StepBatch(free=[rid]))
            want = self.m.step(StepBatch(free=[f"{s}:{rid}"]), writer=s + 1)
            assert got.free_status.tolist() == want.free_status.tolist() == [0]
            self.ticks[s].append(want.tick)
            del self.tokens[s][rid], self.registered[s][rid]

    def confirm(self, s: int) -> None:
        if self.ticks[s]:
            t = self.ticks[s][int(self.rng.integers(0, len(self.ticks[s])))]
            self.c[s].step(StepBatch(computed_through=t))
            want = self.m.step(StepBatch(computed_through=t), writer=s + 1)
            self.ticks[s].append(want.tick)

    def check_tables(self) -> None:
        for s in range(2):
            for rid in self.tokens[s]:
                assert self.c[s].block_table(rid).tolist() == self.m.block_table(f"{s}:{rid}").tolist(), (s, rid)


@pytest.mark.parametrize("seed", range(10))
def test_two_sessions_share_prefixes_as_two_writers_do_in_process(seed):
    d = Daemon(Cfg)
    try:
        run = _Run(seed, d)
        ops = [run.admit, run.admit, run.decode, run.decode, run.free, run.confirm]
        for _ in range(70):
            ops[int(run.rng.integers(0, len(ops)))](int(run.rng.integers(0, 2)))
            run.check_tables()
        assert run.hits > 0
    finally:
        for s in list(d.sessions.values()):
            d.end_session(s, "test")
