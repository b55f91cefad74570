"""Router replicas and store servers on a real etcd (in this process, real gRPC on
loopback): discovery, agreed generations, first-wins admission across replicas."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import grpc
import pytest

from kvstore._proto import router_pb2, router_pb2_grpc
from kvstore.client.router_client import RouterClient
from kvstore.wire.card import card_checksum
from kvstore.wire.card_proto import card_to_proto
from kvstore.wire.errors import Code, KVError
from tests.conftest import ServerThread, wait_for
from tests.membership.conftest import (
    Blocks,
    RouterThread,
    etcd_keys,
    etcd_read,
    prefix_known,
)
from tests.router.conftest import card

HASHES = [9100 + i for i in range(4)]


@pytest.fixture
def replicas(etcd_config):
    started = [RouterThread(etcd_config) for _ in range(2)]
    clients = [RouterClient(r.address, timeout_s=10) for r in started]
    yield started, clients
    for client in clients:
        client.close()
    for replica in started:
        replica.stop()


def store_thread(config, node_id: str) -> ServerThread:
    return ServerThread(
        pool_size=16 << 20, device="cpu", slab_bytes=4 << 20, node_id=node_id, etcd=config
    )


def generations(replicas, node_id: str) -> list[int | None]:
    return [r.call(r.router.peer_generations).get(node_id) for r in replicas]


def workers(replica) -> dict[str, int]:
    return replica.call(replica.router.worker_generations)


def test_a_store_joins_both_replicas_with_one_generation_and_a_restart_is_a_new_one(
    etcd_config, replicas
):
    routers, _ = replicas
    store = store_thread(etcd_config, "s1")
    blocks = None
    try:
        first = etcd_keys(etcd_config, "stores/")["stores/s1"].create_revision
        assert wait_for(lambda: generations(routers, "s1") == [first, first], timeout=10)
        blocks = Blocks(store.address)
        blocks.save(HASHES)
        for r in routers:
            assert wait_for(
                lambda r=r: prefix_known(r.address, blocks.namespace, HASHES, "s1") == 4,
                timeout=10,
            )
        blocks.close()
        blocks = None
        store.stop()  # a clean stop revokes its lease: it leaves at once
        assert wait_for(lambda: generations(routers, "s1") == [None, None], timeout=5)
        store = store_thread(etcd_config, "s1")
        again = etcd_keys(etcd_config, "stores/")["stores/s1"].create_revision
        assert again > first
        assert wait_for(lambda: generations(routers, "s1") == [again, again], timeout=10)
    finally:
        if blocks is not None:
            blocks.close()
        store.stop()


@pytest.mark.parametrize(
    "first,second",
    [(("A", 0), ("B", 1)), (("B", 1), ("A", 0)), (("A", 1), ("B", 0)), (("B", 0), ("A", 1))],
    ids=["A@r0,B@r1", "B@r1,A@r0", "A@r1,B@r0", "B@r0,A@r1"],
)
def test_the_first_card_wins_across_replicas_in_either_order(replicas, first, second):
    routers, clients = replicas
    cards = {"A": card(model_config_checksum="cfg-A"), "B": card(model_config_checksum="cfg-B")}
    (c1, r1), (c2, r2) = first, second
    admitted = clients[r1].register_worker("w1", cards[c1])
    with pytest.raises(KVError) as refused:
        clients[r2].register_worker("w2", cards[c2])
    assert refused.value.code is Code.FAILED_PRECONDITION
    assert "model_config_checksum" in refused.value.message
    for r in routers:
        assert wait_for(lambda r=r: workers(r) == {"w1": admitted.generation}, timeout=5)


def leave_a_stale_card(config, worker_card) -> None:
    """The card of a set whose members all left before any replica dissolved it."""
    from kvstore.membership.etcd import put
    from kvstore.membership.layout import Layout, SetCard, SetId

    key = Layout(config.prefix).card(SetId.of(worker_card))
    value = SetCard(card_checksum(worker_card), worker_card.hash_format, worker_card).encode()
    etcd_read(config, lambda etcd: etcd.txn([], [put(key, value)]))


@pytest.mark.parametrize("stale", [None, "A", "B"], ids=["new-set", "stale-A", "stale-B"])
def test_concurrent_admissions_of_two_checksums_through_two_replicas_have_one_winner(
    replicas, etcd_config, stale
):
    routers, clients = replicas
    for round_ in range(4):
        model = f"model-{round_}"
        if stale is not None:  # joiners of the stale checksum race re-fixers of the other
            leave_a_stale_card(
                etcd_config, card(display_name=model, model_config_checksum=f"cfg-{stale}")
            )
        # 8 workers: checksums A and B, through replica 0 and 1, in all four combinations.
        jobs = [
            (f"w{round_}-{i}", "AB"[(i + round_) % 2], clients[(i // 2 + round_) % 2])
            for i in range(8)
        ]
        barrier = threading.Barrier(len(jobs))
        results: dict[str, tuple[str, object]] = {}

        def register(name, checksum, client, model=model, barrier=barrier, results=results):
            worker_card = card(display_name=model, model_config_checksum=f"cfg-{checksum}")
            barrier.wait()
            try:
                results[name] = (checksum, client.register_worker(name, worker_card))
            except KVError as exc:
                results[name] = (checksum, exc)

        threads = [threading.Thread(target=register, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        winners = {c for c, r in results.values() if not isinstance(r, KVError)}
        assert len(winners) == 1, results
        (winner,) = winners
        for checksum, result in results.values():
            if checksum == winner:
                assert not isinstance(result, KVError), result
            else:
                assert isinstance(result, KVError) and result.code is Code.FAILED_PRECONDITION
        admitted = {n: r.generation for n, (c, r) in results.items() if c == winner}

        def held(replica, prefix=f"w{round_}-"):
            return {n: g for n, g in workers(replica).items() if n.startswith(prefix)}

        for r in routers:
            assert wait_for(lambda r=r, admitted=admitted: held(r) == admitted, timeout=5)
        cards = [k for k in etcd_keys(etcd_config, "worksets/") if k.endswith("/card")]
        assert sum(f"/{model}/" in k for k in cards) == 1


def test_a_worker_admitted_through_one_replica_routes_and_is_removed_through_the_other(
    replicas, etcd_config
):
    routers, (a, b) = replicas
    reply = a.register_worker("w", card(model_config_checksum="cfg-A", address="10.0.0.1:8000"))
    # Replica b applies it from its watch of etcd, a moment later than a does.
    assert wait_for(lambda: workers(routers[1]) == {"w": reply.generation}, timeout=5)
    route = b.route("llama-8b", token_ids=list(range(64)), track=False)
    assert (route.worker, route.generation, route.address) == (
        "w",
        reply.generation,
        "10.0.0.1:8000",
    )
    member = [e for k, e in etcd_keys(etcd_config, "worksets/").items() if "/members/" in k]
    assert [e.mod_revision for e in member] == [reply.generation]
    assert b.remove_worker("w", reply.generation)
    for r in routers:
        assert wait_for(lambda r=r: workers(r) == {}, timeout=5)
    assert wait_for(lambda: etcd_keys(etcd_config, "worksets/") == {}, timeout=5)  # dissolved
    assert etcd_keys(etcd_config, "workers/") == {}
    # The emptied set forgot its checksum: the next card fixes it anew.
    b.register_worker("w2", card(model_config_checksum="cfg-B"))
    with pytest.raises(KVError) as refused:
        a.register_worker("w3", card(model_config_checksum="cfg-A"))
    assert refused.value.code is Code.FAILED_PRECONDITION
    with pytest.raises(KVError) as gone:
        a.remove_worker("w", reply.generation)
    assert gone.value.code is Code.NOT_FOUND


def test_a_session_holds_its_worker_on_every_replica_until_it_ends(replicas, etcd_config):
    routers, _ = replicas
    channel = grpc.insecure_channel(routers[0].address)
    call = router_pb2_grpc.RouterStub(channel).WorkerSession(
        router_pb2.RegisterWorkerRequest(name="s", card=card_to_proto(card()))
    )
    try:
        first = next(call)
        assert wait_for(lambda: workers(routers[1]) == {"s": first.generation}, timeout=5)
    finally:
        call.cancel()
        channel.close()
    for r in routers:
        assert wait_for(lambda r=r: workers(r) == {}, timeout=5)
    assert wait_for(lambda: etcd_keys(etcd_config, "worksets/") == {}, timeout=5)


def test_a_session_whose_admission_fails_to_settle_leaves_nothing_in_etcd(
    replicas, etcd_config, monkeypatch
):
    """Before: a WorkerSession this replica had not seen admitted within the
    settle wait (or whose client left during it) ended UNAVAILABLE, yet its
    admission stayed in etcd, kept alive by the replica: a worker routed to
    with no session left to end it. Now the failed session releases it."""

    from kvstore.membership import replica as replica_module

    routers, _ = replicas
    monkeypatch.setattr(replica_module, "SETTLE_S", 0.5)
    lagging = routers[0].served.replica.directories[1]  # its view of the worker sets stops
    asyncio.run_coroutine_threadsafe(lagging.close(), routers[0].loop).result(10)
    channel = grpc.insecure_channel(routers[0].address)
    call = router_pb2_grpc.RouterStub(channel).WorkerSession(
        router_pb2.RegisterWorkerRequest(name="s", card=card_to_proto(card()))
    )
    try:
        with pytest.raises(grpc.RpcError) as failed:
            next(call)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        channel.close()
    assert wait_for(lambda: etcd_keys(etcd_config, "worksets/") == {}, timeout=5)
    assert wait_for(lambda: workers(routers[1]) == {}, timeout=5)


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_an_alias_of_two_models_resolves_the_same_on_both_replicas_in_either_order(replicas, order):
    routers, clients = replicas
    one = card(display_name="m-one", aliases=["chat"])
    two = card(display_name="m-two", aliases=["chat"])
    clients[order[0]].register_worker("x", one)
    clients[order[1]].register_worker("y", two)
    for r in routers:
        assert wait_for(lambda r=r: set(workers(r)) == {"x", "y"}, timeout=5)
    for client in clients:
        with pytest.raises(KVError) as ambiguous:
            client.route("chat", token_ids=list(range(16)), track=False)
        assert ambiguous.value.code is Code.FAILED_PRECONDITION
        assert client.route("m-one", token_ids=list(range(16)), track=False).worker == "x"
        assert client.route("m-two", token_ids=list(range(16)), track=False).worker == "y"


def test_a_replica_refuses_store_advertisements_it_learns_from_etcd(replicas):
    _, (a, _) = replicas
    with pytest.raises(KVError) as refused:
        a.advertise_peer("s9", "127.0.0.1:1", "", [])
    assert refused.value.code is Code.FAILED_PRECONDITION and "--etcd" in refused.value.message


def test_the_client_moves_to_the_next_etcd_endpoint(etcd_server):
    from kvstore.demo import free_port
    from kvstore.membership.etcd import EtcdConfig

    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    config = EtcdConfig.parse(f"http://{dead},{etcd_server.url}", 2, "/kvstore-test/endpoints/")
    assert config.endpoints == (dead, etcd_server.url.removeprefix("http://"))
    entries, revision = etcd_read(config, lambda etcd: etcd.list_prefix(config.prefix))
    assert entries == [] and revision > 0
    with pytest.raises(KVError) as refused:
        etcd_read(EtcdConfig((dead,), 2), lambda etcd: etcd.list_prefix("/"))
    assert refused.value.code is Code.UNAVAILABLE and dead in refused.value.message


def test_two_replicas_give_the_same_route_once_store_events_have_settled(etcd_config, replicas):
    routers, clients = replicas
    stores = [store_thread(etcd_config, f"n{i}") for i in range(2)]
    saved = []
    try:
        saved = [Blocks(s.address) for s in stores]
        ns = saved[0].namespace
        saved[0].save(HASHES[:2])  # n0 holds 2 blocks of the prompt, n1 all 4
        saved[1].save(HASHES)
        for i, client in enumerate(clients):  # one worker per node, through either replica
            client.register_worker(f"w{i}", card(node_id=f"n{i}", final_namespace=ns))
        for r in routers:
            assert wait_for(lambda r=r: set(workers(r)) == {"w0", "w1"}, timeout=5)
            for node, depth in (("n0", 2), ("n1", 4)):
                assert wait_for(
                    lambda r=r, node=node, depth=depth: (
                        prefix_known(r.address, ns, HASHES, node) == depth
                    ),
                    timeout=10,
                )
        answers = [
            [
                (a.worker, a.generation, a.store_blocks, a.remote_blocks)
                for a in (c.route("llama-8b", hashes=HASHES, track=False) for _ in range(3))
            ]
            for c in clients
        ]
        assert answers[0] == answers[1]
        assert answers[0][0][0] == "w1" and answers[0][0][2] == 4  # the node holding it all
    finally:
        for blocks in saved:
            blocks.close()
        for s in stores:
            s.stop()


def test_a_replica_that_refuses_a_re_registration_stops_routing_to_the_old_one():
    """Replicas with different --events-allow: etcd admitted a new card this core
    refuses. Before, the old generation (old address) stayed routable here."""

    from kvstore.membership.etcd import Change, Entry
    from kvstore.membership.layout import Layout, MemberRecord, SetId
    from kvstore.membership.mirror import WorkerMirror
    from kvstore.router.core import Router

    async def go():
        router, layout = Router(), Layout("/kvstore/test/")
        mirror = WorkerMirror(router, layout, lambda _set: None, lambda _name, _change: None)
        old = card(address="127.0.0.1:8000")
        new = card(address="10.0.0.6:8000", kv_events_endpoint="tcp://10.0.0.5:5557")

        def put(c, revision):
            key = layout.member(SetId.of(c), "w0")
            return Change(False, Entry(key, MemberRecord(c, "").encode(), revision, revision, 7))

        mirror.changed(put(old, 10))
        assert router.worker_generations() == {"w0": 10}
        mirror.changed(put(new, 20))  # a foreign event endpoint: refused by this core
        assert router.worker_generations() == {}
        with pytest.raises(KVError) as gone:
            router.route("llama-8b", hashes=[1])
        assert gone.value.code is Code.NOT_FOUND

    asyncio.run(go())


@contextlib.asynccontextmanager
async def two_replicas(config, cores):
    """Replicas R1 and R2 on etcd, both listed, and a probe client of its own;
    all closed after."""
    from kvstore.membership.etcd import Etcd
    from kvstore.membership.replica import RouterReplica

    etcds = [Etcd(config) for _ in range(3)]
    replicas = [RouterReplica(e, config, c) for e, c in zip(etcds, cores, strict=False)]
    try:
        for i, r in enumerate(replicas):
            await r.start(f"127.0.0.1:{i + 1}")
            assert await r.listed(5)
        yield replicas[0], replicas[1], etcds[2]
    finally:
        for r in replicas:
            await r.close()
        for e in etcds:
            await e.close()


def test_a_replica_whose_lease_was_lost_does_not_readmit_over_a_newer_registration(etcd_config):
    """R1 admitted w0, then lost its lease (silent past the TTL) while w0
    registered again through R2. Before, R1 admitted its old card again over
    R2's, R2 let go, and when R1's stale session ended w0 vanished everywhere
    though the worker was alive on R2. Now R1 lets go instead."""
    from kvstore.membership.layout import MemberRecord, SetId
    from kvstore.router.core import Router

    async def go():
        cores = [Router(), Router()]
        async with two_replicas(etcd_config, cores) as (r1, r2, probe):
            old, new = card(address="10.0.0.1:8000"), card(address="10.0.0.2:8000")
            first = (await r1.admit("w0", old)).generation
            await r1.seen("w0", first)
            await r1.directories[1].close()  # a partition: R1 hears no worker changes ...
            member = await probe.get(r1.layout.member(SetId.of(old), "w0"))
            # w0 registers again through R2 first: were R1's loss noticed before that
            # (its keeper looks every TTL/3), R1 would rightly readmit the unclaimed name
            second = (await r2.admit("w0", new)).generation
            await r2.seen("w0", second)
            await probe.revoke(member.lease)  # ... and R1's lease for w0 expires
            for _ in range(100):  # R1 hears its lease is gone, and lets go
                if not r1.holds("w0"):
                    break
                await asyncio.sleep(0.1)
            assert not r1.holds("w0") and r2.holds("w0")
            member = await probe.get(r1.layout.member(SetId.of(new), "w0"))
            assert MemberRecord.decode(member.value).card.address == "10.0.0.2:8000"
            r1.release("w0", first)  # R1's stale session ends: nothing of R2's goes
            await asyncio.sleep(0.5)
            assert cores[1].worker_generations() == {"w0": second}

    asyncio.run(go())


def test_a_late_watch_event_of_the_admission_it_replaced_does_not_drop_a_worker(etcd_config):
    """w0 admitted through R1, then again through R2, whose watch delivers R1's
    admission only after R2's own transaction returned (the order a CI run of
    the test above hit). Before, R2 read that put's foreign lease as
    "re-registered elsewhere", let go and revoked its fresh lease: w0 vanished
    from etcd and from every replica while its session was alive on R2."""
    from kvstore.membership.etcd import Change
    from kvstore.membership.layout import SetId
    from kvstore.router.core import Router

    async def go():
        async with two_replicas(etcd_config, [Router(), Router()]) as (r1, r2, probe):
            await r2.directories[1].close()  # R2's watch lags: it delivers nothing yet
            old, new = card(address="10.0.0.1:8000"), card(address="10.0.0.2:8000")
            await r1.admit("w0", old)
            replaced = await probe.get(r1.layout.member(SetId.of(old), "w0"))
            second = (await r2.admit("w0", new)).generation
            r2.workers.changed(Change(False, replaced))  # ... and now hands over R1's put
            await asyncio.sleep(0.5)  # a let-go revokes in a task of its own
            assert r2.holds("w0")
            member = await probe.get(r2.layout.member(SetId.of(new), "w0"))
            assert member is not None and member.mod_revision == second
            newer = await r1.admit("w0", old)  # a put newer than R2's: R2 lets go
            r2.workers.changed(Change(False, await probe.get(member.key)))
            assert not r2.holds("w0") and r1.holds("w0")
            await asyncio.sleep(0.5)
            member = await probe.get(r1.layout.member(SetId.of(old), "w0"))
            assert member is not None and member.mod_revision == newer.generation

    asyncio.run(go())


async def eventually(check, timeout_s: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def test_a_worker_removed_while_the_watch_was_broken_is_let_go_when_listed_again(etcd_config):
    """R2 holds w0; its watch breaks and meanwhile w0 is removed through R1. The
    listing after the break brings no event for it. Before, R2 kept its lease
    alive with nothing under it for as long as the worker's session lived, and
    were that lease ever lost it would admit the removed worker again."""
    from kvstore.membership.layout import SetId
    from kvstore.router.core import Router

    async def go():
        async with two_replicas(etcd_config, [Router(), Router()]) as (r1, r2, probe):
            w0 = card()
            second = (await r2.admit("w0", w0)).generation
            assert await r1.seen("w0", second)
            lease = (await probe.get(r2.layout.member(SetId.of(w0), "w0"))).lease
            await r2.directories[1].close()  # the watch breaks ...
            assert await r1.remove("w0")  # ... while w0 is removed
            r2.directories[1].start()  # listed again
            assert await eventually(lambda: not r2.holds("w0"))
            assert await eventually(lambda: not r2.keeper.holds(lease))

    asyncio.run(go())


def test_a_readmission_heard_before_the_admission_it_replaced_returned_lets_go(etcd_config):
    """R2's admission commits; before its call returns, w0 is admitted again
    through R1 and R2's watch hands that over while R2 holds nothing for w0
    yet. Before, no later event came and R2 held a lease with nothing under it."""
    from kvstore.membership.etcd import Change
    from kvstore.membership.layout import SetId
    from kvstore.router.core import Router

    async def go():
        async with two_replicas(etcd_config, [Router(), Router()]) as (r1, r2, probe):
            await r2.directories[1].close()  # R2 hears only what the test hands over
            w0 = card()
            admit = r2.worksets.admit

            async def then_r1_admits(*args, **kwargs):
                outcome = await admit(*args, **kwargs)
                await r1.admit("w0", w0)
                newer = await probe.get(r1.layout.member(SetId.of(w0), "w0"))
                r2.workers.changed(Change(False, newer))  # heard before R2 holds w0
                return outcome

            r2.worksets.admit = then_r1_admits
            await r2.admit("w0", w0)
            assert await eventually(lambda: not r2.holds("w0"))
            assert r1.holds("w0")
            member = await probe.get(r1.layout.member(SetId.of(w0), "w0"))
            assert member is not None and r1.keeper.holds(member.lease)

    asyncio.run(go())


def test_remove_worker_without_a_generation_removes_what_etcd_holds(etcd_config):
    """RemoveWorker (generation 0) through a replica whose view still shows an
    older generation. Before, it asked etcd to remove that older generation
    and answered NOT_FOUND for a live worker."""
    from kvstore.membership.layout import SetId
    from kvstore.router.core import Router

    async def go():
        async with two_replicas(etcd_config, [Router(), Router()]) as (r1, r2, probe):
            w0 = card()
            first = (await r1.admit("w0", w0)).generation
            assert await r2.seen("w0", first)
            await r2.directories[1].close()  # R2's view stays at the first generation
            newer = (await r1.admit("w0", w0)).generation
            assert newer > first and r2.workers.generation("w0") == first
            assert await r2.remove("w0")
            assert await probe.get(r2.layout.member(SetId.of(w0), "w0")) is None
            assert await eventually(lambda: not r1.holds("w0"))

    asyncio.run(go())


def test_a_listing_after_etcd_lost_its_data_sets_the_revision_afresh():
    """etcd restarted empty counts revisions from 1 again. Before, the mirror kept
    the highest revision it had ever seen, so a wait for etcd's admissions
    (``workers_settled``) returned before they were applied."""
    from kvstore.membership.etcd import Entry
    from kvstore.membership.layout import Layout, MemberRecord, SetId
    from kvstore.membership.mirror import WorkerMirror
    from kvstore.router.core import Router

    async def go():
        layout = Layout("/kvstore/test/")
        mirror = WorkerMirror(Router(), layout, lambda _set: None, lambda _name, _change: None)
        key, value = layout.member(SetId.of(card()), "w0"), MemberRecord(card(), "").encode()
        mirror.reset([Entry(key, value, 900, 900, 7)])
        assert mirror.revision == 900
        mirror.reset([Entry(key, value, 5, 5, 8)])  # etcd lost everything; w0 is back
        assert mirror.revision == 5 and mirror.generation("w0") == 5

    asyncio.run(go())


async def raw_client(config):
    """An aetcd client of its own: writes no kvstore code would (raw bytes, compaction)."""
    import aetcd

    host, _, port = config.endpoints[0].rpartition(":")
    return aetcd.Client(host, int(port))


def test_a_key_that_is_not_utf8_does_not_stop_a_replica_following_etcd(etcd_config):
    """Some other tool wrote a key under worksets/ that is not UTF-8. Before,
    decoding it raised out of the listing, the directory's task ended without a
    word, and the replica never heard of another worker."""
    from kvstore.router.core import Router

    async def go():
        raw = await raw_client(etcd_config)
        try:
            await raw.put(f"{etcd_config.prefix}worksets/".encode() + b"\xff\xfe", b"junk")
            async with two_replicas(etcd_config, [Router(), Router()]) as (r1, r2, _):
                second = (await r1.admit("w0", card())).generation
                assert await r2.seen("w0", second)
        finally:
            await raw.close()

    asyncio.run(go())


def test_a_compacted_watch_lists_again_on_the_same_endpoint(etcd_server):
    """A watch from a compacted revision: etcd answered, so the client stays on
    its endpoint. Before, the compaction counted as the endpoint failing and the
    client moved to the next one (here, a dead one) for every call after."""
    from kvstore.demo import free_port
    from kvstore.membership.etcd import Etcd, EtcdConfig, put

    good = etcd_server.url.removeprefix("http://")
    dead = f"127.0.0.1:{free_port()}"
    config = EtcdConfig.parse(f"http://{good},{dead}", 2, "/kvstore-test/compacted/")

    async def go():
        etcd, raw = Etcd(config), await raw_client(config)
        try:
            for i in range(3):
                await etcd.txn([], [put(f"{config.prefix}k{i}", b"v")])
            _, revision = await etcd.list_prefix(config.prefix)
            await raw.compact(revision)
            with pytest.raises(KVError) as broken:
                async for _ in etcd.watch_prefix(config.prefix, revision - 2):
                    pass
            assert broken.value.code is Code.UNAVAILABLE and "compacted" in broken.value.message
            assert etcd.endpoint == good
        finally:
            await raw.close()
            await etcd.close()

    asyncio.run(go())


def test_a_member_record_of_wrong_field_types_does_not_stop_a_listing():
    """A member record someone wrote into etcd whose card has a field of the wrong
    type (display_name a number) raised TypeError out of the card's checks: the
    rest of that listing (here w1) was never applied. Now it is refused like a
    card the core refuses, logged, and the listing goes on."""
    import dataclasses

    import msgpack

    from kvstore.membership.etcd import Entry
    from kvstore.membership.layout import Layout, MemberRecord, SetId
    from kvstore.membership.mirror import WorkerMirror
    from kvstore.router.core import Router

    async def go():
        router, layout = Router(), Layout("/kvstore/test/")
        mirror = WorkerMirror(router, layout, lambda _set: None, lambda _name, _change: None)
        bad = {"card": {**dataclasses.asdict(card()), "display_name": 7}, "owner": ""}
        entries = [
            Entry(layout.member(SetId.of(card()), "w0"), msgpack.packb(bad), 10, 10, 1),
            Entry(
                layout.member(SetId.of(card()), "w1"), MemberRecord(card(), "").encode(), 11, 11, 1
            ),
        ]
        mirror.reset(entries)
        assert mirror.generation("w1") == 11 and mirror.generation("w0") == 0

    asyncio.run(go())


LARGE = "p" * 60_000  # a prompt_context near its 64 KiB bound: a member record of ~60 KB


async def admit_many(replica, names_and_cards) -> None:
    for name, worker_card in names_and_cards:
        outcome = await replica.admit(name, worker_card)
        assert outcome.generation, outcome


def test_a_set_of_many_members_with_large_cards_still_admits(etcd_config):
    """Admission read every member of the set, each with its whole card, in
    one answer: at about 70 members with a 60 KB prompt_context that answer
    passed gRPC's 4 MiB and every admission into the set was UNAVAILABLE for
    good. Now the members are read as keys only."""
    from kvstore.router.core import Router

    async def go():
        async with two_replicas(etcd_config, [Router(), Router()]) as (r1, r2, _):
            big = card(prompt_context=LARGE)
            await admit_many(r1, [(f"w{i}", big) for i in range(80)])
            assert await r2.seen("w79", r1.workers.generation("w79"))

    asyncio.run(go())


def test_a_replica_lists_worker_sets_larger_than_one_grpc_message(etcd_config):
    """worksets/ held ~10 MB (80 members of 120 KB cards in 8 sets): a replica
    that started then (or listed again after any watch break) read it all in one
    answer, over gRPC's 4 MiB limit: UNAVAILABLE every time, so it never heard
    of a worker. Now a listing reads pages at one revision, fewer keys a page
    while a page is over the limit (64 of these records are)."""
    from kvstore.membership.etcd import Etcd
    from kvstore.membership.replica import RouterReplica
    from kvstore.router.core import Router

    async def go():
        async with two_replicas(etcd_config, [Router(), Router()]) as (r1, _, _):
            big = {"prompt_context": LARGE, "router_config": LARGE}
            await admit_many(
                r1, [(f"w{i}", card(display_name=f"m{i % 8}", **big)) for i in range(80)]
            )
            etcd, core = Etcd(etcd_config), Router()
            late = RouterReplica(etcd, etcd_config, core)
            try:
                await late.start("127.0.0.1:9")
                assert await late.listed(5)
                assert len(core.worker_generations()) == 80
            finally:
                await late.close()
                await etcd.close()

    asyncio.run(go())


def test_records_that_do_not_decode_are_replaced_or_refused_by_admission(etcd_config):
    """A set's card and a worker's name claim that do not decode (written by
    another tool, or another kvstore version). Before, admission raised
    ValueError out of the replica (UNKNOWN at the edge) for as long as the
    record stayed: nobody could join that set, or register or remove that name.
    Now an empty set's card is written anew, and a claim is FAILED_PRECONDITION
    naming its key, with nothing written."""
    from kvstore.membership.etcd import put
    from kvstore.membership.layout import Layout, SetId
    from kvstore.router.core import Router

    layout = Layout(etcd_config.prefix)

    async def go():
        async with two_replicas(etcd_config, [Router(), Router()]) as (r1, r2, probe):
            await probe.txn([], [put(layout.card(SetId.of(card())), b"\xc1 not msgpack")])
            admitted = await r1.admit("w0", card())
            assert await r2.seen("w0", admitted.generation)
            await probe.txn([], [put(layout.worker("w1"), b"\x93\x01\x02\x03")])
            for attempt in (r1.admit("w1", card()), r1.remove("w1")):
                with pytest.raises(KVError) as refused:
                    await attempt
                assert refused.value.code is Code.FAILED_PRECONDITION
                assert layout.worker("w1") in refused.value.message
            assert await probe.get(layout.member(SetId.of(card()), "w1")) is None

    asyncio.run(go())
