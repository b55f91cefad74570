"""A stopping store server ends its long streams at once, UNAVAILABLE.

A rank's registration stream, a router's Events subscription and a worker's
session on the embedded router never end by themselves. Before: a SIGTERM
waited out the whole grace period for them (2 s for ``kvstore serve``), then
cancelled each, logging a CancelledError traceback per stream. Now each ends
UNAVAILABLE saying the server is shutting down (its client registers or
subscribes again once one answers), so the stop waits for none of them.

A real store server with an embedded router on a loopback port (in a thread);
its clients are real gRPC clients of this process.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from kvstore._proto import router_pb2, router_pb2_grpc, store_pb2, store_pb2_grpc
from kvstore.client import KVLayer, StoreClient, kv_cache_shm
from kvstore.router.core import Router, RouterConfig
from kvstore.service.router_server import ServedRouter
from kvstore.wire.card_proto import card_to_proto
from kvstore.wire.errors import Code, KVError
from tests.conftest import ServerThread, wait_for
from tests.router.conftest import card

GRACE_S = 20.0  # what a stream still open would hold the stop for


@pytest.fixture
def shm():
    made = kv_cache_shm("kv_first", 4, 16, 2, 64)
    yield made
    made.close()


def _ended(call) -> list:
    """Read ``call`` to its end on a thread; the list gets its RpcError (or None)."""
    outcome: list = []

    def drain():
        try:
            for _ in call:
                pass
            outcome.append(None)
        except grpc.RpcError as exc:
            outcome.append(exc)

    threading.Thread(target=drain, daemon=True).start()
    return outcome


def test_a_stopping_store_ends_registrations_subscriptions_and_worker_sessions(shm, caplog):
    store = ServerThread(
        ServedRouter(Router(RouterConfig())),
        pool_size=16 << 20,
        device="cpu",
        slab_bytes=4 << 20,
        transfer=False,
    )
    client = StoreClient(store.address)
    channel = grpc.insecure_channel(store.address)
    try:
        layer = KVLayer("model.layers.0.self_attn", shm.tensor, "kv_first", "NHD", shm)
        session = client.register("engine", "llama", [layer], block_size=16)
        session.wait_sealed(10)
        events = store_pb2_grpc.KVStoreStub(channel).Events(store_pb2.EventsRequest())
        worker = router_pb2_grpc.RouterStub(channel).WorkerSession(
            router_pb2.RegisterWorkerRequest(name="w", card=card_to_proto(card()))
        )
        assert next(worker).name == "w"
        events_end, worker_end = _ended(events), _ended(worker)

        store.run(store.server.stop(grace=GRACE_S), timeout=GRACE_S + 10)

        assert wait_for(lambda: session.error is not None and events_end and worker_end)
        assert session.error.code is Code.UNAVAILABLE, session.error
        assert "shutting down" in session.error.message, session.error
        for outcome in (events_end, worker_end):
            assert outcome[0].code() == grpc.StatusCode.UNAVAILABLE, outcome[0]
            assert "shutting down" in outcome[0].details()
        assert "CancelledError" not in caplog.text
    finally:
        channel.close()
        client.close()
        store.loop.call_soon_threadsafe(store.loop.stop)
        store.thread.join(timeout=5)


def test_a_stopping_store_takes_no_new_save_load_or_prefetch(shm):
    """The store's stop ends its peer port (unpinning the blocks peers were
    granted to read) before gRPC stops taking calls: a Prefetch let in meanwhile
    could evict those blocks and write their slots while a peer's one-sided read
    still lands (store review, LOW), as could a Load's peer fetch, and a rank's
    Save or Load was told NOT_FOUND (its registration just ended), not why.
    Once it begins to stop, each is UNAVAILABLE, shutting down, and changes
    nothing."""
    store = ServerThread(pool_size=16 << 20, device="cpu", slab_bytes=4 << 20, transfer=False)
    client = StoreClient(store.address)
    try:
        layer = KVLayer("model.layers.0.self_attn", shm.tensor, "kv_first", "NHD", shm)
        session = client.register("engine", "llama", [layer], block_size=16)
        session.wait_sealed(10)
        assert session.save([(1, 0)]).sealed == 1
        stored = client.stats().sealed_blocks

        store.loop.call_soon_threadsafe(store.server.service.end_streams)  # stop's first step
        for attempt in (
            lambda: session.save([(2, 1)]),
            lambda: session.load([(1, 1)]),
            lambda: client.prefetch(session.final_namespace, [2]),
        ):
            with pytest.raises(KVError) as refused:
                attempt()
            assert refused.value.code is Code.UNAVAILABLE, refused.value
            assert "shutting down" in refused.value.message
        assert client.stats().sealed_blocks == stored
    finally:
        client.close()
        store.stop()
