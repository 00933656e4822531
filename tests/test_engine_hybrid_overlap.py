"""A hybrid model (full attention + a sliding window: two KV-cache groups) on the engine's overlapped
and multi-step-window paths, and the engine's check that kvd's windows keep every block its forwards
read (``Engine._check_windows``)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest_daemon import daemon_factory, short_tmp  # noqa: F401
from tests.engine_common import BLOCK, DAEMON, HYBRID, LLAMA, assert_matches_hf, model_of

from kvd_client import Client  # noqa: E402
import torch  # noqa: E402

from kvd_engine import Engine, InProcClient, OwnedKv  # noqa: E402

W = HYBRID["window"]


def _groups(kvd_window: int) -> str:
    return f"{BLOCK},{BLOCK}:{kvd_window}"


def _prompts(seed: int, n: int = 5):
    rng = np.random.default_rng(seed)
    # longer than the window (and some than a block past it): blocks slide out while they decode
    return {f"r{i}": rng.integers(0, 512, int(rng.integers(W + 2, 4 * W))).tolist() for i in range(n)}


@pytest.mark.parametrize("per_message", [1, 3])
def test_hybrid_overlap_and_windows_match_hf_and_release_the_window(daemon_factory, per_message):
    """Overlap (and multi-step windows of 3) on a hybrid model: tokens and logits equal HF's, the
    steps ran on the steady batch with messages sent during forwards, kvd released the window
    group's blocks as the requests decoded, and the pool is empty at the end."""
    ahead = 2 if per_message > 1 else 1
    d = daemon_factory(**DAEMON, kv_groups=_groups(W + ahead))
    model = model_of(HYBRID)
    prompts = _prompts(7)
    with Client(d.endpoint, name="e", steps_in_flight=1, mailbox=True) as c:  # (its steady steps in the mailbox)
        assert c.sliding_windows == (0, W + ahead) and c.mailbox
        eng = Engine(c, model, overlap=True, steps_per_message=per_message)
        for rid, p in prompts.items():
            eng.add(rid, p, 24)
        released = []
        while eng.busy:
            eng.step()
            r = eng.reqs["r0"]
            if r.state == "running" and c.row_of("r0") is not None:
                released.append(int((c.block_table("r0", 1) == 0).sum()))
        assert_matches_hf(model, eng, prompts, 24)
        assert eng.steady_steps > 0 and eng.ahead_steps > 0
        if per_message > 1:
            assert eng.early_messages > 0
        assert max(released) >= 2  # r0's window group dropped its leading blocks
        c.mark_computed()
        assert c.stats()["num_requests"] == 0 and c.stats()["num_used_blocks"] == 0


def test_hybrid_overlap_gives_the_same_tokens_as_the_synchronous_engine(daemon_factory):
    """The same prompts through a synchronous engine and an overlapped one with windows of 4, each on
    its own daemon, half of them arriving while the others decode: identical tokens (both equal
    HF's: see above), both pools empty after; steps that free and admit beside the decodes went as
    the binary decode_free op with both groups' hashes."""
    from kvd import protocol as P

    model = model_of(HYBRID)
    prompts = _prompts(11, 6)
    out = {}
    for overlap, per_message in ((False, 1), (True, 4)):
        d = daemon_factory(**DAEMON, kv_groups=_groups(W + 2))
        with Client(d.endpoint, name="e", steps_in_flight=1) as c:
            ops = []
            real = c._req_step

            def req_step(batch):  # each step message's op, and a decode_free's admissions
                spec = real(batch)
                ops.append((spec[0], spec[1][-1] if spec[0] is P.DECODE_FREE else 0))
                return spec
            c._req_step = req_step
            eng = Engine(c, model, overlap=overlap, steps_per_message=per_message, keep_logits=False)
            rids = list(prompts)
            for rid in rids[:3]:
                eng.add(rid, prompts[rid], 20)
            for _ in range(6):
                eng.step()
            for rid in rids[3:]:
                eng.add(rid, prompts[rid], 20 - rids.index(rid))  # (finishing at different steps)
            eng.run()
            assert any(op is P.DECODE_FREE and nd for op, nd in ops), ops
            out[overlap] = {rid: r.output for rid, r in eng.reqs.items()}
            assert [len(out[overlap][rid]) for rid in rids] == [20, 20, 20, 17, 16, 15]
            c.mark_computed()
            assert c.stats()["num_requests"] == 0 and c.stats()["num_used_blocks"] == 0
    assert out[True] == out[False]


def test_a_kvd_window_one_token_short_changes_the_tokens(daemon_factory, monkeypatch):
    """Why the check: with kvd's window one token shorter than the model's, a block the model's
    window still reads goes back to the pool, the forward reads it as the null block, and the
    logits leave HF's (the check bypassed here). With the model's window exactly, they match."""
    model = model_of(HYBRID)
    prompts = _prompts(3, 4)
    monkeypatch.setattr(Engine, "_check_windows", lambda self, window, ahead: None)
    for kvd_window, same in ((W, True), (W - 1, False)):
        d = daemon_factory(**DAEMON, kv_groups=_groups(kvd_window))
        with Client(d.endpoint, name="e") as c:
            eng = Engine(c, model)
            for rid, p in prompts.items():
                eng.add(rid, p, 16)
            eng.run()
            if same:
                assert_matches_hf(model, eng, prompts, 16)
            else:
                with pytest.raises(AssertionError):
                    assert_matches_hf(model, eng, prompts, 16)


@pytest.mark.parametrize("kvd_window, overlap, per_message, needs", [
    (W - 1, False, 1, W),       # shorter than the model's: blocks it reads would be released
    (W, True, 1, W + 1),        # overlap: the next step's release counts from one token on
    (W + 1, True, 3, W + 2),    # windows: the next window's message goes out a step early
])
def test_the_engine_refuses_a_kvd_window_its_forwards_outrun(daemon_factory, kvd_window, overlap, per_message, needs):
    """A kvd window one token short of what the engine's mode needs is refused with the figure it
    needs; exactly that window is accepted."""
    d = daemon_factory(**DAEMON, kv_groups=_groups(kvd_window))
    model = model_of(HYBRID)
    with Client(d.endpoint, name="e", steps_in_flight=1) as c:
        with pytest.raises(ValueError, match=f"group 1 has a sliding window of {kvd_window} tokens.*needs >= {needs}"):
            Engine(c, model, overlap=overlap, steps_per_message=per_message)
    d2 = daemon_factory(**DAEMON, kv_groups=_groups(needs))
    with Client(d2.endpoint, name="e", steps_in_flight=1) as c:
        Engine(c, model, overlap=overlap, steps_per_message=per_message)


def test_the_engine_refuses_a_window_on_full_attention_layers(daemon_factory):
    d = daemon_factory(**DAEMON, kv_groups=f"{BLOCK}:{W},{BLOCK}")
    with Client(d.endpoint, name="e") as c:
        assert c.sliding_windows == (W, 0)
        with pytest.raises(ValueError, match="group 0 has a sliding window of 12 tokens, but the model's full-attention"):
            Engine(c, model_of(HYBRID))
        with pytest.raises(ValueError, match="group 0 has a sliding window"):
            Engine(c, model_of(LLAMA))


def test_the_in_process_client_says_its_windows():
    assert InProcClient(16, BLOCK, window=W).sliding_windows == (0, W)
    assert InProcClient(16, BLOCK).sliding_windows == (0,)
    with pytest.raises(ValueError, match="needs >= 13"):
        Engine(InProcClient(16, BLOCK, window=W), model_of(HYBRID), overlap=True,
               kv=OwnedKv(2, 16, BLOCK, 2, 16, torch.float32, "cpu"))


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_windows_with_a_prompt_shorter_than_a_block(daemon_factory, kind):
    """A request whose first block fills during the steady batch has no parent hash for the batch's
    chained hashing: the engine sends that request's steps one message each (the generic hashing)
    until its first block has a hash, then windows again. Tokens equal HF's."""
    d = daemon_factory(**DAEMON, kv_groups=_groups(W + 2))
    model = model_of(HYBRID if kind == "hybrid" else LLAMA)
    rng = np.random.default_rng(2)
    prompts = {"short": rng.integers(0, 512, 3).tolist(), "long": rng.integers(0, 512, 30).tolist(),
               "mid": rng.integers(0, 512, 13).tolist()}
    with Client(d.endpoint, name="e", steps_in_flight=1) as c:
        eng = Engine(c, model, overlap=True, steps_per_message=3)
        for rid, p in prompts.items():
            eng.add(rid, p, 24)
        eng.run()
        assert_matches_hf(model, eng, prompts, 24)
        assert eng.early_messages > 0


def test_hybrid_windows_in_a_pool_too_small_preempt_by_swap_and_match_hf(daemon_factory):
    """The hybrid model, overlapped with windows of 4, in a pool too small for its requests: kvd
    grants some windows in part (their requests hold tokens), the engine preempts by swap-out and
    swaps back in (the window group's released entries stay null across the swap); tokens and
    logits equal HF's, the pool is empty at the end."""
    d = daemon_factory(**dict(DAEMON, num_gpu_blocks=30, num_cpu_blocks=96), kv_groups=_groups(W + 2))
    model = model_of(HYBRID)
    prompts = _prompts(4, 6)
    with Client(d.endpoint, name="e", steps_in_flight=1) as c:
        eng = Engine(c, model, overlap=True, steps_per_message=4)
        held = []
        real = eng._took_reply

        def took(res):  # the requests holding granted tokens after each reply
            real(res)
            held.append(sum(r.held for r in eng.reqs.values()))
        eng._took_reply = took
        for rid, p in prompts.items():
            eng.add(rid, p, 24)
        eng.run()
        assert eng.swaps_out >= 1 and eng.swaps_in == eng.swaps_out
        assert_matches_hf(model, eng, prompts, 24)
        c.mark_computed()
        assert c.stats()["num_requests"] == 0 and c.stats()["num_used_blocks"] == 0
        assert max(held) > 0 and held[-1] == 0
