"""Misuse through the daemon is judged as the manager judges it in process: seeded random steps
mixing valid items with unknown or repeated ids, existing children, bad sizes and bad hashes go to
a session of a daemon (through ``Daemon.handle``; the client judges some items itself, the daemon
the rest) and to a ``BlockManager`` of the same configuration. Every item's status and cached
tokens must agree, and the valid items must leave both with the same block tables: bad input
costs its own item and nothing else."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.api import AdmitRequest, ManagerConfig, StepBatch
from kvd.errors import BadHashes, DuplicateRequest, InvalidArgument, UnknownRequest
from kvd.hashing import hash_prompt
from kvd.manager import BlockManager
from kvd.server import Daemon
from test_decode_op import BS, Cfg, InProc

STATUS = ("free_status", "fork_status", "append_status", "admit_status", "admit_cached_tokens")


class _Run:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.d = Daemon(Cfg)
        self.c = InProc(self.d, json=False)
        # the daemon's manager, as a session sees it: one writer whose own blocks it hits
        self.m = BlockManager(ManagerConfig(num_gpu_blocks=Cfg.num_gpu_blocks, max_model_len=Cfg.max_model_len,
                                            max_num_reqs=Cfg.max_num_reqs, groups=self.d.manager.config.groups,
                                            defer_cache_registration=True))
        self.prefix = self.rng.integers(1, 300, 12).astype(np.int32)
        self.live: list[str] = []
        self.n = 0
        self.codes: set[int] = set()  # the error codes seen (the run must have exercised misuse)

    def pick(self, p_unknown: float = 0.2) -> str:
        if not self.live or self.rng.random() < p_unknown:
            return f"ghost{int(self.rng.integers(0, 3))}"
        return self.live[int(self.rng.integers(0, len(self.live)))]

    def new_id(self) -> str:
        self.n += 1
        return f"r{self.n}"

    def admission(self) -> tuple[AdmitRequest, bool]:
        """(an admission, whether it is well formed: only then does a step repeat its id, since
        the client refuses a repeated id in batch order whatever the daemon makes of the first)."""
        kind = self.rng.random()
        rid = self.pick(0.0) if kind < 0.1 and self.live else self.new_id()  # an id in use
        p = np.concatenate([self.prefix[: int(self.rng.integers(0, 13))],
                            self.rng.integers(1, 300, int(self.rng.integers(1, 9))).astype(np.int32)])
        hashes = hash_prompt(p, BS)
        n = p.size
        if 0.1 <= kind < 0.15:
            hashes = np.concatenate([hashes, hash_prompt(p + 1, BS)[:2]])  # more hashes than full blocks
        elif 0.15 <= kind < 0.2:
            n = Cfg.max_model_len + 1  # longer than any request may be
        elif 0.2 <= kind < 0.25:
            hashes = hashes.astype("S8")  # another width
        return AdmitRequest(rid, n, hashes), kind >= 0.25

    def batch(self) -> StepBatch:
        r = self.rng.random
        free = [self.pick() for _ in range(int(self.rng.integers(0, 3)))]
        forks = []
        for _ in range(int(self.rng.integers(0, 2))):
            child = self.pick(0.0) if r() < 0.2 and self.live else self.new_id()
            forks.append((self.pick(), child))
        app = [self.pick(0.15) for _ in range(int(self.rng.integers(0, 4)))]
        ntok = np.array([int(self.rng.choice([0, 1, 2, -1, 60, 2**40])) if r() < 0.2 else 1 for _ in app], np.int64)
        while ntok[(ntok > 0) & (ntok < 2**31)].sum() > Cfg.max_num_batched_tokens:
            ntok[np.argmax(np.where(ntok < 2**31, ntok, 0))] = 1  # the daemon refuses a step past its slot buffer
        made = [self.admission() for _ in range(int(self.rng.integers(0, 3)))]
        admit = [a for a, _ in made]
        if made and made[0][1] and r() < 0.1:
            admit.append(AdmitRequest(admit[0].req_id, admit[0].num_tokens, admit[0].block_hashes))  # twice in a step
        return StepBatch(free=free, forks=forks, append_ids=app, append_num_tokens=ntok, admit=admit)

    def step(self) -> None:
        b = self.batch()
        if len(self.live) + len(b.admit) + len(b.forks) > Cfg.max_reqs_per_session:
            b.admit, b.forks = [], []  # the session's rows, not the manager's, would run out first
        got = self.c.step(b)
        want = self.m.step(b)
        for f in STATUS:
            assert np.asarray(getattr(got, f)).tolist() == np.asarray(getattr(want, f)).tolist(), (f, b)
            if f.endswith("status"):
                self.codes |= set(np.asarray(getattr(want, f)).tolist()) - {0}
        alive = set(self.m._row_of)
        assert alive == set(self.c._row_of), "the client's rows and the manager's requests differ"
        self.live = sorted(alive)
        for rid in self.live:
            assert self.c.block_table(rid).tolist() == self.m.block_table(rid).tolist(), rid


@pytest.mark.parametrize("seed", range(12))
def test_misuse_through_the_daemon_is_judged_as_in_process(seed):
    run = _Run(seed)
    try:
        for _ in range(40):
            run.step()
            run.c.step(StepBatch())  # (the session confirms what it computed, as an engine's next step does)
            run.m.step(StepBatch())
        # misuse was exercised: bad counts and unknown ids, and duplicate ids or bad hashes
        assert {InvalidArgument.code, UnknownRequest.code} <= run.codes, run.codes
        assert run.codes & {DuplicateRequest.code, BadHashes.code}, run.codes
    finally:
        for s in list(run.d.sessions.values()):
            run.d.end_session(s, "test")
