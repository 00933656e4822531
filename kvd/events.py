"""KV cache events for routers, in vLLM's wire format (``kv_events_endpoint``).

A ZeroMQ PUB socket; each message is three frames::

    topic     the tenant the events belong to (utf-8; "" for the default tenant): subscribers
              filter by prefix, and each tenant's prefixes live in their own namespace
    seq       uint64, big-endian, one sequence over all topics (a gap means messages were lost)
    payload   msgpack of vLLM's KVEventBatch (msgspec array_like structs, omitted defaults):
                [ts: float (unix seconds), [event, ...]]
              event, tagged by its class name:
                ["BlockStored", [hash, ...], parent_hash: null, token_ids: [], block_size, lora_id: null, "GPU"]
                ["BlockRemoved", [hash, ...], "GPU"]
                ["AllBlocksCleared"]

Hashes are kvd's 16-byte block hashes (msgpack bin), the ones the engines computed; a BlockStored
lists the blocks of one registration in chain order. kvd never sees token ids, so ``token_ids`` is
empty and ``parent_block_hash`` null. A tenant's prefix-cache reset is an AllBlocksCleared on its
topic. Events are published after the reply that caused them, without blocking (a slow subscriber
loses messages at the socket's high-water mark, as with vLLM's publisher).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgpack
import zmq

MEDIUM = "GPU"
SEND_HWM = 100_000


class KvEventPublisher:
    """Publishes what the pool's ``event_log`` recorded. ``describe(cache_key)`` gives the topic
    and the block size of a prefix-cache key."""

    def __init__(self, ctx: zmq.Context, endpoint: str, describe: Callable[[int], tuple[str, int]]):
        self.describe = describe
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.sock.bind(endpoint)
        self.seq = 0
        self.dropped = 0

    def publish(self, log: list[tuple[str, int, list[bytes]]]) -> None:
        """Send the logged changes, one message per topic, and empty the log."""
        if not log:
            return
        batches: dict[str, list] = {}
        for kind, key, hashes in log:
            topic, block_size = self.describe(key)
            if kind == "stored":
                event = ["BlockStored", hashes, None, [], block_size, None, MEDIUM]
            elif kind == "removed":
                event = ["BlockRemoved", hashes, MEDIUM]
            else:
                event = ["AllBlocksCleared"]
            batches.setdefault(topic, []).append(event)
        log.clear()
        now = time.time()
        for topic, events in batches.items():
            frames = [topic.encode(), self.seq.to_bytes(8, "big"), msgpack.packb([now, events], use_bin_type=True)]
            self.seq += 1
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                self.dropped += 1

    def close(self) -> None:
        self.sock.close(0)
