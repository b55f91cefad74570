"""Eviction by bytes: room for a block of one slot size costs about that size.

A slab serves one slot size while it holds any slot, so freeing slots of other
sizes helps only once a whole slab empties. Blocks of another layout sharing the
pool (an MTP and a non-MTP deployment) must not flush each other's caches.
"""

from __future__ import annotations

import random

import pytest

from kvstore.testing.store import make_instance, make_store, run
from kvstore.wire.errors import Code, KVError

SLAB = 8 << 20
POOL = 32 << 20
SMALL = 32 << 10  # slot bytes of the first layout
BATCH = 64


def saved(node, rank, hashes, first_id=0):
    for start in range(0, len(hashes), BATCH):
        batch = hashes[start : start + BATCH]
        refs = [(h, first_id + start + i) for i, h in enumerate(batch)]
        run(node.save(rank.reg.caller_id, refs))


def fill_with_small_blocks(node):
    (small,) = make_instance(
        node.registry, "small", tp_size=1, layers=2, num_blocks=512, block_bytes=SMALL, ns="small"
    )
    ns = node.registry.instances["small"].seal.final_namespace
    hashes = list(range(1, 513))  # 512 blocks of 2 x 32 KiB fill the 32 MiB pool
    saved(node, small, hashes)
    assert node.index.pool_stats().free_bytes == 0
    rng = random.Random(7)
    touched = rng.sample(hashes, 200)  # recency no longer follows slab order
    for h in touched:
        node.release(node.query(ns, [h], lease=True).lease_id)
    return small, ns, hashes, touched[-1]


def test_a_block_of_a_new_size_evicts_one_slab_not_the_cache():
    node = make_store(pool_bytes=POOL, slab_bytes=SLAB)
    small, ns, hashes, newest = fill_with_small_blocks(node)
    (big,) = make_instance(
        node.registry, "big", tp_size=1, layers=1, num_blocks=4, block_bytes=2 * SMALL, ns="big"
    )
    before = node.index.stats().evictions
    run(node.save(big.reg.caller_id, [(9001, 0)]))
    evicted = node.index.stats().evictions - before
    assert evicted * 2 * SMALL <= SLAB + 2 * SMALL, evicted  # one slab, plus one straddler
    left = [h for h in hashes if node.query(ns, [h]).prefix_blocks]
    assert newest in left  # the most recently used block was not in the emptied slab
    # The next small save reuses a small block's slots: one eviction, not a slab.
    before = node.index.stats().evictions
    saved(node, small, [7777], first_id=511)
    assert node.index.stats().evictions - before == 1
    node.index.pool("cpu").check()


def test_alternating_layouts_do_not_thrash():
    node = make_store(pool_bytes=POOL, slab_bytes=SLAB)
    small, _, _, _ = fill_with_small_blocks(node)
    (big,) = make_instance(
        node.registry, "big", tp_size=1, layers=1, num_blocks=64, block_bytes=2 * SMALL, ns="big"
    )
    before = node.index.stats().evictions
    for i in range(32):  # one block of each layout in turn
        run(node.save(big.reg.caller_id, [(50_000 + i, i % 64)]))
        saved(node, small, [60_000 + i], first_id=i % 512)
    evicted = node.index.stats().evictions - before
    # 32 big + 32 small blocks (4 MiB) need at most one slab of room plus the 32 reused.
    assert evicted * 2 * SMALL <= SLAB + 32 * 2 * SMALL + 2 * SMALL, evicted
    node.index.pool("cpu").check()


def test_a_slab_that_a_peer_fetch_also_holds_is_not_emptied_for_nothing():
    """Slab eviction knew only the blocks of the index: a slab that also held a
    reservation for a peer's fetch (detached, out of the index) could never empty,
    yet its blocks were evicted, then the next slab's, and so on, the whole cache.
    Now such a slab is passed over: one slab's blocks go, as for any other."""
    import numpy as np

    from kvstore.store.block import SlotSet
    from kvstore.store.blocks import BlockIndex, Writer
    from kvstore.store.pool import SlotPool

    class Shape:
        def __init__(self, slot: int):
            self.slot_bytes = np.array([slot])
            self.slot_bytes.flags.writeable = False
            self.tp_size = 1

    small, big = Shape(16 << 10), Shape(32 << 10)
    index = BlockIndex({"cpu": SlotPool(128 << 10, "cpu", 64 << 10)})  # 2 slabs of 4 small slots
    w = Writer("w", 0, "cpu")
    for h in range(3):  # slab 0: three sealed blocks, the oldest ...
        index.finish(index.claim("a", [h], small, SlotSet.of([0], small.slot_bytes), w))
    fetching = index.reserve("a", [99], small, ["cpu"])  # ... and a fetch's reserved slot
    for h in range(3, 7):  # slab 1: four newer sealed blocks
        index.finish(index.claim("a", [h], small, SlotSet.of([0], small.slot_bytes), w))
    index.claim(
        "b", [1], big, SlotSet.of([0], big.slot_bytes), w
    )  # a 32 KiB slot: one whole slab must empty
    assert index.stats().evictions == 4  # slab 1's blocks, not slab 0's three as well
    assert index.snapshot() == [("a", 0), ("a", 1), ("a", 2)]
    index.discard(fetching.blocks)
    index.pool("cpu").check()


def offsets_of(node, ns, block_hash):
    return node.index.blocks[(ns, block_hash)].offsets.tolist()


def test_a_save_into_a_full_pool_takes_over_the_evicted_blocks_slots():
    """Steady state of a full cache: the victim's slots go to the new block as they
    lie (one run stays one run), freed to the pool and taken back by no one."""
    node = make_store(pool_bytes=POOL, slab_bytes=SLAB)
    small, ns, _, _ = fill_with_small_blocks(node)
    pool = node.index.pool("cpu")
    lru = [h for _, h in node.index.snapshot()]
    # the three oldest, in an order their addresses do not follow (a pool that
    # freed and took them back would hand them out in address order)
    oldest = sorted(lru[:3], key=lambda h: offsets_of(node, ns, h), reverse=True)
    node.release(node.query(ns, oldest + lru[3:], lease=True).lease_id)
    assert [h for _, h in node.index.snapshot()[:3]] == oldest
    slots = [offsets_of(node, ns, h) for h in oldest]
    saved(node, small, [7001, 7002, 7003], first_id=100)
    assert not any(node.query(ns, [h]).prefix_blocks for h in oldest)
    assert [offsets_of(node, ns, h) for h in (7001, 7002, 7003)] == slots
    assert pool.free_bytes == 0
    pool.check()


def test_a_victims_slots_beyond_what_the_save_needs_go_back_to_the_pool():
    node = make_store(pool_bytes=POOL, slab_bytes=SLAB)
    fill_with_small_blocks(node)  # two 32 KiB slots a block
    (one,) = make_instance(
        node.registry, "one", tp_size=1, layers=1, num_blocks=4, block_bytes=SMALL, ns="one"
    )
    before = node.index.stats().evictions
    run(node.save(one.reg.caller_id, [(8001, 0)]))  # one 32 KiB slot
    assert node.index.stats().evictions - before == 1
    pool = node.index.pool("cpu")
    assert pool.free_bytes == SMALL  # the victim's second slot
    pool.check()


def test_slots_taken_over_go_back_when_the_rest_cannot_be_had():
    """A save that evicts a block, takes its slots, and still cannot get the rest
    (every other block pinned) is refused and keeps nothing: the victim stays
    evicted, its slots are free, the pool's accounts hold."""
    node = make_store(pool_bytes=POOL, slab_bytes=SLAB)
    small, ns, hashes, _ = fill_with_small_blocks(node)
    oldest = node.index.snapshot()[0][1]
    node.query(ns, [h for h in hashes if h != oldest], lease=True, lease_ms=60_000)
    with pytest.raises(KVError) as info:
        saved(node, small, [9001, 9002], first_id=100)
    assert info.value.code == Code.RESOURCE_EXHAUSTED
    assert not node.query(ns, [9001]).prefix_blocks and not node.query(ns, [oldest]).prefix_blocks
    pool = node.index.pool("cpu")
    assert pool.free_bytes == 2 * SMALL
    pool.check()
    saved(node, small, [9003], first_id=100)  # the freed slots serve the next save
    assert node.query(ns, [9003]).prefix_blocks == 1
    pool.check()
