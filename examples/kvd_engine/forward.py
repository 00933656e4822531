"""The forward of one engine step: inputs and kvd's metadata on the device (one staged copy), the
model (a CUDA graph's replay for a small step, else the eager paged forward), greedy sampling."""

from __future__ import annotations

import time
import warnings
from itertools import chain

import numpy as np
import torch

from .graphs import TableRows
from .inputs import varlen_layout
from .model import StepMeta, use_paged
from .state import PREFILL, RUNNING


def _record_start(timed: bool):
    """(start, end) timing events with the start recorded now, or None."""
    if not timed:
        return None
    events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
    events[0].record()
    return events


class ForwardMixin:
    """``Engine``'s forward pass (``_forward``, or ``_launch`` then ``_finish`` around a round trip)."""

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
        return self._dispatch((sched, done), res, t0, t_meta, ids, positions, keep, None, rows, seq_lens, qsl,
                              (starts, counts))

    def _launch_steady(self, batch):
        """:meth:`_launch` for a steady decode batch (``steady.SteadyBatch``): its arrays as they are,
        one token per row, every row sampling. A step the last forward staged on the device
        (``Bucket.advance``: the same bucket, tables and layout) only replays."""
        t0 = time.perf_counter()
        bk = self._prestaged(batch)
        if bk is not None:
            bk.prestaged = 0
            self.prestaged_replays += 1
            return self._replay(bk, (batch, None), t0, t0, batch.keep.shape[0])
        pos = batch.pos
        return self._dispatch((batch, None), None, t0, t0, batch.last, pos, batch.keep, batch.keep, batch.rows,
                              (pos + 1).astype(np.int32), batch.qsl, None, layout=batch.stamp)

    def _prestaged(self, batch):
        """The last step's graph bucket when ``batch``'s next step was staged into it during that
        step's forward and nothing else it reads moved: the session's device tables, at the
        addresses it was staged with (host tables are copied into the bucket at every step)."""
        bk = self._bucket
        if bk is None or not bk.prestaged or bk.prestaged != batch.stamp or self.graphs.table_width:
            return None
        gpu = getattr(self.c, "gpu_tables", None)
        return bk if gpu is not None and bk.tables_now is not None and bk.tables_now[0] is gpu[0] else None

    def _dispatch(self, what, res, t0, t_meta, ids, positions, keep, rep, rows, seq_lens, qsl, spans, layout=0):
        """Tables, slots and the forward's launch from the step's arrays. ``spans``: (starts,
        counts) of the requests, for ``rep`` (each token's request) when None and for the comparison
        with kvd's slot mapping; None: one token per request, not compared. ``layout``: see
        ``GraphRunner.prepare``."""
        dev = self.device
        n, total = rows.shape[0], positions.shape[0]
        if rep is None:
            rep = np.repeat(np.arange(n, dtype=np.int64), spans[1])
        graphs = self.graphs if self.graphs is not None and self.graphs.fits(total) else None
        if graphs is not None and graphs.table_width:  # host tables: the bucket gathers the rows
            # into its pinned buffers straight from the session's numpy views (no torch views)
            tables = TableRows(self.c.tables, rows, -(-int(seq_lens.max()) // self.bs))
            rows = np.arange(n, dtype=np.int32)
            host_tables = True
        else:
            tables = self._tables()
            host_tables = tables[0].device.type != dev.type
        if host_tables and graphs is None:  # host tables, device model: only the scheduled rows' used columns move
            width = -(-int(seq_lens.max()) // self.bs)
            tables = [t[torch.from_numpy(rows).long(), :width] for t in tables]
            rows = np.arange(n, dtype=np.int32)
        # kvd's slot mapping: the eager forward's when it is this step's (a graph computes its own)
        wanted = spans is not None and not host_tables and not self.overlap and (graphs is None or self.check_slots)
        kvd = self._kvd_slots(res, rows, *spans) if wanted else None
        self.kvd_slot_steps += kvd is not None and graphs is None
        if graphs is not None:  # the graph computes the slots from the tables itself
            bucket = self._bucket = graphs.prepare(ids, positions, keep, rep, rows, seq_lens, qsl, tables, layout)
            launched = self._replay(bucket, what, t0, t_meta, keep.shape[0])
            if kvd is not None and self.check_slots:
                assert all(torch.equal(a, b[:total]) for a, b in zip(kvd, bucket.slots)), "kvd slot mapping differs"
            return launched
        self._bucket = None
        if host_tables:
            tables = [t.to(dev) for t in tables]
        own = kvd is None or self.check_slots  # slots from the tables (too)
        x = self.staging.pack(ids, positions, keep, rep if own else None, rows, seq_lens, qsl)
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
        events = _record_start(self._timed())
        use_paged(self.model, True)
        try:
            with torch.no_grad():
                logits = self.model(input_ids=x.ids[None], position_ids=x.positions[None], kvd_meta=meta,
                                    use_cache=False, logits_to_keep=x.keep).logits[0]
        finally:
            use_paged(self.model, False)
        return self._launched(what, logits, t0, t_meta, t_model, events)

    def _timed(self) -> bool:
        """Whether a forward's end on the GPU is recorded (the overlap figures)."""
        return self.overlap and self.device.type == "cuda"

    def _replay(self, bucket, what, t0: float, t_meta: float, num_keep: int):
        """Replay a staged graph bucket: the forward's launch (see :meth:`_dispatch`)."""
        t_model = time.perf_counter()
        events = _record_start(self._timed())
        logits = self.graphs.replay(bucket, num_keep)
        return self._launched(what, logits, t0, t_meta, t_model, events)

    def _launched(self, what, logits, t0: float, t_meta: float, t_model: float, events):
        """Account a launched forward's metadata time; what :meth:`_finish` needs."""
        if events is not None:
            events[1].record()
        self.phases["launch"] = time.perf_counter() - t_model
        self.meta_s += t_model - t_meta
        self.meta_exposed_s += t_model - t_meta  # the GPU waits for it
        self.phases.update(inputs=t_meta - t0, meta=t_model - t_meta)
        return what, logits, t0, t_model, events

    def _finish(self, launched, ahead_rt: tuple[float, float] | None = None, settle: bool = True) -> None:
        """Wait for the launched forward, sample, account. ``ahead_rt``: host (start, end) of the
        send of the step sent during this forward, whose reply is taken as soon as it arrives while
        the forward runs, else after the sampling (see ``OverlapMixin._reply_or_gpu``); the parts of
        both after the GPU finished are exposed. ``settle`` False: a reply that has not arrived by the
        sampling is left for the next step's forward (a window's message sent a step early)."""
        (sched, done), logits, t0, t_model, events = launched
        t_sample = time.perf_counter()
        # polled for the reply (a window's step without a message: hashes queued blocks meanwhile)
        end = events[1] if events is not None and (ahead_rt is not None or self._window_left) else None
        if done is None:
            self._sample_steady(sched, logits, end)
        else:
            self._sample(sched, done, logits, end)
        self.forwards += 1
        t1 = time.perf_counter()
        self.forward_s += t1 - t0
        self.phases.update(model=t_sample - t_model, sample=t1 - t_sample)
        # when the GPU finished the forward (an upper bound: its start counted from the launch);
        # the CPU's forward has returned before anything after it starts
        gpu_done = t_model + events[0].elapsed_time(events[1]) / 1e3 if events is not None else 0.0
        if events is not None:
            self.phases["gpu"] = gpu_done - t_model
        if ahead_rt is not None and settle:
            self._ahead_exposed(ahead_rt, gpu_done)

    def _sample(self, sched, done, logits, forward_end=None) -> None:
        """Greedy tokens (argmax on the model's device; only the ids come back) unless forced."""
        best = self._greedy(logits)
        self._reply_or_gpu(forward_end)
        best = best.tolist()  # the step's one device synchronization
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

    def _sample_steady(self, batch, logits, forward_end=None) -> None:
        """:meth:`_sample` for a steady decode batch: every row samples its next token. When the next
        step is this batch again (sent ahead, no row finishes, no forced token) and this step's graph
        advanced its inputs on the device (``Bucket.advance``), that next step is staged already
        (``Bucket.prestaged``)."""
        best = self._greedy(logits)
        ahead, bk = self._ahead, self._bucket
        same_next = self._window_left > 0 or (ahead is not None and ahead[6] is not None and ahead[6][0] is batch)
        if (self.prestage and bk is not None and bk.advances and same_next and not batch.forced
                and (batch.left > 1).all()):
            bk.prestaged = batch.stamp
            self.prestaged_steps += 1
        self._reply_or_gpu(forward_end)
        toks = best.cpu().numpy()  # the step's one device synchronization
        kept = logits.float().cpu() if self.keep_logits else None
        if batch.forced:
            toks = toks.copy()
            for j, r in enumerate(batch.reqs):
                if r.forced:
                    toks[j] = r.forced.get(len(r.output), toks[j])
        for r, t in zip(batch.reqs, toks.tolist()):
            r.output.append(t)
            r.computed += 1
        if kept is not None:
            for r, row in zip(batch.reqs, kept):
                r.logits.append(row)
        batch.advance(toks)

    def _greedy(self, logits):
        """Each row's argmax, on the device: the replayed graph's own (``Bucket.next_ids``) when it
        computed them (the same kernel on the same logits), else one more launch."""
        bk = self._bucket
        if bk is not None and bk.advances:
            return bk.next_ids[:logits.shape[0]]
        return torch.argmax(logits, dim=-1)
