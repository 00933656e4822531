"""The torch references of write_kv and paged_attention against hand-computed values and dense SDPA.

These pin down the references themselves (the Triton kernels are tested against them elsewhere): a
reference only consistent with the kernel could be wrong in the same way.
"""

import pytest

torch = pytest.importorskip("torch")

from attn_cases import dense_attention, make_case  # noqa: E402

from kvd_kernels import PAD_SLOT_ID  # noqa: E402


def refs():
    from kvd_kernels import paged_attention_ref, write_kv_ref
    return write_kv_ref, paged_attention_ref


def test_write_kv_ref_hand_computed():
    write_kv_ref, _ = refs()
    kv = torch.zeros(2, 3, 2, 1, 2)
    key = torch.tensor([[[1., 2.]], [[3., 4.]], [[5., 6.]]])
    value = -key
    # token 0 -> block 2 offset 1, token 1 is padding, token 2 -> block 1 offset 0; entry 3 unused
    write_kv_ref(key, value, kv, torch.tensor([5, PAD_SLOT_ID, 2, 4]))
    want = torch.zeros(2, 3, 2, 1, 2)
    want[0, 2, 1, 0] = torch.tensor([1., 2.])
    want[1, 2, 1, 0] = torch.tensor([-1., -2.])
    want[0, 1, 0, 0] = torch.tensor([5., 6.])
    want[1, 1, 0, 0] = torch.tensor([-5., -6.])
    assert torch.equal(kv, want)


@pytest.mark.parametrize("slots", [[6, 0], [-2, 1]], ids=["past_pool", "negative_not_pad"])
def test_write_kv_ref_rejects_bad_slots_and_changes_nothing(slots):
    write_kv_ref, _ = refs()
    kv = torch.zeros(2, 3, 2, 1, 2)
    with pytest.raises(ValueError, match="slot"):
        write_kv_ref(torch.ones(2, 1, 2), torch.ones(2, 1, 2), kv, torch.tensor(slots))
    assert not kv.any()


def test_write_kv_ref_rejects_bad_shapes():
    write_kv_ref, _ = refs()
    kv = torch.zeros(2, 3, 2, 1, 2)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_ref(torch.ones(3, 1, 2), torch.ones(3, 1, 2), kv, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="kv_layer"):
        write_kv_ref(torch.ones(1, 2, 2), torch.ones(1, 2, 2), kv, torch.tensor([0]))
    with pytest.raises(ValueError, match="int64"):
        write_kv_ref(torch.ones(1, 1, 2), torch.ones(1, 1, 2), kv, torch.tensor([0], dtype=torch.int32))


def test_paged_attention_ref_hand_computed():
    _, attn = refs()
    # one request, 2 cached keys + 1 new query (position 2); block size 2: blocks 3 then 1
    kv = torch.zeros(2, 4, 2, 1, 1)
    kv[0, 3, :, 0, 0] = torch.tensor([0., 1.])       # keys at positions 0, 1
    kv[0, 1, 0, 0, 0] = 2.                            # key at position 2
    kv[1, 3, :, 0, 0] = torch.tensor([10., 20.])
    kv[1, 1, 0, 0, 0] = 30.
    kv[:, 0] = float("nan")                           # the null block is never read
    q = torch.tensor([[[1.]]])
    table = torch.tensor([[3, 1, 0]], dtype=torch.int32)
    out = attn(q, kv, table, torch.tensor([3], dtype=torch.int32),
               torch.tensor([0, 1], dtype=torch.int32), scale=1.0)
    w = torch.softmax(torch.tensor([0., 1., 2.]), 0)
    assert torch.allclose(out, (w @ torch.tensor([10., 20., 30.])).reshape(1, 1, 1), atol=1e-6)
    # window 2: position 2 sees keys 1 and 2 only
    out = attn(q, kv, table, torch.tensor([3], dtype=torch.int32),
               torch.tensor([0, 1], dtype=torch.int32), scale=1.0, sliding_window=2)
    w = torch.softmax(torch.tensor([1., 2.]), 0)
    assert torch.allclose(out, (w @ torch.tensor([20., 30.])).reshape(1, 1, 1), atol=1e-6)


CASES = {
    "decode": dict(specs=[(9, 1), (1, 1), (16, 1)]),
    "prefill": dict(specs=[(7, 7), (12, 12)]),
    "chunked_prefill": dict(specs=[(19, 6), (13, 1), (8, 8)]),
    "gqa1": dict(specs=[(11, 3), (5, 1)], h_q=2, h_kv=2),
    "gqa4": dict(specs=[(11, 3), (5, 1)], h_q=8, h_kv=2),
    "window": dict(specs=[(23, 1), (21, 6), (5, 5)], window=7),
    "window_prefill": dict(specs=[(18, 18)], window=5),
    "row_indices": dict(specs=[(10, 2), (6, 1), (13, 13)], row_indices=True),
    "padded_rows": dict(specs=[(10, 2), (6, 1)], pad_rows=3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_ref_matches_dense_sdpa(name):
    _, attn = refs()
    case = make_case(**CASES[name])
    sentinel = 123.0
    out = torch.full_like(case.query, sentinel)
    got = attn(*case.args(), out=out, **case.kwargs())
    assert got is out
    for s in range(len(case.specs)):
        q0, q1 = int(case.qsl[s]), int(case.qsl[s + 1])
        want = dense_attention(case, s).float()
        assert torch.allclose(out[q0:q1], want, atol=1e-5, rtol=0), name
    # padding rows past query_start_loc[-1] are left as they were
    assert torch.all(out[int(case.qsl[-1]):] == sentinel)
    fresh = attn(*case.args(), **case.kwargs())
    assert torch.all(fresh[int(case.qsl[-1]):] == 0)
    assert torch.equal(fresh[:int(case.qsl[-1])], out[:int(case.qsl[-1])])


def test_paged_attention_ref_rejects_bad_input():
    _, attn = refs()
    case = make_case([(5, 2)])
    q, kv, table, lens, qsl = case.args()
    with pytest.raises(ValueError, match="multiple"):
        attn(q[:, :3], kv, table, lens, qsl, scale=1.0)
    with pytest.raises(ValueError, match="int32"):
        attn(q, kv, table.long(), lens, qsl, scale=1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        attn(q, kv, table, lens, qsl[:1], scale=1.0)
    with pytest.raises(ValueError, match="query tokens"):
        attn(q, kv, table, torch.tensor([1], dtype=torch.int32), qsl, scale=1.0)
