"""How many blocks the router indexes: a worker's tier, and the whole index.

Before, nothing bounded the prefix index: any admitted tenant's vLLM publisher
(frames of 4 MiB, as many as it likes), a store's PublishEvents or a relay
could grow the router's memory without limit (the review stored 1,048,576
blocks, 112 MiB, in 16 calls; nothing stopped a hundred times that). Now a
worker's tier indexes at most its card's capacity_blocks (the router's
default when the card states none) and all holders together at most the
router's max_held_blocks; a stored block past either is not indexed, counted
(over_capacity / index_full, in blocks) and warned of once per episode.
"""

from __future__ import annotations

import argparse
import logging

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.cli.router import add_router_arguments, build_served_router
from kvstore.client.router_client import RouterClient
from kvstore.router.bounds import DEFAULT_CAPACITY_BLOCKS, DEFAULT_MAX_HELD_BLOCKS, IndexBudget
from kvstore.router.core import Router, RouterConfig
from kvstore.router.holders import HolderIndex
from kvstore.router.vllm_events import BlockEvent
from kvstore.service.metrics import RecordCollector
from kvstore.wire.events import StoreEvent
from tests.router.conftest import ServerThread, card
from tests.router.test_vllm_events import batch, frames, stored, wait_for

NS = "tenant.0123456789abcdef"


def blocks(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def store(router: Router, ref, hashes, tier="gpu") -> None:
    router.apply_worker_events(ref, [BlockEvent("stored", hashes, tier=tier)])


def remove(router: Router, ref, hashes, tier="gpu") -> None:
    router.apply_worker_events(ref, [BlockEvent("removed", hashes, tier=tier)])


def held_of(router: Router, name: str, tier: str = "gpu") -> int:
    worker = router.admission.workers[name]
    return router.domains.fill(worker, tier).held


def warnings(caplog, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and text in r.getMessage()
    ]


def every_entry(router: Router) -> int:
    """Blocks held, summed over every index by a full scan (what the budget counts)."""
    indexes = [*router.domains.indexes.values(), *router.peers.indexes.values()]
    return sum(index.entries() for index in indexes)


def test_the_reviews_flood_stops_at_the_default_capacity():
    """The review's reproduction with the default flags, carried on: 65 calls of
    65,536 blocks index 4,194,304 (the default capacity), and the 65th call's are
    counted."""
    router = Router()
    w = router.register_worker("w", card())
    for i in range(DEFAULT_CAPACITY_BLOCKS // (1 << 16) + 1):
        store(router, w.ref, blocks(i << 16, 1 << 16))
    stats = router.stats()
    assert stats.held_blocks == DEFAULT_CAPACITY_BLOCKS == held_of(router, "w")
    assert stats.dropped_by.over_capacity == 1 << 16
    assert stats.events_dropped == stats.dropped_by.total()


def test_a_worker_is_indexed_up_to_its_cards_capacity_and_warned_of_once(caplog):
    caplog.set_level(logging.INFO, logger="kvstore.router.core")
    router = Router()
    w = router.register_worker("w", card(capacity_blocks=100))
    for i in range(16):
        store(router, w.ref, blocks(i * 64, 64))
    assert held_of(router, "w") == 100
    assert router.stats().dropped_by.over_capacity == 16 * 64 - 100
    lines = warnings(caplog, "over_capacity")
    assert len(lines) == 1, lines  # once, not per event
    assert "'w'" in lines[0] and "capacity_blocks 100" in lines[0]
    assert "removals" in lines[0]
    # the leading blocks it did index still route
    assert router.route("llama-8b", hashes=blocks(0, 64), track=False).overlap_blocks == 64


def test_removing_blocks_makes_room_again_and_a_new_episode_warns_again(caplog):
    caplog.set_level(logging.INFO, logger="kvstore.router.core")
    router = Router()
    w = router.register_worker("w", card(capacity_blocks=100))
    store(router, w.ref, blocks(0, 120))
    dropped = router.stats().dropped_by.over_capacity
    assert dropped == 20
    remove(router, w.ref, blocks(0, 5))
    store(router, w.ref, blocks(1000, 5))  # room for exactly these: nothing dropped
    assert held_of(router, "w") == 100
    assert router.stats().dropped_by.over_capacity == dropped
    # evicted then stored in one batch, as an engine at capacity does
    router.apply_worker_events(
        w.ref, [BlockEvent("removed", blocks(5, 10)), BlockEvent("stored", blocks(2000, 10))]
    )
    assert router.stats().dropped_by.over_capacity == dropped
    assert len(warnings(caplog, "over_capacity")) == 1
    remove(router, w.ref, blocks(15, 50))  # back under 90 %: the episode ends
    store(router, w.ref, [])
    assert any("back within its bound" in r.getMessage() for r in caplog.records)
    store(router, w.ref, blocks(3000, 60))  # 50 + 60 > 100: a new episode
    assert held_of(router, "w") == 100
    assert len(warnings(caplog, "over_capacity")) == 2


def test_the_default_bounds_a_card_that_states_none_and_the_offload_tier():
    router = Router(RouterConfig(default_capacity_blocks=64))
    plain = router.register_worker("plain", card())
    small = router.register_worker("small", card(capacity_blocks=8))
    store(router, plain.ref, blocks(0, 100))
    store(router, small.ref, blocks(0, 100))
    store(router, small.ref, blocks(0, 100), tier="store")  # offload: max(8, 64)
    assert held_of(router, "plain") == 64
    assert held_of(router, "small") == 8
    assert held_of(router, "small", "store") == 64
    assert router.stats().dropped_by.over_capacity == 36 + 92 + 36


def test_a_worker_within_its_capacity_is_unaffected_by_one_that_floods(caplog):
    caplog.set_level(logging.WARNING, logger="kvstore.router.core")
    router = Router()
    flood = router.register_worker("flood", card(capacity_blocks=50))
    calm = router.register_worker("calm", card(capacity_blocks=50))
    for i in range(20):
        store(router, flood.ref, blocks(10_000 + i * 50, 50))
        # calm churns at its capacity: it evicts before it stores
        remove(router, calm.ref, blocks((i - 1) * 50, 50))
        store(router, calm.ref, blocks(i * 50, 50))
        assert held_of(router, "calm") == 50
    assert router.stats().dropped_by.over_capacity == 19 * 50  # flood's only
    assert all("'calm'" not in line for line in warnings(caplog, "over_capacity"))
    r = router.route("llama-8b", hashes=blocks(19 * 50, 50), track=False)
    assert (r.worker.ref.name, r.overlap_blocks) == ("calm", 50)


def test_the_router_wide_bound_holds_across_workers_and_store_peers(caplog):
    caplog.set_level(logging.INFO, logger="kvstore.router.core")
    router = Router(RouterConfig(max_held_blocks=1000))
    refs = [router.register_worker(f"w{i}", card()).ref for i in range(3)]
    for i, ref in enumerate(refs):
        store(router, ref, blocks(i * 10_000, 400))
    router.advertise_peer("node-a", "127.0.0.1:1", "", [NS])
    gen = router.peers.get("node-a").generation
    own = StoreEvent("stored", NS, blocks(0, 50), "node-a")
    result = router.apply_store_events("node-a", gen, [own])
    stats = router.stats()
    assert stats.held_blocks == 1000 == every_entry(router)
    assert stats.dropped_by.index_full == 200 + 50
    assert stats.dropped_by.over_capacity == 0
    assert result.applied == 1  # the event applied; its blocks past the bound are counted
    lines = warnings(caplog, "index_full")
    assert len(lines) == 1 and "--max-held-blocks 1000" in lines[0] and "'w2'" in lines[0]
    router.remove_worker("w0")  # frees 400
    router.apply_store_events("node-a", gen, [StoreEvent("stored", NS, blocks(0, 50), "node-a")])
    assert router.stats().held_blocks == 650 == every_entry(router)
    assert router.stats().dropped_by.index_full == 250
    assert any("router index is back" in r.getMessage() for r in caplog.records)
    assert len(router.query_prefix(NS, blocks(0, 50))) == 1


def test_relayed_events_count_against_the_workers_capacity():
    router = Router()
    w = router.register_worker("w", card(capacity_blocks=10))
    router.advertise_peer("node-a", "127.0.0.1:1", "", [NS])
    gen = router.peers.get("node-a").generation
    relay = StoreEvent("stored", NS, blocks(0, 30), "w", tier="gpu")
    router.apply_store_events("node-a", gen, [relay])
    router.apply_relayed_worker_event(StoreEvent("stored", NS, blocks(100, 5), "w", tier="gpu"))
    assert held_of(router, "w") == 10
    assert router.stats().dropped_by.over_capacity == 20 + 5
    router.apply_store_events("node-a", gen, [], snapshot=True)  # its relays go with it
    assert held_of(router, "w") == 0 == router.stats().held_blocks
    store(router, w.ref, blocks(0, 10))
    assert held_of(router, "w") == 10 and router.stats().dropped_by.over_capacity == 25


def test_a_worker_whose_blocks_are_forgotten_starts_a_new_episode(caplog):
    """A lost batch forgets the worker's blocks, and its overflow episode with
    them: overflowing again is warned of again."""
    caplog.set_level(logging.WARNING, logger="kvstore.router.core")
    router = Router()
    w = router.register_worker("w", card(capacity_blocks=10))
    store(router, w.ref, blocks(0, 20))
    router.vllm_batches_lost(w.ref, 1)
    store(router, w.ref, blocks(100, 20))
    assert held_of(router, "w") == 10
    assert len(warnings(caplog, "over_capacity")) == 2


def test_forgotten_and_removed_holders_give_their_blocks_back_to_the_budget():
    router = Router(RouterConfig(max_held_blocks=100))
    a = router.register_worker("a", card())
    store(router, a.ref, blocks(0, 60), tier="gpu")
    store(router, a.ref, blocks(0, 30), tier="store")
    router.vllm_batches_lost(a.ref, 1)  # its blocks are forgotten
    assert router.stats().held_blocks == 0
    store(router, a.ref, blocks(0, 80))
    router.register_worker("a", card(model_config_checksum="cfg-2"))  # a new generation
    assert router.stats().held_blocks == 0
    router.advertise_peer("node-a", "127.0.0.1:1", "", [NS])
    gen = router.peers.get("node-a").generation
    router.apply_store_events("node-a", gen, [StoreEvent("stored", NS, blocks(0, 70), "node-a")])
    router.remove_peer("node-a")
    assert router.stats().held_blocks == 0 == every_entry(router)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "update", "clear", "release"]),
        st.sampled_from(["a", "b", "c"]),
        st.lists(st.integers(0, 11), max_size=6),
        st.lists(st.booleans(), min_size=6, max_size=6),
    ),
    max_size=40,
)
LIMITS = {"a": 3, "b": 5, "c": 100}
BUDGET = 9


class Reference:
    """Per holder a plain list of what it holds; a new block past its limit or
    the budget is refused, in order."""

    def __init__(self):
        self.held: dict[str, list[int]] = {}

    def total(self) -> int:
        return sum(map(len, self.held.values()))

    def apply(self, holder: str, hashes: list[int], keeps: list[bool]) -> int:
        """Store (keep) or remove each hash in order; return how many were refused."""
        held = self.held.setdefault(holder, [])
        refused = 0
        for h, keep in zip(hashes, keeps, strict=False):
            if not keep:
                if h in held:
                    held.remove(h)
            elif h in held:
                continue
            elif len(held) >= LIMITS[holder] or self.total() >= BUDGET:
                refused += 1
            else:
                held.append(h)
        return refused


def run_op(index: HolderIndex, ref: Reference, op: str, holder: str, hashes, keeps) -> None:
    bit = index.assign(holder, LIMITS[holder])
    if op == "store":
        got = index.store(bit, hashes)
        assert got.over_capacity + got.index_full == ref.apply(holder, hashes, [True] * 6)
    elif op == "remove":
        index.remove(bit, hashes)
        ref.apply(holder, hashes, [False] * 6)
    elif op == "update":
        got = index.update(bit, hashes, keeps[: len(hashes)])
        assert got.over_capacity + got.index_full == ref.apply(holder, hashes, keeps)
    elif op == "clear":
        index.clear(bit)
        ref.held[holder] = []
    else:
        index.release(holder)
        ref.held.pop(holder, None)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_the_index_keeps_both_bounds_like_a_reference(ops):
    """Per holder at most its limit, together at most the budget; a new block past
    either is refused, in order (a removal first makes room)."""
    budget = IndexBudget(BUDGET)
    index = HolderIndex(budget=budget)
    ref = Reference()
    for op, holder, hashes, keeps in ops:
        run_op(index, ref, op, holder, hashes, keeps)
        for name, held in ref.held.items():
            assert index.held(index.bit_of(name)) == len(held) <= LIMITS[name]
        assert budget.used == index.entries() == ref.total() <= BUDGET


def test_a_workers_vllm_feed_over_zmq_is_bounded_and_reported_over_grpc(caplog):
    """A real ZMQ publisher floods a worker whose card says 4 blocks; RouterStats
    over gRPC and the /metrics collector report the drops and the held blocks."""
    caplog.set_level(logging.WARNING, logger="kvstore.router.core")
    router = Router(RouterConfig(max_held_blocks=1000))
    server = ServerThread(router)
    client = RouterClient(server.address)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    endpoint = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        client.register_worker("w", card(capacity_blocks=4, kv_events_endpoint=endpoint))
        seq = iter(range(1, 1_000_000))
        hashes = iter(range(1, 1_000_000))

        def send() -> None:
            batch_hashes = [next(hashes) for _ in range(3)]
            sock.send_multipart(frames(batch(stored(batch_hashes)), seq=next(seq)))

        wait_for(lambda: router.stats().dropped_by.over_capacity >= 8, send)
        stats = client.stats()
        assert stats.held_blocks == 4 and stats.held_blocks_limit == 1000
        assert stats.dropped_by.over_capacity >= 8 and stats.dropped_by.index_full == 0
        assert stats.events_dropped == sum(
            getattr(stats.dropped_by, f.name) for f in stats.dropped_by.DESCRIPTOR.fields
        )
        metrics = {
            m.name: m.samples[0].value
            for m in RecordCollector(lambda: {"router": router.stats()}).collect()
        }
        assert metrics["kvstore_router_held_blocks"] == 4
        assert metrics["kvstore_router_dropped_by_over_capacity"] >= 8
        assert len(warnings(caplog, "over_capacity")) == 1
    finally:
        client.close()
        server.stop()
        sock.close(0)
        ctx.term()


def test_the_bound_flags_reach_the_core():
    p = argparse.ArgumentParser()
    add_router_arguments(p)
    config = build_served_router(p.parse_args([])).router.config
    assert (config.default_capacity_blocks, config.max_held_blocks) == (
        DEFAULT_CAPACITY_BLOCKS,
        DEFAULT_MAX_HELD_BLOCKS,
    )
    args = p.parse_args(["--default-capacity-blocks", "7", "--max-held-blocks", "9"])
    router = build_served_router(args).router
    assert router.stats().held_blocks_limit == 9
    assert router.domains.default_capacity == 7
    for flag in ("--default-capacity-blocks", "--max-held-blocks"):
        with pytest.raises(SystemExit):
            p.parse_args([flag, "0"])
