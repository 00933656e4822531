"""Chained sha256 block hashes in one compiled loop: OpenSSL's libcrypto called from numba.

``kvd.hashing``'s default scheme hashes a prompt block by block, each block's parent the previous
block's hash, so the work is a loop of small digests (80 bytes each at block size 16). From Python
that loop costs ~0.4 µs a block on the 2-core box and ~2 µs on the device hosts, where it was most
of an engine's planning time before a 1,024-token prefix hit. Here the same loop is native: the
digest itself is OpenSSL's (the same library ``hashlib`` uses, so the same bytes), the loop and the
byte shuffling around it numba's, and the GIL is released while it runs.

``AVAILABLE`` is False without numba (the optional extra ``kvd[fast]``), where no libcrypto
exporting the low-level ``SHA256_Init/Update/Final`` can be found, under ``NUMBA_DISABLE_JIT=1`` or
with ``KVD_NATIVE_HASH=0``; ``kvd.hashing`` then runs its Python loop (same results:
``tests/test_sha256loop.py``). The first call loads (or compiles) the loops: ``warm_up``. The library
is the one this process has already mapped for ``hashlib`` when there is one (Linux), else the
system's ``libcrypto``. Its symbols are bound by name (numba external functions), so the compiled
loops are cached on disk like ``kvd.rowloops``'.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import numpy as np

DIGEST_BYTES = 32
_CTX_BYTES = 256  # sizeof(SHA256_CTX) is 112 in OpenSSL 1.1 and 3.x; room to spare


def _mapped_libcrypto() -> str | None:
    """The libcrypto this process loaded for ``hashlib`` (Linux), so that no second copy loads."""
    try:
        import _hashlib  # noqa: F401  (maps OpenSSL when hashlib links it dynamically)
    except ImportError:  # a Python built without OpenSSL
        return None
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "/libcrypto" in path and os.path.exists(path):
                    return path
    except OSError:
        pass
    return None


def _load() -> bool:
    if os.environ.get("KVD_NATIVE_HASH", "1") == "0":
        return False
    try:
        import llvmlite.binding as llvm
        from numba import config
    except ImportError:
        return False
    if config.DISABLE_JIT:  # (the external functions can only be called from compiled code)
        return False
    path = _mapped_libcrypto() or ctypes.util.find_library("crypto")
    if path is None:
        return False
    try:
        lib = ctypes.CDLL(path)
        if not all(hasattr(lib, name) for name in ("SHA256_Init", "SHA256_Update", "SHA256_Final")):
            return False
        llvm.load_library_permanently(path)
    except (OSError, RuntimeError):
        return False
    return True


AVAILABLE = _load()
"""True when the compiled loops below can run (else ``kvd.hashing`` keeps its Python loop)."""

if AVAILABLE:
    from numba import njit, types

    _init = types.ExternalFunction("SHA256_Init", types.int32(types.voidptr))
    _update = types.ExternalFunction("SHA256_Update", types.int32(types.voidptr, types.voidptr, types.uintp))
    _final = types.ExternalFunction("SHA256_Final", types.int32(types.voidptr, types.voidptr))

    @njit(cache=True, nogil=True, boundscheck=False)
    def _digest(ctx, msg, md):
        _init(ctx.ctypes.data)
        _update(ctx.ctypes.data, msg.ctypes.data, msg.size)
        _final(md.ctypes.data, ctx.ctypes.data)

    @njit(cache=True, nogil=True, boundscheck=False)
    def chain(blocks, parent, out):
        """``out[i]`` = the first ``out.shape[1]`` bytes of sha256(``out[i - 1]`` + ``blocks[i]``),
        ``parent`` standing in for ``out[-1]``. ``blocks``: (n, block bytes) uint8, C order."""
        width = out.shape[1]
        ctx = np.empty(_CTX_BYTES, np.uint8)
        md = np.empty(DIGEST_BYTES, np.uint8)
        msg = np.empty(width + blocks.shape[1], np.uint8)
        msg[:width] = parent
        for i in range(blocks.shape[0]):
            msg[width:] = blocks[i]
            _digest(ctx, msg, md)
            out[i] = md[:width]
            msg[:width] = md[:width]

    @njit(cache=True, nogil=True, boundscheck=False)
    def each(blocks, parents, out):
        """``out[i]`` = the first ``out.shape[1]`` bytes of sha256(``parents[i]`` + ``blocks[i]``)."""
        width = out.shape[1]
        ctx = np.empty(_CTX_BYTES, np.uint8)
        md = np.empty(DIGEST_BYTES, np.uint8)
        msg = np.empty(width + blocks.shape[1], np.uint8)
        for i in range(blocks.shape[0]):
            msg[:width] = parents[i]
            msg[width:] = blocks[i]
            _digest(ctx, msg, md)
            out[i] = md[:width]


WARM = False
"""Whether ``warm_up`` ran: ``kvd.hashing``'s first compiled call runs it, so that a process's
first call of either loop loads both (a client's first decode-step hashes, after its prompts'
hashes, would otherwise pay ~5 ms to load ``each`` in the middle of its steps)."""


def warm_up() -> None:
    """Load both loops now (from numba's disk cache, or compile them: ~0.2 s or ~2 s) rather than
    on a request's first hash. Later calls do nothing."""
    global WARM
    if WARM:
        return
    WARM = True
    if AVAILABLE:
        one = np.zeros((1, 4), np.uint8)
        chain(one, np.zeros(16, np.uint8), np.empty((1, 16), np.uint8))
        each(one, np.zeros((1, 16), np.uint8), np.empty((1, 16), np.uint8))
