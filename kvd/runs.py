"""Which request's chain each registered block continues: what a KV event's BlockStored needs.

vLLM publishes one ``BlockStored`` per request and step (``BlockPool.cache_full_blocks``): that
request's new full blocks in chain order, ``parent_block_hash`` = the hash of the block just before
the first of them in that request (None for a request's first block), and the blocks' token ids.
A router that keeps a radix tree of hashes (Dynamo, llm-d) links each event under its parent, so
blocks of several requests must not share one event.

kvd registers many requests' blocks in one call (a batched admission, a decode step) and, for a
writer that confirms later (``kvd.manager``'s computed state), publishes them only when confirmed,
after some may have left the cache. So each registration carries, per block, its *parent* (the hash
of the block before it in its request's chain) and whether it *starts* its request's run; filtering
blocks out (already cached, evicted before confirmation, lost a race) keeps both exact, and the
events are cut wherever a new run starts or a block's parent is not the block before it in the list.
Only a manager that publishes events builds these (``BlockManager.enable_kv_events``); otherwise
every registration passes ``None`` and nothing here runs.
"""

from __future__ import annotations

import numpy as np

NO_PARENT = b""
"""The parent of a request's first block (vLLM's ``parent_block_hash = None``). numpy ``S`` arrays
read an all-zero hash back as b"", so a zero hash means "no parent"."""

NO_TOKENS = -1
"""Token id that fills the rows of blocks whose request supplied no token ids (first column read)."""


def expand(log: list[tuple]) -> list[tuple]:
    """An event log with every ``("runs", key, hashes, runs)`` entry (what the pool records: one
    per registration) replaced by its ``("stored", ...)`` entries, one per event."""
    out = []
    for entry in log:
        out.extend(entry[3].entries(entry[1], entry[2]) if entry[0] == "runs" else [entry])
    return out


class Runs:
    """Per block, in registration order: ``parent`` (hash array, NO_PARENT for a chain's first
    block), ``first`` (bool: starts its request's run) and ``tokens`` (int32 [n, block_size], rows
    of NO_TOKENS where unknown; None when no block of the registration has any)."""

    __slots__ = ("parent", "first", "tokens")

    def __init__(self, parent: np.ndarray, first: np.ndarray, tokens: np.ndarray | None = None) -> None:
        self.parent = parent
        self.first = first
        self.tokens = tokens

    def __len__(self) -> int:
        return self.parent.shape[0]

    @classmethod
    def chain(cls, hashes: np.ndarray, parent: bytes, tokens: np.ndarray | None = None) -> "Runs":
        """One request's consecutive blocks ``hashes`` after the block hashed ``parent``."""
        parents = np.empty(hashes.shape[0], hashes.dtype)
        if parents.size:
            parents[0] = parent
            parents[1:] = hashes[:-1]
        first = np.zeros(parents.size, bool)
        first[:1] = True
        return cls(parents, first, tokens)

    @classmethod
    def of_requests(cls, hashes: list[np.ndarray], parents: list[bytes], tokens: list) -> "Runs":
        """Several requests' consecutive blocks (non-empty ``hashes[i]`` after ``parents[i]``,
        token ids ``tokens[i]`` or None), in a few array operations (a batched admission)."""
        flat = np.concatenate(hashes)
        lens = np.fromiter(map(len, hashes), np.int64, count=len(hashes))
        starts = np.cumsum(lens) - lens
        parent = np.empty_like(flat)
        parent[1:] = flat[:-1]
        parent[starts] = np.array(parents, flat.dtype)
        first = np.zeros(flat.size, bool)
        first[starts] = True
        given = [t for t in tokens if t is not None]
        if not given:
            return cls(parent, first)
        if len(given) < len(tokens):
            tokens = [np.full((n, given[0].shape[1]), NO_TOKENS, np.int32) if t is None else t
                      for t, n in zip(tokens, lens.tolist())]
        return cls(parent, first, np.concatenate(tokens))

    @classmethod
    def one_each(cls, parents: np.ndarray, tokens: np.ndarray | None = None) -> "Runs":
        """Blocks of different requests, one each (a decode step)."""
        return cls(parents, np.ones(parents.shape[0], bool), tokens)

    def take(self, sel) -> "Runs":
        """The runs of the selected blocks (a mask, indices or a slice), in order."""
        return Runs(self.parent[sel], self.first[sel], None if self.tokens is None else self.tokens[sel])

    @staticmethod
    def concat(parts: list["Runs"]) -> "Runs":
        if len(parts) == 1:
            return parts[0]
        tokens = None
        with_tokens = [p.tokens for p in parts if p.tokens is not None]
        if with_tokens:
            width = with_tokens[0].shape[1]
            tokens = np.concatenate([p.tokens if p.tokens is not None else np.full((len(p), width), NO_TOKENS, np.int32)
                                     for p in parts])
        return Runs(np.concatenate([p.parent for p in parts]), np.concatenate([p.first for p in parts]), tokens)

    def starts(self, hashes: np.ndarray) -> np.ndarray:
        """Where each event of blocks ``hashes`` (these runs' blocks, in order) starts: at a new
        run, and after a block that is not the next one's parent."""
        cut = self.first.copy()
        if cut.size:
            cut[0] = True
            w = hashes.dtype.itemsize  # compared as raw bytes: faster than numpy's string compare
            prev = np.ascontiguousarray(hashes[:-1]).view(np.uint8).reshape(-1, w)
            parent = np.ascontiguousarray(self.parent[1:], hashes.dtype).view(np.uint8).reshape(-1, w)
            cut[1:] |= (prev != parent).any(axis=1)
        return np.flatnonzero(cut)

    def entries(self, key: int, hashes: np.ndarray) -> list[tuple]:
        """The ``("stored", key, hashes, parent or None, tokens or None)`` event log entries of
        blocks ``hashes`` (these runs' blocks, in order): one per unbroken piece of a run."""
        n = hashes.shape[0]
        if not n:
            return []
        starts = self.starts(hashes)
        hl = hashes.tolist()
        parents = self.parent[starts].tolist()
        tokens = self.tokens
        if starts.size == n:  # every block its own event (a decode step)
            if tokens is None:
                return [("stored", key, [h], p or None, None) for h, p in zip(hl, parents)]
            known = (tokens[:, 0] != NO_TOKENS).tolist()
            return [("stored", key, [h], p or None, tokens[i : i + 1] if k else None)
                    for i, (h, p, k) in enumerate(zip(hl, parents, known))]
        ends = starts[1:].tolist() + [n]
        out = []
        for s, e, p in zip(starts.tolist(), ends, parents):
            tok = None if tokens is None or tokens[s, 0] == NO_TOKENS else tokens[s:e]
            out.append(("stored", key, hl[s:e], p or None, tok))
        return out
