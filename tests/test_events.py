"""KV cache events (kvd.events): what a router subscribed to the daemon receives, in vLLM's format."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq

from conftest_daemon import daemon_factory, short_tmp  # noqa: F401
from kvd.hashing import hash_prompt
from kvd.pool import BlockPool
from kvd_client import Client


def test_pool_logs_stores_evictions_and_resets_only_when_asked():
    pool = BlockPool(8)
    h = [bytes([i]) * 16 for i in range(4)]
    first = pool.take(2)  # 1, 2
    pool.register(1, np.array(h[:2], "S16"), first)
    assert pool.event_log is None  # nothing recorded without a publisher
    pool.event_log = []
    blocks = pool.take(2)  # 3, 4
    pool.register(1, np.array(h[2:], "S16"), blocks)
    pool.register(1, np.array(h[2:3], "S16"), pool.take(1))  # already cached: no event
    pool.release(blocks)
    pool.take(4)  # the fresh 6 and 7, then the cached 3 and 4, least recently freed first
    pool.release(first)
    assert pool.reset_cache({1})
    assert pool.event_log == [("stored", 1, h[2:]), ("removed", 1, [h[2], h[3]]), ("cleared", 1, [])]


def _recv(sub: zmq.Socket, timeout_ms: int = 5000):
    assert sub.poll(timeout_ms), "no event arrived"
    topic, seq, payload = sub.recv_multipart()
    return topic.decode(), int.from_bytes(seq, "big"), msgpack.unpackb(payload)


def test_a_router_sees_stored_removed_and_cleared_blocks_per_tenant(daemon_factory, short_tmp):
    events_ep = f"ipc://{short_tmp}/events.sock"
    d = daemon_factory(num_gpu_blocks=16, kv_events_endpoint=events_ep)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(events_ep)
    c = Client(d.endpoint, tenant="alice")
    try:
        hs = hash_prompt(np.arange(40, dtype=np.int32), 16)
        for _ in range(50):  # a PUB socket drops what it sends before the subscription arrives
            c.allocate("probe", 40, hs)
            c.free("probe")
            if sub.poll(100):
                break
        while sub.poll(200):
            sub.recv_multipart()
        assert c.reset_prefix_cache()
        topic, seq, (ts, events) = _recv(sub)
        # engine-owned KV memory: the session's own namespace, and a topic of its own
        assert c.info["topic"] == "alice#1" and not c.shared
        assert topic == "alice#1" and isinstance(ts, float) and events == [["AllBlocksCleared"]]

        c.allocate("a", 40, hs)  # blocks 1, 2 full and registered, 3 partial
        topic, seq2, (_, events) = _recv(sub)
        assert seq2 == seq + 1
        assert events == [["BlockStored", [bytes(x) for x in hs], None, [], 16, None, "GPU"]]
        c.free("a")
        c.allocate("b", 15 * 16)  # every block of the pool: both cached blocks are evicted
        topic, _, (_, events) = _recv(sub)
        assert topic == "alice#1" and events[0][0] == "BlockRemoved"
        assert sorted(events[0][1]) == sorted(bytes(x) for x in hs) and events[0][2] == "GPU"
    finally:
        c.close()
        sub.close(0)
        ctx.term()
    assert d.stop() == 0, d.stderr[-2000:]


def test_a_daemon_that_cannot_bind_its_events_endpoint_says_so(daemon_factory):
    d = daemon_factory(wait=False, kv_events_endpoint="tcp://256.0.0.1:1")
    assert d.proc.wait(60) == 1
    d.stop()
    assert "cannot bind the KV events endpoint" in d.stderr
