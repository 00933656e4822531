"""The Triton write_kv and paged_attention kernels against their torch references.

CPU: Triton's interpreter (float32, tiny shapes); CUDA: float32, bfloat16, float16. Float32 runs the
dots in IEEE precision: bound atol 1e-5. Half precisions feed the softmax weights to the P @ V dot in
the KV dtype (as flash attention does): bound atol 2e-3 (fp16) / 1.5e-2 (bf16) on outputs of size ~1.
"""

import pytest

torch = pytest.importorskip("torch")

from attn_cases import make_case  # noqa: E402

from kvd_kernels import PAD_SLOT_ID  # noqa: E402

ATOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.5e-2}
DTYPES = ["float32", "float16", "bfloat16"]


def dtype_for(device, name):
    if device == "cpu" and name != "float32":
        pytest.skip("the interpreter runs float32 only")
    return getattr(torch, name)


def bits(t):
    return t.cpu().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


# ---------------------------------------------------------------- write_kv

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strided_key", [False, True], ids=["contiguous", "from_qkv"])
def test_write_kv_matches_reference(device, dtype, strided_key):
    from kvd_kernels import write_kv_ref, write_kv_triton
    dt = dtype_for(device, dtype)
    g = torch.Generator().manual_seed(1)
    num_blocks, block_size, h, d, t = 7, 4, 2, 16, 9
    kv = torch.randn(2, num_blocks, block_size, h, d, generator=g).to(dt)
    if strided_key:  # K and V as views into a fused qkv projection, as engines produce them
        qkv = torch.randn(t, 3 * h, d, generator=g).to(dt)
        key, value = qkv[:, h:2 * h], qkv[:, 2 * h:]
    else:
        key = torch.randn(t, h, d, generator=g).to(dt)
        value = torch.randn(t, h, d, generator=g).to(dt)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t + 3]
    slots[[2, 5, t - 1]] = PAD_SLOT_ID  # padding rows, the last one too
    slots[t:] = 0  # entries past T are not tokens: block 0 must stay untouched
    want = kv.clone()
    write_kv_ref(key, value, want, slots)
    got = kv.clone().to(device)
    write_kv_triton(key.to(device), value.to(device), got, slots.to(device))
    assert torch.equal(bits(got), bits(want))
    # the reference itself: written slots hold K/V bit for bit, every other slot its old bytes
    flat_want, flat_kv = bits(want).flatten(1, 2), bits(kv).flatten(1, 2)
    written = [(i, int(s)) for i, s in enumerate(slots[:t]) if s != PAD_SLOT_ID]
    for i, s in written:
        assert torch.equal(flat_want[0, s], bits(key[i])) and torch.equal(flat_want[1, s], bits(value[i]))
    untouched = sorted(set(range(num_blocks * block_size)) - {s for _, s in written})
    assert len(written) == t - 3 and torch.equal(flat_want[:, untouched], flat_kv[:, untouched])


def test_write_kv_dispatch_and_rejects_bad_shapes(device):
    from kvd_kernels import write_kv, write_kv_triton
    kv = torch.zeros(2, 3, 2, 1, 16, device=device)
    key = torch.ones(2, 1, 16, device=device)
    write_kv(key, 2 * key, kv, torch.tensor([3, PAD_SLOT_ID], device=device))
    assert torch.equal(kv[0, 1, 1, 0].cpu(), torch.ones(16)) and float(kv.sum()) == 48.0
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_triton(key, key, kv, torch.tensor([0], device=device))
    assert float(kv.sum()) == 48.0


# ---------------------------------------------------------------- paged_attention

CASES = {
    "decode": dict(specs=[(9, 1), (1, 1), (16, 1), (30, 1)]),
    "prefill": dict(specs=[(7, 7), (12, 12)]),
    "chunked_prefill": dict(specs=[(19, 6), (27, 9)]),
    "mixed": dict(specs=[(19, 6), (13, 1), (8, 8), (5, 1), (21, 2)]),
    "gqa1": dict(specs=[(11, 3), (5, 1)], h_q=2, h_kv=2),
    "gqa4": dict(specs=[(11, 3), (5, 1)], h_q=8, h_kv=2),
    "window": dict(specs=[(23, 1), (21, 6), (5, 5), (14, 14)], window=7),
    "row_indices": dict(specs=[(10, 2), (6, 1), (13, 13)], row_indices=True),
    "padded_rows": dict(specs=[(10, 2), (6, 1)], pad_rows=3),
    "head_dim_24": dict(specs=[(10, 3), (6, 1)], d=24),
    # long enough for whole unmasked chunks between masked ones (with block_n 16)
    "long": dict(specs=[(70, 5), (50, 1), (45, 45)]),
    "long_window": dict(specs=[(70, 5), (50, 1), (45, 45)], window=19),
    # 2-token tiles: the first whole chunk starts exactly one key after the last row's window
    "window_pairs": dict(specs=[(60, 2), (45, 2), (33, 2)], window=19),
}


def run_case(device, dtype, spec, **tuning):
    from kvd_kernels import paged_attention_ref, paged_attention_triton
    dt = dtype_for(device, dtype)
    case = make_case(**spec, dtype=dt, device=device)
    want = paged_attention_ref(*case.args(), out=torch.full_like(case.query, 7.0), **case.kwargs())
    got = torch.full_like(case.query, 7.0)
    ret = paged_attention_triton(*case.args(), out=got, **case.kwargs(), **tuning)
    assert ret is got
    n = int(case.qsl[-1])
    assert torch.all(got[n:] == 7.0)  # padding rows untouched
    assert not torch.isnan(got[:n]).any()
    err = (got[:n].float() - want[:n].float()).abs().max().item()
    assert err <= ATOL[dtype], f"max abs error {err}"
    return case, got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_matches_reference(device, dtype, name):
    run_case(device, dtype, CASES[name])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("name", ["mixed", "long", "long_window", "window_pairs"])
def test_paged_attention_small_chunks_and_split_k(device, dtype, name, splits):
    # block_n 16: short contexts span several key chunks (masked and whole ones), and with 4 splits
    # several programs per (request, KV head) cover them, merged by the second kernel
    run_case(device, dtype, CASES[name], num_splits=splits, block_n=16)


@pytest.mark.parametrize("splits", [1, 4])
def test_a_new_output_has_zero_padding_rows(device, splits, monkeypatch):
    """Without ``out`` the padding rows are zero: with splits the merge kernel writes them into an
    uninitialized tensor (made NaN here, as fresh memory may hold anything), without splits the
    output starts zeroed; the other rows are the same bits as with a given ``out``."""
    from kvd_kernels import paged_attention_triton
    case = make_case(**CASES["padded_rows"], dtype=torch.float32, device=device)
    given = paged_attention_triton(*case.args(), out=torch.zeros_like(case.query), **case.kwargs(),
                                   num_splits=splits, block_n=16)
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: empty_like(t, **kw).fill_(float("nan")))
    got = paged_attention_triton(*case.args(), **case.kwargs(), num_splits=splits, block_n=16)
    n = int(case.qsl[-1])
    assert n < got.shape[0] and torch.all(got[n:] == 0)
    assert torch.equal(bits(got), bits(given))


@pytest.mark.parametrize("null_value", [float("nan"), 1e30, float("inf")])
def test_null_block_never_influences_output(device, null_value):
    spec = dict(CASES["window"], null_value=null_value)
    case, got = run_case(device, "float32", spec)
    assert (case.block_table == 0).any()  # the window case has leading null entries
    case2, got2 = run_case(device, "float32", dict(spec, null_value=0.0))
    assert torch.equal(got, got2)


def test_paged_attention_dispatch_and_fresh_output(device):
    from kvd_kernels import paged_attention
    case = make_case(**CASES["padded_rows"], device=device)
    out = paged_attention(*case.args(), **case.kwargs())
    n = int(case.qsl[-1])
    assert out.shape == case.query.shape and torch.all(out[n:] == 0)
    assert out.device.type == device


def test_paged_attention_triton_rejects_bad_input(device):
    from kvd_kernels import paged_attention_triton
    case = make_case([(5, 2)], device=device)
    q, kv, table, lens, qsl = case.args()
    with pytest.raises(ValueError, match="dtypes differ"):
        paged_attention_triton(q.double(), kv, table, lens, qsl, scale=1.0)
    with pytest.raises(ValueError, match="power of two"):
        paged_attention_triton(q, kv, table, lens, qsl, scale=1.0, num_splits=3)
