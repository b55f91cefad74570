"""Peer authentication on the UCX port: a cluster secret proven both ways before
any REQUEST is sent or served (docs/design.md §4, §8).

    secret = PeerSecret.load("/etc/kvstore/peer.secret")    # 0600, owned by this user
    PeerServer(source, host, port, secret=secret)            # checks every fetcher
    await fetch(address, namespace, hashes, sink, secret=secret)  # checks the peer

Each side proves it holds the secret with an HMAC-SHA256 over a label, its
role, the protocol version and both sides' fresh nonces::

    fetcher                                        peer
    HELLO [version, Nf]                      ─▶
                 ◀─ CHALLENGE [Np, mac(peer, Nf, Np)]
    check the peer's mac, else abort
    PROOF [mac(fetcher, Nf, Np)]             ─▶    check it, else abort (counted, logged)
    REQUEST ...                              ─▶

The role keeps one side's proof from passing as the other's, the nonces of
both sides bind each proof to this connection (a recorded exchange does not
replay), and proofs are compared with ``hmac.compare_digest``. The secret never
crosses the wire. What this does not give: privacy or integrity of the bytes
after the handshake against someone on the network path (§8).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import stat
from dataclasses import dataclass, field

from kvstore.transfer.errors import PeerTimeout, PeerUnauthenticated, PeerUnavailable, ProtocolError
from kvstore.transfer.ucx import Conn, frame_sends, recv_frame, send_frame
from kvstore.transfer.wire import (
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Kind,
    decode_challenge,
    decode_hello,
    decode_proof,
    encode_challenge,
    encode_hello,
    encode_proof,
)

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
FLAG = "--peer-secret-file"
_LABEL = b"kvstore-peer-auth"
_PEER = b"peer"
_FETCHER = b"fetcher"


@dataclass(frozen=True)
class PeerSecret:
    """The cluster's shared peer secret (never printed)."""

    key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not MIN_SECRET_BYTES <= len(self.key) <= MAX_SECRET_BYTES:
            raise ValueError(
                f"{FLAG}: the secret must be {MIN_SECRET_BYTES}..{MAX_SECRET_BYTES} bytes "
                f"(surrounding whitespace ignored), got {len(self.key)}; e.g. "
                "`head -c 32 /dev/urandom | base64 > FILE && chmod 600 FILE`"
            )

    @classmethod
    def load(cls, path: str) -> PeerSecret:
        """Read the secret from ``path``: a regular file (not a link), owned by this
        user, readable by nobody else; ValueError naming the flag and the fault."""
        try:  # no link followed; O_NONBLOCK: a FIFO planted there does not hang us
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            why = "is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
            raise ValueError(f"{FLAG} {path!r}: {why}") from None
        try:
            _check_private(path, os.fstat(fd))
            with os.fdopen(fd, "rb", closefd=False) as f:
                key = f.read(MAX_SECRET_BYTES + 1).strip()
        finally:
            os.close(fd)
        return cls(key)

    def mac(self, role: bytes, fetcher_nonce: bytes, peer_nonce: bytes) -> bytes:
        """The proof of ``role`` for the connection with these nonces (fixed length:
        the concatenation is unambiguous)."""
        version = PROTOCOL_VERSION.to_bytes(2, "little")
        message = b"".join([_LABEL, role, version, fetcher_nonce, peer_nonce])
        return hmac.new(self.key, message, hashlib.sha256).digest()

    def verify(self, role: bytes, fetcher_nonce: bytes, peer_nonce: bytes, mac: bytes) -> bool:
        return hmac.compare_digest(self.mac(role, fetcher_nonce, peer_nonce), mac)


def _check_private(path: str, st: os.stat_result) -> None:
    """A regular file of this user's that no one else may read."""
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{FLAG} {path!r}: not a regular file")
    if st.st_uid != os.geteuid():
        raise ValueError(
            f"{FLAG} {path!r}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
        )
    if st.st_mode & 0o077:
        raise ValueError(
            f"{FLAG} {path!r}: mode {stat.S_IMODE(st.st_mode):04o} lets other users read it; "
            "chmod 600 it"
        )


async def authenticate_peer(conn: Conn, secret: PeerSecret, deadline: float) -> None:
    """Fetcher side, on a fresh connection: check the peer's proof, then send ours.
    PeerUnauthenticated (the connection aborted) when the peer fails or refuses;
    PeerTimeout when it does not answer by ``deadline``."""
    mine = os.urandom(NONCE_BYTES)
    hello = frame_sends(conn, Kind.HELLO, encode_hello(mine))
    try:
        _, _, body = await recv_frame(conn, [Kind.CHALLENGE], deadline, after=hello)
        theirs, mac = decode_challenge(body)
    except PeerTimeout:
        raise
    except (ProtocolError, PeerUnavailable) as exc:
        conn.abort()
        raise PeerUnauthenticated(
            f"peer {conn.peer}: handshake failed (does it hold the cluster secret?): {exc}"
        ) from None
    if not secret.verify(_PEER, mine, theirs, mac):
        conn.abort()
        raise PeerUnauthenticated(f"peer {conn.peer} did not prove the cluster secret")
    await send_frame(
        conn, Kind.PROOF, deadline, body=encode_proof(secret.mac(_FETCHER, mine, theirs))
    )
    conn.authenticated = True


async def authenticate_fetcher(conn: Conn, secret: PeerSecret, deadline: float) -> None:
    """Serving side, before the first REQUEST: answer HELLO with our proof and a
    nonce, then check the fetcher's proof. Raises (ProtocolError, KVError) on any
    failure: a frame out of place, a wrong proof, a fetcher gone or late."""
    _, _, body = await recv_frame(conn, [Kind.HELLO], deadline)
    theirs = decode_hello(body)
    mine = os.urandom(NONCE_BYTES)
    challenge = frame_sends(
        conn, Kind.CHALLENGE, encode_challenge(mine, secret.mac(_PEER, theirs, mine))
    )
    _, _, body = await recv_frame(conn, [Kind.PROOF], deadline, after=challenge)
    if not secret.verify(_FETCHER, theirs, mine, decode_proof(body)):
        raise PeerUnauthenticated("the fetcher did not prove the cluster secret")
    conn.authenticated = True
