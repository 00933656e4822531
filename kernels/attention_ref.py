"""Torch references of the two kernels an engine runs on kvd's output: ``write_kv`` (store a step's
K/V at its slots) and ``paged_attention`` (varlen attention through block tables).

Plain gathers and a masked float32 softmax, runnable on the CPU: they define what the Triton kernels
(``kv_write.py``, ``attention.py``) must compute, and they are what an engine runs without a GPU.

Layouts (kvd.memory's daemon-owned cache, one layer of it):

- ``kv_layer``: ``[2, num_blocks, block_size, H_kv, D]``, index 0 = K, 1 = V, any strides.
- slot of a token: ``block_id * block_size + position % block_size``; ``PAD_SLOT_ID`` (-1) marks a
  padding row that writes nothing. Block 0 is the null block: it never holds data anyone may read.
- ``block_table``: int32 ``[num_rows, max_blocks]``; request ``s`` reads row ``s``, or row
  ``row_indices[s]`` when given (then the table may be a session's whole table, with no gather).
- ``query_start_loc``: int32 ``[num_seqs + 1]``; request ``s`` owns query rows
  ``query_start_loc[s]:query_start_loc[s + 1]``; rows past ``query_start_loc[-1]`` are padding.
- ``seq_lens``: int32 ``[num_seqs]``, context length after this step (cached + new tokens). Query
  row ``i`` of request ``s`` sits at position ``p = seq_lens[s] - q_len + i`` and attends to keys
  ``j <= p`` (and ``p - j < W`` with a sliding window ``W > 0``, Hugging Face's masking).
- GQA: query head ``h`` reads KV head ``h // (H_q // H_kv)``.

Output rows of padding are left as they are in ``out``; a fresh ``out`` (``out=None``) is zeroed.
"""

from __future__ import annotations

import torch

from .reference import PAD_SLOT_ID


def check_write_kv(key, value, kv_layer, slot_mapping) -> None:
    """Shape/dtype checks shared by the reference and the kernel (no device sync)."""
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be [T, H_kv, D]; got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    if kv_layer.dim() != 5 or kv_layer.shape[0] != 2 or kv_layer.shape[3:] != key.shape[1:]:
        raise ValueError(f"kv_layer must be [2, num_blocks, block_size, {key.shape[1]}, "
                         f"{key.shape[2]}]; got {tuple(kv_layer.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < key.shape[0]:
        raise ValueError(f"slot_mapping must be 1-D with >= {key.shape[0]} entries; got "
                         f"{tuple(slot_mapping.shape)}")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, not {slot_mapping.dtype}")


def write_kv_ref(key, value, kv_layer, slot_mapping) -> None:
    """Store token ``t``'s K/V at ``slot_mapping[t]``; PAD_SLOT_ID entries are skipped."""
    check_write_kv(key, value, kv_layer, slot_mapping)
    num_blocks, block_size = kv_layer.shape[1], kv_layer.shape[2]
    slots = slot_mapping[:key.shape[0]].to(kv_layer.device)
    keep = slots != PAD_SLOT_ID
    slots = slots[keep]
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_blocks * block_size):
        raise ValueError(f"slot_mapping holds slots outside [0, {num_blocks * block_size}) other "
                         f"than PAD_SLOT_ID")
    blocks, offsets = slots // block_size, slots % block_size
    keep = keep.to(key.device)
    kv_layer[0, blocks, offsets] = key[keep].to(kv_layer.device, kv_layer.dtype)
    kv_layer[1, blocks, offsets] = value[keep].to(kv_layer.device, kv_layer.dtype)


def check_attention(query, kv_layer, block_table, seq_lens, query_start_loc, out,
                    row_indices) -> None:
    """Shape/dtype checks shared by the reference and the kernel (no device sync)."""
    if query.dim() != 3 or kv_layer.dim() != 5 or kv_layer.shape[0] != 2:
        raise ValueError("query must be [T, H_q, D] and kv_layer [2, num_blocks, block_size, "
                         "H_kv, D]")
    h_q, d = query.shape[1:]
    h_kv = kv_layer.shape[3]
    if kv_layer.shape[4] != d or h_q % h_kv != 0:
        raise ValueError(f"query heads {h_q} must be a multiple of KV heads {h_kv} and head dims "
                         f"must agree ({d} vs {kv_layer.shape[4]})")
    num_seqs = seq_lens.shape[0]
    if seq_lens.dim() != 1 or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError("seq_lens must be [num_seqs] and query_start_loc [num_seqs + 1]")
    if block_table.dim() != 2:
        raise ValueError("block_table must be [num_rows, max_blocks]")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc), ("row_indices", row_indices)):
        if t is not None and t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, not {t.dtype}")
    if row_indices is None and block_table.shape[0] < num_seqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {num_seqs} requests")
    if row_indices is not None and row_indices.shape != (num_seqs,):
        raise ValueError("row_indices must be [num_seqs]")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype):
        raise ValueError("out must have the query's shape and dtype")


def attended_range(seq_len: int, q_len: int, sliding_window: int) -> tuple[int, int]:
    """Key positions [lo, hi) that some query row of a request may attend to."""
    first = seq_len - q_len
    lo = max(0, first - sliding_window + 1) if sliding_window > 0 else 0
    return lo, seq_len


def paged_attention_ref(query, kv_layer, block_table, seq_lens, query_start_loc, *, scale,
                        sliding_window=0, out=None, row_indices=None):
    """Varlen causal attention over paged K/V; float32 softmax and accumulation."""
    check_attention(query, kv_layer, block_table, seq_lens, query_start_loc, out, row_indices)
    if out is None:
        out = torch.zeros_like(query)
    h_q, h_kv = query.shape[1], kv_layer.shape[3]
    block_size = kv_layer.shape[2]
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    rows = range(len(lens)) if row_indices is None else row_indices.tolist()
    for s, row in enumerate(rows):
        q0, q1 = qsl[s], qsl[s + 1]
        q_len, seq_len = q1 - q0, lens[s]
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"request {s} has {q_len} query tokens but seq_len {seq_len}")
        lo, hi = attended_range(seq_len, q_len, sliding_window)
        # only blocks holding attendable keys are read: leading null entries of a window never are
        b0, b1 = lo // block_size, -(-hi // block_size)
        ids = block_table[row, b0:b1].to(kv_layer.device).long()
        k = kv_layer[0, ids].reshape(-1, h_kv, kv_layer.shape[4])[lo - b0 * block_size:
                                                                  hi - b0 * block_size]
        v = kv_layer[1, ids].reshape(-1, h_kv, kv_layer.shape[4])[lo - b0 * block_size:
                                                                  hi - b0 * block_size]
        q = query[q0:q1].float().transpose(0, 1)                      # [H_q, q_len, D]
        k = k.float().repeat_interleave(h_q // h_kv, dim=1).transpose(0, 1)  # [H_q, L, D]
        v = v.float().repeat_interleave(h_q // h_kv, dim=1).transpose(0, 1)
        pos_q = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        pos_k = torch.arange(lo, hi, device=q.device)[None, :]
        allowed = pos_k <= pos_q
        if sliding_window > 0:
            allowed &= pos_q - pos_k < sliding_window
        scores = (q @ k.transpose(1, 2)) * scale
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        o = torch.softmax(scores, dim=-1) @ v                          # [H_q, q_len, D]
        out[q0:q1] = o.transpose(0, 1).to(out.dtype).to(out.device)
    return out
