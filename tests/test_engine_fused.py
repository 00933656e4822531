"""The engine's fused RMSNorm and rotary-embedding kernels (examples/kvd_engine/fused.py) against
their references, HF's formulas: on the CPU through Triton's interpreter (float32), on CUDA in
float32, bfloat16 and float16 (marked cuda). The rotary embedding must be bit-identical to HF's;
RMSNorm sums its squares in another order than torch's mean: rtol 1e-6 in float32, one unit in the
last place in the half precisions."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tests import engine_common  # noqa: E402,F401  (puts examples/ on the path)

from kvd_engine import fused  # noqa: E402

HALF_ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def _device(name):
    if name == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        return torch.device("cuda")
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(fused._rope_kernel, InterpretedFunction):
        pytest.skip("CPU runs need TRITON_INTERPRET=1 (set without a GPU by tests/conftest.py)")
    return torch.device("cpu")


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _dtypes(dev):
    return [torch.float32] if dev.type == "cpu" else [torch.float32, torch.bfloat16, torch.float16]


def bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _qk_cos_sin(dev, dtype, t, hq, hk, d, seed=0):
    """q, k as HF makes them (views of the projections' [1, T, H * D] outputs) and HF's cos/sin."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, t, hq * d, generator=g).to(dtype).to(dev).view(1, t, hq, d).transpose(1, 2)
    k = torch.randn(1, t, hk * d, generator=g).to(dtype).to(dev).view(1, t, hk, d).transpose(1, 2)
    pos = torch.arange(t, dtype=torch.float32) + 1000.0
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    f = torch.outer(pos, inv)
    emb = torch.cat((f, f), dim=-1)
    return q, k, emb.cos()[None].to(dtype).to(dev), emb.sin()[None].to(dtype).to(dev)


@pytest.mark.parametrize("devname", DEVICES)
@pytest.mark.parametrize("shape", [(5, 4, 2, 16), (3, 3, 1, 8), (1, 16, 4, 128), (0, 2, 1, 8)],
                         ids=["gqa", "odd_heads", "llama_like", "empty"])
def test_rope_is_hf_bit_for_bit(devname, shape):
    dev = _device(devname)
    t, hq, hk, d = shape
    for dtype in _dtypes(dev):
        q, k, cos, sin = _qk_cos_sin(dev, dtype, t, hq, hk, d)
        want_q, want_k = fused.rope_ref(q, k, cos, sin)
        got_q, got_k = fused.rope(q, k, cos, sin)
        assert got_q.shape == want_q.shape == (1, hq, t, d) and got_k.shape == want_k.shape == (1, hk, t, d)
        assert torch.equal(bits(got_q), bits(want_q)), dtype
        assert torch.equal(bits(got_k), bits(want_k)), dtype
        # stored [T, H, D]: the paged attention's transpose(0, 1).contiguous() copies nothing
        assert got_q[0].transpose(0, 1).is_contiguous() and got_k[0].transpose(0, 1).is_contiguous()


@pytest.mark.parametrize("devname", DEVICES)
@pytest.mark.parametrize("rows,n", [(7, 64), (2, 96), (1, 2048), (0, 32)], ids=["pow2", "ragged", "wide", "empty"])
def test_rms_norm_matches_hf(devname, rows, n):
    dev = _device(devname)
    for dtype in _dtypes(dev):
        g = torch.Generator().manual_seed(3)
        x = (3 * torch.randn(1, rows, n, generator=g)).to(dtype).to(dev)
        w = (1 + 0.5 * torch.randn(n, generator=g)).to(dtype).to(dev)
        want = fused.rms_norm_ref(x, w, 1e-6)
        got = fused.rms_norm(x, w, 1e-6)
        assert got.shape == want.shape and got.dtype == want.dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        else:  # within one unit in the last place
            assert ((got.float() - want.float()).abs() <= HALF_ULP[dtype] * want.float().abs() + 1e-30).all()


@pytest.mark.parametrize("devname", DEVICES)
def test_rms_norm_reads_strided_rows(devname):
    """A row stride other than N (a slice of a wider tensor) is read as it is."""
    dev = _device(devname)
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(6, 80, generator=g).to(dev)
    x = wide[:, :48]
    w = torch.randn(48, generator=g).to(dev)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), fused.rms_norm_ref(x, w, 1e-5), rtol=1e-6, atol=1e-7)


def test_install_switches_only_paged_cuda_forwards():
    """The wrappers call HF's code unless a paged forward of a fused model runs on CUDA tensors: on
    the CPU, installed or not, the model's logits are the same bits."""
    from kvd_engine import build_model, tiny_config, use_paged

    model = build_model(tiny_config("llama", layers=1, hidden=32, heads=4, kv_heads=2, vocab=64), seed=1)
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        assert fused.install(model) is True and model._kvd_fused
        use_paged(model, True)
        assert fused.ACTIVE[0] is True
        use_paged(model, False)
        assert fused.ACTIVE[0] is False
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)
    assert fused.install(model, on=False) is False and not model._kvd_fused
    use_paged(model, True)
    assert fused.ACTIVE[0] is False  # a model turned off never switches the kernels on
    use_paged(model, False)


@pytest.mark.parametrize("devname", DEVICES)
def test_installed_embedding_gathers_the_same_rows(devname):
    """The token embedding of a fused model, in a paged forward, is the rows ``F.embedding`` returns
    (on CUDA by indexing, whose kernel takes any count of ids; on the CPU HF's own call), for id
    counts on both sides of torch's small-index kernel (< 64 ids); an embedding with ``max_norm``
    (which renormalizes rows) keeps its own forward."""
    from kvd_engine import build_model, tiny_config

    dev = _device(devname)
    model = build_model(tiny_config("llama", layers=1, hidden=32, heads=4, kv_heads=2, vocab=64), seed=1, device=dev)
    assert fused.install(model) is True
    emb = model.get_input_embeddings()
    assert "forward" in vars(emb)  # wrapped
    renorm = torch.nn.Sequential(torch.nn.Embedding(8, 4, max_norm=1.0))
    fused.install(renorm)
    assert "forward" not in vars(renorm[0])
    g = torch.Generator().manual_seed(3)
    was = fused.ACTIVE[0]
    try:
        fused.ACTIVE[0] = True
        for n in (1, 16, 63, 64, 300):
            ids = torch.randint(0, 64, (1, n), generator=g).to(dev)
            with torch.no_grad():
                got = emb(ids)
            assert got.shape == (1, n, 32)
            assert torch.equal(got, torch.nn.functional.embedding(ids, emb.weight)), n
    finally:
        fused.ACTIVE[0] = was


def test_patched_rope_keeps_hf_for_what_the_kernel_does_not_take():
    """The patched apply_rotary_pos_emb calls HF's function with the same arguments unless a paged
    forward runs on CUDA tensors of the one layout the kernel takes."""
    calls = []

    def orig(*args, **kwargs):
        calls.append((len(args), sorted(kwargs)))
        return "hf"

    apply = fused._fused_rope(orig)
    q, k, cos, sin = _qk_cos_sin(torch.device("cpu"), torch.float32, 3, 2, 1, 8)
    was = fused.ACTIVE[0]
    try:
        fused.ACTIVE[0] = True
        assert apply(q, k, cos, sin) == "hf"  # CPU tensors
        assert apply(q, k, cos, sin, 2) == "hf"
        assert apply(q, k, cos, sin, unsqueeze_dim=1) == "hf"
        fused.ACTIVE[0] = False
        assert apply(q, k, cos, sin) == "hf"
    finally:
        fused.ACTIVE[0] = was
    assert calls == [(4, []), (5, []), (4, ["unsqueeze_dim"]), (4, [])]
