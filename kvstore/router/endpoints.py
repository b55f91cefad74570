"""Which ZMQ event endpoints the router may connect to (docs/design.md §8).

A worker card names ``kv_events_endpoint``, and the router subscribes to it:
left open, any caller that may register a worker could make the router dial
any address. :class:`EndpointAllowList` is the operator's list of patterns
(``kvstore router --events-allow PATTERN``, repeatable), parsed once; a card
whose endpoint matches none is refused at registration with
PERMISSION_DENIED naming ``card.kv_events_endpoint`` (the card is well formed:
this router's policy, not the request, forbids it), and an endpoint that is
not a ZMQ ``tcp://`` or ``ipc://`` address is INVALID_ARGUMENT.

Patterns:

    tcp://HOST:PORT   HOST  an address (127.0.0.1, [::1]), a CIDR range
                            (10.0.0.0/8, [fd00::/8]), an exact host name
                            (events.internal, no wildcards), or * (any host)
                      PORT  a number, a range LOW-HIGH, or * (any port)
    ipc://GLOB        GLOB  matched against the socket path (fnmatch: * also
                            matches /); ipc://* allows every path

The default, :data:`LOOPBACK`, allows loopback and local sockets only, so a
single-node deployment needs no flag. Host names are never resolved here (no
DNS in the request path): a name is allowed only by a pattern naming it
exactly, except ``localhost``, which is loopback (ZMQ connects over IPv4 unless
told otherwise, so it is 127.0.0.1). An ipc path with a ``..`` component is
refused whatever the patterns.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.wire.errors import KVError, invalid
from kvstore.wire.principal import denied

FIELD = "card.kv_events_endpoint"
LOOPBACK = ("tcp://127.0.0.0/8:*", "tcp://[::1]:*", "tcp://localhost:*", "ipc://*")
LOCALHOST = ipaddress.ip_address("127.0.0.1")
_HOSTNAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*")
_Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Endpoint:
    """A ZMQ endpoint a card names, parsed: tcp (host, port) or ipc (path)."""

    scheme: str
    host: str = ""  # tcp: the host as written, lowercased, without brackets
    address: _Address | None = None  # tcp: the address the host names, when it is one
    port: int = 0
    path: str = ""  # ipc

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """ValueError saying what is wrong with ``text``."""
        scheme, sep, rest = text.partition("://")
        if not sep:
            raise ValueError("expected tcp://HOST:PORT or ipc://PATH")
        if scheme == "ipc":
            if not rest or ".." in rest.split("/"):
                raise ValueError("an ipc path, without '..' components, is needed")
            return cls("ipc", path=rest)
        if scheme != "tcp":
            raise ValueError(f"transport {scheme!r}: only tcp and ipc are followed")
        host, sep, port = rest.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("expected tcp://HOST:PORT with a port in 1-65535")
        host = _unbracket(host).lower()
        address = _address(host)
        if address is None and not _HOSTNAME.fullmatch(host):
            raise ValueError(f"host {host!r} is neither an address nor a host name")
        if host == "localhost":
            address = LOCALHOST
        return cls("tcp", host, address, int(port))


@dataclass(frozen=True)
class EndpointPattern:
    """One allowed set of endpoints; :meth:`parse` reads the syntax above."""

    text: str
    scheme: str
    network: _Network | None = None  # tcp: an address range
    host: str = ""  # tcp: an exact host name
    any_host: bool = False
    ports: tuple[int, int] = (1, 65535)
    path: str = ""  # ipc: a glob

    @classmethod
    def parse(cls, text: str) -> EndpointPattern:
        """ValueError naming the pattern and what is wrong with it."""
        try:
            return cls._parse(text)
        except ValueError as exc:
            raise ValueError(f"--events-allow {text!r}: {exc}") from None

    @classmethod
    def _parse(cls, text: str) -> EndpointPattern:
        scheme, sep, rest = text.partition("://")
        if scheme == "ipc" and sep and rest:
            return cls(text, "ipc", path=rest)
        if scheme != "tcp" or not sep:
            raise ValueError("expected tcp://HOST:PORT or ipc://GLOB")
        host, sep, port = rest.rpartition(":")
        if not sep or not host:
            raise ValueError("expected tcp://HOST:PORT (PORT may be * or LOW-HIGH)")
        ports = _ports(port)
        host = _unbracket(host).lower()
        if host == "*":
            return cls(text, "tcp", any_host=True, ports=ports)
        try:
            return cls(text, "tcp", network=ipaddress.ip_network(host, strict=False), ports=ports)
        except ValueError:
            pass
        if not _HOSTNAME.fullmatch(host):
            raise ValueError(f"host {host!r} is not *, an address, a CIDR range or a host name")
        return cls(text, "tcp", host=host, ports=ports)

    def matches(self, endpoint: Endpoint) -> bool:
        if endpoint.scheme != self.scheme:
            return False
        if self.scheme == "ipc":
            return fnmatch.fnmatchcase(endpoint.path, self.path)
        if not self.ports[0] <= endpoint.port <= self.ports[1]:
            return False
        if self.any_host or (self.host and self.host == endpoint.host):
            return True
        return (
            self.network is not None
            and endpoint.address is not None
            and endpoint.address.version == self.network.version
            and endpoint.address in self.network
        )


class EndpointAllowList:
    """The event endpoints a router may connect to; built once from patterns."""

    def __init__(self, patterns: Sequence[str] = LOOPBACK):
        """ValueError naming the first pattern that does not parse."""
        self.patterns = tuple(EndpointPattern.parse(p) for p in patterns)

    def __repr__(self) -> str:
        return f"EndpointAllowList({[p.text for p in self.patterns]})"

    def allows(self, endpoint: str) -> bool:
        """Whether ``endpoint`` is well formed and matches a pattern."""
        try:
            parsed = Endpoint.parse(endpoint)
        except ValueError:
            return False
        return any(p.matches(parsed) for p in self.patterns)

    def check(self, endpoint: str, field: str = FIELD) -> None:
        """Nothing for "" (no endpoint) or an allowed endpoint; else INVALID_ARGUMENT
        (malformed) or PERMISSION_DENIED (not allowed), naming ``field``."""
        if not endpoint:
            return
        try:
            parsed = Endpoint.parse(endpoint)
        except ValueError as exc:
            raise invalid(f"{field} {endpoint!r}: {exc}") from None
        if not any(p.matches(parsed) for p in self.patterns):
            raise _refused(field, endpoint, self.patterns)


def _refused(field: str, endpoint: str, patterns: Sequence[EndpointPattern]) -> KVError:
    allowed = ", ".join(p.text for p in patterns) or "none"
    return denied(
        f"{field} {endpoint!r} is not an event endpoint this router may connect to "
        f"(--events-allow: {allowed})"
    )


def _unbracket(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _address(host: str) -> _Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _ports(text: str) -> tuple[int, int]:
    if text == "*":
        return (1, 65535)
    low, _, high = text.partition("-")
    high = high or low
    if not (low.isdigit() and high.isdigit() and 0 < int(low) <= int(high) < 65536):
        raise ValueError(f"port {text!r} is not *, a port or LOW-HIGH within 1-65535")
    return (int(low), int(high))
