"""A tiny paged-attention engine driven by kvd: the end-to-end proof.

The engine owns the KV cache, a CPU torch tensor ``[layers, 2 (K/V), num_blocks, block_size, heads,
head_dim]`` (block 0 is kvd's null block: no real token is ever written there). kvd owns the block
*bookkeeping*: every scheduler step is one ``Client.step`` round trip (admissions with the prompt's
block hashes, decode appends with the hash of each block that fills, forks, frees), after which the
engine reads the block-table rows and the step's slot mapping from the client's shared-memory views,
performs the copy-on-write copies kvd returned (``kvd_kernels.copy_blocks_ref``), writes each new
token's K/V at its slot and computes attention by gathering K/V through the block table.

The model is a toy two-layer transformer (float64, random weights, fixed seed). The scenario:

    step 0  admit A (45-token prompt) and C (21 tokens)
    step 1  fork C -> C1 (parallel sampling: C1 takes the runner-up token), admit B (A's first 40
            tokens + 9 of its own: a 40-token prefix hit on A's blocks, zero copy), decode A, C, C1
            (C and C1 both write into their shared partial block: one copy-on-write copy)
    step 4  admit D = A's first 48 tokens (45 of prompt + 3 decoded: the 6th block was filled by a
            decode step and registered with its hash) + 4 new: a 48-token prefix hit
    step 7  free everything

At the end every logit the engine computed is compared with a dense, non-paged forward pass of the
same model over each request's tokens, and each request's sampled tokens with a dense greedy decode.

    python examples/paged_engine.py                 # starts its own daemon in a temp dir
    python examples/paged_engine.py --endpoint ipc:///run/kvd/kvd.sock   # an existing daemon
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvd.api import PAD_SLOT_ID, AdmitRequest, StepBatch
from kvd_client import Client
from kvd_kernels import NULL_BLOCK, copy_blocks_ref

REPO = Path(__file__).resolve().parents[1]

# ---- the toy model --------------------------------------------------------------------------------

VOCAB, D_MODEL, N_HEADS, HEAD_DIM, N_LAYERS, MAX_POS = 97, 32, 4, 8, 2, 256
DTYPE = torch.float64
# float64 and the same attention function on both sides: the paged and dense paths differ only in
# the order of floating-point sums (matmul shapes differ), so they agree to ~1e-15. A wrong slot, a
# stale block or a missed CoW copy changes logits by O(0.1).
TOLERANCE = 1e-10


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)


class ToyModel:
    """Embeddings + absolute positions, N_LAYERS pre-norm attention/MLP blocks, an unembedding."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)

        def w(*shape, scale=1.0):
            return torch.randn(*shape, generator=g, dtype=DTYPE) * scale

        s = 1 / math.sqrt(D_MODEL)
        self.emb = w(VOCAB, D_MODEL)
        self.pos = w(MAX_POS, D_MODEL, scale=0.5)
        self.unemb = w(D_MODEL, VOCAB, scale=s)
        self.layers = [dict(wq=w(D_MODEL, D_MODEL, scale=s), wk=w(D_MODEL, D_MODEL, scale=s),
                            wv=w(D_MODEL, D_MODEL, scale=s), wo=w(D_MODEL, D_MODEL, scale=s),
                            w1=w(D_MODEL, 2 * D_MODEL, scale=s), w2=w(2 * D_MODEL, D_MODEL, scale=s))
                       for _ in range(N_LAYERS)]

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.emb[tokens] + self.pos[positions]

    def qkv(self, layer: int, x: torch.Tensor):
        p, h = self.layers[layer], _rms(x)
        return tuple((h @ p[k]).view(-1, N_HEADS, HEAD_DIM) for k in ("wq", "wk", "wv"))

    def finish_layer(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        p = self.layers[layer]
        x = x + attn.reshape(-1, D_MODEL) @ p["wo"]
        return x + torch.tanh(_rms(x) @ p["w1"]) @ p["w2"]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x) @ self.unemb


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Causal attention of queries at positions ``q_pos`` over keys/values at positions 0..T-1."""
    scores = torch.einsum("nhd,thd->hnt", q, k) / math.sqrt(HEAD_DIM)
    future = torch.arange(k.shape[0]) > q_pos[:, None]  # [n, T]
    scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("hnt,thd->nhd", torch.softmax(scores, -1), v)


def dense_logits(model: ToyModel, tokens: list[int]) -> torch.Tensor:
    """The reference: the whole sequence at once, no cache, no paging. Logits at every position."""
    pos = torch.arange(len(tokens))
    x = model.embed(torch.tensor(tokens), pos)
    for layer in range(N_LAYERS):
        q, k, v = model.qkv(layer, x)
        x = model.finish_layer(layer, x, attend(q, k, v, pos))
    return model.logits(x)


def pick(logits: torch.Tensor, rank: int = 0) -> int:
    """Greedy sampling; ``rank`` 1 takes the runner-up (how the forked sample diverges)."""
    return int(torch.argsort(logits, descending=True, stable=True)[rank])


# ---- the engine -----------------------------------------------------------------------------------

@dataclass
class Request:
    rid: str
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)       # tokens whose KV is (being) computed
    hashes: list[bytes] = field(default_factory=list)     # hashes of their full blocks
    output: list[int] = field(default_factory=list)       # sampled tokens
    ranks: dict[int, int] = field(default_factory=dict)   # output index -> sampling rank (forks)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> engine logits
    cached_tokens: int = 0

    @property
    def next_token(self) -> int:
        return self.output[-1]


class PagedEngine:
    def __init__(self, client: Client, model: ToyModel, num_blocks: int):
        self.c = client
        self.model = model
        self.bs = client.block_sizes[0]
        self.kv = torch.zeros(N_LAYERS, 2, num_blocks, self.bs, N_HEADS, HEAD_DIM, dtype=DTYPE)
        self.reqs: dict[str, Request] = {}
        self.running: list[str] = []
        self.cow_copies = 0
        self.tokens_computed = 0

    # -- one scheduler step: one kvd round trip, then one forward pass ------------------------------
    def step(self, admit: list[tuple[str, list[int]]] = (), forks: list[tuple[str, str]] = (),
             free: list[str] = ()) -> None:
        bs = self.bs
        for parent_id, child_id in forks:  # parallel sampling: the child takes the runner-up token
            p = self.reqs[parent_id]
            child = Request(child_id, p.prompt, list(p.tokens), list(p.hashes), list(p.output),
                            dict(p.ranks), dict(p.logits))
            child.ranks[len(child.output) - 1] = 1
            child.output[-1] = pick(p.logits[len(p.tokens) - 1], 1)
            self.reqs[child_id] = child
            # kvd's StepBatch takes forks too, but the daemon does not yet let a child forked in a
            # step append in that same step (reported as UnknownRequest), so fork first: one more
            # round trip
            self.c.fork(parent_id, child_id)
        running = [r for r in self.running if r not in free] + [c for _, c in forks]

        # decode appends: one token each (the last sampled one), plus the hash of a block it fills
        new_hashes, counts = [], []
        for rid in running:
            r = self.reqs[rid]
            n = len(r.tokens) + 1
            if n % bs == 0:
                parent = r.hashes[-1] if r.hashes else None
                h = self.c.hash_prompt(np.array((r.tokens + [r.next_token])[n - bs:]), parent=parent,
                                       first_block_index=n // bs - 1)
                new_hashes.append(h)
                r.hashes += list(h)  # the next block's parent
            counts.append(int(n % bs == 0))
        admits = []
        for rid, prompt in admit:
            self.reqs[rid] = Request(rid, list(prompt), tokens=list(prompt))
            hs = self.c.hash_prompt(np.array(prompt))
            self.reqs[rid].hashes = list(hs)
            admits.append(AdmitRequest(rid, len(prompt), hs))
        batch = StepBatch(free=list(free), append_ids=running, append_num_tokens=1,
                          append_hashes=[np.concatenate(new_hashes)] if new_hashes else (),
                          append_hash_counts=[np.array(counts, np.int32)] if new_hashes else (),
                          admit=admits)
        res = self.c.step(batch)
        for what in ("free_status", "fork_status", "append_status", "admit_status"):
            st = getattr(res, what)
            if st.any():
                raise RuntimeError(f"kvd refused part of the step: {what}={st.tolist()}")
        for rid in free:
            del self.reqs[rid]

        # copy-on-write: kvd gave a writer of a shared partial block a fresh block; the engine (the
        # owner of the KV memory) copies the old block's contents before anything is written
        if res.copies.size:
            copy_blocks_ref(self.kv.numpy(), res.copies)  # the numpy view shares the tensor's memory
            self.cow_copies += len(res.copies)

        # the step's schedule, in kvd's batch order: appends, then admissions (uncached tokens only)
        sched: list[tuple[Request, int, list[int]]] = []   # (request, first position, new tokens)
        for rid in running:
            r = self.reqs[rid]
            sched.append((r, len(r.tokens), [r.next_token]))
        for i, (rid, prompt) in enumerate(admit):
            r = self.reqs[rid]
            r.cached_tokens = int(res.admit_cached_tokens[i])
            sched.append((r, r.cached_tokens, prompt[r.cached_tokens:]))
        self.running = running + [rid for rid, _ in admit]
        if sched:
            self._forward(sched, res.num_scheduled_tokens[0])

    def _forward(self, sched, num_tokens: int) -> None:
        bs, c = self.bs, self.c
        n_total = sum(len(t) for _, _, t in sched)
        assert n_total == num_tokens, (n_total, num_tokens)
        slot_view = c.slot_mappings[0]
        slots = torch.from_numpy(slot_view[:n_total].astype(np.int64))
        assert n_total == slot_view.size or slot_view[n_total] == PAD_SLOT_ID
        tables, positions, tokens = [], [], []
        for r, start, new in sched:
            row = c.row_of(r.rid)
            table = c.tables[0][row, : int(c.num_blocks[0][row])].astype(np.int64)
            assert (table != NULL_BLOCK).all()
            tables.append(torch.from_numpy(table))
            positions += range(start, start + len(new))
            tokens += new
        pos = torch.tensor(positions)
        # the contract kvd's slot mapping follows: slot = block_id * block_size + position % bs
        expect = torch.cat([t[torch.arange(s, s + len(n)) // bs] * bs + torch.arange(s, s + len(n)) % bs
                            for t, (_, s, n) in zip(tables, sched)])
        assert torch.equal(slots, expect), "slot mapping does not follow the block table"
        assert (slots // bs != NULL_BLOCK).all()

        x = self.model.embed(torch.tensor(tokens), pos)
        for layer in range(N_LAYERS):
            q, k, v = self.model.qkv(layer, x)
            k_cache = self.kv[layer, 0].view(-1, N_HEADS, HEAD_DIM)  # [num_blocks * bs, H, D]
            v_cache = self.kv[layer, 1].view(-1, N_HEADS, HEAD_DIM)
            k_cache[slots] = k  # write every new token's K/V at its slot ("reshape_and_cache")
            v_cache[slots] = v
            outs, off = [], 0
            for table, (_, start, new) in zip(tables, sched):
                ctx = start + len(new)  # paged attention: gather the context through the block table
                k_ctx = self.kv[layer, 0][table].reshape(-1, N_HEADS, HEAD_DIM)[:ctx]
                v_ctx = self.kv[layer, 1][table].reshape(-1, N_HEADS, HEAD_DIM)[:ctx]
                outs.append(attend(q[off:off + len(new)], k_ctx, v_ctx, pos[off:off + len(new)]))
                off += len(new)
            x = self.model.finish_layer(layer, x, torch.cat(outs))
        logits = self.model.logits(x)
        self.tokens_computed += n_total

        off = 0
        for r, start, new in sched:
            for j in range(len(new)):
                r.logits[start + j] = logits[off + j]
            if start == len(r.tokens):  # a decode append (admissions already hold their prompt)
                r.tokens += new
            off += len(new)
            r.output.append(pick(r.logits[len(r.tokens) - 1], r.ranks.get(len(r.output), 0)))


# ---- the daemon -----------------------------------------------------------------------------------

DAEMON_OPTS = dict(num_gpu_blocks=64, block_size=8, max_model_len=128, max_num_reqs=32,
                   max_reqs_per_session=16, max_num_batched_tokens=256, max_sessions=4)


class ReadyListener:
    """A datagram socket at ``path`` for a child's sd_notify messages (``NOTIFY_SOCKET``): ``wait``
    returns once one says READY=1; the socket file goes with the context."""

    def __init__(self, path: Path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.bind(self.path)

    def wait(self, proc: subprocess.Popen, timeout: float) -> bool:
        """True once READY=1 arrived; raises when ``proc`` exits first; False after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if proc.poll() is not None:
                err = proc.stderr.read()[-2000:] if proc.stderr else ""
                raise RuntimeError(f"kvd exited with {proc.returncode}: {err}")
            self.sock.settimeout(min(left, 0.1))
            try:
                msg = self.sock.recv(4096)
            except TimeoutError:
                continue
            if b"READY=1" in msg.split(b"\n"):
                return True
        return False

    def __enter__(self) -> "ReadyListener":
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()  # the daemon's later notifications then go nowhere (it never blocks on them)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class KvdDaemon:
    """``python -m kvd serve`` in a temp runtime dir; ``stop()`` (idempotent) ends it and removes its
    shared-memory segments and the dir, whatever state it is in."""

    def __init__(self, runtime_dir: str | None = None, **opts):
        self.own_dir = runtime_dir is None
        self.runtime_dir = Path(runtime_dir or tempfile.mkdtemp(prefix="kvde", dir="/tmp"))
        self.opts = {**DAEMON_OPTS, **opts}
        self.endpoint = "ipc://" + str(self.runtime_dir / "kvd.sock")
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout: float = 20.0) -> "KvdDaemon":
        """Start the daemon and return once it serves: it sends READY=1 (sd_notify, kvd.systemd) to
        a socket of ours after its socket is bound and a GPU daemon's kernels are compiled, which
        can take longer than a client's hello waits."""
        argv = [sys.executable, "-m", "kvd", "serve", "--runtime-dir", str(self.runtime_dir),
                "--log-level", "warning", "--exit-with-parent"]  # a killed caller leaves no daemon
        for k, v in self.opts.items():
            argv += ["--" + k.replace("_", "-"), str(v)]
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("KVD_") and k not in ("NOTIFY_SOCKET", "RUNTIME_DIRECTORY")}
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        with ReadyListener(self.runtime_dir / "notify.sock") as ready:
            env["NOTIFY_SOCKET"] = ready.path
            self.proc = subprocess.Popen(argv, cwd=str(REPO), env=env, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, text=True)
            if not ready.wait(self.proc, timeout):
                raise RuntimeError("kvd did not become ready")
        return self

    def stop(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if p is not None:
            if p.stderr:
                p.stderr.close()
            for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else ():
                if name.startswith(f"kvd_{p.pid}_"):
                    try:
                        os.unlink("/dev/shm/" + name)
                    except FileNotFoundError:
                        pass
        if self.own_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def __enter__(self) -> "KvdDaemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- the scenario and the check -------------------------------------------------------------------

@dataclass
class Report:
    outputs: dict[str, list[int]]
    prefix_hit_tokens: dict[str, int]
    shared_blocks: dict[str, tuple[str, int]]   # request -> (prefix owner, leading blocks in common)
    cow_copies: int
    tokens_computed: int
    tokens_total: int
    max_abs_diff: float
    logits_compared: int
    tokens_match: bool
    registered_blocks: dict[str, int]   # request -> leading full blocks kvd's lookup finds
    null_block_clean: bool
    requests_after_free: int
    full_blocks: dict[str, int] = field(default_factory=dict)
    daemon_pid: int | None = None

    @property
    def ok(self) -> bool:
        return (self.max_abs_diff <= TOLERANCE and self.tokens_match and self.null_block_clean
                and self.requests_after_free == 0
                and all(n == self.full_blocks[k] for k, n in self.registered_blocks.items()))

    def text(self) -> str:
        hits = sum(self.prefix_hit_tokens.values())
        lines = [f"requests: {len(self.outputs)}  KV tokens held: {self.tokens_total} = computed "
                 f"{self.tokens_computed} + prefix hits {hits} + inherited by forks "
                 f"{self.tokens_total - self.tokens_computed - hits}"]
        for rid, out in self.outputs.items():
            share = self.shared_blocks.get(rid)
            share = f"{share[1]} blocks shared with {share[0]}" if share else ""
            lines.append(f"  {rid:3s} prefix-hit tokens {self.prefix_hit_tokens[rid]:3d}  "
                         f"output {str(out):28s} {share}")
        lines += [f"copy-on-write copies: {self.cow_copies}",
                  f"max |logit - dense reference|: {self.max_abs_diff:.3g} over {self.logits_compared} "
                  f"positions (tolerance {TOLERANCE:g})",
                  f"sampled tokens equal the dense greedy decode: {self.tokens_match}",
                  "full blocks found by lookup(hash_prompt(tokens)): "
                  + ", ".join(f"{k} {v}" for k, v in self.registered_blocks.items()),
                  f"null block never written: {self.null_block_clean}; "
                  f"requests left after the frees: {self.requests_after_free}",
                  "OK" if self.ok else "MISMATCH"]
        return "\n".join(lines)


def run_scenario(client: Client, num_blocks: int, seed: int = 0) -> Report:
    model = ToyModel(seed)
    eng = PagedEngine(client, model, num_blocks)
    rng = np.random.default_rng(seed)
    prompt_a = rng.integers(0, VOCAB, 45).tolist()
    prompt_b = prompt_a[:40] + rng.integers(0, VOCAB, 9).tolist()
    prompt_c = rng.integers(0, VOCAB, 21).tolist()

    eng.step(admit=[("A", prompt_a), ("C", prompt_c)])
    eng.step(admit=[("B", prompt_b)], forks=[("C", "C1")])
    eng.step()
    eng.step()
    prompt_d = eng.reqs["A"].tokens[:48] + rng.integers(0, VOCAB, 4).tolist()
    assert len(eng.reqs["A"].tokens) >= 48  # A's 6th block was filled (and hashed) by a decode step
    eng.step(admit=[("D", prompt_d)])
    eng.step()
    eng.step()

    # zero copy: a prefix hit's blocks are the owner's very blocks
    tab = {rid: client.block_table(rid).copy() for rid in eng.reqs}
    shared = {}
    for rid, owner in (("B", "A"), ("D", "A"), ("C1", "C")):
        n = min(len(tab[rid]), len(tab[owner]))
        shared[rid] = (owner, int(np.cumprod(tab[rid][:n] == tab[owner][:n]).sum()))

    # the reference: dense logits over each request's tokens, and a dense greedy decode
    max_diff, compared, tokens_match = 0.0, 0, True
    for r in eng.reqs.values():
        ref = dense_logits(model, r.tokens)
        for p, lg in r.logits.items():
            max_diff = max(max_diff, float((lg - ref[p]).abs().max()))
            compared += 1
        seq, out = list(r.prompt), []
        for i in range(len(r.output)):
            out.append(pick(dense_logits(model, seq)[-1], r.ranks.get(i, 0)))
            seq.append(out[-1])
        tokens_match &= out == r.output
    # every full block, prompt or decode-filled, was registered under the hash of its whole chain
    registered = {rid: client.lookup(client.hash_prompt(np.array(r.tokens))) for rid, r in eng.reqs.items()}
    for rid, r in eng.reqs.items():
        assert [bytes(h) for h in r.hashes] == [bytes(h) for h in client.hash_prompt(np.array(r.tokens))]
    report = Report(
        outputs={rid: r.output for rid, r in eng.reqs.items()},
        prefix_hit_tokens={rid: r.cached_tokens for rid, r in eng.reqs.items()},
        shared_blocks=shared,
        cow_copies=eng.cow_copies, tokens_computed=eng.tokens_computed,
        tokens_total=sum(len(r.tokens) for r in eng.reqs.values()),
        max_abs_diff=max_diff, logits_compared=compared, tokens_match=tokens_match,
        registered_blocks=registered,
        full_blocks={rid: len(r.tokens) // eng.bs for rid, r in eng.reqs.items()},
        null_block_clean=bool((eng.kv[:, :, NULL_BLOCK] == 0).all()), requests_after_free=-1)
    eng.step(free=list(eng.reqs))
    report.requests_after_free = int(client.stats()["session_requests"])
    return report


def run(endpoint: str | None = None, daemon: KvdDaemon | None = None, seed: int = 0) -> Report:
    """Run the scenario against ``endpoint``, else against ``daemon`` (started and always stopped
    here), else against a daemon of its own in a temp dir."""
    if endpoint is None and daemon is None:
        daemon = KvdDaemon()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: extra threads only spin against the daemon's CPU
    try:
        if endpoint is None:
            daemon.start()
            endpoint = daemon.endpoint
        # this engine owns its KV memory: the daemon gives it a prefix-cache namespace of its own
        client = Client(endpoint, name="paged_engine")
        try:
            report = run_scenario(client, int(client.stats()["num_blocks"]) + 1, seed)
        finally:
            client.close()
        report.daemon_pid = daemon.pid if daemon else None
        return report
    finally:
        torch.set_num_threads(threads)
        if daemon is not None:
            daemon.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--endpoint", help="use a running daemon (default: start one in a temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    report = run(args.endpoint, seed=args.seed)
    print(report.text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
