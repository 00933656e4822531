"""A session's mailbox: an engine's step messages and their replies through shared memory, no socket.

Why: an engine sends one decode message per step. On the GPU hosts of issue 11 the ZeroMQ send and
receive of that message cost the engine's thread ~28 µs of a ~1.1 ms step (the whole budget for
kvd's share is 2 %, ~22 µs). A daemon that busy-polls anyway can as well poll a word in shared
memory: the engine writes its message there and the daemon's reply comes back the same way. ZeroMQ
stays the transport of everything else (hello, the general step, the single-request calls, stats),
and of every message of a client that does not ask for a mailbox.

Who gets one: a session whose hello asks for it (``mailbox``: true) and whose peer runs under the
daemon's own uid. The segment is created 0600, so only processes of that uid can open it, and those
could already do anything to the daemon (ptrace it, write its pool): a mailbox gives a session's
credential to nobody who did not have the daemon already. Peers of other uids keep the socket.

What travels: the binary step ops of the mailbox's own session (``kvd.protocol``'s ``decode``, the
steady decode step; ``decode_free``, a serving step whose requests finished or joined; ``admit``, a
new request's first step), as the frames the socket would carry; anything else written there gets
an error reply. The reply is the one
the socket would carry (the decode reply, or an error reply), applied once per sequence number as on
the socket: a request resent on the socket after a timeout gets the same reply.

Layout (little-endian; the words each side writes sit on cache lines of their own)::

    offset 0     8 bytes  magic b"KVDMBX01"
    offset 64    uint64   req_seq: the sequence number of the request in the request area (client;
                          written after the area)
    offset 128   uint64   rep_seq: the sequence number of the reply in the reply area (daemon;
                          written after the area)
    offset 192   uint32   polling: 1 while the daemon's loop polls its mailboxes, 0 once it may sleep
    offset 256   request area, ``req_cap`` bytes: uint32 n, uint32 length[n], the n frames back to back
    then         reply area, ``rep_cap`` bytes (from a 64-byte boundary), the same format

The hello reply names the segment (``mb``) and both capacities (``mb_req``, ``mb_rep``).

Waking a sleeping daemon: the client stores ``req_seq``, then (after a full fence) reads
``polling``; the daemon stores ``polling = 0``, then (after a full fence) reads every ``req_seq``
once more before it sleeps. One of the two sees the other's store, so either the daemon finds the
request or the client sees 0 and kicks the loop awake: a byte written to the daemon's kick FIFO
(``kvd.kick`` beside its lock file, 0600, named by the hello reply's ``mb_kick``; one system call,
and the loop's own poll wakes for it), else a 4-byte message (``KICK``) on its socket, which passes
through both sides' ZeroMQ I/O threads (the 2-core box, a daemon that never polls, steps 2 ms
apart: a 256-row step's round trip 667 µs with the FIFO against 872 with the socket's kick at the
p50). The fence is a lock's atomic read-modify-write (``fence``). A client whose reply does not
come kicks again after ``KICK_AGAIN_S`` and resends on the socket after its timeout, as it would
without a mailbox.

A message or reply too large for its area goes on the socket instead (the client waits on both).
The daemon copies a request out before it reads any of it, and checks every count against the area:
a client that scribbles on its mailbox gets error replies for its own session, nothing else.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import threading

import numpy as np

from kvd import protocol as P
from kvd.errors import ProtocolError
from kvd.shm import segment_path

MAGIC = b"KVDMBX01"
REQ_SEQ, REP_SEQ, POLLING, AREAS = 64, 128, 192, 256
KICK = b"kvK" + bytes([P.VERSION])
"""A message of this one frame only wakes the daemon's loop (no reply)."""
KICK_AGAIN_S = 0.005
"""How long a client waits for a mailbox reply before it kicks the daemon again (a lost wake-up
cannot happen with the fences; this bounds what a missed one would cost)."""
_U32 = struct.Struct("<I")
_SEQ_C = struct.Struct("<qq")
_STEADY_SEQ_AT = AREAS + 3 * _U32.size + struct.calcsize(P.DECODE_REQUEST.format[:4])
"""Where a decode request of two frames (header, rows) has its seq and c: after the frame table
(n, two lengths) and the header's magic and sid (``P.DECODE_REQUEST``'s first two fields)."""
_DECODE_POST: dict[int, struct.Struct] = {}


def _decode_post(frames: int) -> struct.Struct:
    """A decode request's frame count, the lengths of its ``frames`` frames and its header (its
    first frame) in one ``pack_into``."""
    st = _DECODE_POST.get(frames)
    if st is None:
        st = _DECODE_POST[frames] = struct.Struct(f"<I{frames}I" + P.DECODE_REQUEST.format.lstrip("<"))
    return st


_DECODE_REPLY: dict[int, struct.Struct] = {}


def _decode_reply(groups: int) -> struct.Struct:
    """A decode reply's frame count and lengths, its header and its ``groups`` token counts: what
    the reply area holds before the body, in one ``unpack_from``."""
    st = _DECODE_REPLY.get(groups)
    if st is None:
        st = _DECODE_REPLY[groups] = struct.Struct("<III" + P.DECODE_REPLY.format.lstrip("<") + f"{groups}i")
    return st


_LOCK = threading.Lock()
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
"""Both sides map the whole segment in at once: a page first touched by a message would cost that
message a page fault (tens of µs in the sandboxed GPU hosts: a registering step's hashes reach
pages the steady steps never touch)."""


def fence() -> None:
    """A full memory fence: a lock's acquire and release are atomic read-modify-writes (``lock
    cmpxchg`` on x86-64), which no load passes."""
    _LOCK.acquire()
    _LOCK.release()


def reply_capacity(max_reqs: int, num_groups: int) -> int:
    """Bytes that hold any decode reply of a session of ``max_reqs`` rows: the header (with a token
    count per group), a status per row, a copy per row and group, the changed rows and the
    schedule's starts; error replies are small (those that are not go on the socket)."""
    return 4096 + P.DECODE_REPLY.size + 4 * num_groups + max_reqs * (2 + 8 * num_groups + 4 + 4)


def request_capacity(max_reqs: int, num_groups: int, hash_width: int) -> int:
    """Bytes for a decode message that registers up to one block per row and group (a message that
    registers more goes on the socket)."""
    return 4096 + P.DECODE_REQUEST.size + 4 * max_reqs + num_groups * max_reqs * (4 + hash_width + 4 * 16)


def _area_end(req_cap: int) -> int:
    return (AREAS + req_cap + 63) // 64 * 64


def open_kick_fifo(path: str) -> int:
    """Daemon: a new kick FIFO at ``path`` (0600; a stale one of a dead daemon replaced), opened
    read-write and non-blocking: the loop reads kicks from it, and holding its own write end it never
    sees the end of file when clients close theirs."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.mkfifo(path, 0o600)
    os.chmod(path, 0o600)  # (whatever the umask)
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)


def drain_kicks(fd: int) -> None:
    """Daemon: read every kick waiting in the FIFO."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def kick_writer(path: str) -> int | None:
    """Client: the daemon's kick FIFO opened for writing, or None (not there, not ours, not a
    FIFO: the socket kicks instead)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return None
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):  # (a kick never writes into a file)
        os.close(fd)
        return None
    return fd


class Mailbox:
    """One session's mailbox segment. Daemon: ``create``; client: ``attach`` (both read-write)."""

    def __init__(self, name: str, mm: mmap.mmap, req_cap: int, rep_cap: int):
        self.name = name
        self._mm = mm
        self.req_cap, self.rep_cap = req_cap, rep_cap
        self.rep_at = _area_end(req_cap)
        words = np.frombuffer(mm, np.uint64, AREAS // 8)
        self.req_seq = words[REQ_SEQ // 8:REQ_SEQ // 8 + 1]
        self.rep_seq = words[REP_SEQ // 8:REP_SEQ // 8 + 1]
        self.polling = np.frombuffer(mm, np.uint32, 1, POLLING)
        self.seen = 0  # daemon: the last request sequence number it took
        self.kick_fd: int | None = None  # client: the daemon's kick FIFO (``kick_writer``), if it has one
        # client: (sid, an, la, rows) of the decode request the request area holds, when its frames
        # are the header and the rows alone (``post_decode``)
        self._steady: tuple | None = None

    @classmethod
    def create(cls, name: str, req_cap: int, rep_cap: int) -> "Mailbox":
        """A new segment, 0600: only this uid may map it (see the module docstring)."""
        path = segment_path(name)
        size = _area_end(req_cap) + rep_cap
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, _MAP_FLAGS, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        mm[0:8] = MAGIC
        return cls(name, mm, req_cap, rep_cap)

    @classmethod
    def attach(cls, name: str, req_cap: int, rep_cap: int) -> "Mailbox":
        fd = os.open(segment_path(name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != _area_end(req_cap) + rep_cap:
                raise ValueError(f"mailbox {name}: {size} bytes, not the announced layout's")
            mm = mmap.mmap(fd, size, _MAP_FLAGS, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if mm[0:8] != MAGIC:
            mm.close()
            raise ValueError(f"mailbox {name}: bad magic")
        return cls(name, mm, req_cap, rep_cap)

    # ---- both sides ------------------------------------------------------------------------------------
    def _put(self, at: int, cap: int, frames) -> bool:
        frames = [f if type(f) is bytes else memoryview(f).cast("B") for f in frames]
        n = len(frames)
        head = 4 + 4 * n
        total = head + sum(map(len, frames))
        if total > cap:
            return False
        mm = self._mm
        struct.pack_into(f"<{n + 1}I", mm, at, n, *map(len, frames))
        o = at + head
        for f in frames:
            e = o + len(f)
            mm[o:e] = f
            o = e
        return True

    def _take(self, at: int, cap: int) -> list[bytes]:
        """The frames of an area, copied out (what the other side writes later cannot change them),
        each count checked against the area."""
        mm = self._mm
        (n,) = _U32.unpack_from(mm, at)
        if not 0 < n <= P.MAX_FRAMES or 4 + 4 * n > cap:
            raise ProtocolError(f"mailbox: {n} frames")
        lens = struct.unpack_from(f"<{n}I", mm, at + 4)
        o = at + 4 + 4 * n
        if o - at + sum(lens) > cap:
            raise ProtocolError("mailbox: frames longer than the area")
        out = []
        for ln in lens:
            out.append(mm[o:o + ln])
            o += ln
        return out

    # ---- client ----------------------------------------------------------------------------------------
    def post(self, seq: int, frames) -> bool:
        """Write a request and publish its sequence number; False (nothing written) when it does not
        fit. Then ``daemon_polls`` says whether a kick is needed."""
        self._steady = None  # (whatever is written below, the area no longer holds that decode step)
        if not self._put(AREAS, self.req_cap, frames):
            return False
        self.req_seq[0] = seq
        return True

    def post_decode(self, seq: int, sid: int, c: int, na: int, an: int, la: int, rows_b: bytes, extra=()) -> bool:
        """``post`` of a decode request: ``P.DECODE_REQUEST``'s fields, the rows, then ``extra``
        frames (C-contiguous arrays or bytes: the hashes and counts), each written once, the
        header and the frame table with one ``pack_into``. A steady engine posts the same rows
        with the same counts step after step, and only it writes this area: when the last post
        without ``extra`` had the same session, counts and rows, only the sequence number and the
        confirmation are written (their 16 bytes; an engine's thread meets this code cold, where
        the whole post costs ~3x that)."""
        mm = self._mm
        if not extra and self._steady == (sid, an, la, rows_b):
            _SEQ_C.pack_into(mm, _STEADY_SEQ_AT, seq, c)
            self.req_seq[0] = seq
            return True
        nb = len(rows_b)
        lens = [a.nbytes if type(a) is np.ndarray else len(a) for a in extra] if extra else ()
        st = _decode_post(2 + len(lens))
        if st.size + nb + sum(lens) > self.req_cap:
            return False
        st.pack_into(mm, AREAS, 2 + len(lens), P.DECODE_REQUEST.size, nb, *lens, P.DECODE_MAGIC, sid, seq, c, na, an, la)
        o = AREAS + st.size
        mm[o:o + nb] = rows_b
        o += nb
        for a, ln in zip(extra, lens):
            mm[o:o + ln] = a
            o += ln
        self.req_seq[0] = seq
        self._steady = None if extra else (sid, an, la, rows_b)
        return True

    def request(self) -> list[bytes]:
        """The request posted last (a client resending it on the socket)."""
        return self._take(AREAS, self.req_cap)

    def decode_reply(self, seq: int, num_groups: int):
        """The reply area read in place as a decode reply to ``seq``: (epoch bytes, tick, nc, nch,
        ns, per-group token counts, body), or None for anything else (an error reply)."""
        mm, at = self._mm, self.rep_at
        st = _decode_reply(num_groups)
        n, head, nb, magic, rseq, epoch, tick, nc, nch, ns, g, *nt = st.unpack_from(mm, at)
        if (n != 2 or head != st.size - 12 or magic != P.DECODE_REPLY_MAGIC or rseq != seq or g != num_groups
                or 12 + head + nb > self.rep_cap):
            return None
        o = at + st.size
        return epoch, tick, nc, nch, ns, nt, mm[o:o + nb]

    def kick(self) -> bool:
        """Wake the daemon's loop through its kick FIFO; False when there is none or it is unusable
        (the daemon is gone): the caller kicks on the socket."""
        fd = self.kick_fd
        if fd is None:
            return False
        try:
            os.write(fd, b"k")
        except BlockingIOError:
            pass  # full of kicks the loop has not read yet: it wakes for those
        except OSError:
            return False
        return True

    def daemon_polls(self) -> bool:
        """After ``post``: whether the daemon's loop will find the request without a kick."""
        fence()
        return bool(self.polling[0])

    def replied(self, seq: int) -> bool:
        return int(self.rep_seq[0]) == seq

    def reply(self) -> list[bytes]:
        return self._take(self.rep_at, self.rep_cap)

    # ---- daemon ----------------------------------------------------------------------------------------
    def waiting(self) -> bool:
        """A request the daemon has not taken yet."""
        return int(self.req_seq[0]) != self.seen

    def take_request(self) -> tuple[int, list[bytes]]:
        """(its sequence number, its frames); raises ProtocolError for a malformed area (the
        request counts as taken)."""
        seq = self.seen = int(self.req_seq[0])
        return seq, self._take(AREAS, self.req_cap)

    def answer(self, seq: int, frames) -> bool:
        """Write the reply to request ``seq`` and publish it; False when it does not fit (the caller
        sends it on the socket)."""
        if not self._put(self.rep_at, self.rep_cap, frames):
            return False
        self.rep_seq[0] = seq
        return True

    def set_polling(self, on: bool) -> None:
        self.polling[0] = 1 if on else 0

    def unlink(self) -> None:
        try:
            os.unlink(segment_path(self.name))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self.kick_fd is not None:
            os.close(self.kick_fd)
            self.kick_fd = None
        self.req_seq = self.rep_seq = self.polling = None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass
