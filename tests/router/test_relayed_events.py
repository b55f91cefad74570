"""GPU-tier events a store relays for a worker, and who may relay them.

A store relays its attached workers' GPU-tier events to the router in its
event batches (docs/design.md §6). Without ``--store-cn`` any certificate may
publish as a store, so before, tenant A could advertise a node of its own and
relay ``stored`` or ``removed`` events for tenant B's worker: B's prefix index,
and so B's routes, were A's to steer (no KV bytes exposed). Now a relayed event
applies only when its publisher may speak for the worker: the worker's owner,
an admin, or a trusted store (``RouterConfig.store_cns``, fed by
``--store-cn``), which relays for every tenant's workers on a shared store.
Any other relay is dropped and counted under a cause of its own
(``relay_refused``, not the ``not_indexable`` of a store event about another
holder), the rest of its batch applies, and nothing of that worker's changes
(docs/design.md §8).
"""

from __future__ import annotations

import pytest

from kvstore.router.core import EventsApplied, Router, RouterConfig
from kvstore.wire import limits
from kvstore.wire.events import StoreEvent
from kvstore.wire.principal import LOCAL, Principal
from tests.router.conftest import card

NS = "tenant.0123456789abcdef"
HASHES = [101, 102, 103, 104]
TENANT_A = Principal("tenant-a")
TENANT_B = Principal("tenant-b")
STORE = Principal("store-x")  # a trusted store node (--store-cn store-x)
ADMIN = Principal("ops", admin=True)


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
    """Tenant A's worker a0 and tenant B's worker b0; node-a is tenant A's store
    node (advertised by tenant A's certificate: no --store-cn, so it may)."""
    router = Router(RouterConfig())
    router.config.store_cns = frozenset({STORE.name})  # as ServedRouter.start sets it
    router.register_worker("a0", card(), caller=TENANT_A)
    router.register_worker("b0", card(), caller=TENANT_B)
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
    # the route for these hashes cannot be pulled to b0 by A's relay
    assert router.route("llama-8b", hashes=HASHES, track=False).worker.name == "a0"


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
    admin; without TLS every caller is the local admin) it relays for all of them."""
    router = tenants
    router.advertise_peer("shared", "127.0.0.1:3", "", [NS], caller=relayer)
    events = [relay("a0", HASHES[:1]), relay("b0"), relay("b0", HASHES[3:], "removed")]
    assert publish(router, relayer, events, node="shared") == EventsApplied(3, 0)
    assert (gpu_depth(router, "a0"), gpu_depth(router, "b0")) == (1, 3)
    assert router.stats().events_dropped == 0


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


def test_the_direct_relay_entry_point_checks_its_caller(tenants):
    """apply_relayed_worker_event, as a feed calls it: the caller is the relayer."""
    router = tenants
    assert router.apply_relayed_worker_event(relay("b0"), TENANT_A) is False
    assert router.apply_relayed_worker_event(relay("b0"), TENANT_B) is True
    assert router.apply_relayed_worker_event(relay("a0"), STORE) is True
    assert (gpu_depth(router, "a0"), gpu_depth(router, "b0")) == (4, 4)
    assert router.stats().dropped_by.relay_refused == router.stats().events_dropped == 1


def test_a_node_id_taken_over_cannot_erase_what_it_relayed_for_another_tenant(tenants):
    """A snapshot replaces the GPU tier of the workers its node id relayed for.
    Once tenant A's node-a has left, tenant B may advertise a node of that id:
    its snapshot must not erase A's worker's blocks (B could not relay their
    removal either), while a trusted store's snapshot of that id may."""
    router = tenants
    assert publish(router, TENANT_A, [relay("a0")]) == EventsApplied(1, 0)
    router.remove_peer("node-a")
    gen = router.advertise_peer("node-a", "127.0.0.1:9", "", [NS], caller=TENANT_B).generation
    assert router.apply_store_events("node-a", gen, [], TENANT_B, seq=1, snapshot=True).applied == 0
    assert gpu_depth(router, "a0") == 4
    router.remove_peer("node-a")
    gen = router.advertise_peer("node-a", "127.0.0.1:9", "", [NS], caller=STORE).generation
    router.apply_store_events("node-a", gen, [], STORE, seq=1, snapshot=True)
    assert gpu_depth(router, "a0") == 0
