"""The compiled sha256 chain (kvd.sha256loop) against hashlib, byte for byte, and the Python
fallback kvd.hashing runs without it."""

import hashlib
import subprocess
import sys

import numpy as np
import pytest

from kvd import sha256loop
from kvd.hashing import HASH_DTYPE, ROOT_SEED, hash_next_blocks, hash_prompt

native = pytest.mark.skipif(not sha256loop.AVAILABLE, reason="no numba or no libcrypto with SHA256_Init")


def sha16(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:16]


def chain_by_hashlib(tokens: np.ndarray, block_size: int, parent: bytes) -> bytes:
    out, h = [], parent
    for i in range(tokens.size // block_size):
        h = sha16(h + tokens[i * block_size : (i + 1) * block_size].astype("<i4").tobytes())
        out.append(h)
    return b"".join(out)


@pytest.fixture(params=["native", "python"])
def loop(request, monkeypatch):
    if request.param == "native" and not sha256loop.AVAILABLE:
        pytest.skip("no compiled loop here")
    monkeypatch.setattr(sha256loop, "AVAILABLE", request.param == "native")
    return request.param


@pytest.mark.parametrize("block_size", [1, 3, 16, 32])
@pytest.mark.parametrize("length", [0, 5, 16, 1040])
def test_hash_prompt_equals_hashlib_by_either_loop(loop, block_size, length):
    rng = np.random.default_rng(block_size * 10_000 + length)
    tokens = rng.integers(-(2**31), 2**31, length).astype(np.int32)
    got = hash_prompt(tokens, block_size)
    assert got.dtype == HASH_DTYPE and got.shape == (length // block_size,)
    assert got.tobytes() == chain_by_hashlib(tokens, block_size, sha16(ROOT_SEED))


def test_a_parent_with_trailing_zero_bytes_and_int64_input_by_either_loop(loop):
    tokens = np.arange(48, dtype=np.int64)  # converted to int32 before hashing
    parent = b"\x07" + bytes(15)
    got = hash_prompt(tokens, 16, parent=np.array([parent], HASH_DTYPE)[0], first_block_index=3)
    assert got.tobytes() == chain_by_hashlib(tokens, 16, parent)
    # an item whose hash ends in zero bytes reads back the same 16 bytes from the returned array
    assert [bytes(h).ljust(16, b"\0") for h in got] == [got.tobytes()[i * 16 : (i + 1) * 16] for i in range(3)]


def test_hash_next_blocks_equals_hashlib_by_either_loop(loop):
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 50_000, (300, 16)).astype(np.int32)
    parents = np.array([sha16(bytes([i % 7])) if i % 3 else bytes([i % 5 + 1]) + bytes(15) for i in range(300)])
    got = hash_next_blocks(blocks, parents.astype(HASH_DTYPE))
    want = b"".join(sha16(parents[i].ljust(16, b"\0") + blocks[i].astype("<i4").tobytes()) for i in range(300))
    assert got.dtype == HASH_DTYPE and got.shape == (300,) and got.tobytes() == want


def test_hash_next_blocks_of_no_blocks(loop):
    got = hash_next_blocks(np.zeros((0, 16), np.int32), np.zeros(0, HASH_DTYPE))
    assert got.dtype == HASH_DTYPE and got.shape == (0,)


@native
def test_the_compiled_chain_writes_only_its_rows_and_keeps_its_inputs():
    blocks = np.arange(4 * 64, dtype=np.uint8).reshape(4, 64)
    parent = np.frombuffer(sha16(b"p"), np.uint8).copy()
    before = blocks.copy(), parent.copy()
    out = np.full((6, 16), 0xAB, np.uint8)
    sha256loop.chain(blocks, parent, out[1:5])
    assert (out[0] == 0xAB).all() and (out[5] == 0xAB).all()
    assert out[1:5].tobytes() == chain_by_hashlib(blocks.view("<i4").ravel(), 16, parent.tobytes())
    assert np.array_equal(blocks, before[0]) and np.array_equal(parent, before[1])


def test_kvd_native_hash_0_turns_the_compiled_loop_off(monkeypatch):
    monkeypatch.setenv("KVD_NATIVE_HASH", "0")
    assert sha256loop._load() is False


@native
def test_a_process_first_hash_loads_both_loops():
    """A client's first decode-step hashes must not load the one-each loop in the middle of its
    steps (~5 ms): the first compiled hash of a process loads both."""
    code = ("import numpy as np\nfrom kvd import sha256loop\nfrom kvd.hashing import hash_prompt\n"
            "assert not sha256loop.chain.signatures and not sha256loop.each.signatures\n"
            "hash_prompt(np.arange(64, dtype=np.int32), 16)\n"
            "print(len(sha256loop.chain.signatures), len(sha256loop.each.signatures))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1"]
