"""kvd's "vllm_sha256" scheme against vLLM 0.33.0's own block hasher (skipped without vLLM)."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.errors import BadHashes
from kvd.hashing import VLLM_SCHEME, as_hash_array, hash_dtype, hash_prompt, hash_width, vllm_none_hash

kcu = pytest.importorskip("vllm.v1.core.kv_cache_utils")
from vllm.utils.hashing import sha256 as vllm_sha256  # noqa: E402


class _Pos:
    def __init__(self, offset, length):
        self.offset, self.length = offset, length


class _Feature:
    def __init__(self, identifier, offset, length):
        self.identifier, self.mm_position = identifier, _Pos(offset, length)


class _Lora:
    def __init__(self, name, path):
        self.lora_name, self.lora_path = name, path


class _Request:
    """The attributes vLLM's generate_block_hash_extra_keys reads."""

    def __init__(self, lora=None, mm=(), salt=None):
        self.lora_request = _Lora(*lora) if lora else None
        self.mm_features = [_Feature(*m) for m in mm]
        self.cache_salt = salt
        self.prompt_embeds = None


def vllm_hashes(tokens, block_size, req, seed="vllm-none-hash", monkeypatch=None):
    """vLLM's chain, block by block, with its own extra-key and hash functions."""
    monkeypatch.setattr(kcu, "NONE_HASH", kcu.BlockHash(vllm_sha256(seed)), raising=False)
    parent, mm_idx, out = None, 0, []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra, mm_idx = kcu.generate_block_hash_extra_keys(req, start, start + block_size, mm_idx)
        parent = kcu.hash_block_tokens(vllm_sha256, parent, tokens[start : start + block_size], extra)
        out.append(parent)
    return out


def test_none_hash_is_vllms_default_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kcu.init_none_hash(vllm_sha256)
    assert vllm_none_hash() == kcu.NONE_HASH and len(kcu.NONE_HASH) == 32


def test_width_is_a_property_of_the_scheme():
    assert hash_width(VLLM_SCHEME) == 32 and hash_width("sha256") == 16 and hash_width("xxh3_128") == 16
    assert hash_dtype(VLLM_SCHEME) == np.dtype("S32")
    with pytest.raises(BadHashes):
        as_hash_array([b"x" * 16], 32)
    assert as_hash_array([b"x" * 32], 32).dtype == np.dtype("S32")


@pytest.mark.parametrize("seed", range(40))
def test_random_prompts_and_extra_keys_are_bit_identical(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([1, 4, 16, 32]))
    n = int(rng.integers(0, 8 * bs + bs))
    tokens = rng.integers(0, 200_000, n).tolist()
    lora = (f"adapter{seed}", f"/models/lora{seed}") if rng.random() < 0.5 else None
    salt = f"salt{seed}" if rng.random() < 0.5 else None
    mm, pos = [], int(rng.integers(0, bs + 1))
    while rng.random() < 0.6 and pos < n:  # sorted by offset, as vLLM assumes; some span blocks
        length = int(rng.integers(1, 2 * bs + 2))
        mm.append((f"img{len(mm)}-{seed}", pos, length))
        pos += length + int(rng.integers(0, bs))
    hash_seed = "vllm-none-hash" if seed % 4 else str(seed)  # a PYTHONHASHSEED-style seed too
    want = vllm_hashes(tokens, bs, _Request(lora, mm, salt), hash_seed, monkeypatch)
    got = hash_prompt(np.array(tokens, np.int64), bs, algo=VLLM_SCHEME, lora_name=lora and lora[0],
                      lora_path=lora[1] if lora else "", mm_items=mm, cache_salt=salt, seed=hash_seed)
    assert got.dtype == np.dtype("S32") and got.shape == (n // bs,)
    assert [bytes(h).ljust(32, b"\0") for h in got] == want


def test_continuing_a_chain_equals_hashing_the_whole_prompt(monkeypatch):
    tokens = list(range(1000, 1070))
    req = _Request(("a", "/p"), [("img", 20, 30)], "s")
    want = vllm_hashes(tokens, 16, req, monkeypatch=monkeypatch)
    kw = dict(algo=VLLM_SCHEME, lora_name="a", lora_path="/p", mm_items=[("img", 20, 30)], cache_salt="s")
    head = hash_prompt(tokens[:32], 16, **kw)
    tail = hash_prompt(tokens[32:64], 16, parent=head[-1], first_block_index=2, **kw)
    assert [bytes(h).ljust(32, b"\0") for h in [*head, *tail]] == want[:4]
