"""vLLM KV events: decoding vLLM's exact wire format, and routing on real ZMQ PUB feeds.

The payloads are built by hand with msgpack the way msgspec encodes vLLM's
``array_like`` tagged structs (and the map form of newer versions), so the
tests depend on neither vLLM nor msgspec.
"""

from __future__ import annotations

import argparse
import time

import msgpack
import pytest
import zmq

from kvstore.cli.router import add_router_arguments, feed_specs
from kvstore.client.router_client import RouterClient
from kvstore.router.core import Router
from kvstore.router.vllm_events import TierOps, decode_batch, decode_events, decode_message
from kvstore.testing.vllm_events import encode_batch
from kvstore.wire.events import StoreEvent
from tests.router.conftest import ServerThread, card

H = [0x1111, 0x2222, 0x3333, 0xFFFF_FFFF_FFFF_FFFF]


def stored(hashes, parent=None, medium="GPU", tokens=None, block_size=16):
    # [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
    return ["BlockStored", hashes, parent, tokens or [], block_size, None, medium, None]


def removed(hashes, medium="GPU"):
    return ["BlockRemoved", hashes, medium]


def batch(*events, ts=1.5, dp_rank=None) -> bytes:
    return encode_batch(list(events), ts=ts, data_parallel_rank=dp_rank)


def frames(payload: bytes, seq: int = 0, topic: bytes = b"") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), payload]


def test_decode_array_like_batch():
    payload = batch(stored(H, parent=7), removed(H[:1]), ["AllBlocksCleared"], dp_rank=2)
    b = decode_message(frames(payload, seq=41))
    assert (b.seq, b.ts, b.data_parallel_rank) == (41, 1.5, 2)
    assert (b.events, b.blocks_stored) == (3, 4)
    events = decode_events(payload)
    assert [(e.kind, e.hashes, e.tier) for e in events] == [
        ("stored", H, "gpu"),
        ("removed", H[:1], "gpu"),
        ("cleared", [], "gpu"),
    ]
    assert events[0].parent_hash == 7


def test_decode_oldest_and_newest_positional_shapes():
    old = ["BlockStored", H, None, [1, 2], 16, None]  # before `medium` existed
    new = ["BlockStored", H, None, [], 16, None, "GPU", "lora-a", None, 0, "full", None]
    removed_old = ["BlockRemoved", H]
    events = decode_events(batch(old, new, removed_old))
    assert [e.kind for e in events] == ["stored", "stored", "removed"]


def test_decode_map_form_and_byte_hashes():
    digest = bytes(range(32))
    payload = msgpack.packb(
        {
            "ts": 2.0,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [digest],
                    "parent_block_hash": None,
                    "token_ids": [],
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "CPU",
                },
                {"type": "AllBlocksCleared"},
            ],
            "data_parallel_rank": 0,
        },
        use_bin_type=True,
    )
    events = decode_events(payload)
    expected = int.from_bytes(digest, "big") & ((1 << 64) - 1)  # what vLLM's int form would be
    assert events[0].hashes == [expected] and events[0].tier == "store"
    assert events[1].kind == "cleared"
    runs = decode_batch(payload).runs
    assert runs[0].tiers["store"] == TierOps([expected], [True]) and runs[1].cleared_first


def test_negative_int_hashes_wrap_to_u64_and_other_groups_are_skipped():
    b = decode_batch(
        batch(stored([-1]), ["BlockStored", [5], None, [], 16, None, "GPU", None, None, 1])
    )
    assert b.runs[0].tiers["gpu"] == TierOps([(1 << 64) - 1], [True])
    assert b.skipped == 1 and b.events == 1


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb([1.0]), "batch must be"),
        (msgpack.packb([1.0, [["Bogus", [1]]]]), "unknown event tag"),
        (msgpack.packb([1.0, [["BlockStored", [1]]]]), "at least 5 fields"),
        (msgpack.packb([1.0, [["BlockRemoved", "x"]]]), "must be an array"),
        (msgpack.packb([1.0, [["BlockRemoved", [1.5]]]]), "hash of type float"),
    ],
)
def test_malformed_batches_are_refused(payload, message):
    with pytest.raises(ValueError, match=message):
        decode_batch(payload)


def test_bad_frames_are_refused():
    with pytest.raises(ValueError, match="3 frames"):
        decode_message([b"", b"x"])
    with pytest.raises(ValueError, match="8 bytes"):
        decode_message([b"", b"\x00", batch()])


# -- real ZMQ PUB -> router subscription -> route --


def settled(predicate, timeout_s: float = 20.0) -> None:
    """Wait until the router shows what was published once."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("router never saw the published events")
        time.sleep(0.02)


def wait_for(predicate, publish, timeout_s: float = 20.0) -> None:
    """Re-publish until the router shows the effect (ZMQ PUB drops messages
    sent before the subscriber has joined, so the first ones may be lost)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("router never saw the published events")
        publish()
        time.sleep(0.02)


@pytest.fixture
def pub():
    ctx = zmq.Context()
    sockets = []

    def make():
        sock = ctx.socket(zmq.PUB)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        sockets.append(sock)
        return sock, f"tcp://127.0.0.1:{port}"

    yield make
    for sock in sockets:
        sock.close(0)
    ctx.term()


def test_vllm_events_over_zmq_are_indexed_and_routed_on(served, pub):
    router, client, _ = served
    sock, endpoint = pub()
    client.register_worker("cold", card(hash_format="vllm-sha256"))
    client.register_worker("hot", card(hash_format="vllm-sha256", kv_events_endpoint=endpoint))
    seq = iter(range(1_000_000))

    def send(*events):
        sock.send_multipart(frames(batch(*events), seq=next(seq)))

    wait_for(lambda: router.stats().indexed_blocks == 4, lambda: send(stored(H)))
    r = client.route("llama-8b", hashes=H, track=False)
    assert (r.worker, r.overlap_blocks, r.gpu_blocks) == ("hot", 4, 4)
    wait_for(lambda: router.stats().indexed_blocks == 2, lambda: send(removed(H[2:])))
    assert client.route("llama-8b", hashes=H, track=False).overlap_blocks == 2
    wait_for(lambda: router.stats().indexed_blocks == 0, lambda: send(["AllBlocksCleared"]))


def test_an_oversized_event_frame_is_refused_on_the_wire_and_later_batches_land(served, pub):
    """Before: a frame of any size was received whole (256 MiB of the router's
    memory for a 256 MiB frame) and only then counted dropped. Now ZMQ refuses a
    frame past MAX_EVENT_BYTES as it arrives, which drops the connection; the
    router connects again, so the publisher's later batches still land."""
    from kvstore.wire import limits

    router, client, _ = served
    sock, endpoint = pub()
    client.register_worker("hot", card(hash_format="vllm-sha256", kv_events_endpoint=endpoint))
    seq = iter(range(1_000_000))

    def send(*events):
        sock.send_multipart(frames(batch(*events), seq=next(seq)))

    wait_for(lambda: router.stats().indexed_blocks == 1, lambda: send(stored(H[:1])))
    sock.send_multipart(frames(b"\x91" * (limits.MAX_EVENT_BYTES + 1), seq=next(seq)))

    # the refused batch (and any sent while the router connected again) is lost: what
    # it told is unknown, so the worker's blocks are forgotten and the later ones land
    def landed() -> bool:
        stats = router.stats()
        return stats.dropped_by.sequence_gap >= 1 and stats.indexed_blocks == 1

    wait_for(landed, lambda: send(stored(H[1:2])))
    assert client.route("llama-8b", hashes=H[1:2], track=False).overlap_blocks == 1
    assert router.stats().dropped_by.undecodable == 0  # refused by ZMQ: never received


def test_a_lost_vllm_batch_forgets_the_workers_blocks_and_is_counted(served, pub):
    """Batch 1 stores H, batch 2 (lost: a full ZMQ queue, a reconnection) would
    have removed it, batch 3 stores another block. Before, the gap was logged
    only: H stayed indexed, routes credited blocks the worker had evicted, and no
    drop was counted (found by review). A publisher that starts again (numbers
    going back) is a loss too."""
    router, client, _ = served
    sock, endpoint = pub()
    client.register_worker("w", card(hash_format="vllm-sha256", kv_events_endpoint=endpoint))
    seq = [0]

    def send(events, skip=0):
        seq[0] += 1 + skip
        sock.send_multipart(frames(batch(*events), seq=seq[0]))

    wait_for(lambda: router.stats().indexed_blocks == 4, lambda: send([stored(H)]))
    send([stored([0x9999])], skip=1)  # the batch before it never arrives
    settled(lambda: router.stats().indexed_blocks == 1)
    assert router.stats().dropped_by.sequence_gap == 1
    assert client.route("llama-8b", hashes=H, track=False).overlap_blocks == 0
    send([stored(H[:2])])
    settled(lambda: router.stats().indexed_blocks == 3)
    seq[0] = -1
    send([stored(H[2:3])])  # numbered 0: the publisher started again
    settled(lambda: router.stats().indexed_blocks == 1)
    assert router.stats().dropped_by.sequence_gap == 2


def test_a_batch_a_full_domain_cannot_take_is_dropped_and_the_feed_goes_on(served, pub):
    """A domain index holds MAX_WORKERS_PER_DOMAIN holders. A batch of a worker new
    to a full one was half applied, and its RESOURCE_EXHAUSTED ended the feed: the
    worker's later batches were never read. Now the batch is dropped whole
    (no_room) and the feed reads on."""
    from kvstore.wire import limits
    from kvstore.wire.events import StoreEvent

    router, client, _ = served
    sock, endpoint = pub()
    hot = card(hash_format="vllm-sha256", kv_events_endpoint=endpoint)
    client.register_worker("hot", hot)
    fillers = [
        router.register_worker(f"w{i}", card(hash_format="vllm-sha256"))
        for i in range(limits.MAX_WORKERS_PER_DOMAIN)
    ]
    namespace = hot.final_namespace
    for w in fillers:
        router.apply_relayed_worker_event(StoreEvent("stored", namespace, [7], w.name, tier="gpu"))
    indexed = router.stats().indexed_blocks
    seq = iter(range(1_000_000))

    def send(*events):
        sock.send_multipart(frames(batch(*events), seq=next(seq)))

    wait_for(lambda: router.stats().dropped_by.no_room > 0, lambda: send(stored(H)))
    assert router.stats().indexed_blocks == indexed  # nothing of it landed
    router.remove_worker("w0")  # room for one holder again
    wait_for(lambda: router.stats().indexed_blocks == indexed + len(H), lambda: send(stored(H)))


def test_replaced_worker_old_publisher_is_ignored(served, pub):
    router, client, _ = served
    old_sock, old_ep = pub()
    new_sock, new_ep = pub()
    client.register_worker("w", card(kv_events_endpoint=old_ep))
    wait_for(
        lambda: router.stats().indexed_blocks == 2,
        lambda: old_sock.send_multipart(frames(batch(stored(H[:2])))),
    )
    client.register_worker("w", card(kv_events_endpoint=new_ep, source_path="/new"))
    assert router.stats().indexed_blocks == 0  # the old generation's blocks went with it
    for _ in range(20):  # the old process keeps talking: none of it may land
        old_sock.send_multipart(frames(batch(stored([0xDEAD]))))
    wait_for(
        lambda: router.stats().indexed_blocks == 1,
        lambda: new_sock.send_multipart(frames(batch(stored([0xBEEF])))),
    )
    for _ in range(20):
        old_sock.send_multipart(frames(batch(stored([0xDEAD]))))
    time.sleep(0.2)
    masks = [i.masks for i in router.domains.indexes.values()]
    assert all(0xDEAD not in m for m in masks) and any(0xBEEF in m for m in masks)


def test_static_endpoint_flag_feeds_the_named_worker(pub):
    sock, endpoint = pub()
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    args = parser.parse_args(["--zmq-endpoint", f"w={endpoint}"])
    router = Router()
    server = ServerThread(router, feed_specs(args))
    try:
        with RouterClient(server.address) as client:
            client.register_worker("w", card())
            wait_for(
                lambda: router.stats().indexed_blocks == 4,
                lambda: sock.send_multipart(frames(batch(stored(H)), topic=b"kv")),
            )
            assert client.route("llama-8b", hashes=H, track=False).overlap_blocks == 4
    finally:
        server.stop()


def test_a_device_cache_reset_leaves_the_workers_offload_tier(served, pub):
    """vLLM's AllBlocksCleared resets its GPU prefix cache, and a store relays a
    cleared event for the GPU tier: neither touches the blocks the worker's feed
    reports offloaded (medium CPU, tier store). Before, both tiers went (found
    by review)."""
    _, client, _ = served
    sock, endpoint = pub()
    client.register_worker("w", card(hash_format="vllm-sha256", kv_events_endpoint=endpoint))
    seq = iter(range(1, 1_000_000))

    def send(*events):
        sock.send_multipart(frames(batch(*events), seq=next(seq)))

    def tiers() -> tuple[int, int]:
        route = client.route("llama-8b", hashes=H, track=False)
        return route.gpu_blocks, route.store_blocks

    # (from the device, then from its offload tier beyond that)
    wait_for(lambda: tiers() == (2, 2), lambda: send(stored(H, medium="CPU"), stored(H[:2])))
    send(["AllBlocksCleared"])
    settled(lambda: tiers()[0] == 0)
    assert tiers() == (0, 4)
    send(stored(H[:2]))
    settled(lambda: tiers() == (2, 2))
    gen = client.advertise_peer("node-a", "h:1", "", [])
    relayed = StoreEvent("cleared", "tenant.0123456789abcdef", [], "w", tier="gpu")
    client.publish([relayed], node_id="node-a", generation=gen)
    assert tiers() == (0, 4)
