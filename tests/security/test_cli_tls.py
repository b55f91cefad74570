"""The CLI refuses plaintext on a non-loopback address unless --insecure, and
takes the TLS flags on servers and clients."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from kvstore.client.store_client import StoreClient

KVSTORE = [sys.executable, "-m", "kvstore"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*KVSTORE, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", ["serve", "router"])
def test_non_loopback_bind_without_tls_is_refused(command):
    result = run(command, "--host", "0.0.0.0", "--port", "0")
    assert result.returncode == 2
    assert "not loopback and no TLS" in result.stderr and "--insecure" in result.stderr


def test_non_loopback_bind_with_insecure_serves_and_warns():
    proc = subprocess.Popen(
        [*KVSTORE, "router", "--host", "0.0.0.0", "--port", "0", "--insecure"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "listening on 0.0.0.0:" in line
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "plaintext gRPC on 0.0.0.0 (--insecure)" in err


@pytest.mark.parametrize("command", ["router", "serve", "stats"])
def test_partial_tls_flags_are_refused_naming_them(pki, command):
    port = [] if command == "stats" else ["--port", "0"]
    result = run(command, "--tls-cert", pki.server.cert, *port)
    assert result.returncode == 2, result.stderr
    assert "missing: --tls-ca, --tls-key" in result.stderr and "Traceback" not in result.stderr


def test_client_commands_take_tls_flags(pki, tls_store):
    tls = pki.issue("tenant-a")
    flags = ["--tls-ca", tls.ca, "--tls-cert", tls.cert, "--tls-key", tls.key]
    result = run("stats", "--address", tls_store.address, *flags)
    assert result.returncode == 0, result.stderr
    refused = run("clear", "--address", tls_store.address, *flags)
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr
    plain = run("stats", "--address", tls_store.address, timeout=60)
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr
    assert StoreClient(tls_store.address, tls=tls).stats() is not None
