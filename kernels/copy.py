"""Copy whole KV blocks between or inside pools: copy-on-write, and the kernel half of swapping.

A pool is any tensor with a block dimension: the dimensions before it ("planes": layers, K/V) may
have any strides, the dimensions after it must be contiguous, so every (plane, block) is one
contiguous chunk. The default layout is ``[layers, 2, num_blocks, block_size, heads, head_dim]``
(``block_dim=2``): 64 planes of one chunk per block for 32 layers. One launch copies every chunk of
every ``(src, dst)`` pair, each program one piece of a chunk.

Sources and destinations must be disjoint (a CoW target is a fresh block): the launch reads and
writes concurrently, so a chain ``a->b, b->c`` has no defined order.
"""

from __future__ import annotations

from dataclasses import dataclass


from ._triton import HAS_TRITON, require_triton, tl, torch, triton


@dataclass(frozen=True)
class PoolLayout:
    """A pool seen as planes x blocks x contiguous chunks, in units of ``unit_bytes``."""
    flat: object          # 1-D tensor of the unit dtype aliasing the pool's storage
    unit_bytes: int
    n0: int               # planes = n0 * n1; plane p sits at (p // n1) * s0 + (p % n1) * s1
    n1: int
    s0: int
    s1: int
    sb: int               # block stride
    chunk: int            # contiguous units per (plane, block)

    @property
    def num_planes(self) -> int:
        return self.n0 * self.n1

    def offset(self, plane: int, block: int) -> int:
        return (plane // self.n1) * self.s0 + (plane % self.n1) * self.s1 + block * self.sb


_UNITS = ((8, "int64"), (4, "int32"), (2, "int16"), (1, "uint8"))


def pool_layout(pool, block_dim: int = 2) -> PoolLayout:
    """Describe ``pool`` for the copy kernel, reinterpreted in the widest integer unit that divides
    every chunk, stride and the base address: 8-byte units let each thread move 16 bytes per access
    whatever the KV dtype."""
    shape, strides = list(pool.shape), list(pool.stride())
    inner = 1
    for size, stride in zip(reversed(shape[block_dim + 1:]), reversed(strides[block_dim + 1:])):
        if size != 1 and stride != inner:
            raise ValueError("the dimensions after block_dim must be contiguous")
        inner *= size
    lead = [(n, s) for n, s in zip(shape[:block_dim], strides[:block_dim]) if n != 1]
    # merge leading dims that are contiguous with each other (e.g. layers and K/V of one pool)
    merged: list[tuple[int, int]] = []
    for n, s in lead:
        if merged and merged[-1][1] == n * s:
            merged[-1] = (merged[-1][0] * n, s)
        else:
            merged.append((n, s))
    if len(merged) > 2:
        raise ValueError("at most two non-mergeable dimensions may precede block_dim")
    merged = [(1, 0)] * (2 - len(merged)) + merged
    (n0, s0), (n1, s1) = merged
    sb = strides[block_dim]
    esize = pool.element_size()
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    for unit, name in _UNITS:
        if all((x * esize) % unit == 0 for x in (inner, s0, s1, sb, span)) and \
                pool.data_ptr() % unit == 0:
            break
    flat = pool.as_strided((span,), (1,))
    if unit != esize:
        flat = flat.view(getattr(torch, name))

    def conv(x: int) -> int:
        return x * esize // unit

    return PoolLayout(flat, unit, n0, n1, conv(s0), conv(s1), conv(sb), conv(inner))


if HAS_TRITON:

    @triton.jit
    def _copy_blocks_kernel(src, dst, pairs_ptr, num_planes, n1, ss0, ss1, ssb, ds0, ds1, dsb,
                            CHUNK: tl.constexpr, BLOCK: tl.constexpr, PIECES: tl.constexpr):
        # program -> (pair, plane, piece), piece fastest so neighbours stream adjacent memory
        pid = tl.program_id(0).to(tl.int64)
        piece = pid % PIECES
        rest = pid // PIECES
        plane = rest % num_planes
        pair = rest // num_planes
        sblk = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
        dblk = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
        p0 = plane // n1
        p1 = plane % n1
        so = p0 * ss0 + p1 * ss1 + sblk * ssb + piece * BLOCK
        do = p0 * ds0 + p1 * ds1 + dblk * dsb + piece * BLOCK
        offs = tl.arange(0, BLOCK)
        if CHUNK % BLOCK == 0:
            tl.store(dst + do + offs, tl.load(src + so + offs))
        else:
            mask = piece * BLOCK + offs < CHUNK
            tl.store(dst + do + offs, tl.load(src + so + offs, mask=mask), mask=mask)


#: Units per program and warps, chosen on an H100 (scripts/bench_kernels.py): 16 KiB per program.
COPY_BLOCK = 2048
COPY_WARPS = 4


def copy_blocks_between(src_layout: PoolLayout, dst_layout: PoolLayout, block_mapping,
                        num_pairs: int | None = None, *, block: int = COPY_BLOCK,
                        num_warps: int = COPY_WARPS) -> None:
    """Launch the copy of every chunk of every (src, dst) pair of ``block_mapping`` (int64 [N, 2],
    on the device or in pinned host memory) from one pool layout to another."""
    require_triton()
    if (src_layout.unit_bytes, src_layout.chunk, src_layout.num_planes) != \
            (dst_layout.unit_bytes, dst_layout.chunk, dst_layout.num_planes):
        raise ValueError("pools differ in block geometry")
    n = block_mapping.shape[0] if num_pairs is None else num_pairs
    if n == 0:
        return
    chunk = src_layout.chunk
    block = min(block, triton.next_power_of_2(chunk))
    pieces = triton.cdiv(chunk, block)
    grid = (n * src_layout.num_planes * pieces,)
    s, d = src_layout, dst_layout
    _copy_blocks_kernel[grid](s.flat, d.flat, block_mapping, s.num_planes, s.n1, s.s0, s.s1, s.sb,
                              d.s0, d.s1, d.sb, CHUNK=chunk, BLOCK=block, PIECES=pieces,
                              num_warps=num_warps)


def copy_blocks(kv_cache, block_mapping, block_dim: int = 2, **tuning) -> None:
    """Torch wrapper of :func:`copy_blocks_ref`: one launch for all layers, K and V, of a pool
    tensor (a list of per-layer tensors costs one launch per tensor). ``block_mapping`` is int64
    [N, 2] of (src, dst) on the pool's device (or pinned host memory)."""
    pools = kv_cache if isinstance(kv_cache, (list, tuple)) else [kv_cache]
    for pool in pools:
        layout = pool_layout(pool, block_dim)
        copy_blocks_between(layout, layout, block_mapping, **tuning)
