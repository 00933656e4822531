"""The hash width is a property of the daemon's scheme: a 32-byte (vLLM scheme) manager end to end."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.api import GroupSpec, ManagerConfig
from kvd.errors import BadHashes
from kvd.hashing import VLLM_SCHEME, hash_prompt
from kvd.manager import BlockManager


def _manager(width: int) -> BlockManager:
    return BlockManager(ManagerConfig(num_gpu_blocks=16, groups=(GroupSpec(block_size=4),), max_model_len=64,
                                      hash_width=width, debug_checks=True))


def test_a_32_byte_manager_shares_prefixes_by_full_hash():
    m = _manager(32)
    tokens = np.arange(10)
    hs = hash_prompt(tokens, 4, algo=VLLM_SCHEME)
    assert hs.dtype == np.dtype("S32") and m.pool.block_hash.dtype == np.dtype("S32")
    a = m.allocate("a", 10, hs)
    b = m.allocate("b", 10, hs)
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 8
    assert m.block_table("a").tolist() == [1, 2, 3] and m.block_table("b").tolist() == [1, 2, 4]
    assert m.pool.ref_cnt[[1, 2, 3, 4]].tolist() == [2, 2, 1, 1]
    # two hashes equal in their first 16 bytes are different blocks
    x = np.array([b"\x01" * 16 + b"\x02" * 16, b"\x01" * 16 + b"\x03" * 16], "S32")
    m.allocate("x", 4, x[:1])
    assert m.allocate("y", 4, x[1:]).num_cached_tokens == 0


@pytest.mark.parametrize("width,wrong", [(32, "S16"), (16, "S32")])
def test_hashes_of_the_other_width_are_rejected_and_change_nothing(width, wrong):
    m = _manager(width)
    free = m.num_free_blocks
    with pytest.raises(BadHashes):
        m.allocate("a", 8, np.zeros(2, wrong))
    with pytest.raises(BadHashes):
        m.allocate("a", 8, [b"x" * (48 - width)] * 2)
    assert m.num_free_blocks == free and m.num_requests == 0
