"""A throwaway certificate authority for tests and benches (``cryptography``).

    pki = Pki(tmp_path)                    # a CA, and a server certificate for 127.0.0.1
    tls = pki.issue("tenant-a")            # TlsFiles whose certificate's CN is tenant-a
    server_tls = pki.server                # CN "store", SAN 127.0.0.1 and localhost

Every certificate is signed by one CA and usable as client and server (no
extended key usage). ``Pki(tmp, name="rogue")`` is another, unrelated CA.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvstore.wire.tls import TlsFiles

DAY = datetime.timedelta(days=1)


def _name(cn: str, *more: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, n) for n in (cn, *more)])


class Pki:
    def __init__(self, directory: Path, name: str = "kvstore-test-ca"):
        self.dir = Path(directory) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - DAY)
            .not_valid_after(now + DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.ca = self.dir / "ca.pem"
        self.ca.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))
        self.server = self.issue("store")

    def issue(self, cn: str, *more_cns: str, subject: x509.Name | None = None) -> TlsFiles:
        """A key and certificate with subject CN ``cn`` (SAN 127.0.0.1, localhost);
        ``more_cns``: further CN attributes after it, as some CAs issue; ``subject``:
        that whole subject instead (``cn`` then only names the files)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        san = x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject or _name(cn, *more_cns))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - DAY)
            .not_valid_after(now + DAY)
            .add_extension(san, critical=False)
            .sign(self._key, hashes.SHA256())
        )
        stem = "+".join((cn, *more_cns))
        cert_path, key_path = self.dir / f"{stem}.pem", self.dir / f"{stem}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        key_path.chmod(0o600)
        return TlsFiles(str(self.ca), str(cert_path), str(key_path))
