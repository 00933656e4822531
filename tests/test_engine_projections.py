"""The engine's fused q/k/v and gate/up projections (examples/kvd_engine/projections.py): which models
they take, that HF's own forward is untouched, and that the fused products are the separate ones:
close on the CPU (the wrappers forced on), bit for bit on CUDA in bfloat16 and float16 (marked cuda),
the property the module's half-precision-only rule rests on."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tests import engine_common  # noqa: E402,F401  (puts examples/ on the path)

import torch.nn.functional as F  # noqa: E402
from kvd_engine import build_model, fused, projections, tiny_config  # noqa: E402

HALF = [torch.bfloat16, torch.float16]


def _model(kind="llama", dtype=torch.bfloat16, device="cpu"):
    extra = dict(window=4) if kind == "hybrid" else {}
    return build_model(tiny_config(kind, layers=2, hidden=64, heads=4, kv_heads=2, vocab=64, **extra),
                       seed=1, dtype=dtype, device=device)


@pytest.fixture
def forced_on(monkeypatch):
    """The wrappers' fused path on CPU tensors too (normally CUDA paged forwards only); the SiLU
    kernel as its reference (Triton's interpreter computes float32 only: it has its own test)."""
    calls = []

    def silu_mul(both, n):
        calls.append(n)
        return fused.silu_mul_ref(both, n)

    monkeypatch.setattr(projections, "_active", lambda x: True)
    monkeypatch.setattr(fused, "silu_mul", silu_mul)
    return calls


def _interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(fused._silu_mul_kernel, InterpretedFunction):
        pytest.skip("CPU runs need TRITON_INTERPRET=1 (set without a GPU by tests/conftest.py)")


@pytest.mark.parametrize("rows,n", [(5, 24), (1, 1), (3, 2500), (0, 8)])
def test_silu_mul_kernel_matches_hf_on_the_interpreter(rows, n):
    """float32 through Triton's interpreter (its own exp: close, not bits; the GPU test is exact)."""
    _interpreted()
    x = torch.randn(1, rows, 2 * n, generator=torch.Generator().manual_seed(rows + n)) * 6
    got = fused.silu_mul(x, n)
    assert got.shape == (1, rows, n)
    torch.testing.assert_close(got, fused.silu_mul_ref(x, n), rtol=1e-6, atol=1e-7)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=["fp32", "bf16", "fp16"])
def test_cuda_silu_mul_kernel_is_hf_bit_for_bit(dtype):
    """On CUDA the kernel's bits are torch's ``silu(gate) * up``: values from -90 to 90 (exp
    overflowing to inf included) and every row count of a step's bucket."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    for t, n in ((1, 4096), (16, 4096), (256, 4096), (7, 1000)):
        x = (torch.randn(1, t, 2 * n, device="cuda", generator=g) * 8).to(dtype)
        x[0, 0, :8] = torch.tensor([-90.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 90.0, -0.0]).to(dtype)
        got, want = fused.silu_mul(x, n), fused.silu_mul_ref(x, n)
        assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           want.view(torch.int16 if dtype != torch.float32 else torch.int32)), (t, n, dtype)


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_install_reseats_half_precision_weights_as_slices_of_one_matrix(kind):
    """Each layer's q/k/v (and gate/up) weights become consecutive row slices of one matrix with
    the same values (Qwen2's q/k/v biases too); HF's own forward gives the same bits afterwards."""
    model = _model(kind)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert projections.install(model) == 4  # 2 attentions + 2 MLPs
    after = dict(model.named_parameters())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    row = q.shape[1] * q.element_size()
    assert k.data_ptr() == q.data_ptr() + q.shape[0] * row
    assert v.data_ptr() == k.data_ptr() + k.shape[0] * row
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    assert up.data_ptr() == gate.data_ptr() + gate.shape[0] * gate.shape[1] * gate.element_size()
    if kind == "hybrid":
        qb, kb = attn.q_proj.bias, attn.k_proj.bias
        assert kb.data_ptr() == qb.data_ptr() + qb.shape[0] * qb.element_size()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits)


def test_float32_models_keep_separate_products():
    model = _model(dtype=torch.float32)
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert projections.install(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert "forward" not in vars(model.model.layers[0].self_attn.q_proj)


def test_fused_install_counts_the_projections():
    model = _model()
    assert fused.install(model) is True
    assert model._kvd_fused_projections == 4
    fp32 = _model(dtype=torch.float32)
    assert fused.install(fp32) is True and fp32._kvd_fused_projections == 0


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_forced_fused_products_match_separate_ones(kind, forced_on):
    """Fused (forced on the CPU) q/k/v and MLP outputs against HF's separate products: shapes,
    strides of views into one product, values within a bfloat16 rounding."""
    model = _model(kind)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    ref = {n: getattr(attn, n).weight.detach().clone() for n in ("q_proj", "k_proj", "v_proj")}
    bias = {n: (None if getattr(attn, n).bias is None else getattr(attn, n).bias.detach().clone()) for n in ref}
    gate_w, up_w = mlp.gate_proj.weight.detach().clone(), mlp.up_proj.weight.detach().clone()
    projections.install(model)
    x = torch.randn(1, 7, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        q = attn.q_proj(x)
        k = attn.k_proj(x)
        v = attn.v_proj(x)
        for got, n in zip((q, k, v), ref):
            torch.testing.assert_close(got, F.linear(x, ref[n], bias[n]), rtol=2 ** -7, atol=1e-2)
        assert q.shape == (1, 7, 64) and k.shape == v.shape == (1, 7, 32)
        assert q.stride(1) == k.stride(1) == v.stride(1) == 128  # rows of the one [7, 64 + 32 + 32] product
        want = mlp.down_proj(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w))
        torch.testing.assert_close(mlp(x), want, rtol=2 ** -6, atol=2e-2)
    assert forced_on == [128]  # the fused MLP's one silu_mul call, over the intermediate width


def test_k_and_v_of_another_input_take_their_own_products(forced_on):
    """The kept product serves only k_proj/v_proj calls on the very tensor q_proj saw; any other
    input (or a call without a q_proj call before it) runs the projection's own forward."""
    model = _model()
    attn = model.model.layers[0].self_attn
    projections.install(model)
    g = torch.Generator().manual_seed(2)
    x, y = (torch.randn(1, 3, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        attn.q_proj(x)
        assert torch.equal(attn.k_proj(y), F.linear(y, attn.k_proj.weight))
        assert torch.equal(attn.v_proj(y), F.linear(y, attn.v_proj.weight))
        kx = attn.k_proj(x)
        assert kx.stride(1) == 128  # still x's fused product
        attn.v_proj(x)  # consumes it
        assert attn.k_proj(x).stride(1) == 32  # now its own product


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_cuda_fused_products_are_the_separate_products_bit_for_bit(kind, dtype):
    """On CUDA, in a fused paged forward's state (``fused.ACTIVE``), every slice of the fused product
    has the separate product's bits, at the benchmark model's width and token counts from a decode of
    one to a long prefill."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    extra = dict(window=4) if kind == "hybrid" else {}
    model = build_model(tiny_config(kind, layers=1, hidden=2048, heads=16, kv_heads=4, vocab=64, **extra),
                        seed=1, dtype=dtype, device="cuda")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert projections.install(model) == 2
    g = torch.Generator(device="cuda").manual_seed(0)
    was = fused.ACTIVE[0]
    try:
        fused.ACTIVE[0] = True
        with torch.no_grad():
            for t in (1, 16, 64, 256, 1040):
                x = torch.randn(1, t, 2048, device="cuda", generator=g).to(dtype)
                assert attn.q_proj(x).stride(1) == 2048 + 512 + 512  # the fused product's rows
                for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
                    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias)), (t, lin)
                want = mlp.down_proj(mlp.act_fn(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight))
                assert torch.equal(mlp(x), want), t
    finally:
        fused.ACTIVE[0] = was


def test_replaced_weights_take_their_own_products(forced_on):
    """A weight replaced after install (``load_state_dict(assign=True)``, ``model.to``) is no
    longer a slice of the concatenation: the projections then compute from the weights the modules
    hold, never from the stale concatenation."""
    model = _model()
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    projections.install(model)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 3, 64, generator=g).to(torch.bfloat16)
    attn.k_proj.weight = torch.nn.Parameter(torch.randn(32, 64, generator=g).to(torch.bfloat16), requires_grad=False)
    mlp.up_proj.weight = torch.nn.Parameter(torch.randn(128, 64, generator=g).to(torch.bfloat16), requires_grad=False)
    with torch.no_grad():
        q = attn.q_proj(x)
        assert q.stride(1) == 64  # its own product: the concatenation is not used any more
        assert torch.equal(attn.k_proj(x), F.linear(x, attn.k_proj.weight))
        assert torch.equal(attn.v_proj(x), F.linear(x, attn.v_proj.weight))
        want = mlp.down_proj(F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight))
        assert torch.equal(mlp(x), want)
