"""Block copies inside a pool (copy-on-write) and swaps between pools, over several KV layouts."""

import numpy as np
import pytest

from kvd_kernels import copy_blocks_ref, swap_blocks_ref

# (name, shape, block_dim, dtype, permutation applied to a contiguous tensor)
LAYOUTS = [
    ("default_bf16", (3, 2, 12, 4, 2, 8), 2, "bfloat16", None),
    ("block_major_f32", (12, 3, 2, 4, 2, 8), 0, "float32", None),
    # stored K/V outermost, then blocks, then layers: planes cannot merge into one stride
    ("kv_outer_layer_inner", (3, 2, 12, 4, 2, 8), 2, "float16", (1, 2, 0, 3, 4, 5)),
    # 3 half-precision elements per chunk: 2-byte units and a partial (masked) piece
    ("odd_chunk_f16", (2, 2, 12, 3), 2, "float16", None),
    ("per_token_fp8_like_u8", (2, 2, 12, 5, 7), 2, "uint8", None),
]


def make_pool(rng, shape, dtype, perm, device):
    import torch
    bits = rng.integers(-(2**15), 2**15, size=shape, dtype=np.int64)
    base = torch.from_numpy(bits).to(torch.int16 if dtype != "uint8" else torch.uint8)
    if dtype in ("bfloat16", "float16"):
        # raw bits, so the comparison is exact whatever the values mean as floats
        pool = base.view(getattr(torch, dtype))
    elif dtype == "float32":
        pool = torch.from_numpy(bits.astype(np.int32)).view(torch.float32)
    else:
        pool = base
    pool = pool.to(device)
    if perm is not None:  # same logical shape, storage ordered differently
        pool = pool.permute(*perm).contiguous().permute(*np.argsort(perm))
    return pool


def as_bits(t):
    import torch
    t = t.cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy()
    return t.view(torch.int32).numpy() if t.dtype == torch.float32 else t.numpy()


def disjoint_mapping(rng, num_src_blocks, num_dst_blocks, n, same_pool):
    if same_pool:
        ids = rng.permutation(num_src_blocks)[:2 * n]
        return np.stack([ids[:n], ids[n:]], axis=1).astype(np.int64)
    return np.stack([rng.permutation(num_src_blocks)[:n], rng.permutation(num_dst_blocks)[:n]],
                    axis=1).astype(np.int64)


def mapping_with_run(rng, num_src_blocks, num_dst_blocks, n):
    """n distinct sources to n distinct destinations, rows 1..3 a run (s, d), (s+1, d+1), ...
    that DMA merges into one region. Duplicates would make the launch order observable."""
    s0, d0 = int(rng.integers(0, num_src_blocks - 2)), int(rng.integers(0, num_dst_blocks - 2))
    srcs = [x for x in rng.permutation(num_src_blocks) if not s0 <= x < s0 + 3][:n - 3]
    dsts = [x for x in rng.permutation(num_dst_blocks) if not d0 <= x < d0 + 3][:n - 3]
    srcs = srcs[:1] + [s0, s0 + 1, s0 + 2] + srcs[1:]
    dsts = dsts[:1] + [d0, d0 + 1, d0 + 2] + dsts[1:]
    return np.stack([srcs, dsts], axis=1).astype(np.int64)


def test_copy_ref_hand_computed():
    kv = np.arange(2 * 2 * 4 * 3).reshape(2, 2, 4, 3)
    copy_blocks_ref(kv, np.array([[0, 3], [1, 2]]), block_dim=2)
    np.testing.assert_array_equal(kv[:, :, 3], kv[:, :, 0])
    np.testing.assert_array_equal(kv[:, :, 2], kv[:, :, 1])
    np.testing.assert_array_equal(kv[1, 0, 2], [27, 28, 29])


@pytest.mark.parametrize("name,shape,block_dim,dtype,perm", LAYOUTS, ids=[x[0] for x in LAYOUTS])
@pytest.mark.parametrize("num_pairs", [0, 1, 5])
def test_copy_blocks(device, name, shape, block_dim, dtype, perm, num_pairs):
    import torch

    from kvd_kernels import copy_blocks
    rng = np.random.default_rng(num_pairs)
    pool = make_pool(rng, shape, dtype, perm, device)
    mapping = disjoint_mapping(rng, shape[block_dim], shape[block_dim], num_pairs, True)
    want = as_bits(pool).copy()
    copy_blocks_ref(want, mapping, block_dim)
    # every element of the pool is compared: copied blocks and untouched ones alike
    copy_blocks(pool, torch.from_numpy(mapping).to(device), block_dim)
    np.testing.assert_array_equal(as_bits(pool), want)


@pytest.mark.parametrize("name,shape,block_dim,dtype,perm", LAYOUTS[:3], ids=[x[0] for x in LAYOUTS[:3]])
@pytest.mark.parametrize("method", ["kernel", "dma", "auto"])
def test_swap_both_directions(device, name, shape, block_dim, dtype, perm, method):
    import torch

    from kvd_kernels import swap_blocks
    rng = np.random.default_rng(7)
    gpu = make_pool(rng, shape, dtype, perm, device)
    cpu_shape = list(shape)
    cpu_shape[block_dim] = 9  # the host pool has its own block count
    host = make_pool(rng, tuple(cpu_shape), dtype, perm, "cpu")
    if device == "cuda":
        host = host.pin_memory()
    for src, dst in ((gpu, host), (host, gpu)):
        mapping = mapping_with_run(rng, src.shape[block_dim], dst.shape[block_dim], 6)
        want = as_bits(dst).copy()
        swap_blocks_ref(as_bits(src), want, mapping, block_dim)
        m = torch.from_numpy(mapping)
        used = swap_blocks(src, dst, m.pin_memory() if device == "cuda" else m, block_dim,
                           method=method)
        assert used in ("kernel", "dma")
        if device == "cuda":
            torch.cuda.synchronize()
        np.testing.assert_array_equal(as_bits(dst), want)


def test_swap_ref_matches_hand_computed():
    src = np.arange(2 * 3 * 2).reshape(2, 3, 2)
    dst = np.zeros((2, 2, 2), dtype=src.dtype)
    swap_blocks_ref(src, dst, np.array([[2, 0]]), block_dim=1)
    np.testing.assert_array_equal(dst, [[[4, 5], [0, 0]], [[10, 11], [0, 0]]])


def test_pool_layout_geometry():
    import torch

    from kvd_kernels import pool_layout
    rng = np.random.default_rng(0)
    default = pool_layout(make_pool(rng, (3, 2, 12, 4, 2, 8), "bfloat16", None, "cpu"), 2)
    # layers and K/V merge into 6 planes of one stride; 128-byte chunks move as 8-byte units
    assert (default.n0, default.n1, default.s1, default.sb, default.chunk) == (1, 6, 12 * 16, 16, 16)
    assert default.unit_bytes == 8 and default.flat.dtype == torch.int64
    split = pool_layout(make_pool(rng, (3, 2, 12, 4, 2, 8), "float16", (1, 2, 0, 3, 4, 5), "cpu"))
    assert (split.n0, split.n1, split.s0, split.s1, split.sb) == (3, 2, 16, 12 * 3 * 16, 3 * 16)
    odd = pool_layout(make_pool(rng, (2, 2, 12, 3), "float16", None, "cpu"))
    assert (odd.unit_bytes, odd.chunk) == (2, 3)
