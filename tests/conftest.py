"""Root test configuration.

Without a GPU, Triton kernels run in its interpreter: TRITON_INTERPRET must be set before anything
imports triton, so it is set here, before any test module is collected. A machine with NVIDIA
device nodes keeps the real backend (scripts/gpu_check.sh runs the cuda-marked tests there).
"""

import os

if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionfinish(session, exitstatus):
    """The CUDA driver's file behind this process's interprocess events (in-process GPU pools of
    the cuda tests) outlives the process unless unlinked (kvd.gpu_session.remove_ipc_event_files)."""
    from kvd.gpu_session import remove_ipc_event_files

    remove_ipc_event_files()
