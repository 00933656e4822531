"""Swap blocks between the GPU pool and a pinned CPU pool, in either direction, batched.

Two ways to move the bytes:
  * the copy kernel of :mod:`.copy` with one side in pinned host memory: the SMs read or write
    host memory directly over the bus (zero-copy), one launch for every chunk of every block, so
    it costs the same for 32 KiB chunks as for 2 MiB ones;
  * plain DMA (``cudaMemcpyAsync`` through ``Tensor.copy_``), one call per contiguous region
    (a chunk, or a run of consecutive blocks when the layout makes them adjacent on both sides):
    no SM is used, but each call costs microseconds of host time.

``method="auto"`` takes DMA when the average contiguous region is at least
:data:`DMA_MIN_REGION_BYTES`, the crossover measured by scripts/bench_kernels.py.
"""

from __future__ import annotations

import numpy as np

from ._triton import require_triton
from .copy import PoolLayout, copy_blocks_between, pool_layout

#: Contiguous bytes per DMA call from which DMA beats the zero-copy kernel. Measured on an H100
#: (PCIe bus ceiling 55 GB/s each way; scripts/bench_kernels.py, swap crossover rows): the kernel
#: holds 52 GB/s out / 50.5 GB/s in at every region size; DMA calls reach 2.4 GB/s at 32 KiB,
#: 36 GB/s at 512 KiB, 51 GB/s at 2 MiB (a tie) and 54 GB/s at 8 MiB.
DMA_MIN_REGION_BYTES = 4 << 20


def dma_regions(src: PoolLayout, dst: PoolLayout, mapping: np.ndarray):
    """(src offset, dst offset, length) in units of every contiguous region of a swap.

    Consecutive pairs (s, d), (s+1, d+1) merge into one region where both pools store consecutive
    blocks back to back (block stride == chunk), which a block-major pool always does.
    """
    mapping = np.asarray(mapping, dtype=np.int64).reshape(-1, 2)
    if len(mapping) == 0:
        return np.zeros((0, 3), dtype=np.int64)
    s, d = mapping[:, 0], mapping[:, 1]
    if src.sb == src.chunk and dst.sb == dst.chunk:
        new_run = np.ones(len(mapping), dtype=bool)
        new_run[1:] = (np.diff(s) != 1) | (np.diff(d) != 1)
        starts = np.flatnonzero(new_run)
        lengths = np.diff(np.append(starts, len(mapping))) * src.chunk
        s, d = s[starts], d[starts]
    else:
        lengths = np.full(len(mapping), src.chunk, dtype=np.int64)
    regions = []
    for p in range(src.num_planes):
        regions.append(np.stack([src.offset(p, 0) + s * src.sb, dst.offset(p, 0) + d * dst.sb,
                                 lengths], axis=1))
    return np.concatenate(regions)


def swap_blocks(src, dst, block_mapping, block_dim: int = 2, method: str = "auto") -> str:
    """Copy blocks ``block_mapping[i] = (s, d)`` of pool ``src`` into pool ``dst`` (same layout
    apart from the number of blocks), one of them on the GPU and the other in pinned host memory.

    ``block_mapping`` is int64 [N, 2] on the host (pinned lets the kernel read it in place).
    ``method`` is "kernel", "dma" or "auto"; the one used is returned. Asynchronous on the current
    stream, like any copy: synchronize before reading a host destination.
    """
    require_triton()
    s_layout, d_layout = pool_layout(src, block_dim), pool_layout(dst, block_dim)
    mapping = block_mapping
    n = mapping.shape[0]
    if n == 0:
        return "none"
    if method == "auto":
        regions = dma_regions(s_layout, d_layout, mapping.numpy())
        avg = regions[:, 2].mean() * s_layout.unit_bytes
        method = "dma" if avg >= DMA_MIN_REGION_BYTES else "kernel"
    if method == "dma":
        regions = dma_regions(s_layout, d_layout, mapping.numpy())
        sf, df = s_layout.flat, d_layout.flat
        for so, do, length in regions.tolist():
            df[do:do + length].copy_(sf[so:so + length], non_blocking=True)
        return "dma"
    if method != "kernel":
        raise ValueError(f"unknown method {method!r}")
    device = src.device if src.is_cuda else dst.device
    if device.type == "cuda" and not mapping.is_cuda and not mapping.is_pinned():
        mapping = mapping.to(device, non_blocking=True)
    copy_blocks_between(s_layout, d_layout, mapping)
    return "kernel"
