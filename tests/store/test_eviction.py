"""Eviction by bytes: room for a block of one slot size costs about that size.

A slab serves one slot size while it holds any slot, so freeing slots of other
sizes helps only once a whole slab empties. Blocks of another layout sharing the
pool (an MTP and a non-MTP deployment) must not flush each other's caches.
"""

from __future__ import annotations

import random

from kvstore.testing.store import make_instance, make_store, run

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
