"""KV events per request run (kvd.runs): every BlockStored the manager logs is one request's
contiguous run with its parent, through batched admissions, decode steps, confirmations by a
later writer, races, forks and swaps; token ids when supplied."""

from __future__ import annotations

import numpy as np
import pytest

import kvd.manager as M
from kvd import errors
from kvd.api import AdmitRequest, GroupSpec, ManagerConfig, StepBatch
from kvd.hashing import hash_prompt
from kvd.manager import BlockManager
from kvd.runs import NO_PARENT, NO_TOKENS, Runs, expand

BS = 4


def _manager(**kw) -> BlockManager:
    cfg = dict(num_gpu_blocks=32, groups=(GroupSpec(block_size=BS),), max_model_len=64, max_num_reqs=8,
               debug_checks=True)
    cfg.update(kw)
    return BlockManager(ManagerConfig(**cfg))


def _chain(tokens, parent=None, first_block=0):
    return hash_prompt(np.array(tokens), BS, parent=parent, first_block_index=first_block)


def _entries(log):
    """(hashes, parent, token ids or None) of each event the log's stored entries make, then clear it."""
    out = [(e[2], e[3], None if e[4] is None else e[4].ravel().tolist()) for e in expand(log) if e[0] == "stored"]
    log.clear()
    return out


def test_runs_cut_where_a_request_starts_or_a_block_is_missing():
    h = np.array([bytes([i]) * 16 for i in range(1, 7)], "S16")
    a = Runs.chain(h[:3], NO_PARENT, np.arange(12, dtype=np.int32).reshape(3, 4))
    b = Runs.chain(h[3:], h[2])  # continues a's chain, but is another request: another event
    both = Runs.concat([a, b])
    assert both.tokens[3:].tolist() == [[NO_TOKENS] * 4] * 3
    entries = both.entries(7, h)
    assert [(e[2], e[3]) for e in entries] == [(h[:3].tolist(), None), (h[3:].tolist(), h[2])]
    assert entries[0][4].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] and entries[1][4] is None
    keep = np.array([True, False, True, True, True, False])  # a's middle block and b's last are gone
    cut = both.take(keep).entries(7, h[keep])
    assert [(e[2], e[3]) for e in cut] == [([h[0]], None), ([h[2]], h[1]), (h[3:5].tolist(), h[2])]
    one = Runs.one_each(np.array([h[0], NO_PARENT], "S16")).entries(1, h[1:3])
    assert [(e[2], e[3], e[4]) for e in one] == [([h[1]], h[0], None), ([h[2]], None, None)]


def test_a_batched_admission_and_a_decode_step_log_one_run_per_request_with_parents_and_tokens():
    m = _manager()
    log = m.enable_kv_events()
    system = list(range(8))
    p = [system + [100, 101, 102, 103, 104], system + [200, 201, 202, 203, 204, 205], [7] * 6]
    h = [_chain(x) for x in p]
    res = m.step(StepBatch(admit=[AdmitRequest("a", 13, h[0], token_ids=p[0]),
                                  AdmitRequest("b", 14, h[1], token_ids=np.array(p[1])),
                                  AdmitRequest("c", 6, h[2])]))  # c supplies no token ids
    assert res.admit_cached_tokens.tolist() == [0, 8, 0]
    assert _entries(log) == [(h[0].tolist(), None, p[0][:12]),
                             (h[1][2:].tolist(), h[1][1], p[1][8:12]),  # b hit a's 2 system blocks
                             (h[2][:1].tolist(), None, None)]
    # a decode step: a and b fill a block, c does not
    m.step(StepBatch(append_ids=["a", "b", "c"], append_num_tokens=np.array([3, 2, 1])))
    fill = [p[0][12:13] + [1, 2, 3], p[1][12:14] + [4, 5]]
    new = [_chain(fill[0], h[0][-1], 3), _chain(fill[1], h[1][-1], 3)]
    m.step(StepBatch(append_ids=["a", "b", "c"], append_num_tokens=0, append_hashes=(np.concatenate(new),),
                     append_hash_counts=(np.array([1, 1, 0]),), append_token_ids=(np.array(fill[0] + fill[1]),)))
    assert _entries(log) == [(new[0].tolist(), h[0][-1], fill[0]), (new[1].tolist(), h[1][-1], fill[1])]


def _deferred_decode_step(p):
    """A manager deferring like a daemon's, requests admitted with prompts ``p`` (7 tokens each),
    then a decode step filling each one's second block: (manager, log, prompt hashes, new hashes)."""
    m = _manager(defer_cache_registration=True, debug_checks=False)  # the heavy check would flush
    log = m.enable_kv_events()
    h = [_chain(x[:4]) for x in p]
    r = m.step(StepBatch(admit=[AdmitRequest(i, 7, hs) for i, hs in enumerate(h)]))
    _entries(log)
    rows = r.admit_rows.astype(np.int32)
    new = [_chain(x[4:] + [0], hs[0], 1) for x, hs in zip(p, h)]
    m.step(StepBatch(append_rows=rows, append_num_tokens=1, append_hashes=(np.concatenate(new),),
                     append_hash_counts=(np.ones(len(p), np.int32),),
                     append_token_ids=(np.array([x[4:] + [0] for x in p], np.int32),)))
    return m, log, h, new


def test_a_decode_step_the_daemon_defers_logs_its_runs_at_the_flush():
    p = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3]]
    m, log, h, new = _deferred_decode_step(p)
    assert log == []  # registered after the reply
    m.flush_deferred()
    assert _entries(log) == [(new[i].tolist(), h[i][0], p[i][4:] + [0]) for i in range(2)]
    m.check_invariants(heavy=True)


def test_a_deferred_registration_flushed_in_slices_registers_requests_in_order_and_keeps_the_rest():
    p = [[i * 10 + t for t in range(7)] for i in range(3)]
    m, log, h, new = _deferred_decode_step(p)
    assert m.flush_deferred(max_rows=2) == 2  # the first two requests' blocks; the third stays queued
    assert _entries(log) == [(new[i].tolist(), h[i][0], p[i][4:] + [0]) for i in range(2)]
    assert m.num_deferred == 1
    assert m.flush_deferred(max_rows=2) == 1
    assert m.flush_deferred(max_rows=2) == 0
    assert _entries(log) == [(new[2].tolist(), h[2][0], p[2][4:] + [0])] and m.num_deferred == 0
    assert [m.lookup(np.r_[h[i], new[i]]) for i in range(3)] == [2, 2, 2]
    m.check_invariants(heavy=True)


def test_a_writers_runs_wait_for_its_confirmation_and_keep_their_parents_across_promotion_batches(monkeypatch):
    monkeypatch.setattr(M, "PROMOTE_BATCH", 2)
    m = _manager(defer_cache_registration=True)
    log = m.enable_kv_events()
    p = [list(range(13)), list(range(50, 63))]
    h = [_chain(x) for x in p]
    r = m.step(StepBatch(admit=[AdmitRequest(i, 13, hs, token_ids=x) for i, (x, hs) in enumerate(zip(p, h))]),
               writer=1)
    assert log == []  # unconfirmed: nothing published
    m.mark_computed(1, r.tick)
    m.flush_deferred()  # two of the six blocks per flush
    assert _entries(log) == [(h[0][:2].tolist(), None, p[0][:8])]
    m.flush_deferred()
    assert _entries(log) == [([h[0][2]], h[0][1], p[0][8:12]), ([h[1][0]], None, p[1][:4])]
    m.flush_deferred()
    assert _entries(log) == [(h[1][1:].tolist(), h[1][0], p[1][4:12])]
    m.check_invariants(heavy=True)


def test_a_run_part_of_which_another_writer_confirmed_first_publishes_the_rest_after_it():
    m = _manager()
    log = m.enable_kv_events()
    p = list(range(13))
    h = _chain(p)
    m.allocate("a", 13, h, writer=1, token_ids=p)  # 3 blocks, unconfirmed by writer 1
    m.allocate("b", 5, h[:1], writer=2, token_ids=p[:5])  # writer 2's own copy of block 0
    m.mark_computed(2, m.tick)
    assert _entries(log) == [(h[:1].tolist(), None, p[:4])]
    m.mark_computed(1, m.tick)  # a's block 0 lost: the rest of its run, after block 0's hash
    assert _entries(log) == [(h[1:].tolist(), h[0], p[4:12])]


def test_a_forked_childs_chain_goes_on_from_its_parents():
    m = _manager()
    log = m.enable_kv_events()
    p = [1, 2, 3, 4, 5, 6]
    h = _chain(p)
    m.allocate("a", 6, h)
    m.fork("a", "b")
    _entries(log)
    fill = {"a": [7, 8], "b": [9, 10]}
    new = {r: _chain(p[4:] + t, h[0], 1) for r, t in fill.items()}
    m.step(StepBatch(append_ids=["a", "b"], append_num_tokens=2, append_hashes=(np.concatenate([new["a"], new["b"]]),),
                     append_hash_counts=(np.array([1, 1]),),
                     append_token_ids=(np.array(p[4:] + fill["a"] + p[4:] + fill["b"]),)))
    assert _entries(log) == [(new[r].tolist(), h[0], p[4:] + fill[r]) for r in "ab"]


def test_a_block_another_request_had_cached_is_still_its_chains_parent():
    m = _manager()
    log = m.enable_kv_events()
    p = list(range(8))
    h = _chain(p)
    m.step(StepBatch(admit=[AdmitRequest("a", 8, h), AdmitRequest("b", 8, h)]))
    # b hits (8 - 1) // 4 = 1 block; its second block is a duplicate of a's: not stored again
    assert _entries(log) == [(h.tolist(), None, None)]
    fill = [8, 9, 10, 11]
    new = _chain(fill, h[1], 2)
    m.append_slots("b", 4, new, new_block_token_ids=fill)
    assert _entries(log) == [(new.tolist(), h[1], fill)]


def test_swapped_in_content_is_registered_again_as_its_requests_run():
    m = _manager(num_gpu_blocks=9, num_cpu_blocks=8)
    log = m.enable_kv_events()
    p = list(range(13))
    h = _chain(p)
    m.allocate("a", 13, h)
    assert m.swap_out("a").ok  # blocks 1-4 free; the full ones stay cached, tail first in the queue
    m.allocate("b", 4 * 6 + 1, ())  # the 4 fresh blocks, then evicts blocks 3, 2 (a's h2, h1)
    _entries(log)
    m.free("b")
    assert m.swap_in("a").ok  # h0 still cached: reused; h1, h2 registered again after it
    assert _entries(log) == [(h[1:].tolist(), h[0], None)]


def test_token_ids_are_checked_and_bad_ones_change_nothing():
    m = _manager()
    log = m.enable_kv_events()
    h = _chain(list(range(8)))
    with pytest.raises(errors.InvalidArgument):
        m.allocate("a", 9, h, token_ids=list(range(7)))  # fewer than the 8 its hashes cover
    with pytest.raises(errors.InvalidArgument):
        m.allocate("a", 9, h, token_ids=[0.5] * 9)
    with pytest.raises(errors.InvalidArgument):
        m.allocate("a", 9, h, token_ids=np.full(9, -1, np.int32))  # what the daemon passes: int32
    res = m.step(StepBatch(admit=[AdmitRequest("a", 9, h, token_ids=[-1] * 9), AdmitRequest("b", 9, h)]))
    assert res.admit_status.tolist() == [errors.InvalidArgument.code, 0] and "a" not in m
    assert _entries(log) == [(h.tolist(), None, None)]
    before = m.num_tokens.copy()
    new = _chain([8, 9, 10, 11], h[1], 2)
    with pytest.raises(errors.InvalidArgument):
        m.step(StepBatch(append_ids=["b"], append_num_tokens=3, append_hashes=(new,), append_hash_counts=(np.array([1]),),
                         append_token_ids=(np.arange(3),)))  # 3 ids for a block of 4
    assert np.array_equal(m.num_tokens, before) and log == []


def test_without_events_token_ids_are_checked_but_not_kept():
    m = _manager()
    h = _chain(list(range(8)))
    with pytest.raises(errors.InvalidArgument):
        m.allocate("a", 9, h, token_ids=list(range(20)))  # more than the prompt
    assert m.allocate("a", 9, h, token_ids=list(range(9))).ok
    assert m._tails is None and m.pool.event_log is None
    # enabling now is refused: a request's chain is followed from its admission
    with pytest.raises(errors.InvalidArgument):
        m.enable_kv_events()


def test_a_writer_with_two_groups_publishes_each_groups_runs_under_its_map():
    m = _manager(groups=(GroupSpec(block_size=BS), GroupSpec(block_size=2 * BS)))
    log = m.enable_kv_events()
    p = list(range(17))
    h0, h1 = _chain(p), hash_prompt(np.array(p), 2 * BS)
    m.allocate("a", 17, [h0, h1], writer=1, token_ids=p)
    assert log == []
    m.mark_computed(1, m.tick)
    keys = [m._cache_key(m._space(0, 0), g) for g in (0, 1)]
    got = [(e[1], e[2], e[3], e[4].ravel().tolist()) for e in expand(log)]
    assert got == [(keys[0], h0.tolist(), None, p[:16]), (keys[1], h1.tolist(), None, p[:16])]


def test_a_writers_events_carry_the_token_ids_it_gave_though_it_reused_its_buffer_before_confirming():
    """Events of a writer's blocks go out at its confirmation, later than the call that gave their
    token ids: what they carry is what that call was given."""
    m = _manager(debug_checks=False)
    log = m.enable_kv_events()
    ids = np.arange(13, dtype=np.int32)  # the caller's buffer (int32: the manager's own dtype)
    given = ids.copy()
    m.allocate("a", 13, _chain(ids), writer=1, token_ids=ids)
    _entries(log)
    ids[:] = 99  # reused before the confirmation
    m.mark_computed(1, m.tick)
    m.flush_deferred()
    (hashes, parent, tokens), = _entries(log)
    assert hashes == _chain(given).tolist() and parent is None and tokens == given[:12].tolist()
