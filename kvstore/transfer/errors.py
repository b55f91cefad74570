"""How a fetch fails: the peer is gone or late, or it broke the protocol."""

from __future__ import annotations

import logging

from kvstore.wire.errors import Code, KVError

log = logging.getLogger(__name__)


class PeerUnavailable(KVError):
    """The peer refused, broke the connection, died, or spoke nonsense."""

    def __init__(self, message: str):
        super().__init__(Code.UNAVAILABLE, message)


class PeerTimeout(KVError):
    """The peer did not finish within the fetch deadline."""

    def __init__(self, message: str):
        super().__init__(Code.DEADLINE_EXCEEDED, message)


class ProtocolError(Exception):
    """A frame that breaks the wire protocol (bad magic, kind, size or body)."""


class VersionMismatch(ProtocolError):
    """A frame of another protocol version (the peer is told which one we speak)."""


class PeerUnauthenticated(PeerUnavailable):
    """The peer did not prove the cluster secret (or refused our proof): no byte of
    it is accepted (docs/design.md §8)."""


class RmaFailed(PeerUnavailable):
    """A one-sided read failed after the reservation: it was aborted, or, when
    ``unsettled``, left reserved for good (a read may still land in it). The
    fetch may be retried two-sided. ``released``: the peer's lease was RELEASEd
    on the fetch's endpoint, which stays fit for the next fetch."""

    def __init__(self, message: str, unsettled: bool = False):
        super().__init__(message)
        self.unsettled = unsettled
        self.released = False
