"""One matrix product for a layer's q/k/v projections and one for its MLP's gate/up, in the engine's
paged CUDA forwards of a half-precision model.

With the few tokens of a prefix hit's suffix (or a decode batch) a projection is a thin matrix
product whose time is mostly the kernel's fixed cost, not its bytes: on an H200, bf16, hidden
2,048, 16 tokens, q + k + v as three products took 15.1 µs and as one 5.3 µs; gate + up 10.1 and
7.0 µs; at 256 tokens 16.8 -> 7.0 and 19.3 -> 13.2 (CUDA-graph replays of the products alone;
README, the engine's session 28 entry).

``install(model)`` re-seats each layer's projection weights as row slices of one concatenated
matrix (``q_proj.weight`` is rows ``[0, Hq)`` of it, and so on: no second copy, HF's own forwards
read the same bytes) and wraps the projections: while a fused paged forward runs (``fused.ACTIVE``)
on CUDA, ``q_proj(x)`` computes all three products at once and keeps them for the ``k_proj(x)`` and
``v_proj(x)`` calls on the same ``x`` that HF's attention makes next; the MLP computes gate and up
at once, and (a SiLU MLP) ``silu(gate) * up`` as one kernel (``fused.silu_mul``, torch's bits). The
slices are strided views; the paged attention writes K/V from any row stride.

Only bfloat16 and float16 models: there each output column of the fused product is bit-identical
to the separate product's (checked on the GPU by ``tests/test_engine_projections.py``), so a fused
forward's logits are the unfused forward's bits. In float32 cuBLAS picks other algorithms for the
wider product and the columns differ in the last bits: float32 is the dtype whose tokens must be
identical to HF's, so it keeps HF's three and two products.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fused

#: dtypes whose fused products equal the separate ones column for column (see the docstring)
FUSED_DTYPES = (torch.bfloat16, torch.float16)
_ATTENTIONS = ("LlamaAttention", "Qwen2Attention", "MistralAttention")
_MLPS = ("LlamaMLP", "Qwen2MLP", "MistralMLP")
#: activations that are ``F.silu`` (HF's "silu"): their MLPs take the fused ``fused.silu_mul``
_SILUS = ("SiLUActivation", "SiLU")


def _concat_rows(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding ``linears``' rows in order; each linear's own parameters become
    views of it (without gradients: the engine only runs inference)."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
    start = 0
    for lin in linears:
        rows = lin.out_features
        lin.weight = torch.nn.Parameter(weight[start:start + rows], requires_grad=False)
        if has_bias:
            lin.bias = torch.nn.Parameter(bias[start:start + rows], requires_grad=False)
        start += rows
    return weight, bias


def _fusable(linears) -> bool:
    first = linears[0]
    return (all(type(lin) is torch.nn.Linear for lin in linears)
            and all(lin.in_features == first.in_features and lin.weight.dtype == first.weight.dtype
                    and lin.weight.device == first.weight.device
                    and (lin.bias is None) == (first.bias is None) for lin in linears)
            and first.weight.dtype in FUSED_DTYPES)


def _active(x: torch.Tensor) -> bool:
    return fused.ACTIVE[0] and x.is_cuda


def _seated(linears, weight: torch.Tensor):
    """A check that ``linears``' weights are still the row slices of ``weight`` ``_concat_rows``
    made them (a later ``model.to(...)`` or ``load_state_dict(assign=True)`` replaces them: then
    their own products, never a stale concatenation)."""
    row = weight.stride(0) * weight.element_size()
    want, start = [], weight.data_ptr()
    for lin in linears:
        want.append(start)
        start += lin.out_features * row
    want = tuple(want)
    return lambda: tuple(lin.weight.data_ptr() for lin in linears) == want


def fuse_attention(attn) -> bool:
    """Wrap ``attn``'s q/k/v projections (see the module docstring); False where they do not fit."""
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    if not _fusable((q, k, v)):
        return False
    weight, bias = _concat_rows((q, k, v))
    seated = _seated((q, k, v), weight)
    nq, nk = q.out_features, k.out_features
    kept: list = [None, None]  # the x of the last fused q_proj call and its product
    q_orig, k_orig, v_orig = q.forward, k.forward, v.forward

    def q_forward(x):
        if not (_active(x) and seated()):
            return q_orig(x)
        kept[0], kept[1] = x, F.linear(x, weight, bias)
        return kept[1][..., :nq]

    def k_forward(x):
        if kept[0] is x:
            return kept[1][..., nq:nq + nk]
        return k_orig(x)

    def v_forward(x):
        if kept[0] is x:
            out = kept[1][..., nq + nk:]
            kept[0] = kept[1] = None
            return out
        return v_orig(x)

    q.forward, k.forward, v.forward = q_forward, k_forward, v_forward
    return True


def fuse_mlp(mlp) -> bool:
    """Wrap ``mlp``'s forward: ``down(act(gate(x)) * up(x))`` with gate and up as one product."""
    gate, up = mlp.gate_proj, mlp.up_proj
    if not _fusable((gate, up)):
        return False
    weight, bias = _concat_rows((gate, up))
    seated = _seated((gate, up), weight)
    n = gate.out_features
    orig = mlp.forward
    silu = type(mlp.act_fn).__name__ in _SILUS

    def forward(x):
        if not (_active(x) and seated()):
            return orig(x)
        both = F.linear(x, weight, bias)
        if silu:
            return mlp.down_proj(fused.silu_mul(both, n))
        return mlp.down_proj(mlp.act_fn(both[..., :n]) * both[..., n:])

    mlp.forward = forward
    return True


def install(model) -> int:
    """Fuse the projections of every attention and MLP module of the known architectures; returns
    how many modules were fused (0 for a float32 model)."""
    count = 0
    for mod in model.modules():
        name = type(mod).__name__
        if name in _ATTENTIONS:
            count += fuse_attention(mod)
        elif name in _MLPS:
            count += fuse_mlp(mod)
    return count
