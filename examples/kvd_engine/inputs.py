"""A step's model inputs and varlen layout, built with numpy and moved to the model's device in ONE
copy (on CUDA: from a pinned buffer, asynchronously).

Staging layout, int64 words, for T tokens, B scheduled requests, K sampling rows and R = T (token ->
request index, only when the slots are computed from the block tables) or 0:

    [0, T)                  input token ids
    [T, 2T)                 positions
    [2T, 2T + K)            rows of the forward's output that sample (``logits_to_keep``)
    [2T + K, 2T + K + R)    index of each token's request in the step (slots from the tables)
    then int32, two per word: session rows [B], seq_lens [B], query_start_loc [B + 1]

Reuse: the pinned buffer is written again by the next step's pack; the engine synchronizes with the
device at the end of every step (sampling reads the tokens back), so the previous copy is done.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class StepInputs:
    """Device views of one step's packed inputs (``rep`` is None unless asked for)."""

    ids: torch.Tensor         # int64 [T]
    positions: torch.Tensor   # int64 [T]
    keep: torch.Tensor        # int64 [K]
    rep: torch.Tensor | None  # int64 [T]: the step index of each token's request
    rows: torch.Tensor        # int32 [B]
    seq_lens: torch.Tensor    # int32 [B]
    qsl: torch.Tensor         # int32 [B + 1]


def varlen_layout(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(query_start_loc int32 [B + 1], seq_lens int32 [B], positions int64 [T]) of requests computing
    ``counts[i]`` tokens from position ``starts[i]``."""
    b = starts.shape[0]
    qsl = np.zeros(b + 1, np.int32)
    np.cumsum(counts, out=qsl[1:])
    total = int(qsl[-1])
    positions = np.repeat(starts.astype(np.int64) - qsl[:-1], counts) + np.arange(total, dtype=np.int64)
    return qsl, (starts + counts).astype(np.int32), positions


class Staging:
    """A growing host buffer (pinned on CUDA) and its device twin."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cap = 0
        self.host = self.host_np = self.dev = None

    def _grow(self, words: int) -> None:
        cap = 1 << max(words - 1, 1023).bit_length()
        cuda = self.device.type == "cuda"
        self.host = torch.empty(cap, dtype=torch.int64, pin_memory=cuda)
        self.host_np = self.host.numpy()
        self.dev = torch.empty(cap, dtype=torch.int64, device=self.device) if cuda else self.host
        self.cap = cap

    def pack(self, ids, positions: np.ndarray, keep: np.ndarray, rep: np.ndarray | None, rows: np.ndarray,
             seq_lens: np.ndarray, qsl: np.ndarray) -> StepInputs:
        t, k, b = positions.shape[0], keep.shape[0], rows.shape[0]
        r = t if rep is not None else 0
        head = 2 * t + k + r
        words = head + (3 * b + 2) // 2
        if words > self.cap:
            self._grow(words)
        h = self.host_np
        h[:t] = ids
        h[t:2 * t] = positions
        h[2 * t:2 * t + k] = keep
        if rep is not None:
            h[2 * t + k:head] = rep
        tail = h[head:words].view(np.int32)
        tail[:b] = rows
        tail[b:2 * b] = seq_lens
        tail[2 * b:3 * b + 1] = qsl
        d = self.dev
        if d is not self.host:
            d[:words].copy_(self.host[:words], non_blocking=True)
        small = d[head:words].view(torch.int32)
        return StepInputs(d[:t], d[t:2 * t], d[2 * t:2 * t + k], d[2 * t + k:head] if rep is not None else None,
                          small[:b], small[b:2 * b], small[2 * b:3 * b + 1])
