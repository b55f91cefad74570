"""Every router replica ends with the index of a store's real sealed blocks
(docs/design.md §6): numbered batches, snapshots, resync, drops counted.

Real parts throughout: store servers and router replicas on real gRPC
(in this process, or as ``kvstore`` commands), a real etcd where replicas are
involved. A replica's index of a node is read through QueryPrefix one hash at
a time and compared with what the store itself says is sealed.
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from kvstore._proto import store_pb2 as pb
from kvstore._proto import store_pb2_grpc as pb_grpc
from kvstore.client.router_client import RouterClient
from kvstore.client.store_client import StoreClient
from kvstore.router.core import Router, RouterConfig
from kvstore.service.router_server import FeedSpecs
from kvstore.wire.events import STORED, StoreEvent
from tests.conftest import ServerThread, wait_for
from tests.membership.conftest import TTL_S, Blocks, RouterThread, prefix_known, wait_healthy
from tests.router.conftest import ServerThread as RouterServerThread

HASHES = [5100 + i for i in range(4)]
MORE = [5200 + i for i in range(4)]
BOGUS = [5900 + i for i in range(2)]
EVERY = HASHES + MORE + BOGUS


def held(router_address: str, namespace: str, node_id: str) -> set[int] | None:
    """The hashes of EVERY the router says ``node_id`` holds (None: no answer)."""
    out = set()
    for h in EVERY:
        depth = prefix_known(router_address, namespace, [h], node_id)
        if depth < 0:
            return None
        if depth:
            out.add(h)
    return out


def sealed(store_address: str, namespace: str) -> set[int]:
    """The hashes of EVERY the store itself holds sealed."""
    client = StoreClient(store_address)
    try:
        return {h for h in EVERY if client.query(namespace, [h]).prefix_blocks}
    finally:
        client.close()


def store_thread(node_id: str, **config) -> ServerThread:
    return ServerThread(
        pool_size=16 << 20, device="cpu", slab_bytes=4 << 20, node_id=node_id, **config
    )


@pytest.fixture
def replicas(etcd_config):
    started = [RouterThread(etcd_config) for _ in range(2)]
    yield started
    for replica in started:
        replica.stop()


def test_a_replica_out_of_step_resyncs_to_the_stores_sealed_set(etcd_config, replicas):
    """Two ways a replica's view of a node falls out of step, each repaired by
    the store's snapshot: (1) the replica lost the node's state at the same
    generation (as after a restart): the store's next batch is a gap; (2) a
    snapshot numbered ahead of the store's own batches (wrong blocks): the
    store's next batch is older than it. Both replicas end equal to the store."""
    r0, r1 = replicas
    store = store_thread("n0", etcd=etcd_config)
    blocks = None
    try:
        blocks = Blocks(store.address)
        ns = blocks.namespace
        blocks.save(HASHES)
        for r in replicas:
            assert wait_for(lambda r=r: held(r.address, ns, "n0") == set(HASHES), timeout=15)
        generation = r0.call(r0.router.peer_generations)["n0"]
        assert r1.call(r1.router.peer_generations)["n0"] == generation

        def lose_the_node() -> None:  # what a restarted replica knows of n0: nothing
            r0.router.remove_peer("n0", generation)
            r0.router.join_peer("n0", generation, store.address, "")

        r0.call(lose_the_node)
        assert held(r0.address, ns, "n0") == set()
        blocks.save(MORE, first_block=4)
        truth = sealed(store.address, ns)
        assert truth == set(HASHES + MORE)
        for r in replicas:
            assert wait_for(lambda r=r: held(r.address, ns, "n0") == truth, timeout=15), r.address
        gaps = r0.call(r0.router.stats)
        assert gaps.dropped_by.sequence_gap >= 1 and gaps.resyncs_requested >= 1

        # (2) A snapshot of blocks n0 does not hold, numbered past the store's feed.
        feed_seq = store.call(lambda: store.server.link.feeds[r0.address].seq)
        with RouterClient(r0.address) as client:
            reply = client.publish(
                [StoreEvent(STORED, ns, BOGUS, "n0")], "n0", generation, feed_seq + 1, True
            )
        assert reply.applied == 1 and held(r0.address, ns, "n0") == set(BOGUS)
        client = StoreClient(store.address)
        client.clear(ns)  # the store's next batch: older than that snapshot
        client.close()
        blocks.save(HASHES)
        truth = sealed(store.address, ns)
        assert truth == set(HASHES)
        for r in replicas:
            assert wait_for(lambda r=r: held(r.address, ns, "n0") == truth, timeout=15), r.address
        stale = r0.call(r0.router.stats)
        assert stale.dropped_by.stale_sequence >= 1
        assert stale.resyncs_requested > gaps.resyncs_requested
        assert stale.events_dropped == stale.dropped_by.total()
    finally:
        if blocks is not None:
            blocks.close()
        store.stop()


def test_a_paused_replica_converges_and_both_replicas_index_the_same(cluster):
    """Real processes: router1 is stopped (SIGSTOP) past its lease while the
    store clears and saves; once resumed it holds exactly the store's blocks,
    as router0 does."""
    servers = [cluster.router(f"router{i}") for i in range(2)]
    store, store_proc = cluster.store("s1")
    for address, proc in [*servers, (store, store_proc)]:
        wait_healthy(address, proc)
    routers = [address for address, _ in servers]
    blocks = Blocks(store)
    try:
        ns = blocks.namespace
        blocks.save(HASHES)
        for r in routers:
            assert wait_for(lambda r=r: held(r, ns, "s1") == set(HASHES), timeout=15), r
        paused = servers[1][1]
        os.kill(paused.pid, signal.SIGSTOP)
        try:
            client = StoreClient(store)
            client.clear(ns)
            client.close()
            blocks.save(MORE, first_block=4)
            truth = sealed(store, ns)
            assert truth == set(MORE)
            assert wait_for(lambda: held(routers[0], ns, "s1") == truth, timeout=15)
            time.sleep(TTL_S + 1)  # router1 misses batches and its lease
        finally:
            os.kill(paused.pid, signal.SIGCONT)
        for r in routers:
            assert wait_for(lambda r=r: held(r, ns, "s1") == truth, timeout=30), (
                f"{r}: {held(r, ns, 's1')} != {truth}\n{paused.tail()}"
            )
        assert held(routers[0], ns, "s1") == held(routers[1], ns, "s1")
        for r in routers:
            with RouterClient(r) as client:
                stats = client.stats()
            assert stats.events_dropped == sum(
                getattr(stats.dropped_by, f.name) for f in stats.dropped_by.DESCRIPTOR.fields
            )
    finally:
        blocks.close()


def test_the_events_stream_opens_with_a_snapshot_then_numbers_each_event():
    store = store_thread("n0")
    blocks = None
    channel = grpc.insecure_channel(store.address)
    try:
        blocks = Blocks(store.address)
        blocks.save(HASHES)
        call = pb_grpc.KVStoreStub(channel).Events(pb.EventsRequest(), timeout=60)
        first = next(call)
        assert (first.seq, first.snapshot) == (1, True)
        event = StoreEvent.decode(first.payload)
        assert (event.type, event.worker, set(event.block_hashes)) == (STORED, "n0", set(HASHES))
        blocks.save(MORE, first_block=4)
        live = next(call)
        assert (live.seq, live.snapshot) == (2, False)
        assert StoreEvent.decode(live.payload).block_hashes == MORE
        call.cancel()
    finally:
        channel.close()
        if blocks is not None:
            blocks.close()
        store.stop()


def test_a_subscriber_that_falls_behind_is_cut_off_counted_and_resyncs():
    """The store cuts off an Events subscriber whose queue overflows and counts
    what it did not deliver; the router following the store resubscribes, and
    the new stream's snapshot gives it the store's blocks again."""
    store = store_thread("n0")
    blocks = None
    served = None
    try:
        blocks = Blocks(store.address)
        ns = blocks.namespace
        blocks.save(HASHES)
        service = store.server.service
        service.event_queue_max = 2
        router = Router(RouterConfig())
        served = RouterServerThread(router, FeedSpecs(stores=(store.address,)))

        def indexed() -> int:
            return max((p.prefix_blocks for p in router.query_prefix(ns, HASHES)), default=0)

        assert wait_for(lambda: indexed() == 4, timeout=15)
        generation = router.peer_generations()["n0"]

        def burst() -> None:  # five events in one loop step: the subscriber cannot keep up
            for h in (BOGUS * 3)[:5]:
                service.publish(StoreEvent("removed", ns, [h], "n0"))

        store.call(burst)
        client = StoreClient(store.address)
        stats = client.stats()
        client.close()
        assert (stats.event_subscribers_cut, stats.events_dropped) == (1, 3)  # 2 queued + 1
        assert wait_for(lambda: router.peer_generations().get("n0", generation) != generation)
        assert wait_for(lambda: indexed() == 4, timeout=15)
    finally:
        if served is not None:
            served.stop()
        if blocks is not None:
            blocks.close()
        store.stop()
