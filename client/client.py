"""kvd client library: the ``BlockManager`` API over the daemon's socket and shared memory.

``Client`` (blocking) and ``AsyncClient`` (asyncio) expose the manager's methods with its
semantics (lookup, can_allocate, allocate, append_slots, free, fork, can_swap_out/swap_out,
can_swap_in/swap_in, reset_prefix_cache, num_common_prefix_blocks, cross_block_table, stats,
block_table) plus ``step`` (one whole scheduler step, one round trip). Not ``take_copies``: the
copy-on-write copies come with the result of the call that caused them (``copies``).

Errors: one channel per call. Misuse of a single-request call raises a typed ``kvd.errors``
exception (the daemon's, raised again here) and changes nothing; in a ``step`` every request gets a
status instead (``kvd.api`` describes the code space). "No space" is a status (LATER / NEVER).

Request ids are whatever the engine uses (str, int, any hashable); the client maps them to rows of
its session (``row_of``). Block tables, block counts and slot mappings are read-only numpy views into
the session's shared memory (``tables[g]``, ``num_blocks[g]``, ``slot_mappings[g]``), written by the
daemon before it replies; they never move while the session lives (they are replaced by
``reconnect()`` after a daemon restart).

Reliability: every request has a timeout and is retried with the same sequence number (the daemon
replays its cached reply, so a retried step is applied once); ``Timeout`` when every attempt failed.
A reply from a daemon with another boot epoch raises ``DaemonRestarted``: every block is gone;
``reconnect()`` opens a new session. A background thread heartbeats the session (lease renewal) so an
idle engine keeps its blocks; a killed engine stops heartbeating and the daemon reclaims its blocks.
"""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import orjson
import zmq

from kvd import errors
from kvd import protocol as P
from kvd.api import (
    DEFAULT_PRIORITY,
    STATUS_OK,
    AllocResult,
    AllocStatus,
    AppendResult,
    StepBatch,
    StepResult,
    SwapResult,
)
from kvd.errors import (
    ARGUMENT_ERRORS,
    ERROR_BY_CODE,
    DaemonUnavailable,
    PermissionDenied,
    DaemonRestarted,
    DuplicateRequest,
    InvalidArgument,
    KvdError,
    ProtocolError,
    SessionError,
    Timeout,
    UnknownRequest,
    invalid_argument,
)
from kvd.mailbox import KICK, KICK_AGAIN_S, Mailbox, kick_writer
from kvd.shm import SHM_DIR, SessionBuffers

from .step import (DecodeWithFrees, LoneAdmission, StepMessage, decode_hash_arrays, decode_hash_frames, group_token_ids, int32_array,
                   tag_of, token_frame)
from .step import count_field as _count

DEFAULT_ENDPOINT_ENV = "KVD_ENDPOINT"
#: ``_Core.step`` sends a lone admission as ``LoneAdmission`` (tests switch it off to compare)
_LONE_ADMISSION = True
_EMPTY_I32 = np.empty(0, np.int32)
_EMPTY_I16 = np.empty(0, np.int16)
_POLLIN = int(zmq.POLLIN)


def default_endpoint() -> str:
    """$KVD_ENDPOINT, else the daemon's default ipc socket (see kvd.config.ServeConfig)."""
    ep = os.environ.get(DEFAULT_ENDPOINT_ENV)
    if ep:
        return ep
    rd = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if not rd:
        xdg = os.environ.get("XDG_RUNTIME_DIR", "")
        rd = os.path.join(xdg, "kvd") if xdg else f"/tmp/kvd-{os.getuid()}"
    return "ipc://" + os.path.join(rd, "kvd.sock")


class GpuBuffers:
    """The session's GPU buffers mapped over CUDA IPC (see kvd.gpu_session): torch CUDA tensors that
    never move while the session lives. ``tables[g]`` int32 [max_reqs, max_blocks_g],
    ``num_blocks[g]`` int32 [max_reqs], ``slot_array`` int64 [G, max_tokens] (``slot_mappings[g]`` its
    rows). The daemon replies before its writes to them have run on the GPU; after every reply the
    client makes the current CUDA stream wait for them unless they have run by then (:meth:`wait`), so
    work queued on that stream afterwards (kernels, ``.cpu()``) sees the reply's contents. Another
    stream: ``wait(stream)``.
    torch is imported here, only when the daemon has a GPU pool."""

    def __init__(self, info: dict, num_groups: int):
        import torch

        self.key = info["h"]
        self.storage, self.device = _open_cuda_storage(info)
        dtypes = {"<i4": torch.int32, "<i8": torch.int64}

        def view(name: str):
            off, dt, shape = info["arrays"][name]
            return _row_major(self.storage, self.device, dtypes[dt], off, shape)

        self.slot_array = view("slots")
        counts = view("counts")
        self.num_blocks = [counts[g] for g in range(num_groups)]
        self.tables = [view(f"table_{g}") for g in range(num_groups)]
        self.slot_mappings = [self.slot_array[g] for g in range(num_groups)]
        done = info.get("done")  # absent from an older daemon, which synchronizes before replying
        self._done = torch.cuda.Event.from_ipc_handle(self.device, bytes.fromhex(done)) if done else None
        self._current_stream = torch.cuda.current_stream
        self.waits = self.waits_skipped = 0

    def wait(self, stream=None) -> None:
        """Make ``stream`` (default: the current stream of the buffers' device) wait for the daemon's
        writes of the last reply. When they have run already (their event has completed: work
        launched from now on sees them), there is nothing to order: the usual case for a reply
        taken while the engine's forward runs, and ~1 µs against ~30 for a stream wait in situ on
        an H100 host (``waits`` counts the stream waits, ``waits_skipped`` the others)."""
        done = self._done
        if done is None:
            return
        if done.query():
            self.waits_skipped += 1
            return
        self.waits += 1
        (stream or self._current_stream(self.device)).wait_event(done)

    def close(self) -> None:
        self._done = None
        self.tables = self.num_blocks = self.slot_mappings = self.slot_array = None
        self.storage = None  # the mapping goes (and the daemon's ref count drops) with the last view


def _open_cuda_storage(info: dict):
    """(storage, device) of a daemon allocation exported over CUDA IPC (torch's own recipe)."""
    import torch

    dev = int(info["dev"])
    uuid = info.get("uuid")
    if uuid:  # the daemon's device index may differ under another CUDA_VISIBLE_DEVICES
        for i in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(i).uuid) == uuid:
                dev = i
                break
        else:
            raise RuntimeError(f"the daemon's GPU {uuid} is not visible to this process")
    torch.cuda.init()
    ev = info.get("ev")
    with torch.cuda.device(dev):
        storage = torch.UntypedStorage._new_shared_cuda(
            dev, bytes.fromhex(info["h"]), int(info["sz"]), int(info["off"]),
            bytes.fromhex(info["rc"]), int(info["rco"]),
            None if ev is None else bytes.fromhex(ev), bool(info["evs"]))
    return storage, torch.device("cuda", dev)


def _map_kv_cache(info: dict):
    """The daemon-owned KV cache (see kvd.memory): numpy over shared memory, or a torch CUDA tensor."""
    shape = [int(x) for x in info["shape"]]
    if info["kind"] == "shm":
        from kvd.memory import DTYPES, SHM_DIR

        path = os.path.join(SHM_DIR, info["name"])
        try:
            return np.memmap(path, DTYPES[info["dtype"]], "r+", shape=tuple(shape))
        except PermissionError:
            raise errors.PermissionDenied(f"cannot map the KV cache {path} read-write: permission denied "
                                          "(is this user in the daemon's group?)") from None
    import torch

    storage, device = _open_cuda_storage(info)
    return _row_major(storage, device, getattr(torch, info["dtype"]), 0, shape)


def _row_major(storage, device, dtype, byte_offset: int, shape):
    """A row-major tensor of ``shape`` over ``storage`` from ``byte_offset``."""
    import torch

    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    item = torch.empty(0, dtype=dtype).element_size()
    return torch.empty(0, dtype=dtype, device=device).set_(storage, byte_offset // item, list(shape), strides[::-1])


def check_endpoint(endpoint: str) -> None:
    """Fail at once, naming the path, when an ipc endpoint's socket file is missing or this user
    may not open it (instead of a ``Timeout`` after every retry)."""
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint[len("ipc://"):]
    if path.startswith("@"):  # Linux abstract socket: no file to check
        return
    try:
        os.stat(path)
    except FileNotFoundError:
        raise DaemonUnavailable(f"no kvd daemon socket at {path} (is the daemon running? "
                                f"endpoint {endpoint}; set $KVD_ENDPOINT or pass endpoint=)") from None
    except PermissionError:
        raise PermissionDenied(f"permission denied reaching the daemon socket {path}: its directory is "
                               "open to the daemon's group only (group kvd by default); join that group "
                               "or ask for access") from None
    if not os.access(path, os.R_OK | os.W_OK):
        raise PermissionDenied(f"permission denied opening the daemon socket {path}: the daemon "
                               "makes it group-accessible (socket_mode, group kvd by default); "
                               "join that group or ask for access")


def _attach_segment(name: str) -> SessionBuffers:
    path = os.path.join(SHM_DIR, name)
    try:
        return SessionBuffers.attach(name)
    except PermissionError:
        raise PermissionDenied(f"permission denied opening the session's shared memory {path} "
                               "(the daemon's segment mode/group does not include this user)") from None
    except FileNotFoundError:
        raise SessionError(f"the session's shared memory {path} does not exist (the session "
                           "ended); call reconnect()") from None


def _raise(h: dict) -> None:
    cls = ERROR_BY_CODE.get(int(h.get("err", KvdError.code)), KvdError)
    raise cls(h.get("msg", ""))


class _Heartbeat(threading.Thread):
    """Sends a heartbeat for the session every ``interval`` seconds on its own socket."""

    def __init__(self, ctx: zmq.Context, endpoint: str, interval: float):
        super().__init__(name="kvd-heartbeat", daemon=True)
        self.ctx = ctx
        self.endpoint = endpoint
        self.interval = interval
        self.sid = 0
        self.stop_event = threading.Event()
        self.last_error: dict | None = None

    def run(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.setsockopt(zmq.RCVHWM, 4)
        sock.connect(self.endpoint)
        try:
            while not self.stop_event.wait(self.interval):
                sid = self.sid
                if not sid:
                    continue
                try:
                    sock.send(P.request(P.HEARTBEAT, sid, 0), zmq.NOBLOCK)
                except zmq.Again:
                    pass
                while sock.poll(0):
                    rep = sock.recv_multipart()
                    try:
                        h = orjson.loads(rep[0])
                        self.last_error = h if "err" in h else None
                    except Exception:
                        pass
        except zmq.ZMQError:
            pass
        finally:
            sock.close(0)


def _is_index(value: Any, n: int) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and 0 <= value < n


def _builds(fn):
    """A request builder (``_req_*``) whose arguments' misuse is ``InvalidArgument``; building
    changes nothing on a failure (what it took, it gives back before raising)."""
    what = fn.__name__.removeprefix("_req_")

    @functools.wraps(fn)
    def build(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except ARGUMENT_ERRORS as e:
            raise invalid_argument(e, what) from e

    return build


class _Core:
    """State and message building shared by Client and AsyncClient (no I/O here)."""

    def __init__(self, endpoint: str | None = None, *, tenant: str = "", name: str = "",
                 timeout_s: float = 2.0, retries: int = 2, heartbeat: bool = True,
                 gpu: bool | None = None, kv_shared: bool = False, confirm: str = "auto",
                 steps_in_flight: int = 1, slot_mapping: bool = True):
        if confirm not in ("auto", "explicit"):
            raise InvalidArgument(f"confirm must be 'auto' or 'explicit', got {confirm!r}")
        if type(steps_in_flight) is not int or steps_in_flight < 0:
            raise InvalidArgument(f"steps_in_flight must be a non-negative int, got {steps_in_flight!r}")
        self.endpoint = endpoint or default_endpoint()
        self.kv_shared = bool(kv_shared)
        self._want_slots = bool(slot_mapping)
        self._auto_confirm = confirm == "auto"
        # ticks of the last steps: the oldest is the one whose forward pass has surely finished
        self._step_ticks: deque[int] = deque(maxlen=steps_in_flight + 1)
        self.tick = 0  # the manager tick of the last reply that carried one
        # map the daemon's GPU buffers: None = when it has a GPU pool and torch can map them,
        # True = required (raise if it cannot), False = never (CPU shared memory only)
        self._want_gpu = gpu
        self.gpu: GpuBuffers | None = None
        self._kv = None  # the daemon-owned KV cache, mapped on first use
        self._kv_of: str | None = None
        self.tenant = tenant
        self.name = name
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self._want_heartbeat = heartbeat
        self._seq = 0
        self.sid = 0
        self.epoch: str | None = None
        self._epoch_b = b""
        self.info: dict = {}
        self._num_groups = 1
        self.shm: SessionBuffers | None = None
        self._want_mailbox = False
        self._mb: Mailbox | None = None  # kvd.mailbox: the binary step ops' lane without the socket
        self._reset_rows(0)

    # ---- rows ---------------------------------------------------------------------------------------
    def _reset_rows(self, max_reqs: int) -> None:
        self._row_of: dict[Hashable, int] = {}
        # a free row holds _NO_ID, not None: None is a request id like any other hashable
        self._id_of: list[Hashable] = [_NO_ID] * max_reqs
        self._free_rows: list[int] = list(range(max_reqs - 1, -1, -1))

    def _new_row(self, req_id: Hashable) -> int:
        if req_id in self._row_of:
            raise DuplicateRequest(f"request {req_id!r} already exists")
        if not self._free_rows:
            from kvd.errors import CapacityExceeded

            raise CapacityExceeded("no free row in this session (max_reqs_per_session)")
        r = self._free_rows.pop()
        self._row_of[req_id] = r
        self._id_of[r] = req_id
        return r

    def _drop_row(self, row: int) -> None:
        rid = self._id_of[row]
        if rid is not _NO_ID:
            self._id_of[row] = _NO_ID
            if self._row_of.get(rid) == row:  # (a step that freed rid may have given its id a new row)
                del self._row_of[rid]
            self._free_rows.append(row)

    def row_of(self, req_id: Hashable) -> int:
        try:
            return self._row_of[req_id]
        except KeyError:
            raise UnknownRequest(f"unknown request {req_id!r}") from None
        except TypeError as e:  # unhashable
            raise invalid_argument(e, "request id") from e

    def rows_of(self, req_ids: Sequence[Hashable]) -> np.ndarray:
        try:
            return np.array(list(map(self._row_of.__getitem__, req_ids)), np.int32)
        except KeyError as e:
            raise UnknownRequest(f"unknown request {e.args[0]!r}") from None
        except TypeError as e:  # not a sequence, or an unhashable id
            raise invalid_argument(e, "request ids") from e

    def id_of(self, row: int) -> Hashable | None:
        """The request in session row ``row``, or None (a free row)."""
        rid = self._id_of[row]
        return None if rid is _NO_ID else rid

    @property
    def request_ids(self) -> list:
        return list(self._row_of)

    # ---- shared-memory views ----------------------------------------------------------------------
    @property
    def tables(self) -> list[np.ndarray]:
        return self.shm.tables

    @property
    def num_blocks(self) -> list[np.ndarray]:
        return self.shm.counts

    @property
    def slot_mapping(self) -> bool:
        """Whether the daemon writes each step's slot mapping for this session (``slot_mapping``)."""
        return bool(self.info.get("slots", True))

    @property
    def slot_mappings(self) -> list[np.ndarray] | None:
        """The last step's slot mapping per group; None for a session opened with
        ``slot_mapping=False`` (the engine computes its slots from the tables)."""
        return self.shm.slots if self.slot_mapping else None

    @property
    def gpu_tables(self):
        """Torch CUDA tensors of the block tables (None without a GPU pool), see GpuBuffers."""
        return self.gpu.tables if self.gpu is not None else None

    @property
    def gpu_num_blocks(self):
        return self.gpu.num_blocks if self.gpu is not None else None

    @property
    def gpu_slot_mappings(self):
        return self.gpu.slot_mappings if self.gpu is not None and self.slot_mapping else None

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(self.info.get("block_sizes", ()))

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        """Each KV-cache group's sliding window in tokens (0: full attention): a window group's
        blocks before a request's last ``window`` tokens go back to the pool as it decodes."""
        return tuple(self.info.get("windows", ()))

    @property
    def kv_cache(self):
        """The KV cache the daemon owns (``kv_cache`` config), shared by every engine:
        ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``, a numpy array over shared memory
        (bfloat16 and fp8 as integers of their width) or, on a GPU daemon, a torch CUDA tensor.
        The daemon performs the copy-on-write copies and swaps in it before replying. None when
        the engines own their KV memory."""
        info = self.info.get("kv") if self.info else None
        if info is None:
            return None
        key = info.get("name") or info.get("h")
        if self._kv is None or self._kv_of != key:
            self._kv, self._kv_of = _map_kv_cache(info), key
        return self._kv

    def block_table(self, req_id: Hashable, group: int = 0) -> np.ndarray:
        """The request's block ids (read-only view into shared memory, valid until it changes)."""
        r = self.row_of(req_id)
        if not _is_index(group, len(self.shm.tables)):
            raise InvalidArgument(f"group must be an int in [0, {len(self.shm.tables)}), got {group!r}")
        return self.shm.tables[group][r, : int(self.shm.counts[group][r])]

    @property
    def hash_width(self) -> int:
        """Bytes of one block hash under the daemon's scheme (16, or 32 for vLLM's)."""
        return int(self.info.get("hash_width", 16))

    def hash_prompt(self, token_ids, group: int = 0, **kw) -> np.ndarray:
        """kvd.hashing.hash_prompt with this pool's hash scheme (and, for vLLM's scheme, its NONE_HASH
        seed) and the block size of KV-cache ``group`` (with several groups, give
        ``[hash_prompt(t, group=g) for g in ...]``)."""
        from kvd.hashing import hash_prompt

        kw.setdefault("algo", self.info.get("hash_algo", "sha256"))
        if "hash_seed" in self.info:
            kw.setdefault("seed", self.info["hash_seed"])
        if not _is_index(group, len(self.block_sizes)):
            raise InvalidArgument(f"group must be an int in [0, {len(self.block_sizes)}), got {group!r}")
        try:
            return hash_prompt(token_ids, self.block_sizes[group], **kw)
        except ARGUMENT_ERRORS as e:
            raise invalid_argument(e, "token ids") from e

    def hash_next_blocks(self, token_blocks, parents) -> np.ndarray:
        """kvd.hashing.hash_next_blocks with this pool's hash scheme: the blocks that many requests
        just filled, one each, chained to their parents, in one call (a decode step's hashing)."""
        from kvd.hashing import hash_next_blocks

        try:
            return hash_next_blocks(token_blocks, parents, algo=self.info.get("hash_algo", "sha256"))
        except ARGUMENT_ERRORS as e:
            raise invalid_argument(e, "token blocks or parents") from e

    # ---- session ----------------------------------------------------------------------------------
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _hello_msg(self) -> tuple[str, dict, list]:
        fields = {"tenant": self.tenant, "name": self.name, "pid": os.getpid(), "nonce": secrets.token_hex(8)}
        if self.kv_shared:
            fields["kv_shared"] = True
        if not self._want_slots:
            fields["slots"] = False
        if self._want_gpu is False:  # the daemon then neither allocates nor writes device buffers
            fields["gpu"] = False
        if self._want_mailbox:
            fields["mailbox"] = True
        return P.HELLO, fields, []

    @property
    def shared(self) -> bool:
        """Whether this session's prefix cache is its tenant's shared one (else its own)."""
        return bool(self.info.get("shared"))

    @staticmethod
    def _header(op: str, sid: int, seq: int, fields) -> bytes:
        if op is P.DECODE:  # fields: the header's tail, P.DECODE_FIELDS
            return P.DECODE_REQUEST.pack(P.DECODE_MAGIC, sid, seq, *fields)
        if op is P.ADMIT:  # fields: (c, la, the admission's ADMIT_COLS)
            return P.ADMIT_REQUEST.pack(P.ADMIT_MAGIC, sid, seq, *fields)
        if op is P.DECODE_FREE:  # fields: P.DECODE_FREE_FIELDS
            return P.DECODE_FREE_REQUEST.pack(P.DECODE_FREE_MAGIC, sid, seq, *fields)
        return P.request(op, sid, seq, **fields)

    def _confirmation(self, explicit: int | None) -> int | None:
        """The ``c`` of a step: the caller's, or in auto mode the tick of the step ``steps_in_flight``
        steps before the last (whose forward pass has finished when this step is scheduled)."""
        if explicit is not None:
            return _count("computed tick", explicit, P.MAX_INT)
        ticks = self._step_ticks
        if self._auto_confirm and len(ticks) == ticks.maxlen and self.info.get("shared"):
            return ticks[0]
        return None

    def _result(self, op: str, h, f: list, post) -> Any:
        """A reply arrived: note its tick, order the GPU after the daemon's writes, build the result.
        ``h``: the header as a dict, or a decode reply's ``P.unpack_decode_reply`` tuple."""
        self._on_reply(op, h)
        if self.gpu is not None:
            self.gpu.wait()
        return post(h, f)

    def _on_reply(self, op: str, h) -> None:
        t = h[2] if type(h) is tuple else h.get("t")
        if t is not None:
            self.tick = t
            if op is P.DECODE or op == P.STEP or op is P.ADMIT or op is P.DECODE_FREE:
                self._step_ticks.append(t)

    def _on_session(self, h: dict) -> None:
        old = self.shm
        self.sid = int(h["sid"])
        self.epoch = h["e"]
        self._epoch_b = self.epoch.encode("ascii")
        self.info = h
        self._num_groups = int(h.get("num_groups", 1))
        self._step_ticks.clear()
        if old is None or old.name != h["shm"]:
            self.shm = _attach_segment(h["shm"])
            self._reset_rows(int(h["max_reqs"]))
            if old is not None:
                old.close()
        self._on_mailbox(h)
        self._on_gpu(h.get("gpu"))
        if self.gpu is not None:
            self.gpu.wait()

    def _on_mailbox(self, h: dict) -> None:
        name = h.get("mb")
        old = self._mb
        if old is not None and old.name == name:
            return
        self._mb = None
        if old is not None:
            old.close()
        if name is not None and self._want_mailbox:
            try:
                self._mb = Mailbox.attach(name, int(h["mb_req"]), int(h["mb_rep"]))
            except (OSError, ValueError):  # an optimisation: the socket carries the decode steps too
                self._mb = None
            if self._mb is not None and h.get("mb_kick"):
                self._mb.kick_fd = kick_writer(str(h["mb_kick"]))

    @property
    def mailbox(self) -> bool:
        """Whether this session's binary step messages travel through its mailbox (``kvd.mailbox``)."""
        return self._mb is not None

    def _on_gpu(self, info: dict | None) -> None:
        if self.gpu is not None and (info is None or info.get("h") != self.gpu.key):
            self.gpu.close()
            self.gpu = None
        if info is None or self._want_gpu is False or self.gpu is not None:
            if info is None and self._want_gpu:
                raise InvalidArgument("gpu=True but the daemon has no GPU pool")
            return
        try:
            self.gpu = GpuBuffers(info, self._num_groups)
        except Exception as e:
            if self._want_gpu:
                raise
            import warnings

            warnings.warn(f"kvd: the daemon's GPU buffers are not mapped ({type(e).__name__}: {e}); "
                          "CPU shared memory only", RuntimeWarning, stacklevel=2)

    def _check(self, h: dict, seq: int) -> bool:
        """True when ``h`` answers ``seq``; raises for errors and for another daemon boot."""
        if h.get("q") != seq:
            return False
        e = h.get("e")
        if self.epoch is not None and e != self.epoch:
            raise DaemonRestarted(f"daemon restarted (epoch {self.epoch} -> {e}); call reconnect()")
        if "err" in h:
            _raise(h)
        return True

    def _hashes(self, block_hashes: Any) -> list[bytes]:
        G = self._num_groups
        if G == 1:
            if isinstance(block_hashes, (list, tuple)) and block_hashes and isinstance(block_hashes[0], np.ndarray):
                block_hashes = block_hashes[0] if len(block_hashes) == 1 else block_hashes
            return [P.hashes_frame(block_hashes, self.hash_width)]
        if not block_hashes:
            return [P.EMPTY] * G
        if len(block_hashes) != G:
            raise InvalidArgument(f"expected block hashes for {G} groups")
        return [P.hashes_frame(x, self.hash_width) for x in block_hashes]

    # ---- requests: (op, header fields, frames, post-processing) -----------------------------------
    @_builds
    def _req_lookup(self, block_hashes):
        return P.LOOKUP, {}, [P.hashes_frame(block_hashes, self.hash_width)], lambda h, f: int(h["n"])

    @_builds
    def _req_can_allocate(self, num_tokens, block_hashes=(), num_lookahead_tokens=0, *,
                          max_new_tokens=0, num_encoder_tokens=0):
        fields = {"nt": _count("num_tokens", num_tokens), "la": _count("num_lookahead_tokens", num_lookahead_tokens),
                  "mnt": _count("max_new_tokens", max_new_tokens),
                  "net": _count("num_encoder_tokens", num_encoder_tokens)}
        return P.CAN_ALLOCATE, fields, self._hashes(block_hashes), _alloc_status

    @_builds
    def _req_allocate(self, req_id, num_tokens, block_hashes=(), num_lookahead_tokens=0, *,
                      priority=DEFAULT_PRIORITY, num_encoder_tokens=0, max_new_tokens=0, token_ids=None):
        fields = {"nt": _count("num_tokens", num_tokens), "la": _count("num_lookahead_tokens", num_lookahead_tokens),
                  "pri": _count("priority", priority), "net": _count("num_encoder_tokens", num_encoder_tokens),
                  "mnt": _count("max_new_tokens", max_new_tokens)}
        frames = self._hashes(block_hashes)
        if token_ids is not None and self.info.get("kv_events"):  # only a daemon that publishes keeps them
            frames.append(token_frame(token_ids))
        row = self._new_row(req_id)
        fields["row"], fields["tag"] = row, tag_of(req_id)

        def post(h, f):
            st = int(h["status"])
            if st != STATUS_OK:
                self._drop_row(row)
                return AllocResult(st)
            return AllocResult(STATUS_OK, self._row_tables(row), int(h["cached"]), row)

        return P.ALLOCATE, fields, frames, post, lambda: self._drop_row(row)

    def _row_tables(self, row: int) -> tuple[np.ndarray, ...]:
        shm = self.shm
        return tuple(shm.tables[g][row, : int(shm.counts[g][row])] for g in range(len(shm.tables)))

    @_builds
    def _req_append_slots(self, req_id, num_new_tokens, new_block_hashes=(), num_lookahead_tokens=0, *,
                          new_block_token_ids=None):
        fields = {"n": _count("num_new_tokens", num_new_tokens),
                  "la": _count("num_lookahead_tokens", num_lookahead_tokens)}
        fields["row"] = self.row_of(req_id)
        frames = self._hashes(new_block_hashes)
        if new_block_token_ids is not None and self.info.get("kv_events"):
            frames += [token_frame(t) for t in group_token_ids(new_block_token_ids, len(frames))]

        def post(h, f):
            st = int(h["status"])
            if st != STATUS_OK:
                return AppendResult(st)
            G = len(f) - 1
            ids = tuple(np.frombuffer(f[g], np.int32) for g in range(G))
            return AppendResult(STATUS_OK, ids, np.frombuffer(f[G], np.int32).reshape(-1, 2))

        return P.APPEND, fields, frames, post

    @_builds
    def _req_free(self, req_id):
        row = self.row_of(req_id)

        def post(h, f):
            self._drop_row(row)

        return P.FREE, {}, [np.array([row], np.int32).tobytes()], post

    @_builds
    def _req_fork(self, parent_id, child_id):
        prow = self.row_of(parent_id)
        crow = self._new_row(child_id)
        return (P.FORK, {"parent": prow, "child": crow, "tag": tag_of(child_id)}, [],
                lambda h, f: None, lambda: self._drop_row(crow))

    def _swap_rows(self, req_ids) -> bytes:
        if isinstance(req_ids, (list, tuple, np.ndarray)):
            return self.rows_of(list(req_ids)).tobytes()
        return np.array([self.row_of(req_ids)], np.int32).tobytes()

    @_builds
    def _req_can_swap_out(self, req_ids):
        return P.CAN_SWAP_OUT, {}, [self._swap_rows(req_ids)], _alloc_status

    @_builds
    def _req_can_swap_in(self, req_ids):
        return P.CAN_SWAP_IN, {}, [self._swap_rows(req_ids)], _alloc_status

    @_builds
    def _req_swap_out(self, req_ids):
        return P.SWAP_OUT, {}, [self._swap_rows(req_ids)], _swap_result

    @_builds
    def _req_swap_in(self, req_ids):
        return P.SWAP_IN, {}, [self._swap_rows(req_ids)], _swap_result

    @_builds
    def _req_reset_prefix_cache(self):
        return P.RESET_PREFIX_CACHE, {}, [], lambda h, f: bool(h["done"])

    @_builds
    def _req_num_common_prefix_blocks(self, req_id, num_running):
        fields = {"row": self.row_of(req_id), "nr": _count("num_running", num_running)}
        return P.COMMON_PREFIX, fields, [], lambda h, f: int(h["n"])

    @_builds
    def _req_cross_block_table(self, req_id):
        return (P.CROSS_TABLE, {"row": self.row_of(req_id)}, [],
                lambda h, f: np.frombuffer(f[0], np.int32) if f else _EMPTY_I32)

    @_builds
    def _req_stats(self):
        return P.STATS, {}, [], lambda h, f: h["stats"]

    @_builds
    def _req_daemon_status(self):
        return P.STATUS, {}, [], lambda h, f: h["status"]

    @_builds
    def _req_heartbeat(self):
        return P.HEARTBEAT, {}, [], lambda h, f: None

    @_builds
    def _req_mark_computed(self, tick: int | None = None):
        c = self.tick if tick is None else _count("computed tick", tick, P.MAX_INT)
        return P.COMPUTED, {"c": c}, [], lambda h, f: None

    def _req_step(self, batch: StepBatch):
        try:  # (as _builds does, inline: the decode step's path pays nothing for it)
            G = self._num_groups
            rows = batch.append_rows
            if rows is not None and not len(batch.forks) and type(batch.append_num_tokens) is int:
                # (len: an array of ids has no truth value)
                if len(batch.free) or len(batch.admit):  # requests that finished or join, the others decoding
                    return DecodeWithFrees(self, batch, G).spec()
                spec = self._req_decode(rows, batch.append_num_tokens, batch.num_lookahead_tokens,
                                        batch.computed_through, batch.append_hashes, batch.append_hash_counts, G,
                                        batch.append_token_ids)
                if spec is not None:
                    return spec
            elif (len(batch.free) and not (len(batch.forks) or len(batch.append_ids))
                  and type(batch.append_num_tokens) is int):
                return DecodeWithFrees(self, batch, G).spec()  # frees (and admissions) without appends
            if _LONE_ADMISSION and batch.is_lone_admission():
                return LoneAdmission(self, batch, G).spec()
            return StepMessage(self, batch, G).spec()
        except ARGUMENT_ERRORS as e:
            raise invalid_argument(e, "step") from e

    def _req_decode(self, rows, num_tokens: int, lookahead: int, computed_through: int | None = None,
                    hashes=(), counts=(), num_groups: int = 1, token_ids=()):
        """The decode fast path of ``step`` (the ``decode`` op, a binary header): appends by row,
        one token count for all, and each KV-cache group's hashes of the blocks that filled (with
        one group their token ids, sent only to a daemon that publishes KV events); one array copy
        each way, no per-request Python. None when the batch needs the general message (token ids
        with several groups, counts that do not fit the rows)."""
        if type(rows) is not np.ndarray or rows.dtype != np.int32 or not rows.flags.c_contiguous:
            rows = int32_array(rows, "append_rows")  # InvalidArgument rather than a wrapped row
        na = rows.shape[0]
        if not 0 <= num_tokens <= P.MAX_COUNT or not 0 <= lookahead <= P.MAX_COUNT:
            return None
        rows_b = rows.tobytes()
        hash_frames = decode_hash_frames(hashes, counts, na, num_groups, self.hash_width)
        if hash_frames is None:
            return None
        frames = [rows_b, *hash_frames]
        if hash_frames:
            if len(token_ids) and self.info.get("kv_events"):
                if num_groups != 1:
                    return None  # several groups' token ids: the general message
                frames.append(token_frame(group_token_ids(token_ids, 1)[0]))
        elif len(token_ids):
            return None  # token ids without hashes: the general message reports it
        c = self._confirmation(computed_through)
        fields = (P.NO_CONFIRM if c is None else c, na, num_tokens, int(lookahead))  # P.DECODE_FIELDS
        return P.DECODE, fields, frames, functools.partial(_decode_post, rows_b, num_tokens)

    def _release_local(self) -> None:
        """Close the socket and unmap the session's buffers (never unlinks: the daemon owns them)."""
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None
        if self._mb is not None:
            self._mb.close()
            self._mb = None
        self.sid = 0
        self._ctx.term()


_EMPTY_I16_RO, _EMPTY_I32_RO = P.EMPTY_I16_RO, P.EMPTY_I32_RO
DECODE_REPLY_MAGIC = P.DECODE_REPLY_MAGIC
_EMPTY_COPIES = np.empty((0, 2), np.int32)
_EMPTY_COPIES.flags.writeable = False


# A pinned client's ZeroMQ I/O thread shares the engine thread's CPU. At normal policy each send
# woke it at once (wake-up preemption), so the engine thread waited while it wrote the message out;
# SCHED_BATCH keeps its weight but never preempts on waking: the engine's send returns, and the
# thread writes the message (and reads a reply) when the engine next polls (sched_yield) or blocks.
# H200 hosts (session 29, bench_engine's model, 256 requests): a decode message's send 76-86 -> 49 µs,
# a 16-step window's 103-156 -> 72-111 µs; the cross-engine hit's round trip the same (0.84 ms).
IO_THREAD_POLICY = getattr(os, "SCHED_BATCH", None)  # Linux
_io_policy_ok: bool | None = None


def _io_policy_allowed() -> bool:
    """Whether this process may give a thread ``IO_THREAD_POLICY`` (tried once, on a throwaway
    thread): libzmq aborts the process when its I/O thread's policy cannot be set."""
    global _io_policy_ok
    if IO_THREAD_POLICY is None:
        return False
    if _io_policy_ok is None:
        ok = []

        def probe() -> None:
            try:
                os.sched_setscheduler(0, IO_THREAD_POLICY, os.sched_param(0))  # this thread only
                ok.append(True)
            except (OSError, AttributeError):
                pass

        t = threading.Thread(target=probe, name="kvd-policy-probe", daemon=True)
        t.start()
        t.join()
        _io_policy_ok = bool(ok)
    return _io_policy_ok

DEFAULT_BUSY_POLL_US = 1000
# On one CPU a polling engine holds the CPU the daemon needs. Measured on the 2-core box (session 16,
# six alternating runs each, two sittings): a polling client's step p50 108-132 µs against 125-222
# sleeping; 4 clients' aggregate steps/s fell ~6 % in one sitting (7,686-8,118 against 8,234-9,205)
# and not in the other, worst p99 within 2 ms.
BUSY_POLL_MIN_CPUS = 2


def default_busy_poll_us() -> int:
    """``Client(busy_poll_us=None)``: ``DEFAULT_BUSY_POLL_US`` with at least ``BUSY_POLL_MIN_CPUS``
    CPUs to run on, else 0."""
    return DEFAULT_BUSY_POLL_US if len(os.sched_getaffinity(0)) >= BUSY_POLL_MIN_CPUS else 0


def _undo(spec: tuple) -> None:
    """A request that failed: undo what building it did on the client (its optional 5th item)."""
    if len(spec) > 4:
        spec[4]()


def _decode_post(rows_b: bytes, an: int, h, f: list) -> StepResult:
    """The decode op's result; ``h``: its reply header, a ``P.unpack_decode_reply`` tuple (the
    blocking client) or ``P.parse_reply``'s dict (the asyncio client)."""
    if type(h) is tuple:
        _, _, tick, nc, nch, ns, nt = h
        freed = 0
    else:
        tick, nc, nch, ns, nt, freed = h["t"], h["nc"], h["nch"], h["ns"], h.get("nt", []), h["nfr"]
    if freed:
        raise ProtocolError("a decode step's reply says it freed requests")
    return _decode_result(rows_b, an, tick, nc, nch, ns, nt, f[0])


def _decode_result(rows_b: bytes, an: int, tick: int, nc: int, nch: int, ns: int, nt, body: bytes) -> StepResult:
    """The decode op's result from its reply's counts and body."""
    na = len(rows_b) >> 2
    if len(body) != 2 * na + 8 * nc + 4 * nch + 4 * ns:
        raise ProtocolError(f"step reply body of {len(body)} bytes does not match a decode step of {na} rows")
    append_status = np.frombuffer(body, P.I16, na, 0)
    copies = np.frombuffer(body, P.I32, 2 * nc, 2 * na).reshape(nc, 2) if nc else _EMPTY_COPIES
    off = 2 * na + 8 * nc
    # The schedule: the append rows whose status is OK (all of them when ns == na), ``an`` tokens
    # each; only the start positions travel.
    sched_rows = np.frombuffer(rows_b, P.I32)
    if ns != na:
        sched_rows = sched_rows[append_status == STATUS_OK]
    # positional: keywords cost an engine's cold thread ~3 µs a step more (see Client._post_decode)
    res = StepResult(
        _EMPTY_I16_RO, _EMPTY_I16_RO, append_status, _EMPTY_I16_RO, _EMPTY_I32_RO, _EMPTY_I32_RO, copies,
        np.frombuffer(body, P.I32, nch, off) if nch else _EMPTY_I32_RO, sched_rows,
        np.frombuffer(body, P.I32, ns, off + 4 * nch), P.uniform_lens(ns, an), _EMPTY_I32_RO, tick)
    res.num_scheduled_tokens = list(nt)  # type: ignore[attr-defined]
    return res


_I32 = np.dtype(np.int32)  # (numpy's one native int32 dtype: an identity test, no comparison)
_VIA_MAILBOX = object()
"""``_send_first``'s "sent" for a request posted in the session's mailbox."""

_NO_ID = object()
"""What a free session row's request id is (``_Core._id_of``)."""

def _alloc_status(h: dict, f: list) -> AllocStatus:
    return AllocStatus(int(h["status"]))


def _swap_result(h, f) -> SwapResult:
    mapping = np.frombuffer(f[0], np.int32).reshape(-1, 2) if f else np.empty((0, 2), np.int32)
    return SwapResult(int(h["status"]), mapping)


_API = ("lookup", "can_allocate", "allocate", "append_slots", "free", "fork", "can_swap_out",
        "swap_out", "can_swap_in", "swap_in", "reset_prefix_cache", "num_common_prefix_blocks",
        "cross_block_table", "stats", "daemon_status", "step", "mark_computed")


# ---- blocking client ----------------------------------------------------------------------------

class Client(_Core):
    """Blocking client of a kvd daemon: one session, opened at once."""

    def __init__(self, endpoint: str | None = None, *, tenant: str = "", name: str = "",
                 timeout_s: float = 2.0, retries: int = 2, heartbeat: bool = True,
                 gpu: bool | None = None, kv_shared: bool = False, confirm: str = "auto",
                 steps_in_flight: int = 1, busy_poll_us: int | None = None, slot_mapping: bool = True,
                 io_cpu: int | None = None, mailbox: bool = False) -> None:
        """Connect and say hello.

        ``endpoint``: the daemon's ZeroMQ endpoint (default: ``$KVD_ENDPOINT``, else the daemon's
        default ipc socket, see ``default_endpoint``). ``tenant``: a tenant the daemon's ``tenants``
        config opens to this process's uid/gids ("": its own, ``uid:<uid>``). ``kv_shared``: this
        engine's KV memory is shared with the tenant's other engines, so they may share one prefix
        cache (implied when the daemon owns the KV cache). ``confirm``/``steps_in_flight``: when
        blocks this session filled become hits for the tenant's other sessions ("auto": each step
        confirms the step ``steps_in_flight`` before the last; "explicit": ``mark_computed``; see
        the README, "Sharing"). ``name``: shown by ``kvd status``. ``timeout_s`` per attempt, ``retries`` more
        attempts (a retried request is applied once). ``heartbeat``: renew the lease from a
        background thread. ``gpu``: map the daemon's CUDA-IPC buffers (None: when it has a GPU
        pool and torch can; True: required; False: never, and the daemon then keeps none for this
        session: no device memory, no GPU writes after its replies). ``busy_poll_us``: wait for each reply
        this long by polling (yielding the CPU) before sleeping in recv, which costs a wake-up
        (None: ``DEFAULT_BUSY_POLL_US`` with at least ``BUSY_POLL_MIN_CPUS`` CPUs to run on, else 0:
        on fewer, a polling engine takes the CPU the daemon and the other engines need).
        ``slot_mapping``: the daemon writes each step's slot mapping into ``slot_mappings`` (and the
        GPU buffers); False for an engine that computes its slots from the block tables itself
        (a CUDA graph does): the daemon then skips that work and its GPU launch on every step.
        ``io_cpu``: pin this client's ZeroMQ I/O thread to that CPU (None: not pinned); with the
        engine's thread pinned there too (``os.sched_setaffinity``), a reply wakes the I/O thread on
        the CPU the busy-polling engine keeps awake rather than an idle one (the daemon's
        ``pin_cpu`` is the same on its side). The pinned I/O thread runs under
        ``IO_THREAD_POLICY`` (``SCHED_BATCH``, where the process may set it): woken, it does not
        preempt the engine's thread, and does its work when that thread waits or yields.
        ``mailbox``: send the steps that travel as binary ops (``decode``, ``decode_free``,
        ``admit``: see ``step``) through shared memory and take their replies there
        (``kvd.mailbox``), where the daemon grants one (to a process of its own uid); the socket
        carries everything else. Its wait polls, yielding the CPU, whatever
        ``busy_poll_us`` says. The ``mailbox`` property says whether it was granted.

        Raises ``DaemonUnavailable`` (no socket file), ``PermissionDenied`` (socket or segment not
        accessible), ``Timeout`` (no answer), ``ServerBusy`` (too many sessions)."""
        super().__init__(endpoint, tenant=tenant, name=name, timeout_s=timeout_s, retries=retries,
                         heartbeat=heartbeat, gpu=gpu, kv_shared=kv_shared, confirm=confirm,
                         steps_in_flight=steps_in_flight, slot_mapping=slot_mapping)
        if busy_poll_us is None:
            busy_poll_us = default_busy_poll_us()
        if type(busy_poll_us) is not int or not 0 <= busy_poll_us <= 1_000_000:
            raise InvalidArgument(f"busy_poll_us must be an int in [0, 1e6], got {busy_poll_us!r}")
        self._poll_s = busy_poll_us / 1e6
        if type(mailbox) is not bool:
            raise InvalidArgument(f"mailbox must be a bool, got {mailbox!r}")
        self._want_mailbox = mailbox
        if io_cpu is not None and (type(io_cpu) is not int or io_cpu not in os.sched_getaffinity(0)):
            raise InvalidArgument(f"io_cpu must be one of this process's CPUs {sorted(os.sched_getaffinity(0))}, "
                                  f"got {io_cpu!r}")
        self._ctx = zmq.Context()
        if io_cpu is not None:
            self._ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, io_cpu)  # before the first socket starts the thread
            if _io_policy_allowed():
                self._ctx.set(zmq.THREAD_SCHED_POLICY, IO_THREAD_POLICY)
        self._sock: zmq.Socket | None = None
        self._hb: _Heartbeat | None = None
        self._pending: PendingStep | None = None  # a started step whose reply is not taken yet
        self.kicks = 0  # mailbox requests that found the daemon's loop asleep and kicked it awake (_kick)
        try:
            self._open()
            self._hello()
        except BaseException:
            self.close(goodbye=False)
            raise

    def _open(self) -> None:
        check_endpoint(self.endpoint)
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 64)
        s.setsockopt(zmq.RCVHWM, 64)
        s.connect(self.endpoint)
        self._sock = s
        self._rcvtimeo = -1

    def _start_heartbeat(self) -> None:
        if not self._want_heartbeat:
            return
        if self._hb is None:
            self._hb = _Heartbeat(self._ctx, self.endpoint, float(self.info.get("hb_s", 0.375)))
            self._hb.sid = self.sid
            self._hb.start()
        self._hb.sid = self.sid

    def _hello(self) -> None:
        op, fields, frames = self._hello_msg()
        self.epoch = None
        h, _ = self._call(op, fields, frames, sid=0)
        self._on_session(h)
        self._start_heartbeat()

    def _call(self, op: str, fields: dict, frames: list, sid: int | None = None) -> tuple[dict, list]:
        return self._exchange(op, *self._send_first(op, fields, frames, sid))

    def _send_first(self, op: str, fields: dict, frames: list, sid: int | None = None) -> tuple[int, list, bool]:
        """Number and send a request without waiting: (seq, frames, whether it went out). Refused
        while a ``start_step`` waits for its reply (one request in flight per session socket)."""
        if self._pending is not None:
            raise InvalidArgument("a started step waits for its reply: call its result() first")
        seq = self._next_seq()
        msg = [self._header(op, self.sid if sid is None else sid, seq, fields), *frames]
        if self._sock is None:
            raise SessionError("client is closed")
        mb = self._mb
        if (op is P.DECODE or op is P.DECODE_FREE or op is P.ADMIT) and mb is not None and mb.post(seq, msg):
            if not mb.daemon_polls():
                self._kick()
            return seq, msg, _VIA_MAILBOX
        try:
            P.send_frames(self._sock, msg, P.NOBLOCK)
        except zmq.Again:
            return seq, msg, False
        return seq, msg, True

    def _answer(self, op: str, head: bytes, seq: int):
        """The header of a reply to request ``seq``: a dict, or for the decode op the tuple of
        ``P.unpack_decode_reply`` (no dict: the step an engine sends most; the admit op's too); None for a stale or
        unreadable reply. Raises for an error reply and for another daemon boot."""
        if (op is P.DECODE or op is P.ADMIT or op is P.DECODE_FREE) and head[:4] == DECODE_REPLY_MAGIC:
            try:
                r = P.unpack_decode_reply(head)
            except ProtocolError:
                return None
            if r[0] != seq:
                return None
            epoch = r[1].decode("ascii", "replace")
            if self.epoch is not None and epoch != self.epoch:
                raise DaemonRestarted(f"daemon restarted (epoch {self.epoch} -> {epoch}); call reconnect()")
            return r
        try:
            h = P.parse_reply(head)
        except ProtocolError:
            return None
        return h if self._check(h, seq) else None

    def _kick(self) -> None:
        """Wake the daemon's loop to look at the mailbox: through its kick FIFO, else on the socket
        (kvd.mailbox); ``kicks`` counts them."""
        self.kicks += 1
        mb = self._mb
        if mb is not None and mb.kick():
            return
        self._kick_socket()

    def _kick_socket(self) -> None:
        try:
            P.send_frames(self._sock, [KICK], P.NOBLOCK)
        except zmq.Again:
            pass  # the queue is full of messages: the daemon wakes for them

    def _exchange_mailbox(self, op: str, seq: int, msg: list | None, in_place=None) -> tuple[dict | tuple, list | None]:
        """``_exchange`` of a request posted in the mailbox: the reply comes there, or on the socket
        (one too large for the mailbox, or the reply to the same request resent on the socket after
        a timeout, which the daemon applies once). ``msg`` None: a resend takes the request from
        the mailbox. ``in_place(seq)``: a reply in the mailbox read in place, returned as (its
        value, None) unless it says None."""
        mb, sock = self._mb, self._sock
        pc = time.perf_counter
        now = pc()
        kick_at, deadline = now + KICK_AGAIN_S, now + self.timeout_s
        attempts = 0
        while True:
            if mb.replied(seq):
                r = None if in_place is None else in_place(seq)
                if r is not None:
                    return r, None
                try:
                    rep = mb.reply()
                except ProtocolError:
                    rep = None
                h = None if rep is None else self._answer(op, rep[0], seq)
                if h is not None:
                    return h, rep[1:]
            if P.has_input(sock):
                try:
                    rep = P.recv_frames(sock, P.NOBLOCK)
                except zmq.Again:
                    continue
                h = self._answer(op, rep[0], seq)
                if h is not None:
                    return h, rep[1:]
                continue
            now = pc()
            if now >= kick_at:
                self._kick()
                kick_at = now + KICK_AGAIN_S
            if now >= deadline:
                attempts += 1
                if attempts > self.retries:
                    raise Timeout(f"no reply to {op} from {self.endpoint} after {attempts} attempts")
                if msg is None:
                    msg = mb.request()
                try:
                    P.send_frames(sock, msg, P.NOBLOCK)
                except zmq.Again:
                    pass
                deadline = now + self.timeout_s
            os.sched_yield()

    def _exchange(self, op: str, seq: int, msg: list, sent: bool) -> tuple[dict | tuple, list]:
        """Wait for the reply to request ``seq`` (sent already when ``sent``), resending it on a
        timeout: every attempt waits ``timeout_s``."""
        if sent is _VIA_MAILBOX:
            return self._exchange_mailbox(op, seq, msg)
        sock = self._sock
        if sock is None:
            raise SessionError("client is closed")
        # One blocking receive with a socket timeout (RCVTIMEO): no poll() call and no EAGAIN
        # exception per step; a stale reply (an earlier, timed-out attempt) is skipped.
        timeo = max(1, int(self.timeout_s * 1000))
        if timeo != self._rcvtimeo:
            sock.setsockopt(zmq.RCVTIMEO, timeo)
            self._rcvtimeo = timeo
        for attempt in range(self.retries + 1):
            if attempt or not sent:
                try:
                    P.send_frames(sock, msg, P.NOBLOCK)
                except zmq.Again:
                    time.sleep(min(self.timeout_s, 0.05))
                    continue
            deadline = 0.0
            while True:
                if self._poll_s:
                    P.busy_poll(sock, self._poll_s)
                try:
                    rep = P.recv_frames(sock)
                except zmq.Again:
                    break
                h = self._answer(op, rep[0], seq)
                if h is not None:
                    return h, rep[1:]
                now = time.monotonic()  # a stale reply: wait at most timeout_s in all
                if not deadline:
                    deadline = now + self.timeout_s
                elif now >= deadline:
                    break
        raise Timeout(f"no reply to {op} from {self.endpoint} after {self.retries + 1} attempts")

    def _do(self, spec: tuple) -> Any:
        op, fields, frames, post = spec[:4]
        try:
            h, f = self._call(op, fields, frames)
        except BaseException:
            _undo(spec)
            raise
        return self._result(op, h, f, post)

    def _start(self, spec: tuple) -> tuple[int, list, bool]:
        """``_do``'s first half (``start_step``): send."""
        try:
            return self._send_first(*spec[:3])
        except BaseException:
            _undo(spec)
            raise

    def _done(self, spec: tuple, sent: tuple[int, list, bool]) -> Any:
        """``_do``'s second half (``PendingStep.result``): wait for the reply."""
        try:
            h, f = self._exchange(spec[0], *sent)
        except BaseException:
            _undo(spec)
            raise
        return self._result(spec[0], h, f, spec[3])

    def reconnect(self) -> bool:
        """Re-attach to the daemon. Returns True when the old session survived (same daemon boot),
        False when a new session was opened (every request of the old one is gone)."""
        old_sid, old_epoch = self.sid, self.epoch
        self._drop_pending()
        if self._sock is not None:
            self._sock.close(0)
        self._open()
        if old_sid and old_epoch:
            try:
                h, _ = self._call(P.ATTACH, {"epoch": old_epoch}, [], sid=old_sid)
                self._on_session(h)
                self._start_heartbeat()
                return True
            except SessionError:
                pass
        self._hello()
        return False

    def close(self, goodbye: bool = True) -> None:
        """Say goodbye (the daemon frees every request of the session), stop heartbeating."""
        if self._hb is not None:
            self._hb.stop_event.set()
            self._hb.join(timeout=2)
            self._hb = None
        self._drop_pending()
        if goodbye and self._sock is not None and self.sid:
            try:
                saved = self.retries
                self.retries = 0
                self._call(P.GOODBYE, {}, [])
            except KvdError:
                pass
            finally:
                self.retries = saved
        self._release_local()

    # ---- the manager's API (kvd.manager.BlockManager semantics, over the daemon) ---------------
    def lookup(self, block_hashes) -> int:
        """Number of leading blocks of ``block_hashes`` (S16 hashes of group 0's full blocks) that
        are in this session's prefix-cache namespace now. Changes nothing."""
        return self._do(self._req_lookup(block_hashes))

    def can_allocate(self, num_tokens: int, block_hashes=(), num_lookahead_tokens: int = 0, *,
                     max_new_tokens: int = 0, num_encoder_tokens: int = 0) -> AllocStatus:
        """Whether ``allocate`` with these arguments would succeed now (OK), may later (LATER) or
        never can in this pool (NEVER); invalid arguments raise what ``allocate`` raises.
        Advisory once several engines share the pool: act on ``allocate``'s own status."""
        return self._do(self._req_can_allocate(num_tokens, block_hashes, num_lookahead_tokens,
                                               max_new_tokens=max_new_tokens,
                                               num_encoder_tokens=num_encoder_tokens))

    def allocate(self, req_id: Hashable, num_tokens: int, block_hashes=(), num_lookahead_tokens: int = 0, *,
                 priority: int = DEFAULT_PRIORITY, num_encoder_tokens: int = 0,
                 max_new_tokens: int = 0, token_ids=None) -> AllocResult:
        """Admit request ``req_id`` with a prompt of ``num_tokens`` tokens whose full blocks hash to
        ``block_hashes`` (one array per group with several groups). Reuses the cached prefix; the
        block table is in ``tables[g][row_of(req_id)]`` and the slot mapping of the prompt's
        uncached tokens in ``slot_mappings[g]`` when it returns. ``status`` LATER / NEVER (as
        ``can_allocate`` answers): nothing changed. ``token_ids``: the prompt's, for the KV events'
        BlockStored (sent only when the daemon publishes events: ``info["kv_events"]``)."""
        return self._do(self._req_allocate(req_id, num_tokens, block_hashes, num_lookahead_tokens,
                                           priority=priority, num_encoder_tokens=num_encoder_tokens,
                                           max_new_tokens=max_new_tokens, token_ids=token_ids))

    def append_slots(self, req_id: Hashable, num_new_tokens: int, new_block_hashes=(),
                     num_lookahead_tokens: int = 0, *, new_block_token_ids=None) -> AppendResult:
        """Grow request ``req_id`` by ``num_new_tokens`` tokens (plus lookahead slots), registering
        ``new_block_hashes`` of blocks that became full. The new tokens' slots are in
        ``slot_mappings[g]`` when it returns; ``copies`` are the copy-on-write copies to do first.
        ``status`` LATER: nothing changed (preempt something). ``new_block_token_ids``: those
        blocks' token ids for KV events (per group with several groups; see ``allocate``)."""
        return self._do(self._req_append_slots(req_id, num_new_tokens, new_block_hashes, num_lookahead_tokens,
                                               new_block_token_ids=new_block_token_ids))

    def free(self, req_id: Hashable) -> None:
        """Release request ``req_id``: its blocks go back to the pool (full ones stay cached)."""
        return self._do(self._req_free(req_id))

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """New request ``child_id`` sharing every block of ``parent_id`` (copy-on-write)."""
        return self._do(self._req_fork(parent_id, child_id))

    def can_swap_out(self, req_ids) -> AllocStatus:
        """Whether ``swap_out(req_ids)`` fits the CPU pool now (OK), later (LATER) or never
        (NEVER: no or too small a CPU pool). Advisory when several engines share the pool."""
        return self._do(self._req_can_swap_out(req_ids))

    def swap_out(self, req_ids) -> SwapResult:
        """Move the requests' blocks to the CPU pool; ``mapping``: (gpu, cpu) block pairs to copy."""
        return self._do(self._req_swap_out(req_ids))

    def can_swap_in(self, req_ids) -> AllocStatus:
        """Whether ``swap_in(req_ids)`` fits the GPU pool now (OK), later (LATER) or never (NEVER).
        Advisory when several engines share the pool."""
        return self._do(self._req_can_swap_in(req_ids))

    def swap_in(self, req_ids) -> SwapResult:
        """Bring swapped requests back; ``mapping``: (cpu, gpu) block pairs to copy."""
        return self._do(self._req_swap_in(req_ids))

    def reset_prefix_cache(self) -> bool:
        """Forget this session's namespace of the prefix cache (other tenants are untouched);
        False when blocks of it are still in use."""
        return self._do(self._req_reset_prefix_cache())

    def num_common_prefix_blocks(self, req_id: Hashable, num_running: int) -> int:
        """Leading blocks of ``req_id`` (group 0) held by exactly ``num_running`` requests, the
        shared prefix for cascade attention."""
        return self._do(self._req_num_common_prefix_blocks(req_id, num_running))

    def cross_block_table(self, req_id: Hashable) -> np.ndarray:
        """The encoder-decoder cross-attention block ids of ``req_id`` (a copy)."""
        return self._do(self._req_cross_block_table(req_id))

    def stats(self) -> dict:
        """The pool's statistics (the manager's ``stats()``) plus ``sessions`` and this session's
        ``session_requests``."""
        return self._do(self._req_stats())

    def daemon_status(self) -> dict:
        """The daemon-wide view ``kvd status`` prints: daemon, pool, sessions, tenants."""
        return self._do(self._req_daemon_status())

    def step(self, batch: StepBatch) -> StepResult:
        """Apply one scheduler step in one round trip: frees, forks, appends, admissions (see
        ``kvd.api.StepBatch``). Every request gets a status in the result (a bad id is a status,
        not an exception); rows are session rows. Block tables and the step's slot mapping are in
        ``tables`` / ``slot_mappings`` when it returns; ``sched_*`` say which rows' tokens they
        hold. ``append_rows`` with one int token count takes the decode fast path (the ``decode``
        op, through the session's mailbox when it has one; with frees or admissions beside them,
        or frees alone, the ``decode_free`` op)."""
        if self._mb is not None:
            pending = self._post_decode(batch)
            if pending is not None:
                return pending.result()
        return self._do(self._req_step(batch))

    def start_step(self, batch: StepBatch) -> "PendingStep":
        """``step`` in two halves: send the step now and return; ``result()`` of what this returns
        waits for the reply (resending on a timeout, as ``step`` does) and returns the
        ``StepResult``. Between the two the caller may do anything but another call on this
        client (``InvalidArgument``): an engine overlaps the round trip with its own work, such as
        waiting for the GPU. The step's tables are written when ``result()`` returns."""
        if self._mb is not None:
            pending = self._post_decode(batch)
            if pending is not None:
                return pending
        spec = self._req_step(batch)
        pending = PendingStep(self, spec, self._start(spec))
        self._pending = pending
        return pending

    def _post_decode(self, batch: StepBatch) -> "PendingStep | None":
        """A decode step (``_req_decode``'s) posted in the mailbox in a few operations, or None
        (nothing done) for any other batch or one that does not fit: the general path takes it.

        An engine sends this message once per forward, and its thread meets the code cold: on an
        H200 host the general path's send and take cost ~27 µs each there against ~4 warm (the
        2-core box: 21 and 16 against 4 and 4 with its caches thrashed between steps). So this path
        writes the header and the frame table with one ``pack_into``, and ``PendingStep.result``
        reads the reply in place (``_posted_decode_reply``)."""
        rows = batch.append_rows
        n = batch.append_num_tokens
        la = batch.num_lookahead_tokens
        if (type(rows) is not np.ndarray or type(n) is not int or type(la) is not int or rows.dtype is not _I32
                or rows.ndim != 1 or not 0 <= n <= P.MAX_COUNT
                or not 0 <= la <= P.MAX_COUNT or self._pending is not None or len(batch.free) or len(batch.forks)
                or len(batch.admit) or len(batch.append_ids) or len(batch.append_token_ids)):
            return None
        hs, cnt = batch.append_hashes, batch.append_hash_counts
        na = rows.shape[0]
        extra = decode_hash_arrays(hs, cnt, na, self._num_groups, self.hash_width) if len(hs) or len(cnt) else ()
        if extra is None:
            return None
        try:
            c = self._confirmation(batch.computed_through)
        except ARGUMENT_ERRORS as e:
            raise invalid_argument(e, "step") from e
        rows_b = rows.tobytes()
        mb = self._mb
        seq = self._seq + 1
        if not mb.post_decode(seq, self.sid, P.NO_CONFIRM if c is None else c, na, n, la, rows_b, extra):
            return None
        self._seq = seq
        if not mb.daemon_polls():
            self._kick()
        pending = PendingStep(self, (rows_b, n), seq)
        self._pending = pending
        return pending

    def _posted_decode_reply(self, seq: int) -> tuple | None:
        """``_post_decode``'s reply read in place and taken (the tick noted, the GPU buffers' writes
        ordered before the current stream's work): ``Mailbox.decode_reply``'s (epoch, tick, nc, nch,
        ns, token counts, body); None when it is not there yet or is not a decode reply to it from
        this daemon boot (the general wait then takes it, or raises)."""
        mb = self._mb
        if mb is None or not mb.replied(seq):
            return None
        r = mb.decode_reply(seq, self._num_groups)
        if r is None or r[0] != self._epoch_b:
            return None
        tick = r[1]
        self.tick = tick
        self._step_ticks.append(tick)
        if self.gpu is not None:
            self.gpu.wait()
        return r

    def _drop_pending(self) -> None:
        """Forget a started step's reply (closing or reconnecting: it is skipped as stale)."""
        if self._pending is not None:
            self._pending._client = None
            self._pending = None

    def mark_computed(self, tick: int | None = None) -> None:
        """Confirm that the forward passes of this session's calls up to ``tick`` (default: the
        last reply's, ``self.tick``) have finished: the blocks they filled become prefix hits for
        the tenant's other sessions. In ``confirm="auto"`` mode steps do this on their own."""
        return self._do(self._req_mark_computed(tick))

    def heartbeat(self) -> None:
        """Renew the session's lease now (the background thread does it on its own)."""
        self._do(self._req_heartbeat())

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PendingStep:
    """A step sent by ``Client.start_step`` whose reply is not taken yet: ``spec`` and ``sent`` are
    ``Client._start``'s, or for a decode step posted in the mailbox (``Client._post_decode``) its rows
    (bytes) and token count, and its sequence number (an int)."""

    __slots__ = ("_client", "_spec", "_sent", "_result", "_reply")

    def __init__(self, client: Client, spec: tuple, sent: tuple[int, list, bool] | int) -> None:
        self._client, self._spec, self._sent = client, spec, sent
        self._result: StepResult | None = None
        self._reply: tuple | None = None  # a posted decode step's reply, taken by granted()

    def ready(self) -> bool:
        """Whether ``result()`` would return without waiting: taken already, or a reply waits in
        the mailbox or on the socket now (checked without receiving)."""
        c = self._client
        if self._result is not None or self._reply is not None:
            return True
        if c is None or c._sock is None:
            return False
        sent = self._sent
        if type(sent) is int:
            return c._mb.replied(sent) or P.has_input(c._sock)
        return (sent[2] is _VIA_MAILBOX and c._mb.replied(sent[0])) or P.has_input(c._sock)

    def granted(self) -> bool:
        """Wait for the reply as ``result`` does and say whether every request of the step got
        ``STATUS_OK`` (frees, forks, appends, admissions) with nothing copied on write
        (``StepResult.granted``); ``result()`` then still returns the whole result. An engine's
        steady decode step needs no more than this from its reply (its tables are written when
        this returns), and a decode reply through the mailbox answers it from the reply's counts
        alone: the result's arrays are built only if ``result()`` asks (the engine's thread meets
        this code cold once a step, where building them cost more than the rest of the taking)."""
        if self._reply is None and self._result is None:
            self._take()
        r = self._reply
        if r is not None:  # (epoch, tick, copies, changed rows, scheduled rows, ...) of a decode reply
            return r[2] == 0 and r[4] == len(self._spec[0]) >> 2
        return self._result.granted()

    def result(self) -> StepResult:
        """Wait for the reply (at once when it has arrived) and return the step's result; later
        calls return the same result."""
        if self._result is None:
            if self._reply is None:
                self._take()
            if self._result is None:  # a posted decode step's reply, read in place
                rows_b, an = self._spec
                _, tick, nc, nch, ns, nt, body = self._reply
                self._result = _decode_result(rows_b, an, tick, nc, nch, ns, nt, body)
        return self._result

    def _take(self) -> None:
        """Wait for the reply: a decode reply in the mailbox to a step posted there is kept as read
        (``_reply``), anything else becomes ``_result``."""
        c = self._client
        if c is None or c._pending is not self:
            raise SessionError("no reply to wait for: the client closed or reconnected, or an "
                               "earlier result() failed")
        sent = self._sent
        c._pending, self._client = None, None
        if type(sent) is int:  # posted by _post_decode
            r = c._posted_decode_reply(sent)
            if r is None:
                r, f = c._exchange_mailbox(P.DECODE, sent, None, c._posted_decode_reply)
                if f is not None:  # a reply on the socket (too large for the mailbox, or to a resend)
                    self._result = c._result(P.DECODE, r, f, functools.partial(_decode_post, *self._spec))
                    return
            self._reply = r
            return
        self._result = c._done(self._spec, sent)


# ---- asyncio client -----------------------------------------------------------------------------

class AsyncClient(_Core):
    """asyncio client: ``c = await AsyncClient.connect(endpoint, tenant=...)``; every API method is
    a coroutine. Heartbeats run on a thread (they keep the lease even if the loop is busy)."""

    def __init__(self, endpoint: str | None = None, *, tenant: str = "", name: str = "",
                 timeout_s: float = 2.0, retries: int = 2, heartbeat: bool = True,
                 gpu: bool | None = None, kv_shared: bool = False, confirm: str = "auto",
                 steps_in_flight: int = 1, slot_mapping: bool = True) -> None:
        """Not connected yet: use ``await AsyncClient.connect(...)`` (same keywords as Client)."""
        super().__init__(endpoint, tenant=tenant, name=name, timeout_s=timeout_s, retries=retries,
                         heartbeat=heartbeat, gpu=gpu, kv_shared=kv_shared, confirm=confirm,
                         steps_in_flight=steps_in_flight, slot_mapping=slot_mapping)
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        self._sock = None
        self._hb: _Heartbeat | None = None
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(cls, endpoint: str | None = None, *, tenant: str = "", name: str = "",
                      timeout_s: float = 2.0, retries: int = 2, heartbeat: bool = True,
                      gpu: bool | None = None, kv_shared: bool = False, confirm: str = "auto",
                      steps_in_flight: int = 1, slot_mapping: bool = True) -> "AsyncClient":
        """Connect and say hello (see ``Client.__init__`` for the keywords and errors; there is no
        ``busy_poll_us`` or ``io_cpu`` here: both serve the blocking client's polling wait, and this
        one waits in its event loop)."""
        self = cls(endpoint, tenant=tenant, name=name, timeout_s=timeout_s, retries=retries,
                   heartbeat=heartbeat, gpu=gpu, kv_shared=kv_shared, confirm=confirm,
                   steps_in_flight=steps_in_flight, slot_mapping=slot_mapping)
        try:
            self._open()
            await self._hello()
        except BaseException:
            await self.close(goodbye=False)
            raise
        return self

    def _open(self) -> None:
        check_endpoint(self.endpoint)
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 64)
        s.setsockopt(zmq.RCVHWM, 64)
        s.connect(self.endpoint)
        self._sock = s

    async def _hello(self) -> None:
        op, fields, frames = self._hello_msg()
        self.epoch = None
        h, _ = await self._call(op, fields, frames, sid=0)
        self._on_session(h)
        self._start_heartbeat()

    def _start_heartbeat(self) -> None:
        if not self._want_heartbeat:
            return
        if self._hb is None:
            self._hb = _Heartbeat(self._sync_ctx, self.endpoint, float(self.info.get("hb_s", 0.375)))
            self._hb.sid = self.sid
            self._hb.start()
        self._hb.sid = self.sid

    async def _call(self, op: str, fields: dict, frames: list, sid: int | None = None):
        async with self._lock:
            seq = self._next_seq()
            msg = [self._header(op, self.sid if sid is None else sid, seq, fields), *frames]
            sock = self._sock
            if sock is None:
                raise SessionError("client is closed")
            for _attempt in range(self.retries + 1):
                try:
                    await sock.send_multipart(msg, zmq.NOBLOCK)
                except zmq.Again:
                    await asyncio.sleep(min(self.timeout_s, 0.05))
                    continue
                deadline = time.monotonic() + self.timeout_s
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0 or not await sock.poll(int(left * 1000)):
                        break
                    rep = await sock.recv_multipart()
                    try:
                        h = P.parse_reply(rep[0])
                    except ProtocolError:
                        continue
                    if self._check(h, seq):
                        return h, rep[1:]
            raise Timeout(f"no reply to {op} from {self.endpoint} after {self.retries + 1} attempts")

    async def _do(self, spec: tuple) -> Any:
        op, fields, frames, post = spec[:4]
        try:
            h, f = await self._call(op, fields, frames)
        except BaseException:
            _undo(spec)
            raise
        return self._result(op, h, f, post)

    async def heartbeat(self) -> None:
        """Renew the session's lease now (the background thread does it on its own)."""
        await self._do(self._req_heartbeat())

    async def reconnect(self) -> bool:
        """Re-attach to the daemon. True when the old session survived (same daemon boot), False
        when a new session was opened (every request of the old one is gone)."""
        old_sid, old_epoch = self.sid, self.epoch
        if self._sock is not None:
            self._sock.close(0)
        self._open()
        if old_sid and old_epoch:
            try:
                h, _ = await self._call(P.ATTACH, {"epoch": old_epoch}, [], sid=old_sid)
                self._on_session(h)
                self._start_heartbeat()
                return True
            except SessionError:
                pass
        await self._hello()
        return False

    async def close(self, goodbye: bool = True) -> None:
        """Say goodbye (the daemon frees every request of the session), stop heartbeating."""
        if self._hb is not None:
            self._hb.stop_event.set()
            self._hb.join(timeout=2)
            self._hb = None
        if goodbye and self._sock is not None and self.sid:
            saved = self.retries
            self.retries = 0
            try:
                await self._call(P.GOODBYE, {}, [])
            except KvdError:
                pass
            finally:
                self.retries = saved
        self._release_local()
        self._sync_ctx.term()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _make_async(name: str):
    """The coroutine twin of ``Client.<name>`` (same arguments, docstring and result)."""
    req = getattr(_Core, "_req_" + name)

    @functools.wraps(getattr(Client, name))
    async def method(self, *a, **k):
        return await self._do(req(self, *a, **k))

    method.__name__ = name
    method.__qualname__ = "AsyncClient." + name
    return method


for _n in _API:
    setattr(AsyncClient, _n, _make_async(_n))
