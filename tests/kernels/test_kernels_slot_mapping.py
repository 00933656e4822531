"""Slot mapping: numpy references against hand-computed values, the Triton kernel against them."""

import numpy as np
import pytest

from kvd_kernels import PAD_SLOT_ID, slot_mapping_from_ranges_ref, slot_mapping_ref

POISON = 0x5A5A5A5A5A5A5A5A  # any element left unwritten shows up as this


def make_tables(rng, block_sizes, max_reqs, max_model_len, high=2**31 - 1):
    return [rng.integers(0, high, (max_reqs, -(-max_model_len // bs)), dtype=np.int32)
            for bs in block_sizes]


def expected(tables, block_sizes, rows, positions, width):
    """Token-by-token slots in Python ints (no numpy overflow possible)."""
    out = np.full((len(tables), width), PAD_SLOT_ID, dtype=np.int64)
    for g, (table, bs) in enumerate(zip(tables, block_sizes)):
        for t, (r, p) in enumerate(zip(rows, positions)):
            out[g, t] = int(table[r, p // bs]) * bs + p % bs
    return out


def case(rng, block_sizes, lens, max_model_len=256, max_reqs=16, width=None, **kw):
    """A step: random rows, each request's positions a contiguous run inside max_model_len."""
    tables = make_tables(rng, block_sizes, max_reqs, max_model_len, **kw)
    lens = np.asarray(lens, dtype=np.int32)
    rows = rng.permutation(max_reqs)[:len(lens)].astype(np.int32)
    starts = np.array([rng.integers(0, max_model_len - n + 1) for n in lens], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)] +
                               [np.zeros(0)]).astype(np.int64)
    width = width if width is not None else int(lens.sum()) + 7
    return dict(tables=tables, block_sizes=block_sizes, rows=rows, starts=starts, lens=lens,
                qsl=qsl, positions=positions, width=width)


def run_refs(c):
    token_rows = np.repeat(c["rows"], c["lens"])
    want = expected(c["tables"], c["block_sizes"], token_rows, c["positions"], c["width"])
    out = np.full_like(want, POISON)
    slot_mapping_ref(c["tables"], c["block_sizes"], c["rows"], c["qsl"], c["positions"], out)
    np.testing.assert_array_equal(out, want)
    out2 = np.full_like(want, POISON)
    slot_mapping_from_ranges_ref(c["tables"], c["block_sizes"], c["rows"], c["starts"], c["lens"],
                                 out2)
    np.testing.assert_array_equal(out2, want)
    return want


def run_kernel(c, device, positions_dtype="int64"):
    import torch

    from kvd_kernels import slot_mapping
    want = run_refs(c)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    out = torch.full(want.shape, POISON, dtype=torch.int64, device=device)
    pos = c["positions"].astype(positions_dtype)
    got = slot_mapping([t(x) for x in c["tables"]], c["block_sizes"], t(c["rows"]), t(c["qsl"]),
                       t(pos), out)
    assert got is out
    np.testing.assert_array_equal(out.cpu().numpy(), want)


def test_hand_computed_two_groups():
    tables = [np.array([[7, 8], [3, 4]], np.int32), np.array([[9], [5]], np.int32)]
    out = np.full((2, 5), POISON, np.int64)
    # request 0 -> row 1, positions 15, 16; request 1 -> row 0, position 0
    slot_mapping_ref(tables, [16, 32], np.array([1, 0], np.int32), np.array([0, 2, 3], np.int32),
                     np.array([15, 16, 0]), out)
    np.testing.assert_array_equal(out, [[3 * 16 + 15, 4 * 16 + 0, 7 * 16, -1, -1],
                                        [5 * 32 + 15, 5 * 32 + 16, 9 * 32, -1, -1]])


def test_from_ranges_matches_on_random_steps():
    rng = np.random.default_rng(1)
    for _ in range(50):
        lens = rng.integers(0, 40, rng.integers(0, 12))
        run_refs(case(rng, [16, 12], lens, max_model_len=512))


def test_from_ranges_rejects_overflowing_batch():
    tables = [np.zeros((2, 4), np.int32)]
    with pytest.raises(ValueError):
        slot_mapping_from_ranges_ref(tables, [16], np.array([0], np.int32),
                                     np.array([0], np.int32), np.array([9], np.int32),
                                     np.empty((1, 8), np.int64))


STEPS = {
    "empty": dict(block_sizes=[16], lens=[]),
    "one_token": dict(block_sizes=[16], lens=[1]),
    "decode": dict(block_sizes=[16, 32], lens=[1] * 40, max_reqs=64),
    "prefill_and_decode": dict(block_sizes=[16, 12, 64], lens=[70, 1, 0, 33, 1, 129]),
    "no_padding": dict(block_sizes=[16], lens=[50, 14], width=64),
    "five_groups": dict(block_sizes=[16, 32, 8, 64, 12], lens=[5, 20, 1]),
    "many_requests": dict(block_sizes=[16], lens=[1] * 300, max_reqs=512, width=384),
}


@pytest.mark.parametrize("name", STEPS)
def test_kernel_matches_reference(device, name):
    run_kernel(case(np.random.default_rng(len(name)), **STEPS[name]), device)


def test_kernel_block_boundaries_and_huge_ids(device):
    """Positions at block edges and at max_model_len - 1; block ids so large the slot needs 64 bits."""
    max_model_len, bss = 1024, [16, 12]
    rng = np.random.default_rng(3)
    c = case(rng, bss, [1], max_model_len=max_model_len, max_reqs=4)
    edges = [0, 15, 16, 17, 31, 32, 11, 12, 23, 24, max_model_len - 2, max_model_len - 1]
    c["lens"] = np.array([len(edges), 1], np.int32)
    c["rows"] = np.array([2, 3], np.int32)
    c["positions"] = np.array(edges + [max_model_len - 1], np.int64)
    c["qsl"] = np.array([0, len(edges), len(edges) + 1], np.int32)
    c["width"] = 20
    for t in c["tables"]:
        t[2:] = 2**31 - 1 - np.arange(t.shape[1], dtype=np.int32)
    # from_ranges cannot express arbitrary positions; check the general reference and the kernel
    want = expected(c["tables"], bss, [2] * len(edges) + [3], c["positions"], 20)
    assert want.max() > 2**34
    out = np.full_like(want, POISON)
    slot_mapping_ref(c["tables"], bss, c["rows"], c["qsl"], c["positions"], out)
    np.testing.assert_array_equal(out, want)
    import torch

    from kvd_kernels import slot_mapping
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    for pos_dtype in (np.int64, np.int32):
        got = torch.full(want.shape, POISON, dtype=torch.int64, device=device)
        slot_mapping([t(x) for x in c["tables"]], bss, t(c["rows"]), t(c["qsl"]),
                     t(c["positions"].astype(pos_dtype)), got)
        np.testing.assert_array_equal(got.cpu().numpy(), want)


def test_kernel_persistent_buffers(device):
    """Longer persistent input buffers with num_reqs, output allocated from max_num_batched_tokens."""
    import torch

    from kvd_kernels import slot_mapping
    c = case(np.random.default_rng(5), [16], [3, 9, 1])
    want = run_refs(c)
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    rows = t(np.concatenate([c["rows"], [99, 99]]).astype(np.int32))
    qsl = t(np.concatenate([c["qsl"], [1000, 2000]]).astype(np.int32))
    pos = t(np.concatenate([c["positions"], [7] * 30]))
    got = slot_mapping([t(x) for x in c["tables"]], [16], rows, qsl, pos, num_reqs=3,
                       max_num_batched_tokens=c["width"])
    np.testing.assert_array_equal(got.cpu().numpy(), want)


def test_plan_over_persistent_buffers(device):
    """A SlotMappingPlan re-launched step after step, batch sizes crossing REQ_CHUNK buckets,
    equals the reference each time (the fast relaunch path on a GPU, the normal one otherwise)."""
    import torch

    from kvd_kernels import GatherSlotMappingPlan, SlotMappingPlan, gather_block_tables_ref
    rng = np.random.default_rng(11)
    bss, max_reqs, width, max_model_len = [16, 32], 300, 400, 512
    tables = make_tables(rng, bss, max_reqs, max_model_len)
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    dev_tables = [t(x) for x in tables]
    rows_buf = torch.zeros(max_reqs, dtype=torch.int32, device=device)
    qsl_buf = torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)
    pos_buf = torch.zeros(width, dtype=torch.int64, device=device)
    out = torch.full((2, width), POISON, dtype=torch.int64, device=device)
    out_tables = [torch.full((max_reqs, x.shape[1]), -7, dtype=torch.int32, device=device)
                  for x in tables]
    out_slots = torch.full((2, width), POISON, dtype=torch.int64, device=device)
    plan = SlotMappingPlan(dev_tables, bss, rows_buf, qsl_buf, pos_buf, out)
    fused = GatherSlotMappingPlan(dev_tables, bss, rows_buf, qsl_buf, pos_buf, out_tables,
                                  out_slots)
    # repeated REQ_CHUNK buckets take the relaunch path: 8 (5, 7 requests), 256/300 requests
    for lens in ([1] * 5, [1] * 300, [30, 1, 1], [1] * 7, [], [1] * 290, [0, 400]):
        c = case(rng, bss, lens, max_model_len=max_model_len, max_reqs=max_reqs, width=width)
        c["tables"] = tables
        want = run_refs(c)
        n = len(lens)
        rows_buf[:n] = t(c["rows"])
        qsl_buf[:n + 1] = t(c["qsl"])
        pos_buf[:len(c["positions"])] = t(c["positions"])
        out.fill_(POISON)
        out_slots.fill_(POISON)
        for x in out_tables:
            x.fill_(-7)
        plan(n)
        fused(n)
        np.testing.assert_array_equal(out.cpu().numpy(), want)
        np.testing.assert_array_equal(out_slots.cpu().numpy(), want)
        want_tables = [np.empty((max_reqs, x.shape[1]), np.int32) for x in tables]
        gather_block_tables_ref(tables, c["rows"], want_tables)
        for got, w in zip(out_tables, want_tables):
            np.testing.assert_array_equal(got.cpu().numpy(), w)


@pytest.mark.cuda
def test_a_plan_given_a_stream_launches_on_it_whatever_stream_is_current():
    """``SlotMappingPlan(..., stream=handle)`` (the daemon's launches: no current-stream lookup per
    call): every relaunch goes to that stream, not to the current one. The given stream is held up
    by a long sleep: after the current stream drained the output is still untouched, and after the
    given stream drained it equals the reference."""
    import torch

    from kvd_kernels import SlotMappingPlan
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    rng = np.random.default_rng(3)
    c = case(rng, [16], [1] * 5, max_reqs=16, width=32)
    want = run_refs(c)
    t = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
    rows, qsl, pos = t(c["rows"].astype(np.int32)), t(c["qsl"].astype(np.int32)), t(c["positions"])
    out = torch.full((1, 32), POISON, dtype=torch.int64, device=dev)
    side = torch.cuda.Stream(dev)
    plan = SlotMappingPlan([t(c["tables"][0])], [16], rows, qsl, pos, out, stream=side.cuda_stream)
    plan(5)  # the first call compiles and launches the normal way, on the current stream
    torch.cuda.synchronize(dev)
    np.testing.assert_array_equal(out.cpu().numpy(), want)
    out.fill_(POISON)
    torch.cuda.synchronize(dev)
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU cycles ahead of the relaunch on ``side``
    plan(5)  # a relaunch: onto ``side``, behind the sleep
    untouched = out.cpu().numpy()  # a copy on the current stream, which it drains
    assert not side.query()
    assert (untouched == POISON).all()  # the relaunch waits behind the sleep on ``side``
    side.synchronize()
    np.testing.assert_array_equal(out.cpu().numpy(), want)


def test_ranges_ref_int_count_and_incremental_padding():
    rng = np.random.default_rng(7)
    table = rng.integers(1, 1000, (6, 10)).astype(np.int32)
    rows = np.array([4, 1, 3], np.int32)
    start = np.array([0, 17, 31], np.int64)
    full = np.full((1, 12), 99, np.int64)
    slot_mapping_from_ranges_ref([table], [8], rows, start, np.array([2, 2, 2]), full)
    by_int = np.full((1, 12), 99, np.int64)
    slot_mapping_from_ranges_ref([table], [8], rows, start, 2, by_int)
    assert by_int.tolist() == full.tolist()
    assert full[0, :6].tolist() == [table[4, 0] * 8, table[4, 0] * 8 + 1, table[1, 2] * 8 + 1,
                                    table[1, 2] * 8 + 2, table[3, 3] * 8 + 7, table[3, 4] * 8]
    # prev_tokens: only [T, prev) is padded again; beyond it the caller promised PAD already
    buf = np.full((1, 12), 77, np.int64)
    slot_mapping_from_ranges_ref([table], [8], rows[:2], start[:2], 1, buf, prev_tokens=5)
    assert buf[0, 2:5].tolist() == [PAD_SLOT_ID] * 3 and buf[0, 5:].tolist() == [77] * 7
    assert buf[0, :2].tolist() == [table[4, 0] * 8, table[1, 2] * 8 + 1]
