"""Where a component's TLS credentials are: one record for servers and clients.

    tls = TlsFiles.of(ca="ca.pem", cert="node.pem", key="node.key")  # None when all empty

Every gRPC hop (store server, router, StoreClient, RouterClient, the store's
router link, the router's store feeds) takes an optional :class:`TlsFiles`.
With one, both ends present a certificate signed by ``ca`` (mutual TLS) and
the caller's identity is its certificate's subject CN; without one the hop
is plaintext and every caller is the anonymous local identity
(``kvstore.wire.principal.LOCAL``). The gRPC credentials are built from it in
``kvstore.client.tls`` (channels) and ``kvstore.service.tls`` (servers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: the CA that signs every component, and this component's
    certificate chain and private key."""

    ca: str
    cert: str
    key: str

    @classmethod
    def of(cls, ca: str = "", cert: str = "", key: str = "") -> TlsFiles | None:
        """The record when all three are given, None when none is; ValueError
        naming what is missing otherwise (mutual TLS needs all three)."""
        given = {"ca": ca, "cert": cert, "key": key}
        if not any(given.values()):
            return None
        missing = [name for name, path in given.items() if not path]
        if missing:
            raise ValueError(
                f"TLS needs tls_ca, tls_cert and tls_key together; missing: {', '.join(missing)}"
            )
        return cls(str(ca), str(cert), str(key))

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(ca, cert, key) bytes; ValueError naming the file that cannot be read."""
        out = []
        for name in ("ca", "cert", "key"):
            path = getattr(self, name)
            try:
                out.append(Path(path).read_bytes())
            except OSError as exc:
                raise ValueError(f"tls_{name} {path!r}: {exc.strerror or exc}") from None
        return out[0], out[1], out[2]
