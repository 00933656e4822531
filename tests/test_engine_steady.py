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
    b.push(idx)
    assert b.queued.tolist() == [1, 0] and b.q_rows.tolist() == [0] and b.q_tokens.tolist() == [[5, 6, 7, 8]]
    rows, hashes = b.take(np.array([False, False]), hash_next_blocks)
    want = hash_prompt(np.array(r0.seq[:8]), bs)[1]
    assert rows.tolist() == [0] and hashes == [[want]] and b.q_rows.size == 0
    assert b.nh.tolist() == [2, 1] and b.queued.tolist() == [0, 0] and b.last_hash[0] == want
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
    b.push(idx)
    b.take(np.array([True]), hash_next_blocks)
    b.flush()
    assert r1.hashes.tolist() == hash_prompt(np.array(r1.seq[:8]), bs).tolist() and b.pending == []


def test_lockstep_fills_spread_over_steps_and_a_finishing_row_drains_its_chain():
    """40 rows fill a block at the same step: at most ``cap`` (16) are hashed per message, oldest
    first; a row that must finish takes every queued block, two chained blocks in order."""
    bs = 4
    reqs = [_decoding(f"r{i}", [i + 1] * 5, [100 + i, 200 + i, 300 + i], 30, bs) for i in range(40)]  # position 7
    b = SteadyBatch(reqs, np.arange(40), bs, "S16")
    assert b.cap == 20 and b.filled().tolist() == list(range(40))
    b.cap = 16
    b.push(np.arange(40))
    rows, hashes = b.take(np.zeros(40, bool), hash_next_blocks)
    assert rows.tolist() == list(range(16)) and b.q_rows.tolist() == list(range(16, 40))
    assert all(h == [hash_prompt(np.array(reqs[i].seq[:8]), bs)[1]] for i, h in zip(rows.tolist(), hashes))
    must = np.zeros(40, bool)
    must[39] = True
    rows, hashes = b.take(must, hash_next_blocks)
    assert rows.tolist() == list(range(16, 32)) + [39]
    b.registered(None, np.bincount(rows, minlength=40))  # kvd granted them
    b.registered(None, np.isin(np.arange(40), range(16)).astype(np.int64))
    assert b.queued.tolist() == [0] * 32 + [1] * 7 + [0]
    for _ in range(4):  # positions 8..11: the next block of every row
        _sample(b, [7] * 40)
    assert b.filled().tolist() == list(range(40))  # position 11 ends a block (queued ones counted)
    b.push(np.arange(40))  # rows 32..38 now queue two blocks each
    must = np.zeros(40, bool)
    must[35] = True
    rows, hashes = b.take(must, hash_next_blocks)
    # row 35 takes both of its blocks, chained; 16 others, oldest first
    assert rows.tolist() == list(range(32, 39)) + list(range(10))
    by_row = dict(zip(rows.tolist(), hashes))
    seq = reqs[35].seq  # the tokens were copied out of ``recent`` at push
    chain = hash_prompt(np.array(seq[:12]), bs)
    assert by_row[35] == [chain[1], chain[2]] and by_row[0] == [hash_prompt(np.array(reqs[0].seq[:12]), bs)[2]]
    assert by_row[32] == [hash_prompt(np.array(reqs[32].seq[:8]), bs)[1]]
    assert b.queued[35] == 0 and b.nh[35] == 3 and b.queued[32] == 1


def test_registering_every_k_messages_takes_the_prehashed_blocks():
    """``register_every`` 3: a message less than 3 after the last that registered carries no hash
    but a finishing row's; a later one takes every queued block ``prehash`` hashed (none hashed:
    the next message, due still, takes them), each row's chain in order; without a prehash since
    the last message, every queued block, hashed then."""
    bs = 4
    reqs = [_decoding(f"r{i}", [i + 1] * 5, [100 + i, 200 + i, 300 + i], 30, bs) for i in range(40)]  # position 7
    b = SteadyBatch(reqs, np.arange(40), bs, "S16", register_every=3)
    none = np.zeros(40, bool)
    b.push(b.filled())  # 40 blocks queue, cap (20) notwithstanding
    b.prehashed_since_take = True  # (a prehash ran before they were filled)
    assert b.take(none, hash_next_blocks)[0].tolist() == [] and b.since_registered == 1  # not due
    assert b.prehash(hash_next_blocks, lambda: False) == 40  # every queued block, not cap
    must = np.zeros(40, bool)
    must[7] = True  # a finishing row registers at once
    rows, hashes = b.take(must, hash_next_blocks)
    assert rows.tolist() == [7] and hashes == [[hash_prompt(np.array(reqs[7].seq[:8]), bs)[1]]]
    assert b.since_registered == 2
    b.registered(None, must.astype(np.int64))
    for _ in range(4):  # positions 8..11: every row fills its next block
        _sample(b, [9] * 40)
    b.push(b.filled())  # rows but 7 now queue two blocks each, the second not hashed; row 7 one
    b.prehashed_since_take = True
    rows, hashes = b.take(none, hash_next_blocks)  # due: the 39 prehashed blocks
    assert rows.tolist() == [*range(7), *range(8, 40)] and b.q_rows.tolist() == list(range(40))
    for i, h in zip(rows.tolist(), hashes):
        assert h == [hash_prompt(np.array(reqs[i].seq[:8]), bs)[1]], i
    assert b.since_registered == 0
    b.prehashed_since_take = True
    assert b.take(none, hash_next_blocks)[0].size == 0 and b.since_registered == 1
    assert b.take(none, hash_next_blocks)[0].size == 0 and b.since_registered == 2
    b.prehashed_since_take = True  # due, but nothing prehashed: none now, due still
    assert b.take(none, hash_next_blocks)[0].size == 0 and b.since_registered == 3
    rows, hashes = b.take(none, hash_next_blocks)  # no prehash since: every queued block, hashed now
    assert sorted(rows.tolist()) == list(range(40)) and b.q_rows.size == 0 and b.queued.tolist() == [0] * 40
    for i, h in zip(rows.tolist(), hashes):
        assert h == [hash_prompt(np.array(reqs[i].seq[:12]), bs)[2]], i
    assert b.since_registered == 0


def test_queued_blocks_register_by_their_requests_last_message():
    """Beyond ``cap``, a message takes as many queued blocks as an even rate needs to register each
    by its request's last message, the earliest deadlines first: rows 20..39 have 2 tokens to
    sample (2 messages), rows 0..19 27."""
    bs = 4
    reqs = [_decoding(f"r{i}", [i + 1] * 5, [100 + i, 200 + i, 300 + i], 5 if i >= 20 else 30, bs)
            for i in range(40)]
    b = SteadyBatch(reqs, np.arange(40), bs, "S16")
    b.cap = 4
    assert b.left.tolist() == [27] * 20 + [2] * 20
    b.push(b.filled())
    rows, _ = b.take(np.zeros(40, bool), hash_next_blocks)
    assert rows.tolist() == list(range(20, 30))  # 20 blocks due within 2 messages: 10 now
    _sample(b, [7] * 40)
    rows, hashes = b.take(b.left <= 1, hash_next_blocks)  # rows 30..39 finish: theirs, and cap others
    assert rows.tolist() == [0, 1, 2, 3] + list(range(30, 40))
    assert hashes[4] == [hash_prompt(np.array(reqs[30].seq[:8]), bs)[1]]
    assert b.q_rows.tolist() == list(range(4, 20)) and b.queued.tolist() == [0] * 4 + [1] * 16 + [0] * 20


def test_prehashed_blocks_are_what_a_message_registers():
    """``prehash`` hashes each row's oldest queued block (up to ``cap``, 16 a chunk, until
    ``stop``); after a prehash a message registers those (and what deadlines need), with the
    same hashes ``take`` would compute; a row's second block waits for its first."""
    bs = 4
    reqs = [_decoding(f"r{i}", [i + 1] * 5, [100 + i, 200 + i, 300 + i], 30, bs) for i in range(40)]
    b = SteadyBatch(reqs, np.arange(40), bs, "S16")
    b.cap = 20
    b.push(b.filled())
    b.push(np.array([3]))  # row 3 queues a second block (chained on its first)
    calls = []
    b.prehash(hash_next_blocks, lambda: (calls.append(1), len(calls) > 1)[1])  # stops before chunk 2
    assert b.q_hashed.tolist() == [True] * 16 + [False] * 25 and len(calls) == 2
    assert b.q_hash[5] == hash_prompt(np.array(reqs[5].seq[:8]), bs)[1]
    b.prehash(hash_next_blocks, lambda: False)  # 4 more: cap 20
    assert b.q_hashed.tolist() == [True] * 20 + [False] * 21
    assert b.nh.tolist() == [1] * 40 and b.queued[3] == 2  # nothing taken yet
    rows, hashes = b.take(np.zeros(40, bool), hash_next_blocks)
    assert rows.tolist() == list(range(20)) and b.q_rows.tolist() == list(range(20, 40)) + [3]
    assert all(h == [hash_prompt(np.array(reqs[i].seq[:8]), bs)[1]] for i, h in zip(rows.tolist(), hashes))
    b.cap = 24
    b.prehash(hash_next_blocks, lambda: False)
    assert b.q_hashed.tolist() == [True] * 21  # row 3's second block has its parent now
    must = np.zeros(40, bool)
    must[3] = True
    rows, hashes = b.take(must, hash_next_blocks)
    assert rows.tolist() == list(range(20, 40)) + [3] and b.q_rows.size == 0
    first = hash_prompt(np.array(reqs[3].seq[:8]), bs)[1]
    assert hashes[-1] == [hash_next_blocks(np.array([[4, 103, 203, 303]]), np.array([first]))[0]]


def test_prehash_keeps_up_with_near_deadlines():
    """Rows with 3 tokens to sample: the next message has 2 messages left for their blocks, so
    prehash hashes 20 of 40 (the even rate), not ``cap`` (4), and that message registers only
    those; a message with no prehash before it hashes by the rule without (cap, or the even rate)."""
    bs = 4
    reqs = [_decoding(f"r{i}", [i + 1] * 5, [100 + i, 200 + i, 300 + i], 6, bs) for i in range(40)]
    b = SteadyBatch(reqs, np.arange(40), bs, "S16")
    b.cap = 4
    b.push(b.filled())
    assert b.left.tolist() == [3] * 40
    assert b.prehash(hash_next_blocks, lambda: False) == 20
    assert b.q_hashed.tolist() == [True] * 20 + [False] * 20
    _sample(b, [7] * 40)
    rows, _ = b.take(b.left <= 1, hash_next_blocks)
    assert rows.tolist() == list(range(20)) and b.q_rows.tolist() == list(range(20, 40))
    rows, _ = b.take(np.zeros(40, bool), hash_next_blocks)  # no prehash since: 20 due in 2 messages
    assert rows.tolist() == list(range(20, 30))


def test_a_prehash_counts_for_the_next_message_only():
    """A prehash before a message with nothing queued does not make a later message wait for
    prehashed blocks: that one hashes by the rule without prehash (``cap``)."""
    bs = 4
    reqs = [_decoding(f"r{i}", [i + 1] * 5, [100 + i, 200 + i, 300 + i], 30, bs) for i in range(8)]
    b = SteadyBatch(reqs, np.arange(8), bs, "S16")
    b.cap = 3
    assert b.prehash(hash_next_blocks, lambda: False) == 0  # nothing queued yet
    assert b.take(np.zeros(8, bool), hash_next_blocks)[0].size == 0
    b.push(b.filled())
    rows, _ = b.take(np.zeros(8, bool), hash_next_blocks)
    assert rows.tolist() == [0, 1, 2]


def test_steady_batch_refuses_a_first_block_without_parent():
    r = _decoding("a", [1, 2], [3, 4], 8, 4)  # position 3 ends the first block: no parent hash
    assert len(r.hashes) == 0
    assert SteadyBatch([r], np.array([0]), 4, "S16").filled() is None


def _lookup_after(d, model, prompts, max_new, overlap, per_message=1, sent=None):
    """Run ``prompts``; then, from a second session of the tenant, how many leading blocks of each
    request's written tokens are cached. ``sent``: a list that gets every message's append count(s)."""
    with Client(d.endpoint, tenant="t", name="e", steps_in_flight=1) as c:
        eng = Engine(c, model, overlap=overlap, steps_per_message=per_message)
        if sent is not None:
            real = c.start_step

            def start_step(batch):  # every message's append counts, as sent
                n = batch.append_num_tokens
                sent.append(n if isinstance(n, int) else sorted(set(np.asarray(n).tolist())))
                return real(batch)

            c.start_step = start_step
        for rid, p in prompts.items():
            eng.add(rid, p, max_new[rid])
        eng.run()
        c.mark_computed()
        assert c.stats()["num_requests"] == 0
        with Client(d.endpoint, tenant="t", name="reader") as rd:
            cached = {rid: rd.lookup(c.hash_prompt(np.array(p + eng.reqs[rid].output[:-1])))
                      for rid, p in prompts.items()}
    return eng, cached


@pytest.mark.parametrize("cap", [None, 1], ids=["cap", "one_block_a_step"])
def test_overlap_requests_leaving_a_steady_batch_one_by_one(daemon_factory, monkeypatch, cap):
    """Requests finish at different steps: the batch compacts, a finishing request registers its
    last blocks with a 0-token append; tokens equal HF's and every written full block is cached,
    exactly as without overlap; the hashes kept in the batch reached every request. With one block
    registered a step, the queue lags and drains (a finishing request's all at once)."""
    if cap is not None:
        layout = SteadyBatch._layout

        def capped(self):
            layout(self)
            self.cap = cap

        monkeypatch.setattr(SteadyBatch, "_layout", capped)
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


class _Event:
    """A CUDA event stand-in: ``query()`` turns True after ``n`` calls."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def query(self):
        self.calls += 1
        return self.calls > self.n


class _Pending:
    """A PendingStep stand-in: ready after ``n`` polls; ``taken`` counts its takings."""

    def __init__(self, n):
        self.n, self.polls, self.taken = n, 0, 0

    def ready(self):
        self.polls += 1
        return self.polls > self.n

    def granted(self):
        self.taken += 1
        return True


def _overlapping(batch, pending):
    from kvd_engine.overlap import OverlapMixin

    class Eng(OverlapMixin):
        pass

    e = Eng()
    e._ahead, e._took, e._batch, e.prehashed_blocks = ("ids", 2, [0, 0], pending, 1e-4, 0.0, None), None, batch, 0
    e.kvd_s = e.kvd_wall_s = e.kvd_exposed_s = 0.0
    e.sends_s, e.takes_s = [], []
    e.phases = {}
    e.c = type("C", (), {"hash_next_blocks": staticmethod(hash_next_blocks)})()
    return e


def test_the_reply_is_taken_during_the_forward_when_it_comes_first_and_the_queue_prehashed():
    bs = 4
    reqs = [_decoding(f"r{i}", [i + 1] * 5, [100 + i, 200 + i, 300 + i], 30, bs) for i in range(4)]
    b = SteadyBatch(reqs, np.arange(4), bs, "S16")
    b.push(b.filled())
    pending = _Pending(3)
    e = _overlapping(b, pending)
    e._reply_or_gpu(_Event(100))  # the reply after 3 polls, the forward still running
    assert pending.taken == 1 and e._ahead[3] is pending and e._took is not None and e.prehashed_blocks == 4
    assert len(e.takes_s) == 1 and e.takes_s[0] == e._took[1] - e._took[0]  # the taking, as kvd_s counts it
    assert b.q_hashed.tolist() == [True] * 4
    e._ahead_exposed((0.0, 1e-6), gpu_done=1e9)  # the forward ended long after: nothing exposed
    assert e.kvd_exposed_s == 0.0 and e._took is None and e.phases["rt_exposed"] == 0.0


def test_the_reply_waits_for_the_sampling_when_the_forward_ends_first():
    b = SteadyBatch([_decoding("a", [1] * 5, [2, 3, 4], 30, 4)], np.arange(1), 4, "S16")
    pending = _Pending(100)
    e = _overlapping(b, pending)
    e._reply_or_gpu(_Event(2))
    assert pending.taken == 0 and e._took is None and e.prehashed_blocks == 0
    e._ahead_exposed((0.0, 0.0), gpu_done=0.0)  # after the sampling: taking it is exposed
    assert pending.taken == 1 and e._ahead[3] is pending and e.kvd_exposed_s > 0


def _windowed(d, model, prompts, max_new, per_message):
    sent: list = []
    eng, cached = _lookup_after(d, model, prompts, max_new, True, per_message, sent)
    return eng, cached, sent


@pytest.mark.parametrize("per_message", [3, 8])
def test_multi_step_windows_match_hf_with_one_message_per_window(daemon_factory, per_message):
    """steps_per_message=k: a steady batch's message appends k tokens per request (fewer where a
    request has fewer left) and k steps run on it, the next window's message sent a step before the
    window ends; tokens equal HF's, every written full block is cached exactly as with a message per
    step, and the windows' messages are the only ones sent."""
    model = model_of(LLAMA)
    rng = np.random.default_rng(21)
    # prompts of a full block at least: the batch's first block to fill has a parent hash (a first
    # block without one makes the steady batch fall back to a generic message for that step)
    prompts = {f"r{i}": rng.integers(0, 512, int(rng.integers(BLOCK, 30))).tolist() for i in range(4)}
    max_new = {rid: 20 for rid in prompts}
    runs = {}
    for k in (1, per_message):
        d = daemon_factory(**DAEMON, tenants="t=uid:" + str(os.getuid()))
        runs[k] = _windowed(d, model, prompts, max_new, k)
    eng, cached, sent = runs[per_message]
    for rid, p in prompts.items():
        assert eng.reqs[rid].output == hf_generate(model, p, 20)[0], rid
    assert cached == runs[1][1] == {rid: (len(p) + 19) // BLOCK for rid, p in prompts.items()}
    # the first decode step is generic (it makes the batch steady) and sends the first window with
    # 18 tokens left to sample after it: windows of k while >= k are left, then what is left, then
    # the finishing message (0 tokens: the blocks the last window filled register)
    left, windows = 18, []
    while left:
        windows.append(min(per_message, left))
        left -= windows[-1]
    assert sent == windows + [0]
    # a message per step; the blocks register with every BLOCK-th message (the engine's default
    # register_every), the last ones with a finishing message
    assert runs[1][2] == [1] * 18 + [0]
    # 18 steps on the batch's arrays, and the one that takes the finishing message's reply
    assert eng.ahead_steps == len(windows) + 1 and eng.steady_steps == 19
    # every window's message but the first (sent by the generic step) went out on the previous
    # window's next-to-last step, unless that window ends a request (k = 8: the last, of 2 steps)
    assert eng.early_messages == {3: 5, 8: 2}[per_message] and runs[1][0].early_messages == 0


def test_multi_step_window_refused_in_part_holds_tokens_and_matches_hf(daemon_factory):
    """A pool too small for a window: kvd grants some requests' k tokens and refuses others; the
    granted ones hold k - 1 tokens their next steps take with 0-token appends (no second grant),
    the refused are preempted by swap as usual; tokens equal HF's, the pool ends empty."""
    d = daemon_factory(**dict(DAEMON, num_gpu_blocks=24, num_cpu_blocks=64))
    model = model_of(LLAMA)
    rng = np.random.default_rng(4)
    prompts = {f"r{i}": rng.integers(0, 512, int(rng.integers(20, 30))).tolist() for i in range(6)}
    with Client(d.endpoint, name="e", steps_in_flight=1) as c:
        eng = Engine(c, model, overlap=True, steps_per_message=8)
        held = []
        real = Engine._took_reply

        def took(self, res):  # the requests holding tokens after each reply
            real(self, res)
            held.append(sum(r.held for r in self.reqs.values()))

        eng._took_reply = took.__get__(eng)
        for rid, p in prompts.items():
            eng.add(rid, p, 20)  # 6 x (up to 50 tokens = 7 blocks) > 23 blocks
        eng.run()
        assert eng.swaps_out >= 1 and eng.swaps_in == eng.swaps_out
        assert max(held) > 0 and held[-1] == 0
        assert all(r.held == 0 for r in eng.reqs.values())
        assert c.stats()["num_used_blocks"] == 0
    for rid, p in prompts.items():
        assert eng.reqs[rid].output == hf_generate(model, p, 20)[0], rid


def test_steps_per_message_needs_overlap():
    model = model_of(LLAMA)
    from kvd_engine import InProcClient, OwnedKv
    import torch

    kv = OwnedKv(2, 65, BLOCK, 2, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="steps_per_message"):
        Engine(InProcClient(64, BLOCK), model, kv=kv, steps_per_message=4)
    with pytest.raises(ValueError, match="steps_per_message"):
        Engine(InProcClient(64, BLOCK), model, kv=kv, overlap=True, steps_per_message=0)


def test_multi_step_windows_with_arrivals_and_the_in_process_manager():
    """Windows with the in-process manager (InProcClient), requests arriving during decode: an
    arrival waits for its window's end (the generic step admits it), every request's tokens equal
    HF's, and windows run both before and after the arrivals."""
    import torch

    from kvd_engine import InProcClient, OwnedKv

    model = model_of(LLAMA)
    rng = np.random.default_rng(17)
    prompts = {f"r{i}": rng.integers(0, 512, int(rng.integers(BLOCK, 30))).tolist() for i in range(6)}
    eng = Engine(InProcClient(512, BLOCK), model, kv=OwnedKv(2, 513, BLOCK, 2, 16, torch.float32, "cpu"),
                 overlap=True, steps_per_message=4)
    order = list(prompts)
    for rid in order[:3]:
        eng.add(rid, prompts[rid], 16)
    arrivals = [order[3:5], order[5:]]
    waited = []
    while eng.busy:
        eng.step()
        if arrivals and eng._window_left > 0:  # mid-window: the arrivals wait for the window's end
            steps_before, adm_before = eng.steps, eng.c.m.num_requests
            for rid in arrivals.pop(0):
                eng.add(rid, prompts[rid], 16)
            left = eng._window_left
            for _ in range(left):
                eng.step()
            waited.append((eng.c.m.num_requests == adm_before, eng.steps - steps_before == left))
    assert waited == [(True, True), (True, True)]  # no admission while the window ran
    assert eng.early_messages > 0 and eng.ahead_steps < eng.steady_steps
    for rid, p in prompts.items():
        assert eng.reqs[rid].output == hf_generate(model, p, 16)[0], rid


def test_windows_fit_the_daemons_max_num_batched_tokens(daemon_factory):
    """A window's message carries K tokens a request: with 6 requests and a daemon that takes 16
    tokens a message, windows of 8 shrink to 2 steps (16 // 6) instead of being refused."""
    d = daemon_factory(**dict(DAEMON, max_num_batched_tokens=16))
    model = model_of(LLAMA)
    rng = np.random.default_rng(8)
    prompts = {f"r{i}": rng.integers(0, 512, int(rng.integers(BLOCK, 16))).tolist() for i in range(6)}
    with Client(d.endpoint, name="e", steps_in_flight=1) as c:
        eng = Engine(c, model, overlap=True, steps_per_message=8, max_tokens=16)
        sent = []
        real = c.start_step
        c.start_step = lambda batch: (sent.append(batch.append_num_tokens), real(batch))[1]
        for rid, p in prompts.items():
            eng.add(rid, p, 12)
        eng.run()
    assert sent and max(np.max(n) for n in sent) == 2 and eng.early_messages > 0
    for rid, p in prompts.items():
        assert eng.reqs[rid].output == hf_generate(model, p, 12)[0], rid
