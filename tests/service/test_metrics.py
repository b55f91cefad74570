"""Prometheus /metrics of a real store server: the numbers its Stats RPC reports."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import KVLayer, StoreClient, kv_cache_shm
from tests.conftest import ServerThread


def scrape(port: int, path: str = "/metrics") -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
        text = reply.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_follow_the_store_and_unknown_paths_are_404():
    server = ServerThread(pool_size=16 << 20, device="cpu", slab_bytes=4 << 20, metrics_port=0)
    shm = kv_cache_shm("kv_first", num_blocks=8, block_size=16, heads=2, head_dim=64)
    client = StoreClient(server.address)
    try:
        shm.tensor.copy_(torch.ones_like(shm.tensor))
        layer = KVLayer("model.layers.0.self_attn", shm.tensor, "kv_first", "NHD", shm)
        session = client.register("m", "metrics", [layer], block_size=16)
        ns = session.wait_sealed(timeout=30).final_namespace
        session.save([(1, 0), (2, 1)])
        held = client.query(ns, [1, 2, 3], lease=True)  # 2 hits, 1 miss, 2 pinned

        port = server.server.metrics.port
        m = scrape(port)
        stats = client.stats()
        assert m["kvstore_store_requests_hits_total"] == 2
        assert m["kvstore_store_requests_misses_total"] == 1
        assert m["kvstore_store_index_sealed_blocks"] == stats.sealed_blocks == 2
        assert m["kvstore_store_index_pinned_blocks"] == 2
        assert m["kvstore_store_requests_bytes_saved_total"] > 0
        assert m["kvstore_store_pool_used_bytes"] == stats.used_bytes
        client.release(held.lease_id)
        assert scrape(port)["kvstore_store_index_pinned_blocks"] == 0

        with pytest.raises(urllib.error.HTTPError) as err:
            scrape(port, "/other")
        assert err.value.code == 404
    finally:
        client.close()
        server.stop()
        shm.close()


def test_a_standalone_router_serves_its_metrics():
    import subprocess
    import sys
    import time

    from kvstore.demo import free_port

    port, metrics = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "router", "--port", str(port),
         "--metrics-port", str(metrics), "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                m = scrape(metrics)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        assert m["kvstore_router_workers"] == 0 and "kvstore_router_events_dropped_total" in m
    finally:
        proc.kill()
        proc.wait(timeout=10)
