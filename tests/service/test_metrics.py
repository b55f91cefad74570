"""Prometheus /metrics of a real store server: the numbers its Stats RPC reports."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvstore._proto import store_pb2 as pb
from kvstore._proto import store_pb2_grpc as pb_grpc
from kvstore.client import KVLayer, StoreClient, kv_cache_shm
from kvstore.router.drops import DropCause
from kvstore.wire.events import StoreEvent
from tests.conftest import ServerThread, wait_for


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


def test_a_cut_off_events_subscriber_is_counted_in_stats_and_metrics():
    """An Events subscriber that falls behind is cut off; what it missed is in
    the Stats reply and in the store's /metrics counters, the same numbers."""
    server = ServerThread(pool_size=16 << 20, device="cpu", slab_bytes=4 << 20, metrics_port=0)
    shm = kv_cache_shm("kv_first", num_blocks=8, block_size=16, heads=2, head_dim=64)
    client = StoreClient(server.address)
    channel = grpc.insecure_channel(server.address)
    try:
        layer = KVLayer("model.layers.0.self_attn", shm.tensor, "kv_first", "NHD", shm)
        session = client.register("m", "fanout", [layer], block_size=16)
        ns = session.wait_sealed(timeout=30).final_namespace
        session.save([(1, 0)])
        port = server.server.metrics.port
        before = scrape(port)
        assert before["kvstore_store_events_dropped_total"] == 0
        assert before["kvstore_store_event_subscribers_cut_total"] == 0

        service = server.server.service
        service.event_queue_max = 2
        stream = pb_grpc.KVStoreStub(channel).Events(pb.EventsRequest(), timeout=60)
        assert next(stream).snapshot  # subscribed: the snapshot came

        def burst() -> None:  # five events in one loop step: the subscriber cannot keep up
            for h in range(900, 905):
                service.publish(StoreEvent("removed", ns, [h], "n0"))

        server.call(burst)
        with pytest.raises(grpc.RpcError) as cut:
            list(stream)
        assert cut.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        stats = client.stats()
        assert (stats.event_subscribers_cut, stats.events_dropped) == (1, 3)  # 2 queued + 1
        m = scrape(port)
        assert m["kvstore_store_event_subscribers_cut_total"] == stats.event_subscribers_cut
        assert m["kvstore_store_events_dropped_total"] == stats.events_dropped
        assert m["kvstore_store_requests_hits_total"] == stats.hits  # the node's, beside them
    finally:
        channel.close()
        client.close()
        server.stop()
        shm.close()


def test_a_standalone_router_serves_its_metrics():
    import subprocess
    import sys
    import time

    from kvstore.demo import free_ports

    port, metrics = free_ports(2)
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
        for cause in DropCause:  # each a counter, whatever cause is added
            assert m[f"kvstore_router_dropped_by_{cause.value}_total"] == 0
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_cut_stream_whose_client_stopped_reading_stays_counted_until_it_ends():
    """A subscriber cut for falling behind whose client stopped reading holds its
    handler at a write (its HTTP/2 window is full) until the stream ends. It
    must stay counted as open: the per-certificate stream cap counts the same
    streams, and a cut that uncounted it would let a tenant open streams
    without bound, each holding its handler and its buffered events."""
    server = ServerThread(pool_size=16 << 20, device="cpu", slab_bytes=4 << 20)
    shm = kv_cache_shm("kv_first", num_blocks=8, block_size=16, heads=2, head_dim=64)
    client = StoreClient(server.address)
    # no BDP probing: the window stays at its initial 64 KiB and fills
    channel = grpc.insecure_channel(server.address, options=[("grpc.http2.bdp_probe", 0)])
    try:
        layer = KVLayer("model.layers.0.self_attn", shm.tensor, "kv_first", "NHD", shm)
        session = client.register("m", "stalled", [layer], block_size=16)
        ns = session.wait_sealed(timeout=30).final_namespace
        session.save([(1, 0)])
        service = server.server.service
        service.event_queue_max = 2
        stream = pb_grpc.KVStoreStub(channel).Events(pb.EventsRequest(), timeout=120)
        assert next(stream).snapshot  # subscribed; then it reads nothing more
        wide = StoreEvent("removed", ns, list(range(1, 8193)), "n0")  # about 72 KiB encoded

        def one() -> None:
            service.publish(wide)

        deadline = time.monotonic() + 60
        while client.stats().event_subscribers_cut == 0:  # one event a loop step
            server.call(one)
            assert time.monotonic() < deadline, "the stalled stream was never cut"
        time.sleep(0.5)  # a handler that could reach its abort would have by now
        assert client.stats().event_subscribers == 1  # cut, but open: still counted
        stream.cancel()
        assert wait_for(lambda: client.stats().event_subscribers == 0)
    finally:
        channel.close()
        client.close()
        server.stop()
        shm.close()
