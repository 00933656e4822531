"""The daemon-owned KV cache (kvd.memory): one cache shared by every engine, copy-on-write copies and
swaps done by the daemon before its reply. CPU daemons keep it in shared memory; the CUDA path is
in tests/test_gpu_session.py's GPU run."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest_daemon import daemon_factory, shm_segments, short_tmp  # noqa: F401
from kvd.api import StepBatch
from kvd.config import ConfigError, ServeConfig
from kvd.hashing import hash_prompt
from kvd.memory import KvMemory, parse_kv_cache
from kvd_client import Client

SPEC = "2,2,4,float16"  # 2 layers, K and V, 2 KV heads of 4: 16 values per token


def test_kv_cache_spec_parsing():
    assert parse_kv_cache("32, 8, 128, bfloat16") == (32, 8, 128, "bfloat16")
    assert parse_kv_cache("2,2,4") == (2, 2, 4, "float16")
    for bad in ("2,2", "2,2,x", "0,2,4", "2,2,4,int8"):
        with pytest.raises(ValueError):
            parse_kv_cache(bad)
    with pytest.raises(ConfigError, match="kv_cache"):
        ServeConfig(kv_cache="2,2")
    ServeConfig(kv_cache=SPEC, kv_groups="16,16:64")  # one cache serves groups of one block size
    with pytest.raises(ConfigError, match="one block size"):
        ServeConfig(kv_cache=SPEC, kv_groups="16,32:64")


def test_a_cache_bigger_than_shared_memory_is_refused_at_start():
    with pytest.raises(MemoryError, match="the KV cache needs"):
        KvMemory(parse_kv_cache("1024,64,256,float32"), num_blocks=1 << 20, num_cpu_blocks=0, block_size=16,
                 device="cpu", name=f"kvd_{os.getpid()}_test_big_kv")
    assert not os.path.exists(f"/dev/shm/kvd_{os.getpid()}_test_big_kv")


def test_cpu_pool_copies_and_swaps_whole_blocks():
    name = f"kvd_{os.getpid()}_test_kv"
    kv = KvMemory(parse_kv_cache(SPEC), num_blocks=8, num_cpu_blocks=4, block_size=4, device="cpu", name=name)
    try:
        assert kv.gpu.shape == (2, 2, 8, 4, 2, 4) and kv.info == {
            "kind": "shm", "name": name, "shape": [2, 2, 8, 4, 2, 4], "dtype": "float16"}
        kv.gpu[...] = np.arange(8, dtype=np.float16)[None, None, :, None, None, None]  # block b holds b
        kv.copy(np.array([[3, 5], [3, 6]], np.int32))
        assert [float(kv.gpu[1, 1, b, 3, 1, 3]) for b in range(8)] == [0, 1, 2, 3, 4, 3, 3, 7]
        kv.swap_out(np.array([[1, 0], [2, 3]], np.int32))
        kv.gpu[:, :, 1:3] = -1
        kv.swap_in(np.array([[3, 1], [0, 2]], np.int32))
        assert [float(kv.gpu[0, 0, b, 0, 0, 0]) for b in range(4)] == [0, 2, 1, 3]
    finally:
        kv.close()
    assert not os.path.exists("/dev/shm/" + name)


def test_engines_share_one_kv_cache_and_the_daemon_does_the_copies(daemon_factory):
    d = daemon_factory(kv_cache=SPEC, num_cpu_blocks=64)
    a, b = Client(d.endpoint, tenant="t"), Client(d.endpoint, tenant="t")
    try:
        kv_a, kv_b = a.kv_cache, b.kv_cache
        assert kv_a.shape == (2, 2, 1024, 16, 2, 4) and kv_a.dtype == np.float16
        [seg] = [n for n in shm_segments(d.pids[0]) if n.endswith("_kv")]
        assert a.info["kv"]["name"] == seg
        assert a.stats()["kv_cache"] == {"kind": "shm", "shape": [2, 2, 1024, 16, 2, 4], "dtype": "float16",
                                         "bytes": 2 * 2 * 1024 * 16 * 2 * 4 * 2}

        prompt = np.arange(40, dtype=np.int32)
        a.allocate("x", 40, hash_prompt(prompt, 16))
        blocks = a.block_table("x").copy()
        for i, blk in enumerate(blocks.tolist()):  # engine A computes the prompt's KV
            kv_a[:, :, blk] = 10 + i
        a.mark_computed()  # ... and says so: its blocks become hits for the other engines
        # engine B's prefix hit reads A's KV through its own mapping, no copy anywhere
        r = b.allocate("y", 40, hash_prompt(prompt, 16))
        assert r.num_cached_tokens == 32 and b.block_table("y")[:2].tolist() == blocks[:2].tolist()
        assert (kv_b[:, :, blocks[:2]] == np.array([10, 11], np.float16)[None, None, :, None, None, None]).all()

        # fork, then both write into the shared partial block: the daemon has copied it on reply
        a.step(StepBatch(forks=[("x", "x2")]))
        res = a.step(StepBatch(append_ids=["x", "x2"]))
        [[src, dst]] = res.copies.tolist()
        assert src == blocks[2] and a.block_table("x")[2] == dst and a.block_table("x2")[2] == src
        assert (kv_a[:, :, dst] == 12).all()

        # swap out and back in: the content comes back, in whatever blocks it lands
        before = kv_a[:, :, a.block_table("x")].copy()
        assert a.swap_out(["x"]).ok
        kv_a[:, :, dst] = -1  # the freed block is reused by someone else meanwhile
        assert a.swap_in(["x"]).ok
        assert (kv_a[:, :, a.block_table("x")] == before).all()
    finally:
        a.close()
        b.close()
    pid = d.pids[0]
    d.stop()
    assert shm_segments(pid) == []  # the KV segment went with the daemon


@pytest.mark.cuda
def test_gpu_kv_cache_is_shared_over_cuda_ipc_and_copied_by_the_daemon(daemon_factory):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("triton")
    d = daemon_factory(device="cuda:0", kv_cache="4,2,64,bfloat16", num_cpu_blocks=64)
    c = Client(d.endpoint, tenant="g", gpu=True, timeout_s=30.0)
    try:
        kv = c.kv_cache
        assert kv.is_cuda and kv.dtype == torch.bfloat16 and tuple(kv.shape) == (4, 2, 1024, 16, 2, 64)
        c.allocate("x", 40)
        blocks = c.block_table("x").tolist()
        for i, blk in enumerate(blocks):
            kv[:, :, blk] = 10 + i
        torch.cuda.synchronize()
        c.step(StepBatch(forks=[("x", "x2")]))
        res = c.step(StepBatch(append_ids=["x", "x2"]))
        [[src, dst]] = res.copies.tolist()
        assert src == blocks[2] and (kv[:, :, dst] == 12).all()  # copied by the daemon's kernel
        before = kv[:, :, c.block_table("x").tolist()].clone()
        assert c.swap_out(["x"]).ok
        kv[:, :, dst] = -1
        torch.cuda.synchronize()
        assert c.swap_in(["x"]).ok
        assert torch.equal(kv[:, :, c.block_table("x").tolist()], before)
    finally:
        c.close()
    assert d.stop() == 0, d.stderr[-3000:]


def test_a_daemon_whose_kv_cache_does_not_fit_exits_with_a_clear_message(daemon_factory):
    d = daemon_factory(wait=False, kv_cache="1024,64,256,float32", num_gpu_blocks=1 << 20)
    assert d.proc.wait(60) == 1
    d.stop()
    assert "the KV cache needs" in d.stderr and shm_segments(d.proc.pid) == []
