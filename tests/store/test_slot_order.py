"""A block's slots lie in the order a peer reads them (docs/design.md §2, §4).

The seal numbers layers by sorted name; ranks register them in their own order
(vLLM: model.layers.0, 1, 2, ..., 10, which sorts as 0, 1, 10, 11, 2, ...). The
store lays each block's slots out by slot index, so in transfer order (lanes =
tp_size) a served block's slots of one rank are one run, whatever the
registration order, and a fetch of many blocks collapses to a few messages.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.store.fetch import StoreSource
from kvstore.testing.store import make_rank, make_store, run
from kvstore.transfer.slots import choose_lanes, run_starts, transfer_order
from kvstore.transfer.wire import NO_CAP

LAYERS = 12  # names l0 .. l11: sorted order l0, l1, l10, l11, l2, ... differs from theirs


def register(node, tp_size: int, order: str, num_blocks: int = 32):
    """``tp_size`` ranks of LAYERS layers, each registering them in ``order``."""
    ranks = [
        make_rank("a", r, tp_size, layers=LAYERS, num_blocks=num_blocks) for r in range(tp_size)
    ]
    for rank in ranks:
        if order == "reversed":
            rank.reg.layers.reverse()
        for t in rank.tensors:
            t.random_(0, 255)
        node.registry.register(rank.reg)
    return ranks, node.registry.instances["a"].seal


def served_table(node, seal, hashes):
    lease = StoreSource(node.index).lease(seal.final_namespace, hashes)
    assert lease.hashes == hashes
    return lease.slots


def runs_of(table, lanes: int) -> np.ndarray:
    """Run starts of the table read in transfer order with ``lanes``."""
    return run_starts(*table.take(transfer_order(table.counts.tolist(), lanes)), cap=NO_CAP)


@pytest.mark.parametrize("order", ["numeric", "reversed"])
def test_a_served_tp1_block_is_one_run_whatever_the_registration_order(order):
    node = make_store(pool_bytes=4 << 20, slab_bytes=1 << 20)
    (rank,), seal = register(node, 1, order)
    assert [la.geometry.name for la in rank.reg.layers] != sorted(seal.layer_ids)
    for start in (0, 8):  # two saves: each block one run, and the saves adjacent
        run(node.save(rank.reg.caller_id, [(h, h) for h in range(start, start + 8)]))
    table = served_table(node, seal, list(range(16)))
    assert choose_lanes(table) == 1
    for b in range(16):
        one = table.prefix(b + 1)
        block = slice(b * LAYERS, (b + 1) * LAYERS)
        ptr, size = one.ptr[block], one.nbytes[block].astype(np.uint64)
        assert (ptr[1:] == ptr[:-1] + size[:-1]).all(), f"block {b} is not one run"
    assert len(runs_of(table, 1)) == 0  # sixteen blocks in one slab: one message


@pytest.mark.parametrize("full", [False, True], ids=["empty-pool", "full-pool"])
@pytest.mark.parametrize("order", ["numeric", "reversed"])
def test_a_served_tp2_block_is_one_run_per_rank(order, full):
    """Into a full pool too, where a save takes over its victims' slots: two
    ranks' slots of one block alternate in slot order, and a rank given them in
    that order would hold one run a slot."""
    node = make_store(pool_bytes=4 << 20, slab_bytes=1 << 20)
    ranks, seal = register(node, 2, order)
    first = 10_000
    while full and not node.index.stats().evictions:  # until the pool is full
        for rank in ranks:
            run(node.save(rank.reg.caller_id, [(first, 0)]))
        first += 1
    for rank in ranks:
        run(node.save(rank.reg.caller_id, [(h, h) for h in range(8)]))
    table = served_table(node, seal, list(range(8)))
    assert choose_lanes(table) == 2
    order_idx = transfer_order(table.counts.tolist(), 2)
    ptr, size, _ = table.take(order_idx)
    per_lane = 8 * LAYERS  # rank r's slots of every block, in transfer order
    for lane in range(2):
        p = ptr[lane * per_lane : (lane + 1) * per_lane]
        s = size[lane * per_lane : (lane + 1) * per_lane].astype(np.uint64)
        assert (p[1:] == p[:-1] + s[:-1]).all(), f"rank {lane}'s slots are not one run"
    assert len(runs_of(table, 2)) <= 1  # at most a break between the two ranks


@pytest.mark.parametrize("order", ["numeric", "reversed"])
def test_save_load_byte_exact_for_tp2_registered_out_of_sorted_order(order):
    node = make_store(pool_bytes=4 << 20, slab_bytes=1 << 20)
    ranks, _ = register(node, 2, order)
    refs = [(1000 + b, b) for b in range(10)]
    for rank in ranks:
        run(node.save(rank.reg.caller_id, refs))
    saved = [[t[:, :10].clone() for t in rank.tensors] for rank in ranks]
    for rank in ranks:
        for t in rank.tensors:
            t[:, 16:26].zero_()
        run(node.load(rank.reg.caller_id, [(h, 16 + b) for h, b in refs]))
    for rank, before in zip(ranks, saved, strict=True):
        for i, (t, want) in enumerate(zip(rank.tensors, before, strict=True)):
            assert torch.equal(t[:, 16:26], want), f"rank {rank.reg.tp_rank} l{i} differs"


def test_slot_set_groups_slots_by_size_ascending_with_slices_where_evenly_spaced():
    from kvstore.store.block import SlotSet

    sizes = np.array([512, 256, 512, 256, 512, 1024, 512, 256])
    one = SlotSet.of([6, 0, 4, 2, 5, 7], sizes)  # a rank's layers in its own order
    assert one.slots.tolist() == [6, 0, 4, 2, 5, 7] and not one.slots.flags.writeable
    assert one.mask == sum(1 << s for s in (0, 2, 4, 5, 6, 7))
    assert one.nbytes == 4 * 512 + 1024 + 256
    assert [(r.size, r.cells.tolist()) for r in one.runs] == [
        (256, [7]),
        (512, [0, 2, 4, 6]),
        (1024, [5]),
    ]
    assert one.runs[0].where == slice(7, 8, 1) and one.runs[1].where == slice(0, 7, 2)
    uneven = SlotSet.of([0, 2, 6], sizes)  # 0, 2, 6: not evenly spaced, kept as indices
    assert isinstance(uneven.runs[0].where, np.ndarray)
    row = np.zeros(8, dtype=np.int64)
    for run_ in uneven.runs + one.runs:  # either form picks the same cells
        assert row[run_.where].shape == run_.cells.shape


def test_a_ranks_slots_are_worked_out_once_a_seal():
    node = make_store()
    ranks, seal = register(node, 2, "reversed")
    reg = ranks[1].reg
    first = seal.slots_of(reg)
    assert seal.slots_of(reg) is first  # the cached one: not worked out per Save or Load
    names = [layer.geometry.name for layer in reg.layers]  # its own order: l11, l10, ... l0
    assert first.slots.tolist() == [seal.slot_index(seal.layer_ids[n], 1) for n in names]
    assert seal.slots_of(ranks[0].reg).mask == sum(
        1 << seal.slot_index(i, 0) for i in range(LAYERS)
    )


def test_a_ranks_slots_in_a_layout_are_worked_out_once_for_every_fetch():
    from kvstore.store.block import tp_rank_slots

    sizes = np.array([512, 512, 256, 256, 512, 512])  # 3 layers x tp 2
    sizes.flags.writeable = False
    one = tp_rank_slots(sizes, 2, 1)
    assert one.slots.tolist() == [1, 3, 5] and one.nbytes == 512 + 256 + 512
    assert [(r.size, r.cells.tolist()) for r in one.runs] == [(256, [3]), (512, [1, 5])]
    assert tp_rank_slots(sizes.copy(), 2, 1) is one  # the same layout: the same set
    assert tp_rank_slots(sizes, 2, 0).slots.tolist() == [0, 2, 4]
    assert tp_rank_slots(sizes, 3, 1).slots.tolist() == [1, 4]  # another tp: another set
