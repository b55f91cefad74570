"""gRPC channels, plaintext or mutual TLS: the one place clients build them.

Every client of a store server or router (StoreClient, RouterClient, the
store's router link, the router's store feeds, the CLI) opens its channel
here. With :class:`~kvstore.wire.tls.TlsFiles` the channel verifies the
server's certificate against the CA (the address's host must be in the
server certificate's subjectAltName) and presents this component's own
certificate; without, it is plaintext (loopback use).
"""

from __future__ import annotations

import grpc

from kvstore.wire.tls import TlsFiles


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    ca, cert, key = tls.read()
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )


# A restarted server is found again within a second, not gRPC's default two
# minutes: calls fail fast until the channel's next connect attempt, and an
# attempt costs one refused connect.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def open_channel(address: str, tls: TlsFiles | None = None, options=None) -> grpc.Channel:
    """A blocking channel to ``address``."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, channel_credentials(tls), options=options)


def open_aio_channel(address: str, tls: TlsFiles | None = None, options=None) -> grpc.aio.Channel:
    """An asyncio channel to ``address``."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=options)
