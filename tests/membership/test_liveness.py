"""Leases an overloaded process cannot lose, leases lost anyway, and what survives them.

Real etcd, real router replicas and store servers on loopback (each on its own
event loop in a thread, so a test can occupy that loop), the real cluster link.
A loop is made busy with CPU-bound Python, as event ingest makes it, for three
TTLs: its process must keep every lease (no key of it re-created).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from kvstore.client.router_client import RouterClient
from kvstore.membership.etcd import Etcd, is_lease_gone
from kvstore.membership.keeper import THREAD_NAME, LeaseKeeper
from kvstore.membership.lease import LEASE_TRIES, KeyLease
from kvstore.testing.cluster_nodes import MODEL, ClusterShape, SimStore
from kvstore.wire.errors import Code, KVError
from tests.conftest import ServerThread, wait_for
from tests.membership.conftest import TTL_S, RouterThread, StallingRelay, etcd_keys, etcd_read

BUSY_S = 3 * TTL_S


def keys(config) -> dict[str, tuple[int, int, int]]:
    """Every key -> (create revision, mod revision, lease): any re-registration changes it."""
    return {k: (e.create_revision, e.mod_revision, e.lease) for k, e in etcd_keys(config).items()}


def occupy(loop: asyncio.AbstractEventLoop, seconds: float) -> None:
    """Run CPU-bound Python on ``loop`` for ``seconds`` and wait until it is done."""
    done = threading.Event()

    def spin() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sum(range(1000))
        done.set()

    loop.call_soon_threadsafe(spin)
    assert done.wait(seconds + 30)


def keeper_threads() -> int:
    return sum(t.name == THREAD_NAME for t in threading.enumerate())


@pytest.fixture
def replica(etcd_config):
    r = RouterThread(etcd_config)
    client = RouterClient(r.address, timeout_s=10)
    yield r, client
    client.close()
    r.stop()


def test_a_replica_whose_loop_is_busy_past_the_ttl_keeps_its_lease_and_its_workers(
    etcd_config, replica
):
    router, client = replica
    shape = ClusterShape(stores=1, workers=2, gpu_blocks=4, history_blocks=8)
    for j in range(2):
        client.register_worker(shape.worker(j), shape.card(j))
    before = keys(etcd_config)
    assert sum(k.startswith("workers/") for k in before) == 2
    occupy(router.loop, BUSY_S)
    assert keys(etcd_config) == before  # nothing expired, nothing registered again
    admitted = {k.removeprefix("workers/"): v[1] for k, v in before.items() if "workers/" in k}
    assert router.call(router.router.worker_generations) == admitted


def test_a_store_whose_loop_is_busy_past_the_ttl_keeps_its_lease(etcd_config):
    store = ServerThread(
        pool_size=16 << 20, device="cpu", slab_bytes=4 << 20, node_id="s1", etcd=etcd_config
    )
    try:
        before = keys(etcd_config)
        assert list(before) == ["stores/s1"]
        occupy(store.loop, BUSY_S)
        assert keys(etcd_config) == before
    finally:
        store.stop()
    assert etcd_keys(etcd_config) == {}  # a clean stop revokes at once


def test_a_stopped_replica_revokes_its_leases_and_leaves_no_keeper_thread(etcd_config):
    threads = keeper_threads()
    router = RouterThread(etcd_config)
    with RouterClient(router.address, timeout_s=10) as client:
        client.register_worker("w", ClusterShape(1, 1, 4, 8).card(0))
    assert keeper_threads() == threads + 1
    router.stop()
    leased = [k for k, e in etcd_keys(etcd_config).items() if e.lease]
    assert leased == []  # revoked, not left to expire (the set's card lives without a lease)
    assert keeper_threads() == threads


def test_a_lease_lost_anyway_is_granted_again_with_everything_registered(etcd_config, replica):
    router, client = replica
    admitted = client.register_worker("w", ClusterShape(1, 1, 4, 8).card(0))
    before = etcd_keys(etcd_config)
    lost = {before["workers/w"].lease, next(e.lease for k, e in before.items() if "routers/" in k)}
    for lease in lost:  # as if the process had been silent past the TTL
        etcd_read(etcd_config, lambda etcd, lease=lease: etcd.revoke(lease))

    def registered_again() -> bool:
        now = etcd_keys(etcd_config)
        return (
            len(now) == len(before)
            and "workers/w" in now
            and not {e.lease for e in now.values() if e.lease} & lost
        )

    assert wait_for(registered_again, timeout=5 * TTL_S)
    generation = etcd_keys(etcd_config)["workers/w"].mod_revision
    assert generation > admitted.generation
    assert wait_for(lambda: router.call(router.router.worker_generations) == {"w": generation})


def test_a_lease_gone_before_its_keys_are_written_is_replaced_by_a_fresh_one(etcd_config):
    key = etcd_config.prefix + "stores/x"

    async def go():
        etcd, keeper = Etcd(etcd_config), LeaseKeeper(etcd_config, "test")
        granted: list[int] = []

        async def register(lease: int) -> int:  # the first lease expires before the write
            granted.append(lease)
            if len(granted) == 1:
                await etcd.revoke(lease)
            return await etcd.recreate(key, b"x", lease)

        held = KeyLease(etcd, keeper, register, "store x")
        try:
            generation = await held.register()
            entry = await etcd.get(key)
            return granted, held.lease, generation, entry
        finally:
            await held.release()
            await keeper.aclose()
            await etcd.close()

    granted, lease, generation, entry = asyncio.run(go())
    assert len(granted) == 2 and lease == granted[1]
    assert (entry.lease, entry.create_revision) == (granted[1], generation)


def test_an_etcd_endpoint_that_hangs_does_not_lapse_a_lease_of_the_shortest_ttl(etcd_config):
    """The keeper's endpoint stops answering on its open connection: the refresh
    tried there must still move on and reach a live endpoint before the TTL (2 s,
    as short as etcd allows) runs out. With the 2 s bound of every etcd call the
    move came after the lease had lapsed."""
    relay = StallingRelay(etcd_config.endpoints[0])
    hanging_first = dataclasses.replace(
        etcd_config, endpoints=(relay.address, *etcd_config.endpoints)
    )
    lease = etcd_read(etcd_config, lambda etcd: etcd.grant(TTL_S))
    lost: list[int] = []

    async def hold() -> int:
        keeper = LeaseKeeper(hanging_first, "test")
        try:
            keeper.hold(lease, lambda: lost.append(lease))
            while keeper.refreshed < 2:  # refreshed through the relay
                await asyncio.sleep(0.05)
            relay.stalled.set()
            await asyncio.sleep(2 * TTL_S)
            return keeper.refreshed
        finally:
            await keeper.aclose()

    try:
        refreshed = asyncio.run(hold())
    finally:
        relay.close()
    assert lost == [] and refreshed >= 4
    assert etcd_read(etcd_config, lambda etcd: etcd.refresh(lease)) > 0


def test_leases_gone_every_time_are_an_outage_retried_until_one_holds(etcd_config):
    key = etcd_config.prefix + "stores/y"

    async def go():
        etcd, keeper = Etcd(etcd_config), LeaseKeeper(etcd_config, "test")
        granted: list[int] = []

        async def register(lease: int) -> int:  # gone for the first LEASE_TRIES + 1 leases
            granted.append(lease)
            if len(granted) <= LEASE_TRIES + 1:
                await etcd.revoke(lease)
            return await etcd.recreate(key, b"y", lease)

        held = KeyLease(etcd, keeper, register, "store y")
        try:
            with pytest.raises(KVError) as first:
                await held.register()
            held.keep()  # the holder's retry: never stuck
            deadline = time.monotonic() + 5 * TTL_S
            while held.lease == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            entry = await etcd.get(key)
            return first.value, granted, held.lease, entry
        finally:
            await held.release()
            await keeper.aclose()
            await etcd.close()

    error, granted, lease, entry = asyncio.run(go())
    assert error.code is Code.UNAVAILABLE and f"{LEASE_TRIES} leases" in error.message
    assert not is_lease_gone(error)
    assert len(granted) == LEASE_TRIES + 2 and lease == granted[-1] == entry.lease


class StoreLoop:
    """Simulated stores (the real cluster link, blocks generated) on a loop in a thread."""

    def __init__(self, config, shape: ClusterShape):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stores = [SimStore(config, shape, i) for i in range(shape.stores)]
        for store in self.stores:
            self.run(store.start())

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def seal_all(self) -> None:
        async def seal():
            for store in self.stores:
                while store.seal_next():
                    pass

        self.run(seal())

    def stop(self) -> None:
        for store in self.stores:
            self.run(store.link.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def claim_revision(config, name: str = "w0000") -> int:
    entry = etcd_keys(config, "workers/").get(f"workers/{name}")
    return entry.mod_revision if entry is not None else 0


def test_gpu_blocks_a_store_relays_survive_the_workers_readmission(etcd_config, replica):
    _, client = replica
    shape = ClusterShape(stores=1, workers=1, gpu_blocks=8, history_blocks=16)
    admitted = client.register_worker(shape.worker(0), shape.card(0))
    stores = StoreLoop(etcd_config, shape)
    gpu = shape.history(0)[: shape.gpu_blocks].tolist()

    def gpu_blocks() -> tuple[int, int]:
        reply = client.route(MODEL, hashes=gpu, track=False)
        return reply.generation, reply.gpu_blocks

    try:
        stores.seal_all()
        assert wait_for(lambda: gpu_blocks() == (admitted.generation, 8), timeout=10)
        lease = etcd_keys(etcd_config)["workers/w0000"].lease
        etcd_read(etcd_config, lambda etcd: etcd.revoke(lease))  # lost: admitted again
        assert wait_for(lambda: claim_revision(etcd_config) > admitted.generation, 5 * TTL_S)
        again = claim_revision(etcd_config)
        assert wait_for(lambda: gpu_blocks() == (again, 8), timeout=10), gpu_blocks()
    finally:
        stores.stop()


def _keepalive_streams(config) -> tuple[int, int]:
    """etcd's own count of LeaseKeepAlive streams opened and of requests received."""
    import re
    import urllib.request

    text = urllib.request.urlopen(f"http://{config.endpoints[0]}/metrics", timeout=10).read()
    counts = []
    for metric in ("grpc_server_started_total", "grpc_server_msg_received_total"):
        pattern = rf'^{metric}\{{[^}}]*grpc_method="LeaseKeepAlive"[^}}]*\}} (\S+)$'
        counts.append(int(float(re.search(pattern, text.decode(), re.M).group(1))))
    return counts[0], counts[1]


def test_a_keeper_of_many_leases_refreshes_them_over_a_few_streams(etcd_config):
    """A replica holds a lease per worker (up to 4,096 a domain). Before, each
    round opened one LeaseKeepAlive stream a lease: 3,000 leases took 1.8 s of
    a 2 s bound on an idle host, and a loaded one failed every round (each
    lease lapsing, every worker re-admitted). Now a round sends them over one
    stream per 512 leases (etcd counts the streams), and a lease etcd says is
    gone among them is told to its holder alone."""
    from kvstore.membership.etcd import KEEPALIVE_STREAM_LEASES

    count = 1200
    config = dataclasses.replace(etcd_config, ttl_s=10)  # rounds 3.3 s apart, 2 s each at most

    async def go() -> tuple[int, int, list[int], int, int, int]:
        etcd, keeper = Etcd(config), LeaseKeeper(config, "test")
        leases: list[int] = []
        lost: list[int] = []
        try:
            for _ in range(count // 200):
                leases += await asyncio.gather(*(etcd.grant(config.ttl_s) for _ in range(200)))
            gone = leases[7]
            await etcd.revoke(gone)
            before = await asyncio.to_thread(_keepalive_streams, etcd_config)
            for lease in leases:
                keeper.hold(lease, lambda lease=lease: lost.append(lease))
            while keeper.refreshed < 2 * (count - 1) or not lost:  # two rounds at least
                await asyncio.sleep(0.05)
            await keeper.aclose()
            after = await asyncio.to_thread(_keepalive_streams, etcd_config)
            alive = sum([await etcd.refresh(lease) > 0 for lease in leases])
            streams, requests = after[0] - before[0], after[1] - before[1]
            return gone, keeper.refreshed, lost, streams, requests, alive
        finally:
            await keeper.aclose()
            for lease in leases:
                await etcd.revoke(lease)
            await etcd.close()

    gone, refreshed, lost, streams, requests, alive = asyncio.run(go())
    rounds = -(-requests // count)  # each round sends every held lease once
    assert lost == [gone] and alive == count - 1, lost
    per_round = -(-count // KEEPALIVE_STREAM_LEASES)
    assert streams <= per_round * rounds, (streams, rounds)  # was one a lease: >= 2,400
    assert refreshed >= 2 * (count - 1)
