"""Runs every kernel test on the CPU through Triton's interpreter and, where CUDA exists, on the GPU.

TRITON_INTERPRET must be set before triton.jit decorates anything, i.e. before kvd_kernels is first
imported; this conftest is loaded before the test modules of this folder, so it sets it here when
the machine has no GPU (CI). On a GPU machine the kernels compile for the GPU and the CPU variants
skip; run them there with TRITON_INTERPRET=1 in a separate process.
"""

import os

import pytest

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:
    torch = None
    HAS_CUDA = False

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _kernels_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    from kvd_kernels.slots import _slot_mapping_kernel
    return isinstance(_slot_mapping_kernel, InterpretedFunction)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    """Device the torch wrappers run on: 'cpu' (interpreter) or 'cuda'."""
    from kvd_kernels import HAS_TRITON
    if not HAS_TRITON:
        pytest.skip("needs torch and triton")
    if request.param == "cuda":
        if not HAS_CUDA:
            pytest.skip("needs CUDA")
    elif not _kernels_interpreted():
        if HAS_CUDA:
            pytest.skip("CPU runs need TRITON_INTERPRET=1 in the environment on a GPU machine")
        pytest.fail("kvd_kernels was imported before tests/kernels/conftest.py set "
                    "TRITON_INTERPRET=1; set it in the environment or in the root conftest")
    return request.param
