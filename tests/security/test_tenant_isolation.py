"""Tenant against tenant on one shared store and router over mutual TLS
(tenant review): what one tenant's certificate may take of a shared pool,
and what a refusal tells it of another tenant."""

from __future__ import annotations

import pytest

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
