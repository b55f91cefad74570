"""Tenant against tenant on one shared store and router over mutual TLS
(tenant review): what one tenant's certificate may take of a shared pool,
and what a refusal tells it of another tenant."""

from __future__ import annotations

import pytest

from kvstore.client import StoreClient
from kvstore.wire.errors import Code
from tests.conftest import ServerThread
from tests.security.conftest import ADMIN
from tests.security.test_store_auth import Rank, callers, refused

POOL_BYTES = 1 << 20  # 1,024 blocks of Rank's 1 KiB (two layers of 512 B)


@pytest.fixture
def small_store(pki):
    s = ServerThread(
        pool_size=POOL_BYTES,
        device="cpu",
        slab_bytes=256 << 10,
        transfer=False,
        tls=pki.server,
        admins=(ADMIN,),
    )
    yield s
    s.stop()


def test_one_tenants_query_leases_cannot_pin_the_whole_pool(pki, small_store):
    """Before: query leases were capped by count (16,384 a certificate, each up
    to 8,192 blocks for up to 10 minutes), not by what they pin: tenant-a saved
    1,024 blocks, filling the pool, leased them all, and every Save of tenant-b
    was RESOURCE_EXHAUSTED ('pool ... cannot hold') for as long as a cared to
    renew. Now one certificate's leases pin at most half the store's pool: the
    lease past it is RESOURCE_EXHAUSTED naming the lease and pins nothing, and
    tenant-b's saves find room (evicting a's unleased blocks). Blocks two of a
    certificate's leases hold count once: a prompt every request shares and
    leases is not a reason to refuse the next request's lease."""
    a, b, admin = callers(pki, small_store.address)
    hog, victim = Rank(a, "hog", "a-ns"), Rank(b, "victim", "b-ns")
    try:
        ns = hog.session.wait_sealed(10).final_namespace
        victim.session.wait_sealed(10)
        hashes = list(range(1000, 2024))
        assert hog.session.save([(h, h % 8) for h in hashes]).written == 1024
        half = a.query(ns, hashes[:512], lease=True)
        assert half.prefix_blocks == 512 and half.lease_id
        before = admin.stats()
        err = refused(a.query, ns, hashes[512:], lease=True)
        assert err.code is Code.RESOURCE_EXHAUSTED
        assert "lease" in err.message and "pool" in err.message
        after = admin.stats()
        assert (after.leases, after.hits) == (before.leases, before.hits)  # it changed nothing
        assert victim.session.save([(7000 + i, i) for i in range(8)]).written == 8
        assert a.query(ns, hashes[:512]).prefix_blocks == 512  # the leased half stayed
        assert refused(a.query, ns, hashes[-1:], lease=True).code is Code.RESOURCE_EXHAUSTED
        again = a.query(ns, hashes[:512], lease=True)  # the leased half: each block counts once
        assert again.lease_id and a.release(again.lease_id) == 512  # (a shared prompt a request)
        ops = admin.query(ns, hashes[:512], lease=True)  # an admin is not capped
        assert ops.lease_id and admin.release(ops.lease_id) == 512
        assert a.release(half.lease_id) == 512
        assert a.query(ns, hashes[:1], lease=True).lease_id  # released: room again
    finally:
        hog.close()
        victim.close()
        for client in (a, b, admin):
            client.close()


def test_one_tenants_saves_evict_its_own_blocks_not_another_tenants_within_its_share(
    pki, small_store
):
    """Before: one LRU for the whole pool: tenant-b saved 8 blocks, tenant-a saved
    1,024 (the pool's worth) and b's query found a prefix of 0. Now a save that
    must evict takes from tenants over their fair share first (the pool over the
    tenants holding blocks): a's one Save of the whole pool is RESOURCE_EXHAUSTED
    (it would put a over its half only at b's expense) and evicts nothing; a
    saving the pool twice over in 64-block Saves evicts its own oldest blocks;
    b, within its share, keeps its 8 and its next Save evicts a's."""
    a, b, admin = callers(pki, small_store.address)
    hog, victim = Rank(a, "hog", "a-ns"), Rank(b, "victim", "b-ns")
    try:
        a_ns = hog.session.wait_sealed(10).final_namespace
        b_ns = victim.session.wait_sealed(10).final_namespace
        mine = [7000 + i for i in range(8)]
        assert victim.session.save([(h, i) for i, h in enumerate(mine)]).written == 8
        err = refused(hog.session.save, [(h, h % 8) for h in range(1000, 2024)])
        assert err.code is Code.RESOURCE_EXHAUSTED and "fair share" in err.message
        assert "tenant-b" not in err.message
        assert b.query(b_ns, mine).prefix_blocks == 8 and admin.stats().evictions == 0
        hashes = list(range(10_000, 12_048))
        for start in range(0, len(hashes), 64):
            batch = hashes[start : start + 64]
            assert hog.session.save([(h, h % 8) for h in batch]).written == 64
        assert b.query(b_ns, mine).prefix_blocks == 8
        assert a.query(a_ns, hashes[-1016:]).prefix_blocks == 1016  # the rest of the pool
        assert a.query(a_ns, hashes[:1]).prefix_blocks == 0
        more = [8000 + i for i in range(8)]
        assert victim.session.save([(h, i) for i, h in enumerate(more)]).written == 8
        assert b.query(b_ns, mine + more).prefix_blocks == 16
        assert a.query(a_ns, hashes[-1008:]).prefix_blocks == 1008
    finally:
        hog.close()
        victim.close()
        for client in (a, b, admin):
            client.close()


def test_one_tenants_leases_pin_at_most_a_fair_share_when_that_is_less_than_half(pki, small_store):
    """Found by the final read: each certificate could pin half the pool, so two
    tenants leasing between them pinned all of it and a third's saves found no
    room. With three tenants holding blocks, a's leases pin at most a third."""
    a, b, admin = callers(pki, small_store.address)
    c = StoreClient(small_store.address, tls=pki.issue("tenant-c"))
    ranks = [Rank(a, "a0", "a-ns"), Rank(b, "b0", "b-ns"), Rank(c, "c0", "c-ns")]
    try:
        ns = ranks[0].session.wait_sealed(10).final_namespace
        for rank in ranks[1:]:
            rank.session.wait_sealed(10)
        hashes = list(range(1000, 1400))  # 400 KiB: under half the pool, over a third
        assert ranks[0].session.save([(h, h % 8) for h in hashes]).written == 400
        for i, rank in enumerate(ranks[1:]):
            assert rank.session.save([(5000 + 10 * i + j, j) for j in range(8)]).written == 8
        err = refused(a.query, ns, hashes, lease=True)
        assert err.code is Code.RESOURCE_EXHAUSTED and "fair share" in err.message
        assert a.query(ns, hashes[:300], lease=True).lease_id  # 300 KiB: within a third
    finally:
        for rank in ranks:
            rank.close()
        for client in (a, b, c, admin):
            client.close()
