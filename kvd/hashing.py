"""Chained block hashes for the prefix cache (computed by clients; the daemon only looks them up).

A full block's hash is ``H(parent, tokens, extras)`` truncated to ``HASH_BYTES``:

    parent   16 bytes: the previous block's hash, or ``root_hash(algo)`` for the first block
    tokens   the block's token ids as little-endian int32 (exactly block_size * 4 bytes)
    extras   tagged fields, each ``tag (1 byte) + length (uint32 LE) + bytes``:
               b"L" LoRA name (every block of the request)
               b"M" multimodal item id + its offset as int64 LE (each item overlapping the block)
               b"S" cache salt (the prompt's first block only)

Parent and tokens have fixed widths, so the byte string is unambiguous. ``H`` is sha256 (default:
every process computes the same value, and it resists deliberate collisions) or xxh3_128 (faster,
not cryptographic). Only full blocks are hashed: a partial block is never cached.

Scheme "vllm_sha256" is instead bit-identical to vLLM 0.33.0's default prefix-cache hashing
(``prefix_caching_hash_algo="sha256"``, vllm.v1.core.kv_cache_utils.hash_block_tokens): a block's hash
is the full 32-byte ``sha256(pickle.dumps((parent, tuple(token_ids), extra_keys), protocol=5))``
where the first block's parent is vLLM's NONE_HASH, ``sha256(pickle.dumps(seed, protocol=5))`` with
seed "vllm-none-hash" (vLLM's default for sha256; a vLLM started with PYTHONHASHSEED uses that value
instead: pass the same string as ``seed``). ``extra_keys`` is None or a tuple, in this order, of
``("lora", lora_name, lora_path)`` (every block), ``("mm", identifier, offset - block_start)`` (each
multimodal item overlapping the block; the offset is relative to the block and may be negative) and
``("cache_salt", salt)`` (the prompt's first block). A router that computes vLLM's hashes from token
ids therefore matches the hashes in kvd's KV events. Prompt-embedding keys are not supported.

The hash width is a property of the scheme (``hash_width``): 16 bytes for "sha256" / "xxh3_128", 32
for "vllm_sha256". A daemon serves one scheme, chosen at start (``hash_algo``), and its hello reply
says which; its pool and messages then carry ``S{width}`` arrays (``hash_dtype``).

Hashes travel and are stored as numpy ``S16`` arrays (``HASH_DTYPE``, the default width). numpy strips trailing zero
bytes from ``S16`` items; that mapping is injective on 16-byte values, so the stripped ``bytes`` of an
item is a valid dictionary key. Pass a parent to ``hash_prompt`` as any form: it is re-padded.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Sequence

import numpy as np

from kvd import sha256loop
from kvd.api import int_array
from kvd.errors import BadHashes, InvalidArgument

HASH_BYTES = 16
HASH_DTYPE = np.dtype(f"S{HASH_BYTES}")
ROOT_SEED = b"kvd-block-hash-v1"
VLLM_SCHEME = "vllm_sha256"
ALGOS = ("sha256", "xxh3_128", VLLM_SCHEME)
VLLM_HASH_BYTES = 32
VLLM_NONE_HASH_SEED = "vllm-none-hash"  # vLLM's DEFAULT_NONE_HASH_SEED
_PICKLE_PROTOCOL = 5  # pickle.HIGHEST_PROTOCOL on the Pythons vLLM 0.33 supports, which it uses

try:  # OpenSSL's constructor, called directly: ~0.5 µs a block against ~0.8 µs via hashlib.sha256.
    from _hashlib import openssl_sha256 as _sha256
except ImportError:  # pragma: no cover - Python built without OpenSSL
    _sha256 = hashlib.sha256


def hash_width(algo: str) -> int:
    """Bytes of one block hash under scheme ``algo``."""
    if algo == VLLM_SCHEME:
        return VLLM_HASH_BYTES
    if algo in ALGOS:
        return HASH_BYTES
    raise InvalidArgument(f"unknown hash algorithm {algo!r}; expected one of {ALGOS}")


def hash_dtype(algo_or_width: str | int) -> np.dtype:
    """The numpy ``S`` dtype of a scheme's hashes (or of a width in bytes)."""
    width = algo_or_width if isinstance(algo_or_width, int) else hash_width(algo_or_width)
    return np.dtype(f"S{width}")


def vllm_none_hash(seed: str = VLLM_NONE_HASH_SEED) -> bytes:
    """vLLM's NONE_HASH for the sha256 scheme: the parent of every prompt's first block."""
    return _sha256(pickle.dumps(seed, protocol=_PICKLE_PROTOCOL)).digest()


def vllm_extra_keys(block_start: int, block_size: int, lora_name: str | None, lora_path: str,
                    mm_items: Sequence[tuple[str, int, int]], cache_salt: str | None) -> tuple | None:
    """vLLM's ``generate_block_hash_extra_keys`` for the block at ``block_start`` (absolute)."""
    keys: list[tuple] = [("lora", lora_name, lora_path)] if lora_name else []
    end = block_start + block_size
    for identifier, offset, length in mm_items:
        if offset < end and block_start < offset + length:
            keys.append(("mm", identifier, offset - block_start))
    if block_start == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def _hash_prompt_vllm(chunks: list[tuple[int, ...]], block_size: int, parent, first_block_index: int,
                      lora_name, lora_path: str, mm_items, cache_salt, seed: str) -> list[bytes]:
    if parent is None:
        h = vllm_none_hash(seed)
    else:
        h = bytes(parent)
        if len(h) > VLLM_HASH_BYTES:
            raise BadHashes(f"parent hash has {len(h)} bytes, more than {VLLM_HASH_BYTES}")
        h = h.ljust(VLLM_HASH_BYTES, b"\0")
    for item_id, offset, length in mm_items:
        if length <= 0 or offset < 0:
            raise InvalidArgument(f"multimodal item {item_id!r}: bad offset {offset} / length {length}")
    salt = cache_salt if first_block_index == 0 else None
    plain = not lora_name and not mm_items and not salt
    dumps, out = pickle.dumps, []
    for i, chunk in enumerate(chunks):
        extra = None if plain else vllm_extra_keys(
            (first_block_index + i) * block_size, block_size, lora_name, lora_path, mm_items, salt)
        h = _sha256(dumps((h, chunk, extra), protocol=_PICKLE_PROTOCOL)).digest()
        out.append(h)
    return out


def _digest_fn(algo: str):
    if algo == "sha256":
        return lambda data: _sha256(data).digest()[:HASH_BYTES]
    if algo == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128_digest
    raise InvalidArgument(f"unknown hash algorithm {algo!r}; expected one of {ALGOS}")


def root_hash(algo: str = "sha256") -> bytes:
    """The fixed parent of every prompt's first block."""
    return _digest_fn(algo)(ROOT_SEED)


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<I", len(payload)) + payload


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def normalize_parent(parent: bytes | np.bytes_ | None, algo: str = "sha256") -> bytes:
    if parent is None:
        return root_hash(algo)
    raw = bytes(parent)
    if len(raw) > HASH_BYTES:
        raise BadHashes(f"parent hash has {len(raw)} bytes, more than {HASH_BYTES}")
    return raw.ljust(HASH_BYTES, b"\0")


def _block_extras(
    num_blocks: int,
    block_size: int,
    first_block_index: int,
    lora_name: str | bytes | None,
    mm_items: Sequence[tuple[str | bytes, int, int]],
    cache_salt: str | bytes | None,
) -> list[bytes] | bytes:
    """Extra-key bytes per block, or one shared bytes value when every block gets the same."""
    common = _field(b"L", _as_bytes(lora_name)) if lora_name else b""
    if not mm_items and not (cache_salt and first_block_index == 0):
        return common
    extras = [common] * num_blocks
    for item_id, offset, length in mm_items:
        if length <= 0 or offset < 0:
            raise InvalidArgument(f"multimodal item {item_id!r}: bad offset {offset} / length {length}")
        payload = _field(b"M", _as_bytes(item_id) + struct.pack("<q", offset))
        first = max(offset // block_size - first_block_index, 0)
        last = min((offset + length - 1) // block_size - first_block_index, num_blocks - 1)
        for i in range(first, last + 1):
            extras[i] += payload
    if cache_salt and first_block_index == 0 and num_blocks:
        extras[0] += _field(b"S", _as_bytes(cache_salt))
    return extras


def _token_array(token_ids, what: str) -> np.ndarray:
    """Token ids as a C-contiguous little-endian int32 array; InvalidArgument for anything but
    integers in int32's range (a float is not truncated, an id past 2**31 is not wrapped: either
    would hash as another token)."""
    if type(token_ids) is np.ndarray and token_ids.dtype == np.int32:  # (the engines' arrays, as they are)
        return np.ascontiguousarray(token_ids, dtype="<i4")
    return np.ascontiguousarray(int_array(token_ids, np.int32, what), dtype="<i4")


def hash_prompt(
    token_ids,
    block_size: int,
    *,
    parent: bytes | None = None,
    algo: str = "sha256",
    lora_name: str | bytes | None = None,
    mm_items: Sequence[tuple[str | bytes, int, int]] = (),
    cache_salt: str | bytes | None = None,
    first_block_index: int = 0,
    lora_path: str = "",
    seed: str = VLLM_NONE_HASH_SEED,
) -> np.ndarray:
    """Hashes of every full block of ``token_ids`` as an ``S{hash_width(algo)}`` array.

    ``lora_path`` and ``seed`` only matter to the "vllm_sha256" scheme (vLLM hashes the LoRA
    adapter's path beside its name; ``seed`` is vLLM's NONE_HASH seed).

    ``first_block_index`` is the index of ``token_ids``' first block within the request (a nonzero
    value continues a chain from ``parent``: no salt, and multimodal offsets stay absolute).
    ``mm_items`` are ``(identifier, offset, length)`` in absolute token positions.
    """
    if not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool) or block_size <= 0:
        raise InvalidArgument(f"block_size must be a positive int, got {block_size!r}")
    tokens = _token_array(token_ids, "token_ids")
    if tokens.ndim != 1:
        raise InvalidArgument("token_ids must be one-dimensional")
    num_blocks = tokens.size // block_size
    if algo == VLLM_SCHEME:
        chunks = [tuple(c) for c in tokens[: num_blocks * block_size].reshape(num_blocks, block_size).tolist()]
        out = _hash_prompt_vllm(chunks, block_size, parent, first_block_index, lora_name, lora_path,
                                mm_items, cache_salt, seed)
        return np.frombuffer(b"".join(out), dtype=hash_dtype(VLLM_HASH_BYTES)).copy()
    extras = _block_extras(num_blocks, block_size, first_block_index, lora_name, mm_items, cache_salt)
    h = normalize_parent(parent, algo)
    if algo == "sha256" and extras == b"" and _compiled():  # the common case
        out = np.empty((num_blocks, HASH_BYTES), np.uint8)
        blocks = tokens[: num_blocks * block_size].view(np.uint8).reshape(num_blocks, block_size * 4)
        sha256loop.chain(_writable(blocks), np.frombuffer(h, np.uint8).copy(), out)
        return out.view(HASH_DTYPE).reshape(num_blocks)
    # One bytes object per block, cut in C (void items keep trailing zero bytes, unlike S items).
    chunks = tokens[: num_blocks * block_size].view(f"V{block_size * 4}").tolist()
    if algo == "sha256" and extras == b"":
        return _chain_py(chunks, h)
    out = []
    append = out.append
    digest = _digest_fn(algo)
    per_block = [extras] * num_blocks if isinstance(extras, bytes) else extras
    for chunk, extra in zip(chunks, per_block):
        h = digest(h + chunk + extra)
        append(h)
    return np.frombuffer(b"".join(out), dtype=HASH_DTYPE).copy()


def _compiled() -> bool:
    """Whether ``kvd.sha256loop``'s loops run here; a process's first use loads both of them."""
    if not sha256loop.AVAILABLE:
        return False
    if not sha256loop.WARM:
        sha256loop.warm_up()
    return True


def _writable(a: np.ndarray) -> np.ndarray:
    """``a``, or a copy where it is read-only: the compiled loops take one array type (a read-only
    array is another numba type, compiled again on its first use)."""
    return a if a.flags.writeable else a.copy()


def _chain_py(chunks: list[bytes], parent: bytes) -> np.ndarray:
    """The default scheme's chain without extras as a Python loop (``sha256loop.chain``'s fallback
    and reference), without a call per block in between."""
    out = []
    append = out.append
    h = parent
    for chunk in chunks:
        h = _sha256(h + chunk).digest()[:HASH_BYTES]
        append(h)
    return np.frombuffer(b"".join(out), dtype=HASH_DTYPE).copy()


def hash_next_blocks(token_blocks, parents, *, algo: str = "sha256") -> np.ndarray:
    """One full block each for many requests (a decode step's filled blocks), in one call.

    ``token_blocks``: ``(n, block_size)`` token ids, row i the block request i just filled;
    ``parents``: ``(n,)`` hashes (``S{hash_width(algo)}``), row i that request's previous block's
    hash. Equal to ``hash_prompt(token_blocks[i], block_size, parent=parents[i], algo=algo)`` for
    every i, for blocks past the first with no extra keys (LoRA, multimodal; use ``hash_prompt`` for
    those): one loop (compiled for "sha256" where ``sha256loop.AVAILABLE``), where ``hash_prompt``
    per request costs a call each."""
    tokens = _token_array(token_blocks, "token_blocks")
    if tokens.ndim != 2 or not tokens.shape[1]:
        raise InvalidArgument(f"token_blocks must be (n, block_size), got shape {tokens.shape}")
    n, block_size = tokens.shape
    width = hash_width(algo)
    dtype = hash_dtype(width)
    parent_arr = as_hash_array(parents, width)
    if parent_arr.shape != (n,):
        raise BadHashes(f"{parent_arr.shape[0]} parents for {n} blocks")
    if algo == "sha256" and _compiled():
        out = np.empty((n, width), np.uint8)
        parent_bytes = np.ascontiguousarray(parent_arr, dtype).view(np.uint8).reshape(n, width)
        sha256loop.each(_writable(tokens.view(np.uint8).reshape(n, block_size * 4)), _writable(parent_bytes), out)
        return out.view(dtype).reshape(n)
    # V items keep trailing zero bytes (S items drop them): each parent is exactly ``width`` bytes.
    parent_list = np.ascontiguousarray(parent_arr, dtype).view(f"V{width}").tolist()
    if algo == VLLM_SCHEME:
        dumps = pickle.dumps
        out = [_sha256(dumps((p, tuple(c), None), protocol=_PICKLE_PROTOCOL)).digest()
               for p, c in zip(parent_list, tokens.tolist())]
    else:
        chunks = tokens.view(f"V{block_size * 4}").reshape(n).tolist()
        if algo == "sha256":
            out = [_sha256(p + c).digest()[:HASH_BYTES] for p, c in zip(parent_list, chunks)]
        else:
            digest = _digest_fn(algo)
            out = [digest(p + c) for p, c in zip(parent_list, chunks)]
    return np.frombuffer(b"".join(out), dtype=dtype).copy()


def as_hash_array(hashes, width: int = HASH_BYTES) -> np.ndarray:
    """Validate and view client-given hashes as a 1-D ``S{width}`` array (no copy where possible)."""
    dtype = HASH_DTYPE if width == HASH_BYTES else hash_dtype(width)
    if isinstance(hashes, np.ndarray):
        if hashes.dtype == dtype and hashes.ndim == 1:
            return hashes
        if hashes.dtype == np.uint8 and hashes.ndim == 2 and hashes.shape[1] == width:
            return np.ascontiguousarray(hashes).view(dtype).reshape(-1)
        raise BadHashes(f"hash array must be 1-D {dtype} or (n, {width}) uint8, got {hashes.dtype} {hashes.shape}")
    items = list(hashes)
    for item in items:
        if not isinstance(item, (bytes, np.bytes_)) or len(item) > width or (
            isinstance(item, bytes) and len(item) != width
        ):
            raise BadHashes(f"each hash must be {width} bytes")
    return np.array(items, dtype=dtype)


def count_total(counts: np.ndarray) -> int:
    """The number of hashes per-request ``counts`` name, checked in one pass: a negative count
    makes the result equal to no real number of hashes (-1, or >= 2**31 for int32 counts, whose
    negatives read as >= 2**31 through a uint32 view; n uint32 values cannot overflow uint64).
    A numpy reduction of a decode step's 256 counts costs ~2 µs quiet and 5-20 µs in the daemon's
    cache state after a step: one instead of two."""
    if counts.dtype == np.int32:
        return int(counts.view(np.uint32).sum(dtype=np.uint64))
    if counts.size and int(counts.min()) < 0:
        return -1
    return int(counts.sum(dtype=np.int64))
