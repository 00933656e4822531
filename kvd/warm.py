"""Keeping the admission path warm while the daemon polls an idle socket.

On the hosts kvd runs on, what a message costs grows with the idle time before it, whatever the
daemon does meanwhile: ``scripts/bench_idle.py`` measured a prefix hit's admission after polling
in Python, after spinning in native code and back to back (the box, session 24: the same for both
kinds of waiting, +3 % after 0.2 ms, +30 % after 2 ms, +70-100 % after 8 ms). What the waiting leaves
behind is time (the host's other work), so no way of waiting avoids it; running the path again
does (``polled_warm`` there: 317 -> 200 µs after 8 ms).

``Warmer`` runs that path on a shadow: a ``Daemon`` of its own (a small pool with the real one's
KV-cache groups, block sizes and hash scheme; no GPU, no KV memory, no events, no metrics) with two
sessions of one tenant. Session A computed a prompt once; a pass is session B's admission of the
same prompt (a cross-session prefix hit, sent as clients send one, the binary ``admit`` op:
``handle``, ``op_admit``, the manager's lookup, take and registration, the session's row and
tables written, the reply) and its free, through ``Daemon.handle`` as a client's messages go.
Nothing of the real daemon is read or written: its manager, sessions, shared memory and counters
stay exactly as they were. The shadow's session buffers are unlinked as soon as they are made
(nobody attaches them): no segment of its shows in /dev/shm, and none outlives the process however
it ends.

The daemon runs a pass when its socket has been idle for ``warm_every_us`` (and again every
``warm_every_us``), only while it busy-polls (``busy_poll_us``): a sleeping daemon warms nothing. A
message that arrives during a pass waits for it (a pass is ~140 µs on the 2-core box).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from kvd import protocol as P
from kvd.hashing import VLLM_NONE_HASH_SEED, hash_prompt

TAIL = 15  # tokens after the shared blocks: B's partial last block is a fresh block, as a new request's
MAX_SHARED_BLOCKS = 64  # whole blocks of the prompt (of the first group) B finds cached
_SEED = 7  # the prompt's token ids: fixed, so that every pass is the same work


def _admitted(body: bytes) -> tuple[int, int]:
    """(status, cached tokens) of a step reply's one admission (kvd.protocol: nothing else in it)."""
    return int(np.frombuffer(body, np.int16, 1, 0)[0]), int(np.frombuffer(body, np.int32, 1, 2)[0])


class Warmer:
    """A shadow daemon and its two sessions (see the module docstring); ``run()`` is one pass."""

    def __init__(self, config: Any, daemon_cls, group_specs: tuple[tuple[int, int], ...]):
        bs = group_specs[0][0]
        max_model_len = int(config.max_model_len)
        blocks = min(MAX_SHARED_BLOCKS, (max_model_len - TAIL) // bs)
        if blocks < 1:
            raise ValueError(f"max_model_len {max_model_len} leaves no whole block to hit before a {TAIL}-token tail")
        self.num_tokens = blocks * bs + TAIL
        self.shared_tokens = blocks * bs
        shadow = SimpleNamespace(
            group_specs=lambda: group_specs, num_gpu_blocks=4 * len(group_specs) * (blocks + 2),
            max_model_len=max_model_len, max_num_reqs=4, max_reqs_per_session=2,
            max_num_batched_tokens=self.num_tokens, max_sessions=2,
            hash_algo=str(getattr(config, "hash_algo", "sha256")),
            hash_seed=str(getattr(config, "hash_seed", VLLM_NONE_HASH_SEED)),
            max_lookahead_tokens=int(getattr(config, "max_lookahead_tokens", 64)),
        )
        self.d = daemon_cls(shadow)
        self.passes = 0
        try:
            self._prime(group_specs)
        except BaseException:
            self.close()
            raise

    def _prime(self, group_specs) -> None:
        d = self.d
        tokens = np.random.default_rng(_SEED).integers(1, 32000, self.num_tokens).astype(np.int32)
        hashes = [hash_prompt(tokens, bs, algo=d.hash_algo, seed=d.hash_seed) for bs, _ in group_specs]
        self.sid_a, self.seq_a = self._hello(b"warm-a")
        self.sid_b, self.seq_b = self._hello(b"warm-b")
        self._hashes = [h.tobytes() for h in hashes]
        self._free = self._free_frames(d.G, row=0)
        # A computes the prompt and confirms it: its blocks are B's hit from now on
        self.seq_a += 1
        h, body = self.admit(b"warm-a", self.sid_a, self.seq_a)
        if _admitted(body) != (0, 0):
            raise RuntimeError(f"kvd warm: the shadow refused its prompt: {_admitted(body)}")
        self.seq_a += 1
        self._call(b"warm-a", self.sid_a, self.seq_a, {"nf": 0, "nk": 0, "na": 0, "nd": 0, "la": 0, "c": h["t"]},
                   [P.EMPTY] * 4)
        self.d.manager.flush_deferred()
        # the pass's admission: a hit of the shared blocks, or warming would warm another path
        body = self._pass()
        if _admitted(body) != (0, self.shared_tokens):
            raise RuntimeError(f"kvd warm: the shadow's admission is not a whole-block hit: {_admitted(body)}")

    def _hello(self, ident: bytes) -> tuple[int, int]:
        rep = self.d.handle([ident, P.request(P.HELLO, 0, 1, tenant="", name="kvd-warm", pid=0, kv_shared=True,
                                              slots=True)])
        h = P.parse_reply(rep[0])
        if h.get("ok") != 1:
            raise RuntimeError(f"kvd warm: shadow hello failed: {h}")
        sid = int(h["sid"])
        self.d.sessions[sid].shm.unlink()  # mapped, never attached: no name in /dev/shm, nothing to leak
        return sid, 1

    @staticmethod
    def _free_frames(G: int, row: int) -> tuple[dict, list[bytes]]:
        """(header fields, frames) of a step that frees ``row`` (kvd.protocol, "step")."""
        frames = [P.EMPTY] * P.step_frame_count(G)
        frames[0] = np.array([row], np.int32).tobytes()
        fields = {"nf": 1, "nk": 0, "na": 0, "nd": 0, "la": 0}
        fields["fl"], body = P.pack_frames(frames)
        return fields, [body]

    def admit_message(self, sid: int, seq: int) -> list[bytes]:
        """The prompt's admission in row 0 as a client sends a lone admission (kvd.protocol,
        "admit": the binary op), header and frames."""
        head = P.ADMIT_REQUEST.pack(P.ADMIT_MAGIC, sid, seq, P.NO_CONFIRM, 0, 0, self.num_tokens, 0, 0, 0, 0, 1)
        return [head, *self._hashes]

    def admit(self, ident: bytes, sid: int, seq: int) -> tuple[dict, bytes]:
        """Send ``admit_message``: (its reply header as a dict, its body)."""
        return self._send(ident, self.admit_message(sid, seq))

    def _call(self, ident: bytes, sid: int, seq: int, fields: dict, frames: list[bytes]) -> tuple[dict, bytes]:
        return self._send(ident, [P.request(P.STEP, sid, seq, **fields), *frames])

    def _send(self, ident: bytes, msg: list[bytes]) -> tuple[dict, bytes]:
        rep = self.d.handle([ident, *msg])
        h = P.parse_reply(rep[0])
        if h.get("ok") != 1:
            raise RuntimeError(f"kvd warm: shadow step failed: {h}")
        return h, rep[1]

    def _pass(self) -> bytes:
        """B's admission of the prompt (a prefix hit on A's blocks) and its free; the admission's
        reply body."""
        self.seq_b += 1
        _, body = self.admit(b"warm-b", self.sid_b, self.seq_b)
        self.seq_b += 1
        self._call(b"warm-b", self.sid_b, self.seq_b, self._free[0], self._free[1])
        self.d.manager.flush_deferred()
        return body

    def run(self) -> None:
        """One pass. Raises RuntimeError when the shadow refuses it (the daemon then stops warming)."""
        body = self._pass()
        if body[:2] != b"\0\0":  # the admission's status (kvd.protocol: the body's first int16)
            raise RuntimeError(f"kvd warm: the shadow refused a pass's admission: {_admitted(body)}")
        self.passes += 1

    def close(self) -> None:
        """End the shadow's sessions (their buffers are unmapped)."""
        for s in list(self.d.sessions.values()):
            self.d.end_session(s, "warm shadow closed")
