"""The decode graph's advance kernel (examples/kvd_engine/advance.py) against its torch reference:
exactly equal (greedy tokens with first-index ties, the next step's ids, positions and seq_lens), on
the CPU through Triton's interpreter and on CUDA (marked cuda)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tests import engine_common  # noqa: E402,F401  (puts examples/ on the path)

from kvd_engine import advance as A  # noqa: E402


def _device(name):
    if name == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        return torch.device("cuda")
    if not A._interpreted():
        pytest.skip("CPU runs need TRITON_INTERPRET=1 (set without a GPU by tests/conftest.py)")
    return torch.device("cpu")


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _case(dev, dtype, b, v, real, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, v, generator=g).to(dtype)
    logits[0, 3] = logits[0, v - 2] = logits[0].max() + 1  # a tie (across chunks when v > BLOCK_V): the first wins
    if b > 1:
        logits[1, :] = 0.5  # a whole row of ties: index 0
    if b > 2:
        logits[2, v - 1] = 100.0  # the maximum in the last, partial chunk
    ids = torch.randint(1, 1000, (b,), generator=g)
    positions = torch.randint(0, 4000, (b,), generator=g)
    seq_lens = (positions + 1).to(torch.int32)
    ids[real:], positions[real:], seq_lens[real:] = 0, 0, 0  # padding requests and tokens
    qsl = torch.tensor(list(range(real + 1)) + [real] * (b - real), dtype=torch.int32)
    return [x.to(dev) for x in (logits, torch.full((b,), -7, dtype=torch.int64), ids, positions, seq_lens, qsl)]


@pytest.mark.parametrize("devname", DEVICES)
@pytest.mark.parametrize("b,v,real", [(4, 3000, 3), (8, 1024, 8), (1, 50, 1), (16, 2049, 5), (3, 20000, 2)],
                         ids=["padded", "one_chunk", "single", "pow2_edge", "three_chunks"])
def test_advance_kernel_equals_reference(devname, b, v, real):
    dev = _device(devname)
    for dtype in [torch.float32] if dev.type == "cpu" else [torch.float32, torch.bfloat16, torch.float16]:
        want = _case(dev, dtype, b, v, real)
        got = [x.clone() for x in want]
        A.advance_ref(*want)
        A.advance(*got)
        for name, w, x in zip(["logits", "next_ids", "ids", "positions", "seq_lens", "qsl"], want, got):
            assert torch.equal(w, x), (name, dtype, w, x)


def test_reference_advances_real_tokens_only():
    logits = torch.zeros(4, 6)
    for r, tok in enumerate([5, 2, 4, 1]):
        logits[r, tok] = 1.0
    next_ids = torch.zeros(4, dtype=torch.int64)
    ids = torch.tensor([9, 8, 7, 0])
    positions = torch.tensor([10, 20, 30, 0])
    seq_lens = torch.tensor([11, 21, 31, 0], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32)
    A.advance_ref(logits, next_ids, ids, positions, seq_lens, qsl)
    assert next_ids.tolist() == [5, 2, 4, 1]
    assert ids.tolist() == [5, 2, 4, 0] and positions.tolist() == [11, 21, 31, 0]
    assert seq_lens.tolist() == [12, 22, 32, 0]
