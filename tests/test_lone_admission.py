"""A step that only admits one request (``BlockManager._lone_admission_step``, a new request's first
step) against the general step path on seeded random runs: lone admissions that hit, miss, wait for
space, never fit or are misuse (a repeated id, bad hashes, a bad size), with and without a
confirmation in the same step, between batched admissions, decode steps, frees, confirmations and
lookups of two writers. Every step's result and the whole manager state (block ids included) must
be the same after every call."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kvd import manager as manager_mod
from kvd.api import AdmitRequest, StepBatch
from kvd.errors import InvalidArgument
from kvd.hashing import hash_prompt
from test_deferral import BS, _Run

ALL_FIELDS = ("free_status", "fork_status", "append_status", "admit_status", "admit_rows", "admit_cached_tokens",
              "copies", "changed_rows", "sched_rows", "sched_start", "sched_len", "freed_rows", "tick")


def _state(m):
    p = m.pool
    return (p.ref_cnt.tobytes(), p.cache_key.tobytes(), p.unconfirmed_by.tobytes(), p.free_queue_order().tobytes(),
            m.tables[0].tobytes(), m.num_blocks[0].tobytes(), m.num_tokens.tobytes(), m.tick, m.num_deferred,
            dict(m.counters), sorted(m._row_of.items(), key=str))


class _Paths(_Run):
    """Manager 0 takes the lone-admission path, manager 1 the general one; both defer."""

    def __init__(self, seed: int):
        super().__init__(seed, events=True)
        self.m[1] = type(self.m[0])(self.m[0].config)
        self.m[1].log = self.m[1].enable_kv_events()
        self.lone = 0

    def both(self, fn):
        out = []
        for fast, m in zip((True, False), self.m):
            manager_mod._LONE_ADMISSION_PATH = fast
            try:
                out.append(fn(m))
            except Exception as exc:  # both must fail alike
                out.append(type(exc))
            finally:
                manager_mod._LONE_ADMISSION_PATH = True
        assert _state(self.m[0]) == _state(self.m[1])
        return out

    def same_results(self, results) -> None:
        a, b = results
        if isinstance(a, type) or isinstance(b, type):
            assert a == b
            return
        for f in ALL_FIELDS:
            x, y = np.asarray(getattr(a, f)), np.asarray(getattr(b, f))
            assert x.dtype == y.dtype and np.array_equal(x, y), f

    def admit(self, k: int) -> None:
        if k == 1:
            self.lone += 1
        super().admit(k)

    def odd_lone(self) -> None:
        """A lone admission that is misuse or never fits, or with a confirmation in the step."""
        w = int(self.rng.integers(1, 3))
        p = self.new_prompt()
        kind = int(self.rng.integers(0, 6))
        rid, n, hs, extra = f"x{self.next_id}", p.size, hash_prompt(p, BS), {}
        self.next_id += 1
        if kind == 0 and self.tokens:  # an id that is running
            rid = list(self.tokens)[0]
        elif kind == 1:
            n = 10_000  # longer than max_model_len: NEVER
        elif kind == 2:
            hs = np.zeros(3, np.int64)  # hashes of the wrong type
        elif kind == 3:
            n = 0
        elif kind == 4:
            extra = dict(computed_through=int(self.rng.integers(0, self.m[0].tick + 1)))
        else:
            extra = dict(append_rows=np.empty(0, np.int32))  # the daemon's empty append section
        req = AdmitRequest(rid, n, hs, token_ids=p.copy() if n == p.size else None)
        res = self.both(lambda m: m.step(StepBatch(admit=[copy.copy(req)], **extra), writer=w))
        self.same_results(res)
        if not isinstance(res[0], type) and res[0].admit_status.tolist() == [0]:
            self.tokens[rid], self.writer[rid], self.registered[rid] = p, w, p.size // BS
        self.lone += 1


@pytest.mark.parametrize("seed", range(40))
def test_the_lone_admission_path_does_what_the_general_step_does(seed):
    run = _Paths(seed)
    ops = [lambda: run.admit(1), lambda: run.admit(1), lambda: run.admit(int(run.rng.integers(2, 4))),
           run.odd_lone, run.decode, run.decode, run.decode, run.free, run.confirm, run.lookup]
    for _ in range(80):
        ops[int(run.rng.integers(0, len(ops)))]()
    run.m[0].flush_deferred()
    run.m[1].flush_deferred()
    assert _state(run.m[0]) == _state(run.m[1])
    assert run.lone > 10 and run.m[0].pool.num_evictions > 0
    run.m[0].check_invariants(heavy=True)


def test_a_step_of_one_admission_takes_the_lone_path_only_without_other_work(monkeypatch):
    calls = []
    real = manager_mod.BlockManager._lone_admission_step
    monkeypatch.setattr(manager_mod.BlockManager, "_lone_admission_step",
                        lambda self, *a: calls.append(a[0].req_id) or real(self, *a))
    run = _Paths(0)
    m = run.m[0]
    p = np.arange(1, 10, dtype=np.int32)
    m.step(StepBatch(admit=[AdmitRequest("a", p.size, hash_prompt(p, BS))]))
    m.step(StepBatch(admit=[AdmitRequest("b", p.size, hash_prompt(p, BS))], free=["a"]))
    m.step(StepBatch(admit=[AdmitRequest("c", p.size, hash_prompt(p, BS))], append_rows=m.rows_of(["b"])))
    with pytest.raises(InvalidArgument):  # the general path's check of append_num_tokens
        m.step(StepBatch(admit=[AdmitRequest("d", p.size, hash_prompt(p, BS))], append_num_tokens=True))
    assert calls == ["a"]
