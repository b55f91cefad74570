"""A server's transport security: how it binds, and who each caller is.

    security = Security(TlsFiles.of(ca, cert, key), admins=("ops",))
    security.check_exposure(host, insecure=False)  # ValueError: public and plaintext
    port = security.bind(server, host_port(host, port))
    caller = security.principal(context)           # in a handler

With TLS the server demands a client certificate signed by the CA (mutual
TLS): a caller without one never gets a call through (the handshake fails,
UNAVAILABLE at the client). A caller's :class:`Principal` is its certificate's
subject CN, an admin when the CN is in ``admins``. Without TLS every caller is
``LOCAL`` (anonymous, trusted), which is only allowed on a loopback address
unless the operator says ``--insecure``.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
from dataclasses import dataclass

import grpc

from kvstore.wire.errors import Code, KVError
from kvstore.wire.principal import LOCAL, NodeBinding, Principal, TenantBinding
from kvstore.wire.tls import TlsFiles

log = logging.getLogger(__name__)

# Every kvstore gRPC server is built with these: its port is its own. gRPC sets
# SO_REUSEPORT by default, so a second server started on a port in use would
# bind it too, and the kernel would split callers between the two, silently.
BIND_OPTIONS = (("grpc.so_reuseport", 0),)


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 literal in brackets (``[::1]:50051``): gRPC reads
    a bare ``::1:50051`` as another address."""
    bare = host.strip("[]")
    try:
        literal_v6 = ipaddress.ip_address(bare).version == 6
    except ValueError:
        literal_v6 = False
    return f"[{bare}]:{port}" if literal_v6 else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """Does ``host`` (an address or a name) resolve to loopback addresses only?"""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


@dataclass(frozen=True)
class Security:
    """TLS files (None = plaintext), the CNs trusted as admin, the CNs bound
    to client namespaces and, on a router, the CNs of its store nodes."""

    tls: TlsFiles | None = None
    admins: tuple[str, ...] = ()
    stores: tuple[str, ...] = ()  # CNs that may act as store nodes; () = every caller
    # On a router: store CNs bound to the node ids they publish as (--store-node CN=NODE_ID)
    store_nodes: tuple[NodeBinding, ...] = ()
    # Tenants' CNs bound to their client namespaces (--tenant CN=NAMESPACE)
    tenants: tuple[TenantBinding, ...] = ()

    def check_exposure(self, host: str, insecure: bool) -> None:
        """Plaintext on a non-loopback address: ValueError unless ``insecure``,
        then a warning (anyone who reaches the port is trusted with everything).
        With TLS, ValueError naming a file that cannot be read, before any port
        is opened."""
        if self.tls is not None:
            self.tls.read()
            return
        if is_loopback(host):
            return
        if not insecure:
            raise ValueError(
                f"--host {host} is not loopback and no TLS is configured: anyone who can "
                "reach it could register, remove and clear anything. Give --tls-ca, "
                "--tls-cert and --tls-key, or --insecure on a network you trust"
            )
        log.warning(
            "serving plaintext gRPC on %s (--insecure): every caller that reaches it is "
            "trusted with everything",
            host,
        )

    def bind(self, server: grpc.aio.Server, address: str) -> int:
        """Add ``address`` to ``server`` (TLS when configured); the bound port.
        OSError saying why it cannot (e.g. the port is taken: servers are built
        with BIND_OPTIONS)."""
        try:
            if self.tls is None:
                port = server.add_insecure_port(address)
            else:
                ca, cert, key = self.tls.read()
                credentials = grpc.ssl_server_credentials(
                    [(key, cert)], root_certificates=ca, require_client_auth=True
                )
                port = server.add_secure_port(address, credentials)
        except RuntimeError as exc:  # grpcio's "Failed to bind to address ..."
            log.warning("gRPC could not bind %s: %s", address, exc)
            port = 0
        if port == 0:
            raise OSError(f"cannot bind {address}: {why_unbound(address)}")
        return port

    def principal(self, context: grpc.aio.ServicerContext) -> Principal:
        """Who is calling: its certificate CN with TLS, else LOCAL.
        UNAUTHENTICATED when a TLS caller's certificate names no CN."""
        if self.tls is None:
            return LOCAL
        auth = context.auth_context()
        names = auth.get("x509_common_name") or []
        name = names[0].decode() if names else ""
        if not name:
            raise KVError(Code.UNAUTHENTICATED, "client certificate has no subject CN")
        pem = auth.get("x509_pem_cert") or [b""]
        if len(subject_cns(pem[0])) != 1:  # gRPC names the first CN; other tools the last
            raise KVError(
                Code.UNAUTHENTICATED,
                "client certificate subject must hold exactly one readable CN (it has several CNs, "
                "or cannot be parsed): kvstore takes the caller's name from it",
            )
        store = not self.stores or name in self.stores
        return Principal(name, admin=name in self.admins, store=store)


PLAINTEXT = Security()


@functools.lru_cache(maxsize=1024)
def subject_cns(pem: bytes) -> tuple[str, ...]:
    """Every CN attribute of a certificate's subject, in any RDN (read with
    ``cryptography``, not from a printed subject, whose escapes and multi-valued
    RDNs hide some); () when ``pem`` is no certificate."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    try:  # the subject is parsed when read: an encoding cryptography refuses raises then
        cert = x509.load_pem_x509_certificate(pem)
        return tuple(str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME))
    except ValueError:
        return ()


def why_unbound(address: str) -> str:
    """Why gRPC could not bind ``address``, as a plain socket bind tells it: the
    address's error (in use, not ours, no such host), or, when it binds, that
    the TLS files are what gRPC refused (it says only "failed to bind")."""
    host, _, port = address.rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        for family, kind, proto, _, sockaddr in infos:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
                s.bind(sockaddr)
    except OSError as exc:
        return exc.strerror or str(exc)
    return "the address binds, so check the TLS certificate, key and CA files"
