"""CUDA graphs of the engine's forward for small steps: decode batches, prefix-hit suffixes.

The eager forward of a Hugging Face decoder is a Python loop launching ~40 kernels a layer: on an
H100 host an 8-layer model spends ~9-13 ms launching a step whose GPU work takes 1-3 ms. A step of T
tokens of B requests (T <= ``max_tokens``) instead replays the graph of its bucket (Tp, Bp): the
smallest powers of two >= T and >= B. Larger steps (long prefills) run eagerly.

Each bucket owns fixed buffers (a graph replays on the addresses it was captured with). Device
int64 words, laid out like ``inputs.Staging``'s with K = Bp and R = Tp, written by ONE copy from a
pinned host buffer (a steady batch's later steps rewrite only ids, positions and seq_lens there,
``Bucket.stage_moving``); every staging follows the last step's device synchronization (its
sampled tokens), so the copy of the last one is done::

    ids [Tp], positions [Tp], keep [Bp], rep [Tp], then int32 rows [Bp], seq_lens [Bp], qsl [Bp + 1]

plus ``slots`` int64 [G, Tp] and, when the block tables live on the host (the in-process manager, a
session opened with ``gpu=False``), ``tables[g]`` int32 [Bp, max_blocks]: the scheduled rows' used
columns gathered into a pinned copy of them and copied with the inputs, asynchronously. The graph
computes the slots itself, first: slot =
table[rows[rep[t]], position // block_size] * block_size + position % block_size for t < qsl[Bp] (the
step's token count), PAD_SLOT_ID after; no host launch per step but the one copy. A bucket of one
token per request (Tp = Bp: decode) also advances its inputs after the forward, in the graph
(``Bucket.advance``): each real token's next id is its row's argmax (``next_ids``, the step's greedy
tokens), its position and its request's seq_len grow by one. That is the next step of a steady
decode batch, staged on the device with no host work (``Bucket.prestaged``); any other next step
stages over it. Padding: tokens T..Tp-1 have id 0, position 0, slot PAD_SLOT_ID (no K/V written)
and belong to no request (qsl[B..Bp] = T), so attention leaves their rows alone; requests B..Bp-1
are empty (seq_len 0, row 0); logits rows K..Bp-1 are computed from a padding token and never read.

Capture: at a bucket's first use, from that step's own inputs: two eager passes on a side stream
(Triton compiles, allocator warm), then the capture (all buckets share one memory pool), then the
replay that serves the step. Re-running a forward rewrites the same K/V at the same slots, and the
inputs a pass advanced are put back after it (a pass on advanced inputs would write the K/V of a
position whose block may not be allocated yet, through a stale table entry), so the extra passes
change nothing. The graphs hold the addresses of the KV cache and of the tables they read (kvd's GPU
tables of the session): when those change (a new session) every graph is dropped and the next
captures use a new memory pool (a pool whose graphs are all gone cannot take new ones).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .advance import advance
from .model import StepMeta, use_paged

PAD_SLOT_ID = -1


def pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class TableRows(NamedTuple):
    """Host block tables for ``GraphRunner.prepare``: the scheduled ``rows`` of ``tables`` (numpy,
    one per group), their first ``width`` columns (what the step's sequences use)."""

    tables: list
    rows: np.ndarray
    width: int


class Bucket:
    """One (Tp, Bp) bucket: its buffers and, once captured, its graph and output."""

    def __init__(self, tp: int, bp: int, num_groups: int, device: torch.device, table_width: int = 0):
        self.tp, self.bp = tp, bp
        self.words = 3 * tp + bp + (3 * bp + 2) // 2
        cuda = device.type == "cuda"
        # pinned, written again by the next step's staging: the engine synchronizes with the device
        # at the end of every step, so the copy of the last one is done (without CUDA: the "device" one)
        self.host = torch.zeros(self.words, dtype=torch.int64, pin_memory=cuda)
        self.h = self.host.numpy()
        self.dev = torch.zeros(self.words, dtype=torch.int64, device=device) if cuda else self.host
        d = self.dev
        self.ids, self.positions = d[:tp], d[tp:2 * tp]
        self.keep, self.rep = d[2 * tp:2 * tp + bp], d[2 * tp + bp:3 * tp + bp]
        small = d[3 * tp + bp:].view(torch.int32)
        self.rows, self.seq_lens, self.qsl = small[:bp], small[bp:2 * bp], small[2 * bp:3 * bp + 1]
        self.slots = torch.full((num_groups, tp), PAD_SLOT_ID, dtype=torch.int64, device=device)
        self.token_index = torch.arange(tp, device=device)
        self.advances = tp == bp  # one token per request: the graph advances its inputs (``advance``)
        self.next_ids = torch.zeros(bp, dtype=torch.int64, device=device) if self.advances else None
        self.tables = [torch.zeros(bp, table_width, dtype=torch.int32, device=device)
                       for _ in range(num_groups)] if table_width else None
        # their pinned staging (reused like ``host``; without CUDA the tables themselves)
        self.tables_host = ([torch.zeros(bp, table_width, dtype=torch.int32, pin_memory=True)
                             for _ in range(num_groups)] if cuda else self.tables) if table_width else None
        self.tables_now: list[torch.Tensor] | None = None  # the tables the staged step reads
        self.graph = None
        self.out = None
        self.key = None
        self.layout = 0  # the steady batch layout (``SteadyBatch.stamp``) last staged in full; 0: none
        self.prestaged = 0  # that layout's next step is on the device already (``advance``); 0: none

    def stage(self, ids, positions: np.ndarray, keep: np.ndarray, rep: np.ndarray, rows: np.ndarray,
              seq_lens: np.ndarray, qsl: np.ndarray) -> None:
        """Write one step's inputs, padded to the bucket, and copy them to the device."""
        self.prestaged = 0
        tp, bp, h = self.tp, self.bp, self.h
        t, k, b = positions.shape[0], keep.shape[0], rows.shape[0]
        h[:t] = ids
        h[t:tp] = 0
        h[tp:tp + t] = positions
        h[tp + t:2 * tp] = 0
        h[2 * tp:2 * tp + k] = keep
        h[2 * tp + k:2 * tp + bp] = tp - 1  # a padding token's row
        h[2 * tp + bp:2 * tp + bp + t] = rep
        h[2 * tp + bp + t:3 * tp + bp] = 0
        small = h[3 * tp + bp:].view(np.int32)
        small[:b] = rows
        small[b:bp] = 0
        small[bp:bp + b] = seq_lens
        small[bp + b:2 * bp] = 0
        small[2 * bp:2 * bp + b + 1] = qsl
        small[2 * bp + b + 1:3 * bp + 1] = qsl[-1]
        if self.dev is not self.host:
            self.dev.copy_(self.host, non_blocking=True)

    def stage_tables(self, host: TableRows) -> None:
        """Gather the step's table rows into the pinned buffers and copy them to the device tables
        (the columns up to ``host.width``: the graph and the attention read no further)."""
        b, w = host.rows.shape[0], host.width
        for dst, pinned, src in zip(self.tables, self.tables_host, host.tables):
            pinned.numpy()[:b, :w] = src[host.rows, :w]
            if dst is not pinned:
                dst[:b, :w].copy_(pinned[:b, :w], non_blocking=True)

    def stage_moving(self, ids, positions: np.ndarray, seq_lens: np.ndarray) -> None:
        """Rewrite only what moves between two steps of one steady decode batch (ids, positions,
        seq_lens; the rest is staged already), and copy the buffer to the device."""
        self.prestaged = 0
        tp, bp, h = self.tp, self.bp, self.h
        t, b = positions.shape[0], seq_lens.shape[0]
        h[:t] = ids
        h[tp:tp + t] = positions
        h[3 * tp + bp:].view(np.int32)[bp:bp + b] = seq_lens
        if self.dev is not self.host:
            self.dev.copy_(self.host, non_blocking=True)

    def advance(self, logits: torch.Tensor) -> None:
        """After the forward (captured in the graph; Tp = Bp): ``next_ids`` = each row's argmax of
        ``logits`` [Bp, vocab], and the inputs become the next step of the same requests, one token
        each (``advance.advance``: one kernel on CUDA)."""
        advance(logits, self.next_ids, self.ids, self.positions, self.seq_lens, self.qsl)


class GraphRunner:
    """The graphs of one engine's forward (one model, one KV cache, one client session)."""

    def __init__(self, model, kv: torch.Tensor, layer_group: list[int], num_groups: int, block_size: int,
                 max_tokens: int = 512, table_width: int = 0):
        """``table_width``: > 0 when the block tables live on the host (each bucket copies the
        scheduled rows into device tables that wide); 0: the tables passed to :meth:`prepare` are on
        the device at fixed addresses."""
        self.model, self.kv, self.layer_group = model, kv, layer_group
        self.G, self.bs = num_groups, block_size
        self.max_tokens = max_tokens
        self.table_width = table_width
        self.device = kv.device
        self.buckets: dict[tuple[int, int], Bucket] = {}
        self.pool = None
        self.captures = 0
        self.replays = 0

    def fits(self, num_tokens: int) -> bool:
        return self.device.type == "cuda" and 0 < num_tokens <= self.max_tokens

    def prepare(self, ids, positions, keep, rep, rows, seq_lens, qsl, tables, layout: int = 0) -> Bucket:
        """Stage a step into its bucket: inputs and, with host tables, the scheduled rows.
        ``tables``: device tables (fixed addresses) or, with ``table_width``, a ``TableRows`` of the
        host tables in step order (then ``rows`` must be 0..B-1). ``layout``: a steady decode batch's stamp
        (``SteadyBatch.stamp``; 0: none): when the bucket's last full staging had it, only the
        moving arrays are written."""
        t, b = positions.shape[0], rows.shape[0]
        key = (pow2(t), min(pow2(b), pow2(t)))
        bk = self.buckets.get(key)
        if bk is None:
            bk = self.buckets[key] = Bucket(*key, self.G, self.device, self.table_width)
        if layout and bk.prestaged == layout:
            bk.prestaged = 0  # staged on the device by the last forward (``Bucket.advance``)
        elif layout and bk.layout == layout:
            bk.stage_moving(ids, positions, seq_lens)
        else:
            bk.stage(ids, positions, keep, rep, rows, seq_lens, qsl)
            bk.layout = layout
        if self.table_width:
            bk.stage_tables(tables)
            tables = bk.tables
        bk.tables_now = tables
        return bk

    def replay(self, bk: Bucket, num_keep: int) -> torch.Tensor:
        """Logits [num_keep, vocab] of the staged step (captures the bucket's graph first if needed)."""
        key = (self.kv.data_ptr(), tuple(t.data_ptr() for t in bk.tables_now))
        if bk.graph is None or bk.key != key:
            if bk.key is not None and bk.key != key:  # another session's tables: every graph is stale
                for other in self.buckets.values():
                    other.graph = other.out = other.key = None
                self.pool = None
            self._capture(bk, key)
        bk.graph.replay()
        self.replays += 1
        return bk.out[0, :num_keep]

    def _capture(self, bk: Bucket, key) -> None:
        meta = StepMeta(self.kv, self.layer_group, [bk.slots[g] for g in range(self.G)], bk.tables_now,
                        bk.rows, bk.seq_lens, bk.qsl)

        bs = self.bs

        def run():
            pos = bk.positions
            real = bk.token_index < bk.qsl[-1]
            req_rows = bk.rows[bk.rep].long()
            for g, tb in enumerate(bk.tables_now):
                bk.slots[g].copy_(torch.where(real, tb[req_rows, pos // bs].long() * bs + pos % bs, PAD_SLOT_ID))
            logits = self.model(input_ids=bk.ids[None], position_ids=bk.positions[None], kvd_meta=meta,
                                use_cache=False, logits_to_keep=bk.keep).logits
            if bk.advances:
                bk.advance(logits[0])
            return logits

        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        use_paged(self.model, True)
        try:
            with torch.no_grad():
                inputs = bk.dev.clone()  # each pass advances them (``Bucket.advance``): put back after it
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):
                        run()
                        bk.dev.copy_(inputs)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = run()
        finally:
            use_paged(self.model, False)
        bk.graph, bk.out, bk.key = graph, out, key
        self.captures += 1
