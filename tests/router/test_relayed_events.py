"""GPU-tier events a store relays for a worker, and who may relay them.

A store relays its attached workers' GPU-tier events to the router in its
event batches (docs/design.md §6). Without ``--store-cn`` any certificate may
publish as a store, so before, tenant A could advertise a node of its own and
relay ``stored`` or ``removed`` events for tenant B's worker: B's prefix index,
and so B's routes, were A's to steer (no KV bytes exposed). Now a relayed event
applies only when its publisher may speak for the worker: the worker's owner,
an admin, or a trusted store (``RouterConfig.store_cns``, fed by
``--store-cn``), which relays for every tenant's workers attached to the node
it publishes as (the card's ``node_id``). Before, a trusted store relayed for
every worker of every tenant wherever attached; now its word about a worker of
another node counts for nothing, in a batch as in a snapshot. Any other relay
is dropped and counted under a cause of its own (``relay_refused``, not the
``not_indexable`` of a store event about another holder), the rest of its
batch applies, and nothing of that worker's changes (docs/design.md §8).
"""

from __future__ import annotations

import pytest

from kvstore.router.core import EventsApplied, Router, RouterConfig
from kvstore.router.relays import MAX_RELAYERS_PER_WORKER
from kvstore.wire import limits
from kvstore.wire.errors import Code, KVError
from kvstore.wire.events import StoreEvent
from kvstore.wire.principal import LOCAL, Principal
from tests.router.conftest import card

NS = "tenant.0123456789abcdef"
HASHES = [101, 102, 103, 104]
TENANT_A = Principal("tenant-a")
TENANT_B = Principal("tenant-b")
STORE = Principal("store-x")  # a trusted store node (--store-cn store-x)
ADMIN = Principal("ops", admin=True)
SHARED = "shared"  # the node a0 and b0 are attached to (their cards' node_id)


def relay(worker: str, hashes=HASHES, type_="stored") -> StoreEvent:
    """A GPU-tier event relayed for ``worker``."""
    return StoreEvent(type_, NS, list(hashes), worker, tier="gpu")


def own(node: str, hashes=HASHES) -> StoreEvent:
    """A store-tier event of the publishing node itself."""
    return StoreEvent("stored", NS, list(hashes), node)


def gpu_depth(router: Router, name: str, hashes=HASHES) -> int:
    """How many of ``hashes`` the index says worker ``name`` holds on its GPU."""
    worker = router.admission.workers[name]
    return router.domains.depths([worker], hashes).get((worker.ref, "gpu"), 0)


@pytest.fixture
def tenants() -> Router:
    """Tenant A's worker a0 and tenant B's worker b0, both attached to the shared
    node; node-a is tenant A's store node (advertised by tenant A's certificate:
    not --store-cn, so it relays only for tenant A's workers)."""
    router = Router(RouterConfig())
    router.config.store_cns = frozenset({STORE.name})  # as ServedRouter.start sets it
    router.register_worker("a0", card(node_id=SHARED), caller=TENANT_A)
    router.register_worker("b0", card(node_id=SHARED, worker_type="prefill"), caller=TENANT_B)
    router.advertise_peer("node-a", "127.0.0.1:1", "", [NS], caller=TENANT_A)
    return router


def publish(router: Router, caller: Principal, events, node="node-a") -> EventsApplied:
    return router.apply_store_events(node, router.peers.get(node).generation, events, caller)


def test_a_tenant_cannot_store_into_another_tenants_worker(tenants):
    router = tenants
    before = router.stats()
    result = publish(router, TENANT_A, [own("node-a"), relay("b0"), relay("a0", HASHES[:2])])
    assert result == EventsApplied(applied=2, dropped=1)  # the rest of the batch applied
    assert gpu_depth(router, "b0") == 0  # B's index: untouched
    assert gpu_depth(router, "a0") == 2  # A may relay for its own worker
    assert [p.prefix_blocks for p in router.query_prefix(NS, HASHES)] == [4]
    stats = router.stats()
    assert stats.dropped_by.relay_refused == before.dropped_by.relay_refused + 1
    assert stats.dropped_by.not_indexable == before.dropped_by.not_indexable
    assert stats.events_dropped == before.events_dropped + 1
    assert stats.events_applied == before.events_applied + 2
    # B's routes (to its own set) see no GPU blocks A relayed for b0
    routed = router.route("llama-8b", hashes=HASHES, track=False, caller=TENANT_B)
    assert (routed.worker.name, routed.gpu_blocks) == ("b0", 0)


def test_a_tenant_cannot_remove_another_tenants_blocks(tenants):
    """B's blocks, relayed by B's own node, stay when A relays their removal or a clear."""
    router = tenants
    router.advertise_peer("node-b", "127.0.0.1:2", "", [NS], caller=TENANT_B)
    assert publish(router, TENANT_B, [relay("b0")], node="node-b") == EventsApplied(1, 0)
    assert gpu_depth(router, "b0") == 4
    before = router.stats()
    removal = [relay("b0", HASHES[1:2], "removed"), relay("b0", [], "cleared")]
    assert publish(router, TENANT_A, removal) == EventsApplied(applied=0, dropped=2)
    assert gpu_depth(router, "b0") == 4
    after = router.stats()
    assert after.indexed_blocks == before.indexed_blocks
    assert after.dropped_by.relay_refused == before.dropped_by.relay_refused + 2


@pytest.mark.parametrize("relayer", [STORE, ADMIN, LOCAL], ids=["store-cn", "admin", "local"])
def test_trusted_stores_and_admins_relay_for_any_tenants_worker(tenants, relayer):
    """A shared store serves several tenants' workers: named by --store-cn (or an
    admin; without TLS every caller is the local admin) it relays for all of
    those attached to it."""
    router = tenants
    router.advertise_peer(SHARED, "127.0.0.1:3", "", [NS], caller=relayer)
    events = [relay("a0", HASHES[:1]), relay("b0"), relay("b0", HASHES[3:], "removed")]
    assert publish(router, relayer, events, node=SHARED) == EventsApplied(3, 0)
    assert (gpu_depth(router, "a0"), gpu_depth(router, "b0")) == (1, 3)
    assert router.stats().events_dropped == 0


def test_a_trusted_store_cannot_relay_for_a_worker_attached_to_another_node(tenants):
    """A --store-cn store speaks for the workers of the node it publishes as: a
    relay for a worker whose card names another node is dropped (relay_refused),
    stored or removed, and the rest of the batch applies. The worker's owner and
    admins relay for it through any node, as before."""
    router = tenants
    router.register_worker("b1", card(node_id="node-b", worker_type="prefill"), caller=TENANT_B)
    router.advertise_peer("node-c", "127.0.0.1:2", "", [NS], caller=TENANT_B)
    assert publish(router, TENANT_B, [relay("b1")], node="node-c") == EventsApplied(1, 0)
    router.advertise_peer(SHARED, "127.0.0.1:3", "", [NS], caller=STORE)
    before = router.stats()
    events = [
        own(SHARED),
        relay("a0"),  # attached to SHARED: applies
        relay("b1", [901, 902]),
        relay("b1", HASHES[:1], "removed"),
    ]
    assert publish(router, STORE, events, node=SHARED) == EventsApplied(applied=2, dropped=2)
    assert gpu_depth(router, "a0") == 4
    assert gpu_depth(router, "b1") == 4  # its owner's relay stands, nothing erased
    assert gpu_depth(router, "b1", [901, 902]) == 0  # nothing planted
    stats = router.stats()
    assert stats.dropped_by.relay_refused == before.dropped_by.relay_refused + 2
    assert stats.events_dropped == before.events_dropped + 2
    assert publish(router, ADMIN, [relay("b1", [901, 902])], node=SHARED) == EventsApplied(1, 0)
    assert gpu_depth(router, "b1", [901, 902]) == 2


def test_a_store_cn_of_another_router_is_trusted_by_name_only(tenants):
    """Being allowed to act as a store (Principal.store, every caller without
    --store-cn) is not trust: only the CNs the router names relay for others."""
    router = tenants
    stranger = Principal("store-y", store=True)
    router.advertise_peer("node-y", "127.0.0.1:4", "", [NS], caller=stranger)
    assert publish(router, stranger, [relay("a0"), relay("b0")], node="node-y").applied == 0
    assert gpu_depth(router, "a0") == gpu_depth(router, "b0") == 0


def test_a_refused_relay_for_an_unknown_worker_is_still_unknown(tenants):
    router = tenants
    assert publish(router, TENANT_A, [relay("ghost")]) == EventsApplied(0, 1)
    assert router.stats().dropped_by.unknown_worker == 1
    assert router.stats().dropped_by.relay_refused == 0


def test_a_refused_relay_takes_no_room_in_a_full_domain(tenants):
    """The domain check before a batch applies counts only the relays that will
    apply: a refused one for a worker new to a full index neither lands nor
    refuses the rest of the batch (before: RESOURCE_EXHAUSTED, nothing applied)."""
    router = tenants
    fillers = [
        router.register_worker(f"f{i}", card()) for i in range(limits.MAX_WORKERS_PER_DOMAIN)
    ]
    for w in fillers:  # every holder bit of the domain taken (relayed by the local admin)
        router.apply_relayed_worker_event(relay(w.name, [1]))
    before = router.stats()
    result = publish(router, TENANT_A, [own("node-a"), relay("b0")])
    assert result == EventsApplied(applied=1, dropped=1)
    assert gpu_depth(router, "b0") == 0
    assert router.stats().dropped_by.relay_refused == before.dropped_by.relay_refused + 1


def test_a_trusted_stores_relays_take_room_only_for_its_nodes_workers(tenants):
    """The room check before a batch applies judges a trusted store's relays as
    they will apply: with one holder bit left, its relay for a worker of its
    node takes it and one for a worker of another node neither lands nor
    refuses the batch (before: both counted, RESOURCE_EXHAUSTED); with none
    left, its relay for a new worker of its node refuses the whole batch."""
    router = tenants
    for i in range(limits.MAX_WORKERS_PER_DOMAIN - 1):  # all but one holder bit taken
        router.apply_relayed_worker_event(relay(router.register_worker(f"f{i}", card()).name, [1]))
    router.register_worker("b1", card(node_id="node-b", worker_type="prefill"), caller=TENANT_B)
    router.register_worker("a1", card(node_id=SHARED), caller=TENANT_A)
    router.advertise_peer(SHARED, "127.0.0.1:3", "", [NS], caller=STORE)
    assert publish(router, STORE, [relay("a0"), relay("b1")], node=SHARED) == EventsApplied(1, 1)
    assert (gpu_depth(router, "a0"), gpu_depth(router, "b1")) == (4, 0)
    with pytest.raises(KVError) as err:
        publish(router, STORE, [own(SHARED), relay("a1")], node=SHARED)
    assert err.value.code is Code.RESOURCE_EXHAUSTED
    assert router.query_prefix(NS, HASHES) == [] and gpu_depth(router, "a1") == 0


def test_the_direct_relay_entry_point_checks_its_caller(tenants):
    """apply_relayed_worker_event, as a feed calls it: the caller is the relayer.
    It names no node, so a trusted store's word, good only for the workers of
    the node it publishes as, counts there for nothing; owners and admins may."""
    router = tenants
    assert router.apply_relayed_worker_event(relay("b0"), TENANT_A) is False
    assert router.apply_relayed_worker_event(relay("a0"), STORE) is False
    assert router.apply_relayed_worker_event(relay("b0"), TENANT_B) is True
    assert router.apply_relayed_worker_event(relay("a0", HASHES[:2]), ADMIN) is True
    assert (gpu_depth(router, "a0"), gpu_depth(router, "b0")) == (2, 4)
    assert router.stats().dropped_by.relay_refused == router.stats().events_dropped == 2


def test_a_node_id_taken_over_cannot_erase_what_it_relayed_for_another_tenant(tenants):
    """A snapshot replaces the GPU tier of the workers its node id relayed for.
    Once tenant A's node has left, tenant B may advertise a node of that id:
    its snapshot must not erase A's worker's blocks (B could not relay their
    removal either), while a trusted store's snapshot of that id may (a0 is
    attached to it)."""
    router = tenants
    router.advertise_peer(SHARED, "127.0.0.1:3", "", [NS], caller=TENANT_A)
    assert publish(router, TENANT_A, [relay("a0")], node=SHARED) == EventsApplied(1, 0)
    router.remove_peer(SHARED)
    gen = router.advertise_peer(SHARED, "127.0.0.1:9", "", [NS], caller=TENANT_B).generation
    assert router.apply_store_events(SHARED, gen, [], TENANT_B, seq=1, snapshot=True).applied == 0
    assert gpu_depth(router, "a0") == 4
    router.remove_peer(SHARED)
    gen = router.advertise_peer(SHARED, "127.0.0.1:9", "", [NS], caller=STORE).generation
    router.apply_store_events(SHARED, gen, [], STORE, seq=1, snapshot=True)
    assert gpu_depth(router, "a0") == 0


def test_a_trusted_stores_snapshot_leaves_workers_attached_to_another_node(tenants):
    """Tenant B's node id "shared" relayed for b0 (attached to it) and b1 (attached
    to node-b); a trusted store taking that node id over replaces with its
    snapshot what it may relay: b0's GPU tier, not b1's, which it could not
    relay a removal of either."""
    router = tenants
    router.register_worker("b1", card(node_id="node-b", worker_type="prefill"), caller=TENANT_B)
    router.advertise_peer(SHARED, "127.0.0.1:3", "", [NS], caller=TENANT_B)
    events = [relay("b0"), relay("b1")]
    assert publish(router, TENANT_B, events, node=SHARED) == EventsApplied(2, 0)
    router.remove_peer(SHARED)
    gen = router.advertise_peer(SHARED, "127.0.0.1:9", "", [NS], caller=STORE).generation
    router.apply_store_events(SHARED, gen, [], STORE, seq=1, snapshot=True)
    assert (gpu_depth(router, "b0"), gpu_depth(router, "b1")) == (0, 4)
    # still recorded for that node id: its owner's (an admin's) snapshot replaces it
    router.remove_peer(SHARED)
    gen = router.advertise_peer(SHARED, "127.0.0.1:9", "", [NS], caller=TENANT_B).generation
    router.apply_store_events(SHARED, gen, [], TENANT_B, seq=1, snapshot=True)
    assert gpu_depth(router, "b1") == 0


def test_node_ids_churning_through_one_worker_keep_the_ledger_bounded(tenants):
    """A tenant advertising a new node id, relaying one event for its own worker
    and removing the peer, over and over, added a ledger entry a round for good
    (a review: 3,000 rounds, 3,000 entries). A worker keeps the last
    MAX_RELAYERS_PER_WORKER node ids; the blocks relayed stay indexed."""
    router = tenants
    for i in range(3 * MAX_RELAYERS_PER_WORKER):
        node = f"churn-{i}"
        router.advertise_peer(node, "127.0.0.1:3", "", [NS], caller=TENANT_A)
        assert publish(router, TENANT_A, [relay("a0")], node=node) == EventsApplied(1, 0)
        router.remove_peer(node)
    ref = router.admission.workers["a0"].ref
    last = [f"churn-{i}" for i in range(2 * MAX_RELAYERS_PER_WORKER, 3 * MAX_RELAYERS_PER_WORKER)]
    assert router.relays.nodes_of(ref) == last
    assert gpu_depth(router, "a0") == 4
    # the node ids remembered still replace what they relayed with their snapshot
    gen = router.advertise_peer(last[-1], "127.0.0.1:3", "", [NS], caller=TENANT_A).generation
    router.apply_store_events(last[-1], gen, [], TENANT_A, seq=1, snapshot=True)
    assert gpu_depth(router, "a0") == 0


def test_a_relay_refused_then_allowed_is_asked_for_again(tenants):
    """A trusted store on node-y relays for b0 while b0's card names the shared
    node (refused); b0 registers again attached to node-y, which then owes its
    snapshot: its next numbered batch is answered resync, and the snapshot lands."""
    router = tenants
    gen = router.advertise_peer("node-y", "127.0.0.1:4", "", [NS], caller=STORE).generation
    assert router.apply_store_events("node-y", gen, [], STORE, seq=1, snapshot=True).applied == 0
    refused = router.apply_store_events("node-y", gen, [relay("b0")], STORE, seq=2)
    assert refused == EventsApplied(0, 1)
    router.register_worker("b0", card(node_id="node-y", worker_type="prefill"), caller=TENANT_B)
    assert router.apply_store_events("node-y", gen, [], STORE, seq=3).resync
    assert router.stats().dropped_by.snapshot_owed == 0  # an empty batch drops no event
    snap = router.apply_store_events("node-y", gen, [relay("b0")], STORE, seq=4, snapshot=True)
    assert snap == EventsApplied(1, 0)
    assert gpu_depth(router, "b0") == 4


def test_a_refusal_no_card_can_lift_is_not_remembered(tenants):
    """Tenant A's node relays for B's worker b0 (refused: not A's, and A's node is
    no trusted store). b0 restarting must not cost A's store a snapshot each time."""
    router = tenants
    gen = router.peers.get("node-a").generation
    router.apply_store_events("node-a", gen, [], TENANT_A, seq=1, snapshot=True)
    assert router.apply_store_events("node-a", gen, [relay("b0")], TENANT_A, seq=2).dropped == 1
    router.register_worker("b0", card(node_id="node-a", worker_type="prefill"), caller=TENANT_B)
    assert not router.apply_store_events("node-a", gen, [], TENANT_A, seq=3).resync
