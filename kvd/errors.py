"""Typed errors for misuse of the block manager and the daemon.

Misuse (a caller's mistake: unknown request, bad size, wrong hash width) raises one of these and
leaves every piece of state exactly as it was. "No space" is not an error: it is a result value.
Bugs are ``assert``s. Every class carries a stable ``code`` that the wire protocol sends back, so the
client can raise the same class on its side (see ``ERROR_BY_CODE``).
"""

from __future__ import annotations


class KvdError(Exception):
    """Base of every typed kvd error."""

    code = 1


class InvalidArgument(KvdError):
    """A size, count or flag is out of its documented range."""

    code = 2


class UnknownRequest(KvdError):
    """The request id is not known to this manager (or to this session)."""

    code = 3


class DuplicateRequest(KvdError):
    """A request with this id already exists."""

    code = 4


class BadHashes(KvdError):
    """Block hashes of the wrong width, count or type."""

    code = 5


class RequestSwapped(KvdError):
    """The request is swapped out; it must be swapped in before it can grow."""

    code = 6


class RequestNotSwapped(KvdError):
    """swap_in of a request that is not swapped out."""

    code = 7


class CapacityExceeded(KvdError):
    """A fixed capacity (request rows, blocks per request, CPU pool) would be exceeded."""

    code = 8


class ProtocolError(KvdError):
    """A malformed, oversized or out-of-order message."""

    code = 20


class SessionError(KvdError):
    """The session is unknown, expired, or belongs to another daemon boot."""

    code = 21


class DaemonRestarted(SessionError):
    """The daemon's boot epoch changed: every block the session held is gone; reconnect()."""

    code = 22


class Timeout(KvdError):
    """No reply within the request timeout after every retry."""

    code = 23


class ServerBusy(KvdError):
    """The daemon refused work it could not queue."""

    code = 24


class Unauthorized(KvdError):
    """The connecting process may not do this: e.g. take a tenant its uid/gids are not allowed."""

    code = 25


class PermissionDenied(KvdError):
    """The client may not open the daemon's socket or a shared-memory segment (the path is named)."""

    code = 26


ERROR_BY_CODE: dict[int, type[KvdError]] = {
    cls.code: cls
    for cls in (
        KvdError,
        InvalidArgument,
        UnknownRequest,
        DuplicateRequest,
        BadHashes,
        RequestSwapped,
        RequestNotSwapped,
        CapacityExceeded,
        ProtocolError,
        SessionError,
        DaemonRestarted,
        Timeout,
        ServerBusy,
        Unauthorized,
        PermissionDenied,
    )
}
