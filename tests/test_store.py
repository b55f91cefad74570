"""Block store core: inflight -> sealed, dedup, eviction, leases, faults."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.testing.store import make_instance, make_store, run
from kvstore.wire.errors import Code, KVError


def fill(rank, block_id, value):
    for li, t in enumerate(rank.tensors):
        t[:, block_id] = (value * 7 + li * 3 + rank.reg.tp_rank) % 251


async def save_all(store, registry, ranks, refs):
    seal = registry.instances[ranks[0].reg.instance_id].seal
    return [await store.save(seal, r.reg, refs) for r in ranks]


def test_block_invisible_until_every_rank_wrote():
    registry, store = make_store()
    ranks = make_instance(registry, "a")
    seal = registry.instances["a"].seal
    fill(ranks[0], 3, 1)
    run(store.save(seal, ranks[0].reg, [(42, 3)]))
    assert store.query(seal.final_namespace, [42]) == (0, "")
    assert store.inflight_blocks == 1
    run(store.save(seal, ranks[1].reg, [(42, 3)]))
    assert store.query(seal.final_namespace, [42]) == (1, "")
    assert store.sealed_blocks == 1 and store.inflight_blocks == 0


def test_save_then_load_round_trip_into_other_ids():
    registry, store = make_store()
    ranks = make_instance(registry, "a")
    seal = registry.instances["a"].seal
    for b in range(4):
        for r in ranks:
            fill(r, b, b + 10)
    run(save_all(store, registry, ranks, [(100 + b, b) for b in range(4)]))
    before = [r.block(b) for r in ranks for b in range(4)]
    for r in ranks:
        for t in r.tensors:
            t.zero_()
    for r in ranks:
        run(store.load(seal, r.reg, [(100 + b, 8 + b) for b in range(4)]))
    after = [r.block(8 + b) for r in ranks for b in range(4)]
    assert all(torch.equal(x, y) for xs, ys in zip(before, after) for x, y in zip(xs, ys))


def test_bad_saves_change_nothing():
    registry, store = make_store()
    ranks = make_instance(registry, "a")
    seal = registry.instances["a"].seal
    for refs, words in [
        ([(1, 99)], "block_id 99"),
        ([(1, 0), (1, 1)], "appears twice"),
        ([], "blocks is empty"),
    ]:
        with pytest.raises(KVError) as info:
            run(store.save(seal, ranks[0].reg, refs))
        assert info.value.code == Code.INVALID_ARGUMENT
        assert words in info.value.message
    assert store.blocks == {} and store.pools["cpu"].used_bytes == 0


def test_load_of_missing_block_loads_nothing():
    registry, store = make_store()
    ranks = make_instance(registry, "a")
    seal = registry.instances["a"].seal
    fill(ranks[0], 0, 5)
    run(save_all(store, registry, ranks, [(1, 0)]))
    ranks[0].tensors[0][:, 5] = 9
    with pytest.raises(KVError) as info:
        run(store.load(seal, ranks[0].reg, [(1, 5), (2, 6)]))
    assert info.value.code == Code.NOT_FOUND
    assert (ranks[0].tensors[0][:, 5] == 9).all()  # untouched


def test_two_instances_of_one_namespace_keep_one_copy():
    registry, store = make_store()
    a = make_instance(registry, "a")
    b = make_instance(registry, "b")
    seal = registry.instances["a"].seal
    assert seal.final_namespace == registry.instances["b"].seal.final_namespace
    for r in a + b:
        fill(r, 0, 3)

    async def race():
        return await asyncio.gather(*(store.save(seal, r.reg, [(7, 0)]) for r in a + b))

    results = run(race())
    assert sum(x.written for x in results) == 2 and sum(x.skipped for x in results) == 2
    assert store.sealed_blocks == 1
    used = store.pools["cpu"].used_bytes
    assert used == 2 * 2 * 1024  # 2 layers x 2 ranks, one copy


def test_writer_death_drops_its_inflight_blocks():
    registry, store = make_store()
    ranks = make_instance(registry, "a")
    seal = registry.instances["a"].seal
    run(store.save(seal, ranks[0].reg, [(1, 0), (2, 1)]))
    assert store.inflight_blocks == 2
    store.drop_session(ranks[0].reg.session)
    registry.unregister(ranks[0].reg.session)
    assert store.inflight_blocks == 0 and store.pools["cpu"].used_bytes == 0


def test_writer_dying_during_copy_never_seals():
    registry, store = make_store()
    ranks = make_instance(registry, "a")
    seal = registry.instances["a"].seal
    run(store.save(seal, ranks[0].reg, [(1, 0)]))

    async def die_mid_save():
        task = asyncio.create_task(store.save(seal, ranks[1].reg, [(1, 0)]))
        await asyncio.sleep(0)  # the copy thread is running
        store.drop_session(ranks[1].reg.session)
        return await task

    run(die_mid_save())
    assert store.query(seal.final_namespace, [1]) == (0, "")
    assert store.pools["cpu"].used_bytes == 0


def test_lru_evicts_oldest_unpinned_and_respects_leases():
    events = []
    registry, store = make_store(pool_bytes=256 << 10, slab_bytes=64 << 10, events=events)
    ranks = make_instance(registry, "a", num_blocks=128)
    seal = registry.instances["a"].seal
    per_block = 4 * 1024
    capacity = (256 << 10) // per_block  # 64 blocks
    run(save_all(store, registry, ranks, [(h, h) for h in range(capacity)]))
    n, lease = store.query(seal.final_namespace, [0, 1], lease=True)
    assert n == 2
    run(save_all(store, registry, ranks, [(1000, 100)]))
    assert store.counters.evictions == 1
    assert store.query(seal.final_namespace, [0, 1, 2])[0] == 2  # 2 was the oldest unpinned
    assert events[-1].type == "stored" and any(e.type == "removed" for e in events)
    store.release(lease)


def test_everything_pinned_gives_resource_exhausted():
    registry, store = make_store(pool_bytes=64 << 10, slab_bytes=64 << 10)
    ranks = make_instance(registry, "a", num_blocks=32)
    seal = registry.instances["a"].seal
    run(save_all(store, registry, ranks, [(h, h) for h in range(16)]))
    _, lease = store.query(seal.final_namespace, list(range(16)), lease=True)
    with pytest.raises(KVError) as info:
        run(store.save(seal, ranks[0].reg, [(99, 20)]))
    assert info.value.code == Code.RESOURCE_EXHAUSTED
    assert store.sealed_blocks == 16 and store.inflight_blocks == 0
    store.release(lease)
    run(save_all(store, registry, ranks, [(99, 20)]))
    assert store.query(seal.final_namespace, [99])[0] == 1


def test_expired_lease_and_stale_inflight_are_swept():
    registry, store = make_store()
    ranks = make_instance(registry, "a")
    seal = registry.instances["a"].seal
    run(save_all(store, registry, ranks, [(1, 0)]))
    run(store.save(seal, ranks[0].reg, [(2, 1)]))
    _, lease = store.query(seal.final_namespace, [1], lease=True, lease_ms=10)
    store.expire(now=10**9)
    assert lease not in store.leases and store.blocks[(seal.final_namespace, 1)].pins == 0
    assert store.inflight_blocks == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["save", "lease", "release", "load"]),
            st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True),
        ),
        max_size=40,
    )
)
def test_lru_invariants(ops):
    registry, store = make_store(pool_bytes=128 << 10, slab_bytes=32 << 10)
    ranks = make_instance(registry, "a", num_blocks=64)
    seal = registry.instances["a"].seal
    ns = seal.final_namespace
    leases: list[tuple[str, list[int]]] = []
    for op, hashes in ops:
        refs = [(h, h) for h in hashes]
        if op == "save":
            try:
                run(save_all(store, registry, ranks, refs))
            except KVError as err:
                assert err.code == Code.RESOURCE_EXHAUSTED
        elif op == "lease":
            n, lease = store.query(ns, hashes, lease=True)
            if lease:
                leases.append((lease, hashes[:n]))
        elif op == "release" and leases:
            store.release(leases.pop(0)[0])
        elif op == "load":
            n, _ = store.query(ns, hashes)
            if n:
                run(store.load(seal, ranks[0].reg, refs[:n]))
        # invariants
        store.pools["cpu"].check()
        for _lease, held in leases:
            for h in held:
                assert store.blocks[(ns, h)].sealed, "a leased block was evicted"
        assert set(store.lru) == {k for k, b in store.blocks.items() if b.sealed}
        assert all(b.pins >= 0 for b in store.blocks.values())
        used = sum(b.nbytes for b in store.blocks.values() if b.sealed)
        assert store.pools["cpu"].used_bytes == used + sum(
            int(b.slot_bytes[b.offsets >= 0].sum()) for b in store.blocks.values() if not b.sealed
        )


def test_cancelled_save_waits_for_its_copy_then_frees_everything():
    registry, store = make_store()
    ranks = make_instance(registry, "a")
    seal = registry.instances["a"].seal

    async def cancel_mid_copy():
        task = asyncio.create_task(store.save(seal, ranks[0].reg, [(1, 0), (2, 1)]))
        await asyncio.sleep(0)  # prepared; the copy thread is running
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(cancel_mid_copy())
    assert store.inflight_blocks == 0 and store.pools["cpu"].used_bytes == 0
    store.pools["cpu"].check()


def test_departed_rank_memory_stays_mapped_until_its_copy_ends():
    registry, store = make_store()
    ranks = make_instance(registry, "a")
    reg = ranks[0].reg
    closed = []

    class Region:
        def close(self):
            closed.append(True)

    reg.mapped = [Region()]
    reg.hold()
    registry.unregister(reg.session)
    assert closed == []  # a copy still holds it
    reg.unhold()
    assert closed == [True]
