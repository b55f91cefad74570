"""The store as both ends of a peer transfer: leases hold off eviction,
reservations stay invisible until commit and free everything on abort."""

from __future__ import annotations

import pytest

from kvstore.store.peer_store import StoreSink, StoreSource, local_layout_from
from kvstore.testing.store import make_instance, make_store, run
from kvstore.wire.errors import Code, KVError
from tests.test_store import save_all


def setup(pool_bytes=256 << 10):
    registry, store = make_store(pool_bytes=pool_bytes, slab_bytes=64 << 10)
    ranks = make_instance(registry, "a", num_blocks=128)
    seal = registry.instances["a"].seal
    return registry, store, ranks, seal


def fill(store, table, value: int) -> None:
    """Write ``value`` into every slot of ``table`` through the pool, by address."""
    pool = store.pools["cpu"]
    for ptr, n in zip(table.ptr.tolist(), table.nbytes.tolist(), strict=True):
        pool.buffer[ptr - pool.base : ptr - pool.base + n].fill_(value)


def test_lease_keeps_blocks_through_eviction_pressure():
    registry, store, ranks, seal = setup()
    ns = seal.final_namespace
    run(save_all(store, registry, ranks, [(h, h) for h in range(8)]))
    lease = StoreSource(store).lease(ns, [0, 1, 2, 99])
    assert lease.hashes == [0, 1, 2]
    assert lease.slots.counts.tolist() == [4, 4, 4]  # 2 layers x 2 ranks
    assert lease.slots.nbytes.tolist() == [1024] * 12
    assert lease.slots.memory.tolist() == [0] * 12  # host memory
    pool = store.pools["cpu"]
    blocks = store.sealed_prefix(ns, [0, 1, 2])
    expect = [pool.base + int(o) for b in blocks for o in b.offsets]
    assert lease.slots.ptr.tolist() == expect
    layouts, block_layout = lease.slots.layouts()
    assert layouts == [[1024] * 4] and block_layout.tolist() == [0, 0, 0]
    # fill the pool far past capacity: only unleased blocks may go
    for start in range(100, 228, 16):
        run(save_all(store, registry, ranks, [(h, h - 100) for h in range(start, start + 16)]))
    assert store.counters.evictions > 0
    assert len(store.sealed_prefix(ns, [0, 1, 2])) == 3
    lease.release()
    lease.release()  # idempotent
    run(save_all(store, registry, ranks, [(h, h - 300) for h in range(300, 364)]))
    assert len(store.sealed_prefix(ns, [0])) == 0


def test_reservation_invisible_until_commit_and_abort_frees():
    registry, store, ranks, seal = setup()
    ns = seal.final_namespace
    sink = StoreSink(store, local_layout_from(registry))
    sizes = [seal.slot_bytes.tolist()] * 3
    res = sink.reserve(ns, [10, 11, 12], sizes)
    used = store.pools["cpu"].used_bytes
    assert used == 3 * 4 * 1024
    assert store.query(ns, [10])[0] == 0 and store.inflight_blocks == 0
    fill(store, res.slots, 7)
    res.abort()
    assert store.pools["cpu"].used_bytes == 0 and store.query(ns, [10])[0] == 0
    res = sink.reserve(ns, [10, 11], sizes[:2])
    fill(store, res.slots, 9)
    res.commit()
    assert store.query(ns, [10, 11])[0] == 2
    run(store.load(seal, ranks[1].reg, [(10, 50)]))
    assert (ranks[1].tensors[0][:, 50] == 9).all()


def test_commit_keeps_one_copy_when_the_block_arrived_meanwhile():
    registry, store, ranks, seal = setup()
    ns = seal.final_namespace
    sink = StoreSink(store, local_layout_from(registry))
    res = sink.reserve(ns, [5], [seal.slot_bytes.tolist()])
    run(save_all(store, registry, ranks, [(5, 5)]))  # a local save wins the race
    res.commit()
    assert store.sealed_blocks == 1
    assert store.pools["cpu"].used_bytes == 4 * 1024


def test_reserve_refuses_unknown_namespace_and_wrong_sizes():
    registry, store, ranks, seal = setup()
    sink = StoreSink(store, local_layout_from(registry))
    with pytest.raises(KVError) as info:
        sink.reserve("other.0123456789abcdef", [1], [[1024] * 4])
    assert info.value.code == Code.FAILED_PRECONDITION
    with pytest.raises(KVError) as info:
        sink.reserve(seal.final_namespace, [1], [[2048] * 4])
    assert info.value.code == Code.INVALID_ARGUMENT
    assert store.pools["cpu"].used_bytes == 0
