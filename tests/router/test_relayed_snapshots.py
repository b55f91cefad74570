"""A store's snapshot replaces the GPU-tier blocks it relayed, over a real loopback server.

A store relays its attached workers' GPU-tier events in its numbered batches,
and a snapshot is its whole state, relays included (docs/design.md §6). Before,
a snapshot dropped only the store's own blocks: what it had relayed for a
worker stayed in that worker's index whatever the snapshot said, so a relayed
removal lost to a sequence gap was never undone by the resync snapshot, and
routes kept crediting the worker with blocks its GPU no longer held. Now the
snapshot replaces the GPU tier of every worker that node id relayed for, under
any of its generations, and nothing of workers it never relayed for.
"""

from __future__ import annotations

import pytest

from kvstore.client.router_client import RouterClient
from kvstore.router.peers import MAX_AWAITED_PER_PEER, Peer, Peers
from kvstore.wire import limits
from kvstore.wire.events import REMOVED, STORED, StoreEvent
from tests.router.conftest import card

NS = "tenant.0123456789abcdef"
NODE = "node-a"
W0 = [101, 102, 103, 104]  # w0's GPU blocks, as node-a relays them
W1 = [201, 202, 203]  # w1's, as node-b relays them
OWN = [301, 302]  # node-a's own store blocks


def relay(worker: str, hashes: list[int], type_: str = STORED) -> StoreEvent:
    return StoreEvent(type_, NS, hashes, worker, tier="gpu")


def own() -> StoreEvent:
    return StoreEvent(STORED, NS, OWN, NODE)


def gpu(client: RouterClient, hashes: list[int]) -> tuple[str, int]:
    """The worker a route for ``hashes`` picks, and the GPU blocks it credits it with."""
    reply = client.route("llama-8b", hashes=hashes, track=False)
    return reply.worker, reply.gpu_blocks


@pytest.fixture
def store(served):
    """w0 and w1 admitted; node-a advertised, its first snapshot relaying all of w0."""
    _, client, _ = served
    client.register_worker("w0", card())
    client.register_worker("w1", card())
    client.advertise_peer(NODE, "127.0.0.1:1", "", [NS])
    reply = client.publish([own(), relay("w0", W0)], seq=1, snapshot=True)
    assert (reply.applied, reply.dropped, reply.resync) == (2, 0, False)
    assert gpu(client, W0) == ("w0", 4)
    return client


def test_a_snapshot_replaces_the_blocks_its_node_relayed(store):
    client = store
    client.publish([own(), relay("w0", W0[:2])], seq=2, snapshot=True)
    assert gpu(client, W0) == ("w0", 2)  # replaced, not merged with the first snapshot
    client.publish([own()], seq=3, snapshot=True)  # relays for nobody any more
    assert gpu(client, W0)[1] == 0
    assert client.stats().indexed_blocks == len(OWN)


def test_a_relayed_removal_lost_to_a_gap_is_undone_by_the_resync_snapshot(store):
    """w0 evicts its last two blocks; the batch relaying that (seq 2) is lost. The
    next batch is refused with resync, and the snapshot the store answers with
    says what w0 holds now: the router forgets the evicted blocks."""
    client = store
    # seq 2, [relay("w0", W0[2:], REMOVED)], is lost on the way
    reply = client.publish([relay("w0", W0[:1], REMOVED)], seq=3)  # w0 evicts one more
    assert (reply.applied, reply.dropped, reply.resync) == (0, 1, True)
    assert gpu(client, W0) == ("w0", 4)  # stale until the store resyncs
    reply = client.publish([own(), relay("w0", W0[1:2])], seq=4, snapshot=True)
    assert (reply.applied, reply.resync) == (2, False)
    assert gpu(client, [W0[1]]) == ("w0", 1)  # what w0 holds now, and nothing else
    assert gpu(client, W0)[1] == 0
    assert client.stats().dropped_by.sequence_gap == 1


def test_a_new_generations_snapshot_replaces_what_the_old_one_relayed(store):
    """A store that advertises again (a failed publish) is a new peer generation
    and sends its snapshot there: it also states the relays of the old one."""
    client = store
    client.advertise_peer(NODE, "127.0.0.1:1", "", [NS])  # generation 0: a new one
    reply = client.publish([own()], seq=1, snapshot=True)
    assert (reply.applied, reply.resync) == (1, False)
    assert gpu(client, W0)[1] == 0


def test_a_snapshot_leaves_the_workers_another_node_relays_for(store):
    client = store
    other = RouterClient(client.address)
    try:
        other.advertise_peer("node-b", "127.0.0.1:2", "", [NS])
        assert other.publish([relay("w1", W1)], seq=1, snapshot=True).applied == 1
        client.publish([own()], seq=2, snapshot=True)  # node-a: no relays any more
        assert gpu(client, W1) == ("w1", 3)
        assert gpu(client, W0)[1] == 0
        other.publish([], seq=2, snapshot=True)  # node-b: none either
        assert gpu(client, W1)[1] == 0
    finally:
        other.close()


def test_a_worker_admitted_again_gets_the_relays_of_the_next_snapshot(store):
    """A new generation of w0 starts empty (it may be a new process); the node
    that relayed for it is asked for its snapshot (its next batch is answered
    resync), the snapshot relays for it, and a later one without it drops them."""
    client = store
    client.remove_worker("w0")
    client.register_worker("w0", card())
    assert gpu(client, W0)[1] == 0
    reply = client.publish([own()], seq=2)
    assert (reply.applied, reply.dropped, reply.resync) == (0, 1, True)
    assert client.stats().dropped_by.snapshot_owed == 1
    client.publish([own(), relay("w0", W0[:3])], seq=3, snapshot=True)
    assert gpu(client, W0) == ("w0", 3)
    assert client.publish([own()], seq=4).applied == 1  # owes nothing any more
    client.publish([own()], seq=5, snapshot=True)
    assert gpu(client, W0)[1] == 0


def test_a_worker_replaced_by_a_new_generation_is_relayed_for_again(store):
    """w0 registers again without leaving (a restarted process): its new generation
    starts empty, and node-a, which relayed for the old one, owes its snapshot."""
    client = store
    client.register_worker("w0", card())
    assert gpu(client, W0)[1] == 0
    assert client.publish([own()], seq=2).resync
    client.publish([own(), relay("w0", W0)], seq=3, snapshot=True)
    assert gpu(client, W0) == ("w0", 4)


def test_relays_for_a_worker_not_yet_admitted_come_back_once_it_is(store):
    """A store relayed for w2 before w2 registered: the router dropped those
    events (unknown worker), then asks the store again once w2 is admitted, and
    no other node, nor node-a for a worker it never relayed for."""
    client = store
    w2 = [401, 402]
    reply = client.publish([relay("w2", w2)], seq=2)
    assert (reply.applied, reply.dropped) == (0, 1)
    other = RouterClient(client.address)
    try:
        other.advertise_peer("node-b", "127.0.0.1:2", "", [NS])
        assert other.publish([relay("w1", W1)], seq=1, snapshot=True).applied == 1
        client.register_worker("w3", card())  # nobody relayed for it: nobody is asked
        assert client.publish([own()], seq=3).applied == 1
        client.register_worker("w2", card())
        assert other.publish([relay("w1", W1[:1], REMOVED)], seq=2).applied == 1
        reply = client.publish([own()], seq=4)
        assert (reply.applied, reply.resync) == (0, True)
        client.publish([own(), relay("w0", W0), relay("w2", w2)], seq=5, snapshot=True)
        assert gpu(client, w2) == ("w2", 2)
        assert gpu(client, W0) == ("w0", 4)
    finally:
        other.close()


def test_what_a_peer_awaits_is_bounded_by_peer():
    """The names come from the publisher's events: a peer remembers at most
    MAX_AWAITED_PER_PEER of them, its own oldest going first, so one publisher's
    flood of made-up names pushes out nothing another peer awaits."""
    mine, flooder = Peer("node-a", 1, "", "", last_seq=1), Peer("node-x", 1, "", "", last_seq=1)
    mine.await_worker("a0")
    for i in range(MAX_AWAITED_PER_PEER + 10):
        flooder.await_worker(f"fake-{i}")
    assert len(flooder.awaited) == MAX_AWAITED_PER_PEER
    assert not flooder.admitted("fake-9") and flooder.admitted("fake-10")
    assert mine.admitted("a0") and mine.owes_snapshot
    assert not mine.admitted("a0")  # asked once: the name is gone


@pytest.mark.parametrize("seed", range(4))
def test_an_admission_asks_exactly_the_peers_that_await_the_name(seed):
    """Peers keeps, by worker name, which peers await it, so an admission looks
    at those only (it looked at every peer: ~2 ms at 4,096, under the router's
    lock). Random awaits (with evictions past the bound), snapshots, removals
    and new advertisements; each admission asks what a look at every peer finds."""
    import random

    rng = random.Random(seed)
    peers = Peers()
    nodes = [f"node-{i}" for i in range(6)]
    names = [f"w{i}" for i in range(3 * MAX_AWAITED_PER_PEER)]  # past the bound: evictions
    for node in nodes:
        peers.advertise(node, "127.0.0.1:1", "", [], 0, 0, 0.0)
    for _ in range(3000):
        node, name, op = rng.choice(nodes), rng.choice(names), rng.random()
        peer = peers.get(node)
        if op < 0.8 and peer is not None:
            peer.last_seq = rng.choice([0, 1, 2])
            peers.await_worker(peer, name)
        elif op < 0.82 and peer is not None:
            peers.snapshot_taken(peer)
        elif op < 0.84:
            peers.remove(node)
        elif op < 0.86:
            peers.advertise(node, "127.0.0.1:1", "", [], 0, 0, 0.0)
        else:
            want = sorted(
                p.node_id
                for p in peers.peers.values()
                if name in p.awaited and (p.last_seq or p.owes_snapshot)
            )
            assert peers.admitted(name) == want
            assert not any(name in p.awaited for p in peers.peers.values())


def test_a_peer_that_numbers_no_batches_is_not_asked():
    """An unsequenced publisher (seq 0: the embedded router's link) applies every
    batch and is never answered resync: it is not flagged."""
    peer = Peer("node-a", 1, "", "")
    peer.await_worker("w0")
    assert not peer.admitted("w0") and not peer.owes_snapshot


def test_relays_for_names_no_worker_may_have_are_not_remembered(served, store):
    """An event's worker may be megabytes long: only a name a worker could have
    is kept to be asked for again."""
    router, client = served[0], store
    bad = "x" * (limits.MAX_NAME_LEN + 1)
    assert client.publish([relay(bad, [9]), relay("w9", [9])], seq=2).dropped == 2
    assert list(router.peers.get(NODE).awaited) == ["w9"]


def test_a_snapshot_restates_what_a_node_awaits(served, store):
    """A name relayed for in vain, then left out of the node's next snapshot, is
    no longer awaited: its admission asks the node for nothing."""
    router, client = served[0], store
    assert client.publish([relay("w9", [9])], seq=2).dropped == 1
    client.publish([own(), relay("w0", W0)], seq=3, snapshot=True)
    assert not router.peers.get(NODE).awaited
    client.register_worker("w9", card())
    assert client.publish([own()], seq=4).applied == 1


def test_a_lease_refresh_asks_an_idle_node_for_its_snapshot(store):
    """An idle store sends no batch to be answered resync: the answer to its
    lease refresh asks instead, until the snapshot comes. A new advertisement
    does not (its link sends a snapshot anyway)."""
    client = store
    client.advertise_peer(NODE, "127.0.0.1:1", "", [NS], refresh=True)
    assert not client.owes_snapshot
    client.remove_worker("w0")
    client.register_worker("w0", card())
    for _ in range(2):  # asked again on every refresh until the snapshot comes
        client.advertise_peer(NODE, "127.0.0.1:1", "", [NS], refresh=True)
        assert client.owes_snapshot
    client.publish([own(), relay("w0", W0)], seq=2, snapshot=True)
    assert gpu(client, W0) == ("w0", 4)
    client.advertise_peer(NODE, "127.0.0.1:1", "", [NS], refresh=True)
    assert not client.owes_snapshot
    client.register_worker("w0", card())  # a new generation: node-a owes one again
    client.advertise_peer(NODE, "127.0.0.1:1", "", [NS])  # but advertises anew
    assert not client.owes_snapshot
