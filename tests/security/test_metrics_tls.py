"""Issue 12: /metrics of a TLS server is HTTPS and demands a client certificate of
the CA, like every gRPC call; without TLS it stays plain HTTP on --host."""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.demo import free_ports
from kvstore.testing.pki import Pki
from kvstore.wire.tls import TlsFiles
from tests.conftest import ServerThread


def https_scrape(port: int, ca: str, client: TlsFiles | None) -> dict[str, float]:
    context = ssl.create_default_context(cafile=ca)
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    url = f"https://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10, context=context) as reply:
        text = reply.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def refused(port: int, ca: str, client: TlsFiles | None) -> None:
    """The scrape fails at the TLS handshake (or the connection is dropped)."""
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        https_scrape(port, ca, client)


@pytest.fixture
def tls_metrics_store(pki):
    s = ServerThread(
        pool_size=16 << 20,
        device="cpu",
        slab_bytes=4 << 20,
        transfer=False,
        tls=pki.server,
        metrics_port=0,
    )
    yield s
    s.stop()


def test_store_metrics_need_a_client_certificate_of_the_ca(pki, tmp_path, tls_metrics_store):
    port = tls_metrics_store.server.metrics.port
    scraper = pki.issue("prometheus")
    m = https_scrape(port, str(pki.ca), scraper)
    assert "kvstore_store_pool_used_bytes" in m
    refused(port, str(pki.ca), None)  # no client certificate
    rogue = Pki(tmp_path, name="rogue").issue("prometheus")
    refused(port, str(pki.ca), rogue)  # a certificate of another CA
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):  # plain HTTP
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()


def test_a_tls_router_serves_metrics_over_https_only(pki):
    port, metrics = free_ports(2)
    tls = pki.server
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "router", "--port", str(port),
         "--metrics-port", str(metrics), "--log-level", "warning",
         "--tls-ca", tls.ca, "--tls-cert", tls.cert, "--tls-key", tls.key],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    scraper = pki.issue("prometheus")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                m = https_scrape(metrics, str(pki.ca), scraper)
                break
            except (OSError, ssl.SSLError):
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        assert m["kvstore_router_workers"] == 0
        refused(metrics, str(pki.ca), None)
    finally:
        proc.kill()
        proc.wait(timeout=10)
