"""Store peers: QueryPrefix only ever names peers of exactly the asked final namespace."""

from __future__ import annotations

import logging

import pytest

from kvstore.router.core import EventsApplied, Router
from kvstore.router.peers import Peers
from kvstore.wire import limits
from kvstore.wire.errors import Code, KVError
from kvstore.wire.events import StoreEvent
from tests.router.conftest import Clock, card

NS = "tenant.0123456789abcdef"
NS_MTP = "tenant.fedcba9876543210"  # same client namespace, other layout
HASHES = [101, 102, 103, 104, 105]


def ev(node, hashes, ns=NS, type_="stored", tier="store"):
    return StoreEvent(type_, ns, list(hashes), node, tier=tier).encode()


def peer(router, node, namespaces=(NS,), **kw):
    return router.advertise_peer(node, f"{node}:50051", f"{node}:13337", list(namespaces), **kw)


def test_query_prefix_returns_each_compatible_peer_with_its_prefix(router):
    a, b, c = (peer(router, n, (NS, NS_MTP)) for n in "abc")
    router.publish_store_events("a", a.generation, [ev("a", HASHES[:3])])
    router.publish_store_events("b", b.generation, [ev("b", HASHES)])
    router.publish_store_events("c", c.generation, [ev("c", HASHES, ns=NS_MTP)])
    got = router.query_prefix(NS, HASHES)
    assert [(p.node_id, p.prefix_blocks) for p in got] == [("b", 5), ("a", 3)]
    assert got[0].store_address == "b:50051" and got[0].ucx_address == "b:13337"
    assert [p.node_id for p in router.query_prefix(NS_MTP, HASHES)] == ["c"]
    assert [p.node_id for p in router.query_prefix(NS, HASHES, exclude_node_id="b")] == ["a"]


def test_incompatible_peer_is_never_returned_even_for_identical_hashes(router):
    """Same client namespace, same block hashes, other fingerprint: never a match."""
    for i in range(8):
        p = peer(router, f"mtp{i}", (NS_MTP,))
        router.publish_store_events(p.node_id, p.generation, [ev(p.node_id, HASHES, ns=NS_MTP)])
    only = peer(router, "good")
    router.publish_store_events("good", only.generation, [ev("good", HASHES[:1])])
    for prefix in range(1, 6):
        assert [p.node_id for p in router.query_prefix(NS, HASHES[:prefix])] == ["good"]
    assert router.query_prefix("tenant.aaaaaaaaaaaaaaaa", HASHES) == []


def test_gpu_tier_and_foreign_node_events_do_not_make_a_peer(router):
    p = peer(router, "a")
    router.register_worker("w", card())
    result = router.publish_store_events(
        "a",
        p.generation,
        [
            ev("w", HASHES, tier="gpu"),  # relayed for worker w: indexed for routing only
            ev("someone-else", HASHES),  # a store reports only its own blocks
            ev("ghost", HASHES, tier="gpu"),  # not an admitted worker
        ],
    )
    assert result == EventsApplied(applied=1, dropped=2)
    assert router.query_prefix(NS, HASHES) == []
    assert router.route("llama-8b", hashes=HASHES, track=False).gpu_blocks == 5


def test_removed_and_cleared_events(router):
    p = peer(router, "a")
    router.publish_store_events("a", p.generation, [ev("a", HASHES)])
    router.publish_store_events("a", p.generation, [ev("a", HASHES[2:3], type_="removed")])
    assert router.query_prefix(NS, HASHES)[0].prefix_blocks == 2
    router.publish_store_events("a", p.generation, [ev("a", [], type_="cleared")])
    assert router.query_prefix(NS, HASHES) == []


def test_restart_clears_old_blocks_and_stale_generation_is_dropped(router):
    old = peer(router, "a")
    router.publish_store_events("a", old.generation, [ev("a", HASHES)])
    new = peer(router, "a")  # re-advertised without a generation: a restart
    assert new.generation != old.generation
    assert router.query_prefix(NS, HASHES) == []
    assert router.publish_store_events("a", old.generation, [ev("a", HASHES)]) == EventsApplied(
        0, 1
    )
    assert router.query_prefix(NS, HASHES) == []
    router.publish_store_events("a", new.generation, [ev("a", HASHES[:2])])
    assert router.query_prefix(NS, HASHES)[0].prefix_blocks == 2


def test_lease_expiry_drops_a_silent_peer():
    clock = Clock()
    router = Router(clock=clock)
    p = peer(router, "a", lease_ms=5000)
    router.publish_store_events("a", p.generation, [ev("a", HASHES)])
    clock.now += 4
    peer(router, "a", generation=p.generation, lease_ms=5000)  # refresh
    clock.now += 4
    assert router.query_prefix(NS, HASHES)[0].node_id == "a"
    clock.now += 2
    assert router.query_prefix(NS, HASHES) == []
    assert router.stats().peers == 0


def test_refreshing_a_lease_often_holds_one_entry_per_peer_not_one_per_refresh():
    """Each refresh pushes the peer's new expiry; the entries it supersedes are
    dropped before they pile up (a store refreshing a 10-minute lease every
    millisecond held 600,000 of them), and expiry still goes by the latest."""
    clock = Clock()
    router = Router(clock=clock)
    a = peer(router, "a", lease_ms=limits.MAX_LEASE_MS)
    b = peer(router, "b", lease_ms=5000)
    peer(router, "c")  # no lease: never expires, never queued
    for _ in range(5000):
        clock.now += 0.0001
        peer(router, "a", generation=a.generation, lease_ms=limits.MAX_LEASE_MS)
    assert len(router.peers._leases) <= 2 * 3 + 1024  # white box: the expiry queue
    clock.now += 4.0  # 4.5 s
    peer(router, "b", generation=b.generation, lease_ms=5000)  # now until 9.5 s
    clock.now += 1.5  # past b's first lease: its latest holds
    router.query_prefix(NS, HASHES)
    assert router.stats().peers == 3
    clock.now += 4.0  # past b's latest, far from a's
    router.query_prefix(NS, HASHES)
    assert router.stats().peers == 2 and router.peers.get("b") is None


def test_routing_credits_local_store_and_remote_peers(router):
    a = router.register_worker("on-a", card(node_id="a", final_namespace=NS))
    router.register_worker("on-b", card(node_id="b", final_namespace=NS))
    router.register_worker("other-layout", card(node_id="a", final_namespace=NS_MTP))
    pa = peer(router, "a")
    router.publish_store_events("a", pa.generation, [ev("a", HASHES[:4])])
    r = router.route("llama-8b", hashes=HASHES, track=False)
    assert (r.worker.name, r.store_blocks, r.remote_blocks) == ("on-a", 4, 0)
    router.remove_worker("on-a")
    r = router.route("llama-8b", hashes=HASHES, track=False)
    assert (r.worker.name, r.remote_blocks) == ("on-b", 4)  # fetchable from peer a
    assert a.ref not in router.loads.workers


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda r: r.query_prefix("tenant", HASHES), "final_namespace"),
        (lambda r: r.query_prefix(NS, [1] * (1 << 16 + 1)), "block_hashes"),
        (lambda r: r.advertise_peer("a", "x", "y", ["bad ns"]), "final_namespaces[0]"),
        (lambda r: r.advertise_peer("", "x", "y", [NS]), "node_id"),
        (lambda r: r.advertise_peer("a", "x", "y", [NS], lease_ms=10**9), "lease_ms"),
        (lambda r: r.publish_store_events("a", 1, [b"\x93"]), "events[0]"),
        (lambda r: r.publish_store_events("a", 1, [b"x"] * 5000), "events"),
    ],
)
def test_bad_input_names_the_field(router, call, field):
    p = peer(router, "a")
    router.publish_store_events("a", p.generation, [ev("a", HASHES)])
    before = router.stats()
    with pytest.raises(KVError) as err:
        call(router)
    assert err.value.code.name == "INVALID_ARGUMENT" and field in err.value.message
    assert router.stats() == before


def test_refreshes_cannot_take_a_peer_past_its_namespaces(router):
    """Each refresh may add namespaces, but never past MAX_NAMESPACES_PER_PEER in
    all; a refused refresh changes nothing, not even the addresses."""
    half = limits.MAX_NAMESPACES_PER_PEER // 2
    first = [f"a{i}.0123456789abcdef" for i in range(half)]
    more = [f"b{i}.0123456789abcdef" for i in range(half + 1)]
    p = peer(router, "a", first)
    with pytest.raises(KVError) as err:
        router.advertise_peer("a", "moved:1", "moved:2", more, generation=p.generation)
    assert err.value.code == Code.RESOURCE_EXHAUSTED and "final_namespaces" in err.value.message
    assert (p.store_address, len(p.namespaces)) == ("a:50051", half)
    router.advertise_peer("a", "moved:1", "moved:2", more[:-1], generation=p.generation)
    assert len(p.namespaces) == limits.MAX_NAMESPACES_PER_PEER


def test_removals_in_namespaces_a_peer_never_stored_in_take_no_room(router):
    """A full peer's removal (an eviction) naming a namespace it has nothing
    indexed in made that namespace the peer's, refused past the bound: the
    store's eviction raised after its blocks were gone."""
    full = [f"a{i}.0123456789abcdef" for i in range(limits.MAX_NAMESPACES_PER_PEER)]
    p = peer(router, "a", full)
    other = "z.0123456789abcdef"
    removals = [
        StoreEvent("removed", other, [1], "a").encode(),
        StoreEvent("cleared", other, [], "a").encode(),
    ]
    assert router.publish_store_events("a", p.generation, removals).applied == 2
    assert other not in p.namespaces and router.query_prefix(other, [1]) == []
    with pytest.raises(KVError) as err:  # a stored block there still needs room
        router.publish_store_events("a", p.generation, [ev("a", [1], ns=other)])
    assert err.value.code == Code.RESOURCE_EXHAUSTED


def test_stored_events_naming_no_block_take_no_index_and_no_room(router):
    """Before: each made a namespace index (about 16 KiB) and took one of the peer's
    MAX_NAMESPACES_PER_PEER slots for good, with nothing indexed (found by review)."""
    p = peer(router, "a", [])
    empty = [
        StoreEvent("stored", f"t{i}.0123456789abcdef", [], "a").encode()
        for i in range(limits.MAX_NAMESPACES_PER_PEER)
    ]
    before = router.index_bytes()
    assert router.publish_store_events("a", p.generation, empty).applied == len(empty)
    assert p.namespaces == set() and router.index_bytes() == before
    ns = "real.0123456789abcdef"  # every slot is still free
    router.publish_store_events("a", p.generation, [ev("a", [1], ns=ns)])
    assert [q.prefix_blocks for q in router.query_prefix(ns, [1])] == [1]


def test_remote_tier_blocks_are_not_credited_as_fetchable(router):
    """A store event of tier "remote" is indexed but no peer fetch serves it
    (QueryPrefix counts the store tier only). Before, Route credited it as
    remote blocks, even to a worker on the publishing node itself."""
    router.register_worker("on-a", card(node_id="a", final_namespace=NS))
    pa = peer(router, "a")
    router.publish_store_events("a", pa.generation, [ev("a", HASHES, tier="remote")])
    assert router.query_prefix(NS, HASHES) == []
    r = router.route("llama-8b", hashes=HASHES, track=False)
    assert (r.store_blocks, r.remote_blocks) == (0, 0)


def test_a_refused_stale_publish_does_not_claim_a_node_joined_from_etcd(router):
    """A node joined from etcd with no owner recorded is claimed by its first
    publisher. Before, a publish of a stale generation claimed it too, though
    it was dropped, and the store itself was PERMISSION_DENIED after."""
    from kvstore.wire.principal import Principal

    router.join_peer("a", 5, "a:50051", "a:13337")
    stale = router.publish_store_events("a", 4, [ev("a", HASHES)], caller=Principal("intruder"))
    assert stale == EventsApplied(0, 1, stale=True)
    applied = router.publish_store_events("a", 5, [ev("a", HASHES)], caller=Principal("store-a"))
    assert applied == EventsApplied(1, 0)
    with pytest.raises(KVError) as taken:
        router.publish_store_events("a", 5, [ev("a", HASHES)], caller=Principal("intruder"))
    assert taken.value.code is Code.PERMISSION_DENIED


A1, A2 = "10.0.0.1:50051", "10.0.0.2:50051"  # two stores' addresses, one node id


def _conflict_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "kvstore.router.peers" and r.levelno == logging.WARNING
    ]


def test_a_live_node_id_is_refused_to_another_store_address_until_its_lease_lapses(caplog):
    """Two stores given one --node-id each re-advertised with generation 0, and
    each advertisement replaced the other's entry: the router's view of the
    node (blocks, addresses) flipped between them, silently (an operations
    review). Now the second is ALREADY_EXISTS while the first's lease lives,
    the entry keeps the first's address and blocks, and the router warns once."""
    caplog.set_level(logging.WARNING, logger="kvstore.router.peers")
    clock = Clock()
    router = Router(clock=clock)
    first = router.advertise_peer("a", A1, "10.0.0.1:13337", [NS], lease_ms=10_000)
    router.publish_store_events("a", first.generation, [ev("a", HASHES)])
    clock.now += 4
    for _ in range(3):  # the second store tries again at its pace: refused every time
        with pytest.raises(KVError) as refused:
            router.advertise_peer("a", A2, "10.0.0.2:13337", [NS], lease_ms=10_000)
        assert refused.value.code is Code.ALREADY_EXISTS
    message = refused.value.message
    assert "'a'" in message and A1 in message and "in 6.0 s" in message
    assert "another --node-id" in message
    entry = router.peers.get("a")
    assert (entry.generation, entry.store_address) == (first.generation, A1)
    assert [(p.store_address, p.prefix_blocks) for p in router.query_prefix(NS, HASHES)] == [
        (A1, 5)
    ]
    assert len(_conflict_warnings(caplog)) == 1  # one per conflict, not per attempt

    # the first store restarting at its own address replaces its entry at once,
    # whatever its UCX address now
    again = router.advertise_peer("a", A1, "10.0.0.1:14000", [NS], lease_ms=10_000)
    assert again.generation != first.generation and router.query_prefix(NS, HASHES) == []

    clock.now += 10  # its lease lapses (nobody refreshed it): the second may take over
    taken = router.advertise_peer("a", A2, "10.0.0.2:13337", [NS], lease_ms=10_000)
    assert router.peers.get("a") is taken and taken.store_address == A2
    with pytest.raises(KVError) as back:  # and now the first is the one refused
        router.advertise_peer("a", A1, "10.0.0.1:14000", [NS], lease_ms=10_000)
    assert back.value.code is Code.ALREADY_EXISTS and A2 in back.value.message
    assert len(_conflict_warnings(caplog)) == 2  # a new conflict: warned of again


def test_a_live_node_id_without_a_lease_is_refused_until_its_peer_leaves():
    """A peer with no lease never lapses: another address waits for it to leave.
    The Peers core is asked directly, at a given ``now`` (a lapsed lease counts
    as gone even before the router expired it)."""
    peers = Peers()
    peers.advertise("a", A1, "", [NS], generation=0, lease_ms=0, now=0.0)
    with pytest.raises(KVError) as refused:
        peers.advertise("a", A2, "", [NS], generation=0, lease_ms=0, now=10**6)
    assert refused.value.code is Code.ALREADY_EXISTS
    assert "no lease" in refused.value.message and A1 in refused.value.message
    peers.remove("a")
    assert (
        peers.advertise("a", A2, "", [NS], generation=0, lease_ms=5000, now=0.0).store_address == A2
    )
    with pytest.raises(KVError):
        peers.advertise("a", A1, "", [NS], generation=0, lease_ms=0, now=4.9)
    assert peers.advertise("a", A1, "", [NS], generation=0, lease_ms=0, now=5.0).store_address == A1
