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
from collections import deque

import numpy as np
import torch

from kvd import sha256loop
from kvd.api import STATUS_NO_SPACE, STATUS_OK, AdmitRequest, StepBatch

from .forward import ForwardMixin
from .fused import install as install_fused
from .graphs import GraphRunner
from .inputs import Staging
from .model import layer_groups, window_of
from .overlap import OverlapMixin
from .state import DONE, PREFILL, RUNNING, SWAPPED, WAITING, OwnedKv, Request, daemon_kv
from .steady import SteadyBatch

__all__ = ["Engine", "OwnedKv", "Request", "daemon_kv", "WAITING", "PREFILL", "RUNNING", "SWAPPED", "DONE"]


MESSAGE_TIMES = 1 << 14


class Engine(ForwardMixin, OverlapMixin):
    """One engine: a model, a kvd client (daemon ``kvd_client.Client`` or ``InProcClient``), a queue."""

    def __init__(self, client, model, *, kv: OwnedKv | None = None, max_tokens: int = 256, max_running: int = 64,
                 device="cpu", keep_logits: bool = True, graph_tokens: int = 0, overlap: bool = False,
                 prestage: bool = True, fused: bool = True, steps_per_message: int = 1,
                 register_every: int | None = None):
        """``keep_logits``: keep every sampled row's logits (float32, on the host) in ``Request.logits``
        (the tests compare them with HF's); False: only the sampled token ids leave the device.
        ``graph_tokens``: on CUDA, steps of at most that many tokens replay CUDA graphs
        (``graphs.GraphRunner``); 0: every forward is eager. ``overlap``: in steady decode (every
        running request decoding, nothing waiting), send the next step's round trip while this
        step's forward runs (async scheduling). Needs kvd's sliding windows to run that far ahead of
        the model's (``_check_windows``) and a client that confirms a step only once a later one is sent (``steps_in_flight``
        >= 1); slots then come from the block tables (kvd rewrites its slot buffer for the next step
        while this forward may still read it). ``prestage``: with graphs and overlap, a steady decode
        step replays the inputs the previous step's graph advanced on the device
        (``graphs.Bucket.advance``) instead of staging them from the host (its tokens are checked by
        tests/test_engine_gpu.py, its speed by scripts/bench_engine.py --no-prestage).
        ``fused``: on CUDA, the model's RMSNorms and rotary embedding run as fused Triton kernels in
        the engine's forwards (``fused.py``; ``--no-fused`` in the bench). ``steps_per_message``
        (needs ``overlap``): a steady decode batch appends up to that many tokens per request in one
        message and runs that many steps on it (multi-step scheduling, as vLLM's
        ``num_scheduler_steps``: kvd's round trip once per window; a request arriving meanwhile
        waits for the window's end, a block filled meanwhile registers with the next message).
        ``register_every`` k: a steady batch's filled blocks register with a message k or more
        after the last that registered some (``SteadyBatch``; default: block size /
        ``steps_per_message``, so a request has about one block to register then): the messages
        between carry no hashes and cost the engine's thread least, the blocks become prefix hits
        for other engines about k messages later."""
        self.c = client
        sha256loop.warm_up()  # the compiled prompt hashing, loaded now rather than on the first request
        self.model = model
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.owned = kv
        self.fused = self.device.type == "cuda" and install_fused(model, fused)
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
        # requests of a fork whose first append since it is not granted yet: that append may copy
        # on write a block the fork shares; it never goes out during a forward (see ``fork``)
        self.unsplit: set[str] = set()
        self.steps = 0
        self.copies = 0
        self.swaps_out = self.swaps_in = 0
        self.forward_s = 0.0
        # kvd's share of the steps: the engine thread's time in round trips (a step sent ahead:
        # its send and the wait for its reply, not the time between, when the thread waits for the
        # GPU and samples) ...
        self.kvd_s = 0.0
        self.meta_s = 0.0  # ... and building slots / table views / varlen layout from its answer
        self.meta_exposed_s = 0.0  # the part of meta_s the GPU waited for (not done during a forward)
        self.kvd_wall_s = 0.0  # the round trips from send to reply taken, overlapped or not
        # a message sent ahead (overlap): each send's and each reply's taking host seconds, the
        # latest MESSAGE_TIMES of each (a serving engine sends messages for days)
        self.sends_s: deque[float] = deque(maxlen=MESSAGE_TIMES)
        self.takes_s: deque[float] = deque(maxlen=MESSAGE_TIMES)
        # the last step's phases (seconds): plan (scheduling, hashing), rt (kvd round trip), inputs
        # (token ids), meta (kvd's metadata), launch (the forward's), model (the launch and, with
        # overlap, the next step's plan and send), gpu (launch to the forward's end on the GPU, when
        # timed), sample (waiting for the device, sampling), rt_wall and rt_exposed (overlap: the
        # round trip sent during the forward, from its send to its reply taken, and its exposed
        # part), total
        self.phases: dict[str, float] = {}
        self.freed_since_preempt = True
        self.keep_logits = keep_logits
        ticks = getattr(client, "_step_ticks", None)
        if overlap and ticks is not None and ticks.maxlen < 2:
            raise ValueError("overlap needs a client with steps_in_flight >= 1")
        self.overlap = overlap
        if type(steps_per_message) is not int or steps_per_message < 1 or (steps_per_message > 1 and not overlap):
            raise ValueError("steps_per_message must be an integer >= 1; more than 1 needs overlap")
        self._check_windows(window_of(model.config), (2 if steps_per_message > 1 else 1) if overlap else 0)
        self.per_message = steps_per_message
        if register_every is None:  # a request fills at most one block between registering messages
            register_every = max(1, self.bs // steps_per_message)
        if type(register_every) is not int or register_every < 1:
            raise ValueError("register_every must be an integer >= 1")
        self.register_every = register_every
        # a window's message carries K tokens a request: at most the daemon's max_num_batched_tokens
        self._message_tokens = int(getattr(client, "info", {}).get("max_tokens", 0))
        self._window_left = 0  # steps of the current multi-step window still to run without a message
        self._early_rt = None  # host (start, end) of the send of a window's message sent a step early
        self.early_messages = 0  # windows' messages sent on the next-to-last step
        # (ids, decode count, hash counts, StepResult, plan s, rt s, (SteadyBatch, its row order) or
        # None) of the step sent ahead (until its reply is taken: the pending reply, plan s, send start, ...)
        self._ahead = None
        self._took = None  # host (start, end) of taking the reply of the step sent ahead
        self._batch: SteadyBatch | None = None  # overlap: the steady decode batch's arrays
        self.ahead_steps = 0
        self.steady_steps = 0  # steps that ran on the steady batch's arrays
        self.prehashed_blocks = 0  # blocks hashed while waiting for a forward (SteadyBatch.prehash)
        # the step round trips' time on the critical path: all of a round trip the engine waits for,
        # the part of one sent ahead after the forward it overlapped had finished on the GPU (on the
        # CPU the forward is done before it starts: all of it)
        self.kvd_exposed_s = 0.0
        self._free_later: list[str] = []  # finished requests to free with the next message
        self.staging = Staging(self.device)
        self.graphs = None
        self.prestage = prestage
        self.prestaged_steps = 0
        self.prestaged_replays = 0  # steady steps launched as a bare replay of their prestaged bucket
        self._bucket = None  # the graph bucket of the last launch (None: eager)
        if graph_tokens > 0 and self.device.type == "cuda":
            host = isinstance(client.tables[0], np.ndarray) and getattr(client, "gpu_tables", None) is None
            self.graphs = GraphRunner(model, self.kv, self.groups, self.num_groups, self.bs, graph_tokens,
                                      table_width=client.tables[0].shape[1] if host else 0)
        self.forwards = 0
        self.kvd_slot_steps = 0  # forwards that used kvd's own slot mapping (not one from the tables)
        self.check_slots = False  # tests: compare kvd's slot mapping with the one from the tables
        self.after_reply = None  # hook(engine, StepResult) between kvd's reply and the forward (tests)

    def _check_windows(self, window: int, ahead: int) -> None:
        """kvd must keep every block a forward reads. Full-attention layers read their group's whole
        tables: no window there. The sliding-window layers read a request's last ``window`` tokens
        (the model's): their group's window in kvd is none or at least that plus ``ahead``, the
        tokens by which kvd's messages run ahead of the forwards reading those blocks. A window
        releases what the first token an append adds no longer reads; with overlap that append goes
        out during the forward of the token before it (1 ahead), a multi-step window's next message
        during the window's next-to-last forward (2 ahead). Released sooner, a block could go to
        another engine and be rewritten while this engine's forward still reads it."""
        kvd = getattr(self.c, "sliding_windows", None)
        if kvd is None:  # (a client that does not say: test doubles)
            return
        for g, w in enumerate(kvd):
            if not w or g not in self.groups:
                continue
            if g == 0:  # (layer_groups: group 0 the full-attention layers, 1 the window's)
                raise ValueError(f"kvd's KV-cache group {g} has a sliding window of {w} tokens, but the model's "
                                 "full-attention layers use it")
            if w < window + ahead:
                raise ValueError(f"kvd's KV-cache group {g} has a sliding window of {w} tokens: the model's window "
                                 f"is {window}" + (f" and this engine's messages run {ahead} token(s) ahead of its "
                                                   "forwards" if ahead else "") + f"; it needs >= {window + ahead}")

    # ---- requests ------------------------------------------------------------------------------------
    def add(self, rid: str, prompt, max_new_tokens: int, forced: dict[int, int] | None = None) -> None:
        self.reqs[rid] = Request(rid, [int(t) for t in prompt], max_new_tokens, dict(forced or {}),
                                 added_at=time.perf_counter())
        self.waiting.append(rid)

    def fork(self, parent: str, child: str, first_token: int) -> None:
        """Parallel sampling: ``child`` shares ``parent``'s blocks (kvd fork, copy-on-write) and
        replaces the parent's last sampled token with ``first_token``, in the next step that is
        not sent yet (with ``overlap``, a step whose message went out during the last forward
        runs first: the parent has one token more then).

        With overlap, the fork's step and each of its requests' first append after it go as
        synchronous steps (``_steady`` is False while any waits): an append to a partly filled
        block the fork shares copies it on write, and a daemon that owns the KV copies when the
        message arrives, so a message sent during a forward would copy a block that forward may
        still be writing (the parent's last token's K/V)."""
        self.pending_forks.append((parent, child, first_token))

    @property
    def busy(self) -> bool:
        return bool(self.order or self.waiting or self.swapped or self.pending_forks or self._free_later
                    or self._ahead is not None or self._window_left)

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
        if self._window_left:  # a step of a multi-step window: kvd granted it with the window's message
            return self._step_window(t_start)
        if self._ahead is not None:  # this step's round trip went out during the last forward
            return self._step_ahead(t_start)
        self._drop_batch()
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
            # int32 as hashed: np.array of a list of ints costs ~1.5x and an int64 copy to convert
            r.hashes = self.c.hash_prompt(np.fromiter(r.prompt, np.int32, len(r.prompt)))
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
        held = [self.reqs[rid].held > 0 for rid in decode]  # their next token is in kvd already: 0 more
        ntok = 1 if not cont and not any(held) else np.array([0 if h else 1 for h in held] + [0] * len(cont), np.int32)
        adm = [AdmitRequest(r.rid, len(r.prompt), self._group_hashes(r.hashes[: r.chunk // self.bs])) for r in admits]
        batch = StepBatch(free=free, forks=[(p, c) for p, c, _ in forks], append_rows=rows, append_num_tokens=ntok,
                          append_hashes=hs, append_hash_counts=cnt, admit=adm)
        t0 = time.perf_counter()
        res = self.c.step(batch)
        t1 = time.perf_counter()
        self.kvd_s += t1 - t0
        self.kvd_wall_s += t1 - t0
        self.kvd_exposed_s += t1 - t0  # nothing runs meanwhile
        self.phases.update(plan=t0 - t_start, rt=t1 - t0)
        self._took_reply(res)
        for i, (rid, st, n) in enumerate(zip(decode + cont, res.append_status.tolist(), counts)):
            if st == STATUS_OK:  # a refused append registered nothing: its hashes wait for the retry
                self.reqs[rid].registered += n
                if i < len(decode) and held[i]:
                    self.reqs[rid].held -= 1  # (a token kvd held: appended already, before a fork)
                else:
                    self.unsplit.discard(rid)
        for p, c, _ in forks:
            self.order.append(c)
            self.unsplit.add(c)
        sched = self._schedule(decode, res, cont, admits)
        self._run_forward(sched, res, decode)
        self.phases["total"] = time.perf_counter() - t_start

    def _retire(self) -> list[str]:
        """Take the finished requests out of the running order; their ids (to free)."""
        free = [rid for rid in self.order if self.reqs[rid].finished]
        self.unsplit.difference_update(free)  # (a child its fork finished: no append to wait for)
        for rid in free:
            self.order.remove(rid)
            self.reqs[rid].state = DONE
            self.freed_since_preempt = True
        return free

    def _run_forward(self, sched, res, decode) -> None:
        """The step's forward; with ``overlap``, the next step's round trip while it runs."""
        if sched:
            launched = self._launch(sched, res)
            rt = None
            if self._steady(sched, res):  # from now on the steps run on arrays (steady.py)
                batch = self._batch = SteadyBatch([r for r, _, _ in sched], self.c.rows_of([r.rid for r, _, _ in sched]),
                                                  self.bs, self.hashes_dtype, self.per_message,
                                                  self.register_every)
                launched = ((batch, None),) + launched[1:]
                rt = self._send_ahead_steady(batch)
            self._finish(launched, rt)
        self._preempt(decode, res)  # after the forward: a victim's KV of this step is written

    def _drop_batch(self) -> None:
        """Leave the steady batch (its hashes go to their requests first)."""
        if self._batch is not None:
            self._batch.flush()
            self._batch = None

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
            self.unsplit.add(p)  # (this step's append: granted, it leaves the set again)
        return forks

    def _took_reply(self, res) -> None:
        """A step's reply arrived: check it, let a hook see it, do its copies if the KV is ours."""
        self.steps += 1
        self._check(res)
        if self.after_reply is not None:
            self.after_reply(self, res)
        if self.owned is not None:
            self.owned.copy(res.copies)
        self.copies += len(res.copies)

    def _took_granted(self, pending) -> None:
        """``_took_reply`` of a reply that granted every request and copied nothing
        (``PendingStep.granted``): nothing to check or copy; its result is built for a hook only."""
        self.steps += 1
        if self.after_reply is not None:
            self.after_reply(self, pending.result())

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
