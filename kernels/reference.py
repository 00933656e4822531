"""Numpy references of every kernel: what the daemon runs on a CPU pool, and what the Triton kernels
are tested against (exact equality). Imports numpy only, so ``from kvd_kernels import *_ref`` costs
no torch or Triton import (the package loads those lazily, on first use of a GPU wrapper).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

#: Slot of a padding token; attention kernels skip it. kvd/api.py repeats the value for the core.
PAD_SLOT_ID = -1


def _check_out(out: np.ndarray, num_groups: int, num_tokens: int) -> None:
    if out.dtype != np.int64 or out.ndim != 2 or out.shape[0] != num_groups:
        raise ValueError(f"out must be int64 [{num_groups}, max_num_batched_tokens], "
                         f"got {out.dtype} {out.shape}")
    if num_tokens > out.shape[1]:
        raise ValueError(f"{num_tokens} tokens do not fit in max_num_batched_tokens={out.shape[1]}")


def _fill_groups(block_tables, block_sizes, rows, pos, out, prev_tokens: int = -1) -> None:
    """Write the slots of tokens (rows[t], pos[t]) into out[:, :T] and pad out[:, T:].

    Tuned for the decode step, where numpy's per-call overhead dominates: one flat ``take`` instead
    of 2-D fancy indexing (4x slower), shifts for power-of-two block sizes written straight into the
    int64 output. ``prev_tokens`` >= 0 promises that ``out`` already holds PAD_SLOT_ID from that
    many tokens on (the caller's previous step), so only [T, prev_tokens) is padded again.
    """
    num_tokens = len(pos)
    pad_end = out.shape[1] if prev_tokens < 0 else max(prev_tokens, num_tokens)
    for g, (table, bs) in enumerate(zip(block_tables, block_sizes)):
        bs = int(bs)
        o = out[g, :num_tokens]
        pow2 = bs & (bs - 1) == 0
        blk = pos >> (bs.bit_length() - 1) if pow2 else pos // bs
        if table.flags.c_contiguous:
            # int32 flat indices would wrap for tables of 2^31 entries or more
            stride = np.int64(table.shape[1]) if table.size >= 2**31 else table.shape[1]
            idx = rows * stride
            idx += blk
            ids = table.reshape(-1).take(idx)
        else:
            ids = table[rows, blk]
        # widened to int64 as it is written, so block ids near 2^31 / bs cannot wrap
        if pow2:
            np.left_shift(ids, bs.bit_length() - 1, out=o, dtype=np.int64)
            o += pos & (bs - 1)
        else:
            np.multiply(ids, bs, out=o, dtype=np.int64)
            o += pos % bs
        out[g, num_tokens:pad_end] = PAD_SLOT_ID


def slot_mapping_ref(block_tables: Sequence[np.ndarray], block_sizes: Sequence[int],
                     req_rows: np.ndarray, query_start_loc: np.ndarray, positions: np.ndarray,
                     out: np.ndarray) -> None:
    """Numpy reference with vLLM's inputs.

    block_tables[g]: int32 [max_reqs, max_blocks_g], indexed by row. req_rows: int32 [B].
    query_start_loc: int32 [B+1], starting at 0; request i owns tokens
    query_start_loc[i] <= t < query_start_loc[i+1] and uses row req_rows[i].
    positions: int32/int64 [>= T]. out: int64 [G, max_num_batched_tokens], fully written.
    """
    num_reqs = len(req_rows)
    qsl = np.asarray(query_start_loc)
    if len(qsl) < num_reqs + 1 or (len(qsl) and qsl[0] != 0):
        raise ValueError("query_start_loc needs B+1 entries starting at 0")
    num_tokens = int(qsl[num_reqs]) if len(qsl) else 0
    _check_out(out, len(block_tables), num_tokens)
    rows = np.repeat(np.asarray(req_rows), np.diff(qsl[:num_reqs + 1]))
    _fill_groups(block_tables, block_sizes, rows, np.asarray(positions[:num_tokens]), out)


def slot_mapping_from_ranges_ref(block_tables: Sequence[np.ndarray], block_sizes: Sequence[int],
                                 req_rows: np.ndarray, start_pos: np.ndarray,
                                 num_tokens: np.ndarray, out: np.ndarray, prev_tokens: int = -1) -> None:
    """Same result as :func:`slot_mapping_ref` for request i's positions
    start_pos[i] .. start_pos[i] + num_tokens[i] - 1, laid out in request order.

    ``num_tokens`` is one count per request, or one int for every request (a decode step passes 1
    and saves two reductions). Array-at-a-time: a decode step (every count 1) skips the expansion
    entirely. ``prev_tokens``: see :func:`_fill_groups` (a daemon that rewrites one persistent
    buffer every step passes the previous step's token count and pads only what that step wrote
    beyond this one).
    """
    start_pos = np.asarray(start_pos)
    if isinstance(num_tokens, (int, np.integer)):
        total = int(num_tokens) * len(req_rows)
        decode = num_tokens == 1
        num_tokens = np.full(len(req_rows), num_tokens, np.int64) if not decode else None
    else:
        num_tokens = np.asarray(num_tokens)
        total = int(num_tokens.sum())
        decode = total == len(num_tokens) and (total == 0 or num_tokens.max() == 1)
    _check_out(out, len(block_tables), total)
    if decode:
        rows, pos = req_rows, start_pos
    else:
        rows = np.repeat(req_rows, num_tokens)
        # position of token t = t - (first token index of its request) + start_pos of its request
        first = np.cumsum(num_tokens, dtype=np.int64) - num_tokens
        pos = np.arange(total, dtype=np.int64) + np.repeat(start_pos - first, num_tokens)
    _fill_groups(block_tables, block_sizes, rows, pos, out, prev_tokens)


#: The null block: target of padded rows.
NULL_BLOCK = 0


def apply_block_table_updates_ref(block_tables: Sequence[np.ndarray], groups: np.ndarray,
                                  rows: np.ndarray, starts: np.ndarray, offsets: np.ndarray,
                                  ids: np.ndarray) -> None:
    """block_tables[groups[i]][rows[i], starts[i] + j] = ids[offsets[i] + j] for
    0 <= j < offsets[i+1] - offsets[i]. Vectorized per group; changes must not overlap."""
    groups = np.asarray(groups)
    lens = np.diff(offsets)
    change = np.repeat(np.arange(len(lens)), lens)  # change index of every id
    col = np.arange(len(change)) - np.repeat(np.asarray(offsets[:-1], dtype=np.int64), lens)
    col += np.asarray(starts, dtype=np.int64)[change]
    row = np.asarray(rows, dtype=np.int64)[change]
    grp = groups[change]
    for g, table in enumerate(block_tables):
        sel = grp == g
        table[row[sel], col[sel]] = ids[:len(change)][sel]


def gather_block_tables_ref(block_tables: Sequence[np.ndarray], req_rows: np.ndarray,
                            out_tables: Sequence[np.ndarray]) -> None:
    """out_tables[g][i] = block_tables[g][req_rows[i], :cols_g] for i < B, NULL_BLOCK after."""
    num_reqs = len(req_rows)
    for table, out in zip(block_tables, out_tables):
        out[:num_reqs] = table[req_rows, :out.shape[1]]
        out[num_reqs:] = NULL_BLOCK


def gather_slot_mapping_ref(block_tables: Sequence[np.ndarray], block_sizes: Sequence[int],
                            req_rows: np.ndarray, query_start_loc: np.ndarray,
                            positions: np.ndarray, out_tables: Sequence[np.ndarray],
                            out_slots: np.ndarray) -> None:
    """:func:`gather_block_tables_ref` then :func:`slot_mapping_ref`: what the fused kernel does."""
    gather_block_tables_ref(block_tables, req_rows, out_tables)
    slot_mapping_ref(block_tables, block_sizes, req_rows, query_start_loc, positions, out_slots)


def copy_blocks_ref(kv: np.ndarray, block_mapping: np.ndarray, block_dim: int = 2) -> None:
    """kv[..., dst, ...] = kv[..., src, ...] along ``block_dim`` for every row (src, dst)."""
    copy_blocks_between_ref(kv, kv, block_mapping, block_dim)


def copy_blocks_between_ref(src: np.ndarray, dst: np.ndarray, block_mapping: np.ndarray,
                            block_dim: int = 2) -> None:
    """dst[..., d, ...] = src[..., s, ...] along ``block_dim`` for every row (s, d)."""
    mapping = np.asarray(block_mapping).reshape(-1, 2)
    np.moveaxis(dst, block_dim, 0)[mapping[:, 1]] = np.moveaxis(src, block_dim, 0)[mapping[:, 0]]


def swap_blocks_ref(src: np.ndarray, dst: np.ndarray, block_mapping: np.ndarray,
                    block_dim: int = 2) -> None:
    """dst[..., d, ...] = src[..., s, ...] for every (s, d): the CPU pool's view of a swap."""
    copy_blocks_between_ref(src, dst, block_mapping, block_dim)
