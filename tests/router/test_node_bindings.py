"""Store certificates bound to node ids (``--store-node CN=NODE_ID``).

A trusted store relays GPU-tier events for every worker attached to the node it
publishes as (tests/router/test_relayed_events.py). Which node that is was
decided by whoever advertised the node id first: any ``--store-cn`` certificate
could advertise a node id no store had taken yet (a node not started, or gone)
and relay, plant or erase blocks of the workers attached to it, steering their
routes. A binding makes the certificate decide: a bound node id is its CN's
alone, and a bound CN acts as no other node id. Admins act as any, as before;
unbound store CNs keep the first-claim rule.
"""

from __future__ import annotations

import argparse

import pytest

from kvstore.router.core import Router, RouterConfig
from kvstore.wire.errors import Code, KVError
from kvstore.wire.events import StoreEvent
from kvstore.wire.principal import NodeBinding, Principal, node_owners
from tests.router.conftest import card

NS = "tenant.0123456789abcdef"
STORE_A, STORE_B, STORE_C = Principal("store-a"), Principal("store-b"), Principal("store-c")
ADMIN = Principal("ops", admin=True)
TENANT = Principal("tenant")


@pytest.fixture
def router() -> Router:
    """store-a bound to node-a, store-b to node-b; store-c trusted but unbound;
    the tenant's worker b0 attached to node-b, whose store has not advertised."""
    config = RouterConfig(
        store_cns=frozenset({"store-a", "store-b", "store-c"}),
        node_owners=node_owners(
            [NodeBinding("store-a", "node-a"), NodeBinding("store-b", "node-b")]
        ),
    )
    router = Router(config)
    router.register_worker("b0", card(node_id="node-b"), caller=TENANT)
    return router


def refused(fn, *args, **kw) -> str:
    with pytest.raises(KVError) as err:
        fn(*args, **kw)
    assert err.value.code == Code.PERMISSION_DENIED
    return str(err.value)


def gpu_depth(router: Router, name: str, hashes) -> int:
    worker = router.admission.workers[name]
    return router.domains.depths([worker], hashes).get((worker.ref, "gpu"), 0)


def test_a_bound_store_cannot_take_another_nodes_id_and_relay_for_its_workers(router):
    msg = refused(router.advertise_peer, "node-b", "127.0.0.1:9", "", [NS], caller=STORE_A)
    assert "node_id 'node-b' is bound to another certificate (--store-node)" in msg
    assert "store-b" not in msg  # a refusal names no other identity
    assert router.peers.get("node-b") is None  # nothing claimed
    relay = [StoreEvent("stored", NS, [1, 2], "b0", tier="gpu")]
    msg = refused(router.apply_store_events, "node-b", 1, relay, STORE_A)
    assert "PublishEvents" in msg and gpu_depth(router, "b0", [1, 2]) == 0


def test_an_unbound_store_cannot_take_a_bound_node_id(router):
    refused(router.advertise_peer, "node-a", "127.0.0.1:9", "", [NS], caller=STORE_C)
    gen = router.advertise_peer("node-c", "127.0.0.1:3", "", [NS], caller=STORE_C).generation
    assert gen  # unbound node ids: the first claim holds, as before


def test_a_bound_store_acts_as_its_own_node_ids_only(router):
    msg = refused(router.advertise_peer, "node-x", "127.0.0.1:9", "", [NS], caller=STORE_A)
    assert "bound by --store-node to node ids ['node-a']" in msg
    gen = router.advertise_peer("node-b", "127.0.0.1:2", "", [NS], caller=STORE_B).generation
    relay = [StoreEvent("stored", NS, [1, 2], "b0", tier="gpu")]
    applied = router.apply_store_events("node-b", gen, relay, STORE_B)
    assert applied.applied == 1 and gpu_depth(router, "b0", [1, 2]) == 2


def test_an_admin_acts_as_any_node(router):
    gen = router.advertise_peer("node-b", "127.0.0.1:2", "", [NS], caller=ADMIN).generation
    assert router.apply_store_events("node-b", gen, [], ADMIN).applied == 0


def test_bindings_parse_and_a_node_id_bound_to_two_certificates_is_refused():
    from kvstore.cli.router import store_cns, store_node

    # split at the last '=': an X.509 CN may hold one, a node id not
    assert NodeBinding.parse("CN=store,O=x=node-1") == NodeBinding("CN=store,O=x", "node-1")
    for bad in ("store-a", "=node-a", "store-a=", "a=" + "n" * 300, "a=n\n1"):
        with pytest.raises(argparse.ArgumentTypeError):
            store_node(bad)
    stores = store_cns(["b", "a", "ops=x"], [store_node("a=n1"), store_node("a=n2")])
    assert stores.cns == ("b", "a", "ops=x")  # a bare --store-cn is taken verbatim
    assert stores.bound == (NodeBinding("a", "n1"), NodeBinding("a", "n2"))
    with pytest.raises(ValueError, match="node id 'n1' is bound to two certificates"):
        store_cns([], [store_node("a=n1"), store_node("b=n1")])
