"""--tenant CN=NAMESPACE over mutual TLS: a bound client namespace is its
certificate's alone, on the store and on the router it embeds, from the start
(not only once its tenant has claimed it), and a bound certificate claims no
other namespace; an admin may act in any."""

from __future__ import annotations

import pytest

from kvstore.client.router_client import RouterClient
from kvstore.router.core import Router, RouterConfig
from kvstore.service.router_server import ServedRouter
from kvstore.wire.errors import Code, KVError
from kvstore.wire.principal import Principal, Tenancy, TenantBinding
from tests.router.conftest import card
from tests.security.conftest import ADMIN, tls_store_thread
from tests.security.test_store_auth import Rank, callers, refused

BOUND = TenantBinding("tenant-a", "a-ns")


@pytest.fixture
def bound_store(pki):
    s = tls_store_thread(pki, ServedRouter(Router(RouterConfig())), tenants=(BOUND,))
    yield s
    s.stop()


def test_a_bound_namespace_is_its_tenants_before_it_claims_it(pki, bound_store):
    """Before: a client namespace (store) and a WorkerSet (router) were their
    first claimer's: tenant-b, registering first in tenant-a's namespace, kept
    tenant-a out of it. Now tenant-b is PERMISSION_DENIED there from the start,
    naming the field and the binding but not tenant-a's CN (a refusal names no
    other tenant: before, it did); tenant-a claims it and no other."""
    store = callers(pki, bound_store.address)
    routers = {
        cn: RouterClient(bound_store.address, tls=pki.issue(cn))
        for cn in ("tenant-a", "tenant-b", ADMIN)
    }
    err = refused(Rank, store.b, "squat", "a-ns")
    assert err.code is Code.PERMISSION_DENIED
    assert "client_namespace 'a-ns' is bound to another certificate (--tenant)" in err.message
    assert "tenant-a" not in err.message  # a refusal names no other tenant
    err = refused(routers["tenant-b"].register_worker, "squat", card(namespace="a-ns"))
    assert err.code is Code.PERMISSION_DENIED
    assert "card.namespace 'a-ns' is bound to another certificate (--tenant)" in err.message
    assert "tenant-a" not in err.message  # a refusal names no other tenant
    assert routers["tenant-b"].stats().workers == 0
    # tenant-a is confined to its namespace
    err = refused(Rank, store.a, "elsewhere", "b-ns")
    assert err.code is Code.PERMISSION_DENIED and "['a-ns'] (--tenant)" in err.message
    err = refused(routers["tenant-a"].register_worker, "elsewhere", card(namespace="b-ns"))
    assert err.code is Code.PERMISSION_DENIED and "card.namespace 'b-ns'" in err.message
    ranks = [Rank(store.a, "a0", "a-ns"), Rank(store.b, "b0", "b-ns")]  # unbound: first come
    try:
        routers["tenant-a"].register_worker("w-a", card(namespace="a-ns"))
        routers[ADMIN].register_worker("w-ops", card(namespace="b-ns"))
        assert routers[ADMIN].stats().workers == 2
    finally:
        for rank in ranks:
            rank.close()
        for client in (*store, *routers.values()):
            client.close()


def test_the_router_core_checks_the_binding_before_anything_is_admitted():
    router = Router(RouterConfig(tenancy=Tenancy([BOUND])))
    a, b = Principal("tenant-a"), Principal("tenant-b")
    with pytest.raises(KVError) as info:
        router.register_worker("squat", card(namespace="a-ns"), caller=b)
    assert info.value.code is Code.PERMISSION_DENIED
    assert router.worker_generations() == {}
    router.register_worker("w-a", card(namespace="a-ns"), caller=a)
    router.register_worker("w-b", card(namespace="b-ns"), caller=b)
    router.register_worker("w-ops", card(namespace="a-ns"), caller=Principal(ADMIN, admin=True))
    assert set(router.worker_generations()) == {"w-a", "w-b", "w-ops"}


def test_one_namespace_bound_to_two_certificates_is_refused():
    with pytest.raises(ValueError, match="namespace 'a-ns' is bound to two certificates"):
        Tenancy([BOUND, TenantBinding("tenant-b", "a-ns")])
    assert TenantBinding.parse("CN=t,O=x=a-ns") == TenantBinding("CN=t,O=x", "a-ns")


def test_an_admin_acting_in_a_bound_namespace_does_not_lock_its_tenant_out(pki, bound_store):
    """Before: an admin's store registration claimed the bound namespace for the
    admin's CN, and an admin's first worker made the router's set the admin's:
    the bound tenant was then PERMISSION_DENIED in its own namespace (found by
    review). Now an admin claims nothing on the store and a set made in a bound
    namespace is its tenant's, whoever admits its first member."""
    store = callers(pki, bound_store.address)
    tenant = RouterClient(bound_store.address, tls=pki.issue("tenant-a"))
    admin = RouterClient(bound_store.address, tls=pki.issue(ADMIN))
    ranks = [Rank(store.admin, "ops-inst", "a-ns")]
    try:
        ranks.append(Rank(store.a, "a-inst", "a-ns"))
        admin.register_worker("ops0", card(namespace="a-ns"))
        tenant.register_worker("a0", card(namespace="a-ns"))
        routed = {tenant.route("llama-8b", token_ids=[1], track=False).worker for _ in range(8)}
        assert routed <= {"ops0", "a0"} and routed
    finally:
        for rank in ranks:
            rank.close()
        for client in (*store, tenant, admin):
            client.close()


def test_an_admins_store_registration_claims_no_namespace(pki, tls_store):
    """Without bindings too: a namespace an admin registered in first is still
    the first tenant's to claim."""
    store = callers(pki, tls_store.address)
    ranks = [Rank(store.admin, "ops-inst", "x-ns")]
    try:
        ranks.append(Rank(store.b, "b-inst", "x-ns"))
        err = refused(Rank, store.a, "a-inst", "x-ns")
        assert err.code is Code.PERMISSION_DENIED and "x-ns" in err.message
        assert "tenant-b" not in err.message  # another tenant's identity is not told
    finally:
        for rank in ranks:
            rank.close()
        for client in store:
            client.close()


def test_a_store_and_its_router_share_first_claims_of_a_namespace(pki):
    """Without --tenant, a store's namespaces were its ranks' first claimers' but
    the router it embeds checked bindings only: over mutual TLS tenant-a admitted
    a worker whose card named tenant-b's client namespace and final namespace,
    and its Routes told which of b's prefixes the store held (remote_blocks 8 for
    b's hashes, 0 for others; tenant review, MEDIUM). Now the embedded router's
    admissions check and claim client namespaces with the store's ranks: a card
    in b's namespace is PERMISSION_DENIED (naming no tenant), and a namespace a
    worker claimed first is refused to another's ranks."""
    s = tls_store_thread(pki, ServedRouter(Router(RouterConfig())))
    store = callers(pki, s.address)
    routers = {
        cn: RouterClient(s.address, tls=pki.issue(cn)) for cn in ("tenant-a", "tenant-b", ADMIN)
    }
    victim = Rank(store.b, "b0", "b-ns")
    try:
        final = victim.session.wait_sealed(10).final_namespace
        victim.session.save([(100 + i, i % 8) for i in range(8)])
        spy = card(namespace="b-ns", final_namespace=final, display_name="spy-model")
        err = refused(routers["tenant-a"].register_worker, "spy", spy)
        assert err.code is Code.PERMISSION_DENIED, err
        assert "card.namespace 'b-ns'" in err.message and "tenant-b" not in err.message
        assert routers[ADMIN].stats().workers == 0
        routers["tenant-b"].register_worker("w-b", card(namespace="b-ns", final_namespace=final))
        routers["tenant-a"].register_worker("w-a", card(namespace="c-ns"))  # a's claim, first
        err = refused(Rank, store.b, "b1", "c-ns")
        assert err.code is Code.PERMISSION_DENIED and "tenant-a" not in err.message
        Rank(store.a, "a0", "c-ns").close()  # its own claim
        err = refused(routers["tenant-a"].register_worker, "w-b", card(namespace="d-ns"))
        assert err.code is Code.PERMISSION_DENIED  # the worker name is b's
        Rank(store.b, "b2", "d-ns").close()  # and a's refused admission claimed nothing
        routers[ADMIN].register_worker("w-ops", card(namespace="b-ns", final_namespace=final))
        assert routers[ADMIN].stats().workers == 3
    finally:
        victim.close()
        for client in (*store, *routers.values()):
            client.close()
        s.stop()
