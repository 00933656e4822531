"""The engine (examples/kvd_engine) on a real daemon: HF-identical tokens through prefix hits,
chunked prefill, forks (copy-on-write by the daemon), swap preemption and a hybrid model."""

from __future__ import annotations


import numpy as np
import pytest

from tests.conftest_daemon import daemon_factory, short_tmp  # noqa: F401
from tests.engine_common import BLOCK, DAEMON, HYBRID, LLAMA, assert_matches_hf, model_of, run_three_parents_forking

import torch  # noqa: E402

from kvd.config import ConfigError, ServeConfig  # noqa: E402
from kvd_client import Client  # noqa: E402
from kvd_engine import Engine, InProcClient, OwnedKv, hf_generate  # noqa: E402


def _client(d):
    return Client(d.endpoint, name="engine-test", steps_in_flight=0)  # each test's own daemon: a fresh prefix cache


def _prompts(rng, n, lo, hi, vocab=512):
    return {f"r{i}": rng.integers(0, vocab, int(rng.integers(lo, hi))).tolist() for i in range(n)}


def test_32_prompts_arriving_during_decode_match_hf(daemon_factory):
    d = daemon_factory(**DAEMON)
    model = model_of(LLAMA)
    rng = np.random.default_rng(1)
    prompts = _prompts(rng, 32, 3, 60)
    with _client(d) as c:
        eng = Engine(c, model, max_tokens=48)  # < the longest prompts: chunked prefill
        eng.check_slots = True
        order = list(prompts)
        for rid in order[:8]:
            eng.add(rid, prompts[rid], 8)
        arrivals = iter(order[8:])
        while eng.busy:
            eng.step()
            for rid in [next(arrivals, None) for _ in range(3)]:
                if rid is not None:
                    eng.add(rid, prompts[rid], 8)
        assert all(eng.reqs[r].prefilled_tokens == len(prompts[r]) for r in order)
        assert max(eng.reqs[r].first_token_step - eng.reqs[r].admitted_step for r in order) >= 1  # chunked
        # steps with a continuing chunk take their slots from the tables, the others kvd's (checked equal)
        assert 0 < eng.kvd_slot_steps < eng.forwards
        assert_matches_hf(model, eng, prompts, 8)
        assert c.stats()["num_requests"] == 0


def test_prefix_hit_within_an_engine_prefills_only_the_suffix(daemon_factory):
    d = daemon_factory(**DAEMON)
    model = model_of(LLAMA)
    rng = np.random.default_rng(2)
    system = rng.integers(0, 512, 44).tolist()
    prompts = {"a": system + [5, 6, 7], "b": system + [9, 10, 11, 12]}
    with _client(d) as c:
        eng = Engine(c, model)
        eng.check_slots = True
        eng.add("a", prompts["a"], 6)
        eng.step()
        eng.step()  # a's prompt blocks are written (and, with issue 14, confirmed)
        eng.add("b", prompts["b"], 6)
        eng.run()
        assert eng.reqs["b"].cached_tokens == 40  # 5 full blocks of 8 of the 44 shared tokens
        assert eng.reqs["b"].prefilled_tokens == len(prompts["b"]) - 40
        # every forward is kvd's schedule (the hit's suffix included): kvd's slot mapping serves it
        assert eng.kvd_slot_steps == eng.forwards == 8  # a: steps 1-6, b: steps 3-8
        assert_matches_hf(model, eng, prompts, 6)


_FORK_MODES = {"sync": {}, "overlap": dict(overlap=True), "windows": dict(overlap=True, steps_per_message=4)}


@pytest.mark.parametrize("mode", list(_FORK_MODES))
@pytest.mark.parametrize("owned", [False, True], ids=["daemon-kv", "engine-kv"])
def test_fork_n4_copy_on_write_matches_hf(daemon_factory, owned, mode):
    """With overlap (and multi-step windows) too: the fork's step and the forked requests' first
    appends, which copy on write, go synchronously (the engine asserts that no reply of a message
    sent during a forward carries a copy); the steps after them go ahead again."""
    opts = dict(DAEMON)
    if owned:
        opts.pop("kv_cache")
    d = daemon_factory(**opts)
    model = model_of(LLAMA)
    prompt = np.random.default_rng(3).integers(0, 512, 21).tolist()  # partial last block: shared by forks
    with Client(d.endpoint, name="engine-test", steps_in_flight=int(mode != "sync"), mailbox=True) as c:
        kv = OwnedKv(2, 513, BLOCK, 2, 16, torch.float32, "cpu") if owned else None
        eng = Engine(c, model, kv=kv, **_FORK_MODES[mode])
        eng.add("s0", prompt, 10)
        eng.step()
        first = eng.reqs["s0"].output[0]
        forced = {"s0": {}}
        for i in (1, 2, 3):
            tok = (first + 100 * i) % 512
            eng.fork("s0", f"s{i}", tok)
            forced[f"s{i}"] = {0: tok}
        eng.run()
        # the partial 3rd block is shared by 4: the parent writes first (copy), then s1 and s2 (copies);
        # s3, the last holder, writes in place
        assert eng.copies == 3
        # prefill, the fork's step, the children's first appends: synchronous; then ahead
        assert (eng.ahead_steps > 0) == (mode != "sync") and not eng.unsplit
        outs = [tuple(eng.reqs[f"s{i}"].output) for i in range(4)]
        assert len(set(outs)) == 4
        assert_matches_hf(model, eng, {f"s{i}": prompt for i in range(4)}, 10, forced)
        assert c.stats()["num_requests"] == 0 and c.mailbox


@pytest.mark.parametrize("per_message", [1, 4], ids=["overlap", "windows-of-4"])
def test_forks_of_several_parents_in_one_step_overlapped_match_hf(daemon_factory, per_message):
    """Three requests fork three children each in one step (test_engine_gpu's twin on the CPU):
    nine copies, every sample HF's with its forced first token, the steps after the children's
    first appends ahead again."""
    d = daemon_factory(**DAEMON)
    model = model_of(LLAMA)
    with Client(d.endpoint, name="engine-test", steps_in_flight=1) as c:
        eng = Engine(c, model, max_tokens=64, overlap=True, steps_per_message=per_message)
        run_three_parents_forking(eng, model)
        assert eng.ahead_steps > 0 and c.stats()["num_requests"] == 0


@pytest.mark.parametrize("owned", [False, True], ids=["daemon-kv", "engine-kv"])
def test_preemption_by_swap_matches_hf(daemon_factory, owned):
    opts = dict(DAEMON, num_gpu_blocks=24, num_cpu_blocks=64)
    if owned:
        opts.pop("kv_cache")
    d = daemon_factory(**opts)
    model = model_of(LLAMA)
    prompts = _prompts(np.random.default_rng(4), 6, 20, 30)
    with _client(d) as c:
        kv = OwnedKv(2, 25, BLOCK, 2, 16, torch.float32, "cpu", num_cpu_blocks=65) if owned else None
        eng = Engine(c, model, kv=kv)
        for rid, p in prompts.items():
            eng.add(rid, p, 20)  # 6 x (up to 50 tokens = 7 blocks) > 23 blocks
        eng.run()
        assert eng.swaps_out >= 1 and eng.swaps_in == eng.swaps_out
        assert_matches_hf(model, eng, prompts, 20)


def test_hybrid_sliding_window_two_groups_match_hf(daemon_factory):
    d = daemon_factory(**DAEMON, kv_groups=f"{BLOCK},{BLOCK}:{HYBRID['window']}")
    model = model_of(HYBRID)
    rng = np.random.default_rng(5)
    prompts = _prompts(rng, 6, 5, 40)
    with _client(d) as c:
        assert c.block_sizes == (BLOCK, BLOCK)
        eng = Engine(c, model, max_tokens=32)
        eng.check_slots = True
        for rid, p in prompts.items():
            eng.add(rid, p, 24)
        r = eng.reqs["r0"]
        while len(r.output) < 12:
            eng.step()
        # kvd released the window group's blocks that fell out of the window before this decode
        # token (position computed - 1; it attends to positions > computed - 1 - window) and no
        # others; HF's mask agrees (the tokens below match) though those blocks are gone
        skipped = int((c.block_table("r0", 1) == 0).sum())
        assert skipped == max(r.computed - 1 - HYBRID["window"] + 1, 0) // BLOCK >= 2
        assert int((c.block_table("r0", 0) == 0).sum()) == 0
        eng.run()
        assert_matches_hf(model, eng, prompts, 24)


def test_in_process_block_manager_matches_hf():
    model = model_of(HYBRID)
    prompts = _prompts(np.random.default_rng(6), 5, 5, 40)
    c = InProcClient(200, BLOCK, window=HYBRID["window"], num_cpu_blocks=0)
    eng = Engine(c, model, kv=OwnedKv(2, 200, BLOCK, 2, 16, torch.float32, "cpu"), max_tokens=32)
    for rid, p in prompts.items():
        eng.add(rid, p, 12)
    eng.run()
    assert_matches_hf(model, eng, prompts, 12)
    assert c.stats()["num_requests"] == 0


def test_in_process_client_loads_the_managers_compiled_loops_first(monkeypatch):
    """As a daemon does at start (kvd.manager.warm_up), before the manager exists: else each loop
    loads inside the first step that calls it, a step of the engine's timed ones."""
    import kvd_engine.inproc as inproc

    calls = []
    real = inproc.BlockManager
    monkeypatch.setattr(inproc, "warm_up", lambda: calls.append("warm_up"))
    monkeypatch.setattr(inproc, "BlockManager", lambda cfg: calls.append("manager") or real(cfg))
    c = InProcClient(16, BLOCK)
    assert calls == ["warm_up", "manager"]
    assert c.stats()["num_requests"] == 0


def test_kv_cache_serves_several_groups_of_one_block_size():
    ServeConfig(kv_cache="2,2,16,float32", kv_groups="8,8:12")
    with pytest.raises(ConfigError, match="one block size"):
        ServeConfig(kv_cache="2,2,16,float32", kv_groups="8,16:12")


def test_the_triton_kernels_drive_the_same_engine(monkeypatch):
    """The GPU code path's kernels (Triton; under TRITON_INTERPRET=1 on CPU tensors here) in the
    engine: hybrid model, prefill chunks, decode, windows. Tokens identical to HF."""
    import os

    import kvd_kernels

    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs a GPU or the Triton interpreter")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(kvd_kernels, "write_kv", kvd_kernels.write_kv_triton)
    monkeypatch.setattr(kvd_kernels, "paged_attention", kvd_kernels.paged_attention_triton)
    model = model_of(HYBRID).to(dev)
    prompts = _prompts(np.random.default_rng(9), 2, 14, 30)  # > the window: blocks get released
    c = InProcClient(64, BLOCK, window=HYBRID["window"])
    eng = Engine(c, model, kv=OwnedKv(2, 64, BLOCK, 2, 16, torch.float32, dev), max_tokens=24, device=dev)
    for rid, p in prompts.items():
        eng.add(rid, p, 8)
    eng.run()
    assert_matches_hf(model, eng, prompts, 8)


def test_keep_logits_off_samples_the_same_tokens(daemon_factory):
    d = daemon_factory(**DAEMON)
    model = model_of(LLAMA)
    prompts = _prompts(np.random.default_rng(10), 6, 5, 30)
    outs = []
    for keep in (True, False):
        with _client(d) as c:
            eng = Engine(c, model, keep_logits=keep)
            for rid, p in prompts.items():
                eng.add(rid, p, 7)
            eng.run()
            outs.append({rid: r.output for rid, r in eng.reqs.items()})
            assert all(len(r.logits) == (7 if keep else 0) for r in eng.reqs.values())
    assert outs[0] == outs[1] == {rid: hf_generate(model, p, 7)[0] for rid, p in prompts.items()}


def _run_and_lookup(d, model, prompts, max_new, overlap):
    """Run ``prompts`` in one engine; then, from a second session of the tenant, how many leading
    blocks of each request's written tokens (prompt + all outputs but the last) are cached."""
    with Client(d.endpoint, tenant="t", name="e", steps_in_flight=1) as c:
        eng = Engine(c, model, overlap=overlap)
        for rid, p in prompts.items():
            eng.add(rid, p, max_new)
        eng.run()
        c.mark_computed()  # every step's forward has finished: all its blocks may be shared
        assert c.stats()["num_requests"] == 0
        with Client(d.endpoint, tenant="t", name="reader") as r:
            cached = {rid: r.lookup(c.hash_prompt(np.array(p + eng.reqs[rid].output[:-1])))
                      for rid, p in prompts.items()}
        return eng, cached


def test_overlap_sends_decode_steps_ahead_with_the_same_tokens_and_cache(daemon_factory):
    """overlap=True: steady decode steps go out while the previous forward runs; tokens and logits
    equal HF's, every written full block ends up cached exactly as without overlap (a block the next
    token fills registers one message later; a finishing request's last blocks by a 0-token append),
    and every request is freed."""
    model = model_of(LLAMA)
    prompts = _prompts(np.random.default_rng(11), 6, 5, 30)
    runs = {}
    for overlap in (False, True):
        d = daemon_factory(**DAEMON, tenants="t=uid:" + str(__import__("os").getuid()))
        runs[overlap] = _run_and_lookup(d, model, prompts, 21, overlap)
    eng, cached = runs[True]
    assert eng.ahead_steps >= 15 and runs[False][0].ahead_steps == 0
    assert eng.steady_steps >= 14 and runs[False][0].steady_steps == 0  # steps on the arrays (steady.py)
    assert eng.kvd_exposed_s == eng.kvd_s  # on the CPU every round trip is exposed (the forward runs first)
    assert_matches_hf(model, eng, prompts, 21)
    written = {rid: (len(p) + 20) // BLOCK for rid, p in prompts.items()}
    assert cached == runs[False][1] == written
