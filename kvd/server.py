"""The kvd daemon: one ZeroMQ ROUTER socket on an asyncio (uvloop) loop around one ``BlockManager``.

Everything that touches the manager runs synchronously inside the socket's reader callback on the
loop thread (no ``await`` between receiving a message and sending its reply), so the core stays
single-threaded and every step is applied atomically. See ``kvd.protocol`` for the wire format and
``kvd.shm`` for the shared-memory layout.

Sessions: ``hello`` creates one (a shared-memory segment, a row map, a tenant decided by the peer's
credentials, kvd.tenancy). Its prefix-cache namespace is its tenant's shared one when the KV memory
is shared (the daemon owns it, ``kv_cache``, or the client says so with ``kv_shared``), each session
then being one *writer* of the manager's computed state (kvd.manager); otherwise a namespace of its
own, dropped when it ends: a block's K/V then lives only in that engine's memory.

Every message renews its lease; a session silent for ``lease_s`` (or silent for two heartbeat
intervals when ZeroMQ reports a peer disconnect) is ended: all its requests are freed and its segment
unlinked. Manager request ids are ints ``sid << 32 | session_row``, so sessions never collide and a
client can only name its own requests.

Shutdown (SIGTERM/SIGINT): stop reading, answer what was already received, end every session
(unlinking every segment), remove the ipc socket, release the lock, exit 0.

Debugging aids (environment): ``KVDSRV_PROF=1`` logs p50/p99 of the daemon-side step time (handle +
send, wall and CPU) at shutdown, and with ``KVDSRV_PROF_FILE=path.npy`` saves every step's (wall start,
wall end, CPU start, CPU end) there; ``KVDSRV_PROF=cprofile`` logs a cProfile of the socket callback
(``KVDSRV_PROF_SORT``: its pstats order, default tottime; ``KVDSRV_PROF_N``: lines, default 25).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import hashlib
import logging
import os
import secrets
import signal
import sys
import time
from typing import Any

import numpy as np
import zmq

from kvd import protocol as P
from kvd import gcheap, rowloops
from kvd.api import (
    PAD_SLOT_ID,
    STATUS_NEVER,
    STATUS_NO_SPACE,
    STATUS_OK,
    AdmitRequest,
    GroupSpec,
    ManagerConfig,
    StepBatch,
)
from kvd.errors import (
    CapacityExceeded,
    InvalidArgument,
    KvdError,
    ProtocolError,
    ServerBusy,
    SessionError,
    UnknownRequest,
    DaemonRestarted,
    Unauthorized,
)
from kvd.hashing import VLLM_NONE_HASH_SEED, VLLM_SCHEME, hash_dtype, hash_width
from kvd.memory import available_memory
from kvd.mailbox import KICK, Mailbox, drain_kicks, fence, open_kick_fifo, reply_capacity, request_capacity
from kvd.pacing import IdlePacer
from kvd.shm import SessionBuffers, segment_name, sweep_stale
from kvd.tenancy import Peer, parse_tenants, peer_of, tenant_for
from kvd_kernels import slot_mapping_from_ranges_ref

log = logging.getLogger("kvd.server")

SID_SHIFT = 32
RECV_HWM = 1024
SEND_HWM = 1024
TICK_S = 0.1
# KV events wait at most this long while messages keep coming (they go out once none waits)
EVENTS_MAX_DELAY_S = 0.005
LEASE_EXPIRED = "lease expired"
MAX_ENDED_REMEMBERED = 4096
_EMPTY_I32 = np.empty(0, np.int32)
_EMPTY_U64 = np.empty(0, np.uint64)
_NO_ADMITS = np.empty((0, P.ADMIT_COLS), np.int64)
_U64_MASK = (1 << 64) - 1
_LONE_ADMISSION_OP = True  # op_step's lean path for one admission and nothing else (tests turn it off)


_PROF = [] if os.environ.get("KVDSRV_PROF") else None
_MAX_DRAIN_S = 0.02  # the longest one socket callback runs (busy polling included) before timers run
_MAX_DEFERRED = 64  # deferred prefix-cache items a daemon lets pile up while messages keep coming


# ---- sessions -----------------------------------------------------------------------------------

_MAILBOX_OPS = {P.DECODE_MAGIC: P.parse_decode_request, P.DECODE_FREE_MAGIC: P.parse_decode_free_request,
                P.ADMIT_MAGIC: P.parse_admit_request}
"""The ops a session's mailbox carries (kvd.mailbox), by their header's magic: its header's parser."""


class Session:
    __slots__ = (
        "sid", "tenant", "namespace", "writer", "uid", "name", "pid", "nonce", "shm", "mrow", "last_seen",
        "last_seq", "last_reply", "ident", "slots_written", "base", "gpu", "slot_mapping", "mirror", "mailbox",
    )

    def __init__(self, sid: int, tenant: str, namespace: int, writer: int, uid: int | None, name: str, pid: int,
                 nonce: str, shm: SessionBuffers, max_reqs: int, num_groups: int, ident: bytes):
        self.sid = sid
        self.tenant = tenant
        self.namespace = namespace  # the manager namespace of its prefix cache
        self.writer = writer  # its writer id in a shared namespace; 0 in a private one
        self.uid = uid  # the peer's uid (None: no credentials)
        self.name = name
        self.pid = pid
        self.nonce = nonce
        self.shm = shm
        self.mrow = np.full(max_reqs, -1, np.int32)  # session row -> manager row
        self.last_seen = time.monotonic()
        self.last_seq = -1
        self.last_reply: list[bytes] | None = None
        self.ident = ident
        self.slots_written = [0] * num_groups
        self.base = sid << SID_SHIFT
        self.gpu = None  # kvd.gpu_session.GpuSession with a GPU pool
        self.slot_mapping = True  # replies write the step's slot mapping (hello ``slots``)
        self.mirror: list[tuple] | None = None  # Daemon._segment_arrays, made when first needed
        self.mailbox: Mailbox | None = None  # kvd.mailbox, when its hello asked and its peer may have one


def _peer(identity_frame: Any) -> Peer | None:
    if identity_frame is None:
        return None
    try:
        return peer_of(identity_frame.get("Peer-Address"))
    except (zmq.ZMQError, AttributeError, UnicodeDecodeError):
        return None


def _hash_counts(frame: bytes, num_appends: int, num_hashes: int) -> np.ndarray:
    """The append hash counts frame as int32, one per append, adding up to the hashes sent (one
    compiled pass, ``rowloops.widen_counts``; the error says which it is)."""
    counts = P.frame_array(frame, P.I32, num_appends, "append hash counts")
    total = rowloops.widened_counts(counts, keep=False)[1]
    if total != num_hashes:
        raise ProtocolError("negative hash count" if total < 0 else "append hash counts do not add up")
    return counts


def _opt(config: Any, name: str, default: Any) -> Any:
    return getattr(config, name, default)


SOCKET_MODE = "0660"
SEGMENT_MODE = 0o640  # session segments: the daemon writes, the group's engines read
RUNTIME_DIR_MODE = 0o750
DEFAULT_GROUP = "kvd"


def resolve_group(name: str) -> int:
    """The gid for the ``group`` config: a name or a number; "" is "kvd" when that group exists and
    the daemon may use it, else -1 (the daemon's own group). An explicit group the daemon cannot
    give its files raises InvalidArgument."""
    import grp

    explicit = bool(name)
    try:
        gid = int(name) if name.isdigit() else grp.getgrnam(name or DEFAULT_GROUP).gr_gid
    except KeyError:
        if explicit:
            raise InvalidArgument(f"config key 'group': no group named {name!r}") from None
        return -1
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        if explicit:
            raise InvalidArgument(f"config key 'group': the daemon (uid {os.geteuid()}) is not in group {name!r}")
        log.info("group %r exists but this daemon is not in it: files keep the daemon's own group", DEFAULT_GROUP)
        return -1
    return gid


class Daemon:
    def __init__(self, config: Any):
        from kvd.manager import BlockManager, warm_up as manager_warm_up

        self.config = config
        self.epoch = secrets.token_hex(P.EPOCH_BYTES // 2)
        self.epoch_b = self.epoch.encode("ascii")
        self.pid = os.getpid()
        self.groups = tuple(GroupSpec(block_size=bs, sliding_window=sw or None) for bs, sw in _group_specs(config))
        self.mcfg = ManagerConfig(
            num_gpu_blocks=int(config.num_gpu_blocks),
            groups=self.groups,
            num_cpu_blocks=int(_opt(config, "num_cpu_blocks", 0)),
            max_model_len=int(config.max_model_len),
            max_num_reqs=int(config.max_num_reqs),
            enable_prefix_caching=bool(_opt(config, "enable_prefix_caching", True)),
            watermark=float(_opt(config, "watermark", 0.0)),
            max_lookahead_tokens=int(_opt(config, "max_lookahead_tokens", 64)),
            max_encoder_len=int(_opt(config, "max_encoder_len", 0)),
            encoder_block_size=int(_opt(config, "encoder_block_size", 16)),
            # the reply goes out first; drain() flushes right after sending it
            defer_cache_registration=True,
            hash_width=hash_width(str(_opt(config, "hash_algo", "sha256"))),
        )
        need, available = BlockManager.estimate_bytes(self.mcfg), available_memory()
        if need > available:
            raise CapacityExceeded(f"the block pool needs {need} bytes of memory, {available} are available "
                                   "(MemAvailable, or the cgroup's limit): lower num_gpu_blocks, max_num_reqs or "
                                   "max_model_len")
        self.manager = BlockManager(self.mcfg)
        manager_warm_up()  # compile now, not on the first step served
        if not rowloops.HAVE_NUMBA:
            log.warning("numba is not installed: the per-request loops run as plain Python (decode "
                        "steps ~10x slower, see the README); pip install 'kvd[fast]'")
        self.gpu_pool = None
        device = str(_opt(config, "device", "cpu"))
        m = self.manager
        self.G = len(self.groups)
        self.block_sizes = [int(b) for b in m.block_sizes]
        self.max_blocks = [int(t.shape[1]) for t in m.tables]
        self.windowed = [bool(gs.sliding_window) for gs in self.groups]
        self.max_reqs = int(config.max_reqs_per_session)
        self.max_tokens = int(config.max_num_batched_tokens)
        self.max_model_len = int(config.max_model_len)
        self.max_sessions = int(_opt(config, "max_sessions", 64))
        self.lease_s = float(_opt(config, "lease_s", 1.5))
        self.hb_s = self.lease_s / 4
        self.max_message_bytes = int(_opt(config, "max_message_bytes", 64 << 20))
        self.mailbox_on = bool(_opt(config, "mailbox", True))
        self.mailboxes: list[Session] = []  # the sessions with a mailbox, which the serve loop polls
        self.mailbox_polling = False  # whether the serve loop polls them now (their ``polling`` word)
        self.kick_path: str | None = None  # the serve loop's kick FIFO (kvd.mailbox), named in mailbox grants
        self.hash_algo = str(_opt(config, "hash_algo", "sha256"))
        self.hash_seed = str(_opt(config, "hash_seed", VLLM_NONE_HASH_SEED))
        self.hash_width = self.mcfg.hash_width
        self.hash_dtype = hash_dtype(self.hash_width)
        if device.startswith("cuda"):
            # session buffers on the GPU too (kvd.gpu_session); fatal when unavailable: a daemon
            # asked for a GPU pool must not silently serve without one
            from kvd.gpu_session import GpuPool

            self.gpu_pool = GpuPool(device, self.block_sizes, self.max_blocks, self.max_reqs,
                                    self.max_tokens)
        self.tenant_rules = parse_tenants(str(_opt(config, "tenants", "") or ""))
        self.gid = resolve_group(str(_opt(config, "group", "") or ""))
        self.kv = None
        kv_spec = str(_opt(config, "kv_cache", "") or "")
        if kv_spec:  # the daemon owns the KV cache itself (kvd.memory)
            from kvd.memory import KvMemory, parse_kv_cache

            self.kv = KvMemory(parse_kv_cache(kv_spec), self.mcfg.num_gpu_blocks, self.mcfg.num_cpu_blocks,
                               self.block_sizes[0], device, segment_name(self.pid, self.epoch, "kv"), self.gid)
        n = int(config.max_num_reqs)
        self.owner_sid = np.zeros(n, np.int64)  # manager row -> session id (0: none)
        self.owner_srow = np.full(n, -1, np.int32)  # manager row -> session row
        # Steps publish rows and slots through compiled loops (kvd.rowloops), a loop per group; the
        # numpy path does it without numba, and publishes rows that copy-on-write rewrote.
        self._compiled_publish = rowloops.HAVE_NUMBA
        self._srows_buf = np.empty(self.max_reqs, np.int32)
        # the largest value of each admission column (kvd.protocol ADMIT_COLS): row, tokens, lookahead,
        # priority, encoder tokens, max new tokens
        self._admit_max_list = [self.max_reqs - 1, P.MAX_COUNT, P.MAX_COUNT, 100, P.MAX_COUNT, P.MAX_COUNT]
        self.sessions: dict[int, Session] = {}
        self.by_nonce: dict[str, int] = {}
        self.namespaces: dict[str, int] = {}  # tenant -> its shared namespace
        self.topic_of: dict[int, str] = {}  # namespace -> topic of its KV events
        self.next_namespace = 1  # 0 is the in-process manager's default; no session uses it
        self._retired: dict[int, tuple[str, int, int]] = {}  # keys of a namespace being dropped
        self.events = None  # kvd.eventworker.EventForwarder, when kv_events_endpoint is set
        self.events_at = 0.0  # perf_counter of the last publish
        self.next_sid = 1
        # sid -> (name, why) of recently ended sessions, so a late message learns why (bounded)
        self.ended: dict[int, tuple[str, str]] = {}
        self.stopping = False
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.metrics = None
        self._disconnect_at = 0.0
        self.n_steps = 0
        self.was_step = False
        self.was_heartbeat = False  # the last message only renewed a lease (the serve loop reads it)
        self.warmer = None  # kvd.warm.Warmer, when the daemon keeps its admission path warm
        self.ops = {
            P.HELLO: self.op_hello, P.ATTACH: self.op_attach, P.STEP: self.op_step,
            P.LOOKUP: self.op_lookup, P.CAN_ALLOCATE: self.op_can_allocate,
            P.ALLOCATE: self.op_allocate, P.APPEND: self.op_append, P.FREE: self.op_free,
            P.FORK: self.op_fork, P.CAN_SWAP_OUT: self.op_swap, P.SWAP_OUT: self.op_swap,
            P.CAN_SWAP_IN: self.op_swap, P.SWAP_IN: self.op_swap,
            P.RESET_PREFIX_CACHE: self.op_reset, P.STATS: self.op_stats,
            P.HEARTBEAT: self.op_heartbeat, P.GOODBYE: self.op_goodbye, P.COMPUTED: self.op_computed,
            P.COMMON_PREFIX: self.op_common_prefix, P.CROSS_TABLE: self.op_cross_table,
            P.STATUS: self.op_status,
        }

    # ---- message dispatch -------------------------------------------------------------------------
    def handle(self, msg: list[bytes], identity_frame: Any = None) -> list[bytes] | None:
        """One message (identity first) -> reply frames (without identity), or None to drop.
        ``identity_frame``: the zmq.Frame of the identity, whose properties name an ipc peer."""
        ident = msg[0]
        frames = msg[1:]
        seq = None
        try:
            if not frames:
                raise ProtocolError("empty message")
            if len(frames) > P.MAX_FRAMES:
                raise ProtocolError(f"{len(frames)} frames > {P.MAX_FRAMES}")
            total = sum(map(len, frames))
            if total > self.max_message_bytes:
                raise ProtocolError(f"message of {total} bytes > {self.max_message_bytes}")
            head = frames[0]
            if head == KICK and len(frames) == 1:
                return None  # a client's mailbox waits (kvd.mailbox): the serve loop polls them
            if head[:4] == P.DECODE_MAGIC:  # the binary decode step
                sid, seq, c, na, an, la = P.parse_decode_request(head)
                h, fn = (c, na, an, la), self.op_decode
            elif head[:4] == P.DECODE_FREE_MAGIC:  # the binary decode step with frees and admissions
                sid, seq, c, na, an, la, nf, nd = P.parse_decode_free_request(head)
                h, fn = (c, na, an, la, nf, nd), self.op_decode_free
            elif head[:4] == P.ADMIT_MAGIC:  # the binary lone admission
                sid, seq, c, la, cols = P.parse_admit_request(head)
                h, fn = (c, la, cols), self.op_admit
            else:
                h = P.parse_header(head)
                seq = P.get_int(h, "q", None)
                op = h.get("op")
                fn = self.ops.get(op) if isinstance(op, str) else None
                if fn is None:
                    raise ProtocolError(f"unknown op {op!r}")
                if op == P.HELLO:
                    return self.op_hello(h, frames[1:], ident, seq, _peer(identity_frame))
                sid = P.get_int(h, "s", None, 1, (1 << 62) - 1)
                if op == P.ATTACH:
                    return self.op_attach(self.sessions.get(sid), h, frames[1:], ident, seq, _peer(identity_frame))
                if op == P.HEARTBEAT:
                    fn = None
                    self.was_heartbeat = True
            sess = self.sessions.get(sid)
            if sess is None:
                raise SessionError(self._why_no_session(sid))
            sess.last_seen = time.monotonic()
            if fn is None:
                return [P.ok_reply(seq, self.epoch)]
            if seq == sess.last_seq and sess.last_reply is not None:
                return sess.last_reply  # a retry: the reply again, applied once
            if seq < sess.last_seq:
                raise ProtocolError(f"sequence number {seq} < last {sess.last_seq}")
            sess.ident = ident
            try:
                reply = fn(sess, h, frames[1:], ident, seq)
            finally:
                self._do_copies()
                gs = sess.gpu
                if gs is not None and gs.pending and sess.sid in self.sessions:
                    gs.flush(sess.shm.tables, sess.shm.counts)
            if sess.sid in self.sessions:
                sess.last_seq = seq
                sess.last_reply = reply
            return reply
        except KvdError as e:
            if e.__cause__ is not None and not isinstance(e.__cause__, KvdError):
                # a Python or numpy error the manager reported as misuse (errors.ARGUMENT_ERRORS):
                # the daemon's frames reach it typed, so this may be a bug; keep its traceback
                log.warning("refused a message with %s", e, exc_info=e.__cause__)
            if isinstance(e, ProtocolError) and self.metrics is not None:
                self.metrics.inc_malformed()
            if self.metrics is not None:
                try:
                    self.metrics.inc_error(e.code)
                except Exception:
                    pass
            return [P.error_reply(seq, self.epoch, e.code, str(e))]
        except Exception as e:  # a bug must not kill the loop
            log.exception("internal error handling a message")
            return [P.error_reply(seq, self.epoch, KvdError.code, f"internal error: {type(e).__name__}: {e}")]

    # ---- helpers ------------------------------------------------------------------------------------
    def _why_no_session(self, sid: int) -> str:
        ended = self.ended.get(sid)
        if ended is None:
            return f"unknown session {sid} (never opened on this daemon, epoch {self.epoch})"
        name, why = ended
        if why == LEASE_EXPIRED:
            return (f"session {sid} ({name!r}) ended: its lease expired (no message for lease_s="
                    f"{self.lease_s:g} s, daemon option --lease-s / config lease_s); its requests "
                    f"were freed; call reconnect()")
        return f"session {sid} ({name!r}) ended ({why}); call reconnect()"

    def describe_cache_key(self, key: int) -> tuple[str, int, int]:
        """(topic, block size, KV-cache group) of a prefix-cache key, for its KV events: the topic
        is its tenant's, or "tenant#N" for a session's namespace of its own."""
        retired = self._retired.get(key)
        if retired is not None:
            return retired
        ns, group = self.manager.cache_key_owner(key)
        return self.topic_of[ns], self.block_sizes[group], group

    def publish_events(self) -> None:
        """Send what the pool's event log holds (kvd.events), if events are on."""
        if self.events is not None and self.manager.pool.event_log:
            self.events_at = time.perf_counter()
            self.events.publish(self.manager.pool.event_log)

    def _do_copies(self) -> None:
        """The copy-on-write copies the op decided, done now when the daemon owns the KV cache
        (before the reply that reports them); otherwise the engines do them."""
        copies = self.manager.take_copies()
        if self.kv is not None and len(copies):
            self.kv.copy(copies)

    def _rows(self, buf: bytes, name: str, n: int | None = None) -> np.ndarray:
        if not buf and not n:  # most of a step's row frames are empty
            return _EMPTY_I32
        rows = P.frame_array(buf, P.I32, n, name, self.max_reqs)
        if not P.within(rows, 0, self.max_reqs - 1):
            raise InvalidArgument(f"{name}: row out of range [0, {self.max_reqs})")
        return rows

    def _mapped_rows(self, sess: Session, buf: bytes, name: str, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(the session rows, a view of the frame; their manager rows) of a frame of ``n`` session
        rows (a step's appends, the decode op's): one gather that checks the range too (a negative
        row is huge as uint32); unmapped rows come back -1."""
        if not n:
            P.frame_array(buf, P.I32, 0, name)
            return _EMPTY_I32, _EMPTY_I32
        rows = P.frame_array(buf, P.I32, n, name)
        out = rowloops.map_rows(sess.mrow, rows)
        if out is None:
            raise InvalidArgument(f"{name}: row out of range [0, {self.max_reqs})")
        return rows, out

    def _row(self, h: dict, key: str) -> int:
        return P.get_int(h, key, None, 0, self.max_reqs - 1)

    def _group_hashes(self, frames: list[bytes], start: int) -> list[np.ndarray]:
        max_n = self.max_model_len // min(self.block_sizes) + 1
        return [P.frame_hashes(frames[start + g], f"hashes[{g}]", max_n, self.hash_dtype) for g in range(self.G)]

    def _hash_arg(self, hs: list[np.ndarray]) -> Any:
        return hs[0] if self.G == 1 else hs

    @staticmethod
    def _token_frame(buf: bytes, name: str, max_n: int) -> np.ndarray:
        """A frame of token ids (kvd.protocol: only for KV events); the manager checks the values."""
        return P.frame_array(buf, P.I32, None, name, max_n)

    def _map(self, sess: Session, srow: int, mrow: int, tag: int) -> None:
        sess.mrow[srow] = mrow
        self.owner_sid[mrow] = sess.sid
        self.owner_srow[mrow] = srow
        sess.shm.row_tags[srow] = tag

    def _unmap_mrows(self, sess: Session, mrows: np.ndarray) -> None:
        if mrows.size == 0:
            return
        if mrows.size == 1:  # a step that frees one request: int indexes write ~10x faster than arrays
            mine = int(mrows[0])
            if int(self.owner_sid[mine]) != sess.sid:
                return
            srows = int(self.owner_srow[mine])
        else:
            mine = mrows[self.owner_sid[mrows] == sess.sid]
            srows = self.owner_srow[mine]
        sess.mrow[srows] = -1
        self.owner_sid[mine] = 0
        self.owner_srow[mine] = -1
        shm = sess.shm
        shm.row_tags[srows] = 0
        for g in range(self.G):
            shm.counts[g][srows] = 0
        if sess.gpu is not None:
            sess.gpu.tracker.mark_counts(np.asarray(srows, np.int32).reshape(-1))

    def _sync_rows(self, sess: Session, mrows: np.ndarray, full: bool = True) -> np.ndarray:
        """Copy the manager's rows (tables + counts) of this session into its shared memory.

        ``full=False`` (a step without copy-on-write): tables are append-only, so for groups without
        a sliding window only the entries from the old count to the new one are copied, and rows whose
        count did not change are skipped."""
        if mrows.size == 0:
            return _EMPTY_I32
        if not full and self._compiled_publish:
            return self._sync_appended(sess, mrows)
        own = self.owner_sid[mrows] == sess.sid
        if not own.all():
            mrows = mrows[own]
        srows = self.owner_srow[mrows]
        m = self.manager
        shm = sess.shm
        tr = sess.gpu.tracker if sess.gpu is not None else None
        for g in range(self.G):
            cnt = m.num_blocks[g][mrows]
            if full or self.windowed[g]:
                w = int(cnt.max()) if cnt.size else 0
                if w:
                    shm.tables[g][srows, :w] = m.tables[g][mrows, :w]
                    if tr is not None:
                        tr.mark(g, srows, 0, w)
            else:
                old = shm.counts[g][srows]
                grew = cnt > old
                if grew.any():
                    gm, gs, o, n = mrows[grew], srows[grew], old[grew], cnt[grew]
                    k = n - o
                    if tr is not None:
                        tr.mark(g, gs, o, n)
                    if int(k.max()) == 1:
                        shm.tables[g][gs, o] = m.tables[g][gm, o]
                    else:
                        tot = int(k.sum())
                        first = np.repeat(np.cumsum(k) - k, k)
                        col = np.repeat(o, k) + (np.arange(tot) - first)
                        shm.tables[g][np.repeat(gs, k), col] = m.tables[g][np.repeat(gm, k), col]
                shrank = cnt < old
                if shrank.any():  # not expected without CoW/windows; copy those rows whole
                    w = int(cnt[shrank].max())
                    shm.tables[g][srows[shrank], :w] = m.tables[g][mrows[shrank], :w]
                    if tr is not None:
                        tr.mark(g, srows[shrank], 0, w)
            shm.counts[g][srows] = cnt
        if tr is not None:
            tr.mark_counts(srows)
        return srows

    def _sync_appended(self, sess: Session, mrows: np.ndarray) -> np.ndarray:
        """``_sync_rows(full=False)``, one compiled call per group (``rowloops.sync_appended_rows``;
        a window's group from the first entry that changed)."""
        m = self.manager
        k = 0
        for g, (table, counts, start, end) in enumerate(self._segment_arrays(sess)):
            k = rowloops.sync_appended_rows(mrows, self.owner_sid, self.owner_srow, sess.sid, m.tables[g],
                                            m.num_blocks[g], m.last_blocks[g], table, counts, start, end,
                                            self._srows_buf, self.windowed[g])
        return self._counts_changed(sess, self._srows_buf[:k].copy())

    @staticmethod
    def _counts_changed(sess: Session, srows: np.ndarray) -> np.ndarray:
        """``srows``, whose tables and counts a compiled loop wrote (and whose changed entries it
        marked in a GPU session's tracker): the tracker learns of them too."""
        if sess.gpu is not None:
            sess.gpu.tracker.dirty = True
            sess.gpu.tracker.mark_counts(srows)
        return srows

    @staticmethod
    def _segment_arrays(sess: Session) -> list[tuple]:
        """Per group, its table and counts in the session's segment and its GPU tracker's ranges
        of changed entries (empty: no GPU session): the session's for its life, looked up once."""
        arrays = sess.mirror
        if arrays is None:
            tr = sess.gpu.tracker if sess.gpu is not None else None
            arrays = sess.mirror = [(table, counts, tr.st[g] if tr is not None else _EMPTY_I32,
                                     tr.en[g] if tr is not None else _EMPTY_I32)
                                    for g, (table, counts) in enumerate(zip(sess.shm.tables, sess.shm.counts))]
        return arrays

    def _mirror(self, sess: Session, srows: np.ndarray) -> tuple | None:
        """The session's segment as the mirror of a decode step's session rows ``srows``
        (``rowloops.mirror_appends``' first five arguments): the manager writes the entries it
        appends there too (the rows are the session's own, ``_mapped_rows`` checked them)."""
        if self.G != 1 or self.windowed[0]:
            return None  # (several groups or a window: the daemon publishes what decode_rows changed)
        table, counts, start, end = self._segment_arrays(sess)[0]
        return table, counts, srows, start, end

    def _mirrored(self, sess: Session, grown: np.ndarray) -> np.ndarray:
        """The session rows whose tables a mirrored decode step changed (``_mirror``: the manager
        wrote them, copy-on-write included)."""
        return self._counts_changed(sess, self.owner_srow[grown]) if grown.size else _EMPTY_I32

    def _sync_row(self, sess: Session, srow: int) -> None:
        mrow = int(sess.mrow[srow])
        m = self.manager
        shm = sess.shm
        for g in range(self.G):
            c = int(m.num_blocks[g][mrow])
            shm.counts[g][srow] = c
            shm.tables[g][srow, :c] = m.tables[g][mrow, :c]
        if sess.gpu is not None:
            r = np.array([srow], np.int32)
            for g in range(self.G):
                sess.gpu.tracker.mark(g, r, 0, int(shm.counts[g][srow]))
            sess.gpu.tracker.mark_counts(r)

    def _write_slots(self, sess: Session, rows: np.ndarray, start: np.ndarray, lens: np.ndarray,
                     uniform: int = 0) -> list[int]:
        """The step's slot mapping into the session's buffer, padded with PAD_SLOT_ID
        (``rowloops.range_slots``, else the kernels' numpy reference). A step that schedules more tokens than the buffer holds gets
        its first ``max_num_batched_tokens`` slots; the reply says how many were written (none for
        a session that computes its own, hello ``slots`` false)."""
        if not sess.slot_mapping:
            return [0] * self.G
        m = self.manager
        shm = sess.shm
        if sess.gpu is not None:
            sess.gpu.stage_slots(self.owner_srow[rows], start, lens)
        total = rows.shape[0] if uniform == 1 else int(lens.sum())
        if self._compiled_publish and total <= self.max_tokens:
            for g in range(self.G):
                rowloops.range_slots(m.tables[g], m.num_blocks[g], m.last_blocks[g], self.block_sizes[g], rows, start,
                                     lens, PAD_SLOT_ID, max(total, sess.slots_written[g]), shm.slot_array[g])
        elif total <= self.max_tokens:
            slot_mapping_from_ranges_ref(m.tables, self.block_sizes, rows, start, 1 if uniform == 1 else lens,
                                         shm.slot_array, prev_tokens=max(sess.slots_written))
        else:
            spill = np.empty((self.G, total), np.int64)
            slot_mapping_from_ranges_ref(m.tables, self.block_sizes, rows, start, lens, spill)
            shm.slot_array[:] = spill[:, : self.max_tokens]
            total = self.max_tokens
        sess.slots_written = [total] * self.G
        return sess.slots_written

    def _write_one_range(self, sess: Session, mrow: int, start: int, n: int) -> list[int]:
        """The slot mapping of one request's ``n`` tokens from ``start`` (allocate, append_slots)."""
        return self._write_slots(sess, np.array([mrow], np.int32), np.array([start], np.int32),
                                 np.array([n], np.int32))

    def _count_no_space(self, sess: Session, n: int) -> None:
        if n and self.metrics is not None:
            self.metrics.inc_no_space(sess.tenant, n)

    # ---- ops --------------------------------------------------------------------------------------
    def op_hello(self, h, frames, ident, seq, peer: Peer | None):
        claimed = P.get_str(h, "tenant", "")
        name = P.get_str(h, "name", "")
        nonce = P.get_str(h, "nonce", "", 64)
        pid = P.get_int(h, "pid", 0)
        kv_shared = h.get("kv_shared", False)
        slots = h.get("slots", True)
        gpu = h.get("gpu", True)
        mailbox = h.get("mailbox", False)
        if frames:
            raise ProtocolError("hello carries no frames")
        if type(mailbox) is not bool:
            raise ProtocolError("hello: mailbox must be a boolean")
        if type(kv_shared) is not bool:
            raise ProtocolError("hello: kv_shared must be a boolean")
        if type(slots) is not bool:
            raise ProtocolError("hello: slots must be a boolean")
        if type(gpu) is not bool:
            raise ProtocolError("hello: gpu must be a boolean")
        tenant = tenant_for(claimed, peer, self.tenant_rules)
        uid = peer.uid if peer is not None else None
        if nonce and nonce in self.by_nonce and self.by_nonce[nonce] in self.sessions:
            sess = self.sessions[self.by_nonce[nonce]]  # a retried hello
            if sess.uid != uid or sess.tenant != tenant:
                raise Unauthorized("hello: that nonce belongs to another peer's session")
        else:
            if len(self.sessions) >= self.max_sessions:
                raise ServerBusy(f"{len(self.sessions)} sessions: max_sessions reached")
            sess = self._new_session(tenant, kv_shared or self.kv is not None, uid, name, pid, nonce, ident, gpu)
            sess.slot_mapping = slots
            if mailbox and self.mailbox_on and uid == os.getuid():
                self._open_mailbox(sess)
        sess.last_seq = seq
        sess.last_reply = None
        return [self._session_reply(sess, seq)]

    def _new_session(self, tenant: str, shared: bool, uid, name: str, pid: int, nonce: str, ident: bytes,
                     gpu: bool = True) -> Session:
        """A new session; ``gpu`` false: no device buffers even with a GPU pool (hello ``gpu``)."""
        # session ids are unguessable: they are the only credential of a session on the socket
        sid = secrets.randbits(62) | 1
        while sid in self.sessions:
            sid = secrets.randbits(62) | 1
        index = self.next_sid
        self.next_sid += 1
        if shared:  # one prefix cache per tenant, this session one of its writers
            ns = self.namespaces.get(tenant)
            if ns is None:
                ns = self.namespaces[tenant] = self._new_namespace(tenant)
            writer = index
        else:  # the K/V live in this engine's memory only: a prefix cache of its own
            ns, writer = self._new_namespace(f"{tenant}#{index}"), 0
        shm = SessionBuffers.create(
            segment_name(self.pid, self.epoch, index), max_reqs=self.max_reqs,
            max_blocks=self.max_blocks, max_tokens=self.max_tokens,
            block_sizes=self.block_sizes, epoch=self.epoch, mode=SEGMENT_MODE, gid=self.gid,
        )
        sess = Session(sid, tenant, ns, writer, uid, name, pid, nonce, shm, self.max_reqs, self.G, ident)
        if self.gpu_pool is not None and gpu:
            try:
                sess.gpu = self.gpu_pool.new_session()
            except Exception as e:
                shm.unlink()
                shm.close()
                log.error("session %d: GPU buffers failed: %s", index, e)
                raise CapacityExceeded(f"cannot allocate the session's GPU buffers: {e}") from None
        self.sessions[sid] = sess
        if nonce:
            self.by_nonce[nonce] = sid
        log.info("session %d hello: name=%r pid=%d uid=%s tenant=%r namespace=%d%s", index, name, pid, uid,
                 tenant, ns, f" (writer {writer})" if writer else " (private)")
        return sess

    def _open_mailbox(self, sess: Session) -> None:
        """Give the session a mailbox (kvd.mailbox: only for a peer of the daemon's own uid)."""
        index = sess.shm.name.rsplit("_", 1)[1]
        try:
            sess.mailbox = Mailbox.create(segment_name(self.pid, self.epoch, f"mb{index}"),
                                          request_capacity(self.max_reqs, self.G, self.hash_width),
                                          reply_capacity(self.max_reqs, self.G))
        except OSError as e:  # an optimisation: the session keeps the socket
            log.warning("session %s: no mailbox (%s)", index, e)
            return
        sess.mailbox.set_polling(self.mailbox_polling)
        self.mailboxes.append(sess)

    def _close_mailbox(self, sess: Session) -> None:
        mb, sess.mailbox = sess.mailbox, None
        if mb is not None:
            self.mailboxes.remove(sess)
            mb.unlink()
            mb.close()

    def serve_mailbox(self, sess: Session) -> list[bytes] | None:
        """Handle the request waiting in a session's mailbox and answer it there; returns the reply
        when it must go on the socket instead (too large for the mailbox), else None."""
        mb = sess.mailbox
        try:
            seq, frames = mb.take_request()
            head = frames[0]
            parse = _MAILBOX_OPS.get(head[:4])
            if parse is None:
                raise ProtocolError("a mailbox carries the binary step ops only (decode, decode_free, admit)")
            sid, seq = parse(head)[:2]
            if sid != sess.sid:
                raise ProtocolError("a mailbox carries its own session's messages only")
        except ProtocolError as e:
            if self.metrics is not None:
                self.metrics.inc_malformed()
            seq, reply = mb.seen, [P.error_reply(mb.seen, self.epoch, e.code, str(e))]
        else:
            reply = self.handle([sess.ident, *frames])
        if reply is None or sess.mailbox is not mb or mb.answer(seq, reply):
            return None  # answered (or the session ended: nobody waits)
        return reply

    def _new_namespace(self, topic: str) -> int:
        ns = self.next_namespace
        self.next_namespace += 1
        self.topic_of[ns] = topic
        return ns

    def _session_reply(self, sess: Session, seq: int) -> bytes:
        return P.ok_reply(
            seq, self.epoch, sid=sess.sid, shm=sess.shm.name, block_sizes=self.block_sizes,
            max_reqs=self.max_reqs, max_blocks=self.max_blocks, max_tokens=self.max_tokens,
            lease_s=self.lease_s, hb_s=self.hb_s, hash_algo=self.hash_algo,
            hash_width=self.hash_width, **({"hash_seed": self.hash_seed} if self.hash_algo == VLLM_SCHEME else {}),
            num_groups=self.G, windows=list(self.manager.sliding_windows), max_model_len=self.max_model_len,
            tenant=sess.tenant,
            shared=bool(sess.writer), topic=self.topic_of[sess.namespace], t=self.manager.tick,
            kv_events=self.events is not None, slots=sess.slot_mapping,
            **({"gpu": sess.gpu.handle} if sess.gpu is not None and sess.gpu.handle else {}),
            **({"kv": self.kv.info} if self.kv is not None else {}),
            **({"mb": sess.mailbox.name, "mb_req": sess.mailbox.req_cap, "mb_rep": sess.mailbox.rep_cap,
                **({"mb_kick": self.kick_path} if self.kick_path else {})}
               if sess.mailbox is not None else {}),
        )

    def op_attach(self, sess, h, frames, ident, seq, peer: Peer | None):
        epoch = P.get_str(h, "epoch", "")
        if epoch != self.epoch:
            raise DaemonRestarted(f"daemon epoch is {self.epoch}, session was made by {epoch}")
        if sess is None:
            raise SessionError(f"unknown or expired session {h.get('s')}")
        if sess.uid != (peer.uid if peer is not None else None):
            raise Unauthorized("attach: the session belongs to another uid")
        sess.last_seen = time.monotonic()
        sess.ident = ident
        return [self._session_reply(sess, seq)]

    def op_computed(self, sess, h, frames, ident, seq):
        self._confirm(sess, h)
        return [P.ok_reply(seq, self.epoch)]

    def _confirm(self, sess: Session, h: dict) -> None:
        """The session's confirmation ``c`` (see kvd.manager): a no-op in a private namespace."""
        c = self._confirmation(sess, h)
        if c is not None:
            self.manager.mark_computed(sess.writer, c)

    @staticmethod
    def _confirmation(sess: Session, h: dict) -> int | None:
        """A step's confirmation ``c`` for its ``StepBatch.computed_through`` (None in a private
        namespace): the manager counts it only once it has found the step well formed."""
        c = h.get("c")
        return P.get_int(h, "c", None, 0, (1 << 62)) if c is not None and sess.writer else None

    @staticmethod
    def _binary_confirmation(sess: Session, c: int) -> int | None:
        """``_confirmation`` of a binary header's ``c`` (NO_CONFIRM: none; its range is parsed)."""
        return c if c != P.NO_CONFIRM and sess.writer else None

    def op_heartbeat(self, sess, h, frames, ident, seq):
        return [P.ok_reply(seq, self.epoch)]

    def op_goodbye(self, sess, h, frames, ident, seq):
        self.end_session(sess, "goodbye")
        return [P.ok_reply(seq, self.epoch)]

    def op_stats(self, sess, h, frames, ident, seq):
        st = dict(self.manager.stats())
        st["sessions"] = len(self.sessions)
        st["session_requests"] = int((sess.mrow >= 0).sum())
        if self.gpu_pool is not None:
            st["gpu_flush"] = self.gpu_pool.stats()
        if self.kv is not None:
            st["kv_cache"] = {"kind": self.kv.info["kind"], "shape": self.kv.shape, "dtype": self.kv.dtype,
                              "bytes": self.kv.nbytes}
        return [P.ok_reply(seq, self.epoch, stats=st)]

    def _live_mrow(self, sess: Session, h: dict) -> int:
        srow = self._row(h, "row")
        mrow = int(sess.mrow[srow])
        if mrow < 0:
            raise UnknownRequest(f"row {srow} holds no request of this session")
        return mrow

    def op_common_prefix(self, sess, h, frames, ident, seq):
        mrow = self._live_mrow(sess, h)
        nr = P.get_int(h, "nr", None, 0, self.mcfg.max_num_reqs)
        n = self.manager.num_common_prefix_blocks(self.manager.req_id_of_row(mrow), nr)
        return [P.ok_reply(seq, self.epoch, n=int(n))]

    def op_cross_table(self, sess, h, frames, ident, seq):
        mrow = self._live_mrow(sess, h)
        ids = self.manager.cross_block_table(self.manager.req_id_of_row(mrow))
        return [P.ok_reply(seq, self.epoch), P.arr(ids, P.I32)]

    def tenant_usage(self) -> dict[str, dict[str, int]]:
        """Per tenant: sessions, live requests and block references held (all groups; a block
        shared by two requests counts twice)."""
        out: dict[str, dict[str, int]] = {}
        m = self.manager
        for s in list(self.sessions.values()):  # also read by the metrics thread: one snapshot
            t = out.setdefault(s.tenant, {"sessions": 0, "requests": 0, "block_refs": 0})
            live = s.mrow[s.mrow >= 0]
            t["sessions"] += 1
            t["requests"] += int(live.size)
            t["block_refs"] += sum(int(m.num_blocks[g][live].sum()) for g in range(self.G))
        return out

    def op_status(self, sess, h, frames, ident, seq):
        now = time.monotonic()
        # the daemon's own uid and root see every tenant; anyone else only its own
        admin = sess.uid is not None and sess.uid in (0, os.geteuid())
        sessions = [
            {"name": s.name, "pid": s.pid, "tenant": s.tenant, "requests": int((s.mrow >= 0).sum()),
             "idle_s": round(now - s.last_seen, 3)}
            for s in self.sessions.values() if admin or s.tenant == sess.tenant
        ]
        tenants = [{"tenant": t, **u} for t, u in sorted(self.tenant_usage().items()) if admin or t == sess.tenant]
        st = {"daemon": {"pid": self.pid, "epoch": self.epoch, "lease_s": self.lease_s, "steps": self.n_steps,
                         "gc": gcheap.status(), "warm_passes": self.warmer.passes if self.warmer is not None else 0},
              "pool": dict(self.manager.stats()), "sessions": sessions, "tenants": tenants}
        return [P.ok_reply(seq, self.epoch, status=st)]

    def op_reset(self, sess, h, frames, ident, seq):
        done = bool(self.manager.reset_prefix_cache(namespace=sess.namespace))
        return [P.ok_reply(seq, self.epoch, done=done)]

    def op_lookup(self, sess, h, frames, ident, seq):
        if len(frames) != 1:
            raise ProtocolError("lookup: expected 1 frame")
        hs = P.frame_hashes(frames[0], "hashes", self.max_model_len, dtype=self.hash_dtype)
        n = self.manager.lookup(hs, namespace=sess.namespace, writer=sess.writer)
        return [P.ok_reply(seq, self.epoch, n=int(n))]

    def op_can_allocate(self, sess, h, frames, ident, seq):
        if len(frames) != self.G:
            raise ProtocolError(f"can_alloc: expected {self.G} frames")
        hs = self._group_hashes(frames, 0)
        st = self.manager.can_allocate(
            P.get_int(h, "nt", None, 0, P.MAX_COUNT), self._hash_arg(hs),
            P.get_int(h, "la", 0, 0, P.MAX_COUNT), namespace=sess.namespace, writer=sess.writer,
            max_new_tokens=P.get_int(h, "mnt", 0, 0, P.MAX_COUNT),
            num_encoder_tokens=P.get_int(h, "net", 0, 0, P.MAX_COUNT),
        )
        return [P.ok_reply(seq, self.epoch, status=int(st))]

    def op_allocate(self, sess, h, frames, ident, seq):
        if len(frames) not in (self.G, self.G + 1):
            raise ProtocolError(f"allocate: expected {self.G} frames (+ token ids)")
        srow = self._row(h, "row")
        tag = P.get_int(h, "tag", 0, 0, (1 << 64) - 1)
        hs = self._group_hashes(frames, 0)
        tokens = self._token_frame(frames[self.G], "token ids", self.max_model_len) if len(frames) > self.G else None
        res = self.manager.allocate(
            sess.base | srow, P.get_int(h, "nt", None, 0, P.MAX_COUNT), self._hash_arg(hs),
            P.get_int(h, "la", 0, 0, P.MAX_COUNT), namespace=sess.namespace, writer=sess.writer,
            priority=P.get_int(h, "pri", 50, 0, 100),
            num_encoder_tokens=P.get_int(h, "net", 0, 0, P.MAX_COUNT),
            max_new_tokens=P.get_int(h, "mnt", 0, 0, P.MAX_COUNT), token_ids=tokens,
        )
        t = self.manager.tick
        if res.status != STATUS_OK:
            self._count_no_space(sess, 1)
            return [P.ok_reply(seq, self.epoch, status=int(res.status), cached=0, t=t)]
        self._map(sess, srow, int(res.row), tag)
        self._sync_row(sess, srow)
        cached = int(res.num_cached_tokens)
        nt = self._write_one_range(sess, int(res.row), cached, int(self.manager.num_tokens[res.row]) - cached)
        return [P.ok_reply(seq, self.epoch, status=STATUS_OK, cached=cached, nt=nt, t=t)]

    def op_append(self, sess, h, frames, ident, seq):
        if len(frames) not in (self.G, 2 * self.G):
            raise ProtocolError(f"append: expected {self.G} frames (+ {self.G} of token ids)")
        srow = self._row(h, "row")
        if sess.mrow[srow] < 0:
            raise UnknownRequest(f"row {srow} holds no request of this session")
        hs = self._group_hashes(frames, 0)
        tokens = None
        if len(frames) > self.G:
            tokens = [self._token_frame(frames[self.G + g], "token ids", self.max_model_len) for g in range(self.G)]
        res = self.manager.append_slots(
            sess.base | srow, P.get_int(h, "n", None, 0, P.MAX_COUNT), self._hash_arg(hs),
            P.get_int(h, "la", 0, 0, P.MAX_COUNT), new_block_token_ids=tokens,
        )
        t = self.manager.tick
        if res.status != STATUS_OK:
            self._count_no_space(sess, 1)
            return [P.ok_reply(seq, self.epoch, status=int(res.status), t=t)]
        self._sync_row(sess, srow)
        mrow = int(sess.mrow[srow])
        n = P.get_int(h, "n", None, 0, P.MAX_COUNT)
        nt = self._write_one_range(sess, mrow, int(self.manager.num_tokens[mrow]) - n, n)
        out = [P.ok_reply(seq, self.epoch, status=STATUS_OK, nt=nt, t=t)]
        for g in range(self.G):
            ids = res.group_new_block_ids[g] if g < len(res.group_new_block_ids) else ()
            out.append(P.arr(ids, P.I32))
        out.append(P.arr(res.copies, P.I32))
        return out

    def op_free(self, sess, h, frames, ident, seq):
        if len(frames) != 1:
            raise ProtocolError("free: expected 1 frame")
        srows = self._rows(frames[0], "rows")
        if srows.size == 0:
            return [P.ok_reply(seq, self.epoch)]
        if (sess.mrow[srows] < 0).any() or np.unique(srows).size != srows.size:
            raise UnknownRequest("free of a row that holds no request of this session")
        mrows = sess.mrow[srows].copy()
        for r in srows.tolist():
            self.manager.free(sess.base | r)
        self._unmap_mrows(sess, mrows)
        return [P.ok_reply(seq, self.epoch)]

    def op_fork(self, sess, h, frames, ident, seq):
        parent = self._row(h, "parent")
        child = self._row(h, "child")
        tag = P.get_int(h, "tag", 0, 0, (1 << 64) - 1)
        if sess.mrow[parent] < 0:
            raise UnknownRequest(f"row {parent} holds no request of this session")
        self.manager.fork(sess.base | parent, sess.base | child)
        self._map(sess, child, int(self.manager.row_of(sess.base | child)), tag)
        self._sync_row(sess, child)
        return [P.ok_reply(seq, self.epoch)]

    def op_swap(self, sess, h, frames, ident, seq):
        if len(frames) != 1:
            raise ProtocolError("swap: expected 1 frame")
        srows = self._rows(frames[0], "rows")
        if (sess.mrow[srows] < 0).any():
            raise UnknownRequest("swap of a row that holds no request of this session")
        ids = [sess.base | r for r in srows.tolist()]
        op = h["op"]
        m = self.manager
        if op == P.CAN_SWAP_OUT:
            return [P.ok_reply(seq, self.epoch, status=int(m.can_swap_out(ids)))]
        if op == P.CAN_SWAP_IN:
            return [P.ok_reply(seq, self.epoch, status=int(m.can_swap_in(ids)))]
        res = m.swap_out(ids) if op == P.SWAP_OUT else m.swap_in(ids)
        if self.metrics is not None:
            self.metrics.inc_swap(op == P.SWAP_OUT, int(res.status), len(res.mapping))
        if int(res.status) == STATUS_OK:
            if self.kv is not None:
                (self.kv.swap_out if op == P.SWAP_OUT else self.kv.swap_in)(res.mapping)
            self._sync_rows(sess, sess.mrow[srows].copy())
        return [P.ok_reply(seq, self.epoch, status=int(res.status), t=m.tick), P.arr(res.mapping, P.I32)]

    def op_decode(self, sess, h, frames, ident, seq):
        c, na, an, la = h
        if na > self.max_reqs:
            raise ProtocolError(f"decode: {na} rows > {self.max_reqs}")
        if len(frames) == 1:
            return self._decode_step(sess, seq, frames[0], na, an, la, c)
        if self.G != 1:
            if len(frames) != 1 + 2 * self.G:
                raise ProtocolError(f"decode: expected the rows frame, then each of the {self.G} groups' hashes and "
                                    "counts (no token ids with several groups)")
            return self._decode_step(sess, seq, frames[0], na, an, la, c, group_frames=frames[1:])
        if len(frames) not in (3, 4):
            raise ProtocolError("decode: expected the rows frame, then hashes and counts (+ token ids)")
        return self._decode_step(sess, seq, frames[0], na, an, la, c, *frames[1:])

    def op_decode_free(self, sess, h, frames, ident, seq):
        """The decode op with frees first and admissions last (kvd.protocol ``decode_free``): free
        rows, then the decode op's frames, or with admissions the seven frames that carry them."""
        c, na, an, la, nf, nd = h
        if na > self.max_reqs or nf > self.max_reqs or nd > self.max_reqs:
            raise ProtocolError(f"decode_free: {na} append rows, {nf} free rows or {nd} admissions > {self.max_reqs}")
        if nd:
            G = self.G
            if len(frames) != P.decode_free_admit_frames(G):
                raise ProtocolError(f"decode_free with admissions: expected {P.decode_free_admit_frames(G)} frames "
                                    f"with {G} KV-cache group(s)")
            if G == 1:
                return self._decode_step(sess, seq, frames[1], na, an, la, c, frames[2], frames[3], free_b=frames[0],
                                         nf=nf, admit_frames=frames[4:], nd=nd)
            return self._decode_step(sess, seq, frames[1], na, an, la, c, free_b=frames[0], nf=nf,
                                     group_frames=frames[2:2 + 2 * G], admit_frames=frames[2 + 2 * G:], nd=nd)
        if len(frames) == 2:
            return self._decode_step(sess, seq, frames[1], na, an, la, c, free_b=frames[0], nf=nf)
        if self.G != 1:
            if len(frames) != 2 + 2 * self.G:
                raise ProtocolError(f"decode_free: expected the free rows and append rows frames, then each of the "
                                    f"{self.G} groups' hashes and counts (no token ids with several groups)")
            return self._decode_step(sess, seq, frames[1], na, an, la, c, free_b=frames[0], nf=nf,
                                     group_frames=frames[2:])
        if len(frames) not in (4, 5):
            raise ProtocolError("decode_free: expected the free rows and append rows frames, then hashes and "
                                "counts (+ token ids)")
        return self._decode_step(sess, seq, frames[1], na, an, la, c, *frames[2:], free_b=frames[0], nf=nf)

    def _decode_step(self, sess: Session, seq: int, rows_b: bytes, na: int, an: int, la: int, c: int,
                     hashes_b: bytes = P.EMPTY, counts_b: bytes = P.EMPTY, tokens_b: bytes = P.EMPTY,
                     binary: bool = True, free_b: bytes | None = None, nf: int = 0,
                     admit_frames: list[bytes] | None = None, nd: int = 0,
                     group_frames: list[bytes] | None = None) -> list[bytes]:
        """The decode fast path: appends only, one token count for all; the hashes of blocks that
        filled (if any) are registered on the way, with one group their token ids if sent.
        ``c``: the confirmation, or NO_CONFIRM. ``binary``: reply with a decode header (the decode
        op) or JSON (a step). ``free_b``: the decode_free op's ``nf`` free rows, freed first (the
        manager's step then decides request by request; the reply body starts with their status),
        and ``admit_frames`` its ``nd`` admissions (frame, then each group's hashes and counts),
        admitted last.
        ``group_frames``: with several KV-cache groups, each group's hashes and counts frames."""
        if na * an > self.max_tokens:
            raise InvalidArgument(f"{na * an} append tokens > max_num_batched_tokens {self.max_tokens}")
        free_rows = None if free_b is None else self._rows(free_b, "free rows", nf)
        srows, mrows = self._mapped_rows(sess, rows_b, "append rows", na)
        hs = cnt = tokens = None
        if group_frames is not None:
            hs, cnt = self._group_append_hashes(group_frames, na)
        elif hashes_b or counts_b:
            hs = P.frame_hashes(hashes_b, "append hashes", na * (self.max_model_len // self.block_sizes[0] + 1), dtype=self.hash_dtype)
            if not counts_b:
                raise ProtocolError("append hashes without counts")
            cnt = _hash_counts(counts_b, na, hs.shape[0])
            if tokens_b:
                tokens = self._token_frame(tokens_b, "append token ids", na * self.max_model_len)
        elif tokens_b:
            raise ProtocolError("append token ids without hashes")
        adm = admits = None
        if admit_frames is not None:
            adm = P.frame_array(admit_frames[0], P.I64, nd * P.ADMIT_COLS, "admissions").reshape(nd, P.ADMIT_COLS)
            admits = self._step_admissions(sess, adm, [self._admit_hashes(admit_frames[1 + 2 * g], admit_frames[2 + 2 * g],
                                                                          nd, g) for g in range(self.G)], None)
        m = self.manager
        confirm = self._binary_confirmation(sess, c)
        fast = None
        # The fast path confirms first; whatever it declines then is well formed (the frames are
        # checked above, the lookahead here), so the general path refuses none of it as a whole.
        # Token ids, or a lookahead out of range: the general path, which counts the confirmation
        # only once the step is found well formed.
        if tokens is None and free_rows is None and 0 <= la <= m.max_lookahead:
            if confirm is not None:
                m.mark_computed(sess.writer, confirm)
                confirm = None
            mirror = self._mirror(sess, srows)
            fast = m.decode_rows(mrows, an, la, hs, cnt, mirror)
        if fast is not None:  # the usual step: every request appended, its tables published
            old, grown, copies = fast
            tick, status_b, sched_rows, lens = m.tick, bytes(2 * na), mrows, P.uniform_lens(na, an)
            sched_start = old.astype(np.int32)
            if mirror is not None:  # (the manager wrote the session's rows too)
                changed = self._mirrored(sess, grown)
            else:
                changed = self._sync_rows(sess, grown, full=copies.size > 0)
        else:  # declined (or token ids for KV events): the manager decides request by request
            batch = StepBatch(append_rows=mrows, append_num_tokens=an, num_lookahead_tokens=la,
                              computed_through=confirm)
            if hs is not None:
                batch.append_hashes, batch.append_hash_counts = (hs, cnt) if group_frames else ((hs,), (cnt,))
            if tokens is not None:
                batch.append_token_ids = (tokens,)
            if free_rows is not None:
                base = sess.base
                batch.free = [base | r for r in free_rows.tolist()]
            if admits:
                batch.admit = admits
            res = m.step(batch, namespace=sess.namespace, writer=sess.writer)
            if res.freed_rows.size:  # (the session's own rows: frees name only its requests)
                self._unmap_mrows(sess, np.asarray(res.freed_rows))
            if admits:
                self._map_admitted(sess, adm, res)
            grown, copies, tick = res.changed_rows, res.copies, res.tick
            status_b = res.append_status.astype(P.I16, copy=False).tobytes()
            sched_rows, lens = res.sched_rows, res.sched_len
            sched_start = res.sched_start.astype(np.int32, copy=False)
            if sched_rows.shape[0] != na or admits:
                self._count_step_no_space(sess, res)
            changed = self._sync_rows(sess, grown, full=copies.size > 0)
        nt = self._write_slots(sess, sched_rows, sched_start, lens, uniform=0 if admits else an)
        self.was_step = True
        ns = sched_rows.shape[0]
        statuses = [status_b]
        if free_rows is not None:  # the decode_free op's: the frees' first, the admissions' after
            assert binary, "a JSON step with frees takes the general path"
            statuses.insert(0, P.arr(res.free_status, P.I16))
            if adm is not None:
                statuses += [P.arr(res.admit_status, P.I16), P.arr(res.admit_cached_tokens, P.I32)]
        body = b"".join((*statuses, copies.astype(P.I32, copy=False).tobytes(), changed.tobytes(),
                         sched_start.tobytes()))
        if binary:
            return [P.decode_reply(seq, self.epoch_b, tick, len(copies), len(changed), ns, nt), body]
        return [P.ok_reply(seq, self.epoch, t=tick, nt=nt, nc=len(copies), nch=len(changed), nfr=0, ns=ns), body]

    def _group_append_hashes(self, frames: list[bytes], na: int) -> tuple[tuple, tuple] | tuple[None, None]:
        """Each group's append hashes and counts from the decode ops' ``2 * G`` frames (all empty:
        none), checked as the one group's are."""
        if not any(frames):
            return None, None
        hs, cnt = [], []
        for g in range(self.G):
            most = na * (self.max_model_len // self.block_sizes[g] + 1)
            h = P.frame_hashes(frames[2 * g], f"append hashes[{g}]", most, dtype=self.hash_dtype)
            hs.append(h)
            cnt.append(_hash_counts(frames[2 * g + 1], na, h.shape[0]))
        return tuple(hs), tuple(cnt)

    def _lone_admission(self, sess: Session, h: dict, frames: list[bytes], seq: int, la: int) -> list[bytes]:
        """``op_step`` of one admission and nothing else (an idle engine's new request: its time to
        first token): the general path's checks in its order, its manager call, state and reply
        bytes, without parsing the empty sections or building the reply's nine empty parts
        (``tests/test_lone_admission_op.py`` compares the two)."""
        G = self.G
        ntok = P.get_int(h, "an", 1, 0, P.MAX_COUNT)
        k = 5 + 2 * G
        adm = P.frame_array(frames[k], P.I64, P.ADMIT_COLS, "admissions")
        hs = [self._admit_hashes(frames[k + 1 + 2 * g], frames[k + 2 + 2 * g], 1, g)[0] for g in range(G)]
        adm_tokens, app_token_ids = self._step_token_ids(frames[P.step_frame_count(G):], 1, 0)
        self._check_admission_fields(adm[None, :6])
        tok = adm_tokens[0] if adm_tokens and len(adm_tokens[0]) else None
        return self._admit_alone(sess, seq, adm.tolist(), hs, tok, app_token_ids, ntok, la,
                                 self._confirmation(sess, h), binary=False)

    def op_admit(self, sess, h, frames, ident, seq):
        """The binary lone admission (kvd.protocol ``admit``): ``_lone_admission``'s checks, manager
        call and effects, its reply under a binary header."""
        c, la, cols = h
        G = self.G
        if len(frames) not in (G, G + 1):
            raise ProtocolError(f"admit: expected {G} hash frame(s), then optionally the token ids")
        mml = self.max_model_len
        hs = [P.frame_hashes(frames[g], "admit hashes", mml // self.block_sizes[g] + 1, dtype=self.hash_dtype)
              for g in range(G)]
        tok = self._token_frame(frames[G], "admit token ids", mml) if len(frames) > G and frames[G] else None
        self._check_admission_fields(np.array([cols[:6]], np.int64))
        return self._admit_alone(sess, seq, cols, hs, tok, (), 1, la, self._binary_confirmation(sess, c), binary=True)

    def _admit_alone(self, sess: Session, seq: int, cols, hs: list[np.ndarray], tok, app_token_ids, ntok: int,
                     la: int, confirm: int | None, binary: bool) -> list[bytes]:
        """One admission and nothing else, parsed and range-checked: the manager's step, the
        session's row, shared memory, and the reply (``binary``: under a decode reply header)."""
        row, nt, lookahead, pri, net, mnt, tag = cols
        req = AdmitRequest(sess.base | row, nt, hs[0] if self.G == 1 else hs, lookahead, pri, net, mnt, tok)
        batch = StepBatch(free=(), forks=[], append_num_tokens=ntok, append_hashes=[], append_hash_counts=[],
                          num_lookahead_tokens=la, admit=[req], append_token_ids=app_token_ids, append_rows=_EMPTY_I32,
                          computed_through=confirm)
        res = self.manager.step(batch, namespace=sess.namespace, writer=sess.writer)
        assert not res.freed_rows.size and not res.copies.size  # an admission frees and copies nothing
        if int(res.admit_status[0]) == STATUS_OK:
            self._map(sess, row, int(res.admit_rows[0]), tag & _U64_MASK)  # (the tag travels as int64)
        changed = self._sync_rows(sess, res.changed_rows, full=False)
        nt_written = self._write_slots(sess, res.sched_rows, res.sched_start, res.sched_len)
        self.was_step = True
        self._count_step_no_space(sess, res)
        ns = res.sched_rows.size
        sched_s = self.owner_srow[res.sched_rows] if ns else _EMPTY_I32
        body = b"".join((P.arr(res.admit_status, P.I16), P.arr(res.admit_cached_tokens, P.I32), P.arr(changed, P.I32),
                         P.arr(sched_s, P.I32), P.arr(res.sched_start, P.I32), P.arr(res.sched_len, P.I32)))
        if binary:
            return [P.decode_reply(seq, self.epoch_b, res.tick, 0, len(changed), ns, nt_written), body]
        return [P.ok_reply(seq, self.epoch, t=res.tick, nt=nt_written, nc=0, nch=len(changed), nfr=0, ns=ns), body]

    def _map_admitted(self, sess: Session, adm: np.ndarray, res) -> None:
        """Map the session rows of a step's admissions (``adm``: its admissions frame) that the
        manager admitted, with their tags."""
        if adm.shape[0] == 1:  # one admission (an idle engine's new request): scalars, no masks
            if int(res.admit_status[0]) == STATUS_OK:
                self._map(sess, int(adm[0, 0]), int(res.admit_rows[0]), int(adm[0, 6]) & _U64_MASK)
            return
        okm = np.asarray(res.admit_status) == STATUS_OK
        if okm.any():
            srows = adm[okm, 0].astype(np.int32)
            mr = np.asarray(res.admit_rows)[okm]
            sess.mrow[srows] = mr
            self.owner_sid[mr] = sess.sid
            self.owner_srow[mr] = srows
            sess.shm.row_tags[srows] = adm[okm, 6].view(np.uint64)

    def _step_admissions(self, sess: Session, adm: np.ndarray, adm_hashes: list, adm_tokens) -> list:
        """A step's admissions (its frame, checked here; per group their hashes, and token ids)
        as the manager's requests."""
        G, nd, base = self.G, adm.shape[0], sess.base
        cols = adm[:, :6]
        self._check_admission_fields(cols)
        if nd > 1 and np.unique(cols[:, 0]).size != nd:
            raise InvalidArgument("two admissions in one row")
        admits = []
        for i, (row, nt, l, pri, net, mnt) in enumerate(cols.tolist()):
            hs = [adm_hashes[g][i] for g in range(G)]
            tok = adm_tokens[i] if adm_tokens and len(adm_tokens[i]) else None
            admits.append(AdmitRequest(base | row, nt, hs[0] if G == 1 else hs, l, pri, net, mnt, tok))
        return admits

    def _check_admission_fields(self, cols: np.ndarray) -> None:
        """A step's admissions' first six columns (row, tokens, lookahead, priority, ...) in range."""
        if not P.within(cols, 0, self._admit_max_list):
            rows_ok = P.within(cols[:, 0], 0, self._admit_max_list[0])
            raise InvalidArgument("admission field out of range" if rows_ok else "admission row out of range")

    def _admit_hashes(self, hashes_b: bytes, counts_b: bytes, nd: int, g: int) -> list[np.ndarray]:
        """Group ``g``'s admission hashes of a step, one array per admission."""
        R, mml = self.max_reqs, self.max_model_len
        hs = P.frame_hashes(hashes_b, "admit hashes", R * (mml // self.block_sizes[g] + 1), dtype=self.hash_dtype)
        cnt = P.frame_array(counts_b, P.I32, nd, "admit hash counts")
        if nd == 1 and int(cnt[0]) == hs.shape[0]:
            return [hs]
        return P.split_counts(hs, cnt)

    def _step_token_ids(self, frames: list[bytes], nd: int, na: int):
        """A step's optional token-id frames (kvd.protocol): per admission its ids (or None when
        none were sent), and per group the append token ids (() when none were sent)."""
        adm_b, adm_counts_b, *app_b = frames
        adm_tokens = None
        if adm_b or adm_counts_b:
            ids = self._token_frame(adm_b, "admit token ids", nd * self.max_model_len)
            counts = P.frame_array(adm_counts_b, P.I32, nd, "admit token id counts")
            adm_tokens = P.split_counts(ids, counts, "admit token id")
        if not any(app_b):
            return adm_tokens, ()
        return adm_tokens, [self._token_frame(b, "append token ids", na * self.max_model_len) for b in app_b]

    def _count_step_no_space(self, sess: Session, res) -> None:
        if self.metrics is not None:
            n = sum(int(np.count_nonzero((st == STATUS_NO_SPACE) | (st == STATUS_NEVER)))
                    for st in (res.append_status, res.admit_status))
            self._count_no_space(sess, n)

    def op_step(self, sess, h, frames, ident, seq):
        G = self.G
        nfr = P.step_frame_count(G)
        most = P.step_frame_count(G, token_ids=True)
        fl = h.get("fl")
        if fl is not None:  # the packed form: one body frame
            frames = P.unpack_frames(fl, frames, most)
        if len(frames) != most:
            if len(frames) > most or len(frames) < 4:
                raise ProtocolError(f"step: expected 4 to {most} frames after the header")
            frames = frames + [P.EMPTY] * (most - len(frames))  # trailing empty frames may be left out
        R = self.max_reqs
        mml = self.max_model_len
        nf = P.get_int(h, "nf", 0, 0, R)
        nk = P.get_int(h, "nk", 0, 0, R)
        na = P.get_int(h, "na", 0, 0, R)
        nd = P.get_int(h, "nd", 0, 0, R)
        la = P.get_int(h, "la", 0, 0, P.MAX_COUNT)
        if not (nf or nk or nd or frames[0] or frames[1] or frames[2] or frames[4]) \
                and not any(frames[7 if G == 1 else 5 : nfr + 2]) \
                and (G == 1 or not any(frames[nfr + 2 :])):
            # a decode step (that may register the blocks that filled, with their token ids)
            c = P.NO_CONFIRM if h.get("c") is None else P.get_int(h, "c", None, 0, P.MAX_INT)
            return self._decode_step(sess, seq, frames[3], na, P.get_int(h, "an", 1, 0, P.MAX_COUNT), la, c,
                                     frames[5], frames[6], frames[nfr + 2], binary=False)
        if _LONE_ADMISSION_OP and nd == 1 and not (nf or nk or na) and not any(frames[: 5 + 2 * G]):
            return self._lone_admission(sess, h, frames, seq, la)
        # Each section is parsed only when present (or when its frame is not empty, to report it): a
        # step that only admits or only frees parses one section, not eleven.
        free_rows = self._rows(frames[0], "free rows", nf)
        fork_rows = self._rows(frames[1], "fork rows", 2 * nk).reshape(nk, 2)
        fork_tags = P.frame_array(frames[2], P.U64, nk, "fork tags") if nk or frames[2] else _EMPTY_U64
        forked_appends = bool(nk and na)
        # appends name manager rows by one gather (range-checked), unless children forked by this
        # very step are among them (below)
        app_rows = self._rows(frames[3], "append rows", na) if forked_appends else None
        if forked_appends:
            app_mrows = None
        elif na or frames[3]:
            app_mrows = self._mapped_rows(sess, frames[3], "append rows", na)[1]
        else:
            app_mrows = _EMPTY_I32
        if frames[4]:
            ntok = P.frame_array(frames[4], P.I32, na, "append counts")
            if na and (int(ntok.min()) < 0 or int(ntok.max()) > P.MAX_COUNT):
                raise InvalidArgument("append token count out of range")
            app_tokens = int(ntok.sum(dtype=np.int64))
        else:
            ntok = P.get_int(h, "an", 1, 0, P.MAX_COUNT)
            app_tokens = ntok * na
        if app_tokens > self.max_tokens:
            raise InvalidArgument(f"{app_tokens} append tokens > max_num_batched_tokens {self.max_tokens}")
        app_hashes = []
        app_counts = []
        for g in range(G):
            if not (frames[5 + 2 * g] or frames[6 + 2 * g]):
                continue
            hs = P.frame_hashes(frames[5 + 2 * g], "append hashes", R * (mml // self.block_sizes[g] + 1), dtype=self.hash_dtype)
            if frames[6 + 2 * g]:
                cnt = _hash_counts(frames[6 + 2 * g], na, hs.shape[0])
                app_hashes.append(hs)
                app_counts.append(cnt)
            elif hs.shape[0]:
                raise ProtocolError("append hashes without counts")
        k = 5 + 2 * G
        if nd or any(frames[k: k + 1 + 2 * G]):
            adm = P.frame_array(frames[k], P.I64, nd * P.ADMIT_COLS, "admissions").reshape(nd, P.ADMIT_COLS)
            adm_hashes = [self._admit_hashes(frames[k + 1 + 2 * g], frames[k + 2 + 2 * g], nd, g) for g in range(G)]
        else:
            adm, adm_hashes = _NO_ADMITS, [[]] * G
        adm_tokens, app_token_ids = self._step_token_ids(frames[nfr:], nd, na)

        # -- map session rows -> manager ids / rows (arrays; per-request Python only for the rare
        #    frees, forks and admissions)
        base = sess.base
        frees = [base | r for r in free_rows.tolist()] if nf else ()
        forks = []
        if nk:
            for p, c in fork_rows.tolist():
                forks.append((base | p, base | c))
        admits = self._step_admissions(sess, adm, adm_hashes, adm_tokens) if nd else []
        # unmapped session rows become -1: the manager reports UnknownRequest for them (and
        # InvalidArgument for duplicates) without failing the other requests
        if forked_appends:
            # Children forked by this very step have no manager row yet: name appends by id, so
            # the manager resolves them after the forks (rare: forks are not the decode path).
            app = dict(append_ids=[base | r for r in app_rows.tolist()])
        else:
            app = dict(append_rows=app_mrows)
        batch = StepBatch(
            free=frees, forks=forks, append_num_tokens=ntok,
            append_hashes=app_hashes, append_hash_counts=app_counts, num_lookahead_tokens=la,
            admit=admits, append_token_ids=app_token_ids, computed_through=self._confirmation(sess, h), **app,
        )
        m = self.manager
        res = m.step(batch, namespace=sess.namespace, writer=sess.writer)

        # -- publish: unmap freed rows, map forks and admissions, copy changed rows, slot mapping
        freed_s = np.empty(0, np.int32)
        if res.freed_rows.size:
            fr = np.asarray(res.freed_rows)
            freed_s = self.owner_srow[fr[self.owner_sid[fr] == sess.sid]]
            self._unmap_mrows(sess, fr)
        if nk:
            fs = np.asarray(res.fork_status)
            tags = fork_tags.tolist()
            for i, (p, c) in enumerate(fork_rows.tolist()):
                if fs[i] == STATUS_OK:
                    self._map(sess, c, int(m.row_of(base | c)), tags[i])
        if nd:
            self._map_admitted(sess, adm, res)
        changed = self._sync_rows(sess, res.changed_rows, full=res.copies.size > 0)
        nt = self._write_slots(sess, res.sched_rows, res.sched_start, res.sched_len)
        self.was_step = True
        append_status = res.append_status
        copies = res.copies
        self._count_step_no_space(sess, res)
        sched_s = self.owner_srow[res.sched_rows] if res.sched_rows.size else _EMPTY_I32
        return [
            P.ok_reply(seq, self.epoch, t=res.tick, nt=nt, nc=len(copies), nch=len(changed), nfr=len(freed_s),
                       ns=len(sched_s)),
            b"".join((
                P.arr(res.free_status, P.I16), P.arr(res.fork_status, P.I16),
                P.arr(append_status, P.I16), P.arr(res.admit_status, P.I16),
                P.arr(res.admit_cached_tokens, P.I32), P.arr(copies, P.I32),
                P.arr(changed, P.I32), P.arr(freed_s, P.I32),
                P.arr(sched_s, P.I32), P.arr(res.sched_start, P.I32), P.arr(res.sched_len, P.I32),
            )),
        ]

    # ---- session lifecycle -----------------------------------------------------------------------
    def end_session(self, sess: Session, why: str) -> None:
        if self.sessions.pop(sess.sid, None) is None:
            return
        self.ended[sess.sid] = (sess.name, why)
        if len(self.ended) > MAX_ENDED_REMEMBERED:
            del self.ended[next(iter(self.ended))]
        if why == LEASE_EXPIRED and self.metrics is not None:
            self.metrics.inc_lease_expired()
        if sess.nonce and self.by_nonce.get(sess.nonce) == sess.sid:
            del self.by_nonce[sess.nonce]
        live = np.flatnonzero(sess.mrow >= 0)
        freed = 0
        for r in live.tolist():
            try:
                self.manager.free(sess.base | r)
                freed += 1
            except KvdError as e:  # should not happen; keep going
                log.error("session %d: free of row %d failed: %s", sess.sid, r, e)
        mrows = sess.mrow[live]
        self.owner_sid[mrows] = 0
        self.owner_srow[mrows] = -1
        sess.mrow[:] = -1
        try:
            if sess.writer:  # what it never confirmed may never have been written
                self.manager.drop_writer(sess.writer)
            else:  # its K/V memory goes with it
                ns = sess.namespace
                self._retired = {k: (self.topic_of[ns], self.block_sizes[g], g)
                                 for k, g in self.manager.cache_keys_of(ns)}
                self.manager.drop_namespace(ns)
                self.publish_events()  # now: the dropped keys' ids may be given to a new namespace next
                self._retired = {}
                del self.topic_of[ns]
        except KvdError as e:  # a request it held could not be freed above: keep its cache, say so
            log.error("session %d: its prefix cache could not be dropped: %s", sess.sid, e)
        if sess.gpu is not None:
            sess.gpu.close()  # torch keeps the arena in its IPC limbo while the client maps it
            sess.gpu = None
        sess.mirror = None  # (views of the segment: its mapping goes with the close below)
        self._close_mailbox(sess)
        sess.shm.unlink()
        log.info("session %s ended (%s): %d requests freed", sess.shm.name, why, freed)
        sess.shm.close()

    def reap(self, now: float) -> None:
        dead = []
        recent_disconnect = now - self._disconnect_at < 2 * self.hb_s + 0.5
        for s in self.sessions.values():
            idle = now - s.last_seen
            if idle > self.lease_s or (recent_disconnect and idle > 2 * self.hb_s):
                dead.append(s)
        for s in dead:
            self.end_session(s, LEASE_EXPIRED)

    def source(self) -> dict:
        st = dict(self.manager.stats())
        return {"pools": {"gpu": st, "cpu": {"num_blocks": int(self.mcfg.num_cpu_blocks)}},
                "sessions": len(self.sessions), "tenants": self.tenant_usage()}

    def status_line(self) -> str:
        sd = _systemd()
        fmt = getattr(sd, "format_status", None) if sd is not None else None
        if fmt is not None:
            try:
                return f"{fmt(self.source())} steps={self.n_steps}"
            except Exception:
                pass
        st = self.manager.stats()
        return (f"sessions={len(self.sessions)} used={st.get('num_used_blocks')}/{st.get('num_blocks')} "
                f"requests={st.get('num_requests')} hit_rate={st.get('hit_rate', 0):.3f} steps={self.n_steps}")


# ---- the loop -----------------------------------------------------------------------------------

def _systemd():
    try:
        from kvd import systemd  # type: ignore

        return systemd
    except Exception:
        return None


def _notify(*lines: str) -> None:
    sd = _systemd()
    if sd is not None:
        try:
            sd.notify(*lines)
        except Exception:
            log.debug("sd_notify failed", exc_info=True)


def _lock_path(runtime_dir: str, endpoint: str, default_endpoint: bool) -> str:
    if default_endpoint:
        return os.path.join(runtime_dir, "kvd.lock")
    return os.path.join(runtime_dir, f"kvd-{hashlib.sha1(endpoint.encode()).hexdigest()[:12]}.lock")


def _prepare_runtime_dir(path: str, gid: int) -> None:
    """The socket's directory: 0750 and the daemon's group (systemd's RuntimeDirectoryMode does
    the same under the units), so the group's engines can reach the socket and nobody else."""
    under_systemd = bool(os.environ.get("RUNTIME_DIRECTORY")) and path == os.environ["RUNTIME_DIRECTORY"].split(":")[0]
    os.makedirs(path, mode=0o700, exist_ok=True)
    if not under_systemd:
        st = os.stat(path)
        if st.st_uid == os.getuid():
            if gid >= 0 and st.st_gid != gid:
                os.chown(path, -1, gid)
            if (st.st_mode & 0o777) != RUNTIME_DIR_MODE:
                os.chmod(path, RUNTIME_DIR_MODE)


def _set_socket_access(path: str, mode: int, gid: int) -> None:
    if gid >= 0:
        os.chown(path, -1, gid)
    os.chmod(path, mode)


def _group_specs(config: Any) -> tuple[tuple[int, int], ...]:
    """(block size, window) per KV-cache group, from a ServeConfig or a plain namespace."""
    if hasattr(config, "group_specs"):
        return config.group_specs()
    return ((int(config.block_size), int(_opt(config, "sliding_window", 0) or 0)),)


def serve(config: Any) -> int:
    """Run the daemon until SIGTERM/SIGINT. Returns the process exit code."""
    try:
        import uvloop  # type: ignore
    except ImportError:  # pragma: no cover
        uvloop = None
    if uvloop is not None:
        loop = uvloop.new_event_loop()
    else:  # pragma: no cover
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(_serve(config, loop))
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def _resolve(config: Any) -> tuple[str, str]:
    if hasattr(config, "resolved_runtime_dir"):
        rd = config.resolved_runtime_dir()
    else:
        rd = getattr(config, "runtime_dir", "") or f"/tmp/kvd-{os.getuid()}"
    if hasattr(config, "resolved_endpoint"):
        ep = config.resolved_endpoint()
    else:
        ep = getattr(config, "endpoint", "") or "ipc://" + os.path.join(rd, "kvd.sock")
    return rd, ep


EXIT_CONFIG = 78  # EX_CONFIG: the unit files do not restart on it


async def _serve(config: Any, loop: asyncio.AbstractEventLoop) -> int:
    runtime_dir, endpoint = _resolve(config)
    default_ep = not getattr(config, "endpoint", "")
    try:
        gid = resolve_group(str(_opt(config, "group", "") or ""))
        socket_mode = int(str(_opt(config, "socket_mode", SOCKET_MODE)), 8)
    except InvalidArgument as e:
        print(f"kvd: {e}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        _prepare_runtime_dir(runtime_dir, gid)
    except OSError as e:
        print(f"kvd: cannot create runtime directory {runtime_dir}: {e}", file=sys.stderr)
        return 1
    lock_path = _lock_path(runtime_dir, endpoint, default_ep)
    lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        try:
            other = os.pread(lock_fd, 32, 0).decode().strip()
        except OSError:
            other = "?"
        os.close(lock_fd)
        print(f"kvd: another kvd daemon (pid {other or '?'}) already serves {endpoint} "
              f"(lock {lock_path} is held); not starting", file=sys.stderr)
        return 2
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)

    ipc_path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None
    ctx = zmq.Context()
    d: Daemon | None = None
    sock = None
    kick_fd: int | None = None
    try:
        pin_cpu = int(_opt(config, "pin_cpu", -1))
        if pin_cpu >= 0:
            allowed = os.sched_getaffinity(0)
            if pin_cpu not in allowed:
                print(f"kvd: pin_cpu {pin_cpu} is not among this process's CPUs {sorted(allowed)}", file=sys.stderr)
                return EXIT_CONFIG
            ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, pin_cpu)  # before the first socket starts the I/O thread
        removed = sweep_stale(own_pid=os.getpid())
        if removed:
            log.info("removed %d stale shared-memory segments of dead daemons", len(removed))
        try:
            d = Daemon(config)
        except (InvalidArgument, CapacityExceeded) as e:
            print(f"kvd: {e}", file=sys.stderr)
            return EXIT_CONFIG
        except (ImportError, RuntimeError, MemoryError, OSError) as e:
            print(f"kvd: cannot start on device {getattr(config, 'device', 'cpu')}: {e}", file=sys.stderr)
            return 1
        try:
            from kvd.metrics import Metrics  # type: ignore

            d.metrics = Metrics()
            d.metrics.set_source(d.source)
            if int(getattr(config, "metrics_port", 0) or 0) > 0:
                d.metrics.start_http(getattr(config, "metrics_host", "127.0.0.1"), int(config.metrics_port))
        except ImportError as e:
            d.metrics = None
            if int(getattr(config, "metrics_port", 0) or 0) > 0:
                print(f"kvd: metrics_port is set but the metrics extra is missing ({e}); "
                      "pip install 'kvd[metrics]'", file=sys.stderr)
                return 1
        except Exception as e:
            log.warning("metrics disabled: %s", e)
            d.metrics = None

        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.RCVHWM, RECV_HWM)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, d.max_message_bytes)
        if ipc_path is not None and os.path.exists(ipc_path):
            os.unlink(ipc_path)  # stale socket of a dead daemon: we hold the lock
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            print(f"kvd: cannot bind {endpoint}: {e}", file=sys.stderr)
            return 1
        if ipc_path is not None:
            _set_socket_access(ipc_path, socket_mode, gid)
        d.sock = sock
        if d.mailbox_on:
            kick_path = lock_path[:-len(".lock")] + ".kick"  # kvd.kick beside kvd.lock: one per daemon
            try:
                kick_fd = open_kick_fifo(kick_path)
                d.kick_path = kick_path
            except OSError as e:  # an optimisation: mailbox clients then kick on the socket
                log.warning("kvd: no kick FIFO (%s)", e)
        mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        d.monitor = mon
        events_ep = str(getattr(config, "kv_events_endpoint", "") or "")
        if events_ep:
            try:
                import kvd.events  # noqa: F401 - the worker's encoder: fail here, naming the extra
                from kvd.eventworker import EventForwarder, EventsError
            except ImportError as e:
                print(f"kvd: kv_events_endpoint is set but the events extra is missing ({e}); "
                      "pip install 'kvd[events]'", file=sys.stderr)
                return 1

            try:  # encoded and published by a worker process: the loop only hands the log over
                d.events = EventForwarder.start(
                    ctx, f"ipc://{os.path.join(runtime_dir, f'kvd-events-{os.getpid()}.sock')}",
                    d.describe_cache_key, endpoint=events_ep, hash_width=d.hash_width,
                    replay_endpoint=str(_opt(config, "kv_events_replay_endpoint", "")),
                    buffer_steps=int(_opt(config, "kv_events_buffer_steps", 10_000)),
                    topic=str(_opt(config, "kv_events_topic", "{tenant}")),
                    data_parallel_rank=int(_opt(config, "kv_events_data_parallel_rank", 0)),
                    int_hashes=bool(_opt(config, "kv_events_int_hashes", True)),
                    group_windows=[g.sliding_window for g in d.mcfg.groups])
            except EventsError as e:
                print(f"kvd: cannot bind the KV events endpoint {events_ep}: {e}", file=sys.stderr)
                return 1
            d.manager.enable_kv_events()

        # warm the decode path (numpy dispatch) without touching the pool
        slot_mapping_from_ranges_ref([np.zeros((2, 4), np.int32)] * d.G, d.block_sizes, np.zeros(2, np.int32),
                                     np.zeros(2, np.int64), np.ones(2, np.int32), np.empty((d.G, 4), np.int64))
        if d.gpu_pool is not None:
            # READY=1 only after every Triton kernel a session uses is compiled and has run once
            d.gpu_pool.warm()

        stop = asyncio.Event()
        if pin_cpu >= 0:  # the loop thread last: the threads and processes started above keep every CPU
            os.sched_setaffinity(0, {pin_cpu})
        fd = sock.getsockopt(zmq.FD)
        mon_fd = mon.getsockopt(zmq.FD)

        send_frames, recv_message, NB = P.send_frames, P.recv_message, P.NOBLOCK

        has_input = P.has_input

        poll_s = int(getattr(config, "busy_poll_us", 0)) / 1e6
        pc, yield_cpu = time.perf_counter, os.sched_yield

        pacer = IdlePacer()
        warm_s = int(_opt(config, "warm_every_us", 0)) / 1e6 if poll_s else 0.0
        if warm_s:
            from kvd.warm import Warmer

            try:
                d.warmer = Warmer(config, Daemon, _group_specs(config))
            except Exception as e:  # warming is an optimisation: the daemon serves without it
                log.warning("kvd warm: no warming (%s)", e)
        warmed = 0.0  # when the last warm pass ended

        def warm() -> None:
            nonlocal warmed
            try:
                d.warmer.run()
            except Exception:  # a bug must not kill the loop: warming stops, serving goes on
                log.exception("kvd warm: a pass failed; warming stops")
                d.warmer.close()
                d.warmer = None
            warmed = pc()

        # When the socket last had work (a message handled, a deferred slice run): busy polling
        # lasts poll_s from it, across callbacks. A callback that finds nothing (the ticker's, every
        # TICK_S; a re-entry after _MAX_DRAIN_S) must not open a window of its own, or an idle
        # daemon polls poll_s of every TICK_S (5 % of a CPU at the default 5 ms) and, with poll_s
        # above _MAX_DRAIN_S, never sleeps at all.
        last = 0.0

        def drain() -> None:
            nonlocal last
            s = sock
            handle = d.handle
            m = d.manager
            mailboxes = d.mailboxes
            entered = pc()
            if poll_s:
                polling(True)
            while True:
                if mailboxes and serve_mailboxes():
                    continue
                if not has_input(s):  # ZMQ_EVENTS re-arms the edge-triggered FD without an EAGAIN
                    if m.num_deferred:  # idle: the prefix-cache work steps left for later
                        now = pc()
                        rows = pacer.rows(now) if poll_s else IdlePacer.IDLE_ROWS  # not polling: the socket is idle
                        if rows:
                            done = m.flush_deferred(rows)
                            last = pc()
                            pacer.ran(last - now, done)
                            continue
                    d.publish_events()  # KV events once no message waits: several messages' at once
                    if not poll_s:
                        if may_sleep():
                            break
                        continue
                    now = pc()
                    if now - last > poll_s and not m.num_deferred:
                        if may_sleep():
                            break  # idle: sleep in the event loop
                        continue
                    if warm_s and now - last >= warm_s and now - warmed >= warm_s and d.warmer is not None:
                        warm()  # idle long enough for the admission path to go cold (kvd.warm)
                        continue
                    if now - entered > _MAX_DRAIN_S:
                        loop.call_soon(drain)  # timers and signals get their turn
                        break
                    yield_cpu()  # busy polling costs nothing when clients need the CPU
                    continue
                try:
                    msg, identity_frame = recv_message(s, NB)
                except zmq.Again:
                    if may_sleep():
                        break
                    continue
                t0 = time.perf_counter()
                pacer.arrived(t0)
                c0 = time.thread_time() if _PROF is not None else 0.0
                reply = handle(msg, identity_frame)
                if reply is not None:
                    send_reply(msg[0], reply)
                after_message(t0, c0)

        def send_reply(ident: bytes, reply: list[bytes]) -> None:
            try:
                send_frames(sock, [ident, *reply], NB)
            except zmq.Again:
                pass  # peer's queue full: its loss, our memory stays bounded
            except zmq.ZMQError as e:
                log.debug("send failed: %s", e)

        def after_message(t0: float, c0: float) -> None:
            nonlocal last
            m = d.manager
            pacer.replied(pc())
            # Prefix-cache work a decode step left for after its reply waits while messages are
            # queued (up to _MAX_DEFERRED of them), else runs when the socket is idle; the
            # manager runs it first in any call that reads the cache.
            if m.num_deferred > _MAX_DEFERRED:
                m.flush_deferred()
            if d.events is not None and t0 - d.events_at > EVENTS_MAX_DELAY_S:
                d.publish_events()
            if d.was_step:
                if _PROF is not None:
                    _PROF.append((t0, time.perf_counter(), c0, time.thread_time()))
                d.was_step = False
                d.n_steps += 1
                if d.metrics is not None:
                    d.metrics.observe_step(time.perf_counter() - t0)
            if d.was_heartbeat:  # a client's lease renewal says nothing of when its next step comes
                d.was_heartbeat = False
            else:
                last = pc()

        def serve_mailboxes() -> bool:
            """Answer every request waiting in a session's mailbox (kvd.mailbox); whether any did."""
            served = False
            for sess in d.mailboxes:
                mb = sess.mailbox
                if not mb.waiting():
                    continue
                t0 = time.perf_counter()
                pacer.arrived(t0)
                c0 = time.thread_time() if _PROF is not None else 0.0
                reply = d.serve_mailbox(sess)
                if reply is not None:
                    send_reply(sess.ident, reply)  # too large for the mailbox: the client waits on both
                after_message(t0, c0)
                served = True
            return served

        def polling(on: bool) -> None:
            d.mailbox_polling = on  # (a mailbox opened meanwhile starts so)
            for sess in d.mailboxes:
                sess.mailbox.set_polling(on)

        def may_sleep() -> bool:
            """Before the loop sleeps: say so in every mailbox, then look at them once more (a
            request posted before a client saw the flag fall is found here; kvd.mailbox)."""
            if not d.mailboxes:
                return True
            polling(False)
            fence()
            if any(sess.mailbox.waiting() for sess in d.mailboxes):
                if poll_s:
                    polling(True)
                return False
            return True

        def on_monitor() -> None:
            while mon.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                try:
                    mon.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                d._disconnect_at = time.monotonic()

        if os.environ.get("KVDSRV_PROF") == "cprofile":
            import cProfile

            _cprof = cProfile.Profile()
            _drain = drain

            def drain() -> None:  # noqa: F811
                _cprof.enable()
                try:
                    _drain()
                finally:
                    _cprof.disable()

            d._cprof = _cprof
        loop.add_reader(fd, drain)
        loop.add_reader(mon_fd, on_monitor)
        if kick_fd is not None:
            def on_kick() -> None:
                drain_kicks(kick_fd)
                drain()

            loop.add_reader(kick_fd, on_kick)

        def on_signal(signame: str) -> None:
            log.info("%s: shutting down", signame)
            stop.set()

        for sig, name in ((signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")):
            loop.add_signal_handler(sig, on_signal, name)

        # exit_with_parent: the parent that started us, whose death (we are reparented) stops us
        parent = os.getppid() if _opt(config, "exit_with_parent", False) else 0

        async def ticker() -> None:
            sd = _systemd()
            wd = None
            if sd is not None:
                try:
                    wd = sd.watchdog_interval()
                except Exception:
                    wd = None
            next_wd = time.monotonic()
            next_status = time.monotonic() + float(getattr(config, "status_interval_s", 5.0))
            while not stop.is_set():
                await asyncio.sleep(TICK_S)
                now = time.monotonic()
                if parent and os.getppid() != parent:
                    log.warning("kvd: the process that started it (pid %d) is gone: shutting down", parent)
                    stop.set()
                    break
                drain()
                on_monitor()
                d.reap(now)
                if d.metrics is not None:
                    d.metrics.beat()
                if d.gpu_pool is not None:
                    d.gpu_pool.collect(now)
                if wd and now >= next_wd:
                    _notify("WATCHDOG=1")
                    next_wd = now + wd
                if now >= next_status:
                    _notify("STATUS=" + d.status_line())
                    next_status = now + float(getattr(config, "status_interval_s", 5.0))

        tick = loop.create_task(ticker())
        log.info("kvd serving %s (epoch %s, %d blocks of %s tokens)", endpoint, d.epoch,
                 config.num_gpu_blocks, d.block_sizes)
        gcheap.freeze()  # what READY's daemon holds for its life: out of every later collection's walk
        _notify("READY=1", f"STATUS=serving {endpoint}: {d.status_line()}")
        await stop.wait()
        _notify("STOPPING=1")
        if getattr(d, "_cprof", None) is not None:
            import io
            import pstats

            buf = io.StringIO()
            stats = pstats.Stats(d._cprof, stream=buf).sort_stats(os.environ.get("KVDSRV_PROF_SORT", "tottime"))
            stats.print_stats(int(os.environ.get("KVDSRV_PROF_N", "25")))
            log.warning("%s", buf.getvalue())
        if _PROF and os.environ.get("KVDSRV_PROF_FILE"):
            np.save(os.environ["KVDSRV_PROF_FILE"], np.array(_PROF))
        if len(_PROF or ()) > 20:
            a = np.array([b - a for a, b, _, _ in _PROF[20:]]) * 1e6
            c = np.array([d - c for _, _, c, d in _PROF[20:]]) * 1e6
            log.warning("step handle+send us: p50 %.0f p99 %.0f (cpu p50 %.0f) n %d", np.percentile(a, 50),
                        np.percentile(a, 99), np.percentile(c, 50), a.size)
        loop.remove_reader(fd)
        loop.remove_reader(mon_fd)
        if kick_fd is not None:
            loop.remove_reader(kick_fd)
        drain()  # answer what already arrived
        await tick
        return 0
    finally:
        gcheap.thaw()
        if d is not None:
            for s in list(d.sessions.values()):
                d.end_session(s, "daemon shutdown")
            if d.warmer is not None:
                d.warmer.close()
            if d.kv is not None:
                d.kv.close()
            if d.gpu_pool is not None and d.gpu_pool.cuda:
                from kvd.gpu_session import remove_ipc_event_files

                remove_ipc_event_files()  # the driver would leave its file behind
            if d.events is not None:
                d.events.close()
            if d.metrics is not None:
                try:
                    d.metrics.stop()
                except Exception:
                    pass
        if d is not None and d.monitor is not None:
            try:
                sock.disable_monitor()
            except Exception:
                pass
            d.monitor.close(0)
        if sock is not None:
            sock.close(0)
        ctx.term()
        if ipc_path is not None:
            try:
                os.unlink(ipc_path)
            except FileNotFoundError:
                pass
        if kick_fd is not None:
            os.close(kick_fd)
            try:
                os.unlink(d.kick_path)
            except FileNotFoundError:
                pass
        os.close(lock_fd)  # the lock file stays: unlinking it would race with a starting daemon
