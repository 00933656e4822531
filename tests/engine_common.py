"""Shared pieces of the engine tests (tests/test_engine*.py): the tiny models and daemon options."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import torch  # noqa: E402

from kvd_engine import build_model, hf_generate, tiny_config  # noqa: E402

LLAMA = dict(kind="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512)
HYBRID = dict(kind="hybrid", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, window=12)
KV_SPEC = "2,2,16,float32"          # layers, KV heads, head dim (64 / 4), dtype of the tiny models
BLOCK = 8
# float32 on both sides; the paged path sums in another order than HF's eager attention (measured
# max |diff| ~1e-5 on logits of std ~2): a wrong slot, block or missed copy changes them by O(1)
LOGIT_ATOL = 1e-4
DAEMON = dict(block_size=BLOCK, num_gpu_blocks=512, max_num_reqs=128, max_reqs_per_session=64, max_sessions=8,
              max_num_batched_tokens=4096, max_model_len=1024, kv_cache=KV_SPEC)


def model_of(spec: dict, seed: int = 0):
    torch.set_num_threads(1)
    return build_model(tiny_config(**spec), seed=seed)


def assert_matches_hf(model, eng, prompts: dict, max_new: int, forced: dict | None = None):
    """Every request's tokens equal HF generate's, its logits within LOGIT_ATOL."""
    worst = 0.0
    for rid, prompt in prompts.items():
        r = eng.reqs[rid]
        tokens, logits = hf_generate(model, prompt, max_new, (forced or {}).get(rid, r.forced))
        assert r.output == tokens, rid
        diff = float((torch.stack(r.logits) - logits).abs().max())
        assert diff <= LOGIT_ATOL, (rid, diff)
        worst = max(worst, diff)
    return worst


def run_three_parents_forking(eng, model, max_new: int = 12) -> None:
    """Three requests whose prompts end in partly filled blocks prefill in one step, then fork three
    children each (forced first tokens), all in the next step; the engine runs them to the end.
    Each parent's last block is shared by four: the parent and two children copy it on write, the
    last holder writes in place (nine copies). Every request must be HF's."""
    rng = np.random.default_rng(16)
    prompts = {f"p{i}": rng.integers(0, 512, int(n)).tolist() for i, n in enumerate((21, 13, 30))}
    for rid, p in prompts.items():
        eng.add(rid, p, max_new)
    eng.step()  # the prefills
    forced, want = {}, {}
    for rid, p in prompts.items():
        first = eng.reqs[rid].output[0]
        for i in (1, 2, 3):
            tok = (first + 100 * i) % 512
            eng.fork(rid, f"{rid}.{i}", tok)
            forced[f"{rid}.{i}"], want[f"{rid}.{i}"] = {0: tok}, p
    eng.run()
    assert eng.copies == 9 and not eng.unsplit
    assert_matches_hf(model, eng, {**prompts, **want}, max_new, forced)
