"""The local user behind a gRPC peer: the uid that owns the client's TCP socket.

grpc's Python API hands a servicer neither the socket nor its credentials
(what ``SO_PEERCRED`` gives a unix socket), only the peer's address. For a
client on this node that address is one end of a loopback (or local) TCP
connection, and the kernel's socket tables (``/proc/net/tcp``, ``tcp6``)
name the user owning that end. The store checks host memory a caller names
against that user (docs/design.md §1), so that it maps only what the caller
could have opened itself.

The kernel is asked through netlink (``sock_diag``), with a filter on the
caller's port run in the kernel: about 10 ms with 10,000 sockets on the node,
where reading and parsing ``/proc/net/tcp`` took about 100 ms on the store's
event loop. Where netlink is refused (a sandbox), the tables are read instead.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
import sys
from pathlib import Path
from urllib.parse import unquote

TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
ESTABLISHED = "01"  # the st column of a connected socket

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def peer_uid(peer: str, tables: tuple[Path, ...] = TCP_TABLES, netlink: bool = True) -> int | None:
    """The uid owning the connected socket at ``peer`` (``context.peer()``:
    ``ipv4:127.0.0.1:PORT``, ``ipv6:%5B::1%5D:PORT``) when that socket is on this
    node, in this network namespace; None for a remote client, an address of
    another kind, or one that two users' sockets share. Asked through netlink
    (``netlink=False``: the ``tables`` only), the tables where netlink is refused.
    The store out of descriptors raises OSError: its own shortage, no verdict on
    the caller. A table the kernel lacks (no IPv6) is skipped."""
    end = _parse_peer(peer)
    if end is None:
        return None
    uids = None
    if netlink:
        try:
            uids = _netlink_uids(end)
        except OSError as exc:
            if exc.errno in SHORTAGES:
                raise
    if uids is None:
        uids = _table_uids(end, tables)
    return uids.pop() if len(uids) == 1 else None


def _table_uids(end: tuple[Address, int], tables: tuple[Path, ...]) -> set[int]:
    """The users of the connected sockets at ``end``, from the kernel's tables."""
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
    return uids


# sock_diag (linux/sock_diag.h, linux/inet_diag.h): one dump a family of the
# connected TCP sockets whose local port is the caller's, filtered in the kernel.
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_REQ_BYTECODE = 1
INET_DIAG_BC_S_EQ = 11  # the socket's local port equals the next op's ``no``
TCP_ESTABLISHED = 1
NLMSG_HEADER = struct.Struct("=IHHII")  # length, type, flags, seq, pid
DIAG_REQUEST = struct.Struct("=BBBBI48x")  # family, protocol, ext, pad, states, sockid
DIAG_MESSAGE = struct.Struct("=BBBB2x2x16s16s4x8x4x4x4xI4x")  # ... src, dst, ..., uid, inode
SHORTAGES = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS)
RECV_BYTES = 1 << 16


def _netlink_uids(end: tuple[Address, int]) -> set[int]:
    """The users of the connected sockets at ``end``, from the kernel's
    ``sock_diag``; OSError where netlink is refused or fails."""
    address, port = end
    uids = set()
    with socket.socket(
        socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG
    ) as link:
        for family in (socket.AF_INET, socket.AF_INET6):
            link.sendall(_dump_request(family, port))
            for local, uid in _replies(link):
                if _plain(ipaddress.ip_address(local)) == address:
                    uids.add(uid)
    return uids


def _dump_request(family: int, port: int) -> bytes:
    """A dump of ``family``'s established TCP sockets whose local port is ``port``:
    the filter's one test jumps to its end when true (accepted) and 4 bytes past
    it when false (refused)."""
    test = struct.pack("=BBH", INET_DIAG_BC_S_EQ, 8, 12) + struct.pack("=BBH", 0, 0, port)
    body = DIAG_REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << TCP_ESTABLISHED)
    body += struct.pack("=HH", 4 + len(test), INET_DIAG_REQ_BYTECODE) + test
    header = NLMSG_HEADER.pack(
        NLMSG_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0
    )
    return header + body


def _replies(link: socket.socket):
    """Each answered socket's local address (packed) and uid, until the dump ends."""
    while True:
        data = link.recv(RECV_BYTES)
        if not data:
            raise OSError(errno.EPROTO, "sock_diag: the kernel ended the dump unannounced")
        at = 0
        while at + NLMSG_HEADER.size <= len(data):
            length, kind, _, _, _ = NLMSG_HEADER.unpack_from(data, at)
            if length < NLMSG_HEADER.size:
                raise OSError(errno.EPROTO, "sock_diag: a message shorter than its header")
            if kind == NLMSG_DONE:
                return
            if kind == NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", data, at + NLMSG_HEADER.size)
                raise OSError(-code, f"sock_diag: {os.strerror(-code)}")
            family, _, _, _, src, _, uid = DIAG_MESSAGE.unpack_from(data, at + NLMSG_HEADER.size)
            yield src[: 4 if family == socket.AF_INET else 16], uid
            at += (length + 3) & ~3


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
