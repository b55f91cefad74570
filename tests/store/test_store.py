"""A store node's core: inflight -> sealed, dedup, eviction, leases, faults."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.store.node import QueryResult
from kvstore.testing.store import make_instance, make_store, run
from kvstore.wire.errors import Code, KVError
from kvstore.wire.principal import LOCAL


def fill(rank, block_id, value):
    for li, t in enumerate(rank.tensors):
        t[:, block_id] = (value * 7 + li * 3 + rank.reg.tp_rank) % 251


async def save_all(node, ranks, refs):
    return [await node.save(r.reg.caller_id, refs) for r in ranks]


def used_bytes(node) -> int:
    return node.index.pool_stats().used_bytes


def test_block_invisible_until_every_rank_wrote():
    node = make_store()
    ranks = make_instance(node.registry, "a")
    seal = node.registry.instances["a"].seal
    fill(ranks[0], 3, 1)
    run(node.save(ranks[0].reg.caller_id, [(42, 3)]))
    assert node.query(seal.final_namespace, [42]) == QueryResult(0)
    assert node.index.stats().inflight_blocks == 1
    run(node.save(ranks[1].reg.caller_id, [(42, 3)]))
    assert node.query(seal.final_namespace, [42]) == QueryResult(1)
    assert node.index.stats().sealed_blocks == 1 and node.index.stats().inflight_blocks == 0


def test_save_then_load_round_trip_into_other_ids():
    node = make_store()
    ranks = make_instance(node.registry, "a")
    for b in range(4):
        for r in ranks:
            fill(r, b, b + 10)
    run(save_all(node, ranks, [(100 + b, b) for b in range(4)]))
    before = [r.block(b) for r in ranks for b in range(4)]
    for r in ranks:
        for t in r.tensors:
            t.zero_()
    for r in ranks:
        run(node.load(r.reg.caller_id, [(100 + b, 8 + b) for b in range(4)]))
    after = [r.block(8 + b) for r in ranks for b in range(4)]
    assert all(torch.equal(x, y) for xs, ys in zip(before, after) for x, y in zip(xs, ys))


def test_bad_saves_change_nothing():
    node = make_store()
    ranks = make_instance(node.registry, "a")
    for refs, words in [
        ([(1, 99)], "block_id 99"),
        ([(1, 0), (1, 1)], "appears twice"),
        ([], "block_hashes is empty"),
    ]:
        with pytest.raises(KVError) as info:
            run(node.save(ranks[0].reg.caller_id, refs))
        assert info.value.code == Code.INVALID_ARGUMENT
        assert words in info.value.message
    assert node.index.blocks == {} and used_bytes(node) == 0


def test_bad_loads_change_nothing():
    node = make_store()
    ranks = make_instance(node.registry, "a")
    fill(ranks[0], 0, 5)
    run(save_all(node, ranks, [(1, 0), (2, 1)]))
    ranks[0].tensors[0][:, 5:7] = 9
    for refs, words in [
        ([(1, 5), (2, 99)], "block_id 99"),
        ([(1, 5), (1, 6)], "appears twice"),
        ([(1, 5), (2, 5)], "block_id 5 is the target of two blocks"),
    ]:
        with pytest.raises(KVError) as info:
            run(node.load(ranks[0].reg.caller_id, refs))
        assert info.value.code == Code.INVALID_ARGUMENT
        assert words in info.value.message
    assert (ranks[0].tensors[0][:, 5:7] == 9).all()  # untouched


def test_load_of_missing_block_loads_nothing():
    node = make_store()
    ranks = make_instance(node.registry, "a")
    fill(ranks[0], 0, 5)
    run(save_all(node, ranks, [(1, 0)]))
    ranks[0].tensors[0][:, 5] = 9
    with pytest.raises(KVError) as info:
        run(node.load(ranks[0].reg.caller_id, [(1, 5), (2, 6)]))
    assert info.value.code == Code.NOT_FOUND
    assert (ranks[0].tensors[0][:, 5] == 9).all()  # untouched


def test_two_instances_of_one_namespace_keep_one_copy():
    node = make_store()
    a = make_instance(node.registry, "a")
    b = make_instance(node.registry, "b")
    seal = node.registry.instances["a"].seal
    assert seal.final_namespace == node.registry.instances["b"].seal.final_namespace
    for r in a + b:
        fill(r, 0, 3)

    async def race():
        return await asyncio.gather(*(node.save(r.reg.caller_id, [(7, 0)]) for r in a + b))

    results = run(race())
    assert sum(x.written for x in results) == 2 and sum(x.skipped for x in results) == 2
    assert node.index.stats().sealed_blocks == 1
    used = used_bytes(node)
    assert used == 2 * 2 * 1024  # 2 layers x 2 ranks, one copy


def test_writer_death_drops_its_inflight_blocks():
    node = make_store()
    ranks = make_instance(node.registry, "a")
    run(node.save(ranks[0].reg.caller_id, [(1, 0), (2, 1)]))
    assert node.index.stats().inflight_blocks == 2
    node.leave(ranks[0].reg.session)
    assert node.index.stats().inflight_blocks == 0 and used_bytes(node) == 0


@pytest.fixture
def threaded_copies(monkeypatch):
    """Every copy in a worker thread, however small (else a small host copy runs
    on the loop, and nothing can happen while it runs)."""
    monkeypatch.setattr("kvstore.store.copying.INLINE_MAX_BYTES", 0)


def test_small_host_copy_runs_on_the_loop_and_seals_before_anything_else_runs():
    node = make_store()
    ranks = make_instance(node.registry, "a", tp_size=1)
    seal = node.registry.instances["a"].seal

    async def save_then_look():
        task = asyncio.create_task(node.save(ranks[0].reg.caller_id, [(1, 0), (2, 1)]))
        await asyncio.sleep(0)  # one step of the task: no thread hop, so it is done
        assert task.done()
        assert node.query(seal.final_namespace, [1, 2]) == QueryResult(2)
        return task.result()

    assert run(save_then_look()).sealed == 2


def test_writer_dying_during_copy_never_seals(threaded_copies):
    node = make_store()
    ranks = make_instance(node.registry, "a")
    seal = node.registry.instances["a"].seal
    run(node.save(ranks[0].reg.caller_id, [(1, 0)]))

    async def die_mid_save():
        task = asyncio.create_task(node.save(ranks[1].reg.caller_id, [(1, 0)]))
        await asyncio.sleep(0)  # the copy thread is running
        node.leave(ranks[1].reg.session)
        return await task

    run(die_mid_save())
    assert node.query(seal.final_namespace, [1]) == QueryResult(0)
    assert used_bytes(node) == 0


def test_lru_evicts_oldest_unpinned_and_respects_leases():
    events = []
    node = make_store(pool_bytes=256 << 10, slab_bytes=64 << 10, events=events)
    ranks = make_instance(node.registry, "a", num_blocks=128)
    seal = node.registry.instances["a"].seal
    per_block = 4 * 1024
    capacity = (256 << 10) // per_block  # 64 blocks
    run(save_all(node, ranks, [(h, h) for h in range(capacity)]))
    hit = node.query(seal.final_namespace, [0, 1], lease=True)
    assert hit.prefix_blocks == 2
    run(save_all(node, ranks, [(1000, 100)]))
    assert node.index.stats().evictions == 1
    assert (
        node.query(seal.final_namespace, [0, 1, 2]).prefix_blocks == 2
    )  # 2 was the oldest unpinned
    assert events[-1].type == "stored" and any(e.type == "removed" for e in events)
    node.release(hit.lease_id)


def test_everything_pinned_gives_resource_exhausted():
    node = make_store(pool_bytes=64 << 10, slab_bytes=64 << 10)
    ranks = make_instance(node.registry, "a", num_blocks=32)
    seal = node.registry.instances["a"].seal
    run(save_all(node, ranks, [(h, h) for h in range(16)]))
    lease = node.query(seal.final_namespace, list(range(16)), lease=True).lease_id
    with pytest.raises(KVError) as info:
        run(node.save(ranks[0].reg.caller_id, [(99, 20)]))
    assert info.value.code == Code.RESOURCE_EXHAUSTED
    assert node.index.stats().sealed_blocks == 16 and node.index.stats().inflight_blocks == 0
    node.release(lease)
    run(save_all(node, ranks, [(99, 20)]))
    assert node.query(seal.final_namespace, [99]).prefix_blocks == 1


@pytest.mark.parametrize("first", [0, 1], ids=["rank0-first", "rank1-first"])
def test_ranks_slots_seal_together_only_when_written_in_one_step(first):
    """Step 1: rank 1's load failed, so it saves nothing; rank 0 saves its slots,
    computed on rank 1's stale KV. Before: at a later step rank 0 was skipped
    (it had written the block) and rank 1's bytes sealed the block beside rank
    0's stale ones. Now a write of another step replaces the inflight block:
    it seals with both ranks' bytes of step 2."""
    node = make_store()
    ranks = make_instance(node.registry, "a")
    ns = node.registry.instances["a"].seal.final_namespace
    fill(ranks[0], 0, 66)  # stale
    run(node.save(ranks[0].reg.caller_id, [(7, 0)], 1))
    assert node.index.stats().inflight_blocks == 1
    for r in ranks:
        fill(r, 0, 5)  # right
    order = [ranks[first], ranks[1 - first]]
    run(node.save(order[0].reg.caller_id, [(7, 0)], 2))
    assert node.query(ns, [7]).prefix_blocks == 0  # not sealed beside step 1's slots
    run(node.save(order[1].reg.caller_id, [(7, 0)], 2))
    assert node.query(ns, [7]).prefix_blocks == 1
    want = [r.block(0) for r in ranks]
    for r in ranks:
        run(node.load(r.reg.caller_id, [(7, 9)]))
    assert all(torch.equal(x, y) for r, w in zip(ranks, want) for x, y in zip(r.block(9), w))
    stats = node.index.stats()
    assert (stats.sealed_blocks, stats.inflight_blocks) == (1, 0)
    assert used_bytes(node) == 2 * 2 * 1024  # one block: 2 ranks x 2 layers of 1 KiB


def test_steps_of_two_instances_sharing_a_namespace_say_nothing_of_each_other():
    """Two engines of one model (one final namespace) count steps apart. Saves
    interleaved X0(7), Y0(3), X1(7), Y1(3) must seal the block (each dropping
    the other's would keep it inflight for good); and X0's stale slots of its
    step 5 must not seal beside Y1's of Y's step 5."""
    node = make_store()
    xs, ys = make_instance(node.registry, "x"), make_instance(node.registry, "y")
    ns = node.registry.instances["x"].seal.final_namespace
    assert ns == node.registry.instances["y"].seal.final_namespace
    for r in [*xs, *ys]:
        fill(r, 0, 5)
    for rank, step in [(xs[0], 7), (ys[0], 3), (xs[1], 7), (ys[1], 3)]:
        run(node.save(rank.reg.caller_id, [(1, 0)], step))
    assert node.query(ns, [1]).prefix_blocks == 1
    run(node.save(xs[0].reg.caller_id, [(2, 0)], 5))  # x1's load failed in step 5
    for rank in (ys[1], ys[0]):
        run(node.save(rank.reg.caller_id, [(2, 0)], 5))  # y's step 5: left to x
    assert node.query(ns, [2]).prefix_blocks == 0
    assert node.index.stats().inflight_blocks == 1


def test_a_stale_block_of_the_writers_step_frees_its_slots_for_the_next():
    """The stale blocks of step 1 (their other rank never wrote) give their slots
    to step 2's claim of them: no sealed block is evicted for it."""
    node = make_store(pool_bytes=64 << 10, slab_bytes=64 << 10)  # 64 slots of 1 KiB
    ranks = make_instance(node.registry, "a", num_blocks=32)
    ns = node.registry.instances["a"].seal.final_namespace
    run(save_all(node, ranks, [(200 + b, b) for b in range(8)]))  # 32 slots, sealed
    refs = [(100 + b, 8 + b) for b in range(12)]
    run(node.save(ranks[0].reg.caller_id, refs, 1))  # 24 slots: 8 left
    run(node.save(ranks[0].reg.caller_id, refs, 2))  # needs 24: the stale ones'
    assert node.index.stats().evictions == 0
    run(node.save(ranks[1].reg.caller_id, refs, 2))
    assert node.query(ns, [h for h, _ in refs]).prefix_blocks == 12


def test_a_save_larger_than_the_pool_is_refused_before_anything_is_evicted():
    """Before: a Save the pool could not hold even empty evicted every unpinned
    block, then failed anyway (a long prompt flushed the whole cache and stored
    nothing). Now it is RESOURCE_EXHAUSTED up front and the cache is as it was."""
    node = make_store(pool_bytes=256 << 10, slab_bytes=64 << 10)  # 256 slots of 1 KiB
    ranks = make_instance(node.registry, "a", num_blocks=512)
    ns = node.registry.instances["a"].seal.final_namespace
    run(save_all(node, ranks, [(h, h) for h in range(16)]))
    used = used_bytes(node)
    with pytest.raises(KVError) as info:  # 300 blocks x 2 layers of one rank: 600 slots
        run(node.save(ranks[0].reg.caller_id, [(1000 + h, h) for h in range(300)]))
    assert info.value.code == Code.RESOURCE_EXHAUSTED
    assert "300 blocks" in info.value.message and "--pool-size" in info.value.message
    stats = node.index.stats()
    assert (stats.sealed_blocks, stats.inflight_blocks, stats.evictions) == (16, 0, 0)
    assert used_bytes(node) == used and node.query(ns, list(range(16))).prefix_blocks == 16
    run(node.save(ranks[0].reg.caller_id, [(1000 + h, h) for h in range(100)]))  # it fits
    assert node.index.stats().inflight_blocks == 100


def test_a_save_of_new_and_inflight_blocks_seals_each_once_every_rank_wrote():
    """Rank 1's save mixes blocks rank 0 claimed (inflight) with new ones: each
    seals once both ranks wrote it, with each rank's bytes. Such a mixed claim
    that the pool cannot hold changes nothing: neither the inflight blocks nor
    the pool."""
    node = make_store(pool_bytes=64 << 10, slab_bytes=64 << 10)  # 64 slots of 1 KiB
    ranks = make_instance(node.registry, "a", num_blocks=32)
    ns = node.registry.instances["a"].seal.final_namespace
    for r in ranks:
        for b in range(5):
            fill(r, b, b + 1)
    run(node.save(ranks[0].reg.caller_id, [(11, 1), (13, 3)]))
    done = run(node.save(ranks[1].reg.caller_id, [(10 + b, b) for b in range(5)]))
    assert (done.written, done.sealed) == (5, 2)
    assert node.query(ns, [11]).prefix_blocks == 1 and node.query(ns, [10]).prefix_blocks == 0
    run(node.save(ranks[0].reg.caller_id, [(10, 0), (12, 2), (14, 4)]))
    assert node.query(ns, [10 + b for b in range(5)]).prefix_blocks == 5
    for r in ranks:
        run(node.load(r.reg.caller_id, [(10 + b, 20 + b) for b in range(5)]))
        assert all(torch.equal(x, y) for b in range(5) for x, y in zip(r.block(b), r.block(20 + b)))

    lease = node.query(ns, [10 + b for b in range(5)], lease=True).lease_id  # nothing evictable
    run(node.save(ranks[0].reg.caller_id, [(20, 5), (21, 6), (22, 7)]))
    inflight = [node.index.blocks[(ns, h)] for h in (20, 21, 22)]
    before = [(b.claimed, b.devices, b.writers, b.offsets.tolist()) for b in inflight]
    used = used_bytes(node)
    too_many = [(20, 5), (21, 6), (22, 7)] + [
        (30 + i, 8 + i) for i in range(24)
    ]  # 54 slots, 38 free
    with pytest.raises(KVError) as info:
        run(node.save(ranks[1].reg.caller_id, too_many))
    assert info.value.code == Code.RESOURCE_EXHAUSTED
    assert [(b.claimed, b.devices, b.writers, b.offsets.tolist()) for b in inflight] == before
    assert used_bytes(node) == used and node.index.stats().inflight_blocks == 3
    assert (ns, 30) not in node.index.blocks
    node.release(lease)
    node.index.pool("cpu").check()


def test_expired_lease_and_stale_inflight_are_swept():
    node = make_store()
    ranks = make_instance(node.registry, "a")
    seal = node.registry.instances["a"].seal
    run(save_all(node, ranks, [(1, 0)]))
    run(node.save(ranks[0].reg.caller_id, [(2, 1)]))
    lease = node.query(seal.final_namespace, [1], lease=True, lease_ms=10).lease_id
    node.index.expire(now=10**9)
    assert lease and node.index.stats().leases == 0
    assert node.index.blocks[(seal.final_namespace, 1)].pins == 0
    assert node.index.stats().inflight_blocks == 0


def test_a_lease_past_its_expiry_is_not_found_before_it_is_swept():
    """The sweep runs every second; before, a Release in between found the expired
    lease, answered its block count and only then unpinned it."""
    node = make_store()
    ranks = make_instance(node.registry, "a")
    ns = node.registry.instances["a"].seal.final_namespace
    run(save_all(node, ranks, [(1, 0)]))
    lease = node.query(ns, [1], lease=True, lease_ms=1).lease_id
    expires = time.monotonic() + 0.001
    while time.monotonic() <= expires:  # past its expiry; no sweep ran
        time.sleep(0.001)
    with pytest.raises(KVError) as info:
        node.release(lease)
    assert info.value.code == Code.NOT_FOUND and "unknown or expired" in info.value.message
    assert node.index.stats().leases == 0 and node.index.stats().pinned_blocks == 0
    assert node.index.leases_of(LOCAL.name) == 0 and node.clear(ns) == 1


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
    node = make_store(pool_bytes=128 << 10, slab_bytes=32 << 10)
    ranks = make_instance(node.registry, "a", num_blocks=64)
    seal = node.registry.instances["a"].seal
    ns = seal.final_namespace
    leases: list[tuple[str, list[int]]] = []
    for op, hashes in ops:
        refs = [(h, h) for h in hashes]
        if op == "save":
            try:
                run(save_all(node, ranks, refs))
            except KVError as err:
                assert err.code == Code.RESOURCE_EXHAUSTED
        elif op == "lease":
            hit = node.query(ns, hashes, lease=True)
            if hit.lease_id:
                leases.append((hit.lease_id, hashes[: hit.prefix_blocks]))
        elif op == "release" and leases:
            node.release(leases.pop(0)[0])
        elif op == "load":
            n = node.query(ns, hashes).prefix_blocks
            if n:
                run(node.load(ranks[0].reg.caller_id, refs[:n]))
        # invariants
        node.index.pool("cpu").check()
        for _lease, held in leases:
            for h in held:
                assert node.index.blocks[(ns, h)].sealed, "a leased block was evicted"
        assert set(node.index.snapshot()) == {k for k, b in node.index.blocks.items() if b.sealed}
        assert all(b.pins >= 0 for b in node.index.blocks.values())
        pinned = sum(1 for b in node.index.blocks.values() if b.pins)
        assert node.index.stats().pinned_blocks == pinned  # kept as pins change
        assert node.index.leases_of("") == node.index.stats().leases  # LOCAL's, by id
        used = sum(b.nbytes for b in node.index.blocks.values() if b.sealed)
        assert used_bytes(node) == used + sum(
            int(b.slot_bytes[b.offsets >= 0].sum())
            for b in node.index.blocks.values()
            if not b.sealed
        )


def test_cancelled_save_waits_for_its_copy_then_frees_everything(threaded_copies):
    node = make_store()
    ranks = make_instance(node.registry, "a")

    async def cancel_mid_copy():
        task = asyncio.create_task(node.save(ranks[0].reg.caller_id, [(1, 0), (2, 1)]))
        await asyncio.sleep(0)  # prepared; the copy thread is running
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(cancel_mid_copy())
    assert node.index.stats().inflight_blocks == 0 and used_bytes(node) == 0
    node.index.pool("cpu").check()


def test_a_save_whose_rank_left_while_it_copied_counts_no_bytes(threaded_copies):
    node = make_store()
    ranks = make_instance(node.registry, "a", tp_size=1)
    reg = ranks[0].reg

    async def leave_mid_copy():
        task = asyncio.create_task(node.save(reg.caller_id, [(1, 0), (2, 1)]))
        await asyncio.sleep(0)  # claimed; the copy thread is running
        node.leave(reg.session)  # its inflight blocks are dropped under the copy
        return await task

    saved = run(leave_mid_copy())
    assert (saved.written, saved.sealed, saved.bytes) == (0, 0, 0)
    assert node.stats().requests.bytes_saved == 0 and used_bytes(node) == 0


def test_departed_rank_memory_stays_mapped_until_its_copy_ends():
    node = make_store()
    ranks = make_instance(node.registry, "a")
    reg = ranks[0].reg
    closed = []

    class Region:
        def close(self):
            closed.append(True)

    reg.mapped = [Region()]
    reg.hold()
    node.registry.unregister(reg.session)
    assert closed == []  # a copy still holds it
    reg.unhold()
    assert closed == [True]


def test_clear_keeps_pinned_blocks_and_refuses_an_overlong_namespace():
    events = []
    node = make_store(events=events)
    ranks = make_instance(node.registry, "a")
    ns = node.registry.instances["a"].seal.final_namespace
    run(save_all(node, ranks, [(1, 0), (2, 1), (3, 2)]))
    lease = node.query(ns, [1], lease=True).lease_id
    with pytest.raises(KVError) as info:
        node.clear("n" * 200)
    assert info.value.code == Code.INVALID_ARGUMENT and "too long" in info.value.message
    assert node.clear(ns) == 2
    # a follower of the events forgets the namespace, then learns the block that stayed
    assert [(e.type, e.namespace, e.block_hashes) for e in events[-2:]] == [
        ("cleared", ns, []),
        ("stored", ns, [1]),
    ]
    assert node.query(ns, [1, 2]).prefix_blocks == 1  # the leased block stayed
    node.release(lease)
    assert node.clear("") == 1 and used_bytes(node) == 0
    assert events[-1].type == "cleared" and events[-1].namespace == ns  # nothing stayed


def test_an_event_carries_at_most_what_the_wire_allows(monkeypatch):
    """A Clear's stored event names every pinned block that stays: past
    MAX_HASHES_PER_EVENT a subscriber could not decode it (found by review), so
    the index cuts events there, as it does a large Save's or eviction's."""
    monkeypatch.setattr("kvstore.store.blocks.MAX_HASHES_PER_EVENT", 2)
    events = []
    node = make_store(events=events)
    ranks = make_instance(node.registry, "a")
    ns = node.registry.instances["a"].seal.final_namespace
    run(save_all(node, ranks, [(h, h - 1) for h in range(1, 6)]))
    assert [e.block_hashes for e in events if e.type == "stored"] == [[1, 2], [3, 4], [5]]
    node.query(ns, [1, 2, 3], lease=True)
    del events[:]
    assert node.clear(ns) == 2
    assert [(e.type, e.block_hashes) for e in events] == [
        ("cleared", []),
        ("stored", [1, 2]),
        ("stored", [3]),
    ]


def test_stats_gather_every_parts_own_record():
    node = make_store()
    ranks = make_instance(node.registry, "a")
    ns = node.registry.instances["a"].seal.final_namespace
    run(save_all(node, ranks, [(1, 0), (2, 1)]))
    node.query(ns, [1, 2, 3], lease=True)
    stats = node.stats()
    assert stats.devices == ("cpu",)
    assert (stats.registry.instances, stats.registry.sealed_instances) == (1, 1)
    assert (stats.index.sealed_blocks, stats.index.inflight_blocks, stats.index.leases) == (2, 0, 1)
    assert (stats.requests.hits, stats.requests.misses) == (2, 1)
    assert stats.requests.bytes_saved == stats.pool.used_bytes == 2 * 4 * 1024
    assert stats.fetcher.fetched_blocks == stats.source.served_blocks == 0


@pytest.mark.parametrize("namespace", ["a", "a.", "a.0123", "a.0123456789ABCDEF", " ", "x" * 300])
def test_a_namespace_that_is_not_final_is_refused_not_answered_empty(namespace):
    """Query, Clear and Prefetch of a client namespace (or any non-final name)
    once answered 0 blocks / cleared 0 as if it were merely empty."""
    node = make_store()
    ranks = make_instance(node.registry, "a")
    run(save_all(node, ranks, [(1, 0)]))
    calls = [
        lambda: node.query(namespace, [1], lease=True),
        lambda: node.clear(namespace),
        lambda: run(node.prefetch(namespace, [1])),
    ]
    for fn in calls:
        with pytest.raises(KVError) as info:
            fn()
        assert info.value.code == Code.INVALID_ARGUMENT and "namespace" in info.value.message
    stats = node.stats()
    assert (stats.index.sealed_blocks, stats.index.leases, stats.requests.misses) == (1, 0, 0)


def test_a_dropped_block_keeps_the_slots_a_copy_still_writes_until_it_ends():
    """Rank 0's writer left while rank 1's copy into the same block still ran: the
    block was dropped with every slot, rank 1's among them, and the next save got
    that slot, so the late bytes would land in another (sealed) block. Now a
    dropped block's slots wait for the copies into it (finish or abandon)."""
    import numpy as np

    from kvstore.store.block import SlotSet
    from kvstore.store.blocks import BlockIndex, Writer
    from kvstore.store.pool import SlotPool

    class Shape:
        slot_bytes = np.array([4096, 4096])
        tp_size = 2

    for end in ("finish", "abandon"):
        index = BlockIndex({"cpu": SlotPool(1 << 20, "cpu", 64 << 10)})
        a, b = Writer("A", 0, "cpu"), Writer("B", 1, "cpu")
        index.finish(
            index.claim("ns", [1], Shape, SlotSet.of([0], Shape.slot_bytes), a)
        )  # rank 0's bytes are in
        running = index.claim(
            "ns", [1], Shape, SlotSet.of([1], Shape.slot_bytes), b
        )  # rank 1's copy runs ...
        in_flight = int(running.blocks[0].offsets[1])
        assert index.drop_writer("A") == 1  # ... when rank 0's session ends
        other = index.claim(
            "ns", [2], Shape, SlotSet.of([0, 1], Shape.slot_bytes), Writer("C", 0, "cpu")
        )
        assert in_flight not in other.blocks[0].offsets.tolist()
        assert index.pool_stats().used_bytes == 4 * 4096  # block 1's two slots still held
        getattr(index, end)(running)  # the copy ended: now they are free
        assert index.pool_stats().used_bytes == 2 * 4096
        assert index.stats().sealed_blocks == 0 and index.stats().inflight_blocks == 1
        index.pool("cpu").check()


def test_a_layer_whose_slot_outgrows_a_slab_is_refused_at_registration():
    """Before: it registered and sealed, and then every Save failed with
    RESOURCE_EXHAUSTED blaming loads and leases."""
    from kvstore.testing.store import make_rank

    node = make_store(pool_bytes=1 << 20, slab_bytes=64 << 10)
    big = make_rank("big", 0, 1, layers=2, block_bytes=128 << 10)
    with pytest.raises(KVError) as info:
        node.register(big.reg)
    assert info.value.code == Code.INVALID_ARGUMENT
    assert "bytes_per_block 131072" in info.value.message and "65536" in info.value.message
    assert node.registry.get("big") is None
    node.register(make_rank("fits", 0, 1, layers=2, block_bytes=64 << 10).reg)


def test_ranks_of_one_tp_rank_register_memory_on_one_device():
    """Ranks sharing a tp_rank (pipeline stages) on two devices corrupted the slot
    bookkeeping (a block holds one device a tp_rank): refused, nothing recorded."""
    from kvstore.testing.store import make_rank

    node = make_store()
    first, second = make_rank("pp", 0, 1, layers=1), make_rank("pp", 0, 1, layers=1)
    second.reg.rank = 1  # the second stage: tp_rank 0 as well, its own layer
    first.reg.world_size = second.reg.world_size = 2
    layer = second.reg.layers[0]
    layer.geometry = dataclasses.replace(layer.geometry, name="l9")
    second.reg.regions = {"l9": second.reg.regions["l0"]}
    second.reg.device = "cuda:1"
    node.registry.register(first.reg)
    with pytest.raises(KVError) as info:
        node.registry.register(second.reg)
    assert info.value.code == Code.INVALID_ARGUMENT and "device" in info.value.message
    assert list(node.registry.instances["pp"].ranks) == [0]
    assert second.reg.session not in node.registry.sessions


def pipeline_stage(instance: str, rank: int, device: str):
    """Rank ``rank`` of a 2-stage pipeline (tp_size 1): tp_rank 0, layer ``l<rank>``."""
    from kvstore.testing.store import make_rank

    stage = make_rank(instance, 0, 1, layers=1)
    stage.reg.rank, stage.reg.world_size = rank, 2
    layer = stage.reg.layers[0]
    layer.geometry = dataclasses.replace(layer.geometry, name=f"l{rank}")
    stage.reg.regions = {f"l{rank}": stage.reg.regions["l0"]}
    stage.reg.device = device
    return stage


def test_instances_whose_stages_share_a_tp_rank_on_two_devices_never_mix_one_block():
    """Instances a (host) and b (a second pool) of one model, both pipelined, so
    two ranks each write tp_rank 0. b's stage joining the block a's stage began
    moved the block's tp_rank 0 to b's device while a's slot lay in the host
    pool: loads read the wrong pool, and freeing it raised 'double free' with
    its slots leaked. b's stage now leaves that block to a."""
    from kvstore.copy import copier_for
    from kvstore.store.blocks import BlockIndex
    from kvstore.store.node import StoreNode
    from kvstore.store.pool import SlotPool
    from kvstore.store.registry import Registry

    pools = {
        "cpu": SlotPool(1 << 20, "cpu", 64 << 10),
        "cuda:1": SlotPool(1 << 20, "cpu", 64 << 10),
    }
    pools["cuda:1"].device = "cuda:1"  # a second pool, host memory under another name
    copier = copier_for("cpu")
    node = StoreNode(Registry(), BlockIndex(pools), {"cpu": copier, "cuda:1": copier})
    a = [pipeline_stage("a", r, "cpu") for r in (0, 1)]
    b = [pipeline_stage("b", r, "cuda:1") for r in (0, 1)]
    for stage in [*a, *b]:
        node.register(stage.reg)
        fill(stage, 0, 3)
    ns = node.registry.instances["a"].seal.final_namespace
    assert ns == node.registry.instances["b"].seal.final_namespace
    assert run(node.save(a[0].reg.caller_id, [(7, 0)])).written == 1
    assert run(node.save(b[1].reg.caller_id, [(7, 0)])).skipped == 1
    assert run(node.save(a[1].reg.caller_id, [(7, 0)])).sealed == 1
    assert node.query(ns, [7]).prefix_blocks == 1
    assert pools["cuda:1"].stats().used_bytes == 0
    for stage in a:
        stage.tensors[0].zero_()
        assert run(node.load(stage.reg.caller_id, [(7, 1)])).loaded == 1
        assert bool((stage.tensors[0][:, 1] == 3 * 7).all())  # fill(): value 3, layer 0
    assert node.clear("") == 1
    assert used_bytes(node) == 0


def test_memory_on_a_device_the_store_keeps_no_pool_on_is_refused_at_registration():
    """A host rank registering with a store whose pools are all on a GPU (or a
    rank on cuda:1 with the store on cuda:0) sealed, then every Save and Load
    failed UNKNOWN (KeyError 'cpu'), and so did peer fetches of its namespace."""
    from kvstore.testing.store import make_rank

    node = make_store()
    rank = make_rank("elsewhere", 0, 1, layers=1)
    rank.reg.device = "cuda:0"
    with pytest.raises(KVError) as info:
        node.register(rank.reg)
    assert info.value.code == Code.FAILED_PRECONDITION
    assert "'cuda:0'" in info.value.message and "['cpu']" in info.value.message
    assert node.registry.instances == {} and node.registry.sessions == {}


def test_ranks_together_span_at_most_max_layers():
    """The bound on layers is an instance's, not one rank's: two pipeline stages
    of 1,024 layers each made a 2,048-slot block, past what transfers carry."""
    from kvstore.testing.store import make_rank
    from kvstore.wire.limits import MAX_LAYERS

    node = make_store()
    stages = [make_rank("tall", 0, 1, layers=MAX_LAYERS, num_blocks=1) for _ in range(2)]
    second = stages[1].reg
    second.rank, stages[0].reg.world_size, second.world_size = 1, 2, 2
    for layer in second.layers:  # its own layers
        layer.geometry = dataclasses.replace(layer.geometry, name="m" + layer.geometry.name)
    second.regions = {
        layer.geometry.name: r for layer, r in zip(second.layers, second.regions.values())
    }
    node.register(stages[0].reg)
    with pytest.raises(KVError) as info:
        node.register(second)
    assert info.value.code == Code.INVALID_ARGUMENT and info.value.message.startswith("layers:")
    assert f"span {2 * MAX_LAYERS} layers" in info.value.message
    assert list(node.registry.instances["tall"].ranks) == [0]


def test_a_listener_refusing_events_fails_no_save_eviction_or_clear():
    """Events go out after the change they tell of. A listener that raised (the
    embedded router refusing a namespace past its bound) failed the Save whose
    block was already sealed, an eviction after its blocks were gone, and a
    Clear halfway: now the change stands, and the refusal is counted."""
    seen = []

    def listener(event) -> None:
        if event.type != "stored" or event.block_hashes[0] != 2:
            seen.append((event.type, list(event.block_hashes)))
            return
        raise RuntimeError("refused downstream")

    node = make_store(on_event=listener)
    ranks = make_instance(node.registry, "x")
    ns = node.registry.instances["x"].seal.final_namespace
    for key in (1, 2, 3):
        results = run(save_all(node, ranks, [(key, 0)]))
        assert results[-1].sealed == 1
    assert node.query(ns, [1]).prefix_blocks == 1 and node.query(ns, [2]).prefix_blocks == 1
    assert node.index.stats().events_refused == 1  # and on /metrics
    assert node.clear(ns) == 3
    assert node.query(ns, [1, 2, 3]).prefix_blocks == 0 and used_bytes(node) == 0
    assert ("stored", [3]) in seen and any(kind == "cleared" for kind, _ in seen)


def test_a_fetch_never_evicts_the_local_prefix_it_extends():
    """A Load of [local prefix + missing blocks] on a full pool: the fetch's
    reservation (here: Saves while the router is asked) evicted the oldest
    blocks, the caller's own prefix among them, so the Load found nothing."""
    from kvstore.store.fetch import Fetcher, StoreSink

    node = make_store(pool_bytes=128 << 10, slab_bytes=64 << 10)  # 64 blocks of 2 x 1 KiB
    (rank,) = make_instance(node.registry, "a", tp_size=1, num_blocks=32)
    (other,) = make_instance(node.registry, "b", tp_size=1, num_blocks=32)  # same namespace
    ns = node.registry.instances["a"].seal.final_namespace
    run(node.save(rank.reg.caller_id, [(h, h) for h in range(10)]))

    async def find_peers(namespace, hashes):
        """Meanwhile the pool fills twice over: every unpinned block goes."""
        for first in range(100, 228, 32):
            await node.save(other.reg.caller_id, [(h, h - first) for h in range(first, first + 32)])
        return []

    node.fetcher = Fetcher(node.index, StoreSink(node.index, node.registry), find_peers)
    with pytest.raises(KVError) as info:
        run(node.load(rank.reg.caller_id, [(h, i) for i, h in enumerate([*range(10), 1000])]))
    assert info.value.code == Code.NOT_FOUND and f"{1000:#018x}" in info.value.message
    assert node.index.stats().evictions > 0
    assert node.query(ns, list(range(10))).prefix_blocks == 10
    assert node.index.stats().pinned_blocks == 0


def test_a_load_whose_rank_left_while_it_fetched_copies_nothing():
    """Before: a Load waited on a peer fetch, the rank's session ended meanwhile
    (its memory unmapped), and the copy went ahead into the unmapped memory."""
    from kvstore.store.fetch import Fetcher, StoreSink

    node = make_store()
    (rank,) = make_instance(node.registry, "a", tp_size=1)
    (other,) = make_instance(node.registry, "b", tp_size=1)  # the same layout: one namespace
    ns = node.registry.instances["a"].seal.final_namespace
    run(node.save(rank.reg.caller_id, [(7, 0)]))

    async def find_peers(namespace, hashes):
        """While the router is asked, rank a leaves and block 8 arrives from b."""
        node.leave(rank.reg.session)
        await node.save(other.reg.caller_id, [(8, 0)])
        return []

    node.fetcher = Fetcher(node.index, StoreSink(node.index, node.registry), find_peers)
    with pytest.raises(KVError) as info:
        run(node.load(rank.reg.caller_id, [(7, 1), (8, 2)]))
    assert info.value.code == Code.NOT_FOUND and "instance_id 'a'" in info.value.message
    assert node.query(ns, [7, 8]).prefix_blocks == 2  # both blocks there; nothing copied
    assert not rank.reg.mapped and rank.reg.retired


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="cuda:1 must be a device CUDA refuses")
def test_a_cuda_error_under_a_copy_is_internal_naming_it_and_nothing_is_sealed(caplog):
    """A CUDA call failing under a GPU copy (here real CuPy asked for cuda:1, which
    this machine lacks) came out of Save as a bare CUDARuntimeError, UNKNOWN at the
    edge. It is INTERNAL naming the device and CUDA's error, logged, and the
    blocks it was saving are dropped, never visible."""
    pytest.importorskip("cupy")
    from kvstore.copy import copier_for
    from kvstore.store.blocks import BlockIndex
    from kvstore.store.node import StoreNode
    from kvstore.store.pool import SlotPool
    from kvstore.store.registry import Registry

    pool = SlotPool(1 << 20, "cpu", 64 << 10)
    pool.device = "cuda:1"  # host memory under a GPU's name: the copy goes through CuPy
    node = StoreNode(Registry(), BlockIndex({"cuda:1": pool}), {"cuda:1": copier_for("cpu")})
    stages = [pipeline_stage("g", r, "cuda:1") for r in (0, 1)]
    for stage in stages:
        node.register(stage.reg)
    ns = node.registry.instances["g"].seal.final_namespace
    for op, refs in (("save", [(7, 0)]), ("save", [(8, 1)])):
        with pytest.raises(KVError) as info:
            run(getattr(node, op)(stages[0].reg.caller_id, refs))
        assert info.value.code == Code.INTERNAL, info.value
        assert "cuda:1" in info.value.message and "CUDARuntimeError" in info.value.message
    assert node.query(ns, [7]).prefix_blocks == 0
    assert node.index.stats().inflight_blocks == 0 and pool.stats().used_bytes == 0
    faults = [r for r in caplog.records if "CUDA failed under the copy" in r.getMessage()]
    assert [r.getMessage().split("(")[1].split(" ")[0] for r in faults] == ["1", "2"]


def test_a_query_naming_a_hash_twice_is_refused_and_pins_nothing():
    """[h, h, h] answered a prefix of 3, counted 3 hits and leased the block three
    times; Prefetch already refused a repeated hash."""
    node = make_store()
    ranks = make_instance(node.registry, "a")
    run(save_all(node, ranks, [(1, 0)]))
    ns = node.registry.instances["a"].seal.final_namespace
    with pytest.raises(KVError) as info:
        node.query(ns, [1, 1, 1], lease=True)
    assert info.value.code == Code.INVALID_ARGUMENT
    assert "block_hashes: block_hash 0x0000000000000001 appears more than once" in (
        info.value.message
    )
    assert node.index.stats().leases == 0 and node.counters.hits == 0
