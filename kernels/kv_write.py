"""Store a step's K/V at its slots in one layer of the paged cache (vLLM's reshape_and_cache).

Layout and slot convention: see ``attention_ref.py``. One program per (token, piece of the token's
``H_kv * D`` elements), K and V of that piece together; the token's slot is read once per program and
a PAD_SLOT_ID row stores nothing, so ``T`` may include a CUDA graph's padding rows. Slots are trusted
here (checking them would need a device sync): ``write_kv_ref`` is the checked path.
"""

from __future__ import annotations

from ._triton import HAS_TRITON, require_triton, tl, triton
from .attention_ref import check_write_kv, write_kv_ref
from .reference import PAD_SLOT_ID

if HAS_TRITON:

    @triton.jit
    def _write_kv_kernel(key, value, kv, slots, PIECES, skt, skh, svt, svh, s_kv, s_blk, s_tok, s_h,
                         BLOCK_SIZE: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                         BLOCK: tl.constexpr, PAD: tl.constexpr):
        pid = tl.program_id(0)
        token = pid // PIECES
        piece = pid % PIECES
        slot = tl.load(slots + token)
        if slot != PAD:
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            e = piece * BLOCK + tl.arange(0, BLOCK)
            h = e // D
            d = e % D
            mask = e < H * D
            dst = blk * s_blk + off * s_tok + h * s_h + d
            t = token.to(tl.int64)
            k = tl.load(key + t * skt + h * skh + d, mask=mask)
            v = tl.load(value + t * svt + h * svh + d, mask=mask)
            tl.store(kv + dst, k.to(kv.dtype.element_ty), mask=mask)
            tl.store(kv + s_kv + dst, v.to(kv.dtype.element_ty), mask=mask)


#: Elements per program: 1024 bf16 elements (2 KiB of K and 2 KiB of V), a 8 x 128 token at once.
WRITE_BLOCK = 1024
WRITE_WARPS = 4


def write_kv_triton(key, value, kv_layer, slot_mapping, *, block: int = WRITE_BLOCK,
                    num_warps: int = WRITE_WARPS) -> None:
    """The Triton kernel, on CUDA tensors or (TRITON_INTERPRET=1) on CPU tensors."""
    require_triton()
    check_write_kv(key, value, kv_layer, slot_mapping)
    if key.stride(2) != 1 or value.stride(2) != 1 or kv_layer.stride(4) != 1:
        raise ValueError("key, value and kv_layer need a contiguous head_dim")
    t, h, d = key.shape
    if t == 0:
        return
    block = min(block, triton.next_power_of_2(h * d))
    pieces = triton.cdiv(h * d, block)
    # slots are int64, so every cache offset is computed in int64 (a layer may pass 2**31 elements)
    s_blk = kv_layer.stride(1)
    _write_kv_kernel[(t * pieces,)](
        key, value, kv_layer, slot_mapping, pieces, key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), kv_layer.stride(0), s_blk, kv_layer.stride(2), kv_layer.stride(3),
        BLOCK_SIZE=kv_layer.shape[2], H=h, D=d, BLOCK=block, PAD=PAD_SLOT_ID, num_warps=num_warps)


def write_kv(key, value, kv_layer, slot_mapping) -> None:
    """Store token ``t``'s K/V at ``slot_mapping[t]`` (PAD_SLOT_ID skipped): the Triton kernel on
    CUDA tensors, :func:`write_kv_ref` elsewhere."""
    if kv_layer.is_cuda:
        write_kv_triton(key, value, kv_layer, slot_mapping)
    else:
        write_kv_ref(key, value, kv_layer, slot_mapping)
