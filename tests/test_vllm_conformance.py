"""Conformance: one request sequence through vLLM 0.33.0's KVCacheManager (events on) and through kvd's
manager with the vllm_sha256 scheme; the decoded event streams are compared. Skipped without vLLM.

kvd runs the sequence twice: one call per request (``allocate`` / ``append_slots`` / ``free``, as
vLLM's manager is called) and batched, one ``step`` per scheduler round (all admissions of a round
in one batched admission, all decodes in one decode step), where one registration call holds many
requests' blocks. Either way every BlockStored must equal vLLM's, event by event: hashes (as vLLM
publishes them by default: uint64 of the last 8 bytes, kvd.events), ``parent_block_hash``,
``token_ids``, block size, group, medium and the group's kind (``kv_cache_spec_kind``), in vLLM's
order.
Where the two legitimately differ, the test says so and checks a property instead:
- ``lora_id``/``lora_name`` and ``extra_keys``: kvd's manager never sees LoRA names or multimodal
  inputs (the engine hashes them into the block hashes), so its BlockStored leaves them nil; the
  test checks that vLLM sets them only on the LoRA / salted requests' events.
- Which cached blocks an allocation evicts: both evict least recently freed first, tail blocks first,
  but the order of BlockRemoved events within one allocation is not part of the contract; the test
  compares the evicted sets per round.
"""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from kvd.api import AdmitRequest, GroupSpec, ManagerConfig, StepBatch
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
    """kvd's manager with KV events on; its event log goes through kvd's publisher and back through
    vLLM's decoder. ``batched``: one ``step`` per round instead of one call per request."""

    def __init__(self, batched: bool):
        self.m = BlockManager(ManagerConfig(num_gpu_blocks=NUM_BLOCKS, groups=(GroupSpec(block_size=BS),),
                                            max_model_len=256, hash_width=32, debug_checks=True))
        self.log = self.m.enable_kv_events()
        self.batched = batched
        self.pub = KvEventPublisher(zmq.Context.instance(), f"inproc://kvd-conformance-{batched}",
                                    lambda key: ("", BS, 0), hash_width=32, group_windows=[None])
        self.decode_batch = msgspec.msgpack.Decoder(KVEventBatch).decode
        self.chains: dict[str, dict] = {}

    def _admit_request(self, rid, tokens, lora=None, salt=None) -> AdmitRequest:
        kw = dict(algo=VLLM_SCHEME, lora_name=lora and lora[0], lora_path=lora[1] if lora else "", cache_salt=salt)
        hashes = hash_prompt(np.array(tokens), BS, **kw)
        last = bytes(hashes[-1]).ljust(32, b"\0") if len(hashes) else None
        self.chains[rid] = dict(tokens=list(tokens), last=last, kw=kw)
        return AdmitRequest(rid, len(tokens), hashes, token_ids=np.array(tokens))

    def _decoded(self, rid, token):
        """The request's new token: (hashes, token ids) of the block it fills, or empty ones."""
        c = self.chains[rid]
        c["tokens"].append(token)
        n = len(c["tokens"])
        if n % BS:
            return np.empty(0, "S32"), np.empty(0, np.int32)
        block = c["tokens"][n - BS:]
        hashes = hash_prompt(np.array(block), BS, parent=c["last"], first_block_index=n // BS - 1, **c["kw"])
        c["last"] = bytes(hashes[0]).ljust(32, b"\0")
        return hashes, np.array(block, np.int32)

    def run(self, ops):
        kind = ops[0][0]
        if not self.batched or kind == "reset":
            for op in ops:
                getattr(self, op[0])(*op[1:])
        elif kind == "admit":
            res = self.m.step(StepBatch(admit=[self._admit_request(*op[1:]) for op in ops]))
            assert res.admit_status.tolist() == [0] * len(ops)
        elif kind == "decode":
            filled = [self._decoded(rid, token) for _, rid, token in ops]
            res = self.m.step(StepBatch(
                append_ids=[op[1] for op in ops], append_num_tokens=1,
                append_hashes=(np.concatenate([h for h, _ in filled]),),
                append_hash_counts=(np.array([h.size for h, _ in filled]),),
                append_token_ids=(np.concatenate([t for _, t in filled]),)))
            assert res.append_status.tolist() == [0] * len(ops)
        else:
            res = self.m.step(StepBatch(free=[op[1] for op in ops]))
            assert res.free_status.tolist() == [0] * len(ops)
            for op in ops:
                del self.chains[op[1]]

    def admit(self, rid, tokens, lora=None, salt=None):
        req = self._admit_request(rid, tokens, lora, salt)
        assert self.m.allocate(rid, req.num_tokens, req.block_hashes, token_ids=req.token_ids).ok

    def decode(self, rid, token):
        hashes, tokens = self._decoded(rid, token)
        assert self.m.append_slots(rid, 1, hashes, new_block_token_ids=tokens).ok

    def free(self, rid):
        self.m.free(rid)
        del self.chains[rid]

    def reset(self):
        assert self.m.reset_prefix_cache()

    def events(self):
        start = len(self.pub.buffer)
        self.pub.publish(self.log)
        return [e for _, _, payload in list(self.pub.buffer)[start:] for e in self.decode_batch(payload).events]


_EXTRA = ("lora_id", "lora_name", "extra_keys")  # vLLM's, nil in kvd's events (the documented difference)


def _compare(vllm_events, kvd_events, what: str, tagged: set[int]):
    """Event by event, except the order of BlockRemoved within a round; ``tagged``: the hashes that
    carry extra keys in vLLM's events (every block of a LoRA request, a salted request's first)."""
    keep = [e for e in vllm_events if not isinstance(e, BlockRemoved)]
    kvd_keep = [e for e in kvd_events if not isinstance(e, BlockRemoved)]
    for e in keep:
        if isinstance(e, BlockStored):
            extra = e.lora_name is not None or any(k is not None for k in e.extra_keys or ())
            assert extra == any(h in tagged for h in e.block_hashes), what
    assert [msgspec.structs.replace(e, **{f: None for f in _EXTRA}) if isinstance(e, BlockStored) else e
            for e in keep] == kvd_keep, what
    for e in kvd_keep:
        if isinstance(e, BlockStored):
            assert e.medium == "GPU" and len(e.token_ids) == BS * len(e.block_hashes), what
    v_removed = sorted(h for e in vllm_events if isinstance(e, BlockRemoved) for h in e.block_hashes)
    k_removed = sorted(h for e in kvd_events if isinstance(e, BlockRemoved) for h in e.block_hashes)
    assert k_removed == v_removed, what
    stored = [e for e in keep if isinstance(e, BlockStored)]
    return (sum(len(e.block_hashes) for e in stored), sum(e.parent_block_hash is not None for e in stored),
            len(v_removed), sum(isinstance(e, AllBlocksCleared) for e in keep))


def _rounds(rng):
    """Scheduler rounds: each a list of one kind of op (admissions, decodes, frees, a reset)."""
    system = rng.integers(0, 50_000, 8).tolist()
    rounds = [[
        ("admit", "a", system + rng.integers(0, 50_000, 3).tolist(), None, None),  # 2 full blocks + 3
        ("admit", "b", system + rng.integers(0, 50_000, 6).tolist(), None, None),  # shares 2 blocks
        ("admit", "c", system + rng.integers(0, 50_000, 5).tolist(), ("sql", "/lora/sql"), None),
        ("admit", "d", system + rng.integers(0, 50_000, 1).tolist(), None, "tenant-x"),
    ]]
    rounds += [[("decode", rid, int(rng.integers(0, 50_000))) for rid in "abcd"] for _ in range(6)]
    rounds += [[("free", "a"), ("free", "c")]]
    rounds += [[("admit", "e", rng.integers(0, 50_000, 42).tolist(), None, None)]]  # evicts cached blocks
    rounds += [[("decode", rid, int(rng.integers(0, 50_000))) for rid in "bde"] for _ in range(3)]
    rounds += [[("free", "b"), ("free", "d"), ("free", "e")], [("reset",)]]
    rounds += [[("admit", "f", system + rng.integers(0, 50_000, 9).tolist(), None, None),
                ("admit", "g", system + rng.integers(0, 50_000, 13).tolist(), None, None)]]
    rounds += [[("decode", rid, int(rng.integers(0, 50_000))) for rid in "fg"] for _ in range(4)]
    return rounds


@pytest.mark.parametrize("batched", [False, True], ids=["per-request", "batched-steps"])
def test_the_same_requests_give_the_same_events(monkeypatch, batched):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    init_none_hash(vllm_sha256)
    vllm, kvd = VllmSide(), KvdSide(batched)
    tagged: set[int] = set()
    totals = np.zeros(4, int)
    for ops in _rounds(np.random.default_rng(12)):
        for op in ops:
            getattr(vllm, op[0])(*op[1:])
        kvd.run(ops)
        for op in ops:  # what vLLM tags with extra keys: a LoRA request's blocks, a salted one's first
            chain = kvd.chains.get(op[1]) if len(op) > 1 else None
            if chain and (chain["kw"]["lora_name"] or chain["kw"]["cache_salt"]):
                hashes = [_int(h) for h in hash_prompt(np.array(chain["tokens"]), BS, **chain["kw"])]
                tagged |= set(hashes if chain["kw"]["lora_name"] else hashes[:1])
        totals += _compare(vllm.events(), kvd.events(), repr(ops[0][:2]), tagged)
    stored, with_parent, removed, cleared = totals.tolist()
    # the script exercised every kind, and parents both ways (a request's first block, later ones)
    assert (stored, with_parent, removed, cleared) == (35, 12, 6, 1)
    kvd.pub.close()
