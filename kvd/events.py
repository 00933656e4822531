"""KV cache events for routers, byte-for-byte in vLLM 0.33.0's wire format (``kv_events_endpoint``).

A ZeroMQ PUB socket; each message is three frames, as vLLM's ``ZmqEventPublisher`` sends them::

    topic     ``kv_events_topic`` with "{tenant}" replaced by the tenant the events belong to (utf-8;
              "" for the default tenant). Subscribers filter by prefix; vLLM's own subscriber
              subscribes to "" or to its fixed topic, so the default "{tenant}" keeps each tenant's
              namespace apart while an "every topic" subscriber sees all of them.
    seq       uint64, big-endian, one sequence over all topics starting at 0 (a gap means lost messages)
    payload   msgpack of vLLM's ``KVEventBatch`` exactly as ``msgspec.msgpack.Encoder`` writes it:
                [ts: float64 (unix seconds), [event, ...], data_parallel_rank: int]
              each event a map whose first key is the tag "type", then the fields in vLLM's
              declaration order; fields with a default are omitted when equal to it:
                BlockStored       map16 header (the struct has 16 keys in all, so msgspec reserves a
                                  map16 even when it writes fewer): block_hashes, parent_block_hash,
                                  token_ids, block_size, lora_id (nil), medium ("GPU"), lora_name,
                                  group_idx, kv_cache_spec_kind ("full_attention" or
                                  "sliding_window", as vLLM's KVCacheManager annotates them),
                                  kv_cache_spec_sliding_window (the window, sliding groups only)
                BlockRemoved      block_hashes (one hash, as vLLM emits them), medium, group_idx
                AllBlocksCleared  no fields

Hashes (``block_hashes``, ``parent_block_hash``) are published as vLLM 0.33 does by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the uint64 ``int.from_bytes(hash, "big") & (2**64 - 1)``,
i.e. the hash's last 8 bytes read big-endian (``kv_events_int_hashes``, default on). With it off,
the full-width hash of the daemon's scheme (16 bytes by default, 32 for vLLM's: kvd.hashing) is
published as msgpack bin, as vLLM does with that variable set to 0. The pool keeps hashes as numpy
``S`` items, which strip trailing zero bytes, so they are padded back to full width first.

A BlockStored lists, as vLLM's do, one request's blocks stored by one call, in chain order, with
``parent_block_hash`` = the hash of the block before the first of them in that request (nil for a
request's first block) and ``token_ids`` = those blocks' token ids (block_size per block) when the
engine supplied them, else [] (kvd.runs; ``BlockManager.enable_kv_events``). A pool ``event_log``
entry ``("stored", key, hashes[, parent, token_ids])`` carries them; ``lora_name`` / ``extra_keys``
are not sent. A tenant's prefix-cache reset is an AllBlocksCleared on its topic.

Replay (``kv_events_replay_endpoint``): a ROUTER socket, as vLLM's. A subscriber (a DEALER or REQ)
sends ``[b"", start_seq (8 bytes big-endian)]``; it gets back every buffered message with
``seq >= start_seq`` as ``[b"", topic, seq, payload]`` and then the end marker
``[b"", b"", (-1 as 8 bytes big-endian, signed), b""]``. The buffer holds the last
``kv_events_buffer_steps`` messages (vLLM's ``buffer_steps``); the ROUTER's send high-water mark is
``2 * (buffer_steps + 1)`` so a whole replay and its marker always fit.

Events are published after the reply that caused them, without blocking: a slow subscriber loses
messages at the PUB socket's high-water mark (vLLM's ``hwm``), which the replay socket repairs. The
daemon runs this publisher in its events worker process (kvd.eventworker), so one PUB message may
carry the events of several of the daemon's messages (those that arrived within a few ms).
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import msgpack
import numpy as np
import zmq

from kvd import eventpack
from kvd.runs import NO_PARENT, NO_TOKENS, Runs

MEDIUM = "GPU"
SEND_HWM = 100_000  # vLLM's default ``hwm``
BUFFER_STEPS = 10_000  # vLLM's default ``buffer_steps``
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's replay end marker
TENANT_FIELD = "{tenant}"

_MAP16 = b"\xde"
_FIXARRAY3 = b"\x93"
_pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack
# Constant key/value runs, packed once.
_STORED_TYPE = _pack("type") + _pack("BlockStored") + _pack("block_hashes")
_PARENT = _pack("parent_block_hash")
_TOKENS = _pack("token_ids")
_NO_PARENT_NO_TOKENS = _PARENT + _pack(None) + _TOKENS + _pack([])
_SIZE = _pack("block_size")
_LORA_MEDIUM = _pack("lora_id") + _pack(None) + _pack("medium") + _pack(MEDIUM)
_LORA_NAME = _pack("lora_name")
_GROUP = _pack("group_idx")
_KIND = _pack("kv_cache_spec_kind")
_WINDOW = _pack("kv_cache_spec_sliding_window")
FULL_ATTENTION = "full_attention"  # vLLM's KVCacheSpecKind values of kvd's two kinds of group
SLIDING_WINDOW = "sliding_window"
_REMOVED_TAG = b"\x84" + _pack("type") + _pack("BlockRemoved") + _pack("block_hashes")
_MEDIUM = _pack("medium") + _pack(MEDIUM)
_CLEARED = b"\x81" + _pack("type") + _pack("AllBlocksCleared")


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


@functools.lru_cache(maxsize=256)
def _stored_ends(block_size: int, group: int, lora_name: str | None, kind: str | None,
                 window: int | None) -> tuple[bytes, bytes]:
    """A BlockStored's constant parts per block size and group: the map header and type (the map
    counts the fields written: msgspec omits those at their default None) and every field after
    token_ids."""
    count = 9 + (kind is not None) + (window is not None)
    tail = [_SIZE, _pack(block_size), _LORA_MEDIUM, _LORA_NAME, _pack(lora_name), _GROUP, _pack(group)]
    if kind is not None:
        tail += [_KIND, _pack(kind)]
    if window is not None:
        tail += [_WINDOW, _pack(window)]
    return _MAP16 + count.to_bytes(2, "big") + _STORED_TYPE, b"".join(tail)


def encode_block_stored(hashes: list[bytes | int], block_size: int, group: int, parent: bytes | int | None = None,
                        token_ids=None, lora_name: str | None = None, kind: str | None = None,
                        window: int | None = None) -> bytes:
    """One BlockStored event (hashes at full width; ``token_ids`` a list or an int array; ``kind``
    and ``window``: vLLM's kv_cache_spec_kind / kv_cache_spec_sliding_window of the group)."""
    if parent is None and token_ids is None:
        middle = _NO_PARENT_NO_TOKENS
    else:
        if isinstance(token_ids, np.ndarray):
            token_ids = token_ids.ravel().tolist()
        middle = b"".join((_PARENT, _pack(parent), _TOKENS, _pack(token_ids or [])))
    head, tail = _stored_ends(block_size, group, lora_name, kind, window)
    return b"".join((head, _pack(hashes), middle, tail))


def encode_block_removed(block_hash: bytes | int, group: int) -> bytes:
    return b"".join((_REMOVED_TAG, b"\x91", _pack(block_hash), _MEDIUM, _GROUP, _pack(group)))


def encode_all_cleared() -> bytes:
    return _CLEARED


def encode_batch(ts: float, events: list[bytes], data_parallel_rank: int = 0, count: int | None = None) -> bytes:
    """A KVEventBatch payload around already encoded events (``count``: how many, when an item of
    ``events`` holds several)."""
    n = len(events) if count is None else count
    return b"".join((_FIXARRAY3, _pack(float(ts)), _array_header(n), *events, _pack(data_parallel_rank)))


class KvEventPublisher:
    """Publishes what the pool's ``event_log`` recorded. ``describe(cache_key)`` gives the tenant,
    block size and KV-cache group of a prefix-cache key; ``group_windows[g]``: group g's sliding
    window (None: full attention), sent as vLLM's KVCacheManager annotates its BlockStored
    (``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``; not sent when not given)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, describe: Callable[[int], tuple[str, int, int]], *,
                 hash_width: int = 16, replay_endpoint: str = "", buffer_steps: int = BUFFER_STEPS,
                 topic: str = TENANT_FIELD, data_parallel_rank: int = 0, hwm: int = SEND_HWM,
                 int_hashes: bool = True, group_windows: Sequence[int | None] | None = None):
        self.describe = describe
        self.specs = None if group_windows is None else [
            (FULL_ATTENTION, None) if not w else (SLIDING_WINDOW, int(w)) for w in group_windows]
        self.hash_width = hash_width
        self.int_hashes = int_hashes
        self.external = _int_hash(hash_width) if int_hashes else _full_hash(hash_width)
        self.topic = topic
        self.dp_rank = data_parallel_rank
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.bind(endpoint)
        self.seq = 0
        self.dropped = 0
        self.buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_steps)
        self._replay: _ReplayServer | None = None
        if replay_endpoint:
            try:
                self._replay = _ReplayServer(ctx, replay_endpoint, self.buffer, buffer_steps)
            except zmq.ZMQError:
                self.sock.close(0)
                raise

    def _topic(self, tenant: str) -> bytes:
        return self.topic.replace(TENANT_FIELD, tenant).encode()

    def _encode(self, entry: tuple, described: tuple[str, int, int]) -> tuple[bytes, int]:
        """An event log entry as encoded events: (their bytes, how many)."""
        kind, hashes = entry[0], entry[2]
        _, block_size, group = described
        spec_kind, window = (None, None) if self.specs is None else self.specs[group]
        if kind == "runs":
            return self._encode_runs(hashes, entry[3], block_size, group, spec_kind, window)
        if kind == "stored":
            parent = entry[3] if len(entry) > 3 else None
            tokens = entry[4] if len(entry) > 4 else None
            return encode_block_stored(self.external_all(hashes), block_size, group,
                                       None if parent is None else self.external(parent), tokens, None,
                                       spec_kind, window), 1
        if kind == "removed":
            return b"".join(encode_block_removed(h, group) for h in self.external_all(hashes)), len(hashes)
        return encode_all_cleared(), 1

    def _encode_runs(self, hashes: np.ndarray, runs: Runs, block_size: int, group: int, spec_kind, window):
        """One BlockStored per unbroken run piece (kvd.runs), every field vectorized (kvd.eventpack)."""
        hashes = np.asarray(hashes, f"S{self.hash_width}")
        starts = runs.starts(hashes)
        n = starts.size
        counts = np.diff(np.append(starts, hashes.size))
        parents = runs.parent[starts]
        has_parent = parents != NO_PARENT
        if runs.tokens is None:
            tok_counts = np.zeros(n, np.int64)
            tok_part = (np.empty(0, np.uint8), np.empty(0, np.int64))
        else:
            known = runs.tokens[starts, 0] != NO_TOKENS
            tok_counts = counts * block_size * known
            tok_part = eventpack.ints(runs.tokens[np.repeat(known, counts)])
        head, tail = _stored_ends(block_size, group, None, spec_kind, window)
        columns = [head, eventpack.array_headers(counts), eventpack.grouped(self._packed_hashes(hashes), counts),
                   _PARENT, eventpack.optional(has_parent, self._packed_hashes(parents[has_parent])),
                   _TOKENS, eventpack.array_headers(tok_counts), eventpack.grouped(tok_part, tok_counts), tail]
        return eventpack.join(n, columns), n

    def _packed_hashes(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """msgpack of hashes in their published form (kvd.eventpack's (bytes, lengths))."""
        w = self.hash_width
        raw = np.ascontiguousarray(hashes, f"S{w}").view(np.uint8).reshape(-1, w)
        if not self.int_hashes:
            return eventpack.bins(raw)
        return eventpack.ints(np.ascontiguousarray(raw[:, w - 8 :]).view(">u8").ravel())

    def external_all(self, hashes: list[bytes]) -> list:
        """Many hashes in their published form, in a few numpy calls (the S dtype re-pads them)."""
        if len(hashes) < 8:
            return list(map(self.external, hashes))
        w = self.hash_width
        arr = np.array(hashes, f"S{w}")
        if not self.int_hashes:
            raw = arr.tobytes()
            return [raw[i : i + w] for i in range(0, len(raw), w)]
        return np.ascontiguousarray(arr.view(np.uint8).reshape(-1, w)[:, w - 8 :]).view(">u8").ravel().tolist()

    def publish(self, log: list[tuple]) -> None:
        """Send the logged changes, one message per topic, and empty the log."""
        if not log:
            return
        batches: dict[str, list] = {}  # tenant -> [encoded parts, number of events]
        described: dict[int, tuple[str, int, int]] = {}  # one lookup per key, not per entry
        for entry in _merged(log):
            key = entry[1]
            d = described.get(key)
            if d is None:
                d = described[key] = self.describe(key)
            encoded, count = self._encode(entry, d)
            batch = batches.get(d[0])
            if batch is None:
                batch = batches[d[0]] = [[], 0]
            batch[0].append(encoded)
            batch[1] += count
        log.clear()
        now = time.time()
        for tenant, (parts, count) in batches.items():
            self.send(self._topic(tenant), encode_batch(now, parts, self.dp_rank, count))

    def send(self, topic: bytes, payload: bytes) -> None:
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, topic, payload))
        try:
            self.sock.send_multipart([topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    def close(self) -> None:
        if self._replay is not None:
            self._replay.stop()
        self.sock.close(0)


def _merged(log: list[tuple]) -> list[tuple]:
    """The log with consecutive "runs" entries of one key joined (one encoding for all of them;
    their runs stay apart: each starts a run, or continues the chain of the entry before it,
    e.g. a confirmation spread over several messages)."""
    out: list = []
    for entry in log:
        last = out[-1] if out else None
        if entry[0] == "runs" and last is not None and last[0] == "runs" and last[1] == entry[1]:
            if isinstance(last[2], np.ndarray):
                out[-1] = last = ("runs", last[1], [last[2]], [last[3]])
            last[2].append(entry[2])
            last[3].append(entry[3])
        else:
            out.append(entry)
    return [("runs", e[1], np.concatenate(e[2]), Runs.concat(e[3])) if e[0] == "runs" and isinstance(e[2], list)
            else e for e in out]


def _full_hash(width: int) -> Callable[[bytes], bytes]:
    return lambda h: h.ljust(width, b"\0")


def _int_hash(width: int) -> Callable[[bytes], int]:
    """vLLM's ``maybe_convert_block_hash``: the low 64 bits of the big-endian hash."""
    def convert(h: bytes) -> int:
        return int.from_bytes(h.ljust(width, b"\0")[width - 8 :], "big")

    return convert


class _ReplayServer:
    """vLLM's replay ROUTER, served by its own thread so a long replay never delays a step. The
    thread only reads the buffer: ``list(deque)`` copies it while holding the GIL, so appends from
    the daemon's loop never interleave with the copy."""

    POLL_MS = 100

    def __init__(self, ctx: zmq.Context, endpoint: str, buffer: deque, buffer_steps: int):
        self.buffer = buffer
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError:
            self.sock.close(0)
            raise
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="kvd-events-replay", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock = self.sock
        while self._running:
            if not sock.poll(self.POLL_MS):
                continue
            frames = sock.recv_multipart()
            if len(frames) != 3:  # vLLM logs and ignores a malformed request
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, topic, payload in list(self.buffer):
                if seq >= start_seq:
                    sock.send_multipart([client, b"", topic, seq.to_bytes(8, "big"), payload])
            sock.send_multipart([client, b"", b"", END_SEQ, b""])

    def stop(self) -> None:
        self._running = False
        self._thread.join(2 * self.POLL_MS / 1000 + 1)
        self.sock.close(0)
