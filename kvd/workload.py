"""The standard benchmark workload (docs/WORKLOAD.md) as data: prompts, decode tokens, and the
figures an honest run must reproduce. Shared by kvd.bench.core and kvd.bench.zmq_bench."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WorkloadSpec:
    block_size: int = 16
    num_blocks: int = 65536
    num_requests: int = 256
    prompt_len: int = 1024
    system_len: int = 512
    shared: float = 0.5
    decode_steps: int = 128
    hash_algo: str = "sha256"
    seed: int = 0
    max_num_batched_tokens: int = 8192


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    tokens: np.ndarray  # int32 [R, P + D]: the prompt, then the token each decode step appends
    is_shared: np.ndarray  # bool [R]

    @property
    def num_sharers(self) -> int:
        return int(self.is_shared.sum())

    def expected_prefix_hit_tokens(self) -> int:
        """Every sharer but the first hits the system prompt, rounded down to whole blocks."""
        s = self.spec
        return max(self.num_sharers - 1, 0) * (s.system_len // s.block_size * s.block_size)

    def expected_blocks_after_decode(self) -> int:
        s = self.spec
        per_request = -(-(s.prompt_len + s.decode_steps) // s.block_size)
        shared_blocks = max(self.num_sharers - 1, 0) * (s.system_len // s.block_size)
        return s.num_requests * per_request - shared_blocks


def make_workload(spec: WorkloadSpec, client_index: int = 0) -> Workload:
    """Token ids for one client's requests. Every client shares the same system prompt, so with
    several clients over one namespace only the very first sharer misses."""
    system = np.random.default_rng(spec.seed).integers(0, 50_000, spec.system_len, dtype=np.int32)
    rng = np.random.default_rng([spec.seed, client_index + 1])
    total = spec.prompt_len + spec.decode_steps
    tokens = rng.integers(0, 50_000, (spec.num_requests, total), dtype=np.int32)
    # Interleaved sharers: every 1/shared-th request starts with the system prompt.
    num_shared = int(spec.shared * spec.num_requests)
    is_shared = np.zeros(spec.num_requests, bool)
    if num_shared:
        is_shared[np.linspace(0, spec.num_requests, num_shared, endpoint=False).astype(int)] = True
    tokens[is_shared, : spec.system_len] = system
    return Workload(spec, tokens, is_shared)
