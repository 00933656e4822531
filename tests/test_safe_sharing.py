"""Sharing that is safe (issue 14), through real daemons and several client processes: no hit on a
block whose K/V its writer has not confirmed, no hit across separate KV memories, tenants bound to
the peer's uid, group access to the socket. The uid/group tests drop privileges in a child process
and need root (they skip otherwise)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from conftest_daemon import REPO, daemon, daemon_factory, short_tmp  # noqa: F401
from kvd.api import AdmitRequest, StepBatch
from kvd.hashing import hash_prompt
from kvd_client import Client

NOBODY = 65534
GROUP = 4242  # a gid for the daemon's files; no /etc/group entry is needed
SPEC = "2,2,4,float16"
BS = 16
PROMPT = np.arange(64, dtype=np.int32) + 7


def script(endpoint: str, body: str, *args: str, **kw) -> subprocess.Popen:
    code = "import sys, numpy as np\nfrom kvd_client import Client\nfrom kvd.api import StepBatch, AdmitRequest\n" \
           "from kvd import errors\nEP = sys.argv[1]\nARGS = sys.argv[2:]\n" + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-c", code, endpoint, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd="/", **kw)


def finish(p: subprocess.Popen) -> str:
    if not p.stdin.closed:
        p.stdin.close()
    out, err = p.stdout.read(), p.stderr.read()
    assert p.wait(30) == 0, err[-3000:]
    return out


def as_user(fn, uid: int, gids: list[int]) -> str:
    """Run ``fn() -> str`` in a forked child with the given uid and groups; returns its output."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(r)
            os.setgroups(gids)
            os.setgid(gids[0] if gids else uid)
            os.setuid(uid)
            os.write(w, fn().encode())
            code = 0
        except BaseException as e:  # noqa: BLE001
            os.write(w, f"child failed: {type(e).__name__}: {e}".encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as fh:
        out = fh.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    return out


WRITER = """
if ARGS and ARGS[0] == "cuda":  # CUDA's first touch holds the GIL for seconds: before the lease starts
    import torch
    torch.cuda.init()
c = Client(EP)
hs = c.hash_prompt(np.arange(64, dtype=np.int32) + 7)
r = c.step(StepBatch(admit=[AdmitRequest("a", 64, hs)]))
blocks = c.block_table("a").copy()
kv = c.kv_cache
if isinstance(kv, np.ndarray):
    kv[:, :, blocks] = 5  # the forward pass of that step writes the prompt's K/V
else:  # a CUDA tensor mapped over CUDA IPC
    import torch
    kv[:, :, torch.as_tensor(blocks, device=kv.device)] = 5
    torch.cuda.synchronize()
print(int(r.admit_cached_tokens[0]), *blocks.tolist(), flush=True)
for _ in sys.stdin:  # one decode step per line (the client confirms the step before last)
    c.step(StepBatch(append_rows=c.rows_of(["a"])))
    print("stepped", flush=True)
"""


def _kv_values(kv, blocks):
    if isinstance(kv, np.ndarray):
        return kv[:, :, blocks]
    import torch

    return kv[:, :, torch.as_tensor(blocks, device=kv.device)].cpu().numpy()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.cuda)])
def test_a_block_is_a_hit_for_another_engine_only_after_its_writer_confirms(daemon_factory, device):
    if device != "cpu":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
    # a CUDA client maps the KV cache with torch: a longer lease covers its first CUDA calls
    d = daemon_factory(kv_cache=SPEC, device=device, lease_s=1.5 if device == "cpu" else 20.0)
    hs = hash_prompt(PROMPT, BS)
    a = script(d.endpoint, WRITER, "cuda" if device != "cpu" else "cpu")
    b, c = Client(d.endpoint), Client(d.endpoint)
    try:
        first = a.stdout.readline().split()
        cached_a, blocks_a = int(first[0]), [int(x) for x in first[1:]]
        assert cached_a == 0 and len(blocks_a) == 4
        # B is admitted between A's admission and A's confirmation: A's blocks are not written yet
        rb = b.allocate("b", 64, hs)
        assert rb.num_cached_tokens == 0 and not set(rb.block_ids.tolist()) & set(blocks_a)
        a.stdin.write("\n")
        a.stdin.flush()
        assert a.stdout.readline().strip() == "stepped"
        # one step later A's admission step may still be running (async scheduling): no hit yet
        assert c.allocate("c1", 64, hs).num_cached_tokens == 0
        a.stdin.write("\n")
        a.stdin.flush()
        assert a.stdout.readline().strip() == "stepped"
        # the step after that confirms it: the full hit, on A's blocks, reading A's K/V
        rc = c.allocate("c2", 64, hs)
        assert rc.num_cached_tokens == 48 and rc.block_ids[:3].tolist() == blocks_a[:3]
        assert (_kv_values(c.kv_cache, rc.block_ids[:3]) == 5).all()
    finally:
        finish(a)
        b.close()
        c.close()
    assert d.stop() == 0, d.stderr[-2000:]


ENGINE_OWNED = """
c = Client(EP, kv_shared=ARGS[0] == "shared")
hs = c.hash_prompt(np.arange(64, dtype=np.int32) + 7)
r = c.allocate("a", 64, hs)
c.mark_computed()  # its own forward pass wrote the K/V, in its own memory
print(r.num_cached_tokens, c.shared, flush=True)
sys.stdin.read()
"""


def test_engines_with_their_own_kv_memory_never_hit_each_others_blocks(daemon):
    hs = hash_prompt(PROMPT, BS)
    a = script(daemon.endpoint, ENGINE_OWNED, "own")
    b = Client(daemon.endpoint)
    try:
        assert a.stdout.readline().split() == ["0", "False"]
        assert b.lookup(hs) == 0 and b.allocate("b", 64, hs).num_cached_tokens == 0
        b.mark_computed()
        assert b.allocate("b2", 64, hs).num_cached_tokens == 48  # its own blocks, in its own memory
    finally:
        finish(a)
        b.close()
    # engines that say their KV memory is shared opt in to one prefix cache
    a = script(daemon.endpoint, ENGINE_OWNED, "shared")
    c = Client(daemon.endpoint, kv_shared=True)
    try:
        assert a.stdout.readline().split() == ["0", "True"]
        assert c.allocate("c", 64, hs).num_cached_tokens == 48
    finally:
        finish(a)
        c.close()


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="drops privileges in a child: needs root")

def try_tenants(endpoint: str) -> str:
    from kvd import errors

    out = []
    for t in ("alice", "nobodys", ""):
        try:
            c = Client(endpoint, tenant=t)
            out.append(f"{t or '-'} {c.info['tenant']}")
            c.allocate("x", 20)
            c.close()
        except errors.Unauthorized:
            out.append(f"{t or '-'} Unauthorized")
    return "\n".join(out)


def _open_to_others(path) -> None:
    os.chmod(path, 0o755)  # the test's temp dir: let an unprivileged child reach the runtime dir


@needs_root
def test_a_tenant_is_taken_by_credentials_not_by_name(daemon_factory, short_tmp):
    _open_to_others(short_tmp)
    d = daemon_factory(group=str(GROUP), tenants=f"alice=uid:0 nobodys=uid:{NOBODY}")
    out = as_user(lambda: try_tenants(d.endpoint), NOBODY, [GROUP])
    assert out.splitlines() == ["alice Unauthorized", "nobodys nobodys", f"- uid:{NOBODY}"]
    a = Client(d.endpoint, tenant="alice")  # root is alice's uid
    try:
        assert a.info["tenant"] == "alice"
    finally:
        a.close()


def try_connect(endpoint: str) -> str:
    from kvd import errors

    t0 = time.monotonic()
    try:
        c = Client(endpoint)
        sessions = c.stats()["sessions"]
        c.close()
        return f"ok {sessions}"
    except errors.PermissionDenied as e:
        return f"denied {time.monotonic() - t0:.1f} {e}"


@needs_root
def test_group_members_may_connect_and_others_get_a_clear_permission_error(daemon_factory, short_tmp):
    _open_to_others(short_tmp)
    d = daemon_factory(group=str(GROUP))
    rt = short_tmp / "rt0"
    assert (os.stat(rt).st_mode & 0o777, os.stat(rt).st_gid) == (0o750, GROUP)
    sock = rt / "kvd.sock"
    assert (os.stat(sock).st_mode & 0o777, os.stat(sock).st_gid) == (0o660, GROUP)
    assert as_user(lambda: try_connect(d.endpoint), NOBODY, [GROUP]).split() == ["ok", "1"]
    out = as_user(lambda: try_connect(d.endpoint), NOBODY, []).split(maxsplit=2)
    assert out[0] == "denied" and float(out[1]) < 1.0 and str(sock) in out[2], out


def test_session_segments_are_group_readable_and_name_no_session_id(daemon):
    c = Client(daemon.endpoint)
    try:
        st = os.stat("/dev/shm/" + c.shm.name)
        assert st.st_mode & 0o777 == 0o640
        assert "sid" not in c.shm.meta
    finally:
        c.close()


def test_a_pool_that_cannot_fit_in_memory_fails_at_start_with_both_numbers(daemon_factory):
    # ~70 GB of blocks and 256 GiB of block tables (2^20 rows x 65,536 entries): more than any
    # machine this runs on (the blocks alone fit on a 128 GiB GPU host)
    d = daemon_factory(wait=False, num_gpu_blocks=2**31 - 1, max_num_reqs=2**20, max_model_len=2**20)
    assert d.proc.wait(60) == 78
    d.stop()
    assert "the block pool needs" in d.stderr and "bytes of memory" in d.stderr and "available" in d.stderr


def test_the_pool_estimate_bounds_what_the_manager_allocates():
    import tracemalloc

    from kvd.api import GroupSpec, ManagerConfig
    from kvd.manager import BlockManager

    for blocks, cpu, reqs, groups in ((65536, 0, 4096, 1), (20000, 5000, 1024, 2)):
        cfg = ManagerConfig(num_gpu_blocks=blocks, num_cpu_blocks=cpu, max_num_reqs=reqs, max_model_len=4096,
                            groups=tuple(GroupSpec(16) for _ in range(groups)))
        tracemalloc.start()
        m = BlockManager(cfg)
        used = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del m
        assert used <= BlockManager.estimate_bytes(cfg) <= 1.1 * used, (used, BlockManager.estimate_bytes(cfg))
