"""The UCX port's handshake: with a cluster secret, both ends prove it before any
REQUEST is served or any byte accepted (kvstore/transfer/handshake.py, docs/design.md §8).

Real processes with their own UCX contexts on loopback (tests/transfer/nodes.py);
a refused connection must pin nothing, be counted and be logged with its address.
"""

from __future__ import annotations

import os

import pytest

from kvstore.transfer import wire
from kvstore.transfer.handshake import PeerSecret
from tests.transfer.nodes import HASHES, NS, blocks_of, wait_until

pytestmark = pytest.mark.timeout(60)

SECRET = "cluster-secret-0123456789"
OTHER = "another-secret-9876543210"
LAYOUT = [4096, 64 << 10, 100_003]


def frame(kind: wire.Kind, body: bytes) -> bytes:
    (message,) = wire.encode_frame(kind, body)
    return message


def serve(nodes, secret: str = SECRET, **limits):
    server = nodes()
    server.call("watch_logs")
    address = server.call(
        "serve", blocks=blocks_of(HASHES[:4], LAYOUT), secret=secret, limits=limits or None
    )
    return server, address


def refused_and_untouched(server, failures: int = 1) -> None:
    """The server counted the failures, holds no connection, never leased a block,
    and logged the fetcher's address."""
    assert wait_until(lambda: server.call("port_stats")["auth_failures"] == failures)
    assert wait_until(lambda: server.call("port_stats")["connections"] == 0)
    stats = server.call("port_stats")
    assert stats["pinned_blocks"] == 0
    leases = server.call("leases")
    assert leases["active"] == 0 and leases["released"] == 0  # never leased anything
    warned = [w for w in server.call("warnings") if "failed authentication" in w]
    assert len(warned) == failures and "127.0.0.1:" in warned[0], warned


def test_right_secret_fetches_every_byte(nodes):
    server, address = serve(nodes)
    client = nodes()
    out = client.call("fetch", address=address, hashes=HASHES[:4], repeat=2, secret=SECRET)
    assert out["error"] is None, out
    assert out["n"] == [4, 4] and out["corrupt"] == [] and out["visible"] == sorted(HASHES[:4])
    assert server.call("port_stats")["auth_failures"] == 0
    assert wait_until(lambda: server.call("leases")["active"] == 0)


def test_wrong_secret_is_refused_on_both_sides(nodes):
    """Each side checks the other: the fetcher refuses the server's proof (nothing
    reserved, nothing accepted), the server counts the connection as failed."""
    server, address = serve(nodes)
    out = nodes().call("fetch", address=address, hashes=HASHES[:4], secret=OTHER)
    assert out["error"] == "PeerUnauthenticated" and out["code"] == "UNAVAILABLE", out
    assert "did not prove the cluster secret" in out["message"]
    assert out["states"] == [] and out["visible"] == []
    refused_and_untouched(server)


def test_fetcher_without_secret_is_refused(nodes):
    """A plain REQUEST where the HELLO belongs: closed before it is read as a request."""
    server, address = serve(nodes)
    out = nodes().call("fetch", address=address, hashes=HASHES[:4])
    assert out["error"] == "PeerUnavailable" and out["visible"] == [], out
    refused_and_untouched(server)


def test_fetcher_refuses_a_peer_that_cannot_prove_the_secret(nodes):
    """A peer with no secret at all (a rogue, or one left unconfigured) serves happily,
    but the fetcher never sends it a REQUEST nor accepts a byte from it."""
    server, address = serve(nodes, secret="")
    out = nodes().call("fetch", address=address, hashes=HASHES[:4], secret=SECRET)
    assert out["error"] == "PeerUnauthenticated", out
    assert out["states"] == [] and out["visible"] == []
    assert server.call("leases")["released"] == 0


def test_garbage_before_the_handshake_is_refused(nodes):
    server, address = serve(nodes)
    replies = nodes().call("raw", address=address, frames=[b"\xff" * 64], replies=1)
    assert replies[0][0] == "failed", replies
    refused_and_untouched(server)


def test_bad_proof_then_request_pins_nothing(nodes):
    """A fetcher that answers the challenge with a made-up proof, then asks for blocks:
    it gets the challenge, and then only a closed connection."""
    server, address = serve(nodes)
    frames = [
        frame(wire.Kind.HELLO, wire.encode_hello(os.urandom(wire.NONCE_BYTES))),
        frame(wire.Kind.PROOF, wire.encode_proof(os.urandom(wire.MAC_BYTES))),
        frame(wire.Kind.REQUEST, wire.encode_request(NS, HASHES[:4])),
    ]
    replies = nodes().call("raw", address=address, frames=frames, replies=2)
    assert replies[0][0] == "CHALLENGE" and replies[1][0] == "failed", replies
    refused_and_untouched(server)


def test_silent_connection_hits_the_handshake_deadline(nodes):
    server, address = serve(nodes, handshake_s=0.5)
    client = nodes()
    assert client.call("open_idle", address=address, n=1) == 1
    refused_and_untouched(server)
    # and the port still serves one that does prove the secret
    out = client.call("fetch", address=address, hashes=HASHES[:4], secret=SECRET)
    assert out["error"] is None and out["n"] == [4] and out["corrupt"] == [], out


# ---- the proofs themselves (no network) ------------------------------------------------


def test_a_proof_is_bound_to_role_and_both_nonces():
    secret = PeerSecret(SECRET.encode())
    nf, np_, other = (os.urandom(wire.NONCE_BYTES) for _ in range(3))
    mac = secret.mac(b"fetcher", nf, np_)
    assert secret.verify(b"fetcher", nf, np_, mac)
    assert not secret.verify(b"peer", nf, np_, mac)  # one side's proof is not the other's
    assert not secret.verify(b"fetcher", nf, other, mac)  # another connection's nonce
    assert not secret.verify(b"fetcher", other, np_, mac)
    assert not PeerSecret(OTHER.encode()).verify(b"fetcher", nf, np_, mac)
    assert SECRET not in repr(secret)


@pytest.mark.parametrize(
    "body, field",
    [
        (wire.encode_hello(b"short"), "HELLO nonce"),
        (wire.encode_challenge(b"n" * wire.NONCE_BYTES, b"m"), "CHALLENGE mac"),
        (wire.encode_proof(b"m" * (wire.MAC_BYTES + 1)), "PROOF mac"),
    ],
)
def test_handshake_frames_of_the_wrong_size_are_refused(body, field):
    decode = {
        "HELLO": wire.decode_hello,
        "CHALLENGE": wire.decode_challenge,
        "PROOF": wire.decode_proof,
    }[field.split()[0]]
    with pytest.raises(wire.ProtocolError, match=field):
        decode(body)


# ---- through the store servers (kvstore serve --peer-secret-file) ----------------------


def test_stores_fetch_only_from_peers_that_share_the_secret(tmp_path):
    """B shares A's secret and fetches every byte; C holds another and gets nothing
    from A (its Load fails, nothing is sealed there, A serves it no block)."""
    from kvstore.demo import free_ports
    from kvstore.testing.worker import WorkerGroup
    from tests.service.test_peer_fetch import LAYOUT, ready, spawn

    files = {}
    for name, secret in (("s", SECRET), ("t", OTHER)):
        files[name] = tmp_path / name
        files[name].write_text(secret)
        files[name].chmod(0o600)
    ports = free_ports(6)
    common = ("--device", "cpu", "--pool-size", "64MiB", "--fetch-timeout", "5", "--no-router")
    peer_a = ("--peer", f"127.0.0.1:{ports[3]}")
    procs = [
        spawn("serve", "--port", str(ports[i]), "--ucx-port", str(ports[3 + i]), *common,
              "--peer-secret-file", str(files[key]), *(peer_a if i else ()))
        for i, key in enumerate("sst")
    ]  # fmt: skip
    groups = []
    try:
        a, b, c = (ready(f"127.0.0.1:{ports[i]}", procs[i]) for i in range(3))
        src, dst, rogue = (
            WorkerGroup(f"127.0.0.1:{ports[i]}", name, 2, **LAYOUT)
            for i, name in enumerate(("src", "dst", "rogue"))
        )
        groups = [src, dst, rogue]
        hashes = [6000 + i for i in range(8)]
        src.each("fill", [(h, i) for i, h in enumerate(hashes)])
        src.each("save", [(h, i) for i, h in enumerate(hashes)])
        dst.each("load", [(h, 16 + i) for i, h in enumerate(hashes)])
        assert dst.each("digest", list(range(16, 24))) == src.each("digest", list(range(8)))
        assert b.stats().fetched_blocks == 8 and a.stats().served_blocks == 8
        with pytest.raises(RuntimeError, match="UNAVAILABLE"):
            rogue[0].call("load", [(h, 16 + i) for i, h in enumerate(hashes)])
        assert c.stats().sealed_blocks == 0 and c.stats().fetched_blocks == 0
        assert a.stats().served_blocks == 8
    finally:
        for group in groups:
            group.close()
        for p in procs:
            p.kill()
            p.wait(timeout=10)
