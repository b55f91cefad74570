"""Peer transfer over real UCX endpoints between real processes on loopback.

Every test drives spawned "nodes" (tests/transfer/nodes.py: each its own
process with its own UCX context) over a pipe: one serves a test-only
numpy-pool SlotSource, another fetches into a numpy-pool SlotSink and checks
every byte. Misbehaving peers are PeerServer subclasses that fail at a chosen
point of the protocol.
"""

from __future__ import annotations

import pytest

from tests.conftest import need_nixl
from tests.transfer.nodes import HASHES, NS, blocks_of, wait_until

pytestmark = pytest.mark.timeout(60)


# ---- correctness ------------------------------------------------------------------------


def test_fetch_every_byte_several_slot_sizes(nodes):
    """Mixed slot sizes (eager and rendezvous, odd lengths), two layouts, reused endpoint."""
    layout_a = [1, 512, 8191, 8192, 16 << 10, 100_003, 1 << 20]
    layout_b = [64 << 10] * 4
    blocks = {h: (layout_a if i % 2 else layout_b) for i, h in enumerate(HASHES[:8])}
    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks)
    out = client.call("fetch", address=address, hashes=HASHES[:8], repeat=2)
    assert out["error"] is None, out
    assert out["n"] == [8, 8]
    assert out["visible"] == sorted(HASHES[:8])
    assert out["corrupt"] == []
    assert out["states"] == ["committed", "committed"]
    assert wait_until(lambda: server.call("leases")["active"] == 0)


def test_fetch_partial_prefix(nodes):
    """The peer holds blocks 0-4 and 6 of 8: only the prefix 0-4 comes back."""
    held = [*HASHES[:5], HASHES[6]]
    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks_of(held, [32 << 10] * 64))
    out = client.call("fetch", address=address, hashes=HASHES[:8])
    assert out["error"] is None, out
    assert out["n"] == [5]
    assert out["visible"] == sorted(HASHES[:5])
    assert out["corrupt"] == []

    none = client.call("fetch", address=address, hashes=[HASHES[5], HASHES[6]])
    assert none["n"] == [0] and none["states"] == [] and none["error"] is None
    assert wait_until(lambda: server.call("leases")["active"] == 0)


# ---- coalescing: runs adjacent on both sides travel as one message ---------------------------


def expected_segments(num_slots: int, *gap_every: int) -> int:
    cuts = {i for k in gap_every if k for i in range(k, num_slots, k)}
    return len(cuts) + 1


@pytest.mark.parametrize(
    "serve_gap, fetch_gap",
    [(0, 0), (1, 0), (0, 1), (3, 5), (8, 8)],
    ids=["contiguous", "peer-split", "fetcher-split", "mixed", "per-block"],
)
def test_runs_coalesce_and_split(nodes, serve_gap, fetch_gap):
    """Every byte arrives whatever the two sides' layouts; one message per common run."""
    layout = [1, 512, 8191, 8192, 16 << 10, 100_003, 64 << 10, 3]  # odd sizes: unaligned runs
    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks_of(HASHES[:6], layout), gap_every=serve_gap)
    out = client.call("fetch", address=address, hashes=HASHES[:6], gap_every=fetch_gap)
    assert out["error"] is None, out
    assert out["n"] == [6] and out["visible"] == sorted(HASHES[:6]) and out["corrupt"] == []
    segments = server.call("leases")["segments"]
    assert len(segments) == expected_segments(6 * len(layout), serve_gap, fetch_gap)
    assert sum(segments) == 6 * sum(layout)


def test_runs_are_cut_at_the_segment_cap(nodes):
    """A long run on both sides still splits where either side's cap says so."""
    server, client = nodes(), nodes()
    server.call("set_max_segment_bytes", nbytes=100 << 10)
    address = server.call("serve", blocks=blocks_of(HASHES[:4], [32 << 10] * 8))
    out = client.call("fetch", address=address, hashes=HASHES[:4])
    assert out["error"] is None and out["corrupt"] == [] and out["n"] == [4], out
    segments = server.call("leases")["segments"]
    assert max(segments) <= 100 << 10 and sum(segments) == 4 * 8 * (32 << 10)
    assert len(segments) == 11  # 32 slots, 3 per segment


@pytest.mark.parametrize(
    "serve_lanes, fetch_lanes, segments", [(2, 2, 1), (4, 4, 1), (2, 1, 48), (1, 4, 48), (4, 2, 48)]
)
def test_store_like_lanes_coalesce(nodes, serve_lanes, fetch_lanes, segments):
    """Slots laid out per tp_rank, as the store does: the peer picks that lane order,
    and a whole fetch is one message when both sides agree, one per slot when not."""
    layout = [16 << 10, 8 << 10, 16 << 10, 8 << 10, 4096, 4096, 100, 100]
    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks_of(HASHES[:6], layout), lanes=serve_lanes)
    out = client.call("fetch", address=address, hashes=HASHES[:6], lanes=fetch_lanes)
    assert out["error"] is None, out
    assert out["n"] == [6] and out["visible"] == sorted(HASHES[:6]) and out["corrupt"] == []
    sent = server.call("leases")["segments"]
    assert len(sent) == segments and sum(sent) == 6 * sum(layout), sent


@pytest.mark.parametrize(
    "behaviour",
    ["bad_runs_unsorted", "bad_runs_range", "bad_runs_dup", "bad_runs_zero", "bad_runs_lanes"],
)
def test_malformed_run_starts_in_offer_are_rejected(nodes, behaviour):
    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks_of(HASHES[:2], [4096] * 4), behaviour=behaviour)
    out = client.call("fetch", address=address, hashes=HASHES[:2])
    word = "lanes" if behaviour == "bad_runs_lanes" else "run starts"
    assert out["error"] == "PeerUnavailable" and word in out["message"], out
    assert out["states"] == [] and out["visible"] == []


def test_malformed_run_starts_in_go_are_rejected(nodes):
    """The peer drops a fetcher whose GO carries a bad run list, and frees the lease."""
    from kvstore.transfer import wire

    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks_of(HASHES[:2], [4096] * 4))
    request = wire.encode_request(NS, HASHES[:2])
    for accepted, starts in ((2, [5, 3]), (2, [1, 8]), (2, [4, 4]), (1, [])):
        go = wire.encode_go(accepted, starts)
        frames = wire.encode_frame(wire.Kind.REQUEST, request) + wire.encode_frame(wire.Kind.GO, go)
        replies = client.call("raw", address=address, frames=frames, replies=2)
        assert replies[0][0] == "REPLY" and replies[1][0] == "failed", replies
    assert wait_until(lambda: server.call("leases")["released"] == 4)
    assert server.call("leases")["active"] == 0 and server.call("leases")["segments"] == []
    out = client.call("fetch", address=address, hashes=HASHES[:2])
    assert out["n"] == [2] and out["corrupt"] == [], out


# ---- bad requests and bad peers -----------------------------------------------------------


def test_bad_requests_are_refused_and_the_server_survives(nodes):
    import msgpack

    from kvstore.transfer import wire

    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks_of(HASHES[:2], [4096]))

    def request(body: bytes) -> list[bytes]:
        return wire.encode_frame(wire.Kind.REQUEST, body)

    too_many = wire.encode_request(NS, list(range(wire.MAX_BLOCKS_PER_FETCH + 1)))
    garbage = b"\xc1\xff\x00not msgpack"
    bad_ns = msgpack.packb([wire.PROTOCOL_VERSION, "x" * 1000, b"\0" * 8])
    twice = wire.encode_request(NS, [HASHES[0]] * 8)  # would pin and send one block 8 times
    good = wire.encode_request(NS, HASHES[:2])
    replies = client.call(
        "raw",
        address=address,
        replies=5,
        frames=request(too_many)
        + request(garbage)
        + request(bad_ns)
        + request(twice)
        + request(good),
    )
    assert [r[0] for r in replies] == ["ERROR"] * 4 + ["REPLY"], replies
    assert all(r[2][0] == "INVALID_ARGUMENT" for r in replies[:4])

    # Broken framing: the server drops that connection and allocates nothing.
    huge = [wire.encode_preamble(wire.Kind.REQUEST, 1 << 40)]
    bad_magic = [b"XXXX" + wire.encode_preamble(wire.Kind.REQUEST, 8)[4:]]
    for frames in (huge, bad_magic):
        replies = client.call("raw", address=address, frames=frames, replies=1)
        assert replies[0][0] == "failed", replies

    out = client.call("fetch", address=address, hashes=HASHES[:2])
    assert out["n"] == [2] and out["corrupt"] == [], out


def test_a_frame_shorter_than_its_preamble_said_reads_as_zeros_not_old_heap(nodes):
    """ucxx completes a message shorter than the receive buffer without error. A
    REQUEST body announced at 100,000 bytes but sent as 6 landed in an
    uninitialised buffer, and the refusal quoted what it found there: this
    process's old heap, sent to whoever asked. Now the rest reads as zeros."""
    from kvstore.transfer import wire

    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks_of(HASHES[:2], [4096]))
    announced = 100_000
    short = b"\x94\xc6" + (announced - 9).to_bytes(4, "big")  # [bin of ~100 KB, ...] cut off
    preamble = wire.encode_preamble(wire.Kind.REQUEST, announced)
    for _ in range(3):
        server.call("litter", nbytes=announced)
        replies = client.call("raw", address=address, frames=[preamble, short], replies=1)
        kind, _, (code, message) = replies[0]
        assert (kind, code) == ("ERROR", "INVALID_ARGUMENT"), replies
        assert "version" in message and "ZZ" not in message and "\\x00\\x00" in message


def test_malicious_offer_is_rejected_before_reserving(nodes):
    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks_of(HASHES[:2], [4096]), behaviour="evil_offer")
    out = client.call("fetch", address=address, hashes=HASHES[:2])
    assert out["error"] == "PeerUnavailable", out
    assert out["states"] == [] and out["visible"] == []


def test_oversized_slot_message_aborts_the_reservation(nodes):
    """A peer sending more bytes than it announced cannot write past the reserved slot."""
    server, client = nodes(), nodes()
    address = server.call(
        "serve", blocks=blocks_of(HASHES[:3], [16 << 10, 4096]), behaviour="oversend"
    )
    out = client.call("fetch", address=address, hashes=HASHES[:3], timeout_s=5)
    assert out["error"] in ("PeerUnavailable", "PeerTimeout"), out
    assert out["states"] == ["aborted"] and out["visible"] == []


@pytest.mark.parametrize("segment", [4096, 1 << 20], ids=["eager", "rendezvous"])
def test_short_slot_message_aborts_the_reservation(nodes, segment):
    """ucxx completes a receive of a shorter message without error or its length
    (rapidsai/ucxx#104): the slots' old bytes stayed under the peer's short
    segment, and were committed as its blocks. Each segment is now checked."""
    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks_of(HASHES[:3], [segment]), behaviour="undersend")
    out = client.call("fetch", address=address, hashes=HASHES[:3], timeout_s=5)
    assert out["error"] == "PeerUnavailable" and "bytes" in out["message"], out
    assert out["states"] == ["aborted"] and out["visible"] == []


def test_invalid_arguments_fail_locally(nodes):
    client = nodes()
    out = client.call("fetch", address="127.0.0.1:1", hashes=[-1])
    assert out["code"] == "INVALID_ARGUMENT", out
    out = client.call("fetch", address="no-port", hashes=[1])
    assert out["code"] == "INVALID_ARGUMENT", out
    out = client.call("fetch", address="127.0.0.1:1", hashes=[5, 6, 5])
    assert out["code"] == "INVALID_ARGUMENT" and "distinct" in out["message"], out


# ---- what the peer port lets a caller hold ------------------------------------------------


def test_a_request_without_go_pins_its_blocks_only_briefly(nodes):
    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks_of(HASHES[:4], [4096]),
                          limits={"go_timeout_s": 0.5})  # fmt: skip
    from kvstore.transfer import wire

    frames = wire.encode_frame(wire.Kind.REQUEST, wire.encode_request(NS, HASHES[:4]))
    replies = client.call("raw", address=address, frames=frames, replies=1, keep=True)
    assert replies[0][0] == "REPLY", replies
    # The caller stays connected and never sends GO: the lease goes anyway.
    assert wait_until(lambda: server.call("leases")["active"] == 0, timeout=5)
    assert server.call("port_stats")["pinned_blocks"] == 0


def test_idle_and_surplus_connections_are_closed(nodes):
    server, client = nodes(), nodes()
    limits = {"max_connections": 2, "first_request_s": 1.0}
    address = server.call("serve", blocks=blocks_of(HASHES[:2], [4096]), limits=limits)
    client.call("open_idle", address=address, n=4)
    assert wait_until(lambda: server.call("port_stats")["refused_connections"] >= 2, timeout=5)
    assert server.call("port_stats")["connections"] <= 2
    assert wait_until(lambda: server.call("port_stats")["connections"] == 0, timeout=5)
    out = client.call("fetch", address=address, hashes=HASHES[:2])  # the port still serves
    assert out["n"] == [2] and out["corrupt"] == [], out


def test_pinned_blocks_are_capped_across_the_port(nodes):
    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks_of(HASHES[:6], [4096]),
                          limits={"max_pinned_blocks": 3})  # fmt: skip
    out = client.call("fetch", address=address, hashes=HASHES[:6])
    assert out["n"] == [3] and out["corrupt"] == [], out  # a valid, shorter prefix
    assert server.call("port_stats")["pinned_blocks"] == 0


# ---- dying and hanging peers --------------------------------------------------------------


def test_peer_killed_mid_transfer(nodes):
    server, client = nodes(), nodes()
    address = server.call(
        "serve", blocks=blocks_of(HASHES[:8], [256 << 10] * 8), behaviour="die_half", gap_every=1
    )
    out = client.call("fetch", address=address, hashes=HASHES[:8], timeout_s=8)
    assert out["error"] in ("PeerUnavailable", "PeerTimeout"), out
    assert out["states"] == ["aborted"] and out["visible"] == []
    assert not server.proc.is_alive() or wait_until(lambda: not server.proc.is_alive(), 5)


def test_peer_hanging_mid_transfer_times_out(nodes):
    server, client = nodes(), nodes()
    address = server.call(
        "serve", blocks=blocks_of(HASHES[:8], [64 << 10] * 8), behaviour="hang_half", gap_every=1
    )
    out = client.call("fetch", address=address, hashes=HASHES[:8], timeout_s=2)
    assert out["error"] == "PeerTimeout", out
    assert out["states"] == ["aborted"] and out["visible"] == []
    assert out["elapsed"] < 2 + 10  # bounded by the deadline (plus abort grace), not hung


def test_mute_peer_times_out(nodes):
    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks_of(HASHES[:2], [4096]), behaviour="mute")
    out = client.call("fetch", address=address, hashes=HASHES[:2], timeout_s=1.5)
    assert out["error"] == "PeerTimeout", out
    assert out["states"] == []


@pytest.mark.parametrize(
    "behaviour, ahead",
    [("mute", None), ("mute", [4096]), ("hang_half", None)],
    ids=["awaiting-reply", "awaiting-reply-reserved-ahead", "receiving-slots"],
)
def test_a_cancelled_fetch_aborts_and_frees_its_slots(nodes, behaviour, ahead):
    """Cancelled from outside (its caller gave up), a fetch aborts the endpoint,
    lets UCX settle every request it posted, frees what it reserved and shows
    nothing; the node fetches again afterwards."""
    server, good, client = nodes(), nodes(), nodes()
    blocks = blocks_of(HASHES[:8], [4096])
    address = server.call("serve", blocks=blocks, behaviour=behaviour, gap_every=1)
    good_address = good.call("serve", blocks=blocks)
    first = client.call("fetch", address=good_address, hashes=HASHES[:8])  # UCX started
    assert first["error"] is None and first["n"] == [8], first
    out = client.call(
        "fetch", address=address, hashes=HASHES[:8], timeout_s=60, cancel_after=1.0, ahead=ahead
    )
    assert out["error"] == "Cancelled", out
    assert out["visible"] == [] and out["elapsed"] < 30, out  # not the 60 s deadline
    assert out["states"] == ([] if behaviour == "mute" and ahead is None else ["aborted"]), out
    if ahead is not None:
        assert out["ahead"] == [8], out
    if behaviour == "hang_half":
        assert server.call("leases")["sent_half"], "cancelled while the slots came in"
    again = client.call("fetch", address=good_address, hashes=HASHES[:8])
    assert again["error"] is None and again["n"] == [8] and again["corrupt"] == [], again


def test_no_listener_is_unavailable(nodes):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = nodes().call("fetch", address=f"127.0.0.1:{port}", hashes=[1], timeout_s=3)
    assert out["error"] in ("PeerUnavailable", "PeerTimeout"), out


# ---- the serving side releases leases when the fetcher goes away ----------------------------


@pytest.mark.parametrize("on_reserve", ["die", "hang"])
def test_lease_released_when_fetcher_dies_or_hangs_before_go(nodes, on_reserve):
    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks_of(HASHES[:4], [4096] * 4), timeout_s=3)
    client.submit("fetch", address=address, hashes=HASHES[:4], on_reserve=on_reserve)
    assert wait_until(lambda: server.call("leases")["released"] == 1)
    assert server.call("leases")["active"] == 0
    client.kill()


def test_lease_released_when_fetcher_killed_mid_transfer(nodes):
    server, client = nodes(), nodes()
    address = server.call(
        "serve",
        blocks=blocks_of(HASHES[:8], [256 << 10] * 8),
        behaviour="pause_half",
        timeout_s=5,
        gap_every=3,
    )
    client.submit("fetch", address=address, hashes=HASHES[:8])
    assert wait_until(lambda: server.call("leases")["sent_half"])
    client.kill()
    assert wait_until(lambda: server.call("leases")["released"] == 1)
    assert server.call("leases")["active"] == 0
    # The server still serves others.
    out = nodes().call("fetch", address=address, hashes=HASHES[:1])
    assert out["n"] == [1] and out["corrupt"] == [], out


def test_transfer_racing_an_eviction_on_the_peer_is_safe(nodes):
    """A real store node serves: while the fetch is paused half-way, the peer saves
    enough new blocks to evict; the leased blocks stay pinned and every byte arrives."""
    server, client = nodes(), nodes()
    leased, pressure = HASHES[:8], [(1 << 40) + i for i in range(64)]
    address, ns = server.call("serve_store", hashes=leased, behaviour="pause_long")
    rid = client.submit("fetch", address=address, hashes=leased, gap_every=5, namespace=ns)
    assert wait_until(lambda: server.call("store_state")["sent_half"])
    state = server.call("evict_with", hashes=pressure)
    assert state["evictions"] > 0 and sorted(state["held"]) == sorted(leased)
    out = client.result(rid)
    assert out["n"] == [8] and out["corrupt"] == [] and out["visible"] == sorted(leased), out
    assert wait_until(lambda: server.call("store_state")["held"] == [])  # lease released


@pytest.mark.parametrize("rma", [False, True], ids=["two-sided", "one-sided"])
def test_reserved_ahead_keeps_only_what_the_peer_offers(nodes, rma):
    """A sink that knows the layout reserves all 6 asked blocks before the offer;
    the peer holds 4: those are committed, every byte right."""
    if rma:
        need_nixl()
    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks_of(HASHES[:4], [4096] * 3), rma=rma)
    out = client.call("fetch", address=address, hashes=HASHES[:6], rma=rma, ahead=[4096] * 3)
    assert out["error"] is None, out
    assert out["ahead"] == [6]  # reserved before the offer came
    assert out["n"] == [4] and out["states"] == ["committed"]
    assert out["visible"] == sorted(HASHES[:4]) and out["corrupt"] == []


@pytest.mark.parametrize("rma", [False, True], ids=["two-sided", "one-sided"])
def test_reserved_ahead_in_another_layout_is_the_peers_fault(nodes, rma):
    """A peer offering slot sizes other than the namespace's layout: PeerUnavailable,
    the reservation aborted, nothing visible, the peer's lease released."""
    if rma:
        need_nixl()
    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks_of(HASHES[:2], [4096] * 3), rma=rma)
    out = client.call("fetch", address=address, hashes=HASHES[:2], rma=rma, ahead=[8192] * 3)
    assert out["error"] == "PeerUnavailable" and "layout" in out["message"], out
    assert out["states"] == ["aborted"] and out["visible"] == []
    assert wait_until(lambda: server.call("leases")["active"] == 0)


@pytest.mark.parametrize("rma", [False, True], ids=["two-sided", "one-sided"])
def test_reserved_ahead_for_a_peer_that_holds_none_is_aborted(nodes, rma):
    if rma:
        need_nixl()
    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks_of(HASHES[:2], [4096] * 3), rma=rma)
    out = client.call("fetch", address=address, hashes=HASHES[5:8], rma=rma, ahead=[4096] * 3)
    assert out["error"] is None and out["n"] == [0], out
    assert out["ahead"] == [3] and out["states"] == ["aborted"] and out["visible"] == []


def test_reserved_ahead_is_aborted_when_the_peer_refuses(nodes):
    """The peer answers ERROR (busy: no block may be pinned): the reservation made
    while it answered is aborted, the error is the peer's."""
    server, client = nodes(), nodes()
    address = server.call(
        "serve", blocks=blocks_of(HASHES[:2], [4096] * 3), limits={"max_pinned_blocks": 0}
    )
    out = client.call("fetch", address=address, hashes=HASHES[:2], ahead=[4096] * 3)
    assert out["error"] == "PeerUnavailable" and "busy" in out["message"], out
    assert out["ahead"] == [2] and out["states"] == ["aborted"] and out["visible"] == []


@pytest.mark.parametrize("rma", [False, True], ids=["two-sided", "one-sided"])
def test_reserving_ahead_fails_the_fetch_and_releases_the_peer(nodes, rma):
    """The sink cannot reserve (every local block pinned): its error is the fetch's,
    the endpoint is aborted, and the peer's pin (or one-sided lease) goes with it."""
    if rma:
        need_nixl()
    server, client = nodes(), nodes()
    address = server.call("serve", blocks=blocks_of(HASHES[:2], [4096] * 3), rma=rma)
    out = client.call(
        "fetch",
        address=address,
        hashes=HASHES[:2],
        rma=rma,
        ahead=[4096] * 3,
        on_reserve="exhausted",
    )
    assert out["code"] == "RESOURCE_EXHAUSTED" and "no room" in out["message"], out
    assert out["states"] == [] and out["visible"] == []
    assert wait_until(lambda: server.call("leases")["active"] == 0)
