"""Overlap (async scheduling): in steady decode, the next step's round trip to kvd goes out while
this step's forward runs on the GPU, so kvd's round trip leaves the step's critical path.

Steady: every running request decodes and was granted its append, nothing waits, is swapped, forks,
continues a prefill or has yet to append after a fork. Then the next step is known before this step's tokens are: a 1-token append
for every request this forward does not finish. What it cannot carry yet waits one message: the hash
of a block the next token fills (its token is sampled by this forward), the frees of requests this
forward finishes (their blocks are read until it ends); a finishing request registers its last
written blocks with a 0-token append. Safe only where no message rewrites what the running forward
reads: no copy-on-write (a daemon that owns the KV copies when the message arrives, so a fork's step
and its requests' first appends go synchronously: ``Engine.fork``), slots from the tables (kvd
rewrites its slot buffer for the next step), and a sliding-window group's window in kvd longer than
the model's by the tokens the messages run ahead (a window's release would otherwise give back a
block the running forward still reads: ``Engine._check_windows``); ``Engine`` refuses the rest.

Multi-step windows (``Engine(steps_per_message=k)``): a steady batch's message appends ``k`` tokens
per request (fewer where a request has fewer left), and the ``k`` steps it grants run without
another message. The next window's message goes out during the forward of the window's next-to-last
step, so its round trip has two forwards to come back in (after ~k idle steps the daemon and both
sides' ZeroMQ I/O threads wake from sleep for it); its reply is taken during the last step's
forward at the latest. Where a request finishes with this window (its last blocks register then),
the message goes out during the last step instead. The blocks the steps fill queue as usual (hashed
while the forwards run) and register with the next message. A message kvd grants only in part
leaves its granted requests holding ``k - 1`` tokens (``Request.held``), which the generic steps
then take with 0-token appends.
"""

from __future__ import annotations

import os
import time

import numpy as np

from kvd.api import STATUS_OK, StepBatch

from .state import DONE, RUNNING


class OverlapMixin:
    """``Engine``'s overlap steps (see the module docstring)."""

    def _steady(self, sched, res) -> bool:
        """Whether the next step is predictable now: every running request decodes and was granted
        its append, nothing waits, is swapped, forks, continues a prefill or has yet to append
        after a fork (``Engine.fork``)."""
        return (self.overlap and not self.waiting and not self.swapped and not self.pending_forks
                and not self.unsplit and len(sched) == len(self.order) and all(n == 1 for _, _, n in sched)
                and all(self.reqs[rid].state == RUNNING and not self.reqs[rid].held for rid in self.order)
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
        if not nxt and not fin:
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
        return self._send(np.asarray(self.c.rows_of(ids), np.int32), ntok, hs, cnt, (ids, len(nxt), counts), t0)

    def _send(self, rows, ntok, hs, cnt, ahead: tuple, t0: float, steady=None):
        """Send the next step's message (with the frees waiting for it) without waiting for its
        reply, which :meth:`_take_ahead` takes when it arrives during this step's forward, else
        after the sampling (:meth:`_reply_or_gpu`): ``self._ahead`` = (*ahead, pending reply, plan
        time, send start, steady)."""
        msg = StepBatch(free=self._free_later, append_rows=rows, append_num_tokens=ntok, append_hashes=hs,
                        append_hash_counts=cnt)
        self._free_later = []
        t1 = time.perf_counter()
        pending = self.c.start_step(msg)
        t2 = time.perf_counter()
        self.kvd_s += t2 - t1
        self.sends_s.append(t2 - t1)
        self.ahead_steps += 1
        self._ahead = (*ahead, pending, t1 - t0, t1, steady)
        return t1, t2

    def _take_ahead(self) -> None:
        """Take the reply of the step sent during this forward (waiting for it if it has not
        arrived): whether kvd granted all of it (``PendingStep.granted``: a steady step reads
        nothing else, and the whole result is built only when another step needs it);
        ``self._took`` = its host (start, end)."""
        *ahead, pending, plan_s, t_sent, steady = self._ahead
        t0 = time.perf_counter()
        pending.granted()
        t1 = time.perf_counter()
        self.kvd_s += t1 - t0
        self.takes_s.append(t1 - t0)
        self.kvd_wall_s += t1 - t_sent
        self._took = (t0, t1)
        self._ahead = (*ahead, pending, plan_s, t1 - t_sent, steady)

    def _reply_or_gpu(self, forward_end) -> None:
        """Before the engine blocks on its forward: poll for whichever comes first, the reply of the
        step sent ahead (taken at once, its decoding overlapping the forward too, then the steady
        batch's queued blocks are hashed for the next messages until the forward ends) or the
        forward's end (``forward_end``, a CUDA event recorded after it; None: no step was sent
        during this forward, or it is not timed; the reply is then taken after the sampling, which
        needs no reply)."""
        if forward_end is None:
            return
        if self._ahead is None or self._took is not None:  # no reply to wait for: only the hashing
            if self._batch is not None:
                self.prehashed_blocks += self._batch.prehash(self.c.hash_next_blocks, forward_end.query)
            return
        pending = self._ahead[3]
        while not forward_end.query():
            if not pending.ready():
                os.sched_yield()  # as kvd_client's busy polling: a daemon sharing the CPU runs
                continue
            self._take_ahead()
            if self._batch is not None:  # the next messages' hashes, while the GPU works
                self.prehashed_blocks += self._batch.prehash(self.c.hash_next_blocks, forward_end.query)
            return

    def _took_ahead_reply(self, res) -> None:
        """``_took_reply`` of a message sent during a forward, which no copy-on-write may carry
        (``Engine.fork``: a daemon that owns the KV copies when the message arrives)."""
        assert not len(res.copies), "a message sent during a forward copied on write"
        self._took_reply(res)

    def _ahead_exposed(self, sent: tuple[float, float], gpu_done: float) -> None:
        """Account the round trip sent during the forward that ended (on the GPU) at ``gpu_done``:
        taken already or now, its host time after that end is exposed."""
        if self._took is None:
            self._take_ahead()
        exposed = sum(max(0.0, b - max(a, gpu_done)) for a, b in (sent, self._took))
        self._took = None
        self.kvd_exposed_s += exposed
        self.phases.update(rt_exposed=exposed, rt_wall=self._ahead[5])

    def _send_ahead_steady(self, batch, early: bool = False):
        """:meth:`_send_ahead` from a steady batch's arrays (falls back to it, dropping the batch,
        when the hash bookkeeping is not the steady one). ``early``: sent a step before the window's
        last (every request has more than two tokens left: none finishes with the window)."""
        if self.waiting or self.swapped or self.pending_forks:
            return None
        t0 = time.perf_counter()
        if not batch.queue_filled():  # the blocks this forward completes wait in the batch's queue
            assert not early, "a window's steps keep the steady hash bookkeeping"
            self._drop_batch()
            return self._send_ahead()
        nxt = batch.left > 1 + early  # tokens left after the steps before the next window
        hrows, hashes = batch.take(~nxt, self.c.hash_next_blocks)  # in one call (a few, if chained)
        fill = np.zeros(len(batch), np.int32)
        fill[hrows] = [len(h) for h in hashes]
        fin = ~nxt & (fill > 0)  # finishing with a block to register: a 0-token append
        n_next = int(np.count_nonzero(nxt))
        if not n_next and not fin.any():
            return None
        k = 1
        # the next window: as many steps as every continuing request has tokens left, and one step
        # while a request has no block hash yet (its first block, filled in a window, would have no
        # parent for the batch's chained hashing: its steps go one message each until it has one)
        if n_next and (batch.nh[nxt] > 0).all():
            k = min(self.per_message, int(batch.left[nxt].min()) - 1 - early)
            if self._message_tokens:  # and as the daemon takes in one message
                k = max(1, min(k, self._message_tokens // n_next))
        ntok = k
        if n_next == len(batch):
            order, ids, counts, rows = None, batch.rids, fill, batch.rows
        else:
            order = np.concatenate([np.flatnonzero(nxt), np.flatnonzero(fin)])
            ids, counts, rows = [batch.rids[i] for i in order.tolist()], fill[order], batch.rows[order]
            if not n_next:  # every request finishes: one count for all, kvd's decode fast path
                ntok = 0
            elif len(order) > n_next:
                ntok = np.zeros(len(order), np.int32)
                ntok[:n_next] = k
        hs = cnt = ()
        if hrows.size:  # in message order: each row's hashes in chain order
            by_row = dict(zip(hrows.tolist(), hashes))
            seq = np.flatnonzero(counts) if order is None else order[counts > 0]
            hv = np.array([h for i in seq.tolist() for h in by_row[i]], self.hashes_dtype)
            hs, cnt = [hv] * self.num_groups, [counts] * self.num_groups
        return self._send(rows, ntok, hs, cnt, (ids, n_next, counts), t0, (batch, order, k))

    def _step_ahead(self, t_start: float) -> None:
        """A step whose round trip went out during the last forward: retire what that forward
        finished (freed with the next message), run the granted appends."""
        ids, n_decode, counts, pending, plan_s, rt_s, fast = self._ahead
        self._ahead = None
        if fast is not None and fast[0] is self._batch and pending.granted():
            return self._step_ahead_steady(t_start, fast[1], counts, pending, plan_s, rt_s, fast[2])
        res = pending.result()
        k = fast[2] if fast is not None else 1  # what kvd granted a request beyond this step it holds
        self._drop_batch()
        self._free_later += self._retire()
        self.phases.update(plan=plan_s, rt=rt_s)
        self._took_ahead_reply(res)
        sched = []
        for i, (rid, st, n) in enumerate(zip(ids, res.append_status.tolist(), counts)):
            if st == STATUS_OK:
                r = self.reqs[rid]
                r.registered += n
                if i < n_decode:
                    sched.append((r, r.computed, 1))
                    r.held += k - 1
        self._run_forward(sched, res, ids[:n_decode])
        self.phases["total"] = time.perf_counter() - t_start

    def _step_ahead_steady(self, t_start: float, order, counts, pending, plan_s: float, rt_s: float, k: int) -> None:
        """:meth:`_step_ahead` of a steady batch whose every append kvd granted with nothing copied
        (``k`` steps each: the first of a window): its reply needs no check and carries no copies."""
        batch = self._batch
        self.steady_steps += 1
        batch.registered(order, counts)
        gone = batch.left == 0  # finished by the last forward: freed with the next message
        if gone.any():
            out = [r for r, g in zip(batch.reqs, gone.tolist()) if g]
            for r in out:
                r.state = DONE
            self.order = [rid for rid in self.order if self.reqs[rid].state != DONE]
            self._free_later += [r.rid for r in out]
            self.freed_since_preempt = True
            batch.compact(~gone)
        self.phases.update(plan=plan_s, rt=rt_s)
        self._took_granted(pending)
        if len(batch):
            self._window_left = k - 1
            self._run_steady(batch)
        else:
            self._drop_batch()
        self.phases["total"] = time.perf_counter() - t_start

    def _step_window(self, t_start: float) -> None:
        """A step of a multi-step window after its first: the batch as it is, no message but the
        next window's, sent during the forward of the window's next-to-last step (or its last)."""
        self._window_left -= 1
        self.steps += 1
        self.steady_steps += 1
        self._run_steady(self._batch)
        self.phases["total"] = time.perf_counter() - t_start

    def _run_steady(self, batch) -> None:
        """Launch a steady step; during its forward, send the next step's message, or within a window
        queue the blocks it fills (they register with the next message), the next window's message
        going out on its next-to-last step (see the module docstring)."""
        launched = self._launch_steady(batch)
        left, early = self._window_left, self._early_rt
        if not left and early is None:
            return self._finish(launched, self._send_ahead_steady(batch))
        if left == 1 and (batch.left > 2).all():  # (left is 1 only inside a window)
            rt = self._send_ahead_steady(batch, early=True)
            if rt is not None:  # its reply: taken during this forward if it comes, else during the next
                self._early_rt = rt
                self.early_messages += 1
                return self._finish(launched, rt, settle=False)
        ok = batch.queue_filled()
        assert ok, "a window's steps keep the steady hash bookkeeping"
        if early is not None:  # the window's last step: the message sent on the one before comes back now
            self._early_rt = None
            return self._finish(launched, early)
        self._finish(launched, None)
