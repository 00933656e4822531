"""Slot mapping: where each token of a step writes its K and V, per KV-cache group.

``slot = block_id * block_size + position % block_size`` with ``block_id`` read from the token's
request row of the group's block table; entries from the real token count up to the buffer's end
are ``PAD_SLOT_ID`` so a CUDA graph replaying on the persistent buffer sees every element written.
Slots are int64: a pool of 2^27 blocks of 16 tokens already passes 2^31.

Three entry points compute the same function:
  * ``reference.slot_mapping_ref``: numpy, vLLM's inputs (query start locations and positions);
  * ``reference.slot_mapping_from_ranges_ref``: numpy, the daemon's inputs (first position and token
    count per request), vectorized for the step path;
  * :func:`slot_mapping` here: torch wrapper around one Triton launch, for tables on a GPU.
"""

from __future__ import annotations

from typing import Sequence

from ._triton import (HAS_TRITON, MAX_GROUPS_PER_LAUNCH, Relauncher, group_args, require_triton, tl,
                      torch, triton)

if HAS_TRITON:

    @triton.jit
    def _group_slots(table, row_stride, BS: tl.constexpr, row, pos, valid, in_range, out_ptrs):
        bid = tl.load(table + row * row_stride + pos // BS, mask=valid, other=0).to(tl.int64)
        slot = tl.where(valid, bid * BS + pos % BS, -1)
        tl.store(out_ptrs, slot, mask=in_range)

    @triton.jit
    def _pad_groups(out_ptrs, out_stride, in_range, NUM_GROUPS: tl.constexpr, BLOCK: tl.constexpr):
        pad = tl.full([BLOCK], -1, dtype=tl.int64)
        tl.store(out_ptrs, pad, mask=in_range)
        if NUM_GROUPS > 1:
            tl.store(out_ptrs + out_stride, pad, mask=in_range)
        if NUM_GROUPS > 2:
            tl.store(out_ptrs + 2 * out_stride, pad, mask=in_range)
        if NUM_GROUPS > 3:
            tl.store(out_ptrs + 3 * out_stride, pad, mask=in_range)

    @triton.jit
    def _slot_chunk(pid, req_rows_ptr, qsl_ptr, positions_ptr, num_pos, out_ptr, out_stride,
                    num_reqs, num_out, t0, s0, t1, s1, t2, s2, t3, s3,
                    BS0: tl.constexpr, BS1: tl.constexpr, BS2: tl.constexpr, BS3: tl.constexpr,
                    NUM_GROUPS: tl.constexpr, BLOCK: tl.constexpr, REQ_CHUNK: tl.constexpr):
        """Slots of tokens [pid*BLOCK, (pid+1)*BLOCK) for every group, padding included.

        A token finds its request by counting the request ends at or below it: one vector load of
        query_start_loc and a compare, instead of a chain of dependent loads (binary search) or a
        program per request (whose longest request sets the latency). Chunks wholly past the real
        tokens (most of them in a decode step) skip the search and only store padding.
        """
        tok = pid * BLOCK + tl.arange(0, BLOCK)
        in_range = tok < num_out
        # total, positions and the first request ends are loaded together, before the branch that
        # needs total: one memory latency instead of two on the critical path
        total = tl.load(qsl_ptr + num_reqs)
        pos = tl.load(positions_ptr + tok, mask=tok < num_pos, other=0).to(tl.int64)
        r = tl.arange(0, REQ_CHUNK)
        ends = tl.load(qsl_ptr + 1 + r, mask=r < num_reqs, other=2147483647)
        if pid * BLOCK >= total:
            _pad_groups(out_ptr + tok, out_stride, in_range, NUM_GROUPS, BLOCK)
        else:
            valid = tok < total
            req = tl.sum((ends[None, :] <= tok[:, None]).to(tl.int32), axis=1)
            for c in range(REQ_CHUNK, num_reqs, REQ_CHUNK):
                r = c + tl.arange(0, REQ_CHUNK)
                ends = tl.load(qsl_ptr + 1 + r, mask=r < num_reqs, other=2147483647)
                req += tl.sum((ends[None, :] <= tok[:, None]).to(tl.int32), axis=1)
            row = tl.load(req_rows_ptr + req, mask=valid, other=0).to(tl.int64)
            _group_slots(t0, s0, BS0, row, pos, valid, in_range, out_ptr + tok)
            if NUM_GROUPS > 1:
                _group_slots(t1, s1, BS1, row, pos, valid, in_range, out_ptr + out_stride + tok)
            if NUM_GROUPS > 2:
                _group_slots(t2, s2, BS2, row, pos, valid, in_range,
                             out_ptr + 2 * out_stride + tok)
            if NUM_GROUPS > 3:
                _group_slots(t3, s3, BS3, row, pos, valid, in_range,
                             out_ptr + 3 * out_stride + tok)

    @triton.jit(do_not_specialize=["num_reqs"])
    def _slot_mapping_kernel(req_rows_ptr, qsl_ptr, positions_ptr, num_pos, out_ptr, out_stride,
                             num_reqs, num_out, t0, s0, t1, s1, t2, s2, t3, s3,
                             BS0: tl.constexpr, BS1: tl.constexpr, BS2: tl.constexpr,
                             BS3: tl.constexpr, NUM_GROUPS: tl.constexpr, BLOCK: tl.constexpr,
                             REQ_CHUNK: tl.constexpr):
        _slot_chunk(tl.program_id(0), req_rows_ptr, qsl_ptr, positions_ptr, num_pos, out_ptr,
                    out_stride, num_reqs, num_out, t0, s0, t1, s1, t2, s2, t3, s3, BS0, BS1, BS2, BS3,
                    NUM_GROUPS, BLOCK, REQ_CHUNK)


#: Tokens per program: 8,192 tokens make 128 programs, one wave on an H100, and a decode step's
#: 256 tokens spread their request search over 4 programs.
SLOT_BLOCK = 64


def slot_launch_meta(num_reqs: int) -> dict:
    # Counting ends over 256 requests per step keeps the [BLOCK, REQ_CHUNK] compare in registers.
    return dict(BLOCK=SLOT_BLOCK, REQ_CHUNK=min(256, triton.next_power_of_2(max(num_reqs, 1))))


def block_size_args(block_sizes) -> dict:
    sizes = [int(b) for b in block_sizes] + [1] * (MAX_GROUPS_PER_LAUNCH - len(block_sizes))
    return dict(BS0=sizes[0], BS1=sizes[1], BS2=sizes[2], BS3=sizes[3],
                NUM_GROUPS=len(block_sizes))


def _group_kwargs(tables, block_sizes) -> dict:
    args = group_args(tables)
    names = ("t0", "s0", "t1", "s1", "t2", "s2", "t3", "s3")
    return dict(zip(names, args), **block_size_args(block_sizes))


def _check_slots_out(out, num_groups: int) -> None:
    if out.dtype != torch.int64 or out.dim() != 2 or out.shape[0] != num_groups \
            or out.stride(1) != 1:
        raise ValueError("out must be int64 [G, max_num_batched_tokens] with unit column stride")


def slot_launches(block_tables, block_sizes, req_rows, query_start_loc, positions, out,
                  num_reqs: int):
    """(grid, keyword arguments) of each launch of :func:`slot_mapping`, one per 4 groups."""
    num_out = out.shape[1]
    meta = slot_launch_meta(num_reqs)
    grid = (triton.cdiv(num_out, meta["BLOCK"]),)
    for g0 in range(0, len(block_tables), MAX_GROUPS_PER_LAUNCH):
        g1 = min(g0 + MAX_GROUPS_PER_LAUNCH, len(block_tables))
        yield grid, dict(req_rows_ptr=req_rows, qsl_ptr=query_start_loc,
                         positions_ptr=positions, num_pos=positions.shape[0], out_ptr=out[g0],
                         out_stride=out.stride(0),
                         num_reqs=num_reqs, num_out=num_out,
                         **_group_kwargs(block_tables[g0:g1], block_sizes[g0:g1]), **meta)


def slot_mapping(block_tables, block_sizes: Sequence[int], req_rows, query_start_loc, positions,
                 out=None, *, num_reqs: int | None = None, max_num_batched_tokens: int | None = None):
    """Torch wrapper of :func:`slot_mapping_ref`; one launch per 4 groups.

    All tensors on one device (CPU tensors run under TRITON_INTERPRET=1). ``num_reqs`` lets
    req_rows / query_start_loc be persistent buffers longer than the step's batch. ``out`` (int64
    [G, max_num_batched_tokens]) is allocated when not given; the token count is read on the device,
    so the call never synchronizes. For a step loop over persistent buffers, :class:`SlotMappingPlan`
    does the same with a fraction of the host time.
    """
    require_triton()
    num_groups = len(block_tables)
    if num_reqs is None:
        num_reqs = req_rows.shape[0]
    if out is None:
        if max_num_batched_tokens is None:
            raise ValueError("give out or max_num_batched_tokens")
        out = torch.empty((num_groups, max_num_batched_tokens), dtype=torch.int64,
                          device=positions.device)
    _check_slots_out(out, num_groups)
    for grid, kwargs in slot_launches(block_tables, block_sizes, req_rows, query_start_loc,
                                      positions, out, num_reqs):
        _slot_mapping_kernel[grid](**kwargs)
    return out


class LaunchPlan:
    """Launches of one kernel over persistent buffers, re-run each step with a new ``num_reqs``.

    ``launches(num_reqs)`` yields (grid, kwargs); only ``num_reqs`` and the REQ_CHUNK it selects
    change between steps, so one :class:`~kvd_kernels._triton.Relauncher` per REQ_CHUNK serves
    every step after the first that uses it.
    """

    def __init__(self, kernel, launches, stream: int | None = None):
        """``stream``: see :class:`~kvd_kernels._triton.Relauncher`."""
        require_triton()
        self._kernel, self._launches, self._plans = kernel, launches, {}
        self._stream = stream

    def __call__(self, num_reqs: int) -> None:
        key = slot_launch_meta(num_reqs)["REQ_CHUNK"]
        plans = self._plans.get(key)
        if plans is None:  # first step with this REQ_CHUNK: compile and launch normally
            self._plans[key] = [Relauncher(self._kernel, grid, kwargs, stream=self._stream)
                                for grid, kwargs in self._launches(num_reqs)]
            return
        for plan in plans:
            plan(num_reqs=num_reqs)


class SlotMappingPlan(LaunchPlan):
    """:func:`slot_mapping` bound to persistent buffers: ``plan(num_reqs)`` per step.

    The buffers (tables, req_rows, query_start_loc, positions, out) must stay the same tensors for
    the plan's life, as a session's buffers do; their contents change freely between calls.
    """

    def __init__(self, block_tables, block_sizes: Sequence[int], req_rows, query_start_loc,
                 positions, out, stream: int | None = None):
        require_triton()
        _check_slots_out(out, len(block_tables))
        tables, sizes = list(block_tables), list(block_sizes)
        super().__init__(_slot_mapping_kernel, lambda n: slot_launches(
            tables, sizes, req_rows, query_start_loc, positions, out, n), stream)
        self.out = out
