"""A store's link to a standalone router keeps forwarding after a failure."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import pytest

from kvstore.client.router_client import RouterClient
from kvstore.service.router_link import REFRESH_S, RemoteRouterLink
from kvstore.service.sealed import NOTHING, Listed
from kvstore.wire.errors import Code, KVError
from kvstore.wire.events import STORED, StoreEvent
from tests.membership.conftest import RouterThread

NS = "m.0123456789abcdef"


def test_a_snapshot_that_fails_is_sent_again_and_later_events_still_flow():
    """The pump's failure log read len() of the snapshot's None batch: the
    TypeError ended the pump, and the router never heard from the store again."""
    router = RouterThread(None)
    client = RouterClient(router.address, timeout_s=2)
    snapshots = []

    def snapshot() -> Listed:
        snapshots.append(1)
        if len(snapshots) == 1:
            raise RuntimeError("the first snapshot fails")
        return Listed([StoreEvent(STORED, NS, [1, 2], "n1")])

    async def run() -> int:
        link = RemoteRouterLink(router.address, "n1")
        await link.start("127.0.0.1:1", "", snapshot)
        try:
            deadline = asyncio.get_running_loop().time() + 3 * REFRESH_S
            while await asyncio.to_thread(known, 2) < 2:  # the second snapshot's blocks
                assert asyncio.get_running_loop().time() < deadline, "no snapshot reached it"
                await asyncio.sleep(0.1)
            link.publish(StoreEvent(STORED, NS, [3], "n1"))  # and an event after it
            while await asyncio.to_thread(known, 3) < 3:
                assert asyncio.get_running_loop().time() < deadline, "the event never came"
                await asyncio.sleep(0.1)
            return len(snapshots)
        finally:
            await link.stop()

    def known(n: int) -> int:
        peers = client.query_prefix(NS, [1, 2, 3][:n])
        return max((p.prefix_blocks for p in peers), default=0)

    try:
        assert asyncio.run(run()) >= 2
    finally:
        client.close()
        router.stop()


W0 = [11, 12, 13]  # w0's GPU blocks, as store n1 relays them


def _w0_relayed() -> list[StoreEvent]:
    return [StoreEvent(STORED, NS, W0, "w0", tier="gpu")]


def _readmitted(snapshot, settle_s: float = 0.0) -> int:
    """Store n1, linked to a router, relays w0's GPU blocks (``snapshot``); w0
    leaves and registers again, and its blocks come back: w0's blocks right
    after it registered again (``settle_s`` more passes before the link stops)."""
    from tests.router.conftest import card

    router = RouterThread(None)
    client = RouterClient(router.address, timeout_s=2)

    def w0_blocks() -> int:
        return client.route("llama-8b", hashes=W0, track=False).gpu_blocks

    async def wait_for(blocks: int) -> None:
        deadline = asyncio.get_running_loop().time() + 10
        while await asyncio.to_thread(w0_blocks) != blocks:
            assert asyncio.get_running_loop().time() < deadline, f"w0 never had {blocks} blocks"
            await asyncio.sleep(0.05)

    async def run() -> int:
        link = RemoteRouterLink(router.address, "n1")
        await link.start("127.0.0.1:1", "", snapshot)
        try:
            await wait_for(len(W0))
            await asyncio.to_thread(client.remove_worker, "w0")
            await asyncio.to_thread(client.register_worker, "w0", card())
            emptied = await asyncio.to_thread(w0_blocks)
            await wait_for(len(W0))
            await asyncio.sleep(settle_s)
            return emptied
        finally:
            await link.stop()

    try:
        client.register_worker("w0", card())
        return asyncio.run(run())
    finally:
        client.close()
        router.stop()


def test_an_idle_store_resends_its_relays_for_a_worker_admitted_again():
    """The store relays w0's GPU blocks in its snapshot; w0 leaves and registers
    again, so its new generation starts empty. Before, a store with nothing new
    to publish never heard that it owed its snapshot (only a batch's answer
    said so): w0's cached blocks stayed unknown to routing. Now its lease
    refresh's answer asks, and it resends within a refresh or two."""
    snapshots = []

    def snapshot() -> Listed:
        snapshots.append(1)
        return Listed(_w0_relayed())

    assert _readmitted(snapshot) == 0  # the new generation starts empty; nothing is published
    assert len(snapshots) == 2  # the first, and the one the refresh asked for


def test_a_refresh_while_the_owed_snapshot_is_on_its_way_sends_no_second_one(monkeypatch):
    """The router asks on every refresh until the snapshot's first batch applies.
    Before, a refresh answered while the store was still making its snapshot (a
    large store takes a while) queued a second full one (found by review)."""
    import time

    from kvstore.service import router_link

    monkeypatch.setattr(router_link, "REFRESH_S", 0.2)
    snapshots = []

    class Slow:  # events that take longer to make than two refreshes
        def events(self) -> list[StoreEvent]:
            time.sleep(0.5)
            return _w0_relayed()

    def snapshot() -> Slow:
        snapshots.append(1)
        return Slow()

    _readmitted(snapshot, settle_s=1.5)  # several refreshes after: none asks again
    assert len(snapshots) == 2  # the first, and one for the admission


def test_stop_leaves_no_task_of_the_link_running():
    """stop() cancelled the pump and keepalive and returned at once: they were
    still running (mid-publish) when the clients under them closed."""
    router = RouterThread(None)

    async def run() -> list[asyncio.Task]:
        link = RemoteRouterLink(router.address, "n1")
        await link.start("127.0.0.1:1", "", lambda: NOTHING)
        link.publish(StoreEvent(STORED, NS, [1], "n1"))
        await link.stop()
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    try:
        assert asyncio.run(run()) == []
    finally:
        router.stop()


def test_a_feed_to_a_replica_survives_a_failing_snapshot_and_bounds_its_queue(caplog):
    """A store's feed to one router replica (the etcd path). Before, a snapshot
    that raised ended the feed's task for good (it was taken outside the retry),
    and events queued without bound while the replica took them slowly. The
    overflow is logged once until a snapshot is taken."""
    from kvstore.demo import free_port
    from kvstore.service.router_link import MAX_QUEUED_EVENTS, RouterFeed

    calls = []

    def snapshot() -> Listed:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the first snapshot fails")
        return NOTHING

    async def run() -> None:
        loop = asyncio.get_running_loop()
        feed = RouterFeed(f"127.0.0.1:{free_port()}", "n1", snapshot)  # nothing listens
        try:
            feed.resync(generation=7)
            deadline = loop.time() + 10
            while len(calls) < 2:  # retried after the failure: the task lives
                assert loop.time() < deadline, "the feed stopped after the failed snapshot"
                await asyncio.sleep(0.05)
            with caplog.at_level(logging.WARNING, "kvstore.service.router_link"):
                for i in range(3 * MAX_QUEUED_EVENTS + 10):
                    feed.publish(StoreEvent(STORED, NS, [i], "n1"))
            assert feed.queued <= MAX_QUEUED_EVENTS and feed.overflows == 3
            assert sum("events queued" in r.getMessage() for r in caplog.records) == 1
        finally:
            await feed.close()

    asyncio.run(run())


def test_a_batch_stays_under_a_routers_message_size_however_large_its_events():
    """Eight events of MAX_HASHES_PER_EVENT hashes (a Clear's pinned survivors)
    were one 4.7 MB PublishEvents, over the router's 4 MiB limit: refused, and
    the store had to send a whole snapshot (found by review). A batch now
    gathers about MAX_BATCH_HASHES hashes at most, and every event still goes."""
    import asyncio

    from kvstore._proto import router_pb2
    from kvstore.service.router_link import MAX_BATCH_HASHES, next_batch
    from kvstore.wire import limits
    from kvstore.wire.events import StoreEvent

    hashes = list(range(limits.MAX_HASHES_PER_EVENT))
    events = [StoreEvent("stored", "t.0123456789abcdef", hashes, "a") for _ in range(8)]
    queue: asyncio.Queue = asyncio.Queue()
    for event in events[1:]:
        queue.put_nowait(event)
    sent = []
    batch = next_batch(events[0], queue)
    while batch:
        assert sum(len(e.block_hashes) for e in batch) < MAX_BATCH_HASHES + len(hashes)
        request = router_pb2.PublishEventsRequest(events=[e.encode() for e in batch])
        assert request.ByteSize() < 4 << 20
        sent += batch
        batch = next_batch(queue.get_nowait(), queue) if not queue.empty() else None
    assert sent == events


def test_two_stores_given_one_node_id_leave_the_routers_entry_to_the_first(tmp_path, caplog):
    """Two real store processes started with one --node-id advertise to a real
    router. Before, each re-advertisement (every ~3 s, generation 0) replaced
    the other's entry: the router's view of the node flipped between them and
    nobody was told. Now the entry stays the first's across advertise rounds;
    the second logs the conflict once (an ERROR, no traceback), keeps serving,
    and is accepted (logged once) when the first is gone and its lease lapsed.
    The router warns once."""
    import subprocess
    import sys

    from kvstore.demo import free_ports
    from tests.conftest import wait_for
    from tests.service.test_peer_fetch import ready

    caplog.set_level(logging.WARNING, logger="kvstore.router.peers")
    router = RouterThread(None)
    ports = free_ports(2)
    logs = [tmp_path / f"store{i}.log" for i in range(2)]
    procs: list[subprocess.Popen] = []

    def serve(i: int) -> str:
        args = ["serve", "--port", str(ports[i]), "--device", "cpu", "--pool-size", "64MiB"]
        args += ["--router", router.address, "--node-id", "twin", "--log-level", "info"]
        with logs[i].open("w") as err:
            procs.append(subprocess.Popen([sys.executable, "-m", "kvstore", *args], stderr=err))
        return f"127.0.0.1:{ports[i]}"

    def entry() -> tuple[int, str, float] | None:
        peer = router.call(router.router.peers.get, "twin")
        return None if peer is None else (peer.generation, peer.store_address, peer.expires)

    def lines(i: int, text: str) -> list[str]:
        return [line for line in logs[i].read_text().splitlines() if text in line]

    try:
        first = serve(0)
        assert wait_for(lambda: entry() is not None, timeout=60), "the first never advertised"
        generation, address, _ = entry()
        assert address == first
        second = serve(1)
        assert wait_for(lambda: lines(1, "refuses node id"), timeout=60), "no conflict logged"
        seen = {entry()}  # every view of the entry across three of the first's refreshes
        while len({expires for _, _, expires in seen}) < 4:  # the second retries meanwhile
            seen.add(entry())
            time.sleep(0.2)
        assert {(g, a) for g, a, _ in seen} == {(generation, first)}
        ready(second, procs[1]).close()  # it serves all the same
        [refused] = lines(1, "refuses node id")
        assert " ERROR " in refused and "'twin'" in refused and first in refused
        assert "another --node-id" in refused
        assert not lines(1, "Traceback") and not lines(1, "accepted node id")

        procs[0].kill()  # the first goes; once its lease lapses the second is taken
        assert wait_for(lambda: (entry() or (0, ""))[1] == second, timeout=60)
        assert wait_for(lambda: lines(1, "accepted node id"), timeout=10)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
        router.stop()
    assert len(lines(1, "refuses node id")) == 1 and len(lines(1, "accepted node id")) == 1
    warned = [r for r in caplog.records if r.name == "kvstore.router.peers"]
    assert len(warned) == 1 and second in warned[0].getMessage()


def test_a_router_that_forgot_the_store_says_so_and_is_advertised_to_at_once(monkeypatch):
    """A standalone router that no longer knows the store's generation (it
    restarted between two publishes, or the store's lease lapsed) answered its
    PublishEvents OK with every event dropped: the store went on sending into the
    void until its next keepalive round. Now NOT_FOUND naming the node and
    generation, and the store advertises again at once (the keepalive round is
    an hour here), its snapshot replaying what was lost."""
    from kvstore.service import router_link

    monkeypatch.setattr(router_link, "REFRESH_S", 3600.0)
    router = RouterThread(None)
    client = RouterClient(router.address, timeout_s=5)
    published = [StoreEvent(STORED, NS, [1], "n1")]

    def known(h: int) -> bool:
        return bool(client.query_prefix(NS, [h]))

    async def run() -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        link = RemoteRouterLink(router.address, "n1")
        await link.start("127.0.0.1:1", "", lambda: Listed(list(published)))
        try:
            while not await asyncio.to_thread(known, 1):
                assert loop.time() < deadline, "the first snapshot never arrived"
                await asyncio.sleep(0.05)
            generation = link.client.generation
            assert router.call(router.router.remove_peer, "n1", generation)  # forgotten
            with pytest.raises(KVError) as refused:
                client.publish([published[0]], "n1", generation, 0)
            assert refused.value.code is Code.NOT_FOUND, refused.value
            assert f"'n1' generation {generation}" in refused.value.message
            published.append(StoreEvent(STORED, NS, [2], "n1"))
            link.publish(published[-1])  # refused: the link advertises anew, replays
            while not await asyncio.to_thread(known, 2):
                assert loop.time() < deadline, "the store never advertised again"
                await asyncio.sleep(0.05)
            assert await asyncio.to_thread(known, 1)
        finally:
            await link.stop()

    try:
        asyncio.run(run())
    finally:
        client.close()
        router.stop()


def test_a_feed_to_an_absent_replica_logs_one_warning_and_one_line_when_it_takes_us(caplog):
    """A store's feed to one router replica (the etcd path). Before, each batch
    the replica did not take was an INFO line and a fifth failed snapshot a
    WARNING, per outage of the feed. Now one WARNING when it is lost, whatever
    the tries, and one INFO when a replica at that address takes our snapshot."""
    from kvstore.demo import free_port
    from kvstore.service.router_link import RouterFeed

    port = free_port()
    address = f"127.0.0.1:{port}"
    published = [StoreEvent(STORED, NS, [1], "n1")]
    snapshots: list[int] = []

    def snapshot() -> Listed:
        snapshots.append(len(published))
        return Listed(list(published))

    async def run() -> None:
        loop = asyncio.get_running_loop()
        feed = RouterFeed(address, "n1", snapshot)  # nothing listens
        router = None
        try:
            feed.resync(generation=7)
            deadline = loop.time() + 30
            h = 2
            while len(snapshots) < 6:  # snapshots tried in vain, batches between them
                assert loop.time() < deadline, "the feed tried too few times"
                published.append(StoreEvent(STORED, NS, [h], "n1"))
                feed.publish(published[-1])
                h += 1
                await asyncio.sleep(0.2)
            router = await asyncio.to_thread(RouterThread, None, port=port)
            with RouterClient(address, timeout_s=5) as client:
                generation = 0
                while not generation:  # grpc's reconnect backoff to the port may last
                    try:
                        generation = client.advertise_peer("n1", "127.0.0.1:1", "", [NS])
                    except KVError:
                        assert loop.time() < deadline, "the replica never answered"
                        await asyncio.sleep(0.2)
                feed.resync(generation)
                while not client.query_prefix(NS, [h - 1]):  # the snapshot holds them all
                    assert loop.time() < deadline, "the replica never took our snapshot"
                    await asyncio.sleep(0.1)
        finally:
            await feed.close()
            if router is not None:
                await asyncio.to_thread(router.stop)

    warnings, infos = _link_said(caplog, run)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"router replica {address} lost (UNAVAILABLE: "), warnings
    assert not [m for m in infos if "not taken" in m], infos
    assert len([m for m in infos if "resumed" in m]) == 1, infos


def test_a_router_that_stops_is_logged_once_not_per_batch_and_its_return_once(caplog, monkeypatch):
    """Before, a store whose router died logged a warning per failed event batch
    (70 in 0.7 s under load), then one every keepalive round. Now: one WARNING
    for the outage, the batches it could not forward counted, and one INFO when
    a router on that address takes our advertisement again."""
    from kvstore.service import router_link

    monkeypatch.setattr(router_link, "REFRESH_S", 0.2)  # many keepalive rounds while down
    router = RouterThread(None)
    address = router.address
    published: list[StoreEvent] = []

    def snapshot() -> Listed:
        return Listed(list(published))

    async def run() -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        link = RemoteRouterLink(address, "n1")
        await link.start("127.0.0.1:1", "", snapshot)

        def publish(h: int) -> None:
            published.append(StoreEvent(STORED, NS, [h], "n1"))
            link.publish(published[-1])

        def knows(h: int) -> bool:
            try:
                return bool(client.query_prefix(NS, [h]))
            except KVError:  # the router is not back yet
                return False

        async def until(h: int) -> None:
            while not await asyncio.to_thread(knows, h):
                assert loop.time() < deadline, f"the router never heard of block {h}"
                await asyncio.sleep(0.05)

        client = RouterClient(address, timeout_s=2)
        again = None
        try:
            publish(0)
            await until(0)
            await asyncio.to_thread(router.stop)
            h = 1
            while link.stats().batches_dropped < 30 or link._outage.tries < 10:
                assert loop.time() < deadline, "the link dropped too few batches"
                publish(h)
                h += 1
                await asyncio.sleep(0.01)
            assert link.stats().events_dropped >= 30
            again = await asyncio.to_thread(RouterThread, None, port=int(address.split(":")[1]))
            await until(h - 1)  # the snapshot replays what it missed
            publish(h)
            await until(h)  # and events flow again
        finally:
            client.close()
            await link.stop()
            if again is not None:
                await asyncio.to_thread(again.stop)

    warnings, infos = _link_said(caplog, run)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"router {address} lost (")
    resumed = [m for m in infos if "resumed" in m]
    assert len(resumed) == 1 and resumed[0].startswith(f"router {address} resumed after")
    assert re.search(r"; [1-9]\d* events dropped meanwhile\)$", resumed[0]), resumed[0]


def _link_said(caplog, run) -> tuple[list[str], list[str]]:
    """What the router link logged while ``run()`` ran: its warnings (and
    worse), its INFO lines."""
    with caplog.at_level(logging.INFO, "kvstore.service.router_link"):
        asyncio.run(run())
    said = [r for r in caplog.records if r.name == "kvstore.service.router_link"]
    warnings = [r.getMessage() for r in said if r.levelno >= logging.WARNING]
    return warnings, [r.getMessage() for r in said if r.levelno == logging.INFO]
