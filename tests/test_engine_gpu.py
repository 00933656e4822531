"""The engine on a GPU (marked cuda; skipped without one): CUDA graphs of small steps and overlapped
round trips give HF's tokens (float32), through a GPU daemon (kvd's tables and slots over CUDA IPC,
the daemon's KV cache) and through the in-process manager (host tables copied into the graphs'
buffers)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.conftest_daemon import daemon_factory, short_tmp  # noqa: F401
from tests.engine_common import BLOCK, DAEMON, HYBRID, LLAMA, assert_matches_hf, model_of, run_three_parents_forking

import torch  # noqa: E402

from kvd_client import Client  # noqa: E402
from kvd_engine import Engine, InProcClient, OwnedKv  # noqa: E402

pytestmark = pytest.mark.cuda


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("triton")


def _drive(eng, prompts, max_new):
    """8 requests first, the others arriving 2 per step during decode."""
    order = list(prompts)
    for rid in order[:8]:
        eng.add(rid, prompts[rid], max_new)
    arrivals = iter(order[8:])
    while eng.busy:
        eng.step()
        for rid in [next(arrivals, None) for _ in range(2)]:
            if rid is not None:
                eng.add(rid, prompts[rid], max_new)


def _prompts(seed, n=12):
    rng = np.random.default_rng(seed)
    return {f"r{i}": rng.integers(0, 512, int(rng.integers(3, 40))).tolist() for i in range(n)}


@pytest.mark.parametrize("overlap,slot_mapping,per_message", [(False, True, 1), (True, True, 1), (True, False, 1),
                                                             (True, False, 4)],
                         ids=["sync", "overlap", "overlap-own-slots", "windows-of-4"])
def test_graphs_through_a_gpu_daemon_match_hf(daemon_factory, overlap, slot_mapping, per_message):
    _cuda()
    d = daemon_factory(wait=False, device="cuda:0", tenants=f"t=uid:{os.getuid()}", **DAEMON)
    d.wait_ready(300)
    model = model_of(LLAMA).to("cuda")
    prompts = _prompts(12)
    # the daemon compiles its kernels before it serves: the hello may wait for that
    with Client(d.endpoint, tenant="t", name="gpu-engine", steps_in_flight=1, timeout_s=300.0,
                slot_mapping=slot_mapping) as c:
        assert (c.gpu_slot_mappings is None) != slot_mapping  # without them: every slot from the tables
        # steps of up to 16 tokens replay graphs; prefills (chunks up to 48 tokens) run eagerly
        eng = Engine(c, model, device="cuda", max_tokens=48, graph_tokens=16, overlap=overlap, prestage=True,
                     steps_per_message=per_message)
        eng.check_slots = True
        _drive(eng, prompts, 12)
        g = eng.graphs
        assert 0 < g.replays < eng.forwards and g.captures == len(g.buckets)
        assert (eng.ahead_steps > 0) == overlap
        assert (eng.steady_steps > 0) == overlap and (eng.prestaged_steps > 0) == overlap
        assert (eng.prestaged_replays > 0) == overlap  # device tables: a prestaged step only replays
        if per_message > 1:  # windows: fewer messages than steady steps
            assert eng.ahead_steps < eng.steady_steps
        assert_matches_hf(model, eng, prompts, 12)
        assert c.stats()["num_requests"] == 0
        c.mark_computed()
        with Client(d.endpoint, tenant="t", name="reader", timeout_s=300.0) as rd:  # every written block cached
            for rid, p in prompts.items():
                seq = np.array(p + eng.reqs[rid].output[:-1])
                assert rd.lookup(c.hash_prompt(seq)) == len(seq) // BLOCK, rid


@pytest.mark.parametrize("per_message", [1, 4], ids=["overlap", "windows-of-4"])
def test_forks_overlapped_through_a_gpu_daemon_match_hf(daemon_factory, per_message):
    """Parallel sampling (n = 4) on the graphs with overlap: the daemon owns the KV cache on the GPU
    and copies on write when a message arrives, so the fork's step and the children's first
    appends go synchronously (the engine asserts that no reply of a message sent during a forward
    carries a copy); every sample is HF's with its forced first token."""
    _cuda()
    d = daemon_factory(wait=False, device="cuda:0", **DAEMON)
    d.wait_ready(300)
    model = model_of(LLAMA).to("cuda")
    with Client(d.endpoint, name="gpu-forks", steps_in_flight=1, timeout_s=300.0, slot_mapping=False,
                mailbox=True) as c:
        eng = Engine(c, model, device="cuda", max_tokens=64, graph_tokens=16, overlap=True, prestage=True,
                     steps_per_message=per_message)
        run_three_parents_forking(eng, model)
        assert eng.ahead_steps > 0 and c.stats()["num_requests"] == 0


@pytest.mark.parametrize("per_message", [1, 4], ids=["overlap", "windows-of-4"])
def test_hybrid_graphs_overlapped_through_a_gpu_daemon_match_hf(daemon_factory, per_message):
    """A full + sliding-window model (two KV-cache groups) on the graphs, overlap and multi-step
    windows, kvd's window two tokens longer than the model's (``Engine._check_windows``): HF's
    tokens, the window group's leading blocks released as the requests decode."""
    _cuda()
    W = HYBRID["window"]
    d = daemon_factory(wait=False, device="cuda:0", kv_groups=f"{BLOCK},{BLOCK}:{W + 2}", **DAEMON)
    d.wait_ready(300)
    model = model_of(HYBRID).to("cuda")
    prompts = _prompts(15)
    with Client(d.endpoint, name="gpu-hybrid", steps_in_flight=1, timeout_s=300.0, slot_mapping=False,
                mailbox=True) as c:
        eng = Engine(c, model, device="cuda", max_tokens=48, graph_tokens=16, overlap=True, prestage=True,
                     steps_per_message=per_message)
        released = []
        real = eng._took_reply

        def took(res):  # every running request's window blocks released so far
            real(res)
            released.append(sum(int((c.block_table(rid, 1) == 0).sum()) for rid in eng.order))

        eng._took_reply = took
        _drive(eng, prompts, 12)
        g = eng.graphs
        assert 0 < g.replays < eng.forwards and g.captures == len(g.buckets)
        assert eng.ahead_steps > 0 and eng.steady_steps > 0 and eng.prestaged_replays > 0
        assert max(released) > 0
        assert_matches_hf(model, eng, prompts, 12)
        assert c.stats()["num_requests"] == 0


def test_hybrid_graphs_with_host_tables_match_hf():
    _cuda()
    W = HYBRID["window"]
    model = model_of(HYBRID).to("cuda")
    prompts = _prompts(16)
    c = InProcClient(400, BLOCK, window=W + 1, max_num_reqs=32)
    eng = Engine(c, model, kv=OwnedKv(2, 400, BLOCK, 2, 16, torch.float32, "cuda"), device="cuda", max_tokens=48,
                 graph_tokens=64, overlap=True, prestage=True)
    _drive(eng, prompts, 12)
    assert eng.graphs.replays == eng.forwards and eng.ahead_steps > 0 and eng.steady_steps > 0
    assert_matches_hf(model, eng, prompts, 12)


def test_graphs_with_the_daemons_host_tables_match_hf(daemon_factory):
    """A session opened with gpu=False on a GPU daemon: the daemon keeps no device buffers for it
    (no flush at all), the engine's graphs read its shared-memory tables, staged per step."""
    _cuda()
    d = daemon_factory(wait=False, device="cuda:0", tenants=f"t=uid:{os.getuid()}", **DAEMON)
    d.wait_ready(300)
    model = model_of(LLAMA).to("cuda")
    prompts = _prompts(14)
    with Client(d.endpoint, tenant="t", name="host-tables", steps_in_flight=1, timeout_s=300.0, gpu=False,
                slot_mapping=False) as c:
        assert c.gpu is None and c.kv_cache is not None  # the daemon's KV cache, the tables from shm
        flushes = c.stats()["gpu_flush"]["flushes"]  # the daemon's warm-up made one
        eng = Engine(c, model, device="cuda", max_tokens=48, graph_tokens=16, overlap=True, prestage=True)
        _drive(eng, prompts, 12)
        assert eng.graphs.table_width > 0 and 0 < eng.graphs.replays < eng.forwards
        assert_matches_hf(model, eng, prompts, 12)
        assert c.stats()["gpu_flush"]["flushes"] == flushes


def test_graphs_with_host_tables_match_hf():
    _cuda()
    model = model_of(LLAMA).to("cuda")
    prompts = _prompts(13)
    c = InProcClient(400, BLOCK, max_num_reqs=32)
    eng = Engine(c, model, kv=OwnedKv(2, 400, BLOCK, 2, 16, torch.float32, "cuda"), device="cuda", max_tokens=48,
                 graph_tokens=64, overlap=True, prestage=True)
    _drive(eng, prompts, 12)
    assert eng.graphs.replays == eng.forwards and eng.graphs.table_width > 0 and eng.ahead_steps > 0
    assert eng.steady_steps > 0 and eng.prestaged_steps > 0
    assert eng.prestaged_replays == 0  # host tables are copied into the bucket at every step
    assert_matches_hf(model, eng, prompts, 12)
