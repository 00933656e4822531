"""Layering and shared constants: the client stays thin, and the special values agree everywhere."""

import subprocess
import sys

import kvd.api as api
import kvd_kernels


def test_client_import_pulls_in_no_manager_no_triton_no_torch():
    code = (
        "import sys, kvd_client\n"
        "bad = [m for m in ('kvd.manager', 'kvd.pool', 'kvd.server', 'triton', 'torch') if m in sys.modules]\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_special_values_agree_between_core_and_kernels():
    assert kvd_kernels.PAD_SLOT_ID == api.PAD_SLOT_ID == -1
    assert kvd_kernels.NULL_BLOCK == api.NULL_BLOCK == 0
