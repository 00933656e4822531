"""The engine's client surface over kvd's in-process ``BlockManager`` (no daemon, no round trip):
the same engine loop measures what the daemon's transport costs (``scripts/bench_engine.py``)."""

from __future__ import annotations

import numpy as np

from kvd.api import GroupSpec, ManagerConfig
from kvd.hashing import hash_next_blocks, hash_prompt
from kvd.manager import BlockManager, warm_up


class InProcClient:
    """What ``Engine`` uses of ``kvd_client.Client``: step, swap_out/swap_in, row_of, tables,
    block_sizes, hash_prompt, hash_next_blocks; ``kv_cache`` is None (the engine owns its KV memory)."""

    kv_cache = None
    gpu_tables = None

    def __init__(self, num_blocks: int, block_size: int = 16, window: int = 0, num_cpu_blocks: int = 0,
                 max_num_reqs: int = 512, max_model_len: int = 4096, hash_algo: str = "sha256"):
        # the manager's compiled loops load now, as at a daemon's start: else each loads at its first
        # call, inside a step (4-10 ms each on the box; `bench_engine.py --tiny --batches 256`: the
        # in-process engine's manager time 0.28 -> 0.10 ms a step over 32 timed steps)
        warm_up()
        groups = (GroupSpec(block_size),) + ((GroupSpec(block_size, window),) if window else ())
        self.m = BlockManager(ManagerConfig(num_gpu_blocks=num_blocks, groups=groups, num_cpu_blocks=num_cpu_blocks,
                                            max_model_len=max_model_len, max_num_reqs=max_num_reqs))
        self.algo = hash_algo

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return self.m.block_sizes

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        return self.m.sliding_windows

    @property
    def tables(self) -> tuple[np.ndarray, ...]:
        return self.m.tables

    def row_of(self, rid) -> int:
        return self.m.row_of(rid)

    def rows_of(self, rids) -> np.ndarray:
        return self.m.rows_of(rids)

    def hash_prompt(self, token_ids, group: int = 0, **kw) -> np.ndarray:
        kw.setdefault("algo", self.algo)
        return hash_prompt(token_ids, self.block_sizes[group], **kw)

    def hash_next_blocks(self, token_blocks, parents) -> np.ndarray:
        return hash_next_blocks(token_blocks, parents, algo=self.algo)

    def step(self, batch):
        res = self.m.step(batch)
        self.m.take_copies()  # the step's copies are in res.copies; drop the manager's log of them
        return res

    def start_step(self, batch):
        """``step`` now; what ``Client.start_step`` returns (the in-process step has no round trip)."""
        return _Done(self.step(batch))

    def swap_out(self, req_ids):
        return self.m.swap_out(req_ids)

    def swap_in(self, req_ids):
        return self.m.swap_in(req_ids)

    def stats(self) -> dict:
        return self.m.stats()


class _Done:
    """A step already applied: ``result()`` returns it (``kvd_client.PendingStep``'s surface)."""

    __slots__ = ("_res",)

    def __init__(self, res):
        self._res = res

    def ready(self) -> bool:
        return True

    def granted(self) -> bool:
        return self._res.granted()

    def result(self):
        return self._res
