"""Byte equality: kvd's event encoding against vLLM 0.33.0's publisher path (msgspec's Encoder on
vLLM's own Structs, as ZmqEventPublisher encodes them). Skipped without vLLM."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.events import encode_all_cleared, encode_batch, encode_block_removed, encode_block_stored

kv_events = pytest.importorskip("vllm.distributed.kv_events")
msgspec = pytest.importorskip("msgspec")


def _cases(rng):
    for n in (1, 2, 15, 16, 70):  # fixarray / array16 boundaries of block_hashes and of the events list
        width = int(rng.choice([16, 32]))
        hashes = [rng.bytes(width) for _ in range(n)]
        if rng.random() < 0.5:  # vLLM's default: the uint64 of the last 8 bytes
            hashes = [int.from_bytes(h[-8:], "big") for h in hashes]
        parent = (rng.bytes(width) if rng.random() < 0.5 else int(rng.integers(0, 2**63))) if rng.random() < 0.5 else None
        bs = int(rng.choice([1, 16, 256]))
        # every msgpack int width a token id can take: fixint, uint8, uint16, uint32
        top = int(rng.choice([100, 256, 70_000, 2**31 - 1]))
        tokens = rng.integers(0, top, bs * n) if rng.random() < 0.7 else None
        lora = "adapter-x" if rng.random() < 0.3 else None
        group = int(rng.integers(0, 300))
        kind, window = [(None, None), ("full_attention", None), ("sliding_window", int(rng.integers(1, 70_000)))][n % 3]
        yield (kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                     token_ids=[] if tokens is None else tokens.tolist(), block_size=bs,
                                     lora_id=None, medium="GPU", lora_name=lora, group_idx=group,
                                     kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window),
               encode_block_stored(hashes, bs, group, parent, tokens, lora, kind, window))
        yield (kv_events.BlockRemoved(block_hashes=[hashes[0]], medium="GPU", group_idx=group),
               encode_block_removed(hashes[0], group))
    yield kv_events.AllBlocksCleared(), encode_all_cleared()


@pytest.mark.parametrize("seed", range(6))
def test_same_events_are_the_same_bytes(seed):
    rng = np.random.default_rng(seed)
    pairs = list(_cases(rng))
    k = int(rng.integers(1, len(pairs) + 1))
    for count in (k, len(pairs), len(pairs) * 3):  # 16+ events: an array16 header
        chosen = [pairs[i % len(pairs)] for i in range(count)]
        ts = float(rng.random() * 2e9)
        rank = int(rng.choice([0, 1, 7, 300]))
        want = msgspec.msgpack.Encoder().encode(
            kv_events.KVEventBatch(ts=ts, events=[v for v, _ in chosen], data_parallel_rank=rank))
        assert encode_batch(ts, [b for _, b in chosen], rank) == want
