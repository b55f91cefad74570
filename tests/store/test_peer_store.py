"""The store as both ends of a peer transfer: leases hold off eviction,
reservations stay invisible until commit and free everything on abort."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

from kvstore.store.blocks import BlockIndex
from kvstore.store.fetch import StoreSink, StoreSource, slot_table
from kvstore.store.pool import SlotPool
from kvstore.testing.store import make_instance, make_store, run
from kvstore.transfer import PeerUnavailable
from kvstore.wire.errors import Code, KVError
from tests.store.test_store import save_all, used_bytes


def setup(pool_bytes=256 << 10):
    node = make_store(pool_bytes=pool_bytes, slab_bytes=64 << 10)
    ranks = make_instance(node.registry, "a", num_blocks=128)
    seal = node.registry.instances["a"].seal
    return node, ranks, seal


def fill(node, table, value: int) -> None:
    """Write ``value`` into every slot of ``table`` through the pool, by address."""
    pool = node.index.pool("cpu")
    for ptr, n in zip(table.ptr.tolist(), table.nbytes.tolist(), strict=True):
        pool.buffer[ptr - pool.base : ptr - pool.base + n].fill_(value)


def test_lease_keeps_blocks_through_eviction_pressure():
    node, ranks, seal = setup()
    ns = seal.final_namespace
    run(save_all(node, ranks, [(h, h) for h in range(8)]))
    lease = StoreSource(node.index).lease(ns, [0, 1, 2, 99])
    assert lease.hashes == [0, 1, 2]
    assert lease.slots.counts.tolist() == [4, 4, 4]  # 2 layers x 2 ranks
    assert lease.slots.nbytes.tolist() == [1024] * 12
    assert lease.slots.memory.tolist() == [0] * 12  # host memory
    pool = node.index.pool("cpu")
    blocks = node.index.sealed_prefix(ns, [0, 1, 2])
    expect = [pool.base + int(o) for b in blocks for o in b.offsets]
    assert lease.slots.ptr.tolist() == expect
    layouts, block_layout = lease.slots.layouts()
    assert layouts == [[1024] * 4] and block_layout.tolist() == [0, 0, 0]
    # fill the pool far past capacity: only unleased blocks may go
    for start in range(100, 228, 16):
        run(save_all(node, ranks, [(h, h - 100) for h in range(start, start + 16)]))
    assert node.index.stats().evictions > 0
    assert len(node.index.sealed_prefix(ns, [0, 1, 2])) == 3
    lease.release()
    lease.release()  # idempotent
    run(save_all(node, ranks, [(h, h - 300) for h in range(300, 364)]))
    assert len(node.index.sealed_prefix(ns, [0])) == 0


class Shape(NamedTuple):
    slot_bytes: np.ndarray
    tp_size: int = 2


def test_a_slot_table_of_blocks_placed_and_shaped_unalike_is_every_slot_where_it_lies():
    """Blocks of one layout placed alike take the tiled row; any other mix (ranks on
    other pools, another slot count, an equal but not shared slot_bytes) is
    built block by block. Either way every slot is its pool's base + its offset."""
    index = BlockIndex({d: SlotPool(1 << 20, "cpu", 64 << 10) for d in ("a", "b")})
    four, six = Shape(np.full(4, 1024)), Shape(np.full(6, 512))
    made = index.reserve("n", [1, 2, 3], four, ["a", "b"])
    alike = made.blocks
    unalike = [
        *index.reserve("n", [4], four, ["b", "a"]).blocks,
        *index.reserve("n", [5], six, ["a", "b"]).blocks,
        *index.reserve("n", [6], Shape(four.slot_bytes.copy()), ["a", "b"]).blocks,
    ]
    together = slot_table(index, alike, made.offsets)  # their offsets as the one array they share
    assert np.array_equal(together.ptr, slot_table(index, alike).ptr)
    assert all(np.shares_memory(b.offsets, made.offsets) for b in alike)
    for blocks in (alike, alike + unalike[:1], alike + unalike, unalike[::-1]):
        table = slot_table(index, blocks)
        expect = [
            (index.pool(b.devices[s % b.tp_size]).base + int(b.offsets[s]), int(b.slot_bytes[s]))
            for b in blocks
            for s in range(len(b.slot_bytes))
        ]
        assert list(zip(table.ptr.tolist(), table.nbytes.tolist(), strict=True)) == expect
        assert table.counts.tolist() == [len(b.slot_bytes) for b in blocks]
        assert table.memory.tolist() == [0] * len(expect)  # host memory
        assert (table.ptr.dtype, table.nbytes.dtype, table.counts.dtype) == (
            np.uint64,
            np.int64,
            np.int64,
        )
    empty = slot_table(index, [])
    assert len(empty.ptr) == len(empty.counts) == 0


def test_reservation_invisible_until_commit_and_abort_frees():
    node, ranks, seal = setup()
    ns = seal.final_namespace
    sink = StoreSink(node.index, node.registry)
    sizes = [seal.slot_bytes.tolist()] * 3
    res = sink.reserve(ns, [10, 11, 12], sizes)
    assert used_bytes(node) == 3 * 4 * 1024
    assert node.query(ns, [10]).prefix_blocks == 0 and node.index.stats().inflight_blocks == 0
    fill(node, res.slots, 7)
    res.abort()
    assert used_bytes(node) == 0 and node.query(ns, [10]).prefix_blocks == 0
    res = sink.reserve(ns, [10, 11], sizes[:2])
    fill(node, res.slots, 9)
    res.commit()
    assert node.query(ns, [10, 11]).prefix_blocks == 2
    run(node.load(ranks[1].reg.caller_id, [(10, 50)]))
    assert (ranks[1].tensors[0][:, 50] == 9).all()


def test_commit_seals_every_fetched_block_in_one_event():
    """A fetch of many blocks is one STORED event for the namespace (routers and
    subscribers get one message, not one per block); a block saved meanwhile is
    kept and left out of it."""
    events = []
    node = make_store(pool_bytes=256 << 10, slab_bytes=64 << 10, events=events)
    ranks = make_instance(node.registry, "a", num_blocks=128)
    ns = node.registry.instances["a"].seal.final_namespace
    res = StoreSink(node.index, node.registry).reserve_ahead(ns, list(range(20, 36)))
    run(save_all(node, ranks, [(25, 25)]))  # block 25 arrives locally first
    before = len(events)
    res.commit()
    stored = [e for e in events[before:] if e.type == "stored"]
    assert len(stored) == 1 and stored[0].namespace == ns
    assert stored[0].block_hashes == [h for h in range(20, 36) if h != 25]
    assert node.query(ns, list(range(20, 36))).prefix_blocks == 16
    assert used_bytes(node) == 16 * 4 * 1024


def test_commit_keeps_one_copy_when_the_block_arrived_meanwhile():
    node, ranks, seal = setup()
    ns = seal.final_namespace
    sink = StoreSink(node.index, node.registry)
    res = sink.reserve(ns, [5], [seal.slot_bytes.tolist()])
    run(save_all(node, ranks, [(5, 5)]))  # a local save wins the race
    res.commit()
    assert node.index.stats().sealed_blocks == 1
    assert used_bytes(node) == 4 * 1024


def test_reserve_refuses_unknown_namespace_and_wrong_sizes():
    node, _ranks, seal = setup()
    sink = StoreSink(node.index, node.registry)
    with pytest.raises(KVError) as info:
        sink.reserve("other.0123456789abcdef", [1], [[1024] * 4])
    assert info.value.code == Code.FAILED_PRECONDITION
    with pytest.raises(PeerUnavailable) as info:  # the offer's fault: the next peer is asked
        sink.reserve(seal.final_namespace, [1], [[2048] * 4])
    assert info.value.code == Code.UNAVAILABLE and "layout" in info.value.message
    assert used_bytes(node) == 0


def test_a_peer_read_pins_without_making_blocks_recent():
    node, ranks, seal = setup(pool_bytes=64 << 10)  # room for 16 blocks
    ns = seal.final_namespace
    run(save_all(node, ranks, [(h, h) for h in range(16)]))
    source = StoreSource(node.index)
    lease = source.lease(ns, [0])
    lease.release()
    assert source.stats().served_blocks == 1 and node.index.blocks[(ns, 0)].pins == 0
    run(save_all(node, ranks, [(100, 100)]))  # evicts the least recently used block
    assert node.query(ns, [0]).prefix_blocks == 0 and node.query(ns, [1]).prefix_blocks == 1
