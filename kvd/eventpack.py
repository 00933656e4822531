"""Many BlockStored events encoded at once, byte for byte as ``kvd.events.encode_block_stored``
writes them one by one (msgspec's encoding of vLLM's struct), with a few numpy operations per field
instead of Python per event: a decode step stores one block for each of hundreds of requests, each
its own event (kvd.runs).

Every event is the concatenation of *columns*: constant byte strings (the map header and keys, the
fields after token_ids) and per-event variable parts (the hashes array, the parent, the token ids),
each given as one flat byte buffer holding every event's part in order plus each part's length. One
scatter per column assembles all events into one buffer.

msgpack integers take their shortest form (what msgspec and msgpack write for non-negative ints):
positive fixint below 128, then uint8 (0xcc), uint16 (0xcd), uint32 (0xce), uint64 (0xcf), big-endian.
Arrays: fixarray below 16 items, array16 (0xdc) below 65,536, else array32 (0xdd). Binary hashes:
bin8 (0xc4, length, bytes). nil is 0xc0.
"""

from __future__ import annotations

import numpy as np

NIL = 0xC0
FEW_EVENTS = 64  # up to this many events, ``join`` slices instead of scattering
_U8 = np.uint8
# Per int form (fixint, uint8, uint16, uint32, uint64): its marker byte and payload bytes.
_MARKERS = np.array([0, 0xCC, 0xCD, 0xCE, 0xCF], _U8)
_WIDTHS = np.array([0, 1, 2, 4, 8], np.int64)
_COLS = np.arange(9)


def ints(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """msgpack of non-negative integers (< 2**64; int32 ones, e.g. token ids, take a narrower
    path): (flat bytes, bytes per value)."""
    v = np.ascontiguousarray(values).reshape(-1)
    if v.size:
        form = _form(int(v.min()))
        if form == _form(int(v.max())):  # one form for all (e.g. 64-bit hashes): no gather
            return _uniform_ints(v, form)
    if v.dtype == np.int32:  # no uint64 form: 4 payload bytes at most
        form = (v >= 128).view(np.int8) + (v >= 256) + (v >= 1 << 16)
        src = np.empty((v.size, 5), _U8)
        src[:, 1:] = v.astype(">i4").view(_U8).reshape(-1, 4)
    else:
        v = v.astype(np.uint64, copy=False)
        form = (v >= 128).view(np.int8) + (v >= 256) + (v >= 1 << 16) + (v >= 1 << 32)
        src = np.empty((v.size, 9), _U8)
        src[:, 1:] = v.astype(">u8").view(_U8).reshape(-1, 8)
    cols = src.shape[1]
    width = _WIDTHS[form]
    src[:, 0] = np.where(form == 0, src[:, cols - 1], _MARKERS[form])  # a fixint is its own byte
    take = _COLS[:cols] >= cols - width[:, None]  # the marker, then the last ``width`` bytes
    take[:, 0] = True
    return np.compress(take.ravel(), src.ravel()), width + 1


def _form(value: int) -> int:
    return (value >= 128) + (value >= 256) + (value >= 1 << 16) + (value >= 1 << 32)


def _uniform_ints(v: np.ndarray, form: int) -> tuple[np.ndarray, np.ndarray]:
    width = int(_WIDTHS[form])
    if not width:
        return v.astype(_U8), np.ones(v.size, np.int64)
    out = np.empty((v.size, 1 + width), _U8)
    out[:, 0] = _MARKERS[form]
    out[:, 1:] = v.astype(">u8").view(_U8).reshape(-1, 8)[:, 8 - width :]
    return out.reshape(-1), np.full(v.size, 1 + width, np.int64)


def bins(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """msgpack bin8 of equal-width byte strings ([n, width] uint8, width < 256)."""
    n, width = raw.shape
    data = np.empty((n, width + 2), _U8)
    data[:, 0] = 0xC4
    data[:, 1] = width
    data[:, 2:] = raw
    return data.reshape(-1), np.full(n, width + 2, np.int64)


def array_headers(counts: np.ndarray) -> bytes | tuple[np.ndarray, np.ndarray]:
    """msgpack array headers for arrays of ``counts`` items (one bytes column when all are equal)."""
    c = np.asarray(counts, np.int64)
    if c.size and (c == c[0]).all():
        return _array_header(int(c[0]))
    n = c.size
    data = np.zeros((n, 5), _U8)
    lens = np.ones(n, np.int64)
    fix = c < 16
    data[fix, 0] = 0x90 | c[fix]
    mid = ~fix & (c < 1 << 16)
    data[mid, 0] = 0xDC
    data[mid, 1:3] = c[mid].astype(">u2").view(_U8).reshape(-1, 2)
    lens[mid] = 3
    big = c >= 1 << 16
    data[big, 0] = 0xDD
    data[big, 1:5] = c[big].astype(">u4").view(_U8).reshape(-1, 4)
    lens[big] = 5
    return _flatten(data, lens), lens


def _array_header(count: int) -> bytes:
    if count < 16:
        return bytes([0x90 | count])
    if count < 1 << 16:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


def optional(present: np.ndarray, part: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per event: ``part``'s bytes where ``present`` (``part`` holds only those events'), else nil."""
    flat, lens = part
    n = present.size
    if present.all():
        return flat, lens
    all_lens = np.ones(n, np.int64)
    all_lens[present] = lens
    out = np.full(int(all_lens.sum()), NIL, _U8)
    starts = np.cumsum(all_lens) - all_lens
    out[_segment_index(starts[present], lens)] = flat
    return out, all_lens


def grouped(part: tuple[np.ndarray, np.ndarray], counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Items' parts joined per event (``counts`` consecutive items each; the flat bytes stay)."""
    flat, lens = part
    cs = np.concatenate([[0], np.cumsum(lens)])
    ends = np.cumsum(counts)
    return flat, cs[ends] - cs[ends - counts]


def join(n: int, columns: list) -> bytes:
    """Events 0..n-1, each the concatenation of ``columns`` (bytes: the same for every event, or
    (flat bytes, lengths per event)), one after another. Runs of columns of one width per event
    are laid side by side in one matrix first, so only the columns whose widths vary are scattered.
    A few events are joined by slicing instead: a handful of slices each beats index arithmetic
    over every byte."""
    if n <= FEW_EVENTS:
        return _join_few(n, columns)
    pieces = []  # fixed-width runs as [n, w] matrices, and (flat, lens) columns, in order
    run: list = []
    for c in columns:
        if isinstance(c, bytes) or c[1].size and (c[1] == c[1][0]).all():
            run.append(c)
            continue
        if run:
            pieces.append(_side_by_side(n, run))
            run = []
        pieces.append(c)
    if run:
        pieces.append(_side_by_side(n, run))
    if len(pieces) == 1 and isinstance(pieces[0], np.ndarray):
        return pieces[0].tobytes()
    lens = [p[1] if isinstance(p, tuple) else np.full(n, p.shape[1], np.int64) for p in pieces]
    per_event = np.sum(lens, axis=0)
    out = np.empty(int(per_event.sum()), _U8)
    at = np.cumsum(per_event) - per_event  # where each event's next piece goes
    for p, ln in zip(pieces, lens):
        if not isinstance(p, tuple):
            out[at[:, None] + np.arange(p.shape[1])] = p
        elif p[0].size:
            out[_segment_index(at, ln)] = p[0]
        at += ln
    return out.tobytes()


def _join_few(n: int, columns: list) -> bytes:
    cuts = []
    for c in columns:
        if isinstance(c, bytes):
            cuts.append(c)
        else:
            ends = np.cumsum(c[1]).tolist()
            cuts.append((c[0].tobytes(), [0] + ends[:-1], ends))
    parts = []
    for i in range(n):
        for c in cuts:
            parts.append(c if isinstance(c, bytes) else c[0][c[1][i] : c[2][i]])
    return b"".join(parts)


def _side_by_side(n: int, columns: list) -> np.ndarray:
    """Fixed-width columns (constant bytes, or (flat, equal lengths)) as one [n, total] matrix."""
    widths = [len(c) if isinstance(c, bytes) else int(c[1][0]) if n else 0 for c in columns]
    out = np.empty((n, sum(widths)), _U8)
    at = 0
    for c, w in zip(columns, widths):
        if w:
            out[:, at : at + w] = np.frombuffer(c, _U8) if isinstance(c, bytes) else c[0].reshape(n, w)
        at += w
    return out


def _flatten(data: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The first ``lens[i]`` bytes of each row, concatenated."""
    return np.compress((np.arange(data.shape[1]) < lens[:, None]).ravel(), data.ravel())


def _segment_index(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Destination index of every byte of segments ``lens`` placed at ``starts``."""
    total = int(lens.sum())
    within = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(starts, lens) + within
