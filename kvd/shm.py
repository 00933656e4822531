"""Shared-memory session buffers: block tables, block counts, slot mappings and the row -> tag map.

The daemon creates one POSIX shared-memory segment per session (``/dev/shm/<name>``) when the
session says hello, writes into it before every reply, and unlinks it when the session ends (goodbye,
lease expiry, daemon shutdown). Clients map it **read-only**; what they get are numpy views that never
move for the life of the session (persistent buffers, e.g. for CUDA-graph capture after a copy).

Name: ``kvd_<daemon pid>_<boot epoch>_<session id>``. At start the daemon removes every ``kvd_*``
segment (of its own uid) whose daemon pid is no longer alive (``sweep_stale``).

Why ``os.open`` + ``mmap`` instead of ``multiprocessing.shared_memory``: on Python < 3.13 merely
attaching a ``SharedMemory`` registers it with the process's resource_tracker, which unlinks it when
that process exits — a client exiting (or being killed, the tracker survives it) would destroy the
daemon's segment. Opening the file ourselves involves no tracker, lets the client map the segment
``PROT_READ`` (so a client bug cannot corrupt its own tables, let alone anyone else's), and the
segment is created ``O_EXCL`` with mode 0600, then given the daemon's group and mode 0640 (config
``group``): clients in the group may read it, nobody but the daemon may write it.

Layout (all little-endian; every array starts on a 64-byte boundary)::

    offset 0       8 bytes   magic b"KVDSHM01"
    offset 8       uint32    length L of the JSON layout that follows
    offset 12      L bytes   JSON: {"epoch", "num_groups", "max_reqs", "max_blocks": [..],
                             "max_tokens", "block_sizes": [..], "arrays": {name: [offset, dtype, shape]}}
    offset 4096    arrays, in this order:
        row_tags       uint64[max_reqs]                   tag of the request in each session row
                                                          (0 = row free); the request-id -> row map
        counts_g       int32[max_reqs]        per group   number of valid entries of each table row
        table_g        int32[max_reqs, max_blocks_g]  per group   block ids (0 = null block); only
                                                          the first counts_g[row] entries are valid
        slots          int64[num_groups, max_tokens]      slot mapping of the session's last step,
                                                          one row per group: the scheduled tokens in
                                                          batch order, then PAD_SLOT_ID (-1) up to
                                                          max_tokens

Writes happen on the daemon's event-loop thread before it sends the reply that announces them, so a
client that reads after receiving the reply sees a consistent state (the reply's ZeroMQ round trip
orders the accesses; there is no concurrent writer for a session's segment).
"""

from __future__ import annotations

import json
import mmap
import os
import struct

import numpy as np

from kvd.api import PAD_SLOT_ID

SHM_DIR = "/dev/shm"
PREFIX = "kvd_"
MAGIC = b"KVDSHM01"
HEADER_BYTES = 4096
ALIGN = 64


def segment_name(pid: int, epoch: str, sid: int | str) -> str:
    """A session's segment (``sid`` its index), or another segment of the daemon (``sid`` a word:
    "kv" is the KV cache of ``kvd.memory``); all are swept when the daemon is gone."""
    return f"{PREFIX}{pid}_{epoch}_{sid}"


def segment_path(name: str) -> str:
    """The file of segment ``name`` (a kvd segment's name: no path, the ``kvd_`` prefix)."""
    if "/" in name or not name.startswith(PREFIX):
        raise ValueError(f"bad segment name {name!r}")
    return os.path.join(SHM_DIR, name)


def _layout(num_groups: int, max_reqs: int, max_blocks: list[int], max_tokens: int) -> tuple[dict, int]:
    arrays: dict[str, list] = {}
    off = HEADER_BYTES

    def put(name: str, dtype: str, shape: list[int]) -> None:
        nonlocal off
        arrays[name] = [off, dtype, shape]
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        off += (n + ALIGN - 1) // ALIGN * ALIGN

    put("row_tags", "<u8", [max_reqs])
    for g in range(num_groups):
        put(f"counts_{g}", "<i4", [max_reqs])
    for g in range(num_groups):
        put(f"table_{g}", "<i4", [max_reqs, max_blocks[g]])
    put("slots", "<i8", [num_groups, max_tokens])
    return arrays, max(off, HEADER_BYTES + ALIGN)


class SessionBuffers:
    """The arrays of one session's segment. Daemon: ``create`` (writable). Client: ``attach``
    (read-only views)."""

    def __init__(self, name: str, mm: mmap.mmap, meta: dict, writable: bool, owner: bool):
        self.name = name
        self.meta = meta
        self.writable = writable
        self.owner = owner
        self._mm = mm
        self.num_groups = int(meta["num_groups"])
        self.max_reqs = int(meta["max_reqs"])
        self.max_tokens = int(meta["max_tokens"])
        self.epoch = meta.get("epoch")

        def view(key: str) -> np.ndarray:
            off, dt, shape = meta["arrays"][key]
            n = int(np.prod(shape, dtype=np.int64))
            a = np.frombuffer(mm, dtype=np.dtype(dt), count=n, offset=off).reshape(shape)
            if not writable:
                a.flags.writeable = False
            return a

        self.row_tags = view("row_tags")
        self.counts = [view(f"counts_{g}") for g in range(self.num_groups)]
        self.tables = [view(f"table_{g}") for g in range(self.num_groups)]
        self.slot_array = view("slots")  # [num_groups, max_tokens]
        self.slots = [self.slot_array[g] for g in range(self.num_groups)]

    # -- daemon side --------------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, *, max_reqs: int, max_blocks: list[int], max_tokens: int,
               block_sizes: list[int] | None = None, epoch: str = "", mode: int = 0o600,
               gid: int = -1) -> "SessionBuffers":
        """A new segment with permissions ``mode`` and group ``gid`` (-1: the daemon's own). Its
        header names no session id: the id is the session's credential on the socket, and a
        group-readable segment must not give it away."""
        num_groups = len(max_blocks)
        arrays, size = _layout(num_groups, max_reqs, list(max_blocks), max_tokens)
        meta = {
            "epoch": epoch, "num_groups": num_groups, "max_reqs": max_reqs,
            "max_blocks": list(max_blocks), "max_tokens": max_tokens,
            "block_sizes": list(block_sizes or []), "arrays": arrays,
        }
        blob = json.dumps(meta, separators=(",", ":")).encode()
        if len(blob) + 12 > HEADER_BYTES:
            raise ValueError("layout too large for the segment header")
        path = segment_path(name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            set_access(fd, mode, gid)
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            raise
        os.close(fd)
        mm[0:8] = MAGIC
        mm[8:12] = struct.pack("<I", len(blob))
        mm[12:12 + len(blob)] = blob
        self = cls(name, mm, meta, writable=True, owner=True)
        self.slot_array.fill(PAD_SLOT_ID)
        return self

    def unlink(self) -> None:
        try:
            os.unlink(segment_path(self.name))
        except FileNotFoundError:
            pass

    # -- client side --------------------------------------------------------------------------------
    @classmethod
    def attach(cls, name: str) -> "SessionBuffers":
        fd = os.open(segment_path(name), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise ValueError(f"segment {name} too small")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        if mm[0:8] != MAGIC:
            mm.close()
            raise ValueError(f"segment {name}: bad magic")
        (n,) = struct.unpack("<I", mm[8:12])
        meta = json.loads(mm[12:12 + n])
        return cls(name, mm, meta, writable=False, owner=False)

    def close(self) -> None:
        """Drop our mapping (views handed out keep it alive until they are garbage)."""
        for attr in ("row_tags", "counts", "tables", "slots", "slot_array"):
            setattr(self, attr, None)
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # someone still holds a view; the mapping goes when it does


def set_access(fd: int, mode: int, gid: int) -> None:
    """Give a new segment its group and mode (the group first: until then only the owner can open it)."""
    if gid >= 0 and gid != os.fstat(fd).st_gid:
        os.fchown(fd, -1, gid)
    os.fchmod(fd, mode)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_segments() -> list[str]:
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []


def sweep_stale(own_pid: int | None = None) -> list[str]:
    """Unlink ``kvd_*`` segments of our uid whose daemon process is gone. Returns their names."""
    uid = os.getuid()
    removed = []
    for name in list_segments():
        parts = name[len(PREFIX):].split("_")
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        pid = int(parts[0])
        if pid == own_pid:
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid != uid:
                continue
        except FileNotFoundError:
            continue
        if not _pid_alive(pid):
            try:
                os.unlink(path)
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed
