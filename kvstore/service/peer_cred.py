"""The local user behind a gRPC peer: the uid that owns the client's TCP socket.

grpc's Python API hands a servicer neither the socket nor its credentials
(what ``SO_PEERCRED`` gives a unix socket), only the peer's address. For a
client on this node that address is one end of a loopback (or local) TCP
connection, and the kernel's socket tables (``/proc/net/tcp``, ``tcp6``)
name the user owning that end. The store checks host memory a caller names
against that user (docs/design.md §1), so that it maps only what the caller
could have opened itself.
"""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path
from urllib.parse import unquote

TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
ESTABLISHED = "01"  # the st column of a connected socket

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def peer_uid(peer: str, tables: tuple[Path, ...] = TCP_TABLES) -> int | None:
    """The uid owning the connected socket at ``peer`` (``context.peer()``:
    ``ipv4:127.0.0.1:PORT``, ``ipv6:%5B::1%5D:PORT``) when that socket is on this
    node, in this network namespace; None for a remote client, an address of
    another kind, or one that two users' sockets share. An OSError reading a
    table (the store out of descriptors) is raised: the store's own shortage,
    no verdict on the caller. A table the kernel lacks (no IPv6) is skipped."""
    end = _parse_peer(peer)
    if end is None:
        return None
    uids = set()
    for table in tables:
        try:
            rows = table.read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 7 and fields[3] == ESTABLISHED and _decode(fields[1]) == end:
                uids.add(int(fields[7]))
    return uids.pop() if len(uids) == 1 else None


def _parse_peer(peer: str) -> tuple[Address, int] | None:
    """``context.peer()`` as an address and port. grpc writes the peer as a URI:
    an IPv6 one percent-encoded (``ipv6:%5B::1%5D:PORT``)."""
    kind, _, rest = unquote(peer).partition(":")
    host, _, port = rest.rpartition(":")
    if kind not in ("ipv4", "ipv6") or not port.isdigit():
        return None
    try:
        return _plain(ipaddress.ip_address(host.strip("[]"))), int(port)
    except ValueError:
        return None


def _decode(hex_end: str) -> tuple[Address, int] | None:
    """A socket table's ``ADDR:PORT``: the address as 32-bit words in host order
    (reversed on a little-endian host), the port big-endian."""
    addr, _, port = hex_end.partition(":")
    try:
        raw = bytes.fromhex(addr)
        if sys.byteorder == "little":  # the kernel prints each 32-bit word in host order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
        return _plain(ipaddress.ip_address(raw)), int(port, 16)
    except ValueError:
        return None


def _plain(address: Address) -> Address:
    """An IPv4-mapped IPv6 address as the IPv4 one (a dual-stack server sees a
    v4 client so, while the client's socket is in the v4 table)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address
