"""When, and how much of, the work decode steps left for after their replies a busy-polling daemon runs.

The daemon's loop (kvd.server) asks ``IdlePacer.rows`` how many requests' deferred prefix-cache
registrations (``BlockManager.flush_deferred(max_rows)``) to run while its socket is idle, and tells
it when a message arrived, when it replied and what a slice cost. Pure bookkeeping over timestamps:
no I/O, no clock of its own (the caller passes ``time.perf_counter()`` values), so it is tested
exactly.
"""

from __future__ import annotations

from collections import deque


class IdlePacer:
    """Slices of deferred registration sized to the gap the daemon expects before the next message.

    A slice still running when the next message arrives delays that message. So a slice is as
    large as fits in the first ``FILL`` of the gap expected before the next message, at the
    measured cost per request. The gap expected is the shortest of the last ``GAPS`` gaps between a
    reply and the next message, not their mean: a client's long gaps (one that hashes a filled
    block for each of its requests before the step registering them) must not size the slice
    after that step, whose next message comes at the client's usual short gap. With a running
    mean, 4,096 requests' registering step was followed by a slice of ~1,100 requests (~80 µs in
    the daemon), which the next step (its every request's growth) waited for: on the 2-core box
    that step's p50 went from 212-240 µs to 185-197 with the shortest gap, and the decode
    step's p99 from 309-336 to 229-234 µs (``kvd bench --scale 4096``, two runs each).

    After each reply one slice runs however little fits (at least ``MIN_ROWS``: the work cannot fall
    behind the messages that make it); later ones only where at least ``MIN_ROWS`` fit, or once the
    socket has stayed idle for twice the gap (then ``IDLE_ROWS``). With back-to-back steps (a client
    that sends the next step as soon as the reply is in) the registrations of a step that filled
    4,096 blocks are spread over the next steps' gaps in slices of at least ``MIN_ROWS`` instead of
    landing on the step after it (one that filled 256 runs whole after its reply); with an engine's
    forward pass between steps they all run at once.

    The cost per request is an average of seconds per request over the slices run, fixed costs
    included. Its slice size converges to the one that fills the time G it may use: a slice of k
    requests costs a + b*k, so the estimate a/k + b gives the next slice (G - a)/b requests once k
    is there, and the map k -> G/(a/k + b) has slope a/G < 1 there.
    """

    EWMA = 0.2  # of the cost per request
    GAPS = 16
    # A slice has a fixed cost (~8-15 µs in process, ~30 in the daemon's cache state: the calls of
    # one registration, whatever its size), so small slices cost more than they spare the next
    # message. Measured on the 2-core box (session 16, kvd bench, alternating runs): 16 -> 256 took
    # the 1-client p50 at R = 256 from 124-128 µs (9 runs) to 105-115 (4), and p99 at R = 4,096
    # from 500-691 to 466-539 µs (3 each); 64 and 128 fell in between.
    MIN_ROWS = 256
    IDLE_ROWS = 256  # a slice once no message is expected soon (a daemon that does not poll: always)
    FILL = 0.5  # of the expected gap: gaps vary, and a slice's first blocks are the coldest

    def __init__(self, gap_s: float = 100e-6, row_s: float = 1e-6):
        self.gap_s = gap_s  # until the first gap is seen
        self.row_s = row_s
        self.replied_at = 0.0
        self.owed = False
        self._gaps: deque[float] = deque(maxlen=self.GAPS)

    def arrived(self, now: float) -> None:
        if self.replied_at:
            self._gaps.append(now - self.replied_at)
            self.gap_s = min(self._gaps)

    def replied(self, now: float) -> None:
        self.replied_at = now
        self.owed = True

    def rows(self, now: float) -> int:
        """How many requests' registrations to run now; 0: none (wait for the message)."""
        since = now - self.replied_at
        if since > 2 * self.gap_s:
            return self.IDLE_ROWS
        fit = max(int((self.gap_s * self.FILL - since) / self.row_s), 0)
        if self.owed:
            return max(fit, self.MIN_ROWS)
        return fit if fit >= self.MIN_ROWS else 0

    def ran(self, seconds: float, rows: int) -> None:
        """A slice took ``seconds`` and registered ``rows`` requests' blocks (0: only confirmations,
        which say nothing about the cost per request)."""
        self.owed = False
        if rows:
            self.row_s += (seconds / rows - self.row_s) * self.EWMA
