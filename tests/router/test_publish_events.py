"""PublishEvents applies a batch whole or not at all, over a real loopback server.

A malformed field in any event (wrong type, out of range, unknown or missing
key) is INVALID_ARGUMENT naming ``events[i].<field>``, and a batch that does
not fit (a peer's namespaces, an index's holders) is RESOURCE_EXHAUSTED; in
both cases the good events before the bad one are not applied: the index,
the peers and the counters are as they were.

Numbered batches (docs/design.md §6): a gap or a batch from before the last
snapshot is dropped whole, counted and answered ``resync``; a snapshot
replaces the node's blocks; unsequenced batches apply as they come; every
dropped event is counted under one cause.
"""

from __future__ import annotations

import math
from dataclasses import fields

import msgpack
import pytest

from kvstore._proto import router_pb2
from kvstore.client.router_client import RouterClient
from kvstore.router.core import Router
from kvstore.router.drops import DropCause, EventDrops
from kvstore.router.requests import decode_store_events
from kvstore.wire import limits
from kvstore.wire.errors import Code, KVError
from kvstore.wire.events import StoreEvent
from tests.router.conftest import card

NS = "tenant.0123456789abcdef"
HASHES = [101, 102, 103, 104]
NODE = "node-a"


def good_store_event() -> bytes:
    return StoreEvent("stored", NS, HASHES, NODE).encode()


def good_relayed_event() -> bytes:
    """A GPU-tier event a store relays for worker w0."""
    return StoreEvent("stored", NS, HASHES, "w0", tier="gpu").encode()


def event_with(**changes) -> bytes:
    """A good event's msgpack map with ``changes`` (a value of ``...`` drops the key)."""
    raw = {
        "type": "stored",
        "namespace": NS,
        "block_hashes": [7, 8],
        "parent_hash": None,
        "token_ids": [],
        "worker": NODE,
        "tier": "store",
        "seq": 1,
        "ts": 1.0,
    }
    raw.update(changes)
    return msgpack.packb({k: v for k, v in raw.items() if v is not ...}, use_bin_type=True)


def setup(router: Router, client: RouterClient) -> None:
    client.register_worker("w0", card())
    client.advertise_peer(NODE, "127.0.0.1:50051", "127.0.0.1:13337", [NS])


def indexed(client: RouterClient) -> tuple:
    """What the index says about HASHES: the peers' prefixes and the worker's route."""
    peers = [(p.node_id, p.prefix_blocks) for p in client.query_prefix(NS, HASHES)]
    route = client.route("llama-8b", hashes=HASHES, track=False)
    return peers, route.gpu_blocks, route.overlap_blocks


MALFORMED = [
    # (changes, the field the message must name)
    ({"block_hashes": None}, "block_hashes"),
    ({"block_hashes": 5}, "block_hashes"),
    ({"block_hashes": "ab"}, "block_hashes"),
    ({"block_hashes": [1, -1]}, "block_hashes[1]"),
    ({"block_hashes": [True]}, "block_hashes[0]"),
    ({"block_hashes": [1.5]}, "block_hashes[0]"),
    ({"block_hashes": [None]}, "block_hashes[0]"),
    ({"block_hashes": [[1]]}, "block_hashes[0]"),
    ({"block_hashes": [1] * (limits.MAX_HASHES_PER_EVENT + 1)}, "block_hashes"),
    ({"worker": ["node-a"]}, "worker"),
    ({"worker": {"a": 1}}, "worker"),
    ({"worker": ["w0"], "tier": "gpu"}, "worker"),
    ({"worker": {"w0": 1}, "tier": "gpu"}, "worker"),
    ({"worker": None}, "worker"),
    ({"worker": 5}, "worker"),
    ({"namespace": 5}, "namespace"),
    ({"namespace": [NS]}, "namespace"),
    ({"namespace": None}, "namespace"),
    ({"type": None}, "type"),
    ({"type": ["stored"]}, "type"),
    ({"type": "bogus"}, "type"),
    ({"tier": 5}, "tier"),
    ({"tier": "disk"}, "tier"),
    ({"parent_hash": "x"}, "parent_hash"),
    ({"parent_hash": -1}, "parent_hash"),
    ({"parent_hash": 1.5}, "parent_hash"),
    ({"type": "removed", "parent_hash": 7}, "parent_hash"),
    ({"type": "cleared"}, "block_hashes"),  # a clear names no blocks
    ({"token_ids": 3}, "token_ids"),
    ({"token_ids": [-1]}, "token_ids[0]"),
    ({"token_ids": ["a"]}, "token_ids[0]"),
    ({"seq": "x"}, "seq"),
    ({"seq": -1}, "seq"),
    ({"seq": None}, "seq"),
    ({"ts": "x"}, "ts"),
    ({"ts": math.nan}, "ts"),
    ({"ts": math.inf}, "ts"),
    ({"ts": True}, "ts"),
    ({"block_hashes": ...}, "block_hashes"),  # missing
    ({"worker": ...}, "worker"),
    ({"surprise": 1}, "surprise"),  # unknown key
]


def test_the_good_events_alone_are_applied(served):
    """The control for the tests below: without the bad event the batch lands."""
    router, client, _ = served
    setup(router, client)
    reply = client.publish([good_store_event(), good_relayed_event()])
    assert (reply.applied, reply.dropped) == (2, 0)
    assert indexed(client) == ([(NODE, 4)], 4, 4)


@pytest.mark.parametrize(
    "changes, field", MALFORMED, ids=[f"{f}-{i}" for i, (_, f) in enumerate(MALFORMED)]
)
def test_a_good_and_a_bad_event_apply_nothing(served, changes, field):
    router, client, _ = served
    setup(router, client)
    before, index_before = router.stats(), indexed(client)
    with pytest.raises(KVError) as err:
        client.publish([good_store_event(), good_relayed_event(), event_with(**changes)])
    assert err.value.code == Code.INVALID_ARGUMENT, err.value
    assert f"events[2].{field}" in err.value.message, err.value
    assert indexed(client) == index_before == ([], 0, 0)
    assert router.stats() == before


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", b"\x93\x01\x02\x03", msgpack.packb(5), msgpack.packb({b"type": "stored"})],
    ids=["empty", "not-msgpack", "array", "integer", "binary-key"],
)
def test_an_event_that_is_not_a_map_of_strings_applies_nothing(served, payload):
    router, client, _ = served
    setup(router, client)
    before = router.stats()
    with pytest.raises(KVError) as err:
        client.publish([good_store_event(), payload])
    assert err.value.code == Code.INVALID_ARGUMENT and "events[1]" in err.value.message
    assert indexed(client) == ([], 0, 0)
    assert router.stats() == before


def test_a_malformed_node_id_is_invalid_argument(served):
    _, client, _ = served
    anonymous = RouterClient(client.address)  # never advertised: node id ""
    with anonymous, pytest.raises(KVError) as err:
        anonymous.publish([good_store_event()])
    assert err.value.code == Code.INVALID_ARGUMENT and "node_id" in err.value.message


def test_a_batch_past_a_peers_namespaces_applies_nothing(served):
    """The namespace past the peer's bound is the batch's second event: the
    first, in a namespace that still fits, must not be applied either."""
    router, client, _ = served
    served_ns = [f"t{i}.0123456789abcdef" for i in range(limits.MAX_NAMESPACES_PER_PEER - 1)]
    client.advertise_peer(NODE, "127.0.0.1:50051", "", served_ns)
    first, second = "fits.0123456789abcdef", "over.0123456789abcdef"
    before = router.stats()
    with pytest.raises(KVError) as err:
        client.publish(
            [
                StoreEvent("stored", served_ns[0], HASHES, NODE),
                StoreEvent("stored", first, HASHES, NODE),
                StoreEvent("stored", second, HASHES, NODE),
            ]
        )
    assert err.value.code == Code.RESOURCE_EXHAUSTED and "namespaces" in err.value.message
    assert client.query_prefix(served_ns[0], HASHES) == []
    assert client.query_prefix(first, HASHES) == []
    assert router.stats() == before
    # Each fits on its own.
    assert client.publish([StoreEvent("stored", first, HASHES, NODE)]).applied == 1
    assert [p.prefix_blocks for p in client.query_prefix(first, HASHES)] == [4]


def test_relayed_events_past_a_domains_holders_apply_nothing(router):
    """A domain index holds MAX_WORKERS_PER_DOMAIN holders: a batch relaying for
    two workers new to it when one fits applies none of its events."""
    workers = [
        router.register_worker(f"w{i}", card()) for i in range(limits.MAX_WORKERS_PER_DOMAIN + 1)
    ]
    for w in workers[:-2]:
        router.apply_relayed_worker_event(StoreEvent("stored", NS, [1], w.name, tier="gpu"))
    peer = router.advertise_peer(NODE, "127.0.0.1:50051", "", [NS])
    before = router.stats()
    batch = [
        StoreEvent("stored", NS, HASHES, NODE).encode(),
        StoreEvent("stored", NS, HASHES, workers[-2].name, tier="gpu").encode(),
        StoreEvent("stored", NS, HASHES, workers[-1].name, tier="gpu").encode(),
    ]
    with pytest.raises(KVError) as err:
        router.publish_store_events(NODE, peer.generation, batch)
    assert err.value.code == Code.RESOURCE_EXHAUSTED and "events" in err.value.message
    assert router.stats() == before
    assert router.query_prefix(NS, HASHES) == []
    # One of them alone fits.
    assert router.publish_store_events(NODE, peer.generation, batch[:2]).applied == 2


# -- numbered batches and snapshots (docs/design.md §6) ---------------------


def blocks_indexed(router: Router) -> int:
    return router.stats().indexed_blocks


def test_numbered_batches_apply_in_order_and_a_gap_is_dropped_and_asks_for_a_snapshot(served):
    router, client, _ = served
    setup(router, client)
    first = client.publish([StoreEvent("stored", NS, HASHES[:2], NODE)], seq=1, snapshot=True)
    second = client.publish([StoreEvent("stored", NS, HASHES[2:3], NODE)], seq=2)
    assert (first.applied, first.resync, second.applied, second.resync) == (1, False, 1, False)
    assert blocks_indexed(router) == 3

    lost_one = client.publish([StoreEvent("stored", NS, HASHES[3:], NODE)], seq=4)  # 3 was lost
    assert (lost_one.applied, lost_one.dropped, lost_one.resync) == (0, 1, True)
    assert blocks_indexed(router) == 3  # dropped whole
    stats = router.stats()
    assert stats.dropped_by.sequence_gap == 1 and stats.resyncs_requested == 1

    # The snapshot the store sends then replaces the node's blocks wholesale.
    snap = client.publish([StoreEvent("stored", NS, HASHES[1:], NODE)], seq=5, snapshot=True)
    assert (snap.applied, snap.resync) == (1, False)
    assert client.query_prefix(NS, HASHES[1:]) and client.query_prefix(NS, HASHES) == []
    assert blocks_indexed(router) == 3  # HASHES[0] was not in it: gone
    assert client.publish([StoreEvent("removed", NS, HASHES[3:], NODE)], seq=6).applied == 1
    assert blocks_indexed(router) == 2


def test_a_batch_from_before_the_last_snapshot_is_dropped_and_counted(served):
    router, client, _ = served
    setup(router, client)
    client.publish([StoreEvent("stored", NS, HASHES, NODE)], seq=10, snapshot=True)
    late = client.publish([StoreEvent("removed", NS, HASHES, NODE)], seq=9)
    again = client.publish([StoreEvent("removed", NS, HASHES, NODE)], seq=10)
    assert (late.applied, late.resync, again.applied, again.resync) == (0, True, 0, True)
    assert blocks_indexed(router) == 4
    assert router.stats().dropped_by.stale_sequence == 2


def test_a_numbered_batch_before_any_snapshot_asks_for_one(served):
    """A replica that restarted (or lost the node) gets the store's next batch
    without ever having had its snapshot: that is a gap too."""
    router, client, _ = served
    setup(router, client)
    reply = client.publish([StoreEvent("stored", NS, HASHES, NODE)], seq=1)
    assert (reply.applied, reply.resync) == (0, True)
    assert blocks_indexed(router) == 0
    assert router.stats().dropped_by.sequence_gap == 1


def test_unsequenced_batches_apply_as_they_come(served):
    """seq 0 (older stores, the cluster simulator) is never checked."""
    router, client, _ = served
    setup(router, client)
    for hashes in (HASHES[:2], HASHES[2:]):
        reply = client.publish([StoreEvent("stored", NS, hashes, NODE)])
        assert (reply.applied, reply.resync) == (1, False)
    assert blocks_indexed(router) == 4
    assert router.stats().resyncs_requested == 0


def test_a_snapshot_replaces_every_namespace_of_its_node_and_nothing_of_another(router):
    other_ns = "other.0123456789abcdef"
    a = router.advertise_peer("a", "127.0.0.1:1", "", [])
    b = router.advertise_peer("b", "127.0.0.1:2", "", [])
    for node, peer in (("a", a), ("b", b)):
        events = [StoreEvent("stored", ns, HASHES, node) for ns in (NS, other_ns)]
        router.apply_store_events(node, peer.generation, events, seq=1, snapshot=True)
    assert blocks_indexed(router) == 8  # 4 hashes x 2 namespaces, each held by a and b
    router.apply_store_events(
        "a", a.generation, [StoreEvent("stored", NS, HASHES[:1], "a")], seq=2, snapshot=True
    )
    assert [(p.node_id, p.prefix_blocks) for p in router.query_prefix(NS, HASHES)] == [
        ("b", 4),
        ("a", 1),
    ]
    assert [p.node_id for p in router.query_prefix(other_ns, HASHES)] == ["b"]


def test_an_empty_snapshot_empties_its_node(router):
    peer = router.advertise_peer(NODE, "127.0.0.1:1", "", [])
    router.apply_store_events(NODE, peer.generation, [StoreEvent("stored", NS, HASHES, NODE)])
    result = router.apply_store_events(NODE, peer.generation, [], seq=3, snapshot=True)
    assert (result.applied, result.resync) == (0, False)
    assert blocks_indexed(router) == 0


def test_every_dropped_event_is_counted_under_its_cause_over_grpc(served):
    """No event is dropped silently: each cause has its counter, RouterStats
    shows them, and they add up to events_dropped."""
    router, client, _ = served
    setup(router, client)
    gen = client.generation
    client.publish([StoreEvent("stored", NS, HASHES, NODE)], seq=1, snapshot=True)
    client.publish([StoreEvent("stored", NS, HASHES, NODE)], seq=3)  # gap: 1
    client.publish([StoreEvent("stored", NS, HASHES, NODE)] * 2, seq=1)  # stale seq: 2
    client.publish([StoreEvent("stored", NS, HASHES, "someone-else")] * 3)  # not indexable: 3
    client.publish([StoreEvent("stored", NS, HASHES, "ghost", tier="gpu")] * 4)  # unknown: 4
    with pytest.raises(KVError) as stale:  # counted, and said: NOT_FOUND
        client.publish(
            [StoreEvent("stored", NS, HASHES, NODE)] * 5, node_id=NODE, generation=gen + 9
        )
    assert stale.value.code is Code.NOT_FOUND
    router.record_dropped(6)  # a feed message that does not decode
    stats = client.stats()
    assert stats.dropped_by == router_pb2.EventDrops(
        sequence_gap=1, stale_sequence=2, not_indexable=3, unknown_worker=4, stale_generation=5,
        undecodable=6,
    )  # fmt: skip
    assert stats.events_dropped == 21 == router.stats().dropped_by.total()
    assert stats.resyncs_requested == 2


def test_each_drop_cause_is_a_router_stats_field():
    """One list of causes: the core's, the record's and the wire's."""
    wire = [f.name for f in router_pb2.EventDrops.DESCRIPTOR.fields]
    assert wire == [f.name for f in fields(EventDrops)] == [c.value for c in DropCause]


def test_an_events_stream_numbered_backwards_counts_one_stale_drop():
    """A message numbered below the next expected one: before, the router
    counted seq - expected + 1 drops, a negative number, and events_dropped
    went down."""
    from kvstore.router.drops import DropCause
    from kvstore.service.feeds import out_of_sequence

    assert out_of_sequence(9, 5) == (5, DropCause.SEQUENCE_GAP)  # 5..8 skipped, and 9
    assert out_of_sequence(3, 5) == (1, DropCause.STALE_SEQUENCE)
    router = Router()
    router.record_dropped(*out_of_sequence(3, 5))
    stats = router.stats()
    assert stats.events_dropped == 1 and stats.dropped_by.stale_sequence == 1


def test_an_event_nested_past_msgpacks_depth_names_why():
    """msgpack's StackError carries no message: the refusal said "not valid
    msgpack: " and nothing after it."""
    with pytest.raises(KVError) as info:
        decode_store_events("n", [b"\x91" * 100_000 + b"\xc0"])
    assert info.value.message == "events[0]: not valid msgpack: StackError"
