"""The UCX peer port's rules on the command line: the secret file must be this
user's alone, and TLS or a non-loopback host needs a secret (or --insecure)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import pytest

from kvstore.service.store_server import ServerConfig
from kvstore.transfer.handshake import PeerSecret

KVSTORE = [sys.executable, "-m", "kvstore"]
SERVE = ["serve", "--port", "0", "--device", "cpu", "--pool-size", "16MiB", "--no-router"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*KVSTORE, *args], capture_output=True, text=True, timeout=timeout)


def secret_file(tmp_path, content: bytes = b"0123456789abcdef0123", mode: int = 0o600) -> str:
    path = tmp_path / "peer.secret"
    path.write_bytes(content)
    path.chmod(mode)
    return str(path)


def tls_flags(tls) -> list[str]:
    return ["--tls-ca", tls.ca, "--tls-cert", tls.cert, "--tls-key", tls.key]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: secret_file(p, mode=0o644), "mode 0644 lets other users read it; chmod 600"),
        (lambda p: secret_file(p, mode=0o640), "mode 0640"),
        (lambda p: secret_file(p, content=b"short\n"), "must be 16..4096 bytes"),
        (lambda p: str(p / "missing"), "No such file"),
        (lambda p: str(p), "not a regular file"),
    ],
    ids=["world-readable", "group-readable", "too-short", "missing", "directory"],
)
def test_a_bad_secret_file_is_refused_naming_the_flag(tmp_path, make, message):
    result = run(*SERVE, "--peer-secret-file", make(tmp_path))
    assert result.returncode == 2, result.stderr
    assert "--peer-secret-file" in result.stderr and message in result.stderr, result.stderr


def test_a_symlinked_secret_file_is_refused(tmp_path):
    link = tmp_path / "link.secret"
    link.symlink_to(secret_file(tmp_path))
    with pytest.raises(ValueError, match="is a symbolic link"):
        PeerSecret.load(str(link))


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a file to another user needs root")
def test_a_secret_file_of_another_user_is_refused(tmp_path):
    path = secret_file(tmp_path)
    os.chown(path, 65534, 65534)
    with pytest.raises(ValueError, match="owned by uid 65534, not by this user"):
        PeerSecret.load(path)


def test_a_good_secret_file_loads_without_surrounding_whitespace(tmp_path):
    secret = PeerSecret.load(secret_file(tmp_path, content=b"  0123456789abcdef0123\n"))
    assert secret == PeerSecret(b"0123456789abcdef0123")


def test_tls_without_peer_secret_is_refused(pki):
    result = run(*SERVE, *tls_flags(pki.server))
    assert result.returncode == 2
    assert "TLS is configured but the UCX peer port has no authentication" in result.stderr
    assert "--peer-secret-file" in result.stderr and "--insecure" in result.stderr


def test_non_loopback_host_with_tls_needs_peer_secret(pki):
    result = run(*SERVE, "--host", "0.0.0.0", *tls_flags(pki.server))
    assert result.returncode == 2
    assert "--host 0.0.0.0 is not loopback but the UCX peer port" in result.stderr


def test_tls_with_peer_secret_serves(pki, tmp_path):
    proc = subprocess.Popen(
        [*KVSTORE, *SERVE, *tls_flags(pki.server), "--peer-secret-file", secret_file(tmp_path)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stderr:
            if "store server listening" in line or proc.poll() is not None:
                break
        assert "store server listening" in line, line
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


# ---- the rule itself, every case (ServerConfig.check_peer_exposure) --------------------


@pytest.mark.parametrize(
    "host, tls, secret, insecure, transfer, refused",
    [
        ("127.0.0.1", False, False, False, True, False),  # the zero-configuration default
        ("127.0.0.1", True, False, False, True, True),
        ("127.0.0.1", True, True, False, True, False),
        ("127.0.0.1", True, False, True, True, False),
        ("127.0.0.1", True, False, False, False, False),  # no UCX port at all
        ("0.0.0.0", False, False, False, True, True),
        ("0.0.0.0", False, False, True, True, False),
        ("0.0.0.0", False, True, False, True, False),
    ],
)
def test_peer_exposure_rule(pki, caplog, host, tls, secret, insecure, transfer, refused):
    config = ServerConfig(
        host=host,
        tls=pki.server if tls else None,
        peer_secret=PeerSecret(b"0123456789abcdef") if secret else None,
        insecure=insecure,
        transfer=transfer,
    )
    with caplog.at_level(logging.WARNING):
        if refused:
            with pytest.raises(ValueError, match="--peer-secret-file"):
                config.check_peer_exposure()
            return
        config.check_peer_exposure()
    warned = "UCX peer port without authentication (--insecure)" in caplog.text
    assert warned == (insecure and transfer and not secret)
