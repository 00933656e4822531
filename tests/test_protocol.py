"""Wire-format helpers: encoding, bounds and validation (no daemon)."""

import numpy as np
import orjson
import pytest

from kvd import protocol as P
from kvd.errors import BadHashes, ProtocolError


def test_request_roundtrip():
    raw = P.request(P.STEP, 3, 7, na=2)
    h = P.parse_header(raw)
    assert h == {"v": P.VERSION, "op": "step", "s": 3, "q": 7, "na": 2}


@pytest.mark.parametrize("raw", [b"", b"[]", b"{", b'{"v": 999}', b"x" * (P.MAX_HEADER_BYTES + 1),
                                 b'"str"', b"\xff\xfe"])
def test_bad_headers(raw):
    with pytest.raises(ProtocolError):
        P.parse_header(raw)


def test_get_int_bounds():
    h = {"a": 5, "b": True, "c": -1, "d": 1.5, "e": "5"}
    assert P.get_int(h, "a", None, 0, 10) == 5
    for k in "bcde":
        with pytest.raises(ProtocolError):
            P.get_int(h, k, None, 0, 10)
    with pytest.raises(ProtocolError):
        P.get_int(h, "a", None, 0, 4)
    with pytest.raises(ProtocolError):
        P.get_int(h, "missing")
    assert P.get_int(h, "missing", 3) == 3


def test_frame_array_checks():
    a = np.arange(4, dtype=np.int32)
    assert (P.frame_array(a.tobytes(), P.I32, 4) == a).all()
    with pytest.raises(ProtocolError):
        P.frame_array(a.tobytes()[:-1], P.I32)
    with pytest.raises(ProtocolError):
        P.frame_array(a.tobytes(), P.I32, 3)
    with pytest.raises(ProtocolError):
        P.frame_array(a.tobytes(), P.I32, max_n=3)
    assert not P.frame_array(a.tobytes(), P.I32).flags.writeable


def test_hashes_frame_and_split():
    hs = np.array([bytes([i + 1]) * 16 for i in range(5)], dtype=P.HASH_DTYPE)
    assert P.hashes_frame(hs) == hs.tobytes()
    assert P.hashes_frame([bytes(x) for x in hs]) == hs.tobytes()
    assert P.hashes_frame(()) == b""
    with pytest.raises(BadHashes):
        P.hashes_frame([b"short"])
    with pytest.raises(BadHashes):
        P.hashes_frame(np.zeros(3, np.int64))
    back = P.frame_hashes(hs.tobytes())
    parts = P.split_counts(back, np.array([2, 0, 3], np.int32))
    assert [len(p) for p in parts] == [2, 0, 3]
    with pytest.raises(ProtocolError):
        P.split_counts(back, np.array([2, 2], np.int32))
    with pytest.raises(ProtocolError):
        P.split_counts(back, np.array([6, -1], np.int32))


def test_replies():
    ok = orjson.loads(P.ok_reply(4, "ep", n=3))
    assert ok == {"v": 1, "q": 4, "e": "ep", "ok": 1, "n": 3}
    err = orjson.loads(P.error_reply(None, "ep", ProtocolError.code, "bad"))
    assert err["err"] == ProtocolError.code == 32 and err["q"] is None and "ok" not in err


def test_step_frame_count():
    assert P.step_frame_count(1) == 10
    assert P.step_frame_count(2) == 14


def test_within_checks_every_value_against_one_bound_or_one_per_column_at_any_size():
    assert P.within(np.array([0, 3, 5], np.int32), 0, 5) and not P.within(np.array([0, 6], np.int32), 0, 5)
    assert not P.within(np.array([2, -1], np.int32), 0, 5) and P.within(np.empty(0, np.int32), 0, 5)
    cols = np.array([[1, 7], [2, 9]], np.int64)
    assert P.within(cols, 0, [2, 9]) and not P.within(cols, 0, [1, 9]) and not P.within(cols, 0, [2, 8])
    big = np.tile(cols, (40, 1))  # over the small-array size: numpy's reductions, the same answers
    assert P.within(big, 0, [2, 9]) and not P.within(big, 0, [2, 8]) and P.within(-big, -9, [0, 0])
    assert P.within(np.arange(100), 0, 99) and not P.within(np.arange(100), 1, 99)
    assert P.within(cols, 0, 9) and not P.within(cols, 0, 8)  # one bound for every column


def test_busy_poll_returns_once_a_whole_message_waits_else_after_its_time():
    import time

    import zmq

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://busy-poll")
        b.connect("inproc://busy-poll")
        t = time.perf_counter()
        P.busy_poll(b, 0.02)  # nothing comes: it polls the whole time, then returns
        assert time.perf_counter() - t >= 0.02 and not P.has_input(b)
        P.send_frames(a, [b"x", b"yz"])
        t = time.perf_counter()
        P.busy_poll(b, 5.0)
        assert time.perf_counter() - t < 1.0 and P.has_input(b)
        assert P.recv_frames(b) == [b"x", b"yz"]
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def test_a_packed_step_unpacks_to_its_frames_and_bad_lengths_are_protocol_errors():
    frames = [b"", b"ab", b"", b"cdef", b"g"]
    lengths, body = P.pack_frames(frames)
    assert lengths == [0, 2, 0, 4, 1] and body == b"abcdefg"
    assert P.unpack_frames(lengths, [body], 13) == frames
    bad = [
        (lengths, [body, b""]),          # not one body frame
        (tuple(lengths), [body]),        # not a list
        ([3, 4], [b"abcdefg"]),          # fewer than 4 parts
        ([0] * 13 + [7], [body]),        # more than ``most``
        ([0, 2, 0, 5, 1], [body]),       # adds up to more than the body
        ([0, 2, 0, 4, 0], [body]),       # to less
        ([0, 2, -1, 5, 1], [body]),      # a negative length
        ([0, 2, 0, 4, True], [body]),    # a bool is not a length
        ([0, 2.0, 0, 4, 1], [body]),
    ]
    for ls, fr in bad:
        with pytest.raises(ProtocolError):
            P.unpack_frames(ls, fr, 13)
