"""Issue 12, the store over mutual TLS: an instance and a client namespace belong
to the certificate CN that registered them first; Clear, Query and Events are
scoped to a caller's own namespaces; every attack is refused with its status."""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

import grpc
import pytest
import torch

from kvstore._proto import store_pb2 as pb
from kvstore._proto import store_pb2_grpc as pb_grpc
from kvstore.client.router_client import RouterClient
from kvstore.client.store_client import KVLayer, StoreClient, kv_cache_shm
from kvstore.client.tls import open_channel
from kvstore.wire import limits
from kvstore.wire.errors import Code, KVError
from kvstore.wire.events import StoreEvent
from tests.conftest import ServerThread, wait_for
from tests.security.conftest import ADMIN


class Rank:
    """One single-rank instance in host shared memory, registered over TLS."""

    def __init__(self, client: StoreClient, instance: str, namespace: str, **kw):
        self.shms = [kv_cache_shm("kv_first", 8, 4, 2, 16, torch.float16) for _ in range(2)]
        layers = [KVLayer(f"l{i}", s.tensor, "kv_first", "NHD", s) for i, s in enumerate(self.shms)]
        try:
            self.session = client.register(instance, namespace, layers, block_size=4, **kw)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if hasattr(self, "session"):
            self.session.close()
        for shm in self.shms:
            shm.close()


class Callers(NamedTuple):
    a: StoreClient  # tenant-a
    b: StoreClient  # tenant-b
    admin: StoreClient


def callers(pki, address: str) -> Callers:
    return Callers(
        *(StoreClient(address, tls=pki.issue(cn)) for cn in ("tenant-a", "tenant-b", ADMIN))
    )


def refused(fn, *args, **kwargs) -> KVError:
    with pytest.raises(KVError) as info:
        fn(*args, **kwargs)
    return info.value


def watch(address: str, tls, out: list) -> grpc.Future:
    stub = pb_grpc.KVStoreStub(open_channel(address, tls))
    call = stub.Events(pb.EventsRequest())

    def reader():
        try:
            for ev in call:
                out.append(StoreEvent.decode(ev.payload))
        except grpc.RpcError:
            pass

    threading.Thread(target=reader, daemon=True).start()
    return call


def test_stranger_cannot_register_into_read_or_clear_another_tenants_namespace(pki, tls_store):
    """Before: a stranger registering the same client namespace and layout loaded
    8 of 8 of another tenant's blocks and deleted them with Clear. Now each step
    is PERMISSION_DENIED and the blocks stay."""
    a, b, admin = callers(pki, tls_store.address)
    victim = Rank(a, "victim", "llama")
    try:
        ns = victim.session.wait_sealed(10).final_namespace
        assert victim.session.save([(100 + i, i) for i in range(8)]).written == 8
        err = refused(Rank, b, "thief", "llama")  # same client namespace, same layout
        assert err.code is Code.PERMISSION_DENIED and "llama" in err.message
        assert refused(b.query, ns, [100]).code is Code.PERMISSION_DENIED
        assert refused(b.instance, "victim").code is Code.PERMISSION_DENIED  # its namespace
        assert a.instance("victim").final_namespace == ns
        assert refused(b.clear, ns).code is Code.PERMISSION_DENIED
        assert refused(b.clear).code is Code.PERMISSION_DENIED  # every namespace: admin only
        assert refused(a.clear).code is Code.PERMISSION_DENIED  # not even an owner
        assert a.query(ns, [100 + i for i in range(8)]).prefix_blocks == 8
        assert a.clear(ns) == 8  # the owner may clear its own
        victim.session.save([(200, 0)])
        assert admin.clear() == 1  # the admin may clear all
    finally:
        victim.close()


def test_other_ranks_of_an_instance_come_from_its_owner(pki, tls_store):
    a = StoreClient(tls_store.address, tls=pki.issue("tenant-a"))
    b = StoreClient(tls_store.address, tls=pki.issue("tenant-b"))
    rank0 = Rank(a, "shared", "llama", tp_rank=0, tp_size=2)
    try:
        err = refused(Rank, b, "shared", "mistral", tp_rank=1, tp_size=2)
        assert err.code is Code.PERMISSION_DENIED and "shared" in err.message
        rank1 = Rank(a, "shared", "llama", tp_rank=1, tp_size=2)
        assert rank1.session.wait_sealed(10).final_namespace.startswith("llama.")
        rank1.close()
    finally:
        rank0.close()


def test_events_of_another_tenants_namespace_are_not_delivered(pki, tls_store):
    """Before: Events showed every client every namespace and block hash."""
    tls_a, tls_b = pki.issue("tenant-a"), pki.issue("tenant-b")
    seen_b: list[StoreEvent] = []
    seen_admin: list[StoreEvent] = []
    sub_b = watch(tls_store.address, tls_b, seen_b)
    sub_admin = watch(tls_store.address, pki.issue(ADMIN), seen_admin)
    ra = Rank(StoreClient(tls_store.address, tls=tls_a), "ia", "llama")
    rb = Rank(StoreClient(tls_store.address, tls=tls_b), "ib", "mistral")
    try:
        ns_b = rb.session.wait_sealed(10).final_namespace
        ra.session.wait_sealed(10)
        time.sleep(0.2)  # both subscriptions are open before the first event
        ra.session.save([(1, 0), (2, 1)])
        rb.session.save([(3, 0)])
        assert wait_for(lambda: len({e.namespace for e in seen_admin}) == 2)
        assert wait_for(lambda: seen_b)
        time.sleep(0.3)  # anything of tenant-a's that were to reach b has arrived
        assert {e.namespace for e in seen_b} == {ns_b}
        assert sorted(h for e in seen_b for h in e.block_hashes) == [3]
    finally:
        sub_b.cancel()
        sub_admin.cancel()
        ra.close()
        rb.close()


def test_client_without_a_certificate_is_refused(tls_store):
    with pytest.raises(KVError) as info:
        StoreClient(tls_store.address, timeout=5).stats()
    assert info.value.code is Code.UNAVAILABLE


def test_store_advertises_to_a_tls_router_under_its_own_identity(pki, tls_router):
    """A store server's router link presents its certificate; its node id is then
    its own and another identity cannot publish as it."""
    store = ServerThread(
        pool_size=16 << 20,
        device="cpu",
        slab_bytes=4 << 20,
        transfer=False,
        tls=pki.issue("store-1"),
        router_address=tls_router.address,
        node_id="store-1",
    )
    try:
        assert wait_for(lambda: "store-1" in tls_router.router.peer_generations())
        gen = tls_router.router.peer_generations()["store-1"]
        rogue = RouterClient(tls_router.address, tls=pki.issue("store-2"))
        err = refused(
            rogue.publish,
            [StoreEvent("cleared", "x.0123456789abcdef", [], "store-1")],
            "store-1",
            gen,
        )
        assert err.code is Code.PERMISSION_DENIED
    finally:
        store.stop()


def test_plaintext_loopback_keeps_todays_trust(server):
    """Without TLS every caller is the anonymous local identity: as before, any
    caller may register anywhere and clear everything (documented in the README)."""
    one, two = StoreClient(server.address), StoreClient(server.address)
    r1 = Rank(one, "i1", "llama")
    r2 = Rank(two, "i2", "llama")
    try:
        ns = r1.session.wait_sealed(10).final_namespace
        r1.session.save([(5, 0)])
        assert two.query(ns, [5]).prefix_blocks == 1
        assert two.clear() == 1
    finally:
        r1.close()
        r2.close()


def test_query_leases_are_their_takers_and_capped(pki, tls_store, monkeypatch):
    """Before: any certificate could release another tenant's lease by its id, and
    one could hold leases without bound (each pins up to 8,192 blocks for up to
    10 minutes). Now a lease is released by its taker or an admin only, and a
    non-admin holds at most MAX_LEASES_PER_PRINCIPAL: RESOURCE_EXHAUSTED past it,
    with nothing pinned."""
    monkeypatch.setattr(limits, "MAX_LEASES_PER_PRINCIPAL", 2)  # the server runs in this process
    a, b, admin = callers(pki, tls_store.address)
    owner = Rank(a, "leased", "llama")
    try:
        ns = owner.session.wait_sealed(10).final_namespace
        owner.session.save([(100 + i, i) for i in range(4)])
        first = a.query(ns, [100, 101], lease=True)
        second = a.query(ns, [102], lease=True)
        assert first.lease_id and second.lease_id
        hits = admin.stats().hits
        err = refused(a.query, ns, [103], lease=True)
        assert err.code is Code.RESOURCE_EXHAUSTED and "query leases" in err.message
        assert (admin.stats().leases, admin.stats().hits) == (2, hits)  # it changed nothing
        assert a.query(ns, [103]).prefix_blocks == 1  # a plain query needs no lease
        assert admin.query(ns, [103], lease=True).lease_id  # an admin is not capped
        err = refused(b.release, first.lease_id)
        assert err.code is Code.PERMISSION_DENIED and "tenant-a" not in err.message
        assert a.release(first.lease_id) == 2
        assert a.query(ns, [103], lease=True).lease_id  # room again
        assert admin.release(second.lease_id) == 1  # an admin may release any
    finally:
        owner.close()


def test_event_streams_per_certificate_are_capped(pki, tls_store, monkeypatch):
    """Each Events stream may queue 65,536 events; a non-admin may hold
    MAX_EVENT_STREAMS_PER_PRINCIPAL of them, RESOURCE_EXHAUSTED past that."""
    monkeypatch.setattr(limits, "MAX_EVENT_STREAMS_PER_PRINCIPAL", 2)
    tls_a = pki.issue("tenant-a")
    admin = StoreClient(tls_store.address, tls=pki.issue(ADMIN))
    seen: list[list] = [[], [], [], []]
    calls = [watch(tls_store.address, tls_a, seen[i]) for i in range(2)]
    try:
        assert wait_for(lambda: admin.stats().event_subscribers == 2)
        third = pb_grpc.KVStoreStub(open_channel(tls_store.address, tls_a)).Events(
            pb.EventsRequest()
        )
        with pytest.raises(grpc.RpcError) as info:
            next(third)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "event streams" in info.value.details()
        calls.append(watch(tls_store.address, pki.issue("tenant-b"), seen[2]))  # another's own
        calls.append(watch(tls_store.address, pki.issue(ADMIN), seen[3]))  # an admin's
        assert wait_for(lambda: admin.stats().event_subscribers == 4)
        calls.pop(0).cancel()
        assert wait_for(lambda: admin.stats().event_subscribers == 3)
        calls.append(watch(tls_store.address, tls_a, seen[0]))  # room again
        assert wait_for(lambda: admin.stats().event_subscribers == 4)
    finally:
        for call in calls:
            call.cancel()


def test_a_wait_on_another_tenants_instance_is_refused_at_once(pki, tls_store):
    """tenant-b's GetInstance waiting on tenant-a's unsealed instance was answered
    PERMISSION_DENIED only when a's instance sealed (or the wait ran out): it told
    b the moment a's engine came up. Now it is refused before any wait."""
    a = StoreClient(tls_store.address, tls=pki.issue("tenant-a"))
    rank0 = Rank(a, "half", "llama", tp_rank=0, tp_size=2)  # rank 1 never comes: no seal
    try:
        stub = pb_grpc.KVStoreStub(open_channel(tls_store.address, pki.issue("tenant-b")))
        with pytest.raises(grpc.RpcError) as info:
            stub.GetInstance(pb.GetInstanceRequest(instance_id="half", wait_ms=60_000), timeout=20)
        assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED, info.value
    finally:
        rank0.close()


def test_memory_another_tenant_registered_is_refused_without_naming_it(pki, tls_store):
    """The refusal named the registration holding the memory (its instance id and
    rank): another tenant's. Now it says another caller; an owner still sees it named."""
    a, b, _ = callers(pki, tls_store.address)
    victim = Rank(a, "victim-instance", "llama")
    try:
        layers = [
            KVLayer(f"l{i}", s.tensor, "kv_first", "NHD", s) for i, s in enumerate(victim.shms)
        ]
        err = refused(b.register, "thief", "mistral", layers, block_size=4)
        assert err.code is Code.ALREADY_EXISTS and "another caller" in err.message, err
        assert "victim-instance" not in err.message
        err = refused(a.register, "again", "llama", layers, block_size=4)
        assert err.code is Code.ALREADY_EXISTS and "victim-instance" in err.message, err
    finally:
        victim.close()
