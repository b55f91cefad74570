"""SlotTable and the run / segment arithmetic of peer transfer, without a network."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.transfer.slots import (
    SlotTable,
    choose_lanes,
    run_starts,
    segment_bounds,
    transfer_order,
)
from kvstore.transfer.testing import table_from_views


def table_of(mem: np.ndarray, layout: list[tuple[int, int]], counts: list[int]) -> SlotTable:
    views = [mem[o : o + n] for o, n in layout]
    blocks, i = [], 0
    for c in counts:
        blocks.append(views[i : i + c])
        i += c
    return table_from_views(blocks)


def test_from_views_reads_addresses_sizes_and_memory_kind():
    mem = np.zeros(1 << 12, dtype=np.uint8)
    base = mem.__array_interface__["data"][0]
    t = table_of(mem, [(0, 16), (16, 32), (100, 8)], [2, 1])
    assert t.ptr.tolist() == [base, base + 16, base + 100]
    assert t.nbytes.tolist() == [16, 32, 8]
    assert t.memory.tolist() == [0, 0, 0]
    layouts, block_layout = t.layouts()
    assert [layouts[i] for i in block_layout] == [[16, 32], [8]]
    assert t.prefix(1).counts.tolist() == [2] and t.prefix(1).nbytes.tolist() == [16, 32]
    tt = table_from_views([[torch.zeros(8, dtype=torch.uint8)]])
    assert tt.nbytes.tolist() == [8] and tt.memory.tolist() == [0]


def test_table_columns_must_agree():
    with pytest.raises(ValueError, match="disagree"):
        SlotTable(
            np.zeros(2, np.uint64), np.ones(2, np.int64), np.zeros(2, np.int64), np.array([3])
        )


def test_non_contiguous_view_is_refused():
    mem = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="contiguous"):
        table_from_views([[mem[::2]]])


def test_runs_break_at_gaps_memory_changes_and_the_cap():
    ptr = np.array([0, 10, 20, 35, 45, 55], dtype=np.uint64) + np.uint64(1 << 20)
    size = np.full(6, 10, dtype=np.int64)
    host = np.zeros(6, dtype=np.int64)
    assert run_starts(ptr, size, host).tolist() == [3]  # 20 + 10 != 35
    cuda = np.array([0, 0, 0, 7, 7, 9], dtype=np.int64)
    assert run_starts(ptr, size, cuda).tolist() == [3, 5]
    assert run_starts(ptr, size, host, cap=20).tolist() == [2, 3, 5]
    assert segment_bounds(6, np.array([3]), np.array([1, 3])) == [(0, 1), (1, 3), (3, 6)]


def test_segments_cover_their_slots_and_carry_bytes():
    mem = np.arange(256, dtype=np.uint8)
    t = table_of(mem, [(0, 16), (16, 16), (64, 32)], [3])
    order = transfer_order(t.counts.tolist(), 1)
    ptr, size, memory = t.take(order)
    bounds = segment_bounds(3, run_starts(ptr, size, memory))
    assert bounds == [(0, 2), (2, 3)]
    pytest.importorskip("ucxx")
    from kvstore.transfer.ucx import segment_views

    views = segment_views(ptr, size, memory, bounds, writable=False, owner=mem)
    assert [v.nbytes for v in views] == [32, 32]
    assert [v.ptr for v in views] == [int(ptr[0]), int(ptr[2])]
    assert all(v.readonly and not v.cuda for v in views)
    assert np.array_equal(np.asarray(views[1].obj), mem[64:96])


def test_lanes_follow_a_tp_layout():
    """Two ranks: rank r's slots of consecutive blocks lie back to back (rank 1's
    after rank 0's), so two lanes turn 8 blocks x 4 slots into one run; one lane
    breaks at nearly every slot."""
    mem = np.zeros(1 << 12, dtype=np.uint8)
    layout, counts = [None] * 32, [4] * 8
    off = 0
    for r in range(2):
        for b in range(8):
            for s in range(r, 4, 2):
                layout[b * 4 + s] = (off, 16)
                off += 16
    t = table_of(mem, layout, counts)
    assert choose_lanes(t) == 2
    assert len(run_starts(*t.take(transfer_order(counts, 2)))) == 0
    assert len(run_starts(*t.take(transfer_order(counts, 1)))) == 31


def test_frames_travel_as_one_message_unless_long():
    from kvstore.transfer import wire

    short = wire.encode_frame(wire.Kind.GO, b"x" * 100)
    assert len(short) == 1 and len(short[0]) == 116
    assert wire.decode_preamble(short[0][:16], [wire.Kind.GO]) == (wire.Kind.GO, 100)
    long = wire.encode_frame(wire.Kind.REPLY, b"y" * wire.INLINE_FRAME_BYTES)
    assert [len(m) for m in long] == [16, wire.INLINE_FRAME_BYTES]


def test_long_runs_are_cut_greedily_at_the_cap():
    rng = np.random.default_rng(5)
    size = rng.integers(1, 40, 2000).astype(np.int64)
    ptr = (np.concatenate(([0], np.cumsum(size)[:-1])) + (1 << 20)).astype(np.uint64)
    memory = np.zeros(2000, dtype=np.int64)
    for cap in (1, 39, 40, 100, 1000):
        starts = run_starts(ptr, size, memory, cap=cap).tolist()
        expect, total = [], 0  # the plain greedy walk
        for i, s in enumerate(size.tolist()):
            if total + s > cap and i > 0 and total > 0:
                expect.append(i)
                total = 0
            total += s
        assert starts == expect, cap


def test_layouts_and_offers_round_trip():
    """Distinct layouts travel once; the fetcher rebuilds every block's sizes."""
    from kvstore.transfer import wire

    mem = np.zeros(1 << 12, dtype=np.uint8)
    for sizes in ([[16, 16]] * 5, [[16, 16], [16, 32], [16, 16], [16, 32]], [[8], [8, 8], [8]]):
        layout, off = [], 0
        for block in sizes:
            for n in block:
                layout.append((off, n))
                off += n
        table = table_of(mem, layout, [len(b) for b in sizes])
        layouts, block_layout = table.layouts()
        assert len(layouts) == len({tuple(b) for b in sizes})
        offer = wire.decode_offer(wire.encode_layouts(layouts, block_layout), len(sizes))
        assert offer.slot_sizes == sizes and offer.num_blocks == len(sizes)
        assert offer.slot_counts.tolist() == [len(b) for b in sizes]
        assert offer.flat_sizes().tolist() == [n for b in sizes for n in b]
        assert wire.decode_offer(wire.encode_offer(sizes), len(sizes)).slot_sizes == sizes


def _table(sizes_per_block: list[list[int]]):
    from kvstore.transfer.slots import SlotTable

    flat = [s for block in sizes_per_block for s in block]
    return SlotTable(
        np.arange(len(flat), dtype=np.uint64) * 4096,
        np.array(flat, dtype=np.int64),
        np.zeros(len(flat), dtype=np.int64),
        np.array([len(b) for b in sizes_per_block], dtype=np.int64),
    )


@pytest.mark.parametrize(
    ("layouts", "block_layout", "blocks", "fits"),
    [
        ([[100, 200]], [0, 0, 0], [[100, 200]] * 3, True),
        ([[100, 200]], [0, 0, 0], [[100, 200], [100, 201], [100, 200]], False),  # one size off
        ([[100, 200]], [0, 0, 0], [[100, 200]] * 2, False),  # a block fewer
        ([[100, 200]], [0, 0], [[100, 200], [100, 200, 300]], False),  # a slot more
        ([[100, 200]], [0, 0], [[100], [200, 100, 200]], False),  # same bytes, other blocks
        ([[100, 200], [100]], [0, 1, 0], [[100, 200], [100], [100, 200]], True),
        ([[100, 200], [100]], [0, 1, 0], [[100], [100, 200], [100, 200]], False),
    ],
)
def test_a_reservation_fits_an_offer_only_slot_for_slot(layouts, block_layout, blocks, fits):
    """What a fetch lands in must be the offered blocks' slots, block for block
    (a peer's other layout is its fault: the fetch goes elsewhere)."""
    from kvstore.transfer.client import _matches
    from kvstore.transfer.wire import Offer

    offer = Offer(layouts, np.array(block_layout, dtype=np.int64))
    assert _matches(_table(blocks), offer) is fits
