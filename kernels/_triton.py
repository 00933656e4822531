"""Optional imports of Triton and torch.

kvd_kernels must import with numpy alone: the daemon runs the numpy references when its pool lives
on the CPU, on machines that may have neither torch nor Triton. Every module that defines a kernel
does it under ``if HAS_TRITON:`` and every torch wrapper calls :func:`require_triton` first.
"""

from __future__ import annotations

try:
    import torch
except ImportError:  # numpy-only install
    torch = None

try:
    import triton
    import triton.language as tl
except ImportError:  # numpy-only install, or a platform Triton has no wheel for
    triton = None
    tl = None

HAS_TORCH = torch is not None
HAS_TRITON = triton is not None and HAS_TORCH

#: Groups whose tables one launch can address. Tables are passed as separate pointer arguments (not
#: a device array of addresses) so the same kernel runs under TRITON_INTERPRET=1 on the CPU; the
#: wrappers split larger group counts into several launches.
MAX_GROUPS_PER_LAUNCH = 4


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("kvd_kernels: this wrapper needs torch and triton; use the *_ref numpy "
                           "function instead")


def group_args(tables, extra=()):
    """Pad per-group tensors to MAX_GROUPS_PER_LAUNCH pointer/stride pairs (None, 0 when absent)."""
    args = []
    for g in range(MAX_GROUPS_PER_LAUNCH):
        if g < len(tables):
            args += [tables[g], tables[g].stride(0)]
        else:
            args += [None, 0]
    return args
