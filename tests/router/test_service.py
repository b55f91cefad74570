"""The gRPC service on a real loopback server: status codes, sessions, the
store-facing client, following a real store server's Events stream, and the
standalone command."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore._proto import router_pb2, router_pb2_grpc
from kvstore.cli.router import add_router_arguments, build_served_router
from kvstore.client.router_client import RouterClient
from kvstore.router.vllm_events import BlockEvent
from kvstore.service.router_server import FeedSpecs
from kvstore.wire.card import WorkerCard
from kvstore.wire.card_proto import card_from_proto, card_to_proto
from kvstore.wire.errors import Code, KVError
from kvstore.wire.events import StoreEvent
from kvstore.wire.hashing import block_hashes
from tests.router.conftest import card

NS = "tenant.0123456789abcdef"
ROOT = Path(__file__).resolve().parents[2]


def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.02)


def test_card_round_trips_through_proto():
    c = card(
        aliases=["a", "b"],
        needs=["n"],
        multimodal=["qwen-video"],
        lora=True,
        lora_base="base",
        extra_files={"x.json": "1"},
        node_id="n1",
        final_namespace=NS,
    )
    assert card_from_proto(card_to_proto(c)) == c


def test_card_proto_carries_every_card_field():
    """A new card field must be added to the proto and to its codec."""
    card_fields = {f.name for f in fields(WorkerCard)}
    assert {f.name for f in router_pb2.WorkerCard.DESCRIPTOR.fields} == card_fields
    assert card_from_proto(router_pb2.WorkerCard(display_name="m", kv_block_size=16)) == (
        WorkerCard("m", 16)
    )


def test_register_route_done_over_grpc(served):
    router, client, _ = served
    reply = client.register_worker("w0", card(address="10.0.0.1:8000"))
    assert (reply.generation, reply.model, reply.role, reply.members) == (
        1,
        "llama-8b",
        "decode",
        1,
    )
    assert len(reply.semantics_id) == 16 and len(reply.scope_id) == 16
    client.register_worker("w1", card(source_path="/mnt/elsewhere"))
    w0 = router.admission.workers["w0"]
    tokens = list(range(64))
    router.apply_worker_events(w0.ref, [BlockEvent("stored", block_hashes(tokens, 16))])
    r = client.route("llama-8b", token_ids=tokens, request_id="req-1")
    assert (r.worker, r.address, r.overlap_blocks, r.total_blocks, r.request_id) == (
        "w0",
        "10.0.0.1:8000",
        4,
        4,
        "req-1",
    )
    assert r.reason.startswith("w0: ttft 0.0 ms = (0 queued + 0 uncached)")
    assert "4/4 blocks cached" in r.reason
    assert client.stats().active_requests == 1
    client.request_started("req-1")
    client.request_finished("req-1", cached_blocks=4)
    client.request_finished("req-1")  # unknown now: no error
    stats = client.stats()
    assert (stats.active_requests, stats.hit_reports, stats.hit_blocks_reported) == (0, 1, 4)
    assert client.remove_worker("w1")
    assert client.stats().workers == 1


def test_rejection_and_bad_input_statuses(served):
    router, client, _ = served
    client.register_worker("ok", card())
    with pytest.raises(KVError) as err:
        client.register_worker("bad", card(tokenizer_checksum="tok-2", context_length=8))
    assert err.value.code == Code.FAILED_PRECONDITION
    assert "tokenizer_checksum" in err.value.message and "context_length" in err.value.message
    with pytest.raises(KVError) as err:
        client.register_worker("bad", card(namespace="has.dot"))
    assert err.value.code == Code.INVALID_ARGUMENT
    assert "card.namespace" in err.value.message
    with pytest.raises(KVError) as err:
        client.register_worker("", card())
    assert err.value.code == Code.INVALID_ARGUMENT and "name" in err.value.message
    with pytest.raises(KVError) as err:
        client.route("no-such-model")
    assert err.value.code == Code.NOT_FOUND
    with pytest.raises(KVError) as err:
        client.route("llama-8b", token_ids=[1] * 16, hashes=[1])
    assert err.value.code == Code.INVALID_ARGUMENT
    with pytest.raises(KVError) as err:
        client.remove_worker("ghost")
    assert err.value.code == Code.NOT_FOUND
    with pytest.raises(KVError) as err:  # was echoed whole: RESOURCE_EXHAUSTED, naming nothing
        client.remove_worker("g" * 20_000)
    assert err.value.code == Code.INVALID_ARGUMENT and "name" in err.value.message
    assert list(router.admission.workers) == ["ok"]


def test_worker_session_ends_with_the_call(served):
    router, _, server = served
    channel = grpc.insecure_channel(server.address)
    stub = router_pb2_grpc.RouterStub(channel)
    call = stub.WorkerSession(
        router_pb2.RegisterWorkerRequest(name="s", card=card_to_proto(card()))
    )
    first = next(call)
    assert first.name == "s" and first.generation >= 1
    assert "s" in router.admission.workers
    call.cancel()
    wait_for(lambda: "s" not in router.admission.workers)
    channel.close()


def test_rejected_session_gets_the_status(served):
    _, client, server = served
    client.register_worker("ok", card())
    with grpc.insecure_channel(server.address) as channel:
        call = router_pb2_grpc.RouterStub(channel).WorkerSession(
            router_pb2.RegisterWorkerRequest(name="bad", card=card_to_proto(card(kv_block_size=32)))
        )
        with pytest.raises(grpc.RpcError) as err:
            next(call)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "kv_block_size" in err.value.details()


def test_reported_load_steers_routes_over_grpc(served):
    router, client, _ = served
    hot = client.register_worker("hot", card())
    client.register_worker("cold", card())
    tokens = list(range(128))
    router.apply_worker_events(
        router.admission.workers["hot"].ref,
        [BlockEvent("stored", block_hashes(tokens, 16))],
    )
    assert hot.generation >= 1
    r = client.route("llama-8b", token_ids=tokens, track=False)
    assert (r.worker, r.ttft_ms, r.load_reported) == ("hot", 0.0, False)
    client.report_load("hot", queued_prefill_tokens=4096, running_requests=3, kv_usage=0.5)
    r = client.route("llama-8b", token_ids=tokens, request_id="q")
    assert (r.worker, r.queued_tokens, r.uncached_tokens, r.running_requests) == ("cold", 0, 128, 0)
    assert r.ttft_ms == pytest.approx(128 * 0.04) and not r.load_reported
    assert "next hot ttft 166.8 ms" in r.reason  # 4096 x 0.04 + 3 x 1
    assert client.stats().load_reports == 1


@pytest.mark.parametrize(
    "message, field",
    [
        (router_pb2.ReportLoadRequest(worker=""), "worker"),
        (router_pb2.ReportLoadRequest(worker="w", queued_prefill_tokens=1 << 41), "queued_prefill"),
        (router_pb2.ReportLoadRequest(worker="w", running_requests=1 << 30), "running_requests"),
        (router_pb2.ReportLoadRequest(worker="w", kv_usage=1.5), "kv_usage"),
        (router_pb2.ReportLoadRequest(worker="w", kv_usage=float("nan")), "kv_usage"),
        (router_pb2.RequestStartedRequest(request_id="r" * 300), "request_id"),
        (router_pb2.RequestFinishedRequest(request_id="r" * 300), "request_id"),
        (router_pb2.RequestFinishedRequest(request_id="q", cached_blocks=1 << 20), "cached_blocks"),
    ],
)
def test_load_and_life_cycle_rpcs_reject_bad_fields_and_change_nothing(served, message, field):
    _, client, server = served
    client.register_worker("w", card())
    client.route("llama-8b", hashes=[1, 2], request_id="q")
    before = client.stats()
    with grpc.insecure_channel(server.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        method = getattr(stub, type(message).__name__.removesuffix("Request"))
        with pytest.raises(grpc.RpcError) as err:
            method(message, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    assert client.stats() == before
    r = client.route("llama-8b", hashes=[1, 2], track=False)
    assert (r.queued_tokens, r.running_requests, r.load_reported) == (32, 0, False)


def test_load_of_an_unknown_worker_is_not_found(served):
    _, client, _ = served
    with pytest.raises(KVError) as err:
        client.report_load("ghost", 0, 0)
    assert err.value.code == Code.NOT_FOUND and "ghost" in err.value.message


def test_store_client_advertise_publish_query(served):
    router, client, _ = served
    gen = client.advertise_peer("node-a", "127.0.0.1:50051", "127.0.0.1:13337", [NS])
    hashes = [5, 6, 7]
    reply = client.publish([StoreEvent("stored", NS, hashes, "node-a")])
    assert (reply.applied, reply.dropped) == (1, 0)
    with RouterClient(client.address) as other:
        other.advertise_peer("node-b", "127.0.0.1:50052", "", [NS])
        other.publish([StoreEvent("stored", NS, hashes[:1], "node-b")])
    got = client.query_prefix(NS, hashes)
    assert [(p.node_id, p.prefix_blocks, p.ucx_address) for p in got] == [
        ("node-a", 3, "127.0.0.1:13337"),
        ("node-b", 1, ""),
    ]
    assert [p.node_id for p in client.query_prefix(NS, hashes, exclude_node_id="node-a")] == [
        "node-b"
    ]
    assert client.query_prefix("tenant.ffffffffffffffff", hashes) == []
    # A restart (new advertisement) makes the old generation stale: said, not
    # answered OK with the events dropped (the store advertises again at once).
    client.advertise_peer("node-a", "127.0.0.1:50051", "127.0.0.1:13337", [NS])
    with pytest.raises(KVError) as err:
        client.publish([StoreEvent("stored", NS, hashes, "node-a")], generation=gen)
    assert err.value.code == Code.NOT_FOUND
    assert f"node_id 'node-a' generation {gen} is not advertised" in err.value.message
    assert router.stats().dropped_by.stale_generation == 1
    with pytest.raises(KVError) as err:
        client.publish([b"\x00not msgpack map"])
    assert err.value.code == Code.INVALID_ARGUMENT and "events[0]" in err.value.message
    with pytest.raises(KVError) as err:
        client.query_prefix("no-fingerprint", hashes)
    assert err.value.code == Code.INVALID_ARGUMENT
    assert "final_namespace" in err.value.message
    assert router.stats().peers == 2


def test_router_follows_a_real_store_servers_event_stream(served):
    """The store server's own Events RPC (kvstore.service.store_server.StoreServer)
    feeds the router; when the store goes away its blocks go with it."""
    server_mod = pytest.importorskip("kvstore.service.store_server")
    router, client, server = served

    async def start_store():
        store = server_mod.StoreServer(
            server_mod.ServerConfig(
                port=0, device="cpu", pool_size=1 << 20, slab_bytes=64 << 10, node_id="store-1"
            )
        )
        await store.start()
        return store

    store = server.call(start_store)
    try:
        server.loop.call_soon_threadsafe(server.served.follow_store, f"127.0.0.1:{store.port}")
        hashes = [41, 42, 43]

        def publish_until_seen():
            deadline = time.monotonic() + 20
            while not router.query_prefix(NS, hashes):
                assert time.monotonic() < deadline, "router never saw the store's events"
                server.loop.call_soon_threadsafe(
                    store.service.publish, StoreEvent("stored", NS, hashes, "store-1")
                )
                time.sleep(0.05)

        publish_until_seen()
        got = client.query_prefix(NS, hashes)
        assert [(p.node_id, p.prefix_blocks) for p in got] == [("store-1", 3)]
        assert got[0].store_address == f"127.0.0.1:{store.port}"
    finally:
        server.call(lambda: store.stop(grace=0))
    wait_for(lambda: router.query_prefix(NS, [41]) == [])


# -- the command line --


def test_flags_standalone_and_embedded():
    p = argparse.ArgumentParser()
    add_router_arguments(p)
    args = p.parse_args(
        [
            "--identity",
            "r1",
            "--prefill-ms-per-token",
            "0.025",
            "--decode-interference-ms",
            "2.5",
            "--load-staleness",
            "0.5",
            "--temperature",
            "0.1",
            "--zmq-endpoint",
            "w=tcp://127.0.0.1:5557",
            "--store",
            "127.0.0.1:50051",
        ]
    )
    assert (args.host, args.port) == ("127.0.0.1", 50061)
    served = build_served_router(args)
    config = served.router.config
    assert config.identity.value == "r1"
    scoring = config.scoring
    assert (scoring.prefill_ms_per_token, scoring.decode_interference_ms) == (0.025, 2.5)
    assert (scoring.load_staleness_s, scoring.temperature) == (0.5, 0.1)
    assert served.feeds == FeedSpecs(
        vllm=(("w", "tcp://127.0.0.1:5557"),), stores=("127.0.0.1:50051",)
    )
    for action in p._actions:
        assert action.help, action.dest
    embedded = argparse.ArgumentParser()
    embedded.add_argument("--host")
    embedded.add_argument("--port")
    add_router_arguments(embedded, embedded=True)  # no clash with the host command's flags
    assert embedded.parse_args(["--no-router"]).no_router
    for flag in ("--temperature", "--prefill-ms-per-token", "--load-staleness"):
        with pytest.raises(ValueError, match=flag):
            build_served_router(p.parse_args([flag, "-1"]))
    with pytest.raises(ValueError, match="--decode-interference-ms"):
        build_served_router(p.parse_args(["--decode-interference-ms", "nan"]))
    with pytest.raises(ValueError, match="--zmq-endpoint"):
        build_served_router(p.parse_args(["--zmq-endpoint", "tcp://x:1"]))
    with pytest.raises(ValueError, match="--zmq-endpoint"):
        build_served_router(p.parse_args(["--zmq-endpoint", "w="]))


def test_standalone_router_serves_health_and_stops_on_sigterm():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "router", "--port", "0", "--log-level", "WARNING"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line, line + proc.stderr.read()
        address = line.strip().rsplit(" ", 1)[-1]
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "kvstore.v1.Router"):
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stats = router_pb2_grpc.RouterStub(channel).RouterStats(
                router_pb2.RouterStatsRequest(), timeout=10
            )
            assert stats.workers == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
