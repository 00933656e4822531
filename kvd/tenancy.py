"""Who a connecting process is, and which tenant it may be.

A tenant is decided by the peer's credentials, never by the name it sends. On an ipc socket ZeroMQ
reports the connecting process's ``SO_PEERCRED`` as the identity frame's ``Peer-Address`` property,
``"localhost:UID:GID:PID"`` (:func:`peer_of`). The daemon's ``tenants`` config maps tenant names to
the uids and gids allowed to take them::

    tenants = "alice=uid:1000,gid:2000 research=group:ml"     # NAME=PRINCIPAL[,PRINCIPAL...] ...

where a principal is ``uid:N``, ``gid:N``, ``user:NAME`` or ``group:NAME``. A hello naming tenant T
is accepted when T is configured and the peer's uid, primary gid or one of its supplementary gids
(``/proc/PID/status``) is among T's principals; anything else is :class:`kvd.errors.Unauthorized`.
A hello with no tenant gets the peer's own tenant ``uid:<uid>`` (every user its own prefixes).
Peers without credentials (tcp://, or a test calling ``Daemon.handle`` directly) may take no named
tenant; their default tenant is ``anonymous``: tcp gives no way to tell one peer from another.
"""

from __future__ import annotations

import grp
import pwd
from dataclasses import dataclass

from kvd.errors import InvalidArgument, Unauthorized

ANONYMOUS = "anonymous"
"""The default tenant of a peer without credentials."""


@dataclass(frozen=True)
class Peer:
    uid: int
    gid: int
    pid: int

    def groups(self) -> frozenset[int]:
        """Primary and supplementary gids (the process's, read now; it may have exited: primary only)."""
        gids = {self.gid}
        try:
            with open(f"/proc/{self.pid}/status") as fh:
                for line in fh:
                    if line.startswith("Groups:"):
                        gids.update(int(g) for g in line.split()[1:])
                        break
        except OSError:
            pass
        return frozenset(gids)


def peer_of(address: str | None) -> Peer | None:
    """The credentials in a ``Peer-Address`` of an ipc connection, or None (tcp, unknown)."""
    if not address or not address.startswith("localhost:"):
        return None
    parts = address.split(":")
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return Peer(int(parts[1]), int(parts[2]), int(parts[3]))


@dataclass(frozen=True)
class TenantRule:
    uids: frozenset[int]
    gids: frozenset[int]

    def admits(self, peer: Peer) -> bool:
        return peer.uid in self.uids or not self.gids.isdisjoint(peer.groups())


def parse_tenants(text: str) -> dict[str, TenantRule]:
    """``NAME=PRINCIPAL[,PRINCIPAL...]`` entries separated by spaces; raises InvalidArgument."""
    rules: dict[str, TenantRule] = {}
    for entry in text.split():
        name, sep, principals = entry.partition("=")
        if not sep or not name or not principals:
            raise InvalidArgument(f"tenant entry {entry!r} is not NAME=PRINCIPAL[,PRINCIPAL...]")
        if name in rules:
            raise InvalidArgument(f"tenant {name!r} is listed twice")
        if name == ANONYMOUS or name.startswith("uid:"):
            raise InvalidArgument(f"tenant name {name!r} is reserved")
        uids, gids = set(), set()
        for p in principals.split(","):
            kind, _, value = p.partition(":")
            if kind in ("uid", "gid") and value.isdigit():
                (uids if kind == "uid" else gids).add(int(value))
            elif kind == "user" and value:
                uids.add(_resolve(pwd.getpwnam, value, "user").pw_uid)
            elif kind == "group" and value:
                gids.add(_resolve(grp.getgrnam, value, "group").gr_gid)
            else:
                raise InvalidArgument(f"tenant {name!r}: principal {p!r} is not uid:N, gid:N, user:NAME or group:NAME")
        rules[name] = TenantRule(frozenset(uids), frozenset(gids))
    return rules


def _resolve(lookup, value: str, what: str):
    try:
        return lookup(value)
    except KeyError:
        raise InvalidArgument(f"no {what} named {value!r}") from None


def tenant_for(claimed: str, peer: Peer | None, rules: dict[str, TenantRule]) -> str:
    """The tenant a hello gets: the claimed one if the peer may take it, its own if none claimed."""
    if not claimed:
        return f"uid:{peer.uid}" if peer is not None else ANONYMOUS
    rule = rules.get(claimed)
    if rule is None:
        raise Unauthorized(f"tenant {claimed!r} is not configured (the daemon's `tenants` key)")
    if peer is None:
        raise Unauthorized(f"tenant {claimed!r}: this connection carries no credentials (use the ipc socket)")
    if not rule.admits(peer):
        raise Unauthorized(f"tenant {claimed!r} is not open to uid {peer.uid} (gids {sorted(peer.groups())})")
    return claimed
