"""The client's lone-admission message (``kvd_client.step.LoneAdmission``) against the general one
(``StepMessage``): seeded random runs of two clients on two identical daemons, one taking the lean
path and one made to take the general path, send the same bytes, get the same results or the same
errors, and leave the same client rows, shared memory and manager tables, after every call. The lean
message here is the JSON step (``BINARY_ADMIT`` off); ``tests/test_lone_admission_op.py`` runs the
same random calls through the binary ``admit`` op.

The runs: lone admissions (prefix hits, misses, bad hashes, a repeated id, a full session, a prompt
past max_model_len, lookahead and append-count fields in and out of range, confirmations), between
decode steps and frees."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvd import protocol as P
from kvd.api import AdmitRequest, StepBatch
from kvd.hashing import hash_prompt
from kvd.server import Daemon
from kvd_client import client as client_mod
from kvd_client import step as step_mod
from kvd_client.step import LoneAdmission
from tests.test_decode_op import BS, InProc
from tests.test_decode_op import Cfg as DecodeCfg

class Cfg(DecodeCfg):
    """A small pool, short prompts and a session of 5 rows: full sessions and never-fits happen."""

    num_gpu_blocks = 48
    max_model_len = 40
    max_reqs_per_session = 5


class Recorded(InProc):
    """An in-process client that keeps every message it sends; ``general``: never the lean path."""

    def __init__(self, d: Daemon, general: bool):
        self.sent: list[list[bytes]] = []
        self.general = general
        handle = d.handle

        def record(msg):
            self.sent.append(list(msg))
            return handle(msg)

        d.handle = record
        super().__init__(d, json=False)

    def step(self, batch):
        if not self.general:
            return super().step(batch)
        client_mod._LONE_ADMISSION = False
        try:
            return super().step(batch)
        finally:
            client_mod._LONE_ADMISSION = True


def _header(raw: bytes, sid: int):
    """A sent header without its session id (the two daemons' sessions differ)."""
    if raw[:4] in (P.DECODE_MAGIC, P.DECODE_FREE_MAGIC):  # a binary header: its bytes, the session id blanked
        return raw.replace(sid.to_bytes(8, "little"), bytes(8), 1)
    h = P.parse_header(raw)
    h.pop("s", None)
    return h


def _outcome(c: Recorded, batch: StepBatch):
    try:
        res = c.step(batch)
    except Exception as e:  # noqa: BLE001 - the two paths must fail alike
        return ("error", type(e).__name__, str(e))
    return ("ok", {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in vars(res).items()})


def _state(c: Recorded):
    m = c.d.manager
    return (dict(c._row_of), list(c._id_of), sorted(c._free_rows), c.shm.tables[0].tolist(), c.shm.counts[0].tolist(),
            m.tables[0].tolist(), m.num_blocks[0].tolist())


def _admission(rng, prefixes, k):
    """A lone admission batch, sometimes malformed in one field."""
    prompt = np.concatenate([prefixes[rng.integers(len(prefixes))], rng.integers(1, 500, rng.integers(0, 9))])
    prompt = prompt.astype(np.int32)
    n = len(prompt)
    hashes = hash_prompt(prompt, BS)
    kind = rng.integers(12)
    rid = f"r{k}"
    la = 0
    extra = {}
    if kind == 0:
        hashes = [b"short"]  # bad hashes: the client judges them
    elif kind == 1:
        n = Cfg.max_model_len + 3  # never fits
    elif kind == 2:
        la = int(rng.integers(1, 4))
    elif kind == 3:
        la = -1  # the daemon refuses the step
    elif kind == 4:
        extra["append_num_tokens"] = int(rng.choice([-1, P.MAX_COUNT + 1, 0, 3]))
    elif kind == 5:
        extra["computed_through"] = int(rng.integers(0, k + 2))
    elif kind == 6:
        hashes = hashes[: max(len(hashes) - 1, 0)]  # fewer hashes than full blocks: allowed
    return StepBatch(admit=[AdmitRequest(rid, n, hashes, num_lookahead_tokens=la)], **extra)


def _next_batch(rng, prefixes, k: int, live: list, client) -> StepBatch | None:
    """A random run's next call: a lone admission (sometimes of a live request's id), a decode step
    of the live requests or a free of one (taken out of ``live``); None: nothing to do."""
    op = rng.integers(10)
    if op < 6:
        batch = _admission(rng, prefixes, k)
        if rng.integers(4) == 0 and live:  # a repeated id
            a = batch.admit[0]
            batch = StepBatch(admit=[dataclasses.replace(a, req_id=live[int(rng.integers(len(live)))])])
        return batch
    if op < 8 and live:
        return StepBatch(append_rows=client.rows_of(live), append_num_tokens=1)
    if live:
        return StepBatch(free=[live.pop(int(rng.integers(len(live))))])
    return None


def random_run(seed: int, lean, general, outcome, state) -> None:
    """60 seeded calls (lone admissions, decode steps, frees) made on both clients: ``outcome(client,
    batch)`` and then ``state(client)`` must be equal for the two after every call. The first item
    of an outcome is ``("ok", result fields)`` or ``("error", ...)``; the lean client's admitted
    requests are the live ones."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(1, 500, int(rng.integers(0, 20))) for _ in range(3)]
    live: list[str] = []
    for k in range(60):
        batch = _next_batch(rng, prefixes, k, live, lean)
        if batch is None:
            continue
        outs = [outcome(c, batch) for c in (lean, general)]
        assert outs[0] == outs[1], (k, batch)
        assert state(lean) == state(general), k
        res = outs[0][0]
        if res[0] == "ok" and batch.admit and res[1]["admit_status"] == [0]:
            live.append(batch.admit[0].req_id)
        live = [r for r in live if r in lean._row_of]


def _sent_with_outcome(c: Recorded, batch: StepBatch):
    """(outcome, the bodies sent byte for byte, their headers without the session id)."""
    n = len(c.sent)
    out = _outcome(c, batch)
    sent = c.sent[n:]
    return out, [m[2:] for m in sent], [_header(m[1], c.sid) for m in sent]


@pytest.mark.parametrize("seed", range(12))
def test_the_lean_and_general_lone_admission_are_the_same_message_and_result(seed, monkeypatch):
    monkeypatch.setattr(step_mod, "BINARY_ADMIT", False)  # the JSON step (test_lone_admission_op: the admit op)
    lean_built = []
    built = LoneAdmission._lone_spec
    monkeypatch.setattr(LoneAdmission, "_lone_spec", lambda self, one: (lean_built.append(1), built(self, one))[1])
    daemons = [Daemon(Cfg), Daemon(Cfg)]
    try:
        lean, general = Recorded(daemons[0], False), Recorded(daemons[1], True)
        random_run(seed, lean, general, _sent_with_outcome, _state)
        assert len(lean_built) >= 10, len(lean_built)  # the lean path did run
    finally:
        for d in daemons:
            for s in list(d.sessions.values()):
                d.end_session(s, "test")
