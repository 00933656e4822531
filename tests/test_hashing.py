import hashlib
import struct

import numpy as np
import pytest

from kvd.errors import BadHashes, InvalidArgument
from kvd.hashing import HASH_DTYPE, ROOT_SEED, as_hash_array, count_total, hash_next_blocks, hash_prompt, root_hash


def sha16(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:16]


def test_chain_matches_the_documented_byte_layout():
    tokens = np.arange(10, dtype=np.int32)
    hashes = hash_prompt(tokens, 4)
    assert hashes.dtype == HASH_DTYPE and hashes.shape == (2,)  # the 2 leftover tokens are no block
    root = sha16(ROOT_SEED)
    first = sha16(root + np.arange(4, dtype="<i4").tobytes())
    second = sha16(first + np.arange(4, 8, dtype="<i4").tobytes())
    assert hashes.tobytes() == first + second
    assert root_hash() == root


def test_extra_keys_lora_salt_and_multimodal():
    tokens = np.arange(8, dtype=np.int32)
    root = sha16(ROOT_SEED)
    lora = b"L" + struct.pack("<I", 2) + b"ab"
    salt = b"S" + struct.pack("<I", 1) + b"s"
    item = b"M" + struct.pack("<I", 11) + b"img" + struct.pack("<q", 5)
    got = hash_prompt(tokens, 4, lora_name="ab", cache_salt="s", mm_items=[("img", 5, 2)])
    b0 = sha16(root + tokens[:4].astype("<i4").tobytes() + lora + salt)
    b1 = sha16(b0 + tokens[4:].astype("<i4").tobytes() + lora + item)
    assert got.tobytes() == b0 + b1


def test_salt_only_changes_the_chain_from_the_first_block():
    tokens = np.arange(32, dtype=np.int32)
    plain, salted = hash_prompt(tokens, 16), hash_prompt(tokens, 16, cache_salt="tenant")
    assert not np.any(plain == salted)  # the salt reaches every block through the chain


def test_continuing_a_chain_equals_hashing_the_whole_prompt():
    tokens = np.random.default_rng(0).integers(0, 1000, 64).astype(np.int32)
    whole = hash_prompt(tokens, 16)
    head = hash_prompt(tokens[:32], 16)
    tail = hash_prompt(tokens[32:], 16, parent=head[-1], first_block_index=2)
    assert np.array_equal(np.concatenate([head, tail]), whole)


def test_parent_with_trailing_zero_bytes_is_repadded():
    tokens = np.arange(16, dtype=np.int32)
    parent = b"\x07" + bytes(15)
    a = hash_prompt(tokens, 16, parent=parent)
    b = hash_prompt(tokens, 16, parent=np.array([parent], HASH_DTYPE)[0])  # numpy strips the zeros
    assert np.array_equal(a, b)


def test_xxh3_is_selectable_and_differs_from_sha256():
    tokens = np.arange(32, dtype=np.int32)
    x = hash_prompt(tokens, 16, algo="xxh3_128")
    assert x.shape == (2,) and not np.any(x == hash_prompt(tokens, 16))
    with pytest.raises(InvalidArgument):
        hash_prompt(tokens, 16, algo="md5")


def test_as_hash_array_accepts_s16_and_uint8_rows_and_rejects_the_rest():
    raw = np.arange(32, dtype=np.uint8).reshape(2, 16)
    assert as_hash_array(raw).tobytes() == raw.tobytes()
    assert as_hash_array([bytes(16), b"\x01" * 16]).shape == (2,)
    with pytest.raises(BadHashes):
        as_hash_array(np.zeros((2, 8), np.uint8))
    with pytest.raises(BadHashes):
        as_hash_array([b"short"])


@pytest.mark.parametrize("algo", ["sha256", "xxh3_128", "vllm_sha256"])
def test_hash_next_blocks_equals_hash_prompt_per_request(algo):
    rng = np.random.default_rng(1)
    prompts = rng.integers(0, 50_000, (5, 48)).astype(np.int32)
    whole = [hash_prompt(p, 16, algo=algo) for p in prompts]
    parents = np.array([h[1] for h in whole])
    got = hash_next_blocks(prompts[:, 32:], parents, algo=algo)
    assert got.dtype == whole[0].dtype
    assert [bytes(h) for h in got] == [bytes(h[2]) for h in whole]


def test_hash_next_blocks_keeps_a_parents_trailing_zero_bytes():
    tokens = np.arange(16, dtype=np.int32)
    parent = b"\x07" + bytes(15)  # an S16 array stores it as b"\x07"
    got = hash_next_blocks(tokens[None, :], np.array([parent], HASH_DTYPE))
    assert got.tobytes() == sha16(parent + tokens.astype("<i4").tobytes())


def test_hash_next_blocks_rejects_misshapen_input():
    parents = np.array([b"a" * 16], HASH_DTYPE)
    with pytest.raises(InvalidArgument):
        hash_next_blocks(np.arange(16), parents)  # not (n, block_size)
    with pytest.raises(BadHashes):
        hash_next_blocks(np.zeros((2, 16), np.int32), parents)  # one parent for two blocks
    with pytest.raises(BadHashes):
        hash_next_blocks(np.zeros((1, 16), np.int32), np.array([b"a" * 32], "S32"))  # wrong width
    assert hash_next_blocks(np.zeros((0, 16), np.int32), parents[:0]).shape == (0,)


def test_count_total_is_the_sum_or_no_real_total_when_a_count_is_negative():
    assert count_total(np.array([1, 0, 2], np.int32)) == 3
    assert count_total(np.array([], np.int32)) == 0
    assert count_total(np.array([2, -1], np.int32)) == 2 + 2**32 - 1  # -1 read as uint32
    assert count_total(np.array([-(2**31)] * 3, np.int32)) == 3 * 2**31  # no wrap in uint64
    assert count_total(np.array([1, 0, 2], np.int64)) == 3
    assert count_total(np.array([2, -1], np.int64)) == -1
    assert count_total(np.array([2, -1], np.int16)) == -1


def test_token_ids_of_the_wrong_kind_are_refused_never_truncated_or_wrapped():
    # 1.5 would have hashed as token 1, and 2**32 + 7 (int64) as token 7
    ids = np.arange(32, dtype=np.int64)
    assert (hash_prompt(ids, 16) == hash_prompt(ids.astype(np.int32), 16)).all()  # int64 ids that fit are fine
    for bad in (ids + 0.5, ids + (1 << 32), [[1, 2]], "abc", [True] * 16, None):
        with pytest.raises(InvalidArgument):
            hash_prompt(bad, 16)
    with pytest.raises(InvalidArgument):
        hash_next_blocks(np.full((2, 16), 1.5), hash_prompt(ids, 16))
    for bs in (0, 1.5, "16", True):
        with pytest.raises(InvalidArgument):
            hash_prompt(ids, bs)
    assert (hash_prompt(ids, np.int64(16)) == hash_prompt(ids, 16)).all()
