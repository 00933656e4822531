"""The steady decode batch (examples/kvd_engine/steady.py): its arrays exactly, and an overlapped
engine whose requests leave the batch at different steps (compaction, 0-token appends that register
a finishing request's last block) giving HF's tokens and caching every written block."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.conftest_daemon import daemon_factory, short_tmp  # noqa: F401
from tests.engine_common import BLOCK, DAEMON, LLAMA, model_of
from kvd.hashing import hash_next_blocks, hash_prompt

from kvd_client import Client  # noqa: E402
from kvd_engine import Engine, hf_generate  # noqa: E402
from kvd_engine.state import RUNNING, Request  # noqa: E402
from kvd_engine.steady import SteadyBatch  # noqa: E402


def _decoding(rid, prompt, output, max_new, bs):
    """A request in steady decode: its last sampled token's position is the next to compute, its
    full blocks hashed and registered."""
    r = Request(rid, prompt, max_new, output=list(output), state=RUNNING)
    r.computed = r.seq_len - 1
    r.hashes = hash_prompt(np.array(r.seq[: r.computed // bs * bs]), bs)
    r.registered = len(r.hashes)
    return r


def _sample(batch, toks):
    """What the engine does with a step's sampled tokens (forward.ForwardMixin._sample_steady)."""
    for r, t in zip(batch.reqs, toks):
        r.output.append(t)
        r.computed += 1
    batch.advance(np.array(toks, np.int64))


def test_steady_batch_arrays_hashing_and_compaction():
    bs = 4
    r0 = _decoding("a", [1, 2, 3, 4, 5, 6], [7], 5, bs)           # computes position 6
    r1 = _decoding("b", [11, 12, 13], [14, 15, 16], 6, bs)        # computes position 5
    b = SteadyBatch([r0, r1], np.array([5, 9]), bs, "S16")
    assert b.rows.dtype == np.int32 and b.rows.tolist() == [5, 9]
    assert b.pos.tolist() == [6, 5] and b.last.tolist() == [7, 16] and b.left.tolist() == [4, 3]
    assert b.nh.tolist() == [1, 1] and b.reg.tolist() == [1, 1]
    assert b.last_hash.tolist() == [r0.hashes[0], r1.hashes[0]]
    assert b.recent.tolist() == [[5, 6, 7, 0], [15, 16, 0, 0]]  # the blocks being filled, by position % bs
    assert b.keep.tolist() == [0, 1] and b.qsl.tolist() == [0, 1, 2] and not b.forced
    assert b.filled().tolist() == []  # positions 6 and 5 end no block
    stamp = b.stamp

    _sample(b, [8, 17])
    assert b.pos.tolist() == [7, 6] and b.last.tolist() == [8, 17] and b.left.tolist() == [3, 2]
    assert b.recent.tolist() == [[5, 6, 7, 8], [15, 16, 17, 0]]
    idx = b.filled()  # position 7 ends r0's second block
    assert idx.tolist() == [0]
    new = hash_next_blocks(b.recent[idx], b.last_hash[idx])
    assert new[0] == hash_prompt(np.array(r0.seq[:8]), bs)[1]
    b.add_hashes(idx, new)
    assert b.nh.tolist() == [2, 1] and b.last_hash[0] == new[0]
    assert len(r0.hashes) == 1  # not flushed yet
    assert b.filled() is None  # a known hash kvd has not registered: not the steady bookkeeping
    b.registered(None, np.array([1, 0], np.int32))
    assert b.reg.tolist() == [2, 1] and (r0.registered, r1.registered) == (2, 1)

    _sample(b, [9, 18])
    b.compact(np.array([False, True]))  # r0 leaves: every hash reaches its request first
    assert r0.hashes.tolist() == hash_prompt(np.array(r0.seq[:8]), bs).tolist()
    assert b.reqs == [r1] and b.rids == ["b"] and b.rows.tolist() == [9] and b.pos.tolist() == [7]
    assert b.recent.tolist() == [[15, 16, 17, 18]] and b.keep.tolist() == [0] and b.qsl.tolist() == [0, 1]
    assert b.stamp != stamp  # a new layout: graph buckets stage it in full
    idx = b.filled()
    assert idx.tolist() == [0]
    b.add_hashes(idx, hash_next_blocks(b.recent[idx], b.last_hash[idx]))
    b.flush()
    assert r1.hashes.tolist() == hash_prompt(np.array(r1.seq[:8]), bs).tolist() and b.pending == []


def test_steady_batch_refuses_a_first_block_without_parent():
    r = _decoding("a", [1, 2], [3, 4], 8, 4)  # position 3 ends the first block: no parent hash
    assert len(r.hashes) == 0
    assert SteadyBatch([r], np.array([0]), 4, "S16").filled() is None


def _lookup_after(d, model, prompts, max_new, overlap):
    with Client(d.endpoint, tenant="t", name="e", steps_in_flight=1) as c:
        eng = Engine(c, model, overlap=overlap)
        for rid, p in prompts.items():
            eng.add(rid, p, max_new[rid])
        eng.run()
        c.mark_computed()
        assert c.stats()["num_requests"] == 0
        with Client(d.endpoint, tenant="t", name="reader") as rd:
            cached = {rid: rd.lookup(c.hash_prompt(np.array(p + eng.reqs[rid].output[:-1])))
                      for rid, p in prompts.items()}
    return eng, cached


def test_overlap_requests_leaving_a_steady_batch_one_by_one(daemon_factory):
    """Requests finish at different steps: the batch compacts, a finishing request registers its
    last block with a 0-token append; tokens equal HF's and every written full block is cached,
    exactly as without overlap; the hashes kept in the batch reached every request."""
    model = model_of(LLAMA)
    rng = np.random.default_rng(5)
    prompts = {f"r{i}": rng.integers(0, 512, int(rng.integers(6, 30))).tolist() for i in range(6)}
    max_new = {rid: 9 + 3 * i for i, rid in enumerate(prompts)}  # leave at 6 different steps
    runs = {}
    for overlap in (False, True):
        d = daemon_factory(**DAEMON, tenants="t=uid:" + str(os.getuid()))
        runs[overlap] = _lookup_after(d, model, prompts, max_new, overlap)
    eng, cached = runs[True]
    assert eng.steady_steps >= 15 and eng._batch is None
    for rid, p in prompts.items():
        r = eng.reqs[rid]
        assert r.output == hf_generate(model, p, max_new[rid])[0], rid
        written = len(p) + max_new[rid] - 1
        assert r.hashes.tolist() == hash_prompt(np.array((p + r.output)[:written // BLOCK * BLOCK]),
                                                BLOCK).tolist(), rid
    assert cached == runs[False][1] == {rid: (len(p) + max_new[rid] - 1) // BLOCK for rid, p in prompts.items()}


@pytest.mark.parametrize("forced", [False, True])
def test_in_process_overlap_with_forced_tokens_on_the_arrays(forced):
    """The in-process manager drives the same steady path; forced tokens (a test hook) win over the
    sampled ones there too."""
    import torch

    from kvd_engine import InProcClient, OwnedKv

    model = model_of(LLAMA)
    rng = np.random.default_rng(9)
    prompts = {f"r{i}": rng.integers(0, 512, int(rng.integers(6, 20))).tolist() for i in range(3)}
    force = {"r1": {5: 77, 9: 3}} if forced else {}
    eng = Engine(InProcClient(256, BLOCK), model, kv=OwnedKv(2, 257, BLOCK, 2, 16, torch.float32, "cpu"), overlap=True)
    for rid, p in prompts.items():
        eng.add(rid, p, 14, force.get(rid))
    eng.run()
    assert eng.steady_steps >= 8
    for rid, p in prompts.items():
        assert eng.reqs[rid].output == hf_generate(model, p, 14, force.get(rid, {}))[0], rid
    if forced:
        assert [eng.reqs["r1"].output[i] for i in (5, 9)] == [77, 3]
