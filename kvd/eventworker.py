"""The KV events worker: a process of its own that encodes and publishes what the daemon's pool
logged, so that the daemon's event loop never pays for it.

Since every BlockStored is one request's run (kvd.runs), a decode step of hundreds of requests
makes hundreds of events, and an admission wave with token ids megabytes of them. Encoding them
(kvd.events, kvd.eventpack) in the daemon's loop would delay every client's next message; here the
loop only copies the log's arrays into one message to the worker (``EventForwarder.publish``).

The worker (``python -m kvd.eventworker CONFIG_JSON``, started by ``EventForwarder.start``, at nice
``NICE``: where cores are short the steps go first and events wait) binds
the events PUB socket and the replay ROUTER (kvd.events.KvEventPublisher: sequence numbers,
replay buffer), then a PULL socket at ``inbox`` (an ipc path in the daemon's runtime directory,
mode 0600: only the daemon's user may push), and prints one line on stdout: ``ready`` or
``error: <why>``. It exits when its stdin closes (the daemon ended, however it ended).

Daemon -> worker message (ZeroMQ multipart): one group of frames per log entry, in log order::

    meta     kind (1 byte: b"r" runs, b"s" stored, b"x" removed, b"c" cleared), block size
             (uint32 LE), KV-cache group (uint32 LE), then the topic's tenant (utf-8)
    hashes   the entry's hashes, S{hash_width} each (raw, zero-padded)
    parents  runs: a parent per block, S{hash_width} (all zero: none); stored: the parent or empty
    first    runs: bool per block (starts a request's run); otherwise empty
    tokens   int32 [blocks, block size] (kvd.runs.NO_TOKENS rows: none), or empty

A message the worker's queue cannot take (past ``hwm`` messages) is dropped and counted in
``EventForwarder.dropped`` (subscribers see no sequence gap for it: the worker numbers what it gets).
"""

from __future__ import annotations

import json
import os
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import zmq

from kvd.runs import Runs

_META = struct.Struct("<cII")
FRAMES_PER_ENTRY = 5
READY = "ready"
START_TIMEOUT_S = 30.0
FORWARD_HWM = 100_000  # messages queued for the worker before the daemon drops
DRAIN_MS = 500  # at the end: how long the worker waits for the daemon's last messages
GATHER_MS = 2  # how long the worker lets the daemon's messages gather before encoding them
GATHER_MAX_ENTRIES = 4096
# Below the daemon and its engines: where cores are short, events wait (a few ms late, none
# lost up to FORWARD_HWM messages) rather than the steps.
NICE = 10


class EventsError(Exception):
    """The worker could not start (e.g. its endpoint cannot be bound)."""


# ---- the log as frames ---------------------------------------------------------------------------

def encode_log(log: list[tuple], describe: Callable[[int], tuple[str, int, int]], width: int) -> list[bytes]:
    frames: list[bytes] = []
    dtype = f"S{width}"
    for entry in log:
        kind, key, hashes = entry[0], entry[1], entry[2]
        tenant, block_size, group = describe(key)
        frames.append(_META.pack(kind[:1].encode() if kind != "removed" else b"x", block_size, group) + tenant.encode())
        frames.append(np.asarray(hashes, dtype).tobytes() if len(hashes) else b"")
        if kind == "runs":
            runs: Runs = entry[3]
            frames += [np.asarray(runs.parent, dtype).tobytes(), runs.first.tobytes(),
                       b"" if runs.tokens is None else np.ascontiguousarray(runs.tokens, np.int32).tobytes()]
        elif kind == "stored" and len(entry) > 3:
            parent, tokens = entry[3], entry[4]
            frames += [b"" if parent is None else np.asarray([parent], dtype).tobytes(), b"",
                       b"" if tokens is None else np.ascontiguousarray(tokens, np.int32).tobytes()]
        else:
            frames += [b"", b"", b""]
    return frames


def decode_log(frames: list[bytes], width: int) -> list[tuple]:
    """The entries of a message; each key is its (tenant, block size, group)."""
    if len(frames) % FRAMES_PER_ENTRY:
        raise ValueError(f"{len(frames)} frames: not whole entries")
    dtype = np.dtype(f"S{width}")
    out = []
    for i in range(0, len(frames), FRAMES_PER_ENTRY):
        meta, hashes_b, parents_b, first_b, tokens_b = frames[i : i + FRAMES_PER_ENTRY]
        kind, block_size, group = _META.unpack_from(meta)
        key = (meta[_META.size :].decode(), block_size, group)
        hashes = np.frombuffer(hashes_b, dtype)
        tokens = np.frombuffer(tokens_b, np.int32).reshape(-1, block_size) if tokens_b else None
        if kind == b"r":
            out.append(("runs", key, hashes, Runs(np.frombuffer(parents_b, dtype), np.frombuffer(first_b, bool), tokens)))
        elif kind == b"s":
            parent = np.frombuffer(parents_b, dtype)[0] if parents_b else None
            out.append(("stored", key, hashes.tolist(), parent, tokens))
        elif kind == b"x":
            out.append(("removed", key, hashes.tolist()))
        else:
            out.append(("cleared", key, []))
    return out


# ---- the daemon's side ---------------------------------------------------------------------------

class EventForwarder:
    """The daemon's end: ``publish(log)`` hands the log to the worker and empties it."""

    def __init__(self, proc: subprocess.Popen, sock: zmq.Socket, describe, width: int):
        self.proc = proc
        self.sock = sock
        self.describe = describe
        self.width = width
        self.dropped = 0

    @classmethod
    def start(cls, ctx: zmq.Context, inbox: str, describe: Callable[[int], tuple[str, int, int]],
              **publisher_kw) -> "EventForwarder":
        """Start the worker (publisher_kw: kvd.events.KvEventPublisher's endpoint and keywords);
        EventsError when it cannot publish."""
        cfg = dict(publisher_kw, inbox=inbox)
        proc = subprocess.Popen([sys.executable, "-m", "kvd.eventworker", json.dumps(cfg)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        line = proc.stdout.readline().strip() if ready else f"error: no answer in {START_TIMEOUT_S:g} s"
        if line != READY:
            _stop(proc)
            raise EventsError(line.removeprefix("error: ") or f"the events worker exited with {proc.poll()}")
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, FORWARD_HWM)
        sock.setsockopt(zmq.LINGER, 1000)  # at shutdown, what is queued still goes out
        sock.connect(inbox)
        return cls(proc, sock, describe, int(publisher_kw.get("hash_width", 16)))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def publish(self, log: list[tuple]) -> None:
        if not log:
            return
        frames = encode_log(log, self.describe, self.width)
        log.clear()
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.dropped += 1

    def close(self) -> None:
        self.sock.close()
        _stop(self.proc)


def _stop(proc: subprocess.Popen) -> None:
    """Close the worker's stdin (it flushes and exits), then make sure it is gone."""
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.stdout.close()


# ---- the worker ----------------------------------------------------------------------------------

def _gather(inbox: zmq.Socket, width: int) -> list[tuple]:
    """Every entry the daemon has sent, waiting up to GATHER_MS for more while they keep coming
    (one message per client step): encoding many at once costs far less than one by one."""
    entries: list[tuple] = []
    deadline = time.monotonic() + GATHER_MS / 1000
    while len(entries) < GATHER_MAX_ENTRIES:
        try:
            entries += decode_log(inbox.recv_multipart(zmq.NOBLOCK), width)
            continue
        except zmq.Again:
            pass
        left = deadline - time.monotonic()
        if left <= 0 or not inbox.poll(left * 1000):
            break
    return entries


def main(argv: list[str]) -> int:
    from kvd.events import KvEventPublisher

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the daemon's to handle
    os.nice(NICE)
    cfg = json.loads(argv[0])
    inbox_ep = cfg.pop("inbox")
    width = int(cfg.get("hash_width", 16))
    ctx = zmq.Context()
    try:
        pub = KvEventPublisher(ctx, cfg.pop("endpoint"), lambda key: key, **cfg)
    except (zmq.ZMQError, ValueError, TypeError) as e:
        print(f"error: {e}", flush=True)
        return 1
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.RCVHWM, FORWARD_HWM)
    path = inbox_ep[len("ipc://") :] if inbox_ep.startswith("ipc://") else None
    try:
        if path is not None and os.path.exists(path):
            os.unlink(path)  # a dead daemon's of the same pid: the daemon holds its directory's lock
        inbox.bind(inbox_ep)
        if path is not None:
            os.chmod(path, 0o600)
    except (zmq.ZMQError, OSError) as e:
        pub.close()
        print(f"error: cannot bind the events inbox {inbox_ep}: {e}", flush=True)
        return 1
    print(READY, flush=True)
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    try:
        while True:
            ready = dict(poller.poll())
            if inbox in ready:
                pub.publish(_gather(inbox, width))
            elif ready:  # stdin: readable only at EOF (the daemon writes nothing), so it ended
                while inbox.poll(DRAIN_MS):  # what the daemon sent last is still on its way
                    pub.publish(decode_log(inbox.recv_multipart(), width))
                break
    finally:
        inbox.close(0)
        if path is not None and os.path.exists(path):
            os.unlink(path)  # ZeroMQ leaves an ipc socket's file behind
        pub.sock.setsockopt(zmq.LINGER, DRAIN_MS)  # and what we publish last goes out
        pub.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
