"""A refused message changes nothing: every error reply leaves the daemon exactly as it was.

Seeded random runs through ``Daemon.handle`` (no sockets): valid traffic of every kind (steps with
admissions, appends and frees, decode steps, forks, swaps, allocations, appends, confirmations)
mixed with mutations of those messages (bytes flipped, frames cut, dropped or added, header fields
replaced, other ops). Before each mutated message the daemon's deferred work is run, and its state
taken: every numpy array and plain value reachable from the manager (pools, groups, prefix index,
queues, ticks) and from each session (row maps, shared-memory tables and counts). An error reply
must leave all of it as it was; no message may raise out of ``handle`` or get an internal error;
the heavy invariants hold after every message. Then the same for the client's and the manager's own
refusals: every API call with arguments of every wrong kind mixed in must raise a KvdError (never a
bare TypeError or ValueError) and leave the client, the daemon or the manager as they were. Plus
the cases the runs found, one by one."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvd import errors
from kvd import protocol as P
from kvd.api import AdmitRequest, GroupSpec, ManagerConfig, StepBatch
from kvd.hashing import hash_prompt
from kvd.manager import BlockManager
from kvd.server import Daemon
from kvd.shm import segment_name
from kvd_client.client import Client
from kvd_client.step import DecodeWithFrees
from test_decode_op import InProc as _DecodeInProc
from test_server import _mutate

_SCRATCH = {"_copies_buf", "_changed_buf", "_srows_buf", "_mark", "_per_prio", "buf"}  # contents meaningless
_VIEWS = {"_group_arrays"}  # the manager's group arrays again (pictured under their own names)


class Cfg:
    block_size = 4
    num_gpu_blocks = 80
    num_cpu_blocks = 48
    max_model_len = 64
    max_num_reqs = 16
    max_reqs_per_session = 8
    max_num_batched_tokens = 128


class HybridCfg(Cfg):
    """Two KV-cache groups: full attention and a sliding window of 16 tokens."""

    @staticmethod
    def group_specs():
        return ((4, 0), (4, 16))


class InProc(_DecodeInProc):
    """A client core calling ``Daemon.handle`` directly (a writer of the shared prefix cache)."""

    def __init__(self, d: Daemon, confirm: str = "auto"):
        super().__init__(d, json=False, confirm=confirm)


def _walk(obj, prefix: str, out: dict, seen: set, depth: int = 0) -> None:
    if id(obj) in seen or depth > 3 or not hasattr(obj, "__dict__"):
        return
    seen.add(id(obj))
    for k, v in vars(obj).items():
        if k.startswith(("_plan", "_gplan")) or k in _SCRATCH or k in _VIEWS:
            continue
        if isinstance(v, np.ndarray):
            out[prefix + k] = v.copy()
        elif isinstance(v, (list, tuple)) and v and all(isinstance(x, np.ndarray) for x in v):
            out.update({f"{prefix}{k}[{i}]": x.copy() for i, x in enumerate(v)})
        elif isinstance(v, (list, tuple)) and v and all(hasattr(x, "__dict__") for x in v):
            for i, x in enumerate(v):
                _walk(x, f"{prefix}{k}[{i}].", out, seen, depth + 1)
        elif isinstance(v, (dict, list, set, tuple, int, str, float)):
            r = repr(v)
            if " at 0x" not in r:  # (a repr naming objects by address says nothing about their state)
                out[prefix + k] = r
        elif type(v).__module__.startswith("kvd"):
            _walk(v, prefix + k + ".", out, seen, depth + 1)


def state_of(d: Daemon) -> dict:
    """Every array and plain value of the manager and the sessions (their segments' views included)."""
    out: dict = {}
    seen: set = set()
    _walk(d.manager, "m.", out, seen)
    for sid, s in d.sessions.items():
        _walk(s, f"s{sid}.", out, seen)
        for name in ("tables", "counts"):
            out.update({f"s{sid}.shm.{name}[{i}]": np.array(a) for i, a in enumerate(getattr(s.shm, name))})
        out[f"s{sid}.shm.row_tags"] = np.array(s.shm.row_tags)
    return out


def changed(a: dict, b: dict) -> list[str]:
    def same(x, y):
        if isinstance(x, np.ndarray) and isinstance(y, np.ndarray):
            return x.shape == y.shape and np.array_equal(x, y)
        return type(x) is type(y) and x == y
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not same(a[k], b[k]))


@pytest.fixture
def new_daemon():
    """Daemons in process; every session they still hold ends afterwards (its segment unlinked)."""
    made: list[Daemon] = []

    def make(cfg=Cfg) -> Daemon:
        made.append(Daemon(cfg))
        return made[-1]

    yield make
    for d in made:
        for s in list(d.sessions.values()):
            d.end_session(s, "test")
        prefix = segment_name(d.pid, d.epoch, "")
        left = [p for p in os.listdir("/dev/shm") if p.startswith(prefix)] if os.path.isdir("/dev/shm") else []
        assert not left, f"segments outlived their sessions: {left}"


class _Run:
    """One seeded run: ``valid()`` sends a well-formed message of a random kind through the
    client, ``mutated()`` a mutation of one and returns what the check found."""

    KINDS = ("step", "step", "decode", "decode_free", "fork", "swap_out", "swap_in", "common", "computed", "allocate",
             "append")

    def __init__(self, seed: int, d: Daemon):
        self.rng = np.random.default_rng(seed)
        self.d = d
        self.c = InProc(self.d)
        self.ids = iter(range(10**6, 10**7))
        self.prefix = self.rng.integers(1, 300, 8)
        self.swapped: set = set()
        self.refused = 0

    def running(self):
        return [r for r in self.c.request_ids if r not in self.swapped]

    def _hashes(self, tokens):
        """The prompt's block hashes, one array per KV-cache group when there are several."""
        c, groups = self.c, range(len(self.c.block_sizes))
        return c.hash_prompt(tokens) if len(groups) == 1 else [c.hash_prompt(tokens, g) for g in groups]

    def _prompt(self):
        n = int(self.rng.integers(1, 40))
        toks = self.rng.integers(1, 300, n)
        return np.concatenate([self.prefix, toks]) if self.rng.random() < 0.5 else toks

    def spec(self, kind: str):
        c, rng, run = self.c, self.rng, self.running()
        if kind == "step" or not run:
            admits = []
            for _ in range(int(rng.integers(0, 3))):
                t = self._prompt()
                admits.append(AdmitRequest(next(self.ids), t.size, self._hashes(t) if rng.random() < 0.6 else ()))
            app = [r for r in run if rng.random() < 0.5]
            free = [r for r in c.request_ids if r not in app and rng.random() < 0.2]
            return c._req_step(StepBatch(admit=admits, append_ids=app, free=free))
        if kind == "decode":
            rows = np.asarray(c.rows_of(run), np.int32)
            k = int(rng.integers(0, len(run) + 1))
            if k and rng.random() < 0.5:  # every group's hashes of a filled block
                cnt = np.zeros(len(run), np.int32)
                cnt[:k] = 1
                G = len(c.block_sizes)
                return c._req_decode(rows, 1, 0, None, tuple(np.frombuffer(rng.bytes(16 * k), "S16") for _ in range(G)),
                                     (cnt,) * G, G)
            return c._req_decode(rows, int(rng.integers(0, 3)), 0)
        if kind == "decode_free":
            return DecodeWithFrees(c, self._decode_free(run), len(c.block_sizes)).spec()
        if kind == "fork":
            return c._req_fork(run[int(rng.integers(0, len(run)))], next(self.ids))
        if kind == "swap_out":
            return c._req_swap_out([r for r in run if rng.random() < 0.5])
        if kind == "swap_in":
            return c._req_swap_in(list(self.swapped) if self.swapped and rng.random() < 0.8 else run[:1])
        if kind == "common":
            return c._req_num_common_prefix_blocks(run[0], int(rng.integers(0, 4)))
        if kind == "allocate":
            t = self._prompt()
            return c._req_allocate(next(self.ids), t.size, self._hashes(t) if rng.random() < 0.5 else ())
        if kind == "append":
            return c._req_append_slots(run[int(rng.integers(0, len(run)))], int(rng.integers(0, 5)))
        return c._req_mark_computed()

    def _decode_free(self, run: list) -> StepBatch:
        """A step that frees one running request and appends to the others, maybe admitting one
        (the decode_free op)."""
        rows = np.asarray(self.c.rows_of(run[1:]), np.int32)
        admit = []
        if self.rng.random() < 0.3:
            t = self._prompt()
            admit.append(AdmitRequest(next(self.ids), t.size, self._hashes(t)))
        return StepBatch(free=run[:1], append_rows=rows, append_num_tokens=int(self.rng.integers(0, 3)), admit=admit)

    def valid(self) -> None:
        c, rng, kind = self.c, self.rng, self.KINDS[int(self.rng.integers(0, len(self.KINDS)))]
        run = self.running()
        try:
            if kind == "swap_out" and run:
                sel = [r for r in run if rng.random() < 0.5]
                if sel and c._do(c._req_swap_out(sel)).ok:
                    self.swapped.update(sel)
            elif kind == "swap_in" and self.swapped:
                if c._do(c._req_swap_in(list(self.swapped))).ok:
                    self.swapped.clear()
            elif kind == "decode" and run:
                c.step(StepBatch(append_rows=np.asarray(c.rows_of(run), np.int32), append_num_tokens=1))
            elif kind == "decode_free" and run:
                c.step(self._decode_free(run))
            elif kind == "fork" and run:
                c._do(c._req_fork(run[0], next(self.ids)))
            elif kind == "allocate":
                c._do(c._req_allocate(next(self.ids), int(rng.integers(1, 40))))
            else:
                t = self._prompt()
                c.step(StepBatch(admit=[AdmitRequest(next(self.ids), t.size, self._hashes(t))],
                                 append_ids=run[: int(rng.integers(0, len(run) + 1))]))
        except errors.KvdError:
            pass  # a pool too small now, a request too long: the run goes on
        self.d.manager.check_invariants(heavy=True)

    def mutated(self) -> tuple | None:
        """Send a mutation of a random message; None, or (what went wrong, the reply)."""
        c, rng = self.c, self.rng
        kind = self.KINDS[int(rng.integers(0, len(self.KINDS)))]
        try:
            spec = self.spec(kind)
        except errors.KvdError:  # refused by the client already (no free row in the session)
            return None
        if spec is None:
            return None
        op, fields, frames = spec[0], spec[1], list(spec[2])
        if len(spec) > 4:
            spec[4]()  # the client tracks nothing this message may create
        seq = c._next_seq()
        if op is P.DECODE or op is P.ADMIT or op is P.DECODE_FREE:  # a binary header: its fields, mutated
            f = list(fields)
            for _ in range(int(rng.integers(0, 3))):
                f[int(rng.integers(0, len(f)))] = [0, 1, 7, 2**31, 2**32 - 1, c.tick, c.tick + 5][int(rng.integers(0, 7))]
            for _ in range(int(rng.integers(0, 3))):
                k = int(rng.integers(0, 3))
                if k == 0 and frames:
                    frames[int(rng.integers(0, len(frames)))] = rng.bytes(int(rng.integers(0, 40)))
                elif k == 1:
                    frames.append(rng.bytes(int(rng.integers(0, 40))))
                elif frames:
                    frames.pop()
            try:
                hdr = c._header(op, c.sid, seq, tuple(f))
            except Exception:  # a field the binary header cannot hold
                return None
        else:
            fields = dict(fields)
            if "fl" in fields and rng.random() < 0.5:  # the step's frames one by one
                count = P.step_frame_count(len(c.block_sizes), token_ids=True)
                frames = P.unpack_frames(fields.pop("fl"), frames, count)
            fields, frames = _mutate(rng, fields, frames)
            try:
                hdr = P.request(fields.pop("op", op), c.sid, seq, **fields)
            except TypeError:
                return None
        m = self.d.manager
        while m.num_deferred:  # work that is due anyway, done before the picture
            m.flush_deferred()
        before = state_of(self.d)
        rep = self.d.handle([b"id", hdr, *frames])
        h = P.parse_reply(rep[0])
        m.check_invariants(heavy=True)
        if "err" not in h:  # a mutation the daemon accepted: the client's view is stale, start over
            for s in list(self.d.sessions.values()):
                self.d.end_session(s, "test")
            self.c, self.swapped = InProc(self.d), set()
            return None
        self.refused += 1
        if h["err"] == errors.KvdError.code:
            return ("internal error", kind, h)
        diff = changed(before, state_of(self.d))
        return (diff, kind, h) if diff else None


@pytest.mark.parametrize("seed", range(8))
def test_every_refused_message_leaves_the_daemon_as_it_was(seed, new_daemon):
    """Seeds 6 and 7: a daemon of two KV-cache groups (full attention and a sliding window)."""
    run = _Run(seed, new_daemon(HybridCfg if seed >= 6 else Cfg))
    found, most = [], 0
    for _ in range(300):
        if run.rng.random() < 0.4:
            run.valid()
        else:
            bad = run.mutated()
            if bad is not None:
                found.append(bad)
        most = max(most, run.d.manager.num_requests)
    assert not found, found[:3]
    assert run.refused > 80 and most >= 4  # the run refused many messages, among live requests


def test_the_state_picture_sees_a_tick_a_table_entry_and_a_segment_byte(new_daemon):
    d = new_daemon()
    c = InProc(d)
    c.step(StepBatch(admit=[AdmitRequest("a", 10)]))
    before = state_of(d)
    d.manager.tick += 1
    d.manager.groups[0].table[0, 5] = 7  # (the manager's ``tables`` are the groups' tables)
    d.sessions[c.sid].shm.counts[0][3] = 9
    assert changed(before, state_of(d)) == ["m.groups[0].table", "m.tables[0]", "m.tick", f"s{c.sid}.shm.counts[0]"]


# ---------------------------------------------------------------- the cases the runs found
def test_misuse_of_a_whole_call_leaves_the_tick():
    m = BlockManager(ManagerConfig(num_gpu_blocks=32, max_model_len=64, max_num_reqs=4))
    m.allocate("a", 8)
    tick = m.tick
    with pytest.raises(errors.BadHashes):
        m.allocate("b", 6, np.frombuffer(b"x" * 16 * 7, "S16"))  # 7 hashes for 6 tokens
    with pytest.raises(errors.BadHashes):
        m.append_slots("a", 1, np.frombuffer(b"y" * 16 * 3, "S16"))
    with pytest.raises(errors.InvalidArgument):
        m.append_slots("a", 1, num_lookahead_tokens=10**6)
    with pytest.raises(errors.InvalidArgument):
        m.step(StepBatch(append_ids=["a"], append_num_tokens=[1, 2]))
    with pytest.raises(errors.InvalidArgument):
        m.step(StepBatch(append_rows=np.array([m.row_of("a")], np.int32), append_num_tokens=16,
                         append_hashes=(np.frombuffer(b"z" * 16, "S16"),), append_hash_counts=(np.ones(1, np.int32),),
                         append_token_ids=(np.full(16, -1, np.int32),)))
    assert m.tick == tick
    assert m.append_slots("a", 1).ok and m.tick == tick + 1




@pytest.mark.parametrize("how", ["decode lookahead", "decode token ids", "step lookahead"])
def test_a_refused_step_does_not_count_its_confirmation(how, new_daemon):
    """A writer's registered blocks become hits for its tenant's other sessions once it confirms
    them; a confirmation riding on a step that is refused as a whole does not count."""
    d = new_daemon()
    a, b = InProc(d, confirm="explicit"), InProc(d, confirm="explicit")
    prompt = np.arange(1, 13, dtype=np.int32)  # 3 full blocks of 4
    a.step(StepBatch(admit=[AdmitRequest("p", 12, a.hash_prompt(prompt))]))
    tick = a.tick
    row = np.asarray(a.rows_of(["p"]), np.int32)
    seq = a._next_seq()
    if how.startswith("decode"):
        la = Cfg.max_model_len + 1 if how == "decode lookahead" else 0
        frames = [row.tobytes()]
        if how == "decode token ids":  # a hash with token ids out of range
            frames += [b"h" * 16, np.ones(1, np.int32).tobytes(), np.full(4, -5, np.int32).tobytes()]
        msg = [a._header(P.DECODE, a.sid, seq, (tick, 1, 4 if frames[1:] else 1, la)), *frames]
    else:
        spec = a._req_step(StepBatch(append_ids=["p"], computed_through=tick))  # a JSON step, by id
        fields = dict(spec[1])
        fields["la"] = Cfg.max_model_len + 1
        msg = [P.request(P.STEP, a.sid, seq, **fields), *spec[2]]
    h = P.parse_reply(d.handle([b"id", *msg])[0])
    assert h["err"] == errors.InvalidArgument.code, h
    while d.manager.num_deferred:
        d.manager.flush_deferred()
    assert b._do(b._req_lookup(b.hash_prompt(prompt))) == 0  # not hits: A's confirmation did not count
    a._do(a._req_mark_computed(tick))
    assert b._do(b._req_lookup(b.hash_prompt(prompt))) == 3


# ---------------------------------------------------------------- the client's own refusals
class _ApiClient(InProc):
    """``InProc`` with the whole ``Client`` API."""


for _name in ("allocate", "append_slots", "free", "fork", "swap_out", "swap_in", "can_swap_out", "can_swap_in",
              "lookup", "can_allocate", "num_common_prefix_blocks", "cross_block_table", "mark_computed"):
    setattr(_ApiClient, _name, getattr(Client, _name))


def _client_state(c) -> dict:
    out: dict = {}
    _walk(c, "c.", out, set())
    out.pop("c._seq")  # a refused message still took its sequence number
    out.pop("c.raw")  # (the harness's record of the replies)
    out["c._row_of"] = repr(sorted((hash(k), v) for k, v in c._row_of.items()))  # (True is the id 1)
    return out


_GARBAGE = (None, -1, 2**70, 1.5, "x", b"x", [1, "a"], np.array([1.5]), np.array([[1, 2]]), True, object(), {1: 2},
            (), [], np.int64(3), np.array([-1], np.int32), float("nan"), [None], np.array(["a"]),
            np.zeros(3, np.uint64) + 2**63, [2**40], -(2**63))


class _Misuse:
    """Seeded calls of the API the client and the manager share (BlockManager semantics) with
    arguments of every wrong kind mixed in: ``run`` makes them and returns how many were refused
    and what was wrong (a refusal that is not a KvdError, or that changed ``state()``)."""

    def __init__(self, seed: int, api, request_ids, rows, hashes, settle):
        self.rng = np.random.default_rng(seed)
        self.api, self.request_ids, self.rows, self.hashes, self.settle = api, request_ids, rows, hashes, settle
        self.ids = iter(range(10**6, 10**7))

    def g(self, valid):
        return _GARBAGE[int(self.rng.integers(0, len(_GARBAGE)))] if self.rng.random() < 0.3 else valid

    def live(self):
        ids = self.request_ids()
        return ids[int(self.rng.integers(0, len(ids)))] if ids else "nobody"

    def calls(self) -> list:
        api, g, live, ids, hashes = self.api, self.g, self.live, self.ids, self.hashes
        return [
            lambda n: api.allocate(g(next(ids)), g(n), g(hashes(n)), g(0)),
            lambda n: api.append_slots(g(live()), g(1), g(()), g(0)),
            lambda n: api.free(g(live())),
            lambda n: api.fork(g(live()), g(next(ids))),
            lambda n: api.swap_out(g([live()])),
            lambda n: api.swap_in(g([live()])),
            lambda n: api.can_swap_out(g([live()])),
            lambda n: api.can_swap_in(g([live()])),
            lambda n: api.lookup(g(hashes(n))),
            lambda n: api.can_allocate(g(n), g(()), g(0)),
            lambda n: api.num_common_prefix_blocks(g(live()), g(1)),
            lambda n: api.block_table(g(live()), g(0)),
            lambda n: api.step(StepBatch(admit=g([AdmitRequest(g(next(ids)), g(n), g(hashes(n)), g(0), g(0))]),
                                         append_ids=g([live()]), free=g([]), append_num_tokens=g(1),
                                         num_lookahead_tokens=g(0))),
            lambda n: api.step(StepBatch(append_rows=g(self.rows()), append_num_tokens=g(1), append_hashes=g(()),
                                         append_hash_counts=g(()))),
            lambda n: api.step(StepBatch(forks=g([(live(), next(ids))]), computed_through=g(None))),
        ]

    def run(self, calls: list, n: int, state, check) -> tuple[int, list]:
        refused, wrong = 0, []
        for i in range(n):
            k = int(self.rng.integers(0, len(calls)))
            self.settle()
            before = state()
            try:
                calls[k](int(self.rng.integers(1, 40)))
            except Exception as e:  # noqa: BLE001 (what it is, is the point)
                refused += 1
                self.settle()
                diff = changed(before, state())
                if not isinstance(e, errors.KvdError) or diff:
                    wrong.append((i, k, type(e).__name__, str(e)[:80], diff[:4]))
            check()
        return refused, wrong


def _settled(m: BlockManager):
    def settle():
        while m.num_deferred:  # work that is due anyway, done before each picture
            m.flush_deferred()
    return settle


@pytest.mark.parametrize("seed", range(4))
def test_misuse_of_the_client_api_is_typed_and_changes_nothing(seed, new_daemon):
    """Every Client method with arguments of every wrong kind mixed in: what it raises is a
    KvdError (InvalidArgument for a Python or numpy type error), and the client and the daemon
    are as they were."""
    d = new_daemon()
    c = _ApiClient(d)
    run = _Misuse(seed, c, lambda: c.request_ids, lambda: np.asarray(c.rows_of(c.request_ids), np.int32),
                  lambda n: c.hash_prompt(run.rng.integers(1, 300, n)), _settled(d.manager))
    calls = run.calls() + [lambda n: c.cross_block_table(run.g(run.live())),
                           lambda n: c.mark_computed(run.g(c.tick)),
                           lambda n: c.hash_prompt(run.g(run.rng.integers(1, 300, n)))]
    refused, wrong = run.run(calls, 400, lambda: {**state_of(d), **_client_state(c)},
                             lambda: d.manager.check_invariants(heavy=True))
    assert not wrong, wrong[:5]
    assert refused > 100


def test_a_request_named_none_is_freed_and_its_refused_fork_undone(new_daemon):
    """None is a request id like any other hashable (the client's free rows used to hold None)."""
    d = new_daemon()
    c = _ApiClient(d)
    assert c.allocate(None, 10).ok and c.request_ids == [None] and c.id_of(c.row_of(None)) is None
    c.free(None)
    assert c.request_ids == [] and sorted(c._free_rows) == list(range(Cfg.max_reqs_per_session))
    c.allocate("p", 10)
    assert c.swap_out(["p"]).ok
    with pytest.raises(errors.RequestSwapped):
        c.fork("p", None)  # the daemon refuses it: the child's row goes back
    assert c.request_ids == ["p"] and len(c._free_rows) == Cfg.max_reqs_per_session - 1


def test_wrong_kinds_of_arguments_are_invalid_argument(new_daemon):
    d = new_daemon()
    c = _ApiClient(d)
    c.allocate("p", 10)
    row = c.row_of("p")
    for call in (lambda: c.step(StepBatch(admit=[AdmitRequest("q", 5)], num_lookahead_tokens=1.5)),  # not 1
                 lambda: c.step(StepBatch(append_ids=["p"], computed_through=2**70)),
                 lambda: c.mark_computed("x"),
                 lambda: c.block_table("p", group=3),
                 lambda: c.rows_of(5),
                 lambda: c.row_of({}),
                 lambda: c.hash_prompt([[1, "a"]]),
                 lambda: c.allocate("q", 5, block_hashes=7)):
        with pytest.raises(errors.InvalidArgument):
            call()
    assert c.request_ids == ["p"] and c.row_of("p") == row and c.tick == 1
    c.allocate("q", 10)
    res = c.step(StepBatch(free=np.array(["p", "q"])))  # an array of ids is a list here too
    assert res.free_status.tolist() == [0, 0] and c.request_ids == []


# ---------------------------------------------------------------- the manager's, in process
def _manager_state(m: BlockManager) -> dict:
    out: dict = {}
    _walk(m, "m.", out, set())
    out["m._row_of"] = repr(sorted((hash(k), v) for k, v in m._row_of.items()))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_misuse_of_the_manager_api_is_typed_and_changes_nothing(seed):
    """Every BlockManager method with arguments of every wrong kind mixed in (one KV-cache group,
    or a full and a sliding-window one): what it raises is a KvdError, and it changes nothing."""
    kw = dict(num_gpu_blocks=64, num_cpu_blocks=32, max_model_len=64, max_num_reqs=8,
              defer_cache_registration=bool(seed % 2))
    if seed >= 2:
        kw["groups"] = (GroupSpec(16), GroupSpec(16, sliding_window=32))
    m = BlockManager(ManagerConfig(**kw))

    def hashes(n):
        h = hash_prompt(run.rng.integers(1, 300, n), 16)
        return h if len(m.groups) == 1 else [h, h]

    run = _Misuse(seed, m, lambda: list(m._row_of), lambda: np.array(list(m._row_of.values()), np.int32), hashes,
                  _settled(m))
    g = run.g
    calls = run.calls() + [
        lambda n: m.mark_computed(g(0), g(m.tick)),
        lambda n: m.step(StepBatch(admit=[AdmitRequest(next(run.ids), n)], free=g([])), g(0), g(0)),
    ]
    refused, wrong = run.run(calls, 300, lambda: _manager_state(m), lambda: m.check_invariants(heavy=True))
    assert not wrong, wrong[:5]
    assert refused > 60


def test_a_refused_allocation_in_a_new_namespace_makes_no_registration_space():
    m = BlockManager(ManagerConfig(num_gpu_blocks=64, max_model_len=64, max_num_reqs=8))
    before = _manager_state(m)
    with pytest.raises(errors.BadHashes):  # 7 hashes for 6 tokens
        m.allocate("x", 6, np.frombuffer(b"h" * 16 * 7, "S16"), namespace=5, writer=2)
    assert changed(before, _manager_state(m)) == []
    assert m.allocate("x", 6, namespace=5, writer=2).ok and (5, 2) in m._spaces


def test_a_step_of_wrong_kinds_is_refused_before_it_changes_anything():
    m = BlockManager(ManagerConfig(num_gpu_blocks=64, max_model_len=64, max_num_reqs=8))
    m.allocate("a", 10)
    m.allocate("b", 10)
    before = _manager_state(m)
    for batch in (StepBatch(append_ids=["a"], admit={1: 2}),  # appended "a", then failed on the dict
                  StepBatch(append_ids=["a"], free=np.array([["b"]])),
                  StepBatch(append_ids=["a"], forks=1.5),
                  StepBatch(append_ids=["a"], append_num_tokens=2**70),
                  StepBatch(append_ids=["a"], computed_through=1.5)):
        with pytest.raises(errors.InvalidArgument):
            m.step(batch)
        assert changed(before, _manager_state(m)) == [], batch
    res = m.step(StepBatch(free=np.array(["a", "b"])))  # an array of ids is a list (its truth value is not)
    assert res.free_status.tolist() == [0, 0] and m.num_requests == 0


def test_a_python_error_the_manager_types_as_misuse_is_logged_by_the_daemon(new_daemon, monkeypatch, caplog):
    """The daemon's frames reach the manager typed, so a Python error that the manager reports as
    InvalidArgument may be a bug: the daemon replies InvalidArgument and logs its traceback."""
    d = new_daemon()
    c = _ApiClient(d)
    c.allocate("p", 10)
    assert c.swap_out(["p"]).ok

    def broken(self, rows):
        raise IndexError("a bug")

    monkeypatch.setattr(BlockManager, "_swap_in_plan", broken)
    with caplog.at_level("WARNING", logger="kvd.server"), pytest.raises(errors.InvalidArgument, match="a bug"):
        c.swap_in(["p"])
    [rec] = [r for r in caplog.records if r.name == "kvd.server"]
    assert "refused a message with" in rec.getMessage() and rec.exc_info[0] is IndexError
