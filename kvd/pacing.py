"""When a busy-polling daemon runs the work decode steps left for after their replies.

The daemon's loop (kvd.server) asks ``IdlePacer.may_run`` before each slice of deferred prefix-cache
work (``BlockManager.flush_deferred(max_rows)``) while its socket is idle, and tells it when a
message arrived, when it replied and how long a slice took. Pure bookkeeping over timestamps: no I/O,
no clock of its own (the caller passes ``time.perf_counter()`` values), so it is tested exactly.
"""

from __future__ import annotations


class IdlePacer:
    """When a busy-polling daemon runs, between messages, the prefix-cache work that decode steps
    left for after their replies (``BlockManager.flush_deferred`` in slices of kvd.server's
    _IDLE_FLUSH_ROWS requests).

    A slice that is still running when the next message arrives delays that message. So after each
    reply one slice always runs (the work cannot fall behind the messages that make it), and more
    only while they fit before the next message is expected (the mean gap between a reply and the
    next message), or once the socket has stayed idle for twice that gap. With back-to-back steps
    the work of a step that registers 4,096 blocks is spread over the next steps' gaps instead of
    landing on the step after it; with an engine's forward pass between steps it all runs at once.
    (Slices of 64 requests cost twice the CPU in all at R = 4,096: each slice pays ~15 numpy calls.)
    """

    EWMA = 0.2
    MAX_GAP_S = 0.002  # one long pause must not make every later gap look long

    def __init__(self, gap_s: float = 100e-6, slice_s: float = 50e-6):
        self.gap_s = gap_s
        self.slice_s = slice_s
        self.replied_at = 0.0
        self.owed = False

    def arrived(self, now: float) -> None:
        if self.replied_at:
            gap = min(now - self.replied_at, self.MAX_GAP_S)
            self.gap_s += (gap - self.gap_s) * self.EWMA

    def replied(self, now: float) -> None:
        self.replied_at = now
        self.owed = True

    def may_run(self, now: float) -> bool:
        since = now - self.replied_at
        return self.owed or since + self.slice_s <= self.gap_s or since > 2 * self.gap_s

    def ran(self, seconds: float) -> None:
        self.slice_s += (seconds - self.slice_s) * self.EWMA
        self.owed = False
