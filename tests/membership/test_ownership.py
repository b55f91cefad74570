"""Issue 12 on etcd: ownership is recorded in etcd and enforced by every replica.

Two router replicas behind mutual TLS share one real etcd. A worker name belongs
to the certificate CN that admitted it, a store node id (per generation) to the
first CN that publishes as it; a stranger is PERMISSION_DENIED whichever replica
the call lands on, an admin may act on anything, and a refusal changes nothing
in etcd or in either replica.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvstore.client.router_client import RouterClient
from kvstore.membership.etcd import Etcd
from kvstore.membership.layout import (
    Layout,
    MemberRecord,
    NameClaim,
    SetCard,
    SetId,
    StoreRecord,
)
from kvstore.service.tls import Security
from kvstore.testing.pki import Pki
from kvstore.wire.errors import Code, KVError
from kvstore.wire.events import StoreEvent
from kvstore.wire.principal import NodeBinding, TenantBinding
from tests.membership.conftest import RouterThread, etcd_keys, etcd_read
from tests.router.conftest import card
from tests.security.conftest import ADMIN

NS = "llama.0123456789abcdef"
STORE_LEASE_S = 60  # the test holds the store's key itself; it outlives the test


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def replicas(etcd_config, pki):
    security = Security(pki.server, admins=(ADMIN,))
    pair = [RouterThread(etcd_config, security=security) for _ in range(2)]
    yield pair
    for r in pair:
        r.stop()


@pytest.fixture
def clients(pki, replicas):
    """``clients[cn][i]``: a RouterClient of identity ``cn`` to replica ``i``."""
    made: dict[str, list[RouterClient]] = {}
    for cn in ("tenant-a", "tenant-b", ADMIN, "node-a", "rogue"):
        tls = pki.issue(cn)
        made[cn] = [RouterClient(r.address, tls=tls) for r in replicas]
    yield made
    for pair in made.values():
        for c in pair:
            c.close()


def refused(fn, *args) -> KVError:
    with pytest.raises(KVError) as info:
        fn(*args)
    return info.value


def wait_until(fn, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not fn():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def generations(replica) -> dict[str, int]:
    return replica.call(replica.router.worker_generations)


def worker_keys(config, name: str) -> tuple[NameClaim, MemberRecord, int]:
    keys = etcd_keys(config)
    claim = NameClaim.decode(keys[f"workers/{name}"].value)
    member = next(e for k, e in keys.items() if k.endswith(f"/members/{name}"))
    return claim, MemberRecord.decode(member.value), member.mod_revision


def test_a_worker_name_belongs_to_its_admitter_on_every_replica(etcd_config, replicas, clients):
    """Before: on etcd a worker name was tied to no identity; registering it again
    through any replica replaced its address. Now the claim names its owner."""
    a, b = clients["tenant-a"], clients["tenant-b"]
    gen = a[0].register_worker("w0", card(address="10.0.0.1:8000")).generation
    claim, member, revision = worker_keys(etcd_config, "w0")
    assert (claim.owner, member.owner, revision) == ("tenant-a", "tenant-a", gen)
    wait_until(lambda: all(generations(r) == {"w0": gen} for r in replicas))
    for i in (0, 1):  # a hijack through either replica
        err = refused(b[i].register_worker, "w0", card(address="10.6.6.6:8000"))
        assert err.code is Code.PERMISSION_DENIED and "tenant-a" not in err.message
    assert worker_keys(etcd_config, "w0")[2] == gen  # nothing written
    for i in (0, 1):
        routed = a[i].route("llama-8b", token_ids=list(range(64)))
        assert (routed.address, routed.generation) == ("10.0.0.1:8000", gen)
    # the owner may register it again through the other replica (a restart)
    again = a[1].register_worker("w0", card(address="10.0.0.1:8001")).generation
    assert again > gen and worker_keys(etcd_config, "w0")[0].owner == "tenant-a"


def test_remove_worker_is_the_owners_or_an_admins_whichever_replica(etcd_config, replicas, clients):
    """Before: on etcd RemoveWorker was admin-only, since etcd did not say who
    admitted a worker. Now its owner may, through any replica; a stranger may not."""
    a, b, admin = clients["tenant-a"], clients["tenant-b"], clients[ADMIN]
    g0 = a[0].register_worker("w0", card()).generation
    g1 = a[0].register_worker("w1", card()).generation
    wait_until(lambda: generations(replicas[1]) == {"w0": g0, "w1": g1})
    for i in (0, 1):
        assert refused(b[i].remove_worker, "w0").code is Code.PERMISSION_DENIED
    assert "workers/w0" in etcd_keys(etcd_config)
    assert a[1].remove_worker("w0") is True  # not the replica that admitted it
    assert admin[1].remove_worker("w1", g1) is True
    assert not any(k.startswith("workers/") for k in etcd_keys(etcd_config))
    wait_until(lambda: all(generations(r) == {} for r in replicas))


def set_owner(config) -> str:
    (entry,) = [e for k, e in etcd_keys(config).items() if k.endswith("/card")]
    return SetCard.decode(entry.value).owner


def test_a_worker_set_is_its_first_members_owners_on_every_replica(etcd_config, replicas, clients):
    """Before: on etcd tenant-b registered a copy of tenant-a's card under a
    name of its own, through any replica, joined tenant-a's WorkerSet and took
    a share of tenant-a's routes. Now the set's card in etcd names its owner:
    another non-admin is PERMISSION_DENIED before anything is written, and its
    routes do not see the set; an admin may join; an emptied set is anyone's."""
    a, b, admin = clients["tenant-a"], clients["tenant-b"], clients[ADMIN]
    gen = a[0].register_worker("a0", card()).generation
    assert set_owner(etcd_config) == "tenant-a"
    wait_until(lambda: all(generations(r) == {"a0": gen} for r in replicas))
    for i in (0, 1):
        err = refused(b[i].register_worker, "b0", card())
        assert err.code is Code.PERMISSION_DENIED and "WorkerSet llama-8b" in err.message
        with pytest.raises(KVError) as info:
            b[i].route("llama-8b", token_ids=list(range(64)))
        assert info.value.code is Code.NOT_FOUND
    assert "workers/b0" not in etcd_keys(etcd_config)
    ops = admin[1].register_worker("ops0", card()).generation
    assert set_owner(etcd_config) == "tenant-a"
    wait_until(lambda: all(generations(r) == {"a0": gen, "ops0": ops} for r in replicas))
    assert a[1].remove_worker("a0") is True and admin[0].remove_worker("ops0") is True
    b[1].register_worker("b0", card())
    assert set_owner(etcd_config) == "tenant-b"


def test_a_replica_that_lists_a_set_takes_its_owner_from_etcd(etcd_config, pki, clients):
    """A replica started later lists the set's members in key order. Before, its
    core's set belonged to whichever member it applied first: here an admin's
    "alpha", which joined tenant-a's set, so tenant-a's routes through that
    replica were NOT_FOUND. Now the set's owner is its card's in etcd."""
    a, admin = clients["tenant-a"], clients[ADMIN]
    a[0].register_worker("zeta", card())
    admin[0].register_worker("alpha", card())
    late = RouterThread(etcd_config, security=Security(pki.server, admins=(ADMIN,)))
    mine = RouterClient(late.address, tls=pki.issue("tenant-a"))
    try:
        wait_until(lambda: set(generations(late)) == {"alpha", "zeta"})
        assert mine.route("llama-8b", token_ids=list(range(64))).worker in ("alpha", "zeta")
    finally:
        mine.close()
        late.stop()


def test_a_set_card_left_by_its_last_member_passes_to_the_next_first_member(etcd_config):
    """A set's card outlives its members when nobody dissolved it (the replica
    that emptied the set stopped first). The set is empty, so it is anyone's:
    the next first member writes the card anew with itself as owner (kept, the
    old owner would refuse every later member of the new one's as a stranger)."""
    from kvstore.membership.worksets import Admitted, WorkerSets
    from kvstore.wire.card import card_checksum
    from kvstore.wire.principal import Principal

    a, b = Principal("tenant-a"), Principal("tenant-b")
    c = card()

    layout = Layout(etcd_config.prefix)

    async def owner(etcd) -> str:
        return SetCard.decode((await etcd.get(layout.card(SetId.of(c)))).value).owner

    async def go(etcd):
        sets = WorkerSets(etcd, layout)
        lease = await etcd.grant(60)
        assert isinstance(await sets.admit("a0", c, card_checksum(c), lease, a), Admitted)
        assert await sets.remove("a0", caller=a)  # the card stays: nobody dissolved it
        assert await owner(etcd) == "tenant-a"
        assert isinstance(await sets.admit("b0", c, card_checksum(c), lease, b), Admitted)
        assert await owner(etcd) == "tenant-b"
        assert isinstance(await sets.admit("b1", c, card_checksum(c), lease, b), Admitted)
        with pytest.raises(KVError) as info:
            await sets.admit("a1", c, card_checksum(c), lease, a)
        assert info.value.code is Code.PERMISSION_DENIED

    etcd_read(etcd_config, go)


def register_store(config, node_id: str) -> int:
    """What a store server does on --etcd: its key, created anew under its lease."""

    async def go(etcd: Etcd) -> int:
        lease = await etcd.grant(STORE_LEASE_S)
        record = StoreRecord("127.0.0.1:1", "127.0.0.1:2").encode()
        return await etcd.recreate(Layout(config.prefix).store(node_id), record, lease)

    return etcd_read(config, go)


def store_seen(config, node_id: str, *replicas) -> int:
    """register_store, and its generation once every one of ``replicas`` has it."""
    gen = register_store(config, node_id)
    wait_until(lambda: all(r.call(r.router.peer_generations) == {node_id: gen} for r in replicas))
    return gen


def store_owner(config, node_id: str) -> str | None:
    return StoreRecord.decode(etcd_keys(config)[f"stores/{node_id}"].value).owner


def test_a_store_node_id_belongs_to_its_first_publisher_on_every_replica(
    etcd_config, replicas, clients
):
    """Before: a node id belonged to whoever first published as it *on each
    replica*, so a rogue could take it on a replica the store had not reached yet.
    Now the first publisher is written into the store's etcd value."""
    node, rogue, admin = clients["node-a"], clients["rogue"], clients[ADMIN]
    gen = store_seen(etcd_config, "node-a", *replicas)
    assert store_owner(etcd_config, "node-a") is None
    stored = [StoreEvent("stored", NS, [1, 2], "node-a")]
    assert node[0].publish(stored, "node-a", gen).applied == 1
    assert store_owner(etcd_config, "node-a") == "node-a"
    poison = [StoreEvent("stored", NS, [1, 2, 3, 4], "node-a")]
    for i in (1, 0):  # replica 1 has not seen node-a publish: it still knows
        err = refused(rogue[i].publish, poison, "node-a", gen)
        assert err.code is Code.PERMISSION_DENIED and "node-a" in err.message
    for i in (0, 1):
        if i == 1:
            assert node[1].publish(stored, "node-a", gen).applied == 1
        assert [p.prefix_blocks for p in node[i].query_prefix(NS, [1, 2, 3, 4])] == [2]
    assert admin[1].publish([], "node-a", gen).applied == 0  # an admin may
    # the store registers again: a new generation starts unclaimed
    store_seen(etcd_config, "node-a", replicas[1])
    assert store_owner(etcd_config, "node-a") is None


def test_a_batch_refused_as_invalid_claims_no_node_id(etcd_config, replicas, clients):
    """The publisher used to be written into the store's etcd value before its
    batch was decoded: a batch refused as INVALID_ARGUMENT had taken the node id."""
    from kvstore.wire import limits

    gen = store_seen(etcd_config, "node-a", *replicas)
    too_many = [StoreEvent("stored", NS, [1], "node-a")] * (limits.MAX_EVENTS_PER_PUBLISH + 1)
    err = refused(clients["rogue"][0].publish, too_many, "node-a", gen)
    assert err.code is Code.INVALID_ARGUMENT and "events" in err.message
    assert store_owner(etcd_config, "node-a") is None
    stored = [StoreEvent("stored", NS, [1, 2], "node-a")]
    assert clients["node-a"][1].publish(stored, "node-a", gen).applied == 1


def test_two_publishers_racing_through_two_replicas_have_one_winner(etcd_config, replicas, clients):
    gen = store_seen(etcd_config, "node-a", *replicas)
    outcomes: dict[str, str] = {}

    def publish(cn: str, i: int) -> None:
        try:
            clients[cn][i].publish([], "node-a", gen)
            outcomes[cn] = "ok"
        except KVError as exc:
            outcomes[cn] = exc.code.name

    threads = [
        threading.Thread(target=publish, args=("node-a", 0)),
        threading.Thread(target=publish, args=("rogue", 1)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    winner = store_owner(etcd_config, "node-a")
    loser = "rogue" if winner == "node-a" else "node-a"
    assert outcomes == {winner: "ok", loser: "PERMISSION_DENIED"}


def test_a_card_naming_a_foreign_event_endpoint_is_refused_before_etcd(
    etcd_config, replicas, clients
):
    err = refused(
        clients["tenant-a"][1].register_worker,
        "w0",
        card(kv_events_endpoint="tcp://10.0.0.9:5557"),
    )
    assert err.code is Code.PERMISSION_DENIED and "card.kv_events_endpoint" in err.message
    assert not any(k.startswith(("workers/", "worksets/")) for k in etcd_keys(etcd_config))


def test_workers_per_certificate_are_capped_on_etcd_too(
    etcd_config, replicas, clients, monkeypatch
):
    """Before: a replica on etcd admitted any number of workers for one
    certificate (each costs every replica an event feed). Now a new name past
    MAX_WORKERS_PER_PRINCIPAL, as the replica has seen etcd, is
    RESOURCE_EXHAUSTED and never reaches etcd; the owner may still register
    its own names again, and others are not held back."""
    from kvstore.wire import limits

    monkeypatch.setattr(limits, "MAX_WORKERS_PER_PRINCIPAL", 2)  # the replicas run here
    a, b = clients["tenant-a"], clients["tenant-b"]
    a[0].register_worker("a0", card())
    a[1].register_worker("a1", card())
    wait_until(lambda: all(set(generations(r)) == {"a0", "a1"} for r in replicas))
    for i in (0, 1):
        err = refused(a[i].register_worker, "a2", card())
        assert err.code is Code.RESOURCE_EXHAUSTED and "workers admitted" in err.message
    assert "workers/a2" not in etcd_keys(etcd_config)
    assert a[1].register_worker("a0", card(address="10.0.0.1:8001")).generation  # its own
    assert b[0].register_worker("b0", card(worker_type="prefill")).generation  # b's own set
    assert clients[ADMIN][1].register_worker("c0", card()).generation  # an admin: no cap


def test_a_namespace_bound_to_a_tenant_is_refused_to_others_before_etcd(etcd_config, pki):
    """With --tenant tenant-a=a-ns a replica refuses another certificate's card
    naming a-ns (and tenant-a's naming another namespace) with
    PERMISSION_DENIED before anything reaches etcd, though nobody claimed it."""
    bound = (TenantBinding("tenant-a", "a-ns"),)
    security = Security(pki.server, admins=(ADMIN,), tenants=bound)
    replica = RouterThread(etcd_config, security=security)
    a, b, admin = (
        RouterClient(replica.address, tls=pki.issue(cn)) for cn in ("tenant-a", "tenant-b", ADMIN)
    )
    try:
        err = refused(b.register_worker, "squat", card(namespace="a-ns"))
        assert err.code is Code.PERMISSION_DENIED and "card.namespace 'a-ns'" in err.message
        err = refused(a.register_worker, "elsewhere", card(namespace="b-ns"))
        assert err.code is Code.PERMISSION_DENIED and "(--tenant)" in err.message
        assert not any(k.startswith(("workers/", "worksets/")) for k in etcd_keys(etcd_config))
        # an admin's first member makes the set the bound tenant's, not the admin's
        assert admin.register_worker("ops0", card(namespace="a-ns")).generation
        assert set_owner(etcd_config) == "tenant-a"
        assert a.register_worker("w-a", card(namespace="a-ns")).generation
        assert b.register_worker("w-b", card(namespace="b-ns")).generation
    finally:
        for client in (a, b, admin):
            client.close()
        replica.stop()


def test_a_replica_told_its_store_cns_lets_no_other_certificate_claim_a_node(etcd_config, pki):
    """With --store-cn, a certificate not named there cannot claim a store node
    registered in etcd by publishing first (it would own the node id), nor ask
    QueryPrefix; the store's own CN then claims it."""
    security = Security(pki.server, admins=(ADMIN,), stores=("node-a",))
    replica = RouterThread(etcd_config, security=security)
    rogue = RouterClient(replica.address, tls=pki.issue("rogue"))
    node = RouterClient(replica.address, tls=pki.issue("node-a"))
    try:
        gen = store_seen(etcd_config, "node-a", replica)
        stored = [StoreEvent("stored", NS, [1, 2], "node-a")]
        err = refused(rogue.publish, stored, "node-a", gen)
        assert err.code is Code.PERMISSION_DENIED and "--store-cn" in err.message
        assert store_owner(etcd_config, "node-a") is None  # nothing claimed
        assert refused(rogue.query_prefix, NS, [1]).code is Code.PERMISSION_DENIED
        assert node.publish(stored, "node-a", gen).applied == 1
        assert store_owner(etcd_config, "node-a") == "node-a"
        assert [p.prefix_blocks for p in node.query_prefix(NS, [1, 2])] == [2]
    finally:
        rogue.close()
        node.close()
        replica.stop()


def test_a_store_cn_bound_to_its_node_claims_no_other_node_in_etcd(etcd_config, pki):
    """--store-node CN=NODE_ID on etcd: a bound store certificate publishing first
    as another node (registered in etcd, its own store not yet publishing) would
    have claimed it in etcd, and the real store been refused on every replica.
    The binding is checked before the claim: nothing is claimed, and the node's
    own certificate claims it."""
    bound = (NodeBinding("store-a", "node-a"), NodeBinding("store-b", "node-b"))
    security = Security(pki.server, (ADMIN,), ("store-a", "store-b"), bound)
    replica = RouterThread(etcd_config, security=security)
    store_a = RouterClient(replica.address, tls=pki.issue("store-a"))
    store_b = RouterClient(replica.address, tls=pki.issue("store-b"))
    try:
        gen = store_seen(etcd_config, "node-b", replica)
        stored = [StoreEvent("stored", NS, [1, 2], "node-b")]
        err = refused(store_a.publish, stored, "node-b", gen)
        assert err.code is Code.PERMISSION_DENIED and "bound to another certificate" in err.message
        assert "store-b" not in err.message  # a refusal names no other identity
        assert store_owner(etcd_config, "node-b") is None  # nothing claimed
        assert store_b.publish(stored, "node-b", gen).applied == 1
        assert store_owner(etcd_config, "node-b") == "store-b"
    finally:
        store_a.close()
        store_b.close()
        replica.stop()
