"""Issue 12, the router over mutual TLS: a worker name and a store node id belong
to the certificate CN that claimed them; every attack is refused with its status."""

from __future__ import annotations

import grpc
import pytest

from kvstore._proto import router_pb2, router_pb2_grpc
from kvstore.client.router_client import RouterClient
from kvstore.router.core import Router, RouterConfig
from kvstore.service.tls import Security
from kvstore.wire.errors import Code, KVError
from kvstore.wire.events import StoreEvent
from kvstore.wire.principal import NodeBinding
from tests.router.conftest import ServerThread as RouterThread
from tests.router.conftest import card
from tests.security.conftest import ADMIN

NS = "llama.0123456789abcdef"


def refused(fn, *args, **kwargs) -> KVError:
    with pytest.raises(KVError) as info:
        fn(*args, **kwargs)
    return info.value


def test_worker_name_hijack_is_permission_denied(pki, tls_router):
    """Before: a second RegisterWorker of "w0" replaced its address and Route sent
    the victim's traffic to the attacker. Now: PERMISSION_DENIED, nothing changes."""
    victim = RouterClient(tls_router.address, tls=pki.issue("tenant-a"))
    attacker = RouterClient(tls_router.address, tls=pki.issue("tenant-b"))
    gen = victim.register_worker("w0", card(address="10.0.0.1:8000")).generation
    err = refused(attacker.register_worker, "w0", card(address="10.6.6.6:8000"))
    assert err.code is Code.PERMISSION_DENIED and "tenant-a" not in err.message
    routed = victim.route("llama-8b", token_ids=list(range(64)))
    assert (routed.worker, routed.address, routed.generation) == ("w0", "10.0.0.1:8000", gen)
    # the owner may re-register it (a restart), under a new generation
    again = victim.register_worker("w0", card(address="10.0.0.1:8001")).generation
    assert again > gen


def test_a_tenants_worker_set_is_neither_joined_nor_routed_to_by_another(pki, tls_router):
    """Before: tenant-b registered a copy of tenant-a's card under its own
    worker name, joined tenant-a's WorkerSet and drew a share of tenant-a's
    routes; its own Route saw tenant-a's cached prefixes. Now both are refused:
    PERMISSION_DENIED to join, NOT_FOUND to route (as for a model nobody serves)."""
    victim = RouterClient(tls_router.address, tls=pki.issue("tenant-a"))
    attacker = RouterClient(tls_router.address, tls=pki.issue("tenant-b"))
    victim.register_worker("w0", card(address="10.0.0.1:8000"))
    err = refused(attacker.register_worker, "copy", card(address="10.6.6.6:8000"))
    assert err.code is Code.PERMISSION_DENIED and "WorkerSet llama-8b" in err.message
    assert refused(attacker.route, "llama-8b", token_ids=[1]).code is Code.NOT_FOUND
    for _ in range(4):
        assert victim.route("llama-8b", token_ids=list(range(64))).worker == "w0"


def test_foreign_remove_worker_is_permission_denied_but_admin_may(pki, tls_router):
    owner = RouterClient(tls_router.address, tls=pki.issue("tenant-a"))
    stranger = RouterClient(tls_router.address, tls=pki.issue("tenant-b"))
    admin = RouterClient(tls_router.address, tls=pki.issue(ADMIN))
    owner.register_worker("w0", card())
    owner.register_worker("w1", card())
    assert refused(stranger.remove_worker, "w0").code is Code.PERMISSION_DENIED
    assert owner.route("llama-8b", token_ids=[1, 2, 3]).worker in ("w0", "w1")
    assert owner.remove_worker("w0") is True
    assert admin.remove_worker("w1") is True
    assert refused(owner.route, "llama-8b", token_ids=[1]).code is Code.NOT_FOUND


def test_a_tenant_cannot_touch_another_tenants_load_or_requests(pki, tls_router):
    """Before: any certificate could report a huge queue on another tenant's
    worker (routes then avoided it), or finish its tracked requests and reuse
    their ids. Now a load report is the worker owner's, a tracked request its
    router's, and a stranger's start or finish changes nothing."""
    owner = RouterClient(tls_router.address, tls=pki.issue("tenant-a"))
    stranger = RouterClient(tls_router.address, tls=pki.issue("tenant-b"))
    owner.register_worker("w0", card())
    err = refused(stranger.report_load, "w0", 1 << 40, 1000)
    assert err.code is Code.PERMISSION_DENIED and "tenant-a" not in err.message
    routed = owner.route("llama-8b", token_ids=list(range(64)), request_id="q1", track=True)
    assert owner.stats().active_requests == 1 and routed.request_id == "q1"
    stranger.request_started("q1")
    stranger.request_finished("q1")
    assert owner.stats().active_requests == 1  # still tracked: the stranger changed nothing
    err = refused(stranger.route, "llama-8b", token_ids=[1], request_id="q1", track=True)
    assert err.code is Code.ALREADY_EXISTS
    owner.report_load("w0", 10, 1)
    owner.request_finished("q1")
    assert owner.stats().active_requests == 0


def test_node_id_spoofing_on_advertise_and_publish_is_permission_denied(pki, tls_router):
    """Before: anyone could advertise or publish as any store node and poison
    QueryPrefix (issue 12, item 1). Now a node id is its first advertiser's."""
    node_a = RouterClient(tls_router.address, tls=pki.issue("node-a"))
    rogue = RouterClient(tls_router.address, tls=pki.issue("node-b"))
    gen = node_a.advertise_peer("node-a", "127.0.0.1:1", "127.0.0.1:2", [NS])
    node_a.publish([StoreEvent("stored", NS, [1, 2], "node-a")], "node-a", gen)

    err = refused(rogue.advertise_peer, "node-a", "127.0.0.1:9", "127.0.0.1:9", [NS])
    assert err.code is Code.PERMISSION_DENIED and "node-a" in err.message
    poison = [StoreEvent("stored", NS, [1, 2, 3, 4], "node-a")]
    assert refused(rogue.publish, poison, "node-a", gen).code is Code.PERMISSION_DENIED
    # a stale generation is no way around it either
    assert refused(rogue.publish, poison, "node-a", gen + 7).code is Code.PERMISSION_DENIED

    peers = node_a.query_prefix(NS, [1, 2, 3, 4])
    assert [(p.node_id, p.ucx_address, p.prefix_blocks) for p in peers] == [
        ("node-a", "127.0.0.1:2", 2)
    ]
    # the rogue may advertise itself under its own id, and nothing of node-a's changes
    rogue.advertise_peer("node-b", "127.0.0.1:9", "127.0.0.1:9", [NS])
    assert node_a.query_prefix(NS, [1, 2])[0].node_id == "node-a"


def test_query_prefix_answers_store_nodes_and_admins_only(pki, tls_router):
    """Before: any certificate could ask which peers hold a tenant's prefixes."""
    node = RouterClient(tls_router.address, tls=pki.issue("node-a"))
    tenant = RouterClient(tls_router.address, tls=pki.issue("tenant-b"))
    admin = RouterClient(tls_router.address, tls=pki.issue(ADMIN))
    gen = node.advertise_peer("node-a", "127.0.0.1:1", "127.0.0.1:2", [NS])
    node.publish([StoreEvent("stored", NS, [1, 2], "node-a")], "node-a", gen)
    err = refused(tenant.query_prefix, NS, [1, 2])
    assert err.code is Code.PERMISSION_DENIED and "tenant-b" in err.message
    assert [p.prefix_blocks for p in node.query_prefix(NS, [1, 2])] == [2]
    assert [p.prefix_blocks for p in admin.query_prefix(NS, [1, 2])] == [2]


def test_client_without_a_certificate_is_refused(pki, tls_router):
    channel = grpc.insecure_channel(tls_router.address)  # plaintext to a TLS port
    stub = router_pb2_grpc.RouterStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.RouterStats(router_pb2.RouterStatsRequest(), timeout=5)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    # TLS that trusts the server but presents no client certificate
    with open(pki.ca, "rb") as f:
        server_only = grpc.ssl_channel_credentials(root_certificates=f.read())
    stub = router_pb2_grpc.RouterStub(grpc.secure_channel(tls_router.address, server_only))
    with pytest.raises(grpc.RpcError) as info:
        stub.RouterStats(router_pb2.RouterStatsRequest(), timeout=5)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    assert tls_router.router.stats().workers == 0


def test_certificate_of_another_ca_is_refused(tmp_path, tls_router):
    from kvstore.testing.pki import Pki

    rogue = Pki(tmp_path, name="rogue-ca").issue("tenant-a")  # the right CN, the wrong CA
    client = RouterClient(tls_router.address, timeout_s=5, tls=rogue)
    assert refused(client.register_worker, "w0", card()).code is Code.UNAVAILABLE
    assert tls_router.router.stats().workers == 0


def test_a_certificate_naming_several_cns_is_unauthenticated(pki, tls_router):
    """gRPC names a caller by the first CN of its subject, other tools by the
    last: a certificate of /CN=<admin>/CN=tenant-b, which a CA checking the last
    CN would issue to tenant-b, made its holder the admin."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    def attr(oid, value):
        return x509.NameAttribute(oid, value)

    rdn = x509.RelativeDistinguishedName
    hiding = [  # subjects whose printed form hides the second CN from a text count
        x509.Name([rdn([attr(NameOID.COMMON_NAME, "tenant-b"), attr(NameOID.COMMON_NAME, ADMIN)])]),
        x509.Name(
            [
                rdn([attr(NameOID.COMMON_NAME, ADMIN)]),
                rdn([attr(NameOID.ORGANIZATIONAL_UNIT_NAME, "x\\")]),
                rdn([attr(NameOID.COMMON_NAME, "tenant-b")]),
            ]
        ),
    ]
    for i, tls in enumerate(
        [pki.issue(ADMIN, "tenant-b")]
        + [pki.issue(f"hiding{i}", subject=n) for i, n in enumerate(hiding)]
    ):
        client = RouterClient(tls_router.address, timeout_s=5, tls=tls)
        err = refused(client.register_worker, f"w{i}", card())
        assert err.code is Code.UNAUTHENTICATED and "several CNs" in err.message, i
    assert tls_router.router.stats().workers == 0
    one = RouterClient(tls_router.address, timeout_s=5, tls=pki.issue("tenant-b"))
    one.register_worker("w0", card())  # one CN: as ever
    assert tls_router.router.stats().workers == 1


def test_one_certificate_cannot_fill_the_routers_peers(pki, tls_router, monkeypatch):
    """Any certificate may advertise a store node; one that advertised
    MAX_PEERS_PER_PRINCIPAL of them is RESOURCE_EXHAUSTED (it could fill
    MAX_PEERS and lock every real store out), other certificates are not."""
    from kvstore.wire import limits

    monkeypatch.setattr(limits, "MAX_PEERS_PER_PRINCIPAL", 3)  # the router runs in this process
    greedy = RouterClient(tls_router.address, tls=pki.issue("tenant-a"))
    store = RouterClient(tls_router.address, tls=pki.issue("node-a"))
    for i in range(3):
        greedy.advertise_peer(f"n{i}", "127.0.0.1:1", "", [NS])
    err = refused(greedy.advertise_peer, "n3", "127.0.0.1:1", "", [NS])
    assert err.code is Code.RESOURCE_EXHAUSTED and "tenant-a" in err.message
    greedy.advertise_peer("n0", "127.0.0.1:1", "", [NS])  # its own again: a restart
    assert store.advertise_peer("node-a", "127.0.0.1:2", "", [NS]) > 0


def test_one_certificate_cannot_admit_workers_without_end(pki, tls_router, monkeypatch):
    """Each worker may cost the router an event feed (a task, two ZMQ sockets):
    a non-admin certificate may have MAX_WORKERS_PER_PRINCIPAL admitted."""
    from kvstore.wire import limits

    monkeypatch.setattr(limits, "MAX_WORKERS_PER_PRINCIPAL", 2)
    greedy = RouterClient(tls_router.address, tls=pki.issue("tenant-a"))
    other = RouterClient(tls_router.address, tls=pki.issue("tenant-b"))
    greedy.register_worker("a0", card())
    greedy.register_worker("a1", card())
    err = refused(greedy.register_worker, "a2", card())
    assert err.code is Code.RESOURCE_EXHAUSTED and "tenant-a" in err.message
    greedy.register_worker("a1", card(address="10.0.0.9:8000"))  # its own again: a restart
    other.register_worker("b0", card(namespace="b-ns"))  # its own set
    greedy.remove_worker("a0")
    greedy.register_worker("a2", card())


def test_a_router_told_its_store_cns_lets_no_other_certificate_act_as_a_store(pki):
    """Before: any certificate of the CA could advertise a dummy store node and
    then ask QueryPrefix which peers hold any tenant's prefixes. With --store-cn
    only those CNs (and admins) may advertise, publish or ask; nothing changes
    on a refusal."""
    security = Security(pki.server, admins=(ADMIN,), stores=("node-a",))
    router = RouterThread(Router(RouterConfig()), security=security)
    try:
        node = RouterClient(router.address, tls=pki.issue("node-a"))
        tenant = RouterClient(router.address, tls=pki.issue("tenant-b"))
        admin = RouterClient(router.address, tls=pki.issue(ADMIN))
        err = refused(tenant.advertise_peer, "n-rogue", "127.0.0.1:1", "", [NS])
        assert err.code is Code.PERMISSION_DENIED and "--store-cn" in err.message
        assert router.router.stats().peers == 0
        gen = node.advertise_peer("node-a", "127.0.0.1:1", "127.0.0.1:2", [NS])
        node.publish([StoreEvent("stored", NS, [1, 2], "node-a")], "node-a", gen)
        err = refused(tenant.publish, [StoreEvent("stored", NS, [3], "node-a")], "node-b", 1)
        assert err.code is Code.PERMISSION_DENIED and "PublishEvents" in err.message
        err = refused(tenant.query_prefix, NS, [1, 2])
        assert err.code is Code.PERMISSION_DENIED and "QueryPrefix" in err.message
        assert [p.prefix_blocks for p in node.query_prefix(NS, [1, 2, 3])] == [2]
        assert admin.advertise_peer("node-b", "127.0.0.1:3", "", [NS]) > 0  # an admin may
        held = {p.node_id: p.prefix_blocks for p in admin.query_prefix(NS, [1, 2])}
        assert held["node-a"] == 2
    finally:
        router.stop()


def gpu_route(client: RouterClient, model: str, hashes) -> tuple[str, int]:
    """The worker a route of ``hashes`` picks, and its GPU-tier blocks of them."""
    routed = client.route(model, hashes=hashes, track=False)
    return routed.worker, routed.gpu_blocks


def test_a_tenant_cannot_relay_gpu_blocks_for_another_tenants_worker(pki, tls_router):
    """Without --store-cn any certificate may act as a store. Before, tenant-b
    advertised a node and relayed GPU-tier events for tenant-a's worker: stored
    ones drew tenant-a's routes (and its prefix accounting) to whatever tenant-b
    chose, removed ones erased what tenant-a's own store had relayed. Now a relay
    applies only for the worker's owner, an admin or a --store-cn store: the
    rest of the batch applies, the refusal is counted (relay_refused)."""
    victim = RouterClient(tls_router.address, tls=pki.issue("tenant-a"))
    rogue = RouterClient(tls_router.address, tls=pki.issue("tenant-b"))
    admin = RouterClient(tls_router.address, tls=pki.issue(ADMIN))
    victim.register_worker("a0", card(display_name="model-a"))
    victim.register_worker("a1", card(display_name="model-a"))
    gen = victim.advertise_peer("node-a", "127.0.0.1:1", "", [NS])
    reply = victim.publish([StoreEvent("stored", NS, [1, 2], "a0", tier="gpu")], "node-a", gen)
    assert (reply.applied, reply.dropped) == (1, 0)  # its own worker: applied
    assert gpu_route(victim, "model-a", [1, 2]) == ("a0", 2)

    rogue_gen = rogue.advertise_peer("node-b", "127.0.0.1:2", "", [NS])
    poison = [
        StoreEvent("stored", NS, [9, 8, 7], "node-b"),  # its own store blocks: fine
        StoreEvent("stored", NS, [9, 8, 7], "a1", tier="gpu"),
        StoreEvent("removed", NS, [1, 2], "a0", tier="gpu"),
    ]
    before = tls_router.router.stats()
    reply = rogue.publish(poison, "node-b", rogue_gen)
    assert (reply.applied, reply.dropped) == (1, 2)
    assert gpu_route(victim, "model-a", [1, 2]) == ("a0", 2)  # not erased
    assert gpu_route(victim, "model-a", [9, 8, 7])[1] == 0  # not planted
    stats = rogue.stats()
    assert stats.dropped_by.relay_refused == before.dropped_by.relay_refused + 2
    assert stats.dropped_by.not_indexable == before.dropped_by.not_indexable
    assert stats.events_dropped == before.events_dropped + 2
    assert stats.indexed_blocks == before.indexed_blocks + 3  # node-b's own blocks only

    # an admin may relay for any worker (a shared store given --admin)
    admin_gen = admin.advertise_peer("node-ops", "127.0.0.1:3", "", [NS])
    reply = admin.publish([StoreEvent("stored", NS, [5, 6], "a1", tier="gpu")], "", admin_gen)
    assert (reply.applied, reply.dropped) == (1, 0)
    assert gpu_route(victim, "model-a", [5, 6]) == ("a1", 2)


def test_a_store_named_by_store_cn_relays_for_every_tenants_worker(pki):
    """A shared store serves several tenants' workers: the router told its CN
    (--store-cn) applies its relays for any of them attached to its node;
    every other certificate is no store there at all."""
    security = Security(pki.server, admins=(ADMIN,), stores=("node-a",))
    router = RouterThread(Router(RouterConfig()), security=security)
    try:
        node = RouterClient(router.address, tls=pki.issue("node-a"))
        tenant_a = RouterClient(router.address, tls=pki.issue("tenant-a"))
        tenant_b = RouterClient(router.address, tls=pki.issue("tenant-b"))
        tenant_a.register_worker("a0", card(display_name="model-a", node_id="node-a"))
        tenant_b.register_worker("b0", card(display_name="model-b", node_id="node-a"))
        gen = node.advertise_peer("node-a", "127.0.0.1:1", "", [NS])
        relayed = [
            StoreEvent("stored", NS, [1, 2], "a0", tier="gpu"),
            StoreEvent("stored", NS, [3, 4, 5], "b0", tier="gpu"),
        ]
        reply = node.publish(relayed, "node-a", gen)
        assert (reply.applied, reply.dropped) == (2, 0)
        assert gpu_route(tenant_a, "model-a", [1, 2]) == ("a0", 2)
        assert gpu_route(tenant_b, "model-b", [3, 4, 5]) == ("b0", 3)
    finally:
        router.stop()


def test_a_store_cn_relays_only_for_workers_attached_to_its_node(pki):
    """Before, a --store-cn store was trusted for every worker of every tenant:
    store node-a could plant or erase GPU blocks of a worker attached to node-b
    and steer its routes. Now its relay counts only for workers whose card names
    the node it publishes as; the others are dropped (relay_refused), the rest
    of the batch applies, and its snapshot erases none of theirs. An admin
    relays as before (the owner too: tests/router/test_relayed_events.py)."""
    security = Security(pki.server, admins=(ADMIN,), stores=("node-a", "node-b"))
    router = RouterThread(Router(RouterConfig()), security=security)
    try:
        node_a = RouterClient(router.address, tls=pki.issue("node-a"))
        node_b = RouterClient(router.address, tls=pki.issue("node-b"))
        tenant = RouterClient(router.address, tls=pki.issue("tenant-a"))
        admin = RouterClient(router.address, tls=pki.issue(ADMIN))
        tenant.register_worker("a0", card(display_name="model-a", node_id="node-a"))
        tenant.register_worker("b0", card(display_name="model-b", node_id="node-b"))
        gen_b = node_b.advertise_peer("node-b", "127.0.0.1:2", "", [NS])
        reply = node_b.publish([StoreEvent("stored", NS, [1, 2], "b0", tier="gpu")], "", gen_b)
        assert (reply.applied, reply.dropped) == (1, 0)  # its own node's worker

        gen_a = node_a.advertise_peer("node-a", "127.0.0.1:1", "", [NS])
        before = router.router.stats()
        events = [
            StoreEvent("stored", NS, [7, 8], "a0", tier="gpu"),  # attached to node-a
            StoreEvent("stored", NS, [9, 8, 7], "b0", tier="gpu"),
            StoreEvent("removed", NS, [1, 2], "b0", tier="gpu"),
        ]
        reply = node_a.publish(events, "node-a", gen_a)
        assert (reply.applied, reply.dropped) == (1, 2)
        assert gpu_route(tenant, "model-a", [7, 8]) == ("a0", 2)
        assert gpu_route(tenant, "model-b", [1, 2]) == ("b0", 2)  # not erased
        assert gpu_route(tenant, "model-b", [9, 8, 7])[1] == 0  # not planted
        stats = router.router.stats()
        assert stats.dropped_by.relay_refused == before.dropped_by.relay_refused + 2
        assert stats.events_dropped == before.events_dropped + 2

        # an admin relays for b0 through any node, node-a included, as before
        reply = admin.publish([StoreEvent("stored", NS, [5, 6], "b0", tier="gpu")], "node-a", gen_a)
        assert (reply.applied, reply.dropped) == (1, 0)
        assert gpu_route(tenant, "model-b", [5, 6]) == ("b0", 2)
        # node-a's snapshot replaces a0's relayed blocks, and none of b0's: it
        # could not relay their removal either
        reply = node_a.publish([], "node-a", gen_a, seq=1, snapshot=True)
        assert gpu_route(tenant, "model-a", [7, 8])[1] == 0
        assert gpu_route(tenant, "model-b", [1, 2]) == ("b0", 2)
        assert gpu_route(tenant, "model-b", [5, 6]) == ("b0", 2)
    finally:
        router.stop()


def test_a_store_cn_bound_to_its_node_cannot_take_another_nodes_id(pki):
    """With --store-node CN=NODE_ID the certificate, not the first advertiser,
    decides which node a store is: store-a cannot advertise node-b before node-b's
    own store does (and so relay for the workers attached to it), nor anything
    but node-a; store-b publishes as node-b as before (ServedRouter.start takes the
    bindings from the server's Security)."""
    bound = (NodeBinding("store-a", "node-a"), NodeBinding("store-b", "node-b"))
    security = Security(pki.server, (ADMIN,), ("store-a", "store-b"), bound)
    router = RouterThread(Router(RouterConfig()), security=security)
    try:
        store_a = RouterClient(router.address, tls=pki.issue("store-a"))
        store_b = RouterClient(router.address, tls=pki.issue("store-b"))
        tenant = RouterClient(router.address, tls=pki.issue("tenant-b"))
        tenant.register_worker("b0", card(display_name="model-b", node_id="node-b"))
        for node in ("node-b", "node-z"):
            err = refused(store_a.advertise_peer, node, "127.0.0.1:1", "", [NS])
            assert err.code == Code.PERMISSION_DENIED and "--store-node" in str(err)
        relay = [StoreEvent("stored", NS, [1, 2], "b0", tier="gpu")]
        assert refused(store_a.publish, relay, "node-b", 1).code == Code.PERMISSION_DENIED
        gen_b = store_b.advertise_peer("node-b", "127.0.0.1:2", "", [NS])
        reply = store_b.publish(relay, "node-b", gen_b)
        assert (reply.applied, reply.dropped) == (1, 0)
        assert store_a.advertise_peer("node-a", "127.0.0.1:1", "", [NS]) >= 1
    finally:
        router.stop()
