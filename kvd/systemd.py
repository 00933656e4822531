"""sd_notify(3) without libsystemd: a datagram to ``$NOTIFY_SOCKET``.

Outside systemd (no ``$NOTIFY_SOCKET``) every call is a no-op that returns False; no call ever
raises or blocks (the socket is non-blocking: a full queue drops the message, which systemd never
lets happen in practice). The daemon uses it as::

    notify("READY=1", "STATUS=...")       # socket bound, pool allocated, kernels warmed
    notify("WATCHDOG=1")                  # every watchdog_interval() s, from an event-loop task
    notify("STATUS=" + format_status(s))  # every status_interval_s
    notify("STOPPING=1")                  # on SIGTERM
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

__all__ = ["notify", "watchdog_interval", "format_status"]


def notify(*lines: str) -> bool:
    """Send ``"\\n".join(lines)`` to ``$NOTIFY_SOCKET`` (a path, or ``@name`` for an abstract
    socket). True if sent; False when not under systemd or on any error. Never raises."""
    try:
        addr = os.environ.get("NOTIFY_SOCKET", "")
        if not lines or len(addr) < 2:
            return False
        if addr[0] == "@":
            addr = "\0" + addr[1:]
        elif addr[0] != "/":
            return False  # vsock:... and other transports are not supported
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)
            sock.sendto("\n".join(lines).encode("utf-8", "replace"), addr)
        return True
    except Exception:  # noqa: BLE001 - notification is best effort by contract
        return False


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of ``$WATCHDOG_USEC``), or None when the watchdog
    is off or ``$WATCHDOG_PID`` names another process."""
    env = os.environ if env is None else env
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
        pid = env.get("WATCHDOG_PID", "")
        if pid and int(pid) != os.getpid():
            return None
    except ValueError:
        return None
    return usec / 2e6 if usec > 0 else None


def format_status(stats: Mapping[str, Any]) -> str:
    """One-line summary for ``STATUS=``, from a stats dict shaped like the metrics source
    (``{"pools": {"gpu": {...}, ...}, "sessions": int | list}``)."""
    parts = []
    for name, pool in (stats.get("pools") or {}).items():
        total = max(int(pool.get("num_blocks", 0)), 1)
        used = int(pool.get("num_used_blocks", 0))
        queries = int(pool.get("prefix_queries", 0))
        hits = int(pool.get("prefix_hits", 0))
        text = f"{name} {100.0 * used / total:.1f}% used"
        if queries:
            text += f", hit rate {100.0 * hits / queries:.1f}%"
        parts.append(text)
    sessions = stats.get("sessions", 0)
    n = sessions if isinstance(sessions, int) else len(sessions or ())
    parts.append(f"{n} session{'s' if n != 1 else ''}")
    return "; ".join(parts)
