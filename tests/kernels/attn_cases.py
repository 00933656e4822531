"""Builders of paged attention cases shared by the write_kv and paged_attention tests.

A case holds, per request, dense K/V of its whole context (the ground truth for torch SDPA) and the
same K/V scattered into a paged cache at random, non-contiguous blocks. Everything a request may not
read is poisoned: the null block 0, slots past seq_len in its last block, slots before its window,
unused blocks are NaN, and table columns past its last block hold an id far outside the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: A table column no query may attend to: reading through it would index far outside the pool.
FAR_BLOCK = 1 << 30


@dataclass
class Case:
    query: torch.Tensor         # [T, H_q, D]
    kv: torch.Tensor            # [2, num_blocks, block_size, H_kv, D]
    block_table: torch.Tensor   # int32 [num_rows, max_blocks]
    seq_lens: torch.Tensor      # int32 [num_seqs]
    qsl: torch.Tensor           # int32 [num_seqs + 1]
    row_indices: torch.Tensor | None
    dense_k: list               # per request [seq_len, H_kv, D], float32
    dense_v: list
    specs: list                 # (seq_len, q_len) per request
    window: int
    scale: float

    def kwargs(self):
        return dict(scale=self.scale, sliding_window=self.window, row_indices=self.row_indices)

    def args(self):
        return self.query, self.kv, self.block_table, self.seq_lens, self.qsl


def make_case(specs, *, h_q=4, h_kv=2, d=16, block_size=4, window=0, dtype=torch.float32,
              device="cpu", row_indices=False, pad_rows=0, seed=0, null_value=float("nan")):
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-s // block_size) for s, _ in specs]
    max_blocks = max(blocks_needed) + 2
    num_blocks = 1 + sum(blocks_needed) + 3
    kv = torch.full((2, num_blocks, block_size, h_kv, d), float("nan"), dtype=dtype)
    kv[:, 0] = null_value
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.full((len(specs), max_blocks), FAR_BLOCK, dtype=torch.int32)
    dense_k, dense_v, queries = [], [], []
    for s, (seq_len, q_len) in enumerate(specs):
        k = torch.randn(seq_len, h_kv, d, generator=g).to(dtype)
        v = torch.randn(seq_len, h_kv, d, generator=g).to(dtype)
        dense_k.append(k.float())
        dense_v.append(v.float())
        queries.append(torch.randn(q_len, h_q, d, generator=g).to(dtype))
        lo = max(0, seq_len - q_len - window + 1) if window > 0 else 0
        for b in range(blocks_needed[s]):
            if (b + 1) * block_size <= lo:
                table[s, b] = 0  # left the window: kvd hands the null block back
                continue
            blk = ids.pop()
            table[s, b] = blk
            for j in range(max(lo, b * block_size), min(seq_len, (b + 1) * block_size)):
                kv[0, blk, j % block_size] = k[j]
                kv[1, blk, j % block_size] = v[j]
    query = torch.cat(queries + [torch.randn(pad_rows, h_q, d, generator=g).to(dtype)])
    qsl = torch.tensor([0] + [q for _, q in specs], dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for s, _ in specs], dtype=torch.int32)
    rows = None
    if row_indices:  # the session's whole table: more rows than requests, requests in any row
        whole = torch.full((len(specs) + 3, max_blocks), FAR_BLOCK, dtype=torch.int32)
        perm = torch.randperm(len(specs) + 3, generator=g)[:len(specs)].to(torch.int32)
        whole[perm.long()] = table
        table, rows = whole, perm.to(device)
    return Case(query.to(device), kv.to(device), table.to(device), seq_lens.to(device),
                qsl.to(device), rows, dense_k, dense_v, list(specs), window, d ** -0.5)


def dense_attention(case, s):
    """Request s by torch SDPA on its unpaged K/V, float64, with the causal/window mask."""
    seq_len, q_len = case.specs[s]
    q0 = int(case.qsl[s])
    q = case.query[q0:q0 + q_len].double().cpu().transpose(0, 1)[None]
    group = q.shape[1] // case.dense_k[s].shape[1]
    k = case.dense_k[s].double().repeat_interleave(group, 1).transpose(0, 1)[None]
    v = case.dense_v[s].double().repeat_interleave(group, 1).transpose(0, 1)[None]
    pq = torch.arange(seq_len - q_len, seq_len)[:, None]
    pk = torch.arange(seq_len)[None, :]
    mask = pk <= pq
    if case.window > 0:
        mask &= pq - pk < case.window
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case.scale)
    return o[0].transpose(0, 1)  # [q_len, H_q, D]
