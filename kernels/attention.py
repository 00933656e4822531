"""Paged varlen attention through kvd's block tables: decode, prefill and chunked prefill in one launch.

Semantics and layouts: see ``attention_ref.py`` (the reference this kernel is tested against).

Work split: a program owns one query tile of one request and one KV head, over one split of the
tile's key range. A tile is ``BLOCK_M`` rows = ``TILE_Q`` query tokens x ``GROUP`` query heads of
that KV head (GQA: each K/V element is loaded once for all of them). Tiles are numbered without a
host sync: request ``s``'s tiles start at ``query_start_loc[s] // TILE_Q + s``, so
``T // TILE_Q + num_seqs`` programs cover every request; a program finds its request by binary
search and exits if its tile is empty. With ``NUM_SPLITS > 1`` (flash decoding: decode batches too
small to fill the GPU) each split writes its normalised partial output and log-sum-exp to float32
scratch, ``[T, H_q, NUM_SPLITS, D]`` and ``[T, H_q, NUM_SPLITS]``, and a second kernel merges them.

A tile reads keys ``[lo, hi)``: ``hi`` is its last query's position + 1 and, with a window, ``lo``
its first query's window start. Loads are masked to that range, so table entries outside it (a
window's leading null blocks, columns past the context) are never read, nor are slots past
``seq_len`` in the last block.
"""

from __future__ import annotations

from ._triton import HAS_TRITON, require_triton, tl, torch, triton
from .attention_ref import check_attention, paged_attention_ref

LOG2E = 1.4426950408889634

if HAS_TRITON:

    @triton.jit
    def _find_request(tile, qsl, num_seqs, TILE_Q: tl.constexpr):
        # largest s with qsl[s] // TILE_Q + s <= tile (strictly increasing in s)
        lo = 0
        hi = num_seqs
        while lo < hi - 1:
            mid = (lo + hi) // 2
            start = tl.load(qsl + mid) // TILE_Q + mid
            lo = tl.where(start <= tile, mid, lo)
            hi = tl.where(start <= tile, hi, mid)
        return lo

    @triton.jit
    def _load_rows(ptr, jmask, dmask, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
        if MASKED:
            x = tl.load(ptr, mask=jmask[:, None] & dmask[None, :], other=0.0)
        elif EVEN_D:
            x = tl.load(ptr)
        else:
            x = tl.load(ptr, mask=dmask[None, :], other=0.0)
        return x

    @triton.jit
    def _attend(qt, kv, tab, lo, hi, pos, c_begin, c_end, m_i, l_i, acc, scale_log2, kvh, s_kv,
                s_blk, s_tok, s_h, d, dmask, MASKED: tl.constexpr, WINDOW: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                EVEN_D: tl.constexpr):
        """Online softmax over key chunks [c_begin, c_end) of BLOCK_N keys from ``lo``."""
        n = tl.arange(0, BLOCK_N)
        for c in range(c_begin, c_end):
            j = lo + c * BLOCK_N + n
            jmask = j < hi
            if MASKED:
                blk = tl.load(tab + j // BLOCK_SIZE, mask=jmask, other=0).to(tl.int64)
            else:  # a whole chunk: every j < hi
                blk = tl.load(tab + j // BLOCK_SIZE).to(tl.int64)
            off = blk * s_blk + (j % BLOCK_SIZE) * s_tok + kvh * s_h
            k_ptr = kv + off[:, None] + d[None, :]
            k = _load_rows(k_ptr, jmask, dmask, MASKED, EVEN_D)
            if IEEE:
                qk = tl.dot(qt, tl.trans(k), input_precision="ieee")
            else:
                qk = tl.dot(qt, tl.trans(k))
            qk = qk * scale_log2
            if MASKED:
                allowed = jmask[None, :] & (j[None, :] <= pos[:, None])
                if WINDOW > 0:
                    allowed = allowed & (pos[:, None] - j[None, :] < WINDOW)
                qk = tl.where(allowed, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _load_rows(k_ptr + s_kv, jmask, dmask, MASKED, EVEN_D)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _paged_attention_kernel(
            q, kv, out, part_o, part_lse, table, seq_lens, qsl, rows, num_seqs, scale_log2,
            sq_t, sq_h, so_t, so_h, s_kv, s_blk, s_tok, s_h, s_tab,
            WINDOW: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
            TILE_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            D: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
            HAS_ROWS: tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr):
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        s = _find_request(tile, qsl, num_seqs, TILE_Q)
        q_start = tl.load(qsl + s)
        q_len = tl.load(qsl + s + 1) - q_start
        first_tok = (tile - (q_start // TILE_Q + s)) * TILE_Q
        if first_tok < q_len:
            seq_len = tl.load(seq_lens + s)
            row = s
            if HAS_ROWS:
                row = tl.load(rows + s)
            tab = table + row.to(tl.int64) * s_tab
            m = tl.arange(0, BLOCK_M)
            tok = first_tok + m // GROUP
            head = kvh * GROUP + m % GROUP
            valid = (m // GROUP < TILE_Q) & (tok < q_len)
            pos = seq_len - q_len + tok
            d = tl.arange(0, BLOCK_D)
            dmask = d < D
            qrow = (q_start + tok).to(tl.int64)
            qt = tl.load(q + qrow[:, None] * sq_t + head[:, None] * sq_h + d[None, :],
                         mask=valid[:, None] & dmask[None, :], other=0.0)

            hi = seq_len - q_len + tl.minimum(first_tok + TILE_Q, q_len)
            lo = 0
            if WINDOW > 0:
                lo = tl.maximum(seq_len - q_len + first_tok - WINDOW + 1, 0)
            chunks = tl.cdiv(hi - lo, BLOCK_N)
            per_split = tl.cdiv(chunks, NUM_SPLITS)
            c0 = split * per_split
            c1 = tl.minimum(c0 + per_split, chunks)

            # chunks every row of the tile sees whole (below the diagonal, inside every row's
            # window) skip the mask; the others, before and after them, are masked
            full_lo = lo
            if WINDOW > 0:
                full_lo = tl.maximum(hi - WINDOW, lo)
            f0 = tl.cdiv(full_lo - lo, BLOCK_N)
            f1 = tl.maximum((seq_len - q_len + first_tok + 1 - lo) // BLOCK_N, f0)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            m_i, l_i, acc = _attend(qt, kv, tab, lo, hi, pos, c0, tl.minimum(c1, f0), m_i, l_i,
                                    acc, scale_log2, kvh, s_kv, s_blk, s_tok, s_h, d, dmask,
                                    True, WINDOW, BLOCK_SIZE, BLOCK_N, IEEE, EVEN_D)
            m_i, l_i, acc = _attend(qt, kv, tab, lo, hi, pos, tl.maximum(c0, f0),
                                    tl.minimum(c1, f1), m_i, l_i, acc, scale_log2, kvh, s_kv,
                                    s_blk, s_tok, s_h, d, dmask, False, WINDOW, BLOCK_SIZE,
                                    BLOCK_N, IEEE, EVEN_D)
            m_i, l_i, acc = _attend(qt, kv, tab, lo, hi, pos, tl.maximum(c0, f1), c1, m_i, l_i,
                                    acc, scale_log2, kvh, s_kv, s_blk, s_tok, s_h, d, dmask,
                                    True, WINDOW, BLOCK_SIZE, BLOCK_N, IEEE, EVEN_D)

            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            o = acc / l_safe[:, None]
            smask = valid[:, None] & dmask[None, :]
            if NUM_SPLITS == 1:
                tl.store(out + qrow[:, None] * so_t + head[:, None] * so_h + d[None, :],
                         o.to(out.dtype.element_ty), mask=smask)
            else:
                H_Q = tl.num_programs(1) * GROUP
                prow = (qrow * H_Q + head) * NUM_SPLITS + split
                lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
                tl.store(part_lse + prow, lse, mask=valid)
                tl.store(part_o + prow[:, None] * D + d[None, :], o, mask=smask)

    @triton.jit
    def _merge_splits_kernel(part_o, part_lse, out, qsl, num_seqs, so_t, so_h,
                             D: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                             ZERO_PAD: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        if t >= tl.load(qsl + num_seqs):  # rows past the last request are padding: zero or left alone
            if ZERO_PAD:
                d = tl.arange(0, BLOCK_D)
                tl.store(out + t.to(tl.int64) * so_t + h * so_h + d,
                         tl.zeros([BLOCK_D], tl.float32).to(out.dtype.element_ty), mask=d < D)
        else:
            prow = (t.to(tl.int64) * tl.num_programs(1) + h) * NUM_SPLITS
            sp = tl.arange(0, NUM_SPLITS)
            lse = tl.load(part_lse + prow + sp)
            mx = tl.max(lse, 0)
            w = tl.math.exp2(lse - mx)
            d = tl.arange(0, BLOCK_D)
            o = tl.load(part_o + (prow + sp)[:, None] * D + d[None, :], mask=d[None, :] < D,
                        other=0.0)
            o = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
            tl.store(out + t.to(tl.int64) * so_t + h * so_h + d, o.to(out.dtype.element_ty),
                     mask=d < D)


def _sm_count(device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: any small figure
    return torch.cuda.get_device_properties(device).multi_processor_count


def attention_config(num_tokens: int, num_seqs: int, h_q: int, h_kv: int, max_keys: int,
                     device) -> dict:
    """Tile sizes and split count from shapes alone (no device sync, stable under CUDA graphs)."""
    group = h_q // h_kv
    per_seq = -(-num_tokens // max(num_seqs, 1))
    # an H100 sweep (scripts/bench_kernels.py): 64-key chunks from decode to prefill, prefill tiles
    # of 128 rows (chunked prefill 8 x 512 after 1,536 cached: 400 us against 465 at 64 x 32)
    block_m = min(max(16, triton.next_power_of_2(per_seq * group)), 128)
    block_m = max(block_m, triton.next_power_of_2(group))
    block_n = 64
    tiles = max(num_seqs, -(-num_tokens // (block_m // group)))
    # flash decoding only while the tiles leave SMs idle (measured on an H100: at 64 requests x
    # 8 KV heads splitting already costs ~10 %), and never a split of less than two chunks
    splits = 1
    while splits < 16 and tiles * h_kv * splits < _sm_count(device) and \
            max_keys >= 4 * splits * block_n:
        splits *= 2
    return dict(block_m=block_m, block_n=block_n, num_splits=splits)


def paged_attention_triton(query, kv_layer, block_table, seq_lens, query_start_loc, *, scale,
                           sliding_window=0, out=None, row_indices=None, block_m=None,
                           block_n=None, num_splits=None, num_warps=4, num_stages=None):
    """The Triton kernel, on CUDA tensors or (TRITON_INTERPRET=1) on CPU tensors; the tiling
    arguments override :func:`attention_config` (benchmarks)."""
    require_triton()
    check_attention(query, kv_layer, block_table, seq_lens, query_start_loc, out, row_indices)
    if query.stride(2) != 1 or kv_layer.stride(4) != 1:
        raise ValueError("query and kv_layer need a contiguous head_dim")
    if query.dtype != kv_layer.dtype:
        raise ValueError(f"query ({query.dtype}) and kv_layer ({kv_layer.dtype}) dtypes differ")
    if num_splits is not None and num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, not {num_splits}")
    if out is not None and out.stride(2) != 1:
        raise ValueError("out needs a contiguous head_dim")
    t, h_q, d = query.shape
    num_seqs, h_kv, block_size = seq_lens.shape[0], kv_layer.shape[3], kv_layer.shape[2]
    if t == 0 or num_seqs == 0:
        return torch.zeros_like(query) if out is None else out
    cfg = attention_config(t, num_seqs, h_q, h_kv, block_table.shape[1] * block_size, query.device)
    block_m = block_m or cfg["block_m"]
    block_n = block_n or cfg["block_n"]
    splits = num_splits or cfg["num_splits"]
    # padding rows of a new output are zero: with splits the merge kernel writes them (one
    # fill kernel less a layer in a graph's step), else they are zero from the start
    zero_pad = out is None and splits > 1
    if out is None:
        out = torch.empty_like(query) if zero_pad else torch.zeros_like(query)
    group = h_q // h_kv
    tile_q = block_m // group
    if tile_q < 1:
        raise ValueError(f"block_m {block_m} is smaller than the GQA group {group}")
    block_d = triton.next_power_of_2(d)
    if splits > 1:
        part_o = torch.empty((t, h_q, splits, d), dtype=torch.float32, device=query.device)
        part_lse = torch.empty((t, h_q, splits), dtype=torch.float32, device=query.device)
    else:
        part_o = part_lse = None
    extra = {} if num_stages is None else {"num_stages": num_stages}
    grid = (t // tile_q + num_seqs, h_kv, splits)
    _paged_attention_kernel[grid](
        query, kv_layer, out, part_o, part_lse, block_table, seq_lens, query_start_loc,
        row_indices, num_seqs, scale * LOG2E, query.stride(0), query.stride(1), out.stride(0),
        out.stride(1), kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2),
        kv_layer.stride(3), block_table.stride(0),
        WINDOW=int(sliding_window), BLOCK_SIZE=block_size, GROUP=group, TILE_Q=tile_q,
        BLOCK_M=block_m, BLOCK_N=block_n, D=d, BLOCK_D=block_d, NUM_SPLITS=splits,
        HAS_ROWS=row_indices is not None, IEEE=query.dtype == torch.float32, EVEN_D=block_d == d,
        num_warps=num_warps, **extra)
    if splits > 1:
        _merge_splits_kernel[(t, h_q)](part_o, part_lse, out, query_start_loc, num_seqs,
                                       out.stride(0), out.stride(1), D=d, BLOCK_D=block_d,
                                       NUM_SPLITS=splits, ZERO_PAD=zero_pad)
    return out


def paged_attention(query, kv_layer, block_table, seq_lens, query_start_loc, *, scale,
                    sliding_window=0, out=None, row_indices=None):
    """Varlen paged attention: the Triton kernel on CUDA tensors, :func:`paged_attention_ref`
    elsewhere. Padding rows past ``query_start_loc[-1]`` keep ``out``'s content (zero when ``out``
    is None)."""
    fn = paged_attention_triton if query.is_cuda else paged_attention_ref
    return fn(query, kv_layer, block_table, seq_lens, query_start_loc, scale=scale,
              sliding_window=sliding_window, out=out, row_indices=row_indices)
