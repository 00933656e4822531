"""Fused Triton kernels for the engine's forward on CUDA: Hugging Face's RMSNorm and rotary
embedding, each one kernel instead of the ~8 and ~10 small ones HF's eager code launches; and the
token embedding as a plain gather.

A 16-token step of the benchmark's 8-layer model launched ~378 kernels, ~47 a layer; most of its GPU
time was those tiny elementwise kernels, not the matrix products (measured on an H200: 1.10 ms of
kernel time, ~0.54 ms of it elementwise and reductions). That is the time to first token of a
prefix hit, whose forward is a few suffix tokens.

In half precision ``install`` also makes each layer's q/k/v projections one matrix product, its
MLP's gate/up another and ``silu(gate) * up`` one kernel (``projections.py``, :func:`silu_mul`): with
the paged attention's zero fill gone too, the 16-token hit step's graph 0.640 -> 0.517 ms (H200).

``install(model)`` wraps every RMSNorm module and plain token embedding of the model and the
``apply_rotary_pos_emb`` of the Llama, Qwen2 and Mistral modeling modules (other architectures keep
HF's code); the fused path runs only while the engine's paged forward runs (``ACTIVE``, set by
``model.use_paged``) on CUDA tensors, so HF's own ``generate`` (the reference) keeps HF's code.
Each kernel has a torch reference that is HF's formula:

- ``rope``: exactly HF's ``q * cos + rotate_half(q) * sin`` (each product and the sum rounded to the
  tensor's dtype, as torch's separate kernels round them; no FMA contraction): bit-identical to the
  reference in every dtype. Its outputs are laid out ``[T, H, D]`` (returned as HF's ``[1, H, T,
  D]`` view), so the paged attention's ``transpose(0, 1).contiguous()`` copies nothing.
- the token embedding (a plain ``torch.nn.Embedding`` without ``max_norm``): ``weight[ids]``, the
  same rows bit for bit. ``F.embedding`` of fewer than 64 ids takes torch's "small index"
  ``index_select`` kernel: 7 µs for 16 ids of a 32,000 x 2,048 table on an H200 (14 µs inside a
  prefix hit's graph) against 1.2 µs for the gather kernel that larger counts and ``weight[ids]``
  take.
- ``rms_norm``: HF's ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``, its sum of squares reduced
  in another order than torch's ``mean``: equal within a float32 rounding of the mean (the tests'
  bound: rtol 1e-6 in float32, one unit in the last place of bfloat16/float16).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - the engine's CPU path needs no Triton
    HAS_TRITON = False

#: True while a paged forward of a fused model runs (``model.use_paged``): the wrappers' switch.
ACTIVE = [False]


# ---- references (HF's formulas) -----------------------------------------------------------------

def rms_norm_ref(x, weight, eps: float):
    """HF's LlamaRMSNorm.forward."""
    dtype = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(q, k, cos, sin, unsqueeze_dim: int = 1):
    """HF's apply_rotary_pos_emb."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def silu_mul_ref(both, n: int):
    """HF's MLP activation of a fused gate/up product ``both [..., 2n]``: ``silu(gate) * up``."""
    return torch.nn.functional.silu(both[..., :n]) * both[..., n:]


# ---- kernels --------------------------------------------------------------------------------------

if HAS_TRITON:
    from triton.language.extra import libdevice

    @triton.jit
    def _silu_mul_kernel(x, out, sxt, N, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < N
        g = tl.load(x + t * sxt + cols, mask=m, other=0.0)
        u = tl.load(x + t * sxt + N + cols, mask=m, other=0.0)
        gf = g.to(tl.float32)
        # torch's CUDA silu: x / (1 + expf(-x)) in float (accurate expf, IEEE division), rounded to
        # the dtype; then the product of two dtype values in float, rounded (Triton's interpreter,
        # the CPU tests, has no libdevice: its exp there)
        e = libdevice.exp(-gf) if LIBDEVICE else tl.exp(-gf)
        s = tl.math.div_rn(gf, 1.0 + e).to(g.dtype)
        tl.store(out + t * N + cols, (s.to(tl.float32) * u.to(tl.float32)).to(out.dtype.element_ty), mask=m)

    @triton.jit
    def _rms_norm_kernel(x, w, out, sxt, sot, N, eps, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        xv = tl.load(x + t * sxt + cols, mask=m, other=0.0).to(tl.float32)
        var = tl.sum(xv * xv, axis=0) / N
        y = (xv * tl.math.rsqrt(var + eps)).to(x.dtype.element_ty)
        wv = tl.load(w + cols, mask=m, other=0.0)
        o = wv.to(tl.float32) * y.to(tl.float32)
        tl.store(out + t * sot + cols, o.to(out.dtype.element_ty), mask=m)

    @triton.jit
    def _rope_kernel(q, k, cos, sin, qo, ko, sqt, sqh, skt, skh, sct, sst, HQ, HK,
                     HALF: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BH + tl.arange(0, BH)[:, None]
        j = tl.arange(0, BD)[None, :]
        mj = j < HALF
        isq = (h < HQ) & mj
        hk = h - HQ
        isk = (h >= HQ) & (hk < HK) & mj
        dt = qo.dtype.element_ty
        qp = q + t * sqt + h * sqh + j
        kp = k + t * skt + hk * skh + j
        x1 = tl.where(isq, tl.load(qp, mask=isq, other=0.0), tl.load(kp, mask=isk, other=0.0)).to(tl.float32)
        x2 = tl.where(isq, tl.load(qp + HALF, mask=isq, other=0.0),
                      tl.load(kp + HALF, mask=isk, other=0.0)).to(tl.float32)
        c1 = tl.load(cos + t * sct + j, mask=mj, other=0.0).to(tl.float32)
        c2 = tl.load(cos + t * sct + HALF + j, mask=mj, other=0.0).to(tl.float32)
        s1 = tl.load(sin + t * sst + j, mask=mj, other=0.0).to(tl.float32)
        s2 = tl.load(sin + t * sst + HALF + j, mask=mj, other=0.0).to(tl.float32)
        # HF: q * cos + cat(-x2, x1) * sin, every product and the sum rounded to the dtype
        o1 = (x1 * c1).to(dt).to(tl.float32) + ((-x2) * s1).to(dt).to(tl.float32)
        o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        D = 2 * HALF
        tl.store(qo + t * (HQ * D) + h * D + j, o1.to(dt), mask=isq)
        tl.store(qo + t * (HQ * D) + h * D + HALF + j, o2.to(dt), mask=isq)
        tl.store(ko + t * (HK * D) + hk * D + j, o1.to(dt), mask=isk)
        tl.store(ko + t * (HK * D) + hk * D + HALF + j, o2.to(dt), mask=isk)


def rms_norm(x, weight, eps: float):
    """The fused RMSNorm of ``x [..., N]`` (last dim contiguous); output dtype as HF's."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), n, float(eps),
                                         BLOCK=block, num_warps=8 if block >= 4096 else 4,
                                         enable_fp_fusion=False)
    return out.view(x.shape)


def silu_mul(both, n: int):
    """:func:`silu_mul_ref` in one kernel: ``both [..., 2n]`` with rows of stride ``2n``."""
    rows = both.reshape(-1, 2 * n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(both.shape[:-1] + (n,), dtype=both.dtype, device=both.device)
    if rows.shape[0]:
        block = min(triton.next_power_of_2(n), 1024)
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](rows, out, rows.stride(0), n, BLOCK=block,
                                                                 LIBDEVICE=both.is_cuda, num_warps=4,
                                                                 enable_fp_fusion=False)
    return out


def rope(q, k, cos, sin):
    """HF's rotary embedding of ``q [1, HQ, T, D]`` and ``k [1, HK, T, D]`` (any strides with a
    contiguous head dim) with ``cos``/``sin [1, T, D]``; returns HF's shapes, stored ``[T, H, D]``."""
    _, hq, t, d = q.shape
    hk = k.shape[1]
    qo = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    ko = torch.empty(t, hk, d, dtype=k.dtype, device=k.device)
    if t:
        bh = min(triton.next_power_of_2(hq + hk), max(1, 4096 // d))
        grid = (t, triton.cdiv(hq + hk, bh))
        _rope_kernel[grid](q, k, cos, sin, qo, ko, q.stride(2), q.stride(1), k.stride(2), k.stride(1),
                           cos.stride(1), sin.stride(1), hq, hk, HALF=d // 2, BH=bh,
                           BD=triton.next_power_of_2(d // 2), num_warps=4, enable_fp_fusion=False)
    return qo.unsqueeze(0).transpose(1, 2), ko.unsqueeze(0).transpose(1, 2)


def _rope_fits(q, k, cos, sin) -> bool:
    """Whether the kernel takes these (HF's default unsqueeze_dim=1 is the caller's to check)."""
    return (q.is_cuda and q.dim() == 4 and q.shape[0] == 1 and k.shape[0] == 1
            and q.shape[2:] == k.shape[2:] and q.shape[-1] % 2 == 0 and q.stride(-1) == 1 and k.stride(-1) == 1
            and cos.shape == sin.shape == (1, q.shape[2], q.shape[3]) and cos.stride(-1) == 1 and sin.stride(-1) == 1
            and q.dtype == k.dtype == cos.dtype == sin.dtype)


# ---- installing ---------------------------------------------------------------------------------

# the architectures whose RMSNorm and apply_rotary_pos_emb are the formulas above (their sources are
# the same in transformers 5.17-5.20); another model keeps HF's code
_ARCHS = ("llama", "qwen2", "mistral")
_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")


def _fused_rope(orig):
    """``apply_rotary_pos_emb`` that takes the kernel where it fits (else, or with any other
    argument, HF's ``orig``)."""
    def apply(q, k, cos, sin, *args, **kwargs):
        if ACTIVE[0] and not kwargs and args in ((), (1,)) and _rope_fits(q, k, cos, sin):
            return rope(q, k, cos, sin)
        return orig(q, k, cos, sin, *args, **kwargs)

    apply._kvd_fused = True
    return apply


def _patch_rope() -> None:
    import importlib

    for arch in _ARCHS:
        mod = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
        orig = mod.apply_rotary_pos_emb
        if getattr(orig, "_kvd_fused", False):
            continue
        mod.apply_rotary_pos_emb = _fused_rope(orig)


def _gather_embedding(mod) -> None:
    """``mod`` (an ``nn.Embedding``) gathers its rows by indexing during paged CUDA forwards."""
    orig = mod.forward

    def forward(ids, _orig=orig, _mod=mod):
        if ACTIVE[0] and ids.is_cuda:
            return _mod.weight[ids]
        return _orig(ids)

    mod.forward = forward


def install(model, on: bool = True) -> bool:
    """Fuse ``model``'s RMSNorms and rotary embedding, gather its token embedding and, in half
    precision, fuse its q/k/v and gate/up projections (``projections.py``) for its paged forwards
    (the wrappers are installed once; ``on=False`` turns them off for the model's later forwards).
    Returns whether the model's paged forwards are fused: False without Triton."""
    if not HAS_TRITON:
        return False
    model._kvd_fused = on
    if getattr(model, "_kvd_fuse_installed", False):
        return on
    _patch_rope()
    for mod in model.modules():
        if type(mod).__name__ in _NORMS:
            orig = mod.forward

            def forward(x, _orig=orig, _mod=mod):
                if ACTIVE[0] and x.is_cuda:
                    return rms_norm(x, _mod.weight, _mod.variance_epsilon)
                return _orig(x)

            mod.forward = forward
        elif type(mod) is torch.nn.Embedding and mod.max_norm is None:
            _gather_embedding(mod)
    from .projections import install as fuse_projections  # it reads ACTIVE from here

    model._kvd_fused_projections = fuse_projections(model)
    model._kvd_fuse_installed = True
    return on
