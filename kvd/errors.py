"""Typed errors for misuse of the block manager and the daemon.

Misuse (a caller's mistake: unknown request, bad size, wrong hash width) raises one of these and
leaves every piece of state exactly as it was. "No space" is not an error: it is a result value.
Bugs are ``assert``s. Every class carries a stable ``code`` that the wire protocol sends back, so the
client can raise the same class on its side (see ``ERROR_BY_CODE``).

Code spaces (one int16 space shared with per-request statuses, see ``kvd.api``): 0..15 are
statuses (``AllocStatus``: 0 OK, 1 LATER, 2 NEVER), 16..31 misuse of the manager, 32..63 transport
and session errors. A per-request status >= 16 is the code of the error that request alone would
have raised.
"""

from __future__ import annotations


class KvdError(Exception):
    """Base of every typed kvd error."""

    code = 16


class InvalidArgument(KvdError):
    """A size, count or flag is out of its documented range."""

    code = 17


ARGUMENT_ERRORS = (TypeError, ValueError, AttributeError, IndexError, KeyError, OverflowError)
"""What Python or numpy raise for an argument of the wrong kind (a dict for an id, a string for a
count, a float array for rows): misuse, which the manager and the client report as InvalidArgument."""


def invalid_argument(exc: BaseException, what: str) -> InvalidArgument:
    """``exc`` (one of ``ARGUMENT_ERRORS``) as the InvalidArgument of ``what`` (a call or argument)."""
    return InvalidArgument(f"{what}: {type(exc).__name__}: {exc}")


class UnknownRequest(KvdError):
    """The request id is not known to this manager (or to this session)."""

    code = 18


class DuplicateRequest(KvdError):
    """A request with this id already exists."""

    code = 19


class BadHashes(KvdError):
    """Block hashes of the wrong width, count or type."""

    code = 20


class RequestSwapped(KvdError):
    """The request is swapped out; it must be swapped in before it can grow."""

    code = 21


class RequestNotSwapped(KvdError):
    """swap_in of a request that is not swapped out."""

    code = 22


class CapacityExceeded(KvdError):
    """A fixed capacity (request rows, blocks per request, CPU pool) would be exceeded."""

    code = 23


class ProtocolError(KvdError):
    """A malformed, oversized or out-of-order message."""

    code = 32


class SessionError(KvdError):
    """The session is unknown, expired, or belongs to another daemon boot."""

    code = 33


class DaemonRestarted(SessionError):
    """The daemon's boot epoch changed: every block the session held is gone; reconnect()."""

    code = 34


class Timeout(KvdError):
    """No reply within the request timeout after every retry."""

    code = 35


class ServerBusy(KvdError):
    """The daemon refused work it could not queue."""

    code = 36


class DaemonUnavailable(KvdError):
    """No daemon listens at the endpoint (its ipc socket file does not exist)."""

    code = 37


class PermissionDenied(KvdError):
    """The caller may not open the daemon's socket or a shared-memory segment (the path is named)."""

    code = 38


class Unauthorized(KvdError):
    """The connecting process may not do this: e.g. take a tenant its uid/gids do not open, or
    attach to another uid's session."""

    code = 39


FIRST_ERROR_CODE = 16
"""Codes below this are statuses (``kvd.api.AllocStatus``), never errors."""

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
        DaemonUnavailable,
        Unauthorized,
        PermissionDenied,
    )
}
