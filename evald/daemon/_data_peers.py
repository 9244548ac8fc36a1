"""Who pays for a data-path connection that has not authenticated yet: its peer process.

Why apart: the small pool of connections with no tenant yet (``data_unauthenticated_connections``)
is shared by everyone who can reach the socket, so when it is full the choice of whom to evict
decides whether a peer churning connections can starve another's. The rule
(:func:`choose_eviction`) is a pure function of the candidates' peers and ages, tested on its
own; :func:`peer_of` reads the peer from the kernel (``SO_PEERCRED``).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterable
from typing import Final, Protocol, TypeVar

__all__ = ["HELLO_GRACE_S", "Peer", "choose_eviction", "peer_of"]

#: A connection still without HELLO after this long may be closed to make room for a new one.
HELLO_GRACE_S: Final = 0.25

#: Who pays for an unauthenticated slot: the peer process, ``(pid, uid)`` from ``SO_PEERCRED``;
#: ``None`` where the platform does not say (then all peers share one account).
Peer = tuple[int, int] | None
_PEERCRED: Final = struct.Struct("3i")


def peer_of(sock: socket.socket) -> Peer:
    """The process at the other end of a unix socket, as the kernel saw it connect.

    The kernel records it at ``connect``, so a peer cannot claim another's identity. A peer
    that forks gets one account per process; among equals the HELLO grace still decides.
    """
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    try:
        pid, uid, _gid = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, option, _PEERCRED.size)
        )
    except OSError:
        return None
    return (pid, uid)


class _Candidate(Protocol):
    """What :func:`choose_eviction` reads of an unauthenticated connection."""

    @property
    def peer(self) -> Peer: ...
    @property
    def heard(self) -> bool: ...
    @property
    def accepted_at(self) -> float: ...


_C = TypeVar("_C", bound=_Candidate)


def choose_eviction(
    candidates: Iterable[_C], newcomer: Peer, now: float, grace_s: float
) -> _C | None:
    """The connection a new one from ``newcomer`` replaces when the unauthenticated pool is
    full, or ``None`` (then the new one is refused ``unavailable``).

    Who pays is the peer holding the most slots (a fair share: the newcomer counts the slot it
    wants). When that is the newcomer's own peer, which holds at least as many as anyone, it
    gives up its own oldest connection (the silent ones first): a peer churning connections
    evicts only its own, however fast. When another peer holds at least two more than the
    newcomer's, it gives up its oldest: it holds more than its share. When it holds just one
    more, evicting would only move a slot between equals, so only a connection that has sent
    nothing at all or whose HELLO has not arrived whole within ``grace_s`` is taken (a client
    sends its HELLO as it connects, so its connection is never the one evicted while it is read).
    """
    by_peer: dict[Peer, list[_C]] = {}
    for candidate in candidates:
        by_peer.setdefault(candidate.peer, []).append(candidate)
    if not by_peer:
        return None
    own = len(by_peer.get(newcomer, ()))
    if own and own >= max(len(held) for held in by_peer.values()):
        return min(by_peer[newcomer], key=lambda c: (c.heard, c.accepted_at))
    held = max(by_peer.values(), key=len)
    if len(held) >= own + 2:
        return min(held, key=lambda c: (c.heard, c.accepted_at))
    lapsed = [
        c
        for others in by_peer.values()
        if len(others) > own
        for c in others
        if not c.heard or now - c.accepted_at >= grace_s
    ]
    return min(lapsed, key=lambda c: (c.heard, c.accepted_at), default=None)
