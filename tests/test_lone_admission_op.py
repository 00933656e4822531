"""The daemon's lean paths for a step that is one admission and nothing else against its general
``op_step``: ``Daemon._lone_admission`` (the JSON step) and ``Daemon.op_admit`` (the binary ``admit``
op, ``kvd_client.step.BINARY_ADMIT``). Two identical daemons get the same calls, one client sending
the lean message and one made to send the general step; every reply (header fields and body bytes),
error, client row, shared-memory table and manager table is the same after every call.

Seeded random runs (prefix hits, misses, a full session, never-fits, lookahead, append counts in and
out of range, confirmations, between decode steps and frees) and hand-made malformed admissions
(row, fields, frame sizes, hash counts) that only a raw message can carry."""

from __future__ import annotations

import numpy as np
import pytest

from kvd import protocol as P
from kvd import server as server_mod
from kvd.api import StepBatch
from kvd.errors import ProtocolError
from kvd.hashing import hash_prompt
from kvd.server import Daemon
from kvd_client import step as step_mod
from tests.test_decode_op import BS, InProc
from tests.test_lone_admission_wire import Cfg, random_run


class Sender(InProc):
    """An in-process client whose lone admissions (``flag``: ``kvd_client.step``'s switch of another
    binary op) go as the binary op or not (``binary``)."""

    def __init__(self, d: Daemon, binary: bool, flag: str = "BINARY_ADMIT"):
        self.binary, self.flag = binary, flag
        super().__init__(d, json=False)

    def step(self, batch):
        old = getattr(step_mod, self.flag)
        setattr(step_mod, self.flag, self.binary)
        try:
            return super().step(batch)
        finally:
            setattr(step_mod, self.flag, old)


class General(Sender):
    """A JSON-step client whose daemon always takes ``op_step``'s general path."""

    def __init__(self, d: Daemon):
        handle = d.handle

        def general(msg, identity_frame=None):
            server_mod._LONE_ADMISSION_OP = False
            try:
                return handle(msg, identity_frame)
            finally:
                server_mod._LONE_ADMISSION_OP = True

        d.handle = general
        super().__init__(d, binary=False)


@pytest.fixture(params=["json", "binary"])
def pair(request, monkeypatch):
    lean_runs = []
    lean = Daemon._lone_admission if request.param == "json" else Daemon.op_admit
    name = lean.__name__
    monkeypatch.setattr(Daemon, name, lambda self, *a: (lean_runs.append(1), lean(self, *a))[1])
    daemons = [Daemon(Cfg), Daemon(Cfg)]
    try:
        yield Sender(daemons[0], binary=request.param == "binary"), General(daemons[1]), lean_runs
    finally:
        for d in daemons:
            for s in list(d.sessions.values()):
                d.end_session(s, "test")


def _reply(rep: list[bytes]):
    """A reply without what differs between two daemons (the epoch), its body frames as bytes."""
    h = P.parse_reply(rep[0])
    h.pop("e", None)
    return h, [bytes(f) for f in rep[1:]]


def _outcome(c: InProc, batch: StepBatch):
    """(("ok", result fields) or ("error", type, message), the daemon's replies without epochs)."""
    n = len(c.raw)
    try:
        res = c.step(batch)
        out = ("ok", {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in vars(res).items()})
    except Exception as e:  # noqa: BLE001 - the two paths must fail alike
        out = ("error", type(e).__name__, str(e))
    return out, [_reply(r) for r in c.raw[n:]]


def _state(c: InProc):
    m, shm = c.d.manager, c.shm
    return (dict(c._row_of), sorted(c._free_rows), shm.tables[0].tolist(), shm.counts[0].tolist(),
            shm.row_tags.tolist(), m.tables[0].tolist(), m.num_blocks[0].tolist(), m.pool.ref_cnt.tolist())


@pytest.mark.parametrize("seed", range(10))
def test_the_lean_and_general_daemon_paths_reply_and_change_the_same(pair, seed):
    lean, general, lean_runs = pair
    random_run(seed, lean, general, _outcome, _state)
    assert len(lean_runs) >= 10, len(lean_runs)  # the lean path did run (and only on one daemon)


def _raw_admission(c: InProc, row=0, cols=None, hashes=None, counts=None, fields=None, tokens=None):
    """A packed one-admission step sent as raw frames (what no client library call would send)."""
    prompt = np.arange(1, 11, dtype=np.int32)
    hs = hash_prompt(prompt, BS) if hashes is None else hashes
    adm = np.array([cols or [row, 10, 0, 0, 0, 0, 5]], np.int64)
    frames = [P.EMPTY] * 7 + [adm.tobytes(), hs.tobytes(),
                              np.array([len(hs)] if counts is None else counts, np.int32).tobytes()]
    if tokens is not None:
        frames += [tokens.tobytes(), np.array([tokens.size], np.int32).tobytes()]
    f = {"nf": 0, "nk": 0, "na": 0, "nd": 1, "la": 0, **(fields or {})}
    f["fl"], body = P.pack_frames(frames)
    seq = c._next_seq()
    return _reply(c.d.handle([b"id", P.request(P.STEP, c.sid, seq, **f), body]))


@pytest.mark.parametrize("case", [
    dict(row=Cfg.max_reqs_per_session), dict(row=-1), dict(cols=[0, -1, 0, 0, 0, 0, 1]),
    dict(cols=[0, 10, 0, 101, 0, 0, 1]), dict(cols=[0, 10, 0, 0, 0]), dict(hashes=np.zeros(3, "S7")),
    dict(counts=[5]), dict(fields={"an": -1}), dict(fields={"la": 10 ** 9}), dict(fields={"la": -1}),
    dict(fields={"c": "x"}),
    dict(tokens=np.arange(1, 11, dtype=np.int32)), dict(tokens=np.arange(1, 5, dtype=np.int32)),
    dict(cols=[1, 10, 2, 3, 0, 0, -7]), dict(),
], ids=lambda c: ",".join(c) or "valid")
def test_a_malformed_lone_admission_gets_the_general_paths_error(pair, case):
    lean, general, lean_runs = pair
    if lean.binary:
        pytest.skip("raw JSON steps: the binary op's own cases are below")
    outs = [_raw_admission(c, **case) for c in (lean, general)]
    assert outs[0] == outs[1]
    assert _state(lean) == _state(general)
    # the lean path took every one but the negative lookahead (a header field, checked before)
    assert bool(lean_runs) == (case.get("fields", {}).get("la", 0) >= 0)


def _raw_binary(c: InProc, row=0, cols=None, hashes=None, la=0, conf=P.NO_CONFIRM, tokens=None, frames=None,
                cut=0):
    """A raw ``admit`` message: its header (``cut`` bytes short) and frames."""
    hs = hash_prompt(np.arange(1, 11, dtype=np.int32), BS) if hashes is None else hashes
    head = P.ADMIT_REQUEST.pack(P.ADMIT_MAGIC, c.sid, c._next_seq(), conf, la, *(cols or [row, 10, 0, 0, 0, 0, 5]))
    body = [hs.tobytes()] + ([] if tokens is None else [tokens.tobytes()]) if frames is None else frames
    return _reply(c.d.handle([b"id", head[: len(head) - cut], *body]))


@pytest.mark.parametrize("case", [
    dict(row=Cfg.max_reqs_per_session), dict(row=-1), dict(cols=[0, -1, 0, 0, 0, 0, 1]),
    dict(cols=[0, 10, 0, 101, 0, 0, 1]), dict(hashes=np.zeros(3, "S7")),
    dict(tokens=np.arange(1, 11, dtype=np.int32)), dict(tokens=np.arange(1, 5, dtype=np.int32)),
    dict(cols=[1, 10, 2, 3, 0, 0, -7]), dict(la=3), dict(conf=0), dict(),
], ids=lambda c: ",".join(c) or "valid")
def test_the_binary_admission_replies_and_changes_as_the_general_step(case):
    """The same admission as a raw admit op and as a raw JSON step on the general path: the same
    reply fields and body bytes, or an error of the same type; the same state after."""
    lean, general = Sender(Daemon(Cfg), binary=True), General(Daemon(Cfg))
    try:
        hs = case.get("hashes")
        json_case = {k: v for k, v in case.items() if k not in ("la", "conf")}
        fields = {"la": case.get("la", 0), **({"c": case["conf"]} if "conf" in case else {})}
        if hs is not None:
            json_case["counts"] = [len(hs.tobytes()) // 16]
        got, want = _raw_binary(lean, **case), _raw_admission(general, fields=fields, **json_case)
        if "err" in want[0]:
            assert got[0]["err"] == want[0]["err"] and not got[1], (got, want)
        else:
            assert got == want
        assert _state(lean) == _state(general)
    finally:
        for c in (lean, general):
            c.d.end_session(c.d.sessions[c.sid], "test")


@pytest.mark.parametrize("case", [
    dict(cut=1), dict(frames=[]), dict(frames=[P.EMPTY, P.EMPTY, P.EMPTY]), dict(la=P.MAX_COUNT + 1),
    dict(conf=-2), dict(hashes=np.zeros(2 * (Cfg.max_model_len // BS + 2), "S16")),
], ids=lambda c: ",".join(c))
def test_a_malformed_binary_admission_is_a_protocol_error_and_changes_nothing(case):
    c = Sender(Daemon(Cfg), binary=True)
    try:
        before = _state(c)
        h, body = _raw_binary(c, **case)
        assert h["err"] == ProtocolError.code and not body, h
        assert _state(c) == before
    finally:
        c.d.end_session(c.d.sessions[c.sid], "test")
