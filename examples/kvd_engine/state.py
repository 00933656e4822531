"""The engine's per-request state and its KV memory (the daemon's, or its own)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

WAITING, PREFILL, RUNNING, SWAPPED, DONE = "waiting", "prefill", "running", "swapped", "done"


@dataclass
class Request:
    rid: str
    prompt: list[int]
    max_new_tokens: int
    forced: dict[int, int] = field(default_factory=dict)   # output index -> token (forks, tests)
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # float32 CPU, one per output token
    hashes: np.ndarray = field(default_factory=lambda: np.empty(0, "S16"))  # full blocks' chain
    computed: int = 0          # tokens whose KV is written
    cached_tokens: int = 0     # prefix hit at admission
    prefilled_tokens: int = 0  # prompt tokens this engine computed
    state: str = WAITING
    first_token_step: int = -1
    admitted_step: int = -1
    added_at: float = 0.0      # perf_counter() when added (time to first token)
    first_token_at: float = 0.0
    registered: int = 0        # leading full blocks registered in kvd's prefix cache
    chunk: int = 0             # prompt tokens this step computes (planned before the round trip)
    held: int = 0              # tokens kvd holds beyond the next one (a multi-step message refused in part)

    @property
    def seq(self) -> list[int]:
        return self.prompt + self.output

    @property
    def seq_len(self) -> int:
        return len(self.prompt) + len(self.output)

    def tokens(self, start: int, n: int) -> list[int]:
        """``seq[start:start + n]`` without building ``seq``."""
        lp = len(self.prompt)
        if start >= lp:
            return self.output[start - lp:start - lp + n]
        if start + n <= lp:
            return self.prompt[start:start + n]
        return self.seq[start:start + n]

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class OwnedKv:
    """Engine-owned KV memory: the GPU-side cache and a CPU swap pool, with kvd's layout."""

    def __init__(self, layers, num_blocks, block_size, kv_heads, head_dim, dtype, device, num_cpu_blocks=0):
        self.gpu = torch.zeros(layers, 2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
        self.cpu = torch.zeros(layers, 2, max(num_cpu_blocks, 1), block_size, kv_heads, head_dim, dtype=dtype)

    def copy(self, pairs: np.ndarray) -> None:
        if len(pairs):
            p = torch.from_numpy(pairs.astype(np.int64)).to(self.gpu.device)
            self.gpu[:, :, p[:, 1]] = self.gpu[:, :, p[:, 0]]

    def swap_out(self, mapping: np.ndarray) -> None:
        if len(mapping):
            m = torch.from_numpy(mapping.astype(np.int64))
            self.cpu[:, :, m[:, 1]] = self.gpu[:, :, m[:, 0].to(self.gpu.device)].cpu()

    def swap_in(self, mapping: np.ndarray) -> None:
        if len(mapping):
            m = torch.from_numpy(mapping.astype(np.int64))
            self.gpu[:, :, m[:, 1].to(self.gpu.device)] = self.cpu[:, :, m[:, 0]].to(self.gpu.device)


def daemon_kv(client, dtype: torch.dtype) -> torch.Tensor:
    """The daemon-owned cache as a torch tensor: CUDA IPC tensor as is, shm numpy memmap wrapped
    (bfloat16/float16 arrive as integers of their width: reinterpret the bytes)."""
    kv = client.kv_cache
    if isinstance(kv, torch.Tensor):
        return kv
    t = torch.from_numpy(kv)
    return t.view(dtype) if t.dtype != dtype else t
