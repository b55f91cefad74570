"""Slot pool: accounting, no overlaps, and no fragmentation under churn."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.store.pool import ALIGN, SlotPool, round_size

SLAB = 64 << 10
SIZES = [100, 4096, 5000, 16384, 40000, SLAB]


def overlaps(live: dict[int, int]) -> bool:
    spans = sorted(live.items())
    return any(a + sa > b for (a, sa), (b, _) in itertools.pairwise(spans))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from(SIZES), st.integers(1, 40)), max_size=60))
def test_random_alloc_free_keeps_invariants(ops):
    pool = SlotPool(16 * SLAB, slab_bytes=SLAB)
    live: dict[int, int] = {}  # offset -> rounded size
    batches: list[tuple[int, np.ndarray]] = []
    for do_alloc, size, count in ops:
        if do_alloc or not batches:
            could = pool.can_alloc(size, count)
            got = pool.alloc(size, count)
            assert (got is not None) == could
            if got is None:
                continue
            assert len(set(got.tolist())) == count
            for off in got.tolist():
                assert off % ALIGN == 0
                assert off not in live
                live[off] = round_size(size)
            batches.append((size, got))
        else:
            size, got = batches.pop(count % len(batches))
            pool.free(size, got)
            for off in got.tolist():
                del live[off]
        pool.check()
        assert not overlaps(live)
        assert pool.used_bytes == sum(live.values())
        assert all(off // SLAB == (off + s - 1) // SLAB for off, s in live.items())
    for size, got in batches:
        pool.free(size, got)
    pool.check()
    assert pool.used_bytes == 0
    assert pool.can_alloc(SLAB, 16)  # every slab came back: nothing stranded


def test_churn_between_sizes_does_not_fragment():
    pool = SlotPool(32 * SLAB, slab_bytes=SLAB)
    rng = np.random.default_rng(0)
    for _ in range(200):
        small = pool.alloc(4096, 8 * 16)  # 8 slabs of small slots
        big = pool.alloc(SLAB // 2, 16)  # 8 slabs of big ones
        assert small is not None and big is not None
        keep = rng.permutation(len(small))
        pool.free(4096, small[keep])  # free in random order
        pool.free(SLAB // 2, big)
        pool.check()
    assert pool.used_bytes == 0
    assert pool.alloc(SLAB, 32) is not None  # the whole pool as one size class again


def test_all_or_nothing():
    pool = SlotPool(2 * SLAB, slab_bytes=SLAB)
    assert pool.alloc(SLAB // 2, 5) is None
    assert pool.used_bytes == 0
    assert pool.alloc(SLAB + 1, 1) is None  # larger than a slab


def test_slots_taken_together_lie_back_to_back_across_whole_slabs():
    """Whole fresh slabs are handed out in one go; the slots still come in ascending
    order, one run (what a peer reads in one piece), and come back whole."""
    pool = SlotPool(8 * SLAB, slab_bytes=SLAB)
    first = pool.alloc(4096, 40)  # 2 whole slabs of 16 slots, 8 slots of a third
    assert first is not None
    assert first.tolist() == [i * 4096 for i in range(40)]
    second = pool.alloc(4096, 24)  # the third slab's other 8, then one whole slab
    assert second is not None
    assert second.tolist() == [i * 4096 for i in range(40, 64)]
    pool.check()
    pool.free(4096, first)  # two whole slabs straight back, the third stays partial
    pool.check()
    assert pool.alloc(SLAB, 6) is not None  # 4 free slabs + the 2 freed: the pool is full
    assert not pool.can_alloc(SLAB, 1)


def test_a_double_free_is_refused_and_changes_nothing():
    pool = SlotPool(4 * SLAB, slab_bytes=SLAB)
    got = pool.alloc(4096, 16)  # one whole slab
    assert got is not None
    other = pool.alloc(4096, 16)  # a second slab
    assert other is not None
    pool.free(4096, got[:1])
    with pytest.raises(ValueError, match="double free"):
        pool.free(4096, np.concatenate([other, got]))  # slot 0 again, after a good slab
    pool.check()
    assert pool.used_bytes == 31 * 4096  # the good slab was not freed either
    with pytest.raises(ValueError, match="holds nothing"):
        pool.free(4096, np.array([3 * SLAB]))  # a slab never used


def test_what_an_empty_pool_holds_counts_slabs_per_rounded_size():
    """Slots of 1,000 and 1,010 bytes round to one 1,024-byte class and share its
    slabs: four blocks of one of each fit one 8 KiB slab (as alloc agrees), and
    are not refused as more than the pool holds."""
    from kvstore.store.block import SlotSet
    from kvstore.store.blocks import _check_fits

    pool = SlotPool(8 << 10, "cpu", 8 << 10)
    _check_fits(pool, SlotSet.of([0, 1], np.array([1000, 1010])), 4)  # 8 slots of 1 KiB: one slab
    assert pool.holds_when_empty({1024: 8}) and not pool.holds_when_empty({1024: 9})
    assert not pool.holds_when_empty({16 << 10: 1})  # larger than a slab
    assert pool.alloc(1000, 4) is not None and pool.alloc(1010, 4) is not None
