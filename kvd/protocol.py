"""The kvd wire format: the one file that defines what travels between a client and the daemon.

Transport
=========
One ZeroMQ ROUTER socket in the daemon, one DEALER socket per client (plus, in the blocking client,
a second DEALER used only for heartbeats). A message is a multipart ZeroMQ message::

    [header, frame_1, ..., frame_n]          (the ROUTER prepends the peer identity on its side)

A session may also have a mailbox (kvd.mailbox, which owns its layout): a shared-memory segment
where its binary step ops (decode, decode_free, admit, below) and their replies travel as the same
frames, the socket carrying only
a 4-byte kick (``kvd.mailbox.KICK``, no reply) when the daemon sleeps.

``header`` is a small orjson object; ``frame_i`` are raw little-endian arrays read with
``numpy.frombuffer`` (never pickle). Every header field and every frame is validated and bounded
(frame count, byte length, dtype width, value ranges) by the daemon before anything reaches the
manager; a message that fails validation gets an error reply (or, when it is too broken to have a
sequence number, is counted and dropped) and changes nothing.

Request header (client -> daemon), keys kept short because it is parsed on every step::

    {"v": VERSION, "op": <op name>, "s": <session id, 0 before hello>, "q": <sequence number>, ...}

``q`` is a per-session, strictly increasing unsigned integer. The daemon keeps the last reply of
every session; a request that repeats the last ``q`` gets that reply again without being applied
(so a retried ``step`` is applied exactly once); a ``q`` lower than the last one is a ProtocolError.

Reply header (daemon -> client)::

    {"v": VERSION, "q": <seq of the request>, "e": <daemon boot epoch, hex str>, "ok": 1, ...}
    {"v": VERSION, "q": <seq>, "e": <epoch>, "err": <kvd.errors code>, "msg": <text>}

An error reply carries no frames. ``err`` is the ``code`` of a ``kvd.errors`` class; the client raises
``ERROR_BY_CODE[err](msg)``. The boot epoch lets a client notice a restarted daemon
(``DaemonRestarted``).

Rows and ids
============
Requests travel as *session rows* (int32, ``0 <= row < max_reqs_per_session``): the client maps its
own request ids (any str/int) to rows and chooses the row of a new request (admission, allocate,
fork child). The daemon keeps ``session row -> manager row`` in an array and rejects a row that is out
of range, not live (for existing requests) or already live (for new ones) — so a client can only ever
name its own requests. With every new request the client also sends a uint64 ``tag`` (its id's 64-bit
digest) that the daemon publishes in the session's shared memory (``kvd.shm``: row -> tag map).

Hashes are ``S16`` frames (16 bytes per full block; ``S32`` when the daemon serves vLLM's hash
scheme: the hello reply's ``hash_width`` says which), one frame per KV-cache group; with several
requests in one message a parallel int32 "counts" frame says how many hashes belong to each request.

Token ids (optional, only for KV events: kvd.events' ``BlockStored.token_ids``) are int32 frames
after every other frame of a message. A client sends them only when the hello reply's
``kv_events`` is true, so a message without them is byte for byte what it was: the daemon keeps
token ids only when it publishes events (it checks them either way). An admission's are the first
ids of its prompt (at least those of its hashed full blocks); an append's are block_size of group g
per hash of group g, in the order of the hashes.

Ops and their frames (G = number of KV-cache groups of the pool; "hdr" = extra header keys)
===========================================================================================
hello      hdr: tenant (str, <= 256 chars; "" = the peer's own, see kvd.tenancy), name (str),
           pid (int), nonce (str, <= 64 chars), kv_shared (bool, default false: this engine's KV
           memory is shared with the tenant's other sessions, so their prefix caches may be one),
           slots (bool, default true: every reply's slot mapping is written into the session's
           buffers; false: none is, the engine computes its slots from the block tables itself, the
           daemon skips that work and its GPU launch, and replies say nt = 0 for every group),
           gpu (bool, default true: with a GPU pool the daemon mirrors the session's tables, counts
           and slot mappings into device buffers after every reply; false: the engine reads its
           tables from shared memory only, and the daemon neither allocates nor writes them),
           mailbox (bool, default false: the session's binary step ops may travel through a mailbox,
           granted only to a peer of the daemon's uid by a daemon with ``mailbox`` on).
           frames: none. reply hdr: sid, epoch, shm (segment name), layout (dict, see kvd.shm),
           block_sizes, max_reqs, max_blocks, max_tokens, lease_s, hb_s (heartbeat interval),
           tenant (the tenant granted), shared (bool: the session's prefix cache is its tenant's
           shared one; false: a namespace of its own), topic (of its KV events: the tenant, or
           "tenant#N" for a namespace of its own), t (the manager tick), kv_events (bool: the
           daemon publishes KV events, so token ids are worth sending), slots (bool: the session's
           replies write slot mappings), num_groups, windows (each KV-cache group's sliding window
           in tokens, 0: full attention), max_model_len, hash_algo, hash_width (hash_seed with
           vLLM's scheme); with a mailbox granted mb (its segment name), mb_req and mb_rep (its
           request and reply areas' bytes, kvd.mailbox).
           A retried hello (same nonce, same peer uid) returns the same session. A tenant the
           peer's credentials do not open -> Unauthorized.
           With a GPU pool (daemon ``--device cuda:N``, kvd.gpu_session) and hello ``gpu`` not
           false, the reply also carries
           ``gpu``: the CUDA IPC export of the session's device arena, made once per session with
           torch's ``UntypedStorage._share_cuda_()`` (bytes as lowercase hex strings):
             dev   int    the daemon's CUDA device index      uuid  str  that device's UUID (the
                                                                         client maps it to its own
                                                                         index)
             h     hex    cudaIpcMemHandle (storage handle)    sz    int  storage size in bytes
             off   int    storage offset in its allocation     rc    hex  torch ref-counter file
             rco   int    ref-counter offset                   ev    hex|null  IPC event handle
             evs   bool   event sync required
             arrays {name: [byte offset in the storage, dtype ("<i4"/"<i8"), shape]} for
                   ``slots`` [G, max_tokens] int64, ``counts`` [G, max_reqs] int32 and
                   ``table_g`` [max_reqs, max_blocks_g] int32: the same contents as the shared
                   memory's slots, counts_g and table_g after every reply, once ``done`` is reached.
             done  hex    cudaIpcEventHandle of an interprocess event the daemon records after its
                   GPU writes of every reply (it does not wait for them): a reader's stream waits
                   on it (cudaStreamWaitEvent) before reading the arena.
           The client rebuilds the storage with ``torch.UntypedStorage._new_shared_cuda(dev, h, sz,
           off, rc, rco, ev, evs)`` (torch/multiprocessing/reductions.py) once per session and takes
           views with ``Tensor.set_``; dropping them releases torch's cross-process ref count.
           When the daemon owns the KV cache (``kv_cache`` config, kvd.memory) the reply also
           carries ``kv``: {kind: "shm" | "cuda", shape: [layers, 2, num_blocks, block_size,
           kv_heads, head_dim], dtype: "float16" | "bfloat16" | ...}, plus ``name`` (the
           /dev/shm segment, mapped read-write) for "shm" or the IPC fields above (dev, uuid, h,
           sz, off, rc, rco, ev, evs; the whole storage is the pool, row-major) for "cuda".
           Copy-on-write copies and swaps are then done in it before the reply that reports them.
attach     hdr: s (existing sid), epoch. Re-binds a live session (e.g. after the client rebuilt
           its socket). Wrong epoch -> DaemonRestarted; unknown/expired sid -> SessionError; a
           peer of another uid than the session's -> Unauthorized.
step       hdr: la (lookahead tokens, int), an (uniform append token count used when the
           append-counts frame is empty), nf, nk, na, nd (counts of frees, forks, appends, admits),
           c (optional int: the session's confirmation, applied first: the forward passes of its
           calls up to manager tick c have finished; see kvd.manager, the computed state).
           frames after the header (6 + 4G, or 8 + 5G with token ids; trailing empty frames may be
           left out, at least 4 sent), in this order:
             0  free rows            int32[nf]
             1  fork rows            int32[nk, 2]   (parent row, child row)
             2  fork tags            uint64[nk]
             3  append rows          int32[na]
             4  append token counts  int32[na] or empty (then every append adds ``an`` tokens)
             5 .. 5+2G-1  per group g: append hashes S16[*], append hash counts int32[na] or empty
             5+2G  admissions        int64[nd, ADMIT_COLS]  (row, num_tokens, lookahead, priority,
                                      num_encoder_tokens, max_new_tokens, tag as int64)
             6+2G .. 6+4G-1  per group g: admit hashes S16[*], admit hash counts int32[nd]
             6+4G  admit token ids      int32[*]   (optional: each admission's, concatenated)
             7+4G  admit token id counts int32[nd] (0: that admission sent none)
             8+4G .. 8+5G-1  per group g: append token ids int32[block_size_g per append hash]
           Packed form (what kvd's client sends): the same frames concatenated into ONE frame after
           the header, and hdr fl: their byte lengths (a list of 4 to 8+5G ints adding up to that
           frame's length). ZeroMQ costs ~1 µs per frame to send and again to receive: an admission's
           11 frames took ~20 µs more than 2 on the 2-core box. A step sent as separate frames is
           still accepted.
           reply hdr: t (the manager tick of this step: what a later ``c`` confirms), nt
           (slot-mapping tokens written per group, list), nc (copies), nch (changed rows), nfr
           (freed rows), ns (scheduled requests). ONE reply frame, the concatenation of:
             free status int16[nf], fork status int16[nk], append status int16[na],
             admit status int16[nd], admit cached tokens int32[nd], copies int32[nc, 2],
             changed rows int32[nch] (session rows whose block-table rows / counts changed),
             freed rows int32[nfr],
             sched rows int32[ns] (session rows), sched start int32[ns], sched len int32[ns]
           (one frame instead of eight: every ZeroMQ frame costs a few µs on each side).
           The schedule is StepResult.sched_*: the successful appends in batch order, then the
           admissions. Decode step (only append rows and ``an`` sent, one group): the reply frame
           is append status int16[na], copies int32[nc, 2], changed rows int32[nch], sched start
           int32[ns] (nfr = 0): the client already knows the schedule's rows (the append rows
           whose status is OK, all of them when ns == na) and lengths (``an`` each), so only the
           start positions travel (4 bytes per request).
           Block tables, counts and the step's slot mapping (padded with PAD_SLOT_ID) are written
           into shared memory before the reply is sent, and with a GPU pool into the session's GPU
           arena too (the daemon synchronizes its stream before replying). This holds for every op
           that changes tables or counts (allocate, append, free, fork, swap, step).
decode     The decode step again, with a *binary* header instead of JSON (the hot path: a JSON
           header costs both sides ~15 µs of encoding, parsing and per-field checks per step).
           The header frame is ``DECODE_REQUEST`` (little-endian, 40 bytes)::

               magic  4s  DECODE_MAGIC (b"kvD" + version byte; a JSON header starts with "{")
               sid    u64 session id           seq  i64  q (>= 0)
               c      i64 confirmation tick, or NO_CONFIRM (-1)
               na     u32 append rows          an   u32  tokens each   la  u32  lookahead tokens
           frames after it: append rows int32[na]; optionally the hashes of the blocks that filled
           S16[*] and their counts int32[na], one pair per KV-cache group in group order, and
           after those (one group only) optionally the blocks' token ids int32[block_size per
           hash]: 1, 3 or 4 frames with one group, 1 or 1 + 2G with G. Same meaning, checks and
           effects as a ``step`` of appends only. The reply header is ``DECODE_REPLY`` (48 bytes +
           4 per group)::

               magic  4s  DECODE_REPLY_MAGIC   seq  i64  q    epoch  12s  the boot epoch (ASCII)
               t      i64 tick   nc u32 copies   nch u32 changed rows   ns u32 scheduled
               G      u32 groups, then nt int32[G] (slot-mapping tokens written per group)
           and its one body frame is the decode step reply's. Errors are ordinary JSON error
           replies (a client tells them apart by the first byte).
decode_free
           The decode op of a step that also frees requests, before its appends, and may admit
           new ones after them (requests that finished with the last forward, others that take
           their place: the usual step of a serving engine whose requests end at different
           times). The header frame is ``DECODE_FREE_REQUEST`` (48 bytes): the decode op's fields
           with magic DECODE_FREE_MAGIC (b"kvF" + version byte), then
               nf     u32 free rows            nd   u32  admissions
           frames after it, without admissions: free rows int32[nf], append rows int32[na], then
           the decode op's optional hash and count (per group) and token-id frames; with admissions exactly
           ``decode_free_admit_frames(G)`` frames (7 with one group):
           free rows, append rows, per group its append hashes S16[*] and counts int32[na] (all
           empty: none), admissions int64[nd, ADMIT_COLS], per group its admit hashes S16[*] and
           admit hash counts int32[nd] (no token ids: such a step goes as ``step``).
           Same meaning, checks and effects as a ``step`` of those frees, appends and admissions.
           The reply is a ``DECODE_REPLY`` header and one body frame: free status int16[nf], the
           decode op's append status int16[na], with admissions their status int16[nd] and cached
           tokens int32[nd], then copies int32[nc, 2], changed rows int32[nch], sched start
           int32[ns]. The rows freed are the free rows whose status is OK; the schedule is the
           appends whose status is OK (``an`` tokens each), then the admissions whose status is OK
           (from their cached tokens to their num_tokens).
admit      A step that is one admission and nothing else (an idle engine's new request: its time
           to first token), with a *binary* header. The header frame is ``ADMIT_REQUEST``
           (little-endian, 88 bytes)::

               magic  4s  ADMIT_MAGIC (b"kvA" + version byte)
               sid    u64 session id           seq  i64  q (>= 0)
               c      i64 confirmation tick, or NO_CONFIRM (-1)
               la     u32 lookahead tokens (the step's)
               row, num_tokens, lookahead, priority, num_encoder_tokens, max_new_tokens, tag
                      i64 each: the admission's ADMIT_COLS, as a step's admissions frame carries them
           frames after it: per group g the admission's hashes S16[*] (all of them: no counts),
           then optionally its token ids int32[*]. Same meaning, checks and effects as a ``step``
           with that one admission. The reply is a ``DECODE_REPLY`` header (nc = 0) and the step
           reply's frame: admit status int16[1], admit cached tokens int32[1], changed rows
           int32[nch], sched rows int32[ns], sched start int32[ns], sched len int32[ns].
lookup     frames: hashes S16[n] (group 0). reply hdr: n (leading cached blocks).
can_alloc  hdr: nt, la, mnt, net. frames: per group hashes S16. reply hdr: status (AllocStatus).
allocate   hdr: row, tag, nt, la, pri, net, mnt. frames: per group hashes S16, then optionally
           the prompt's token ids int32[*].
           reply hdr: status (AllocStatus: OK, LATER or NEVER, as can_alloc answers), cached, t
           (tick), nt (slot-mapping tokens written per group: the prompt's uncached tokens, from
           ``cached``, written into the slot mapping like a step's). No reply frames: the table is
           in shm.
append     hdr: row, n, la. frames: per group new hashes S16, then optionally per group the
           new blocks' token ids int32[block_size_g per hash].
           reply hdr: status, t, nt (the ``n`` new tokens' slots are written into the slot mapping).
           frames: per group new block ids int32, copies int32[k, 2].
computed   hdr: c (tick). The session's confirmation on its own (see step). reply: ok.
free       frames: rows int32[n]. reply: ok.
fork       hdr: parent, child, tag. reply: ok.
can_swap_out / swap_out / can_swap_in / swap_in
           frames: rows int32[n]. reply hdr: status (AllocStatus; for can_* too), t (swap). frames (swap):
           mapping int32[k, 2].
common_prefix  hdr: row, nr (num_running). reply hdr: n (leading blocks of group 0 held by
           exactly ``nr`` requests, the manager's num_common_prefix_blocks).
cross_table    hdr: row. reply frames: the request's encoder-decoder cross-attention block ids int32.
reset_prefix_cache   resets the session's own namespace. reply hdr: done (bool).
stats      reply hdr: stats (the manager's stats dict plus "sessions", "session_requests").
status     (daemon-wide, for ``kvd status``) reply hdr: status {"daemon": {pid, epoch, lease_s,
           steps}, "pool": manager stats, "sessions": [{name, pid, tenant, requests, idle_s}],
           "tenants": [{tenant, sessions, requests, blocks}]}.
heartbeat  reply: ok. Renews the session's lease (every message does).
goodbye    frees every request of the session, unlinks its shared memory; reply: ok.
"""

from __future__ import annotations

import itertools
import os
import struct
import time
from typing import Any

import numpy as np
import orjson

from kvd.errors import ProtocolError

VERSION = 1

# ---- op names -----------------------------------------------------------------------------------
HELLO = "hello"
ATTACH = "attach"
STEP = "step"
LOOKUP = "lookup"
CAN_ALLOCATE = "can_alloc"
ALLOCATE = "allocate"
APPEND = "append"
FREE = "free"
FORK = "fork"
CAN_SWAP_OUT = "can_swap_out"
SWAP_OUT = "swap_out"
CAN_SWAP_IN = "can_swap_in"
SWAP_IN = "swap_in"
RESET_PREFIX_CACHE = "reset_prefix_cache"
STATS = "stats"
HEARTBEAT = "heartbeat"
GOODBYE = "goodbye"
COMPUTED = "computed"
COMMON_PREFIX = "common_prefix"
CROSS_TABLE = "cross_table"
STATUS = "status"
DECODE = "decode"  # the binary-header decode step (never a JSON "op")
DECODE_FREE = "decode_free"  # the binary-header decode step with frees and admissions (never a JSON "op")
ADMIT = "admit"  # the binary-header lone admission (never a JSON "op")

OPS = frozenset(
    {
        HELLO, ATTACH, STEP, LOOKUP, CAN_ALLOCATE, ALLOCATE, APPEND, FREE, FORK, CAN_SWAP_OUT,
        SWAP_OUT, CAN_SWAP_IN, SWAP_IN, RESET_PREFIX_CACHE, STATS, HEARTBEAT, GOODBYE, COMPUTED,
        COMMON_PREFIX, CROSS_TABLE, STATUS,
    }
)
SESSIONLESS_OPS = frozenset({HELLO})

# ---- bounds -------------------------------------------------------------------------------------
MAX_HEADER_BYTES = 4096
MAX_FRAMES = 64
MAX_STR = 256
MAX_INT = (1 << 62) - 1
MAX_COUNT = (1 << 31) - 1  # token counts: values beyond this are malformed; the manager judges the rest
HASH_WIDTH = 16
HASH_DTYPE = np.dtype("S16")
ADMIT_COLS = 7  # row, num_tokens, lookahead, priority, num_encoder_tokens, max_new_tokens, tag

I16 = np.dtype("<i2")
I32 = np.dtype("<i4")
I64 = np.dtype("<i8")
U64 = np.dtype("<u8")

EMPTY = b""


def step_frame_count(num_groups: int, token_ids: bool = False) -> int:
    """Frames of a step request after the header (``token_ids``: with the optional token-id frames)."""
    return 6 + 4 * num_groups + (2 + num_groups if token_ids else 0)


# ---- encoding -----------------------------------------------------------------------------------

def dumps(obj: dict) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


def request(op: str, sid: int, seq: int, **fields: Any) -> bytes:
    h = {"v": VERSION, "op": op, "s": sid, "q": seq}
    h.update(fields)
    return dumps(h)


def ok_reply(seq: int, epoch: str, **fields: Any) -> bytes:
    h = {"v": VERSION, "q": seq, "e": epoch, "ok": 1}
    h.update(fields)
    return dumps(h)


def error_reply(seq: int | None, epoch: str, code: int, msg: str) -> bytes:
    return dumps({"v": VERSION, "q": seq, "e": epoch, "err": int(code), "msg": str(msg)[:1024]})


def arr(a: Any, dtype: np.dtype) -> bytes:
    """Array -> frame bytes (contiguous, little-endian, of ``dtype``)."""
    if a is None or not len(a):  # most of a step reply's parts are empty
        return EMPTY
    return np.ascontiguousarray(a, dtype=dtype).tobytes()


def hashes_frame(h: Any, width: int = HASH_WIDTH) -> bytes:
    """Block hashes (S{width} array, (n, width) uint8 array, list of width-byte values, or ()) ->
    frame bytes. Raises kvd.errors.BadHashes for anything else."""
    if h is None:
        return EMPTY
    if isinstance(h, np.ndarray) and h.dtype.kind == "S" and h.dtype.itemsize == width and h.ndim == 1:
        return h.tobytes()
    if isinstance(h, (tuple, list)) and not h or isinstance(h, np.ndarray) and not h.size:
        return EMPTY  # no hashes, whatever the empty array's type (as the manager takes them)
    from kvd.hashing import as_hash_array

    return as_hash_array(h, width).tobytes()


# ---- the decode op's binary headers --------------------------------------------------------------

DECODE_MAGIC = b"kvD" + bytes([VERSION])
DECODE_REPLY_MAGIC = b"kvR" + bytes([VERSION])
NO_CONFIRM = -1
EPOCH_BYTES = 12  # the daemon's boot epoch: 12 hex digits
DECODE_REQUEST = struct.Struct("<4sQqqIII")
DECODE_FIELDS = ("c", "na", "an", "la")
"""The decode header's fields after magic, sid and seq, in order (the client keeps them as a tuple)."""
DECODE_REPLY = struct.Struct(f"<4sq{EPOCH_BYTES}sqIIII")
MAX_GROUPS = 64
_NT: dict[int, struct.Struct] = {}


def _nt(groups: int) -> struct.Struct:
    fmt = _NT.get(groups)
    if fmt is None:
        fmt = _NT[groups] = struct.Struct(f"<{groups}i")
    return fmt


def decode_request(sid: int, seq: int, na: int, an: int, la: int, c: int | None = None) -> bytes:
    return DECODE_REQUEST.pack(DECODE_MAGIC, sid, seq, NO_CONFIRM if c is None else c, na, an, la)


def parse_decode_request(raw: bytes) -> tuple[int, int, int, int, int, int]:
    """(sid, seq, c or NO_CONFIRM, na, an, la) of a decode header; ranges are the caller's to check
    (every field is an integer by construction)."""
    if len(raw) != DECODE_REQUEST.size:
        raise ProtocolError(f"decode header of {len(raw)} bytes, expected {DECODE_REQUEST.size}")
    _, sid, seq, c, na, an, la = DECODE_REQUEST.unpack(raw)
    _check_decode_fields("decode", sid, seq, c, an, la)
    return sid, seq, c, na, an, la


def _check_decode_fields(op: str, sid: int, seq: int, c: int, an: int, la: int) -> None:
    if seq < 0 or not 0 < sid <= MAX_INT or not NO_CONFIRM <= c <= MAX_INT:
        raise ProtocolError(f"{op} header: session, sequence number or confirmation out of range")
    if an > MAX_COUNT or la > MAX_COUNT:
        raise ProtocolError(f"{op} header: token count out of range")


def decode_reply(seq: int, epoch: bytes, tick: int, nc: int, nch: int, ns: int, nt: list[int]) -> bytes:
    return DECODE_REPLY.pack(DECODE_REPLY_MAGIC, seq, epoch, tick, nc, nch, ns, len(nt)) + _nt(len(nt)).pack(*nt)


def unpack_decode_reply(raw: bytes) -> tuple[int, bytes, int, int, int, int, list[int]]:
    """(seq, epoch bytes, tick, nc, nch, ns, nt) of a ``DECODE_REPLY`` header (the magic is the
    caller's to have checked): a tuple, which the blocking client's decode lane reads as is."""
    if len(raw) < DECODE_REPLY.size:
        raise ProtocolError("short decode reply header")
    _, seq, epoch, tick, nc, nch, ns, G = DECODE_REPLY.unpack_from(raw)
    if not 0 < G <= MAX_GROUPS or len(raw) != DECODE_REPLY.size + 4 * G:
        raise ProtocolError("decode reply header: bad group count")
    return seq, epoch, tick, nc, nch, ns, list(_nt(G).unpack_from(raw, DECODE_REPLY.size))


DECODE_FREE_MAGIC = b"kvF" + bytes([VERSION])
DECODE_FREE_REQUEST = struct.Struct("<4sQqqIIIII")
DECODE_FREE_FIELDS = (*DECODE_FIELDS, "nf", "nd")
"""The decode_free header's fields after magic, sid and seq: the decode op's, then the free and
admission counts."""
def decode_free_admit_frames(num_groups: int) -> int:
    """Frames of a decode_free step with admissions (empty ones included): free rows, append rows,
    each group's append hashes and counts, the admissions, each group's admit hashes and counts
    (7 with one group)."""
    return 3 + 4 * num_groups


def parse_decode_free_request(raw: bytes) -> tuple[int, int, int, int, int, int, int, int]:
    """(sid, seq, c or NO_CONFIRM, na, an, la, nf, nd) of a decode_free header (ranges of na, nf
    and nd are the caller's to check)."""
    if len(raw) != DECODE_FREE_REQUEST.size:
        raise ProtocolError(f"decode_free header of {len(raw)} bytes, expected {DECODE_FREE_REQUEST.size}")
    _, sid, seq, c, na, an, la, nf, nd = DECODE_FREE_REQUEST.unpack(raw)
    _check_decode_fields("decode_free", sid, seq, c, an, la)
    return sid, seq, c, na, an, la, nf, nd


ADMIT_MAGIC = b"kvA" + bytes([VERSION])
ADMIT_REQUEST = struct.Struct("<4sQqqI7q")


def parse_admit_request(raw: bytes) -> tuple[int, int, int, int, tuple]:
    """(sid, seq, c or NO_CONFIRM, la, the admission's ADMIT_COLS) of an admit header; the
    admission's ranges are the caller's to check."""
    if len(raw) != ADMIT_REQUEST.size:
        raise ProtocolError(f"admit header of {len(raw)} bytes, expected {ADMIT_REQUEST.size}")
    _, sid, seq, c, la, *cols = ADMIT_REQUEST.unpack(raw)
    if seq < 0 or not 0 < sid <= MAX_INT or not NO_CONFIRM <= c <= MAX_INT:
        raise ProtocolError("admit header: session, sequence number or confirmation out of range")
    if la > MAX_COUNT:
        raise ProtocolError("admit header: token count out of range")
    return sid, seq, c, la, cols


def parse_reply(raw: bytes) -> dict:
    """A reply header (JSON, or a decode reply) as a dict; raises ProtocolError when it is neither."""
    if raw[:4] == DECODE_REPLY_MAGIC:
        seq, epoch, tick, nc, nch, ns, nt = unpack_decode_reply(raw)
        return {"v": VERSION, "q": seq, "e": epoch.decode("ascii"), "ok": 1, "t": tick, "nt": nt, "nc": nc,
                "nch": nch, "nfr": 0, "ns": ns}
    return _json_object(raw, "reply header")


def _json_object(raw: bytes, what: str) -> dict:
    try:
        h = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ProtocolError(f"{what} is not JSON: {e}") from None
    if not isinstance(h, dict):
        raise ProtocolError(f"{what} is not an object")
    return h


# ---- decoding / validation (daemon and client side) ---------------------------------------------

def parse_header(raw: bytes) -> dict:
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes > {MAX_HEADER_BYTES}")
    h = _json_object(raw, "header")
    if h.get("v") != VERSION:
        raise ProtocolError(f"protocol version {h.get('v')!r} != {VERSION}")
    return h


def get_int(h: dict, key: str, default: int | None = None, lo: int = 0, hi: int = MAX_INT) -> int:
    v = h.get(key, default)
    if v is None:
        raise ProtocolError(f"missing header field {key!r}")
    if type(v) is not int:  # bool is not accepted either
        raise ProtocolError(f"header field {key!r} must be an int")
    if v < lo or v > hi:
        raise ProtocolError(f"header field {key!r}={v} out of range [{lo}, {hi}]")
    return v


def get_str(h: dict, key: str, default: str | None = None, maxlen: int = MAX_STR) -> str:
    v = h.get(key, default)
    if v is None:
        raise ProtocolError(f"missing header field {key!r}")
    if not isinstance(v, str) or len(v) > maxlen:
        raise ProtocolError(f"header field {key!r} must be a str of <= {maxlen} chars")
    return v


_LENS: dict[tuple[int, int], np.ndarray] = {}


def uniform_lens(n: int, value: int) -> np.ndarray:
    """A read-only int32 array of ``n`` times ``value``, shared by every decode step of that shape
    (each token count of a decode op's schedule, on both sides; np.full costs ~1-4 µs, a dict hit
    ~0.1 µs)."""
    a = _LENS.get((n, value))
    if a is None:
        if len(_LENS) > 256:
            _LENS.clear()
        a = np.empty(n, np.int32)
        a.fill(value)
        a.flags.writeable = False
        _LENS[(n, value)] = a
    return a


def frame_array(buf: bytes, dtype: np.dtype, n: int | None = None, name: str = "frame",
                max_n: int | None = None) -> np.ndarray:
    """Frame bytes -> read-only 1-D array of ``dtype``; checks the width (and length ``n``)."""
    size = dtype.itemsize
    if len(buf) % size:
        raise ProtocolError(f"{name}: {len(buf)} bytes is not a multiple of {size}")
    count = len(buf) // size
    if n is not None and count != n:
        raise ProtocolError(f"{name}: {count} items, expected {n}")
    if max_n is not None and count > max_n:
        raise ProtocolError(f"{name}: {count} items > {max_n}")
    return np.frombuffer(buf, dtype=dtype)


def frame_hashes(buf: bytes, name: str = "hashes", max_n: int | None = None,
                 dtype: np.dtype = HASH_DTYPE) -> np.ndarray:
    return frame_array(buf, dtype, None, name, max_n)


EMPTY_I16_RO = np.empty(0, I16)
"""The one read-only empty int16 array of a reply's absent parts (client and ``split_step_reply``)."""
EMPTY_I32_RO = np.empty(0, I32)
"""The one read-only empty int32 array of a reply's absent parts."""
EMPTY_I16_RO.flags.writeable = False
EMPTY_I32_RO.flags.writeable = False


def split_step_reply(body: bytes, nf: int, nk: int, na: int, nd: int, nc: int, nch: int, nfr: int, ns: int):
    """The step reply's body frame -> (free_st, fork_st, append_st, admit_st, cached, copies,
    changed, freed, sched_rows, sched_start, sched_len) arrays (read-only views, no copy)."""
    sizes = (2 * nf, 2 * nk, 2 * na, 2 * nd, 4 * nd, 8 * nc, 4 * nch, 4 * nfr, 4 * ns, 4 * ns, 4 * ns)
    if sum(sizes) != len(body):
        raise ProtocolError(f"step reply body of {len(body)} bytes, expected {sum(sizes)}")
    out = []
    off = 0
    counts = (nf, nk, na, nd, nd, 2 * nc, nch, nfr, ns, ns, ns)
    for dt, n, size in zip((I16, I16, I16, I16, I32, I32, I32, I32, I32, I32, I32), counts, sizes):
        # a small step leaves most parts empty: one shared read-only empty array each (no view)
        out.append(np.frombuffer(body, dt, n, off) if n else (EMPTY_I16_RO if dt is I16 else EMPTY_I32_RO))
        off += size
    out[5] = out[5].reshape(nc, 2)
    return out


def within(values: np.ndarray, lo: int, hi) -> bool:
    """Every value in [lo, hi] (``hi``: one bound, or one per column of a 2-D array). A message
    names a few rows: Python over a list beats numpy's reductions (~4 µs each) up to ~64 values."""
    if values.size > 64:
        return not ((values < lo) | (values > hi)).any()
    vals = values.tolist()
    if values.ndim == 1:
        return not vals or (lo <= min(vals) and max(vals) <= hi)
    his = hi if isinstance(hi, (list, tuple)) else [hi] * values.shape[1]
    return all(lo <= v <= h for row in vals for v, h in zip(row, his))


def pack_frames(frames: list[bytes]) -> tuple[list[int], bytes]:
    """A step's frames -> (their byte lengths, their concatenation): the packed step (see "step")."""
    return [len(f) for f in frames], b"".join(frames)


def unpack_frames(lengths: Any, frames: list[bytes], most: int) -> list[bytes]:
    """A packed step's frames: its one body frame cut at ``lengths`` (the header's ``fl``), checked:
    4 to ``most`` non-negative ints adding up to the body's length."""
    if len(frames) != 1:
        raise ProtocolError(f"packed step: {len(frames)} frames after the header, expected 1")
    body = frames[0]
    ok = type(lengths) is list and 4 <= len(lengths) <= most
    out, end = [], 0
    for n in lengths if ok else ():  # one pass: checked and cut (a bool is not a length)
        if type(n) is not int or n < 0:
            ok = False
            break
        out.append(body[end: end + n])
        end += n
    if not ok or end != len(body):
        raise ProtocolError(f"packed step: fl must be 4 to {most} byte lengths adding up to the body's {len(body)}")
    return out


def split_counts(values: np.ndarray, counts: np.ndarray, what: str = "hash") -> list[np.ndarray]:
    """Split a concatenated array (hashes, token ids) by per-request counts (validated: >= 0,
    sum == len; ``what`` names the values in the error).

    In Python over a list: a message admits a few requests, and numpy's reductions cost ~4 µs
    each on arrays that small (np.split ~10x more)."""
    sizes = counts.tolist()
    ends = list(itertools.accumulate(sizes))
    if sizes and min(sizes) < 0:
        raise ProtocolError(f"negative {what} count")
    if (ends[-1] if ends else 0) != values.shape[0]:
        raise ProtocolError(f"{what} counts do not add up to the number of values")
    return [values[start:end] for start, end in zip([0, *ends[:-1]], ends)]


# ---- fast ZeroMQ I/O ----------------------------------------------------------------------------
# pyzmq's sugar (send_multipart/recv_multipart, enum flags) costs ~10 µs a message on this path; the
# Cython socket methods with int flags cost ~2 µs. Fall back to the sugar if the layout changes.

import zmq as _zmq

NOBLOCK = int(_zmq.NOBLOCK)
SNDMORE = int(_zmq.SNDMORE)
try:
    from zmq.backend.cython._zmq import Socket as _CSocket  # type: ignore

    _csend = _CSocket.send
    _crecv = _CSocket.recv
    _cget = _CSocket.get
except Exception:  # pragma: no cover - other pyzmq backends
    _csend = _crecv = _cget = None
_EVENTS = int(_zmq.EVENTS)
_POLLIN = int(_zmq.POLLIN)


def has_input(sock) -> bool:
    """True when a whole message can be received now (ZMQ_EVENTS & POLLIN). Also re-arms the
    socket's edge-triggered FD, like a receive that fails with EAGAIN, at a quarter of the cost
    (pyzmq builds an exception object for every EAGAIN: ~8 us here)."""
    if _cget is None:
        return bool(sock.getsockopt(_EVENTS) & _POLLIN)
    return bool(_cget(sock, _EVENTS) & _POLLIN)


def busy_poll(sock, seconds: float) -> None:
    """Wait up to ``seconds`` for a whole message by polling ``has_input``, yielding the CPU each
    turn: a thread that sleeps in recv pays the wake-up (tens to hundreds of µs on a cloud host)
    on every message. The caller then receives (blocking, should the time have run out)."""
    end = time.perf_counter() + seconds
    pc, yield_cpu = time.perf_counter, os.sched_yield
    while not has_input(sock) and pc() < end:
        yield_cpu()


def send_frames(sock, frames: list, flags: int = 0) -> None:
    """Send a multipart message (raises zmq.Again with NOBLOCK when the queue is full)."""
    if _csend is None:
        sock.send_multipart(frames, flags)
        return
    last = len(frames) - 1
    more = flags | SNDMORE
    for i, f in enumerate(frames):
        _csend(sock, f, more if i < last else flags)


def recv_message(sock, flags: int = 0) -> tuple[list[bytes], Any]:
    """Like ``recv_frames``, plus the first frame as a ``zmq.Frame``: on a ROUTER that is the peer
    identity, whose ``Peer-Address`` property carries an ipc peer's credentials (kvd.tenancy)."""
    if _crecv is None:
        frames = sock.recv_multipart(flags, copy=False)
        return [f.bytes for f in frames], frames[0]
    first = f = _crecv(sock, flags, False)
    parts = [f.bytes]
    while f.more:
        f = _crecv(sock, flags, False)
        parts.append(f.bytes)
    return parts, first


def recv_frames(sock, flags: int = 0) -> list[bytes]:
    """Receive a whole multipart message as a list of bytes (raises zmq.Again with NOBLOCK)."""
    if _crecv is None:
        return sock.recv_multipart(flags)
    f = _crecv(sock, flags, False)
    parts = [f.bytes]
    while f.more:
        f = _crecv(sock, flags, False)
        parts.append(f.bytes)
    return parts
