"""KV cache events (kvd.events): what a router subscribed to the daemon receives, in vLLM's format."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq

from conftest_daemon import daemon, daemon_factory, short_tmp  # noqa: F401
from kvd.events import END_SEQ, KvEventPublisher, encode_all_cleared, encode_batch, encode_block_removed, encode_block_stored
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


def test_encoding_layout_without_vllm():
    stored = msgpack.unpackb(encode_block_stored([b"a" * 16], 16, 1), raw=False)
    assert stored == {"type": "BlockStored", "block_hashes": [b"a" * 16], "parent_block_hash": None,
                      "token_ids": [], "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
                      "group_idx": 1}
    payload = encode_batch(2.5, [encode_block_removed(b"b" * 32, 0), encode_all_cleared()], 3)
    assert msgpack.unpackb(payload) == [2.5, [{"type": "BlockRemoved", "block_hashes": [b"b" * 32], "medium": "GPU",
                                              "group_idx": 0}, {"type": "AllBlocksCleared"}], 3]


def _publisher_pool(hash_width: int, endpoint: str, **kw):
    ctx = zmq.Context.instance()
    pool = BlockPool(8, np.dtype(f"S{hash_width}"))
    pool.event_log = []
    pub = KvEventPublisher(ctx, endpoint, lambda key: (f"t{key}", 4, key - 1), hash_width=hash_width, **kw)
    return ctx, pool, pub


def _sub(ctx, endpoint):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def _settle(pub, sub):
    """A PUB socket drops what it sends before the subscription arrives: probe until one lands."""
    for _ in range(100):
        pub.send(b"probe", b"")
        if sub.poll(50):
            break
    while sub.poll(100):
        sub.recv_multipart()


@pytest.mark.parametrize("int_hashes", [True, False])
def test_hashes_with_trailing_zero_bytes_are_published_at_full_width(int_hashes):
    ep = f"inproc://kvd-events-width-{int_hashes}"
    ctx, pool, pub = _publisher_pool(32, ep, int_hashes=int_hashes)
    sub = _sub(ctx, ep)
    try:
        _settle(pub, sub)
        h = [b"\x07" * 30 + b"\0\0", b"\0" * 31 + b"\x01"]
        blocks = pool.take(2)
        pool.register(2, np.array(h, "S32"), blocks)
        assert pool.block_hash[blocks[0]] == h[0].rstrip(b"\0")  # numpy strips them
        pub.publish(pool.event_log)
        assert sub.poll(2000)
        topic, seq, payload = sub.recv_multipart()
        ts, events, rank = msgpack.unpackb(payload)
        # vLLM's default: the low 64 bits of the big-endian hash, i.e. its last 8 bytes
        want = [int.from_bytes(x[-8:], "big") for x in h] if int_hashes else h
        assert want[0] == 0x0707070707070000 and want[1] == 1 or not int_hashes
        assert topic == b"t2" and events[0]["block_hashes"] == want and events[0]["group_idx"] == 1 and rank == 0
        assert events[0]["block_size"] == 4
    finally:
        sub.close(0)
        pub.close()


def test_replay_returns_exactly_the_missed_batches(short_tmp):
    ep, replay_ep = f"ipc://{short_tmp}/ev.sock", f"ipc://{short_tmp}/replay.sock"
    ctx, pool, pub = _publisher_pool(16, ep, replay_endpoint=replay_ep, buffer_steps=5, topic="kv@n1@{tenant}")
    sub = _sub(ctx, ep)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay_ep)
    try:
        _settle(pub, sub)
        first = pub.seq
        sent = []
        for i in range(8):
            pool.event_log.append(("cleared", 1 + i % 2, []))
            pub.publish(pool.event_log)
            assert sub.poll(2000)
            sent.append(sub.recv_multipart())
        assert [int.from_bytes(m[1], "big") for m in sent] == list(range(first, first + 8))
        assert sent[0][0] == b"kv@n1@t1" and sent[1][0] == b"kv@n1@t2"

        def replay(start: int) -> list[list[bytes]]:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            got = []
            while True:
                assert dealer.poll(5000), "replay did not answer"
                empty, *frames = dealer.recv_multipart()
                assert empty == b""
                if frames[1] == END_SEQ:
                    assert frames == [b"", END_SEQ, b""]
                    return got
                got.append(frames)

        assert replay(first + 4) == sent[4:]  # missed from seq first+4 on: exactly those
        assert replay(first + 7) == sent[7:]
        assert replay(first + 8) == []  # nothing missed: only the end marker
        assert replay(0) == sent[3:]  # the buffer keeps the last buffer_steps (5) batches
    finally:
        dealer.close(0)
        sub.close(0)
        pub.close()


def _recv(sub: zmq.Socket, timeout_ms: int = 5000):
    assert sub.poll(timeout_ms), "no event arrived"
    topic, seq, payload = sub.recv_multipart()
    return topic.decode(), int.from_bytes(seq, "big"), payload


@pytest.mark.parametrize("algo,int_hashes", [("sha256", True), ("vllm_sha256", True), ("vllm_sha256", False)])
def test_a_router_decodes_every_event_with_vllms_decoder(daemon_factory, short_tmp, algo, int_hashes):
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    msgspec = pytest.importorskip("msgspec")
    decode = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode
    events_ep = f"ipc://{short_tmp}/events.sock"
    d = daemon_factory(num_gpu_blocks=16, kv_events_endpoint=events_ep, hash_algo=algo,
                       kv_events_int_hashes=int_hashes)
    ctx = zmq.Context()
    sub = _sub(ctx, events_ep)
    c = Client(d.endpoint, tenant="alice")
    try:
        assert c.info["hash_width"] == (32 if algo == "vllm_sha256" else 16)
        hs = c.hash_prompt(np.arange(40, dtype=np.int32))
        if algo == "vllm_sha256":
            assert hs.tobytes() == hash_prompt(np.arange(40), 16, algo=algo).tobytes() and hs.dtype == "S32"
        for _ in range(50):
            c.allocate("probe", 40, hs)
            c.free("probe")
            if sub.poll(100):
                break
        while sub.poll(200):
            sub.recv_multipart()
        assert c.reset_prefix_cache()
        topic, seq, payload = _recv(sub)
        batch = decode(payload)
        # engine-owned KV memory: the session's own namespace, and a topic of its own
        assert c.info["topic"] == "alice#1" and not c.shared
        assert topic == "alice#1" and isinstance(batch.ts, float) and batch.data_parallel_rank == 0
        assert batch.events == [kv_events.AllBlocksCleared()]

        c.allocate("a", 40, hs)  # blocks 1, 2 full and registered, 3 partial
        topic, seq2, payload = _recv(sub)
        assert seq2 == seq + 1
        (stored,) = decode(payload).events
        width = c.hash_width

        def ext(x):
            full = bytes(x).ljust(width, b"\0")
            return int.from_bytes(full[-8:], "big") if int_hashes else full

        assert stored == kv_events.BlockStored(
            block_hashes=[ext(x) for x in hs], parent_block_hash=None, token_ids=[],
            block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
            kv_cache_spec_kind="full_attention")
        c.free("a")
        c.allocate("b", 15 * 16)  # every block of the pool: both cached blocks are evicted
        topic, _, payload = _recv(sub)
        events = decode(payload).events
        assert topic == "alice#1" and all(isinstance(e, kv_events.BlockRemoved) for e in events)
        assert sorted(e.block_hashes[0] for e in events) == sorted(ext(x) for x in hs)
        assert {(e.medium, e.group_idx, len(e.block_hashes)) for e in events} == {("GPU", 0, 1)}
    finally:
        c.close()
        sub.close(0)
        ctx.term()
    assert d.stop() == 0, d.stderr[-2000:]


def test_a_daemon_that_cannot_bind_its_events_endpoint_says_so(daemon_factory):
    d = daemon_factory(wait=False, kv_events_endpoint="tcp://256.0.0.1:1")
    assert d.proc.wait(60) == 1
    d.stop()


def test_a_stored_entry_with_parent_and_tokens_publishes_them():
    ep = "inproc://kvd-events-parent"
    ctx, pool, pub = _publisher_pool(32, ep, int_hashes=False)
    try:
        parent, h = b"\x05" * 32, b"\x06" * 31 + b"\0"
        pool.event_log.append(("stored", 1, [h.rstrip(b"\0")], parent, [7, 8, 9, 300]))
        pub.publish(pool.event_log)
        _, _, payload = pub.buffer[-1]
        (event,) = msgpack.unpackb(payload)[1]
        assert (event["block_hashes"], event["parent_block_hash"], event["token_ids"]) == ([h], parent, [7, 8, 9, 300])
        assert pool.event_log == []
    finally:
        pub.close()


@pytest.mark.parametrize("width", [16, 32])
def test_batch_admission_in_a_step_logs_one_stored_entry_per_request(width):
    from kvd.api import AdmitRequest, GroupSpec, ManagerConfig, StepBatch
    from kvd.manager import BlockManager

    algo = "vllm_sha256" if width == 32 else "sha256"
    m = BlockManager(ManagerConfig(num_gpu_blocks=32, groups=(GroupSpec(block_size=4),), max_model_len=64,
                                   hash_width=width, debug_checks=True))
    m.pool.event_log = []
    shared = list(range(8))
    prompts = [shared + [100, 101, 102, 103, 104], shared + [200, 201, 202, 203, 204, 205]]
    hashes = [hash_prompt(np.array(p), 4, algo=algo) for p in prompts]
    m.step(StepBatch(admit=[AdmitRequest(f"r{i}", len(p), h) for i, (p, h) in enumerate(zip(prompts, hashes))]))
    # r0 registers its 3 full blocks; r1 hits the 2 shared ones and registers its third and fourth
    assert m.pool.event_log == [("stored", 1, hashes[0].tolist()), ("stored", 1, hashes[1][2:].tolist())]
    assert m.block_table("r1").tolist()[:2] == m.block_table("r0").tolist()[:2]


def _stored(sub, decode, n: int) -> list:
    """The next ``n`` BlockStored events the subscriber receives (other kinds are skipped)."""
    out = []
    while len(out) < n:
        _, _, payload = _recv(sub)
        out += [e for e in decode(payload).events if type(e).__name__ == "BlockStored"]
    return out


def test_token_ids_and_parents_reach_a_router_through_every_kind_of_call(daemon_factory, short_tmp):
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    msgspec = pytest.importorskip("msgspec")
    from kvd.api import AdmitRequest, StepBatch

    decode = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode
    events_ep = f"ipc://{short_tmp}/events.sock"
    d = daemon_factory(num_gpu_blocks=64, block_size=4, kv_events_endpoint=events_ep)
    ctx = zmq.Context()
    sub = _sub(ctx, events_ep)
    c = Client(d.endpoint, tenant="alice")
    try:
        assert c.info["kv_events"] is True
        for _ in range(50):  # until the subscription is in place
            c.allocate("probe", 5, c.hash_prompt(np.arange(5)))
            c.free("probe")
            if sub.poll(100):
                break
        assert c.reset_prefix_cache()
        while sub.poll(200):
            sub.recv_multipart()
        ext = lambda x: int.from_bytes(bytes(x).ljust(16, b"\0")[-8:], "big")  # noqa: E731
        p = [list(range(10, 19)), list(range(10, 18)) + [40, 41, 42, 43, 44], [7] * 6]
        h = [c.hash_prompt(np.array(x)) for x in p]
        res = c.step(StepBatch(admit=[AdmitRequest("a", 9, h[0], token_ids=p[0]),
                                      AdmitRequest("b", 13, h[1], token_ids=np.array(p[1])),
                                      AdmitRequest("c", 6, h[2])]))
        assert res.admit_cached_tokens.tolist() == [0, 8, 0]
        got = _stored(sub, decode, 3)
        assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in got] == [
            ([ext(x) for x in h[0]], None, p[0][:8]), ([ext(h[1][2])], ext(h[1][1]), p[1][8:12]),
            ([ext(h[2][0])], None, [])]
        assert {(e.block_size, e.group_idx, e.kv_cache_spec_kind) for e in got} == {(4, 0, "full_attention")}
        # a decode step through the binary decode op: a fills its third block, c its second
        rows = c.rows_of(["a", "c"])
        fill = {"a": p[0][8:] + [1, 2, 3], "c": p[2][4:] + [5, 6]}
        new = {r: c.hash_prompt(np.array(p[0 if r == "a" else 2][:4 * (2 if r == "a" else 1)] + fill[r]))[-1:]
               for r in "ac"}
        c.step(StepBatch(append_rows=rows, append_num_tokens=2))
        c.step(StepBatch(append_rows=rows, append_num_tokens=1, append_hashes=(np.concatenate([new["a"], new["c"]]),),
                         append_hash_counts=(np.array([1, 1], np.int32),),
                         append_token_ids=(np.array(fill["a"] + fill["c"], np.int32),)))
        got = _stored(sub, decode, 2)
        assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in got] == [
            ([ext(new["a"][0])], ext(h[0][1]), fill["a"]), ([ext(new["c"][0])], ext(h[2][0]), fill["c"])]
        # allocate and append_slots (a private namespace: the session's own, so nothing hits)
        q = list(range(100, 108))
        hq = c.hash_prompt(np.array(q))
        c.allocate("d", 8, hq, token_ids=q)
        nq = c.hash_prompt(np.array(q + [9, 9, 9, 9]))[-1:]
        c.append_slots("d", 4, nq, new_block_token_ids=[9, 9, 9, 9])
        got = _stored(sub, decode, 2)
        assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in got] == [
            ([ext(x) for x in hq], None, q), ([ext(nq[0])], ext(hq[1]), [9, 9, 9, 9])]
    finally:
        c.close()
        sub.close(0)
        ctx.term()
    assert d.stop() == 0, d.stderr[-2000:]


def test_without_events_the_client_sends_no_token_ids(daemon):
    from kvd.api import AdmitRequest, StepBatch

    c = Client(daemon.endpoint)
    try:
        assert c.info["kv_events"] is False
        h = c.hash_prompt(np.arange(40))
        spec = c._req_decode(np.zeros(2, np.int32), 1, 0, None, (h[:2],), (np.ones(2, np.int32),), 1,
                             (np.arange(32, dtype=np.int32),))
        assert len(spec[2]) == 3  # rows, hashes, counts: the message of a step without token ids
        with_ids = c._req_allocate("x", 40, h, token_ids=np.arange(40))
        assert len(with_ids[2]) == 1
        with_ids[4]()  # give the row back
        res = c.step(StepBatch(admit=[AdmitRequest("a", 40, h, token_ids=list(range(40)))]))
        assert res.admit_status.tolist() == [0]
    finally:
        c.close()


@pytest.mark.parametrize("seed", range(8))
def test_runs_encode_at_once_to_the_bytes_of_their_events_one_by_one(seed):
    """kvd.eventpack's vectorized BlockStored batch against encode_block_stored per event (which
    tests/test_events_vllm_bytes.py checks against msgspec byte for byte)."""
    from kvd.runs import NO_PARENT, NO_TOKENS, Runs, expand

    rng = np.random.default_rng(seed)
    width = int(rng.choice([16, 32]))
    int_hashes = bool(seed % 2)
    bs = int(rng.choice([1, 4, 16, 256]))
    n = int(rng.choice([1, 3, 40, 300]))
    hashes = np.array([rng.bytes(width - 2) + bytes(2) if rng.random() < 0.2 else rng.bytes(width)
                       for _ in range(n)], f"S{width}")  # trailing zero bytes too
    if seed == 0:  # hashes whose low 64 bits are small: every int width of a published hash
        raw = hashes.view(np.uint8).reshape(n, width)
        raw[:, width - 8 :] = np.array([5, 200, 60_000, 2**31, 2**40] * n, ">u8")[:n].view(np.uint8).reshape(n, 8)
    parents = np.array([NO_PARENT if rng.random() < 0.3 else rng.bytes(width) for _ in range(n)], f"S{width}")
    first = rng.random(n) < 0.3
    chained = rng.random(n - 1) < 0.6  # runs of several blocks
    parents[1:][chained] = hashes[:-1][chained]
    tokens = None
    if seed % 4:
        top = int(rng.choice([100, 256, 70_000, 2**31 - 1]))
        tokens = rng.integers(0, top, (n, bs)).astype(np.int32)
    runs = Runs(parents, first, tokens)
    if tokens is not None:  # some requests supplied none: all of their event's rows
        starts = runs.starts(hashes)
        lost = rng.random(starts.size) < 0.2
        tokens[np.repeat(lost, np.diff(np.append(starts, n)))] = NO_TOKENS
    ctx, pool, pub = _publisher_pool(width, f"inproc://kvd-events-runs-{seed}", int_hashes=int_hashes,
                                     group_windows=[None, 4096])
    try:
        for group in (0, 1):
            spec = [("full_attention", None), ("sliding_window", 4096)][group]
            blob, count = pub._encode_runs(hashes, runs, bs, group, *spec)
            one_by_one = [pub._encode(e, ("t", bs, group))[0] for e in expand([("runs", 1, hashes, runs)])]
            assert count == len(one_by_one) == runs.starts(hashes).size
            assert blob == b"".join(one_by_one)
    finally:
        pub.close()


def test_eventpack_ints_and_array_headers_are_msgpacks():
    from kvd import eventpack

    values = np.array([0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63, 2**64 - 1], np.uint64)
    flat, lens = eventpack.ints(values)
    assert flat.tobytes() == b"".join(msgpack.packb(int(v)) for v in values)
    assert lens.tolist() == [len(msgpack.packb(int(v))) for v in values]
    small = np.array([0, 127, 128, 255, 256, 65535, 65536, 2**31 - 1], np.int32)  # token ids: the int32 path
    flat, lens = eventpack.ints(small)
    assert flat.tobytes() == b"".join(msgpack.packb(int(v)) for v in small) and lens.sum() == flat.size
    counts = np.array([0, 15, 16, 65535, 65536, 70_000])
    flat, lens = eventpack.array_headers(counts)
    assert flat.tobytes() == b"".join(msgpack.packb([0] * int(c))[: int(x)] for c, x in zip(counts, lens))
    assert lens.tolist() == [1, 1, 3, 3, 5, 5]
    assert eventpack.array_headers(np.full(3, 16)) == msgpack.packb([0] * 16)[:3]  # all equal: one column
