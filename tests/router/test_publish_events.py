"""PublishEvents applies a batch whole or not at all, over a real loopback server.

A malformed field in any event (wrong type, out of range, unknown or missing
key) is INVALID_ARGUMENT naming ``events[i].<field>``, and a batch that does
not fit (a peer's namespaces, an index's holders) is RESOURCE_EXHAUSTED; in
both cases the good events before the bad one are not applied: the index,
the peers and the counters are as they were.
"""

from __future__ import annotations

import math

import msgpack
import pytest

from kvstore.client.router_client import RouterClient
from kvstore.router.core import Router
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
