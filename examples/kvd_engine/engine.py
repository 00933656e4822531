"""A continuous-batching engine on kvd: every scheduler step is ONE ``step`` round trip to kvd
(frees, forks, decode appends, admissions with prefix hits), then one packed forward of the model.

Scheduling per step, under a token budget (``max_tokens``):
  1. decode: every running request whose prompt is done appends its last sampled token;
  2. chunked prefill: requests admitted earlier whose uncached prompt is not done yet continue
     (kvd allocated the whole prompt at admission: their slots come from the block table);
  3. admissions: waiting requests while budget is left; each computes up to its share of the
     budget (decided before the round trip) of its uncached prompt this step, the rest in later steps.
Prefix-cache registration follows the KV actually written: a step registers exactly the full blocks
its forward pass computes (an admission's hashes reach only as far as its first chunk; a continuing
prefill registers the next chunk's blocks with a 0-token append), so no block is ever a prefix hit,
for this engine or (after the confirmation kvd's client sends with a later step) for another one,
before its K/V is written.
Preemption: a decode append kvd refuses for lack of blocks swaps out the newest running request
(``swap_out``, a round trip of its own) which is swapped back in (``swap_in``) once blocks are free.
KV memory: the daemon's (``client.kv_cache``: it performs copy-on-write copies and swaps) or the
engine's own (``OwnedKv``: the engine performs ``res.copies`` and the swap copies itself).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from kvd.api import STATUS_NO_SPACE, STATUS_OK, AdmitRequest, StepBatch

from .graphs import GraphRunner
from .inputs import Staging, varlen_layout
from .model import StepMeta, layer_groups, use_paged

WAITING, PREFILL, RUNNING, SWAPPED, DONE = "waiting", "prefill", "running", "swapped", "done"


@dataclass
class Request:
    rid: str
    prompt: list[int]
    max_new_tokens: int
    forced: dict[int, int] = field(default_factory=dict)   # output index -> token (forks, tests)
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # float32 CPU, one per output token
    hashes: np.ndarray = field(default_factory=lambda: np.empty(0, "S16"))  # full blocks' chain
    computed: int = 0          # tokens whose KV is written
    cached_tokens: int = 0     # prefix hit at admission
    prefilled_tokens: int = 0  # prompt tokens this engine computed
    state: str = WAITING
    first_token_step: int = -1
    admitted_step: int = -1
    added_at: float = 0.0      # perf_counter() when added (time to first token)
    first_token_at: float = 0.0
    registered: int = 0        # leading full blocks registered in kvd's prefix cache
    chunk: int = 0             # prompt tokens this step computes (planned before the round trip)

    @property
    def seq(self) -> list[int]:
        return self.prompt + self.output

    @property
    def seq_len(self) -> int:
        return len(self.prompt) + len(self.output)

    def tokens(self, start: int, n: int) -> list[int]:
        """``seq[start:start + n]`` without building ``seq``."""
        lp = len(self.prompt)
        if start >= lp:
            return self.output[start - lp:start - lp + n]
        if start + n <= lp:
            return self.prompt[start:start + n]
        return self.seq[start:start + n]

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class OwnedKv:
    """Engine-owned KV memory: the GPU-side cache and a CPU swap pool, with kvd's layout."""

    def __init__(self, layers, num_blocks, block_size, kv_heads, head_dim, dtype, device, num_cpu_blocks=0):
        self.gpu = torch.zeros(layers, 2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
        self.cpu = torch.zeros(layers, 2, max(num_cpu_blocks, 1), block_size, kv_heads, head_dim, dtype=dtype)

    def copy(self, pairs: np.ndarray) -> None:
        if len(pairs):
            p = torch.from_numpy(pairs.astype(np.int64)).to(self.gpu.device)
            self.gpu[:, :, p[:, 1]] = self.gpu[:, :, p[:, 0]]

    def swap_out(self, mapping: np.ndarray) -> None:
        if len(mapping):
            m = torch.from_numpy(mapping.astype(np.int64))
            self.cpu[:, :, m[:, 1]] = self.gpu[:, :, m[:, 0].to(self.gpu.device)].cpu()

    def swap_in(self, mapping: np.ndarray) -> None:
        if len(mapping):
            m = torch.from_numpy(mapping.astype(np.int64))
            self.gpu[:, :, m[:, 1].to(self.gpu.device)] = self.cpu[:, :, m[:, 0]].to(self.gpu.device)


def daemon_kv(client, dtype: torch.dtype) -> torch.Tensor:
    """The daemon-owned cache as a torch tensor: CUDA IPC tensor as is, shm numpy memmap wrapped
    (bfloat16/float16 arrive as integers of their width: reinterpret the bytes)."""
    kv = client.kv_cache
    if isinstance(kv, torch.Tensor):
        return kv
    t = torch.from_numpy(kv)
    return t.view(dtype) if t.dtype != dtype else t


def _record_start(timed: bool):
    """(start, end) timing events with the start recorded now, or None."""
    if not timed:
        return None
    events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
    events[0].record()
    return events


class Engine:
    """One engine: a model, a kvd client (daemon ``kvd_client.Client`` or ``InProcClient``), a queue."""

    def __init__(self, client, model, *, kv: OwnedKv | None = None, max_tokens: int = 256, max_running: int = 64,
                 device="cpu", keep_logits: bool = True, graph_tokens: int = 0, overlap: bool = False):
        """``keep_logits``: keep every sampled row's logits (float32, on the host) in ``Request.logits``
        (the tests compare them with HF's); False: only the sampled token ids leave the device.
        ``graph_tokens``: on CUDA, steps of at most that many tokens replay CUDA graphs
        (``graphs.GraphRunner``); 0: every forward is eager. ``overlap``: in steady decode (every
        running request decoding, nothing waiting), send the next step's round trip while this
        step's forward runs (async scheduling). Needs one full-attention KV-cache group (a window's
        releases, or a fork's copy-on-write, would change blocks the running forward reads), no
        forks, and a client that confirms a step only once a later one is sent (``steps_in_flight``
        >= 1); slots then come from the block tables (kvd rewrites its slot buffer for the next step
        while this forward may still read it)."""
        self.c = client
        self.model = model
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.owned = kv
        dtype = next(model.parameters()).dtype
        self.kv = kv.gpu if kv is not None else daemon_kv(client, dtype)
        self.groups = layer_groups(model.config)
        self.num_groups = len(client.block_sizes)
        if max(self.groups) >= self.num_groups:
            raise ValueError(f"the model has sliding-window layers: kvd needs {max(self.groups) + 1} KV-cache groups")
        if len(set(client.block_sizes)) != 1:
            raise ValueError("the engine needs one block size for all KV-cache groups (one KV cache)")
        self.bs = client.block_sizes[0]
        self.hashes_dtype = f"S{getattr(client, 'hash_width', 16)}"
        self.max_tokens = max_tokens
        self.max_running = max_running
        self.reqs: dict[str, Request] = {}
        self.order: list[str] = []          # running/prefill requests in admission order
        self.waiting: list[str] = []
        self.swapped: list[str] = []
        self.pending_forks: list[tuple[str, str, int]] = []
        self.steps = 0
        self.copies = 0
        self.swaps_out = self.swaps_in = 0
        self.forward_s = 0.0
        self.kvd_s = 0.0   # kvd's share of the steps: the round trips ...
        self.meta_s = 0.0  # ... and building slots / table views / varlen layout from its answer
        # the last step's phases (seconds): plan (scheduling, hashing), rt (kvd round trip), inputs
        # (token ids), meta (kvd's metadata), model (the forward's launch), sample (waiting for the
        # device, sampling), total
        self.phases: dict[str, float] = {}
        self.freed_since_preempt = True
        self.keep_logits = keep_logits
        ticks = getattr(client, "_step_ticks", None)
        if overlap and (self.num_groups != 1 or max(self.groups) > 0 or (ticks is not None and ticks.maxlen < 2)):
            raise ValueError("overlap needs one full-attention KV-cache group and a client with steps_in_flight >= 1")
        self.overlap = overlap
        self._ahead = None  # (ids, decode count, hash counts, StepResult, plan s, rt s) of the step sent ahead
        self.ahead_steps = 0
        # the step round trips' time on the critical path: all of a round trip the engine waits for,
        # the part of one sent ahead after the forward it overlapped had finished on the GPU (on the
        # CPU the forward is done before it starts: all of it)
        self.kvd_exposed_s = 0.0
        self._free_later: list[str] = []  # finished requests to free with the next message
        self.staging = Staging(self.device)
        self.graphs = None
        if graph_tokens > 0 and self.device.type == "cuda":
            host = isinstance(client.tables[0], np.ndarray) and getattr(client, "gpu_tables", None) is None
            self.graphs = GraphRunner(model, self.kv, self.groups, self.num_groups, self.bs, graph_tokens,
                                      table_width=client.tables[0].shape[1] if host else 0)
        self.forwards = 0
        self.kvd_slot_steps = 0  # forwards that used kvd's own slot mapping (not one from the tables)
        self.check_slots = False  # tests: compare kvd's slot mapping with the one from the tables
        self.after_reply = None  # hook(engine, StepResult) between kvd's reply and the forward (tests)

    # ---- requests ------------------------------------------------------------------------------------
    def add(self, rid: str, prompt, max_new_tokens: int, forced: dict[int, int] | None = None) -> None:
        self.reqs[rid] = Request(rid, [int(t) for t in prompt], max_new_tokens, dict(forced or {}),
                                 added_at=time.perf_counter())
        self.waiting.append(rid)

    def fork(self, parent: str, child: str, first_token: int) -> None:
        """Parallel sampling: ``child`` shares ``parent``'s blocks (kvd fork, copy-on-write) and
        replaces the parent's last sampled token with ``first_token``."""
        if self.overlap:
            raise ValueError("fork needs an engine without overlap (its copy-on-write would rewrite blocks "
                             "the running forward reads)")
        self.pending_forks.append((parent, child, first_token))

    @property
    def busy(self) -> bool:
        return bool(self.order or self.waiting or self.swapped or self.pending_forks or self._free_later
                    or self._ahead is not None)

    def run(self, max_steps: int = 100000) -> None:
        for _ in range(max_steps):
            if not self.busy:
                return
            self.step()
        raise RuntimeError("the engine did not finish")

    # ---- one step ------------------------------------------------------------------------------------
    def step(self) -> None:
        t_start = time.perf_counter()
        self.phases = {}
        if self._ahead is not None:  # this step's round trip went out during the last forward
            return self._step_ahead(t_start)
        self._swap_in_some()
        free = self._retire() + self._free_later
        self._free_later = []
        forks = self._take_forks(free)
        budget = self.max_tokens
        decode = [rid for rid in self.order if self.reqs[rid].state == RUNNING]
        budget -= len(decode)
        for rid in decode:  # the block a decode token fills (its tokens are known now)
            self._extend_hashes(self.reqs[rid], self.reqs[rid].computed + 1)
        cont = [rid for rid in self.order if self.reqs[rid].state == PREFILL]
        for rid in cont:  # each continuing prefill's chunk, fixed now: its blocks register with it
            r = self.reqs[rid]
            r.chunk = max(min(len(r.prompt) - r.computed, budget), 0)
            budget -= r.chunk
        admits = []
        while self.waiting and budget > 0 and not self.swapped and len(self.order) + len(admits) < self.max_running:
            r = self.reqs[self.waiting.pop(0)]
            r.hashes = self.c.hash_prompt(np.array(r.prompt))
            r.chunk = min(len(r.prompt), budget)  # computes at least these tokens (more after a hit)
            budget -= r.chunk
            admits.append(r)
        # per append: the blocks its tokens (decode: one; continuing prefill: none, its chunk's
        # slots are in its table already) complete this step, registered now
        regs = [self._unregistered(r, r.computed + 1) if self._lagging(r) else []
                for r in (self.reqs[rid] for rid in decode)]
        regs += [self._unregistered(self.reqs[rid], self.reqs[rid].computed + self.reqs[rid].chunk) for rid in cont]
        rows = np.asarray(self.c.rows_of(decode + cont), np.int32) if decode or cont else None
        counts = [len(x) for x in regs]
        if any(counts):  # no filled block: no hash frames (decode only: kvd's decode fast path)
            hs = [np.array([h for x in regs for h in x], self.hashes_dtype)] * self.num_groups
            cnt = [np.array(counts, np.int32)] * self.num_groups
        else:
            hs = cnt = ()
        ntok = 1 if not cont else np.array([1] * len(decode) + [0] * len(cont), np.int32)
        adm = [AdmitRequest(r.rid, len(r.prompt), self._group_hashes(r.hashes[: r.chunk // self.bs])) for r in admits]
        batch = StepBatch(free=free, forks=[(p, c) for p, c, _ in forks], append_rows=rows, append_num_tokens=ntok,
                          append_hashes=hs, append_hash_counts=cnt, admit=adm)
        t0 = time.perf_counter()
        res = self.c.step(batch)
        t1 = time.perf_counter()
        self.kvd_s += t1 - t0
        self.kvd_exposed_s += t1 - t0  # nothing runs meanwhile
        self.phases.update(plan=t0 - t_start, rt=t1 - t0)
        self.steps += 1
        self._check(res)
        if self.after_reply is not None:
            self.after_reply(self, res)
        if self.owned is not None:
            self.owned.copy(res.copies)
        self.copies += len(res.copies)
        for rid, st, n in zip(decode + cont, res.append_status.tolist(), counts):
            if st == STATUS_OK:  # a refused append registered nothing: its hashes wait for the retry
                self.reqs[rid].registered += n
        for p, c, _ in forks:
            self.order.append(c)
        sched = self._schedule(decode, res, cont, admits)
        self._run_forward(sched, res, decode)
        self.phases["total"] = time.perf_counter() - t_start

    def _retire(self) -> list[str]:
        """Take the finished requests out of the running order; their ids (to free)."""
        free = [rid for rid in self.order if self.reqs[rid].finished]
        for rid in free:
            self.order.remove(rid)
            self.reqs[rid].state = DONE
            self.freed_since_preempt = True
        return free

    def _run_forward(self, sched, res, decode) -> None:
        """The step's forward; with ``overlap``, the next step's round trip while it runs."""
        if sched:
            launched = self._launch(sched, res)
            rt = self._send_ahead() if self._steady(sched, res) else None
            self._finish(launched, rt)
        self._preempt(decode, res)  # after the forward: a victim's KV of this step is written

    # ---- overlap: the next decode step's round trip during this step's forward ------------------------
    def _steady(self, sched, res) -> bool:
        """Whether the next step is predictable now: every running request decodes and was granted
        its append, nothing waits, is swapped, forks or continues a prefill."""
        return (self.overlap and not self.waiting and not self.swapped and not self.pending_forks
                and len(sched) == len(self.order) and all(n == 1 for _, _, n in sched)
                and all(self.reqs[rid].state == RUNNING for rid in self.order)
                and not (res.append_status != STATUS_OK).any())

    def _send_ahead(self) -> None:
        """Send the next step while this one's forward runs: a decode append for every request that
        this forward does not finish, with the hashes of the blocks whose tokens are known and
        written by now (a block the next token fills registers one step later), and the frees of
        requests whose last forward is done."""
        t0 = time.perf_counter()
        live = [self.reqs[rid] for rid in self.order]
        for r in live:  # this forward writes position computed: every block up to it is written
            self._extend_hashes(r, r.computed + 1)
        nxt = [r for r in live if len(r.output) + 1 < r.max_new_tokens]
        # requests this forward finishes register their last written blocks with a 0-token append
        fin = [r for r in live if len(r.output) + 1 >= r.max_new_tokens and self._lagging(r)]
        if not nxt:
            return
        reqs = nxt + fin
        regs = [self._unregistered(r, r.computed + 1) if self._lagging(r) else [] for r in reqs]
        counts = [len(x) for x in regs]
        hs = cnt = ()
        if any(counts):
            hs = [np.array([h for x in regs for h in x], self.hashes_dtype)] * self.num_groups
            cnt = [np.array(counts, np.int32)] * self.num_groups
        ids = [r.rid for r in reqs]
        ntok = np.array([1] * len(nxt) + [0] * len(fin), np.int32) if fin else 1
        batch = StepBatch(free=self._free_later, append_rows=np.asarray(self.c.rows_of(ids), np.int32),
                          append_num_tokens=ntok, append_hashes=hs, append_hash_counts=cnt)
        self._free_later = []
        t1 = time.perf_counter()
        res = self.c.step(batch)
        t2 = time.perf_counter()
        self.kvd_s += t2 - t1
        self.ahead_steps += 1
        self._ahead = (ids, len(nxt), counts, res, t1 - t0, t2 - t1)
        return t1, t2

    def _step_ahead(self, t_start: float) -> None:
        """A step whose round trip went out during the last forward: retire what that forward
        finished (freed with the next message), run the granted appends."""
        ids, n_decode, counts, res, plan_s, rt_s = self._ahead
        self._ahead = None
        self._free_later += self._retire()
        self.phases.update(plan=plan_s, rt=rt_s)
        self.steps += 1
        self._check(res)
        if self.after_reply is not None:
            self.after_reply(self, res)
        if self.owned is not None:
            self.owned.copy(res.copies)
        self.copies += len(res.copies)
        sched = []
        for i, (rid, st, n) in enumerate(zip(ids, res.append_status.tolist(), counts)):
            if st == STATUS_OK:
                r = self.reqs[rid]
                r.registered += n
                if i < n_decode:
                    sched.append((r, r.computed, 1))
        self._run_forward(sched, res, ids[:n_decode])
        self.phases["total"] = time.perf_counter() - t_start

    def _extend_hashes(self, r: Request, n_tokens: int) -> None:
        """Hash the full blocks among ``r``'s first ``n_tokens`` tokens that have no hash yet."""
        k, last = len(r.hashes), n_tokens // self.bs
        if last <= k:
            return
        parent = bytes(r.hashes[-1]) if k else None
        new = self.c.hash_prompt(np.array(r.tokens(k * self.bs, (last - k) * self.bs)), parent=parent,
                                 first_block_index=k)
        r.hashes = np.concatenate([r.hashes, new])

    def _lagging(self, r: Request) -> bool:
        """Whether ``r`` has full blocks with known hashes that are not registered yet."""
        return r.registered < min((r.computed + 1) // self.bs, len(r.hashes))

    def _unregistered(self, r: Request, written: int) -> list[bytes]:
        """Hashes of ``r``'s full blocks past those registered, up to ``written`` tokens' worth."""
        return list(r.hashes[r.registered: min(written // self.bs, len(r.hashes))])

    def _group_hashes(self, hashes: np.ndarray):
        return [hashes] * self.num_groups if self.num_groups > 1 else hashes

    def _take_forks(self, freed):
        forks, self.pending_forks = [(p, c, t) for p, c, t in self.pending_forks if p not in freed], []
        for p, c, tok in forks:
            parent = self.reqs[p]
            if parent.state != RUNNING:
                raise RuntimeError(f"fork of {p}: the parent must be decoding")
            child = Request(c, parent.prompt, parent.max_new_tokens, dict(parent.forced),
                            list(parent.output), list(parent.logits), parent.hashes.copy(), parent.computed,
                            parent.cached_tokens, 0, RUNNING, parent.first_token_step, parent.admitted_step,
                            parent.added_at, parent.first_token_at)
            child.registered = parent.registered
            child.output[-1] = tok
            child.forced[len(child.output) - 1] = tok
            self.reqs[c] = child
        return forks

    def _check(self, res) -> None:
        for what in ("free_status", "fork_status"):
            st = getattr(res, what)
            if st.any():
                raise RuntimeError(f"kvd refused part of the step: {what}={st.tolist()}")
        for st in (res.append_status, res.admit_status):
            bad = (st != STATUS_OK) & (st != STATUS_NO_SPACE)
            if bad.any():
                raise RuntimeError(f"kvd refused part of the step: {st.tolist()}")

    def _schedule(self, decode, res, cont, admits):
        """(request, first position, token count) of this step's forward, in any order."""
        sched = []
        for rid, st in zip(decode, res.append_status.tolist()):
            if st == STATUS_OK:  # a refused append registered nothing: its hash waits for the retry
                r = self.reqs[rid]
                sched.append((r, r.computed, 1))
        for rid in cont:
            r = self.reqs[rid]
            if r.chunk > 0:
                sched.append((r, r.computed, r.chunk))
        for i, r in enumerate(admits):
            if int(res.admit_status[i]) != STATUS_OK:
                self.waiting.insert(0, r.rid)  # no room now: first in line next time
                continue
            r.cached_tokens = r.computed = int(res.admit_cached_tokens[i])
            r.registered = max(r.computed // self.bs, r.chunk // self.bs)  # what kvd registered
            r.state, r.admitted_step = PREFILL, self.steps
            self.order.append(r.rid)
            sched.append((r, r.computed, min(len(r.prompt) - r.computed, r.chunk)))
        return sched

    def _preempt(self, decode, res) -> None:
        """Appends kvd refused (no free block): swap out the newest running request; the refused
        requests retry next step."""
        refused = [rid for rid, st in zip(decode, res.append_status.tolist()) if st == STATUS_NO_SPACE]
        if not refused:
            return
        victims = [rid for rid in reversed(self.order) if self.reqs[rid].state == RUNNING]
        for rid in victims[:1]:
            out = self.c.swap_out([rid])
            if not out.ok:
                raise RuntimeError(f"swap_out({rid}) found no room in the CPU pool")
            if self.owned is not None:
                self.owned.swap_out(out.mapping)
            self.order.remove(rid)
            self.reqs[rid].state = SWAPPED
            self.swapped.append(rid)
            self.swaps_out += 1
            self.freed_since_preempt = False

    def _swap_in_some(self) -> None:
        # only once a request finished since the last preemption: swapping straight back into the
        # blocks the preemption freed would refuse the same appends again (a livelock)
        while self.swapped and self.freed_since_preempt:
            rid = self.swapped[0]
            got = self.c.swap_in([rid])
            if not got.ok:
                return
            if self.owned is not None:
                self.owned.swap_in(got.mapping)
            self.swapped.pop(0)
            self.order.append(rid)
            self.reqs[rid].state = RUNNING
            self.swaps_in += 1

    # ---- the forward ---------------------------------------------------------------------------------
    def _tables(self):
        gpu = getattr(self.c, "gpu_tables", None) if self.device.type == "cuda" else None
        if gpu is not None:
            return list(gpu)
        with warnings.catch_warnings():  # read-only shm views: the forward only reads them
            warnings.simplefilter("ignore", UserWarning)
            return [torch.from_numpy(t) if isinstance(t, np.ndarray) else t for t in self.c.tables]

    def _kvd_slots(self, res, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray):
        """kvd's own slot mappings of this step, or None: usable when kvd's schedule (its appends and
        admissions with tokens, in batch order) is exactly this forward's, and the buffer holds it all."""
        if self.device.type == "cuda":
            maps = getattr(self.c, "gpu_slot_mappings", None)
        else:
            maps = getattr(self.c, "slot_mappings", None)
        total = int(counts.sum())
        if maps is None or total > maps[0].shape[0]:
            return None
        m = res.sched_len > 0
        if not (np.array_equal(res.sched_rows[m], rows) and np.array_equal(res.sched_start[m], starts)
                and np.array_equal(res.sched_len[m], counts)):
            return None
        if self.device.type == "cuda":
            return [s[:total] for s in maps]
        return [torch.from_numpy(np.asarray(s[:total], np.int64)) for s in maps]

    def _forward(self, sched, res) -> None:
        self._finish(self._launch(sched, res))

    def _launch(self, sched, res):
        """Build the step's inputs and metadata and launch its forward (a CUDA graph's replay for a
        small step when graphs are on); returns what :meth:`_finish` needs."""
        t0 = time.perf_counter()
        dev = self.device
        n = len(sched)
        starts = np.fromiter((s for _, s, _ in sched), np.int64, n)
        counts = np.fromiter((k for _, _, k in sched), np.int64, n)
        total = int(counts.sum())
        ids = np.fromiter(chain.from_iterable(r.tokens(s, k) for r, s, k in sched), np.int64, total)
        done = [i for i, (r, s, k) in enumerate(sched) if s + k == r.seq_len]  # rows that sample
        t_meta = time.perf_counter()  # kvd's share from here: varlen layout, tables, slots
        rows = np.asarray(self.c.rows_of([r.rid for r, _, _ in sched]), np.int32)
        qsl, seq_lens, positions = varlen_layout(starts, counts)
        keep = qsl[1:][done] - 1
        tables = self._tables()
        host_tables = tables[0].device.type != dev.type
        if host_tables:  # host tables, device model: only the scheduled rows' used columns move
            width = -(-int(seq_lens.max()) // self.bs)
            tables = [t[torch.from_numpy(rows).long(), :width] for t in tables]
            rows = np.arange(n, dtype=np.int32)
        graphs = self.graphs if self.graphs is not None and self.graphs.fits(total) else None
        # kvd's slot mapping: the eager forward's when it is this step's (a graph computes its own)
        wanted = not host_tables and not self.overlap and (graphs is None or self.check_slots)
        kvd = self._kvd_slots(res, rows, starts, counts) if wanted else None
        self.kvd_slot_steps += kvd is not None and graphs is None
        timed = self.overlap and dev.type == "cuda"  # when the forward ends on the GPU (overlap figures)
        if graphs is not None:  # the graph computes the slots from the tables itself
            bucket = graphs.prepare(ids, positions, keep, np.repeat(np.arange(n, dtype=np.int64), counts), rows,
                                    seq_lens, qsl, tables)
            t_model = time.perf_counter()
            events = _record_start(timed)
            logits = graphs.replay(bucket, len(done))
            if kvd is not None and self.check_slots:
                assert all(torch.equal(a, b[:total]) for a, b in zip(kvd, bucket.slots)), "kvd slot mapping differs"
        else:
            if host_tables:
                tables = [t.to(dev) for t in tables]
            own = kvd is None or self.check_slots  # slots from the tables (too)
            rep = np.repeat(np.arange(n, dtype=np.int64), counts) if own else None
            x = self.staging.pack(ids, positions, keep, rep, rows, seq_lens, qsl)
            slots = kvd
            if own:  # slot = block_id * block_size + position % block_size
                mine = [t[x.rows[x.rep].long(), x.positions // self.bs].long() * self.bs + x.positions % self.bs
                        for t in tables]
                if kvd is not None:
                    assert all(torch.equal(a, b) for a, b in zip(kvd, mine)), "kvd slot mapping differs"
                else:
                    slots = mine
            meta = StepMeta(self.kv, self.groups, slots, tables, x.rows, x.seq_lens, x.qsl)
            t_model = time.perf_counter()
            events = _record_start(timed)
            use_paged(self.model, True)
            try:
                with torch.no_grad():
                    logits = self.model(input_ids=x.ids[None], position_ids=x.positions[None], kvd_meta=meta,
                                        use_cache=False, logits_to_keep=x.keep).logits[0]
            finally:
                use_paged(self.model, False)
        if events is not None:
            events[1].record()
        self.meta_s += t_model - t_meta
        self.phases.update(inputs=t_meta - t0, meta=t_model - t_meta)
        return sched, done, logits, t0, t_model, events

    def _finish(self, launched, ahead_rt: tuple[float, float] | None = None) -> None:
        """Wait for the launched forward, sample, account. ``ahead_rt``: host (start, end) of the
        round trip sent during this forward; the part after the GPU finished is exposed."""
        sched, done, logits, t0, t_model, events = launched
        t_sample = time.perf_counter()
        self._sample(sched, done, logits)
        self.forwards += 1
        t1 = time.perf_counter()
        self.forward_s += t1 - t0
        self.phases.update(model=t_sample - t_model, sample=t1 - t_sample)
        if ahead_rt is not None:
            # the CPU's forward has returned before the round trip starts: all of it is exposed
            gpu_done = t_model + events[0].elapsed_time(events[1]) / 1e3 if events is not None else ahead_rt[0]
            exposed = max(0.0, ahead_rt[1] - max(ahead_rt[0], gpu_done))
            self.kvd_exposed_s += exposed
            self.phases["rt_exposed"] = exposed

    def _sample(self, sched, done, logits) -> None:
        """Greedy tokens (argmax on the model's device; only the ids come back) unless forced."""
        best = torch.argmax(logits, dim=-1).tolist()  # the step's one device synchronization
        kept = logits.float().cpu() if self.keep_logits else None
        for r, s, n in sched:
            r.computed = s + n
            if r.state == PREFILL and r.computed >= len(r.prompt):
                r.state = RUNNING
            if r.cached_tokens <= s < len(r.prompt):
                r.prefilled_tokens += min(n, len(r.prompt) - s)
        now = time.perf_counter()
        for j, i in enumerate(done):
            r = sched[i][0]
            r.output.append(r.forced.get(len(r.output), best[j]))
            if kept is not None:
                r.logits.append(kept[j])
            if r.first_token_step < 0:
                r.first_token_step, r.first_token_at = self.steps, now
