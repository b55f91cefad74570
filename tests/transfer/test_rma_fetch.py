"""One-sided fetches (docs/design.md §4, "One-sided reads"): real processes, real
UCX for the control frames, real NIXL agents reading host-memory pools.

The serving node registers its pool with NIXL and grants one-sided reads; the
fetching node registers its sink's pool, asks the peer's card once per
connection (after the handshake when a secret is set), reads every granted
slot straight into its reservation, commits, and RELEASEs the lease.
"""

from __future__ import annotations

import os
import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import need_nixl
from tests.transfer.nodes import HASHES, blocks_of, wait_until

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(autouse=True)
def _nixl() -> None:
    need_nixl()


KIB = 1 << 10


def port(server) -> dict:
    return server.call("port_stats")


def test_one_sided_fetch_every_byte_several_slot_sizes(nodes):
    layout_a = [1, 512, 8191, 16 * KIB, 100_003, 1 << 20]
    layout_b = [64 * KIB] * 4
    blocks = {h: (layout_a if i % 2 else layout_b) for i, h in enumerate(HASHES[:8])}
    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks, rma=True, gap_every=3)
    out = client.call("fetch", address=address, hashes=HASHES[:8], repeat=2, rma=True)
    assert out["error"] is None, out
    assert out["n"] == [8, 8] and out["rma_reads"] == 2
    assert out["visible"] == sorted(HASHES[:8]) and out["corrupt"] == []
    assert out["states"] == ["committed", "committed"]
    assert server.call("leases")["segments"] == []  # no slot byte went two-sided
    # every lease RELEASEd (none expired): the pins are gone right after the read
    assert wait_until(lambda: server.call("leases")["active"] == 0)
    stats = port(server)
    assert stats["rma_leases"] == 2 and stats["rma_leases_expired"] == 0
    assert stats["pinned_blocks"] == 0


@pytest.mark.parametrize("serve_rma, fetch_rma", [(False, True), (True, False)])
def test_fallback_two_sided_when_one_side_has_rma_off(nodes, serve_rma, fetch_rma):
    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks_of(HASHES[:4], [32 * KIB] * 4), rma=serve_rma)
    out = client.call("fetch", address=address, hashes=HASHES[:4], rma=fetch_rma)
    assert out["error"] is None, out
    assert out["n"] == [4] and out["rma_reads"] == 0 and out["corrupt"] == []
    assert len(server.call("leases")["segments"]) >= 1  # the bytes went two-sided
    assert port(server)["rma_leases"] == 0


def test_lease_expires_when_the_fetcher_never_releases(nodes):
    """A fetcher that hangs after the grant: the pin lasts rma_lease_s, not forever."""
    server, client = nodes(), nodes()
    address = server.call(
        "serve", blocks=blocks_of(HASHES[:3], [4 * KIB] * 2), rma=True, limits={"rma_lease_s": 1.0}
    )
    client.submit("fetch", address=address, hashes=HASHES[:3], rma=True, on_reserve="hang")
    assert wait_until(lambda: port(server)["rma_leases"] == 1)
    assert server.call("leases")["active"] == 1  # pinned while the lease lasts
    assert wait_until(lambda: server.call("leases")["active"] == 0, timeout=10)
    stats = port(server)
    assert stats["rma_leases_expired"] == 1 and stats["pinned_blocks"] == 0


def test_no_read_once_the_lease_counted_from_the_request_ran_out(nodes):
    """The peer's lease starts when the REQUEST reaches it, so its end counts from
    the REQUEST, not from the read. A fetcher stalled past it (its loop blocked
    between offer and read) posts no read: the peer may have reused the slots."""
    server, client = nodes(), nodes()
    address = server.call(
        "serve", blocks=blocks_of(HASHES[:3], [4 * KIB] * 2), rma=True, limits={"rma_lease_s": 1.0}
    )
    out = client.call("fetch", address=address, hashes=HASHES[:3], rma=True, on_reserve="stall:0.9")
    assert out["error"] == "RmaFailed" and "lease" in out["message"], out
    assert out["rma_reads"] == 0 and out["visible"] == [] and out["states"] == ["aborted"]


def test_lease_released_when_the_fetcher_dies_before_release(nodes):
    """The connection's close does not end a granted lease (a read may still be
    landing); its expiry does."""
    server, client = nodes(), nodes()
    address = server.call(
        "serve", blocks=blocks_of(HASHES[:3], [4 * KIB] * 2), rma=True, limits={"rma_lease_s": 2.0}
    )
    client.submit("fetch", address=address, hashes=HASHES[:3], rma=True, on_reserve="die")
    assert wait_until(lambda: port(server)["rma_leases"] == 1)
    assert wait_until(lambda: server.call("leases")["active"] == 0, timeout=10)
    assert port(server)["rma_leases_expired"] == 1 and port(server)["pinned_blocks"] == 0


@pytest.mark.parametrize("fault", ["stop", "kill"])
def test_a_release_that_cannot_go_out_ends_with_the_lease_and_is_logged_once(nodes, fault):
    """The peer is stopped (SIGSTOP) or killed once the fetcher has committed its
    one-sided read, before the RELEASE goes out; with UCX_RNDV_THRESH=0 the
    RELEASE is a rendezvous send, which only a running peer completes. The
    fetch returns its committed blocks all the same. Before, the RELEASE had
    no deadline (it waited for ever on a stopped peer, its endpoint held) and
    its failure went unsaid; now it gives up by the lease's end, aborts its
    endpoint and says so once. The stopped peer, running again, has unpinned."""
    server, client = nodes(), nodes(UCX_RNDV_THRESH="0")
    address = server.call(
        "serve", blocks=blocks_of(HASHES[:3], [4 * KIB] * 2), rma=True, limits={"rma_lease_s": 2.0}
    )
    client.call("watch_logs")

    def unsent() -> list[str]:
        return [w for w in client.call("warnings") if w.startswith("RELEASE of one-sided lease")]

    try:
        hook = f"{fault}:{server.proc.pid}"
        out = client.call("fetch", address=address, hashes=HASHES[:3], rma=True, on_commit=hook)
        assert out["error"] is None and out["n"] == [3] and out["rma_reads"] == 1, out
        assert out["visible"] == sorted(HASHES[:3]) and out["corrupt"] == []
        assert wait_until(lambda: unsent() != [], timeout=10), client.call("warnings")
    finally:
        if fault == "stop":
            os.kill(server.proc.pid, signal.SIGCONT)
    assert len(unsent()) == 1 and address in unsent()[0], unsent()
    if fault == "stop":
        assert wait_until(lambda: server.call("leases")["active"] == 0)
        assert port(server)["pinned_blocks"] == 0
        again = client.call("fetch", address=address, hashes=HASHES[:3], rma=True)
        assert again["error"] is None and again["n"] == [3] and again["corrupt"] == [], again


def test_a_one_sided_read_cancelled_releases_its_lease_at_once(nodes):
    """The peer's NIXL agent never progresses (wedged): over tcp the read hangs,
    and the fetch is cancelled. Nothing commits, the reservation is aborted (or
    kept, had a request not let go), and the lease is RELEASEd: the peer unpins
    at once, and the endpoint stays open for the next fetch. Before, the
    cancelled fetch aborted its endpoint without a RELEASE and the peer kept
    the blocks pinned to the lease's end (30 s here)."""
    env = {"UCX_TLS": "tcp,self"}
    server, client = nodes(**env), nodes(**env)
    address = server.call(
        "serve",
        blocks=blocks_of(HASHES[:3], [4 * KIB] * 2),
        rma=True,
        behaviour="wedged_rma",
        limits={"rma_lease_s": 30.0},
    )
    out = client.call("fetch", address=address, hashes=HASHES[:3], rma=True, cancel_after=1.5)
    assert out["error"] in ("Cancelled", "RmaFailed"), out  # RmaFailed: a request not let go
    assert port(server)["rma_leases"] == 1 and out["rma_reads"] == 0
    assert out["visible"] == [] and out["states"] in (["aborted"], ["reserved"]), out
    assert wait_until(lambda: server.call("leases")["active"] == 0, timeout=10)
    stats = port(server)
    assert stats["rma_leases_expired"] == 0 and stats["pinned_blocks"] == 0
    assert stats["connections"] == 1  # the endpoint, its exchange over, kept for the next fetch


def test_a_cut_connection_does_not_unpin_a_read_still_landing(nodes):
    """Before: the peer unpinned a granted lease the moment its connection was cut
    (a worker recreation on either side cuts every connection). The fetcher's
    read goes over NIXL, not that connection, so it went on and committed slots
    a Save had meanwhile reused. Now the pin lasts until RELEASE or the lease's
    end, whatever happens to the connection."""
    server, client = nodes(), nodes()
    address = server.call(
        "serve",
        blocks=blocks_of(HASHES[:6], [4 * KIB] * 2),
        rma=True,
        behaviour="cut_after_grant",  # and a released lease's slots are overwritten at once
        limits={"rma_lease_s": 3.0},
    )
    # the first fetch connects NIXL; the second's read comes 0.5 s after its offer,
    # the connection cut by then
    out = client.call(
        "fetch",
        address=address,
        hashes=HASHES[:3],
        then=HASHES[3:6],
        rma=True,
        on_reserve="stall:0.5",
        repeat=2,
    )
    assert out["error"] is None and out["n"] == [3, 3] and out["rma_reads"] == 2, out
    assert out["corrupt"] == []
    assert server.call("leases")["active"] == 1  # pinned still: no RELEASE came
    assert wait_until(lambda: server.call("leases")["active"] == 0, timeout=10)
    assert port(server)["rma_leases_expired"] == 1 and port(server)["pinned_blocks"] == 0


def test_a_lease_kept_past_its_connection_ends_when_the_port_stops(nodes):
    """A port that stops takes its memory with it: a lease it kept past its
    connection's close (until its end, 30 s here) ends then, not later."""
    server, client = nodes(), nodes()
    address = server.call(
        "serve", blocks=blocks_of(HASHES[:3], [4 * KIB] * 2), rma=True, limits={"rma_lease_s": 30.0}
    )
    client.submit("fetch", address=address, hashes=HASHES[:3], rma=True, on_reserve="die")
    assert wait_until(lambda: port(server)["rma_leases"] == 1)
    assert wait_until(lambda: port(server)["connections"] == 0)  # the fetcher died
    assert server.call("leases")["active"] == 1  # kept: a read might still land
    assert server.call("stop_serving") == {"active": 0, "pinned_blocks": 0}


def test_peer_killed_before_the_read_aborts_and_another_peer_serves(nodes):
    blocks = blocks_of(HASHES[:4], [64 * KIB] * 4)
    doomed, other, client = nodes(), nodes(), nodes()
    a = doomed.call("serve", blocks=blocks, rma=True)
    b = other.call("serve", blocks=blocks, rma=True)
    out = client.call(
        "fetch",
        address=a,
        hashes=HASHES[:4],
        rma=True,
        timeout_s=3.0,
        on_reserve=f"kill:{doomed.proc.pid}",
    )
    assert out["error"] == "RmaFailed", out
    assert out["visible"] == [] and out["states"] in (["aborted"], ["reserved"])
    again = client.call("fetch", address=b, hashes=HASHES[:4], rma=True)
    assert again["error"] is None and again["n"] == [4] and again["rma_reads"] == 1, again
    assert again["corrupt"] == []


def test_one_sided_fetch_with_the_handshake(nodes):
    server, client = nodes(), nodes()
    address = server.call(
        "serve", blocks=blocks_of(HASHES[:2], [8 * KIB] * 2), rma=True, secret="s" * 32
    )
    out = client.call("fetch", address=address, hashes=HASHES[:2], rma=True, secret="s" * 32)
    assert out["error"] is None and out["n"] == [2] and out["rma_reads"] == 1, out
    assert port(server)["rma_leases"] == 1


def test_no_card_before_the_handshake(nodes):
    """A CARD_REQUEST in place of HELLO gets no card: the connection is closed."""
    from kvstore.transfer import wire

    server, client = nodes(), nodes()
    address = server.call(
        "serve", blocks=blocks_of(HASHES[:2], [8 * KIB] * 2), rma=True, secret="s" * 32
    )
    frame = b"".join(wire.encode_frame(wire.Kind.CARD_REQUEST, wire.encode_card_request()))
    replies = client.call("raw", address=address, frames=[frame], replies=1)
    assert replies[0][0] == "failed", replies
    assert wait_until(lambda: port(server)["auth_failures"] == 1)
    assert port(server)["rma_leases"] == 0


# ---- the frames and the run arithmetic, in-process ------------------------------------------


def test_grant_and_request_fields_are_checked():
    import msgpack
    import numpy as np

    from kvstore.transfer import wire
    from kvstore.transfer.errors import ProtocolError

    grant = wire.Grant(7, 2.5, np.array([4096, 8192, 100], dtype=np.uint64))
    body = wire.encode_layouts([[4096, 4096, 100]], [0], (), 1, grant)
    offer = wire.decode_offer(body, 1, rma=True)
    assert offer.grant.lease_id == 7 and offer.grant.expiry_s == 2.5
    assert offer.grant.addresses.tolist() == [4096, 8192, 100]
    with pytest.raises(ProtocolError, match="reply is not"):  # a grant nobody asked for
        wire.decode_offer(body, 1, rma=False)
    bad = msgpack.unpackb(body)
    for i, value, match in [
        (6, b"\0" * 16, "3 packed u64"),
        (5, 0, "expiry"),
        (5, wire.MAX_LEASE_EXPIRY_MS + 1, "expiry"),
        (4, -1, "lease id"),
    ]:
        fields = list(bad)
        fields[i] = value
        with pytest.raises(ProtocolError, match=match):
            wire.decode_offer(msgpack.packb(fields), 1, rma=True)
    request = msgpack.unpackb(wire.encode_request("ns", [1, 2], rma=True))
    assert wire.decode_request(msgpack.packb(request)).rma is True
    request[3] = 1
    with pytest.raises(ProtocolError, match="rma flag"):
        wire.decode_request(msgpack.packb(request))
    assert wire.decode_card(wire.encode_card(b"")) == b""
    with pytest.raises(ProtocolError, match="CARD is not"):
        wire.decode_card(msgpack.packb(["x"]))


def test_runs_break_where_either_side_breaks():
    import numpy as np

    from kvstore.transfer.onesided import runs_for
    from kvstore.transfer.slots import SlotTable
    from kvstore.transfer.wire import Grant

    size = np.full(6, 100, dtype=np.int64)
    local = np.array([0, 100, 200, 300, 1000, 1100], dtype=np.uint64)  # breaks before 4
    remote = np.array([5000, 5100, 9000, 9100, 9200, 9300], dtype=np.uint64)  # before 2
    table = SlotTable(local, size, np.zeros(6, dtype=np.int64), np.array([3, 3]))
    runs = runs_for(table, Grant(1, 1.0, remote), lanes=1)
    assert runs.local.tolist() == [0, 200, 1000]
    assert runs.remote.tolist() == [5000, 9000, 9200]
    assert runs.nbytes.tolist() == [200, 200, 200]


def test_runs_follow_the_transfer_order_of_the_lanes():
    """TP2 blocks, each rank's slots adjacent across blocks on both sides: two
    lanes read them as two runs (rank 0's, then rank 1's), slot order as four."""
    import numpy as np

    from kvstore.transfer.onesided import runs_for
    from kvstore.transfer.slots import SlotTable
    from kvstore.transfer.wire import Grant

    size = np.full(4, 100, dtype=np.int64)  # block 0 slots 0, 1; block 1 slots 0, 1
    local = np.array([0, 1000, 100, 1100], dtype=np.uint64)
    remote = np.array([5000, 7000, 5100, 7100], dtype=np.uint64)
    table = SlotTable(local, size, np.zeros(4, dtype=np.int64), np.array([2, 2]))
    runs = runs_for(table, Grant(1, 1.0, remote), lanes=2)
    assert runs.local.tolist() == [0, 1000] and runs.remote.tolist() == [5000, 7000]
    assert runs.nbytes.tolist() == [200, 200]
    runs = runs_for(table, Grant(1, 1.0, remote), lanes=1)
    assert runs.local.tolist() == [0, 1000, 100, 1100] and runs.nbytes.tolist() == [100] * 4


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.booleans(), st.integers(1, 3)), min_size=1, max_size=12)
)
def test_runs_are_the_slots_merged_where_both_sides_continue(slots):
    """Against a slot-by-slot walk: one slot, both sides contiguous, cuts on one
    side, on the other, on both (each slot: whether it jumps here, there; size)."""
    import numpy as np

    from kvstore.transfer.onesided import runs_for
    from kvstore.transfer.slots import SlotTable
    from kvstore.transfer.wire import Grant

    local, remote, sizes, at_l, at_r = [], [], [], 0, 1 << 20
    for jump_l, jump_r, units in slots:
        at_l += 4096 * jump_l
        at_r += 8192 * jump_r
        local.append(at_l)
        remote.append(at_r)
        sizes.append(256 * units)
        at_l, at_r = at_l + sizes[-1], at_r + sizes[-1]
    want: list[list[int]] = []  # [remote, local, nbytes] per run
    for r, lo, n in zip(remote, local, sizes, strict=True):
        if want and want[-1][0] + want[-1][2] == r and want[-1][1] + want[-1][2] == lo:
            want[-1][2] += n
        else:
            want.append([r, lo, n])
    n = len(slots)
    table = SlotTable(
        np.array(local, dtype=np.uint64),
        np.array(sizes, dtype=np.int64),
        np.zeros(n, dtype=np.int64),
        np.array([n]),
    )
    runs = runs_for(table, Grant(1, 1.0, np.array(remote, dtype=np.uint64)), lanes=1)
    got = list(zip(runs.remote.tolist(), runs.local.tolist(), runs.nbytes.tolist(), strict=True))
    assert got == [tuple(w) for w in want]


def test_a_protocol_4_request_is_refused_naming_both_versions(nodes):
    import msgpack

    from kvstore.transfer import wire

    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks_of(HASHES[:2], [8 * KIB] * 2), rma=True)
    body = msgpack.packb([4, "ns", b"\1" * 8], use_bin_type=True)
    v4 = wire.PREAMBLE.pack(wire.MAGIC, 4, wire.Kind.REQUEST, 0, len(body)) + body
    replies = client.call("raw", address=address, frames=[v4], replies=1)
    kind, _, (code, message) = replies[0]
    assert kind == "ERROR" and code == "FAILED_PRECONDITION", replies
    assert "protocol version 4, expected 5" in message and "speaks protocol 5" in message
    assert server.call("leases")["active"] == 0 and port(server)["rma_leases"] == 0


# ---- the store's Fetcher over real store nodes ---------------------------------------------


def test_store_fetcher_reads_one_sided_every_byte(nodes):
    server, client = nodes(), nodes()
    address, _ = server.call("serve_store", hashes=HASHES[:6], slot_bytes=8 * KIB, rma=True)
    out = client.call("store_fetch", addresses=[address], hashes=HASHES[:6], slot_bytes=8 * KIB)
    assert out["fetched"] == 6 and out["bad"] == [], out
    assert out["fetches_rma"] == 1 and out["fetches_failed_rma"] == 0
    assert port(server)["rma_leases"] == 1
    assert wait_until(lambda: port(server)["pinned_blocks"] == 0)


@pytest.mark.parametrize("prefix_blocks, evicted", [(0, 0), (6, 6)], ids=["peer", "router"])
def test_reserving_ahead_only_for_what_a_router_said_the_peer_holds(nodes, prefix_blocks, evicted):
    """The fetching store's pool is full of its own blocks and the peer holds none
    of the 6 asked. A --peer (nothing known): its answer comes first, nothing is
    evicted. A router that said the peer holds 6: they were reserved while the
    peer answered, which cost 6 local blocks (docs/design.md §4)."""
    server, client = nodes(), nodes()
    address, _ = server.call("serve_store", hashes=HASHES[:2], slot_bytes=8 * KIB, rma=True)
    out = client.call(
        "store_fetch",
        addresses=[address],
        hashes=HASHES[6:12],
        slot_bytes=8 * KIB,
        prefix_blocks=prefix_blocks,
        own_blocks=32,
    )
    assert out["fetched"] == 0 and out["fetches_failed_unavailable"] == 0, out
    assert out["evictions"] == evicted and out["own_blocks"] == 32 - evicted
    assert out["used_bytes"] == (32 - evicted) * 2 * 8 * KIB  # nothing left reserved


def test_store_fetch_reserved_ahead_reads_one_sided_every_byte(nodes):
    server, client = nodes(), nodes()
    address, _ = server.call("serve_store", hashes=HASHES[:6], slot_bytes=8 * KIB, rma=True)
    out = client.call(
        "store_fetch", addresses=[address], hashes=HASHES[:6], slot_bytes=8 * KIB, prefix_blocks=6
    )
    assert out["fetched"] == 6 and out["bad"] == [], out
    assert out["fetches_rma"] == 1 and out["fetches_failed_rma"] == 0
    assert out["used_bytes"] == 6 * 2 * 8 * KIB


def test_callers_asking_at_once_share_one_fetch(nodes):
    server, client = nodes(), nodes()
    address, _ = server.call("serve_store", hashes=HASHES[:6], slot_bytes=8 * KIB, rma=True)
    out = client.call(
        "store_fetch", addresses=[address], hashes=HASHES[:6], slot_bytes=8 * KIB, callers=3
    )
    assert out["prefixes"] == [6, 6, 6] and out["bad"] == [], out
    assert out["fetched_blocks"] == 6 and out["fetches_rma"] == 1
    assert port(server)["rma_leases"] == 1 and port(server)["requests"] == 1


@pytest.mark.parametrize("rma", [True, False], ids=["one-sided", "two-sided"])
def test_blocks_saved_here_while_they_were_fetched_are_not_counted_fetched(nodes, rma):
    """Two of the six blocks a fetch chose are saved here before its bytes land:
    its commit keeps the local copies and frees its own, and fetched_blocks
    counts the four it made visible (it counted six: each such race, and each
    fetch of a prefix overlapping another's, counted blocks twice)."""
    server, client = nodes(), nodes()
    address, _ = server.call("serve_store", hashes=HASHES[:6], slot_bytes=8 * KIB, rma=rma)
    out = client.call(
        "store_fetch", addresses=[address], hashes=HASHES[:6], slot_bytes=8 * KIB, saved_meanwhile=2
    )
    assert out["prefixes"] == [6] and out["bad"] == [], out
    assert out["fetched_blocks"] == 4, out
    assert out["used_bytes"] == 6 * 2 * 8 * KIB  # the two copies that lost are free


def test_a_cancelled_callers_shared_fetch_is_run_again_for_the_others(nodes):
    """The first caller runs the fetch the others wait on; the peer is slow to
    answer it, and the caller is cancelled: its reservation (made ahead) is
    freed, and a caller still waiting fetches for itself."""
    server, client = nodes(), nodes()
    address, _ = server.call(
        "serve_store", hashes=HASHES[:6], slot_bytes=8 * KIB, rma=True, behaviour="slow_first"
    )
    out = client.call(
        "store_fetch",
        addresses=[address],
        hashes=HASHES[:6],
        slot_bytes=8 * KIB,
        prefix_blocks=6,
        callers=2,
        cancel_first_after=1.5,  # connected by then: its request is at the peer
    )
    assert out["prefixes"] == ["CancelledError", 6] and out["bad"] == [], out
    assert out["fetched_blocks"] == 6 and out["fetches_failed_unavailable"] == 0
    assert out["used_bytes"] == 6 * 2 * 8 * KIB  # the cancelled reservation is free again
    assert port(server)["requests"] == 2  # the waiting caller asked again


def test_failed_one_sided_read_is_counted_and_retried_two_sided(nodes):
    """The peer grants addresses outside its registered region: the read is refused
    before anything is posted, the reservation aborted, the lease RELEASEd (so
    the peer unpins at once, not at the lease's end 15 s on), and the same peer
    serves the fetch two-sided."""
    server, client = nodes(), nodes()
    address, _ = server.call(
        "serve_store", hashes=HASHES[:6], slot_bytes=8 * KIB, rma=True, behaviour="bad_grant"
    )
    out = client.call("store_fetch", addresses=[address], hashes=HASHES[:6], slot_bytes=8 * KIB)
    assert out["fetched"] == 6 and out["bad"] == [], out
    assert out["fetches_rma"] == 0 and out["fetches_failed_rma"] == 1
    assert out["fetches_failed_unavailable"] == 0
    assert out["used_bytes"] == 6 * 2 * 8 * KIB  # only the committed blocks' slots
    stats = port(server)
    assert stats["rma_leases"] == 1 and stats["rma_leases_expired"] == 0
    assert stats["pinned_blocks"] == 0


def test_a_fetch_cancelled_during_its_one_sided_read_is_not_retried_two_sided(nodes):
    """The peer's NIXL agent never progresses (wedged), so the read hangs; the
    caller is cancelled meanwhile. The cancellation goes on: no two-sided retry
    asks the peer again, and the reservation is free (or, had a request not
    been released, kept and counted as a failed one-sided read)."""
    env = {"UCX_TLS": "tcp,self"}
    server, client = nodes(**env), nodes(**env)
    address, _ = server.call(
        "serve_store", hashes=HASHES[:6], slot_bytes=8 * KIB, rma=True, behaviour="wedged_rma"
    )
    out = client.call(
        "store_fetch",
        addresses=[address],
        hashes=HASHES[:6],
        slot_bytes=8 * KIB,
        cancel_first_after=1.5,  # the grant came; the read hangs
    )
    assert out["prefixes"] == ["CancelledError"], out
    assert port(server)["requests"] == 1  # asked once: no retry
    assert out["fetches_rma"] == 0 and out["fetched_blocks"] == 0
    if out["fetches_failed_rma"] == 0:  # settled: the reservation is free again
        assert out["used_bytes"] == 0, out


def test_a_peer_address_that_does_not_parse_is_the_peers_failure(nodes):
    """A store advertising a malformed UCX address made every fetch of the
    namespace fail INVALID_ARGUMENT before the next peer was asked. Now that
    peer is counted unavailable and the next one serves."""
    server, client = nodes(), nodes()
    address, _ = server.call("serve_store", hashes=HASHES[:6], slot_bytes=8 * KIB, rma=True)
    out = client.call(
        "store_fetch", addresses=["garbage", address], hashes=HASHES[:6], slot_bytes=8 * KIB
    )
    assert out["error"] is None and out["fetched"] == 6 and out["bad"] == [], out
    assert out["fetches_failed_unavailable"] == 1


def test_a_peer_hung_under_a_one_sided_read_costs_one_timeout(nodes):
    """The peer's NIXL agent never progresses (wedged); over tcp the read then
    stalls until the fetch's 5 s deadline. Before, the two-sided retry got 5 s
    more of its own (and fetched, the peer's loop being alive): a hung peer
    cost twice the timeout. Now the retry gets only the time left: none."""
    env = {"UCX_TLS": "tcp,self"}
    server, client = nodes(**env), nodes(**env)
    address, _ = server.call(
        "serve_store",
        hashes=HASHES[:6],
        slot_bytes=8 * KIB,
        rma=True,
        behaviour="wedged_rma",
    )
    out = client.call("store_fetch", addresses=[address], hashes=HASHES[:6], slot_bytes=8 * KIB)
    assert out["error"] == "PeerTimeout" and out["fetched"] == 0, out
    assert out["fetches_failed_rma"] == 1 and out["fetches_failed_timeout"] == 1
    assert out["used_bytes"] == 0  # the failed read's reservation is free again


def test_a_card_that_kills_the_process_loading_it_is_fetched_from_two_sided(nodes):
    """A card whose UCX worker address UCX asserts on (SIGABRT: every block the
    store held, gone) is loaded by a child process first: the child dies, the
    fetching node lives and fetches two-sided, every byte."""
    server, client = nodes(), nodes()
    address = server.call(
        "serve", blocks=blocks_of(HASHES[:2], [4096]), rma=True, forgery="ucx_address_ff"
    )
    out = client.call("fetch", address=address, hashes=HASHES[:2], rma=True, timeout_s=10)
    assert client.proc.is_alive()
    assert out["error"] is None and out["n"] == [2] and out["corrupt"] == [], out
    assert out["rma_reads"] == 0


def test_a_card_whose_agent_name_is_not_utf8_is_fetched_from_two_sided(nodes):
    """NIXL loads it under a name no read can give: refused as unusable (it raised
    UnicodeDecodeError out of the fetch, past the two-sided fallback)."""
    server, client = nodes(), nodes()
    address = server.call(
        "serve", blocks=blocks_of(HASHES[:2], [4096]), rma=True, forgery="agent_name_not_utf8"
    )
    out = client.call("fetch", address=address, hashes=HASHES[:2], rma=True)
    assert out["error"] is None and out["n"] == [2] and out["corrupt"] == [], out
    assert out["rma_reads"] == 0


def test_one_peers_unusable_card_does_not_stop_a_store_fetch(nodes):
    """The router lists a peer with an unusable card first: its blocks come
    two-sided (the fetch failed whole, the next peer never asked)."""
    bad, good, client = nodes(), nodes(), nodes()
    bad_address, _ = bad.call(
        "serve_store", hashes=HASHES[:4], rma=True, forgery="agent_name_not_utf8"
    )
    good_address, _ = good.call("serve_store", hashes=HASHES[:4], rma=True)
    out = client.call(
        "store_fetch", addresses=[bad_address, good_address], hashes=HASHES[:4], slot_bytes=4096
    )
    assert out["error"] is None and out["fetched"] == 4 and out["bad"] == [], out
