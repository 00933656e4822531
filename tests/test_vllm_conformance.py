"""Conformance: one request sequence through vLLM 0.33.0's KVCacheManager (events on) and through kvd's
manager with the vllm_sha256 scheme; the decoded event streams are compared. Skipped without vLLM.

Hashes are compared as vLLM publishes them by default (uint64 of the last 8 bytes: kvd.events).
Where the two legitimately differ, the test says so and checks a property instead:
- vLLM publishes ``parent_block_hash``, ``token_ids``, ``lora_id``/``lora_name`` and ``extra_keys``;
  kvd's manager never sees tokens or LoRA names (the engine hashes), so its BlockStored carries the
  hashes, block size and group only. For those fields the test checks that vLLM's values are what a
  router recomputes from kvd's chain (parent = the preceding hash of kvd's chain, token ids = the tokens
  kvd hashed), i.e. that kvd's hashes route the same blocks.
- Which cached blocks an allocation evicts: both evict least recently freed first, tail blocks first,
  but the order of BlockRemoved events within one allocation is not part of the contract; the test
  compares the evicted sets per operation.
"""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from kvd.api import GroupSpec, ManagerConfig
from kvd.events import KvEventPublisher
from kvd.hashing import VLLM_SCHEME, hash_prompt
from kvd.manager import BlockManager

pytest.importorskip("vllm.v1.core.kv_cache_manager")
import msgspec  # noqa: E402
import torch  # noqa: E402
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256 as vllm_sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

BS = 4
NUM_BLOCKS = 24  # block 0 is the null block in both


class VllmSide:
    def __init__(self):
        cfg = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
            ["layer"], FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32))])
        self.kv = KVCacheManager(cfg, max_model_len=256, scheduler_block_size=BS, hash_block_size=BS,
                                 enable_caching=True, log_stats=False, enable_kv_cache_events=True)
        self.hasher = get_request_block_hasher(BS, vllm_sha256)
        self.reqs: dict[str, Request] = {}

    def admit(self, rid, tokens, lora=None, salt=None):
        lora_req = LoRARequest(lora[0], 7, lora[1]) if lora else None
        req = Request(rid, list(tokens), SamplingParams(max_tokens=64), None, lora_request=lora_req,
                      cache_salt=salt, block_hasher=self.hasher)
        blocks, hit, _ = self.kv.get_computed_blocks(req)
        assert self.kv.allocate_slots(req, len(tokens) - hit, hit, blocks) is not None
        req.num_computed_tokens = len(tokens)
        self.reqs[rid] = req

    def decode(self, rid, token):
        req = self.reqs[rid]
        req.append_output_token_ids(token)
        assert self.kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1

    def free(self, rid):
        self.kv.free(self.reqs.pop(rid))

    def reset(self):
        assert self.kv.reset_prefix_cache()

    def events(self):
        return self.kv.take_events()


def _int(h) -> int:
    """vLLM's published form of a hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, its default)."""
    return int.from_bytes(bytes(h).ljust(32, b"\0")[-8:], "big")


class KvdSide:
    """kvd's manager; its event log goes through kvd's publisher and back through vLLM's decoder."""

    def __init__(self):
        self.m = BlockManager(ManagerConfig(num_gpu_blocks=NUM_BLOCKS, groups=(GroupSpec(block_size=BS),),
                                            max_model_len=256, hash_width=32, debug_checks=True))
        self.m.pool.event_log = []
        self.pub = KvEventPublisher(zmq.Context.instance(), "inproc://kvd-conformance",
                                    lambda key: ("", BS, 0), hash_width=32)
        self.decode_batch = msgspec.msgpack.Decoder(KVEventBatch).decode
        self.chains: dict[str, dict] = {}
        self.known: dict[bytes, tuple[bytes | None, list[int]]] = {}  # hash -> (parent, tokens) kvd hashed

    def _remember(self, hashes, parent, tokens):
        for i, h in enumerate(hashes):
            h = _int(h)
            self.known[h] = (parent, list(tokens[i * BS : (i + 1) * BS]))
            parent = h

    def admit(self, rid, tokens, lora=None, salt=None):
        kw = dict(algo=VLLM_SCHEME, lora_name=lora and lora[0], lora_path=lora[1] if lora else "", cache_salt=salt)
        hashes = hash_prompt(np.array(tokens), BS, **kw)
        self._remember(hashes, None, tokens)
        self.m.allocate(rid, len(tokens), hashes)
        last = bytes(hashes[-1]).ljust(32, b"\0") if len(hashes) else None
        self.chains[rid] = dict(tokens=list(tokens), last=last, kw=kw)

    def decode(self, rid, token):
        c = self.chains[rid]
        c["tokens"].append(token)
        n = len(c["tokens"])
        hashes = ()
        if n % BS == 0:
            block = c["tokens"][n - BS:]
            hashes = hash_prompt(np.array(block), BS, parent=c["last"], first_block_index=n // BS - 1, **c["kw"])
            self._remember(hashes, _int(c["last"]), block)
            c["last"] = bytes(hashes[0]).ljust(32, b"\0")
        self.m.append_slots(rid, 1, hashes)

    def free(self, rid):
        self.m.free(rid)
        del self.chains[rid]

    def reset(self):
        assert self.m.reset_prefix_cache()

    def events(self):
        start = len(self.pub.buffer)
        self.pub.publish(self.m.pool.event_log)
        return [e for _, _, payload in list(self.pub.buffer)[start:] for e in self.decode_batch(payload).events]


def _compare(vllm_events, kvd_events, kvd: KvdSide, what: str):
    v_stored = [(h, e.block_size, e.group_idx) for e in vllm_events if isinstance(e, BlockStored) for h in e.block_hashes]
    k_stored = [(h, e.block_size, e.group_idx) for e in kvd_events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert k_stored == v_stored, what  # every hash, block size and group, in the same order
    v_removed = sorted(h for e in vllm_events if isinstance(e, BlockRemoved) for h in e.block_hashes)
    k_removed = sorted(h for e in kvd_events if isinstance(e, BlockRemoved) for h in e.block_hashes)
    assert k_removed == v_removed, what
    kinds = [type(e).__name__ for e in vllm_events if not isinstance(e, BlockRemoved)]
    assert [type(e).__name__ for e in kvd_events if not isinstance(e, BlockRemoved)] == kinds, what
    for e in kvd_events:
        if isinstance(e, BlockStored):
            assert e.parent_block_hash is None and e.token_ids == [] and e.medium == "GPU"
    for e in vllm_events:  # what vLLM adds, recomputed from kvd's chain (the documented difference)
        if isinstance(e, BlockStored):
            parent, _ = kvd.known[e.block_hashes[0]]
            assert e.parent_block_hash == parent, what
            tokens = [t for h in e.block_hashes for t in kvd.known[h][1]]
            assert e.token_ids == tokens, what
    return len(v_stored), len(v_removed), kinds.count("AllBlocksCleared")


def test_the_same_requests_give_the_same_events(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    init_none_hash(vllm_sha256)
    rng = np.random.default_rng(12)
    sides = VllmSide(), KvdSide()
    system = rng.integers(0, 50_000, 8).tolist()
    script = [
        ("admit", "a", system + rng.integers(0, 50_000, 3).tolist(), None, None),  # 2 full blocks + 3
        ("admit", "b", system + rng.integers(0, 50_000, 6).tolist(), None, None),  # shares 2 blocks
        ("admit", "c", system + rng.integers(0, 50_000, 5).tolist(), ("sql", "/lora/sql"), None),
        ("admit", "d", system + rng.integers(0, 50_000, 1).tolist(), None, "tenant-x"),
    ]
    script += [("decode", rid, int(rng.integers(0, 50_000))) for _ in range(6) for rid in "abcd"]
    script += [("free", "a"), ("free", "c")]
    script += [("admit", "e", rng.integers(0, 50_000, 42).tolist(), None, None)]  # evicts cached blocks
    script += [("decode", rid, int(rng.integers(0, 50_000))) for _ in range(3) for rid in "bde"]
    script += [("free", "b"), ("free", "d"), ("free", "e"), ("reset",)]
    script += [("admit", "f", system + rng.integers(0, 50_000, 9).tolist(), None, None)]
    totals = np.zeros(3, int)
    for step in script:
        for side in sides:
            getattr(side, step[0])(*step[1:])
        totals += _compare(sides[0].events(), sides[1].events(), sides[1], repr(step[:2]))
    stored, removed, cleared = totals.tolist()
    assert stored >= 20 and removed >= 4 and cleared == 1  # the script exercised every kind
    sides[1].pub.close()
