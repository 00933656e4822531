"""Block tables on the device: staged writes, batch-order gather, and gather fused with slots.

Block tables are append-only per request, so a step's changes are ``(group, row, start, ids)``: the
daemon stages them CSR-style (``offsets[i]:offsets[i+1]`` indexes the flat ``ids``) and one launch
applies all of them to every group's table. The forward pass reads persistent tables in batch order;
:func:`gather_block_tables` fills them from the daemon's row-indexed tables, zeroing rows past the
batch (block 0 is the null block), and :func:`gather_slot_mapping` also computes the slot mapping in
the same launch.
"""

from __future__ import annotations

from typing import Sequence


from ._triton import HAS_TRITON, MAX_GROUPS_PER_LAUNCH, group_args, require_triton, tl, torch, triton
from .slots import LaunchPlan, _group_kwargs, slot_launch_meta

if HAS_TRITON:
    from .slots import _slot_chunk

    @triton.jit
    def _update_group(table, row_stride, num_cols, row, col, vals, mask):
        # the column bound keeps a bad change from writing outside the table
        tl.store(table + row * row_stride + col, vals, mask=mask & (col < num_cols))

    @triton.jit
    def _apply_updates_kernel(groups_ptr, rows_ptr, starts_ptr, offsets_ptr, ids_ptr, group_base,
                              t0, s0, t1, s1, t2, s2, t3, s3, n0, n1, n2, n3,
                              NUM_GROUPS: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        # a launch serves groups group_base .. group_base + 3; other changes match no branch
        grp = tl.load(groups_ptr + i) - group_base
        row = tl.load(rows_ptr + i).to(tl.int64)
        start = tl.load(starts_ptr + i)
        begin = tl.load(offsets_ptr + i)
        end = tl.load(offsets_ptr + i + 1)
        for c in range(begin, end, BLOCK):
            k = c + tl.arange(0, BLOCK)
            mask = k < end
            vals = tl.load(ids_ptr + k, mask=mask)
            col = start + (k - begin)
            if grp == 0:
                _update_group(t0, s0, n0, row, col, vals, mask)
            if NUM_GROUPS > 1:
                if grp == 1:
                    _update_group(t1, s1, n1, row, col, vals, mask)
            if NUM_GROUPS > 2:
                if grp == 2:
                    _update_group(t2, s2, n2, row, col, vals, mask)
            if NUM_GROUPS > 3:
                if grp == 3:
                    _update_group(t3, s3, n3, row, col, vals, mask)

    @triton.jit
    def _gather_group(src, src_stride, dst, dst_stride, num_cols, src_row, i, valid,
                      BLOCK_COLS: tl.constexpr):
        # padded rows read nothing and store NULL_BLOCK (0); a column bound instead of
        # `mask & valid` because the interpreter cannot load under a mask combined with a scalar
        read_cols = tl.where(valid, num_cols, 0)
        for c in range(0, num_cols, BLOCK_COLS):
            cols = c + tl.arange(0, BLOCK_COLS)
            v = tl.load(src + src_row * src_stride + cols, mask=cols < read_cols, other=0)
            tl.store(dst + i * dst_stride + cols, v, mask=cols < num_cols)

    @triton.jit
    def _gather_row(i, req_rows_ptr, num_reqs, t0, s0, t1, s1, t2, s2, t3, s3,
                    o0, os0, o1, os1, o2, os2, o3, os3, n0, n1, n2, n3,
                    NUM_GROUPS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        valid = i < num_reqs
        src_row = tl.load(req_rows_ptr + i, mask=valid, other=0).to(tl.int64)
        _gather_group(t0, s0, o0, os0, n0, src_row, i, valid, BLOCK_COLS)
        if NUM_GROUPS > 1:
            _gather_group(t1, s1, o1, os1, n1, src_row, i, valid, BLOCK_COLS)
        if NUM_GROUPS > 2:
            _gather_group(t2, s2, o2, os2, n2, src_row, i, valid, BLOCK_COLS)
        if NUM_GROUPS > 3:
            _gather_group(t3, s3, o3, os3, n3, src_row, i, valid, BLOCK_COLS)

    @triton.jit(do_not_specialize=["num_reqs"])
    def _gather_kernel(req_rows_ptr, num_reqs, t0, s0, t1, s1, t2, s2, t3, s3,
                       o0, os0, o1, os1, o2, os2, o3, os3, n0, n1, n2, n3,
                       NUM_GROUPS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        _gather_row(tl.program_id(0).to(tl.int64), req_rows_ptr, num_reqs, t0, s0, t1, s1, t2, s2,
                    t3, s3, o0, os0, o1, os1, o2, os2, o3, os3, n0, n1, n2, n3, NUM_GROUPS,
                    BLOCK_COLS)

    @triton.jit(do_not_specialize=["num_reqs"])
    def _gather_slot_kernel(req_rows_ptr, qsl_ptr, positions_ptr, num_pos, out_ptr, out_stride,
                            num_reqs, num_out, num_slot_programs, t0, s0, t1, s1, t2, s2, t3, s3,
                            o0, os0, o1, os1, o2, os2, o3, os3, n0, n1, n2, n3,
                            BS0: tl.constexpr, BS1: tl.constexpr, BS2: tl.constexpr,
                            BS3: tl.constexpr, NUM_GROUPS: tl.constexpr, BLOCK: tl.constexpr,
                            REQ_CHUNK: tl.constexpr, BLOCK_COLS: tl.constexpr):
        # Slot programs first, then one program per table row: the two halves are independent
        # (slots read the daemon's row-indexed tables, not the gathered copies), so one launch
        # costs one launch latency.
        pid = tl.program_id(0)
        if pid < num_slot_programs:
            _slot_chunk(pid, req_rows_ptr, qsl_ptr, positions_ptr, num_pos, out_ptr, out_stride,
                        num_reqs, num_out, t0, s0, t1, s1, t2, s2, t3, s3, BS0, BS1, BS2, BS3, NUM_GROUPS,
                        BLOCK, REQ_CHUNK)
        else:
            _gather_row((pid - num_slot_programs).to(tl.int64), req_rows_ptr, num_reqs,
                        t0, s0, t1, s1, t2, s2, t3, s3, o0, os0, o1, os1, o2, os2, o3, os3,
                        n0, n1, n2, n3, NUM_GROUPS, BLOCK_COLS)


#: ids per loop iteration of a staged change; a step appends a few blocks per request.
UPDATE_BLOCK = 64
#: columns per loop iteration of a gathered row.
GATHER_BLOCK_COLS = 512


def _num_cols(tables) -> list[int]:
    return [t.shape[1] for t in tables] + [0] * (MAX_GROUPS_PER_LAUNCH - len(tables))


def _check_tables(tables, what: str) -> None:
    if len({t.shape[0] for t in tables}) > 1 and what == "out_tables":
        raise ValueError("out_tables must all have max_batch rows")
    for t in tables:
        if t.dtype != torch.int32 or t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"{what} must be int32 2-D tensors with unit column stride")


def apply_block_table_updates(block_tables, groups, rows, starts, offsets, ids,
                              num_changes: int | None = None) -> None:
    """Torch wrapper of :func:`apply_block_table_updates_ref`; one launch per 4 groups.

    The int32 change arrays may sit in pinned host memory (the kernel then reads them over the bus
    with no separate copy) or on the tables' device. ``num_changes`` lets them be persistent
    staging buffers longer than the step's change list.
    """
    require_triton()
    _check_tables(block_tables, "block_tables")
    n = groups.shape[0] if num_changes is None else num_changes
    if n == 0:
        return
    for g0 in range(0, len(block_tables), MAX_GROUPS_PER_LAUNCH):
        tables = block_tables[g0:g0 + MAX_GROUPS_PER_LAUNCH]
        _apply_updates_kernel[(n,)](groups, rows, starts, offsets, ids, g0, *group_args(tables),
                                    *_num_cols(tables), NUM_GROUPS=len(tables),
                                    BLOCK=UPDATE_BLOCK)


def gather_block_tables(block_tables, req_rows, out_tables, *, num_reqs: int | None = None):
    """Torch wrapper of :func:`gather_block_tables_ref` into preallocated ``out_tables``
    (int32 [max_batch, cols_g], cols_g <= the source's); every element of every row is written."""
    require_triton()
    _check_tables(block_tables, "block_tables")
    _check_tables(out_tables, "out_tables")
    num_reqs = req_rows.shape[0] if num_reqs is None else num_reqs
    for g0 in range(0, len(block_tables), MAX_GROUPS_PER_LAUNCH):
        src = block_tables[g0:g0 + MAX_GROUPS_PER_LAUNCH]
        dst = out_tables[g0:g0 + MAX_GROUPS_PER_LAUNCH]
        rows_out = dst[0].shape[0]
        _gather_kernel[(rows_out,)](req_rows, num_reqs, *group_args(src), *group_args(dst),
                                    *_num_cols(dst), NUM_GROUPS=len(src),
                                    BLOCK_COLS=GATHER_BLOCK_COLS)
    return out_tables


def gather_slot_launches(block_tables, block_sizes, req_rows, query_start_loc, positions,
                         out_tables, out_slots, num_reqs: int):
    """(grid, keyword arguments) of each launch of :func:`gather_slot_mapping`."""
    num_out = out_slots.shape[1]
    meta = slot_launch_meta(num_reqs)
    num_slot_programs = triton.cdiv(num_out, meta["BLOCK"])
    names = ("o0", "os0", "o1", "os1", "o2", "os2", "o3", "os3", "n0", "n1", "n2", "n3")
    for g0 in range(0, len(block_tables), MAX_GROUPS_PER_LAUNCH):
        g1 = min(g0 + MAX_GROUPS_PER_LAUNCH, len(block_tables))
        dst = out_tables[g0:g1]
        grid = (num_slot_programs + dst[0].shape[0],)
        yield grid, dict(req_rows_ptr=req_rows, qsl_ptr=query_start_loc, positions_ptr=positions,
                         num_pos=positions.shape[0], out_ptr=out_slots[g0],
                         out_stride=out_slots.stride(0),
                         num_reqs=num_reqs, num_out=num_out, num_slot_programs=num_slot_programs,
                         **_group_kwargs(block_tables[g0:g1], block_sizes[g0:g1]),
                         **dict(zip(names, group_args(dst) + _num_cols(dst))), **meta,
                         BLOCK_COLS=GATHER_BLOCK_COLS)


def _check_fused(block_tables, out_tables, out_slots) -> None:
    _check_tables(block_tables, "block_tables")
    _check_tables(out_tables, "out_tables")
    if out_slots.dtype != torch.int64 or out_slots.dim() != 2 or \
            out_slots.shape[0] != len(block_tables) or out_slots.stride(1) != 1:
        raise ValueError("out_slots must be int64 [G, max_num_batched_tokens]")


def gather_slot_mapping(block_tables, block_sizes: Sequence[int], req_rows, query_start_loc,
                        positions, out_tables, out_slots, *, num_reqs: int | None = None):
    """Torch wrapper of :func:`gather_slot_mapping_ref`: both outputs in one launch per 4 groups.
    :class:`GatherSlotMappingPlan` is the same over persistent buffers with less host time."""
    require_triton()
    _check_fused(block_tables, out_tables, out_slots)
    num_reqs = req_rows.shape[0] if num_reqs is None else num_reqs
    for grid, kwargs in gather_slot_launches(block_tables, block_sizes, req_rows,
                                             query_start_loc, positions, out_tables, out_slots,
                                             num_reqs):
        _gather_slot_kernel[grid](**kwargs)
    return out_tables, out_slots


class GatherSlotMappingPlan(LaunchPlan):
    """:func:`gather_slot_mapping` bound to persistent buffers: ``plan(num_reqs)`` per step."""

    def __init__(self, block_tables, block_sizes: Sequence[int], req_rows, query_start_loc,
                 positions, out_tables, out_slots):
        require_triton()
        _check_fused(block_tables, out_tables, out_slots)
        tables, sizes, outs = list(block_tables), list(block_sizes), list(out_tables)
        super().__init__(_gather_slot_kernel, lambda n: gather_slot_launches(
            tables, sizes, req_rows, query_start_loc, positions, outs, out_slots, n))
        self.out_tables, self.out_slots = outs, out_slots
