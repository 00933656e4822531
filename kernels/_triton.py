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


class Relauncher:
    """Launch one compiled specialization of a kernel again, skipping Triton's per-call binder,
    specialization and cache lookup: for kernels with ~25 arguments that is most of a launch's host
    time (about 50 us against 13 us for an empty kernel, measured on an H100 host).

    Valid while every argument keeps its specialization: the same tensors (persistent buffers) and
    constexprs; a scalar that changes between calls must be ``do_not_specialize`` in the kernel.
    Under the interpreter, where a launch returns no compiled kernel, every call takes the normal
    path.
    """

    def __init__(self, kernel, grid, args: dict, options: dict | None = None, stream: int | None = None):
        """``stream``: the raw handle (``torch.cuda.Stream.cuda_stream``) of the one stream every
        call launches on, for a caller that never switches streams (the daemon): each call then
        skips Triton's lookup of the current device and stream (two torch calls a launch). None:
        each call launches on the stream current at the call, as a plain launch does."""
        import inspect
        self.kernel, self.grid, self.args = kernel, grid, dict(args)
        self.options = options or {}
        self.names = list(inspect.signature(getattr(kernel, "fn", kernel)).parameters)
        compiled = kernel[grid](**self.args, **self.options)  # compiles, and is the first launch
        # some Triton versions index grid[0..2] in the compiled kernel's runner
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        self.runner = compiled[grid3] if hasattr(compiled, "packed_metadata") else None
        self.stream_kw = {}
        if self.runner is not None and stream is not None and \
                "stream" in inspect.signature(self.runner).parameters:
            self.stream_kw = {"stream": stream}

    def __call__(self, **changes) -> None:
        self.args.update(changes)
        if self.runner is None:
            self.kernel[self.grid](**self.args, **self.options)
        else:
            self.runner(*[self.args[n] for n in self.names], **self.stream_kw)

    def launch_on(self, stream: int) -> None:
        """One launch on the raw stream handle ``stream`` (a CUDA graph capture's stream), whatever
        stream the plan was made for."""
        if self.runner is None or not self.stream_kw:
            raise RuntimeError("launch_on needs a compiled plan made with a stream")
        self.runner(*[self.args[n] for n in self.names], stream=stream)
