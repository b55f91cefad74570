"""The blocks path: a RegionTable derived once, per request only block ids and slot addresses.

Every case is byte-exact against the torch oracle (kvstore.copy.testing) on
whole buffers, for every layout kind (paged views at their own storage
offsets included), TP ranks sharing one pool, every host copier mode; bad
requests are refused with KVError naming the field and change nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.copy import HostCopier, LayerRegion, RegionTable, plan, region_from_tensor
from kvstore.copy.testing import reference_gather, reference_scatter
from kvstore.wire.errors import Code, KVError
from tests.copy.copiers import HOST_MODES, host_copier
from tests.copy.geometry import (
    DTYPES,
    LAYOUTS,
    MIXED_SPECS,
    Geometry,
    Layers,
    expected_pool,
    geometries,
    layer_spec,
    make_layer,
    make_layers,
    make_pool,
)

# ---------------------------------------------------------------- layers of every kind


def paged_layers(num_layers: int, nb: int, rng, *, heads=2, tokens=4, d=8, lead=0, device="cpu"):
    """vLLM's standardised `paged` views: one buffer [nb, layers, heads, tokens, 2 * d] (fp16)
    after `lead` bytes, layer l a view at its own storage offset (blocks interleave by layer)."""
    per_block = heads * tokens * 2 * d * 2
    raw = torch.from_numpy(rng.integers(0, 256, lead + nb * num_layers * per_block + 5, np.uint8))
    raw = raw.to(device)
    whole = raw[lead : lead + nb * num_layers * per_block].view(torch.float16)
    whole = whole.view(nb, num_layers, heads, tokens, 2 * d)
    return [whole[:, layer] for layer in range(num_layers)], raw


def spec_layers(kind: str, order: str, dtype, rng, num_layers=3, **kw) -> Layers:
    """Layers of one LayerSpec kind with 20, 21, 22... blocks, each layer its own buffer."""
    specs = [layer_spec(kind, order, dtype, num_blocks=20 + i, **kw) for i in range(3)]
    layers = make_layers(specs, rng)
    return Layers(layers.tensors[:num_layers], layers.raws[:num_layers])


def roundtrip(tensors, kinds, raws, copier, rng, ids, *, pool_gap=0, pool_base=0, device="cpu"):
    """save_blocks into a shuffled pool, compare every pool byte; load_blocks into other
    blocks of the same layers, compare every cache byte. Returns the table used."""
    table = RegionTable([region_from_tensor(t, k) for t, k in zip(tensors, kinds, strict=True)])
    pool = make_pool([r.slot_bytes for r in table.regions], len(ids), rng, gap=pool_gap,
                     base=pool_base, device=device)  # fmt: skip
    before = [raw.clone() for raw in raws]
    assert copier.save_blocks(table, ids, pool.addrs) == table.bytes_per_block * len(ids)
    images = reference_gather(tensors, kinds, ids)
    assert torch.equal(pool.buf, expected_pool(pool, images)), "pool bytes differ"
    assert all(torch.equal(a, b) for a, b in zip(raws, before, strict=True)), "save wrote the cache"

    nb = min(r.num_blocks for r in table.regions)
    targets = rng.permutation(nb)[: len(ids)]
    want = [raw.clone() for raw in raws]
    views = _same_views(tensors, raws, want)
    reference_scatter(views, kinds, targets, images)
    pool_before = pool.buf.clone()
    assert copier.load_blocks(table, targets, pool.addrs) == table.bytes_per_block * len(ids)
    for raw, w in zip(raws, want, strict=True):
        assert torch.equal(raw, w), "loaded cache bytes differ"
    assert torch.equal(pool.buf, pool_before), "load wrote the pool"
    return table


def _same_views(tensors, raws, copies):
    """The views `tensors` have over `raws`, rebuilt over `copies` (same offsets and strides)."""
    out = []
    for t in tensors:
        raw, copy = next((r, c) for r, c in zip(raws, copies, strict=True) if _within(t, r))
        offset = (t.data_ptr() - raw.data_ptr()) // t.element_size()
        flat = copy[: (raw.numel() // t.element_size()) * t.element_size()].view(t.dtype)
        out.append(flat.as_strided(t.shape, t.stride(), offset))
    return out


def _within(t: torch.Tensor, raw: torch.Tensor) -> bool:
    return raw.data_ptr() <= t.data_ptr() < raw.data_ptr() + raw.numel()


# ---------------------------------------------------------------- byte-exact, every kind


@pytest.mark.parametrize("mode", HOST_MODES)
@pytest.mark.parametrize("kind,order", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_blocks_every_layout_and_dtype(mode, kind, order, dtype):
    rng = np.random.default_rng(abs(hash((mode, kind, order, str(dtype)))) % 2**32)
    tensors, raws = spec_layers(kind, order, dtype, rng)
    roundtrip(tensors, [kind] * 3, raws, host_copier(mode), rng, rng.permutation(20)[:9])


@pytest.mark.parametrize("mode", HOST_MODES)
@pytest.mark.parametrize("lead", [0, 6])
def test_blocks_paged_views_at_storage_offsets(mode, lead):
    """Layers interleaved block by block in one buffer: proven apart by stride arithmetic,
    so loads take the O(blocks) path, and every byte lands."""
    rng = np.random.default_rng(40 + lead)
    tensors, raw = paged_layers(4, 16, rng, lead=lead)
    table = roundtrip(tensors, ["paged"] * 4, [raw], host_copier(mode), rng, [3, 15, 0, 7, 8])
    assert table.paged_disjoint
    assert [t.storage_offset() for t in tensors] == [lead // 2 + i * 2 * 4 * 16 for i in range(4)]


@pytest.mark.parametrize("mode", HOST_MODES)
def test_blocks_mixed_kinds_odd_sizes_unaligned(mode):
    rng = np.random.default_rng(41)
    tensors, raws = make_layers(MIXED_SPECS, rng)
    roundtrip(tensors, [s.kind for s in MIXED_SPECS], raws, host_copier(mode), rng,
              [5, 0, 11, 2], pool_gap=3, pool_base=5)  # fmt: skip


@pytest.mark.parametrize("mode", HOST_MODES)
def test_blocks_large_pieces_cut_between_threads(mode):
    """128 KiB segments: threaded modes cut the request mid-piece at 4 KiB offsets."""
    rng = np.random.default_rng(42)
    spec = layer_spec("kv_first", "HND_view", torch.float16, num_blocks=8, bs=16, h=32, d=128)
    tensors, raws = make_layers([spec, spec], rng)
    roundtrip(tensors, ["kv_first"] * 2, raws, host_copier(mode), rng, [7, 0, 3])


@pytest.mark.parametrize("mode", HOST_MODES)
def test_blocks_tp_ranks_share_one_pool(mode):
    """Two TP ranks, each its own layers and table, fill slot layer * tp + rank of one pool;
    each loads its own slots back into fresh caches (docs/design.md §2)."""
    rng = np.random.default_rng(43)
    tp, num_layers, ids = 2, 3, np.array([4, 1, 9, 6])
    ranks = [paged_layers(num_layers, 12, rng, lead=rank * 2) for rank in range(tp)]
    tables = [RegionTable([region_from_tensor(t, "paged") for t in ts]) for ts, _ in ranks]
    pool = make_pool([tables[0].regions[0].slot_bytes] * (num_layers * tp), len(ids), rng)
    copier = host_copier(mode)
    for rank, table in enumerate(tables):
        copier.save_blocks(table, ids, pool.addrs[rank::tp])  # rows layer * tp + rank
    images = [reference_gather(ts, ["paged"] * num_layers, ids) for ts, _ in ranks]
    by_slot = [images[s % tp][s // tp] for s in range(num_layers * tp)]
    assert torch.equal(pool.buf, expected_pool(pool, by_slot))
    for rank in range(tp):
        fresh, raw = paged_layers(num_layers, 12, np.random.default_rng(rank))
        want = raw.clone()
        reference_scatter(_same_views(fresh, [raw], [want]), ["paged"] * num_layers, ids,
                          images[rank])  # fmt: skip
        fresh_table = RegionTable([region_from_tensor(t, "paged") for t in fresh])
        copier.load_blocks(fresh_table, ids, pool.addrs[rank::tp])
        assert torch.equal(raw, want)


# ---------------------------------------------------------------- the table, derived once


def test_one_table_serves_many_requests_unchanged():
    """The descriptors are derived once and read-only; request after request (other blocks,
    other slots, both directions) reuses them and every byte is right."""
    rng = np.random.default_rng(44)
    tensors, raws = spec_layers("kv_first", "NHD", torch.float16, rng)
    table = RegionTable([region_from_tensor(t, "kv_first") for t in tensors])
    desc, snapshot = table.descriptors, table.descriptors.copy()
    assert not desc.flags.writeable
    copier = HostCopier()
    for n in (1, 5, 20, 3):
        ids = rng.permutation(20)[:n]
        pool = make_pool([r.slot_bytes for r in table.regions], n, rng)
        copier.save_blocks(table, ids, pool.addrs)
        images = reference_gather(tensors, ["kv_first"] * 3, ids)
        assert torch.equal(pool.buf, expected_pool(pool, images))
        for raw in raws:
            raw.zero_()
        copier.load_blocks(table, ids[::-1].copy(), pool.addrs[:, ::-1])  # same pairs, reversed
        back = reference_gather(tensors, ["kv_first"] * 3, ids)
        assert all(torch.equal(a, b) for a, b in zip(back, images, strict=True))
    assert table.descriptors is desc and np.array_equal(desc, snapshot)


def test_table_descriptor_rows():
    r = LayerRegion(base=1000, num_blocks=10, segments=2, segment_bytes=16, block_stride=16,
                    segment_stride=160)  # fmt: skip
    m = LayerRegion(base=5000, num_blocks=7, segments=1, segment_bytes=48, block_stride=96,
                    segment_stride=0)  # fmt: skip
    table = RegionTable([r, m])
    assert table.descriptors.tolist() == [[1000, 16, 160, 16, 2, 10], [5000, 96, 0, 48, 1, 7]]
    assert (table.bytes_per_block, table.min_blocks, len(table)) == (80, 7, 2)


def test_blocks_pieces_match_plan():
    """The table's vectorised pieces equal plan()'s on the same request."""
    rng = np.random.default_rng(45)
    tensors, _ = spec_layers("blocks_first", "HND", torch.bfloat16, rng)
    regions = [region_from_tensor(t, "blocks_first") for t in tensors]
    ids = np.array([3, 4, 5, 0])
    slots = (10_000 + 512 * np.arange(12)).reshape(3, 4).astype(np.uint64)
    got = RegionTable(regions).pieces(RegionTable(regions).check(ids, slots, distinct=True))
    want = plan(regions, ids, slots)
    for a, b in zip(got.__dict__.values(), want.__dict__.values(), strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize(
    "regions,apart",
    [
        ([LayerRegion(0, 8, 2, 32, 32, 256)], True),  # kv_first: V after every K
        ([LayerRegion(0, 8, 2, 32, 64, 32)], True),  # K/V interleaved in a 64-byte stride
        ([LayerRegion(0, 8, 2, 32, 64, 16)], False),  # V half over K
        ([LayerRegion(0, 8, 1, 32, 32, 0)] * 2, False),  # one layer listed twice
        ([LayerRegion(0, 8, 1, 32, 64, 0), LayerRegion(32, 8, 1, 32, 64, 0)], True),  # interleave
        ([LayerRegion(0, 8, 1, 32, 64, 0), LayerRegion(16, 8, 1, 32, 64, 0)], False),
        ([LayerRegion(0, 8, 1, 32, 32, 0), LayerRegion(256, 8, 1, 32, 32, 0)], True),  # apart
        ([LayerRegion(0, 8, 1, 32, 32, 0), LayerRegion(200, 8, 1, 32, 32, 0)], False),
        # two-segment layers interleaved block by block in one buffer (K and V apart)
        ([LayerRegion(0, 8, 2, 32, 64, 1024), LayerRegion(32, 8, 2, 32, 64, 1024)], True),
        ([LayerRegion(0, 8, 2, 32, 64, 1024), LayerRegion(16, 8, 2, 32, 64, 1024)], False),
        ([LayerRegion(0, 8, 2, 32, 128, 32), LayerRegion(64, 8, 2, 32, 128, 32)], True),
        ([LayerRegion(0, 8, 2, 32, 128, 32), LayerRegion(32, 8, 2, 32, 128, 32)], False),
        # V of one layer over K of the other, modulo the stride
        ([LayerRegion(0, 8, 2, 32, 64, 1056), LayerRegion(32, 8, 2, 32, 64, 1024)], False),
    ],
)
def test_paged_disjoint_proof(regions, apart):
    assert RegionTable(regions).paged_disjoint is apart


def _covered_twice(regions: list[LayerRegion]) -> bool:
    """Brute force: does any byte belong to two (layer, block, segment) pieces?"""
    top = max(r.base + (r.num_blocks - 1) * r.block_stride + (r.segments - 1) * r.segment_stride
              + r.segment_bytes for r in regions)  # fmt: skip
    hits = np.zeros(top, dtype=np.int64)
    for r in regions:
        for b in range(r.num_blocks):
            for k in range(r.segments):
                at = r.base + b * r.block_stride + k * r.segment_stride
                hits[at : at + r.segment_bytes] += 1
    return bool((hits > 1).any())


# Layers of one block stride, at random offsets and K/V shifts: (base, segments,
# segment bytes, segment stride) each; the interleaved cases of vLLM's layouts.
INTERLEAVED_LAYERS = st.lists(
    st.tuples(
        st.integers(0, 24).map(lambda x: 8 * x),
        st.integers(1, 2),
        st.sampled_from([8, 16]),
        st.integers(0, 16).map(lambda x: 8 * x),
    ),
    min_size=2,
    max_size=4,
)
STRIDES = st.sampled_from([32, 48, 64])


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(layers=INTERLEAVED_LAYERS, stride=STRIDES)
def test_paged_disjoint_proof_is_sound(layers, stride):
    """Whatever it proves apart never has a byte in two pieces (layers sharing one
    block stride, offset and K/V-shifted at random: the interleaved cases)."""
    regions = [
        LayerRegion(base, 4, segments, size, stride, shift if segments == 2 else 0)
        for base, segments, size, shift in layers
    ]
    if RegionTable(regions).paged_disjoint:
        assert not _covered_twice(regions)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(layers=INTERLEAVED_LAYERS, stride=STRIDES)
def test_first_overlap_finds_shared_bytes_exactly(layers, stride):
    """Layers each apart within themselves (a registration refuses any other):
    first_overlap names two blocks that share bytes iff some byte is covered
    twice (brute force), and the blocks it names do share one."""
    from kvstore.copy import first_overlap
    from kvstore.copy.table import layer_apart

    regions = [
        LayerRegion(base, 4, segments, size, stride, shift if segments == 2 else 0)
        for base, segments, size, shift in layers
    ]
    if not all(layer_apart(r) for r in regions):
        return
    found = first_overlap(RegionTable(regions))
    assert (found is not None) == _covered_twice(regions)
    if found is not None:
        a, b = regions[found.layer_a], regions[found.layer_b]
        pair = [
            LayerRegion(a.base + found.block_a * a.block_stride, 1, a.segments, a.segment_bytes,
                        a.block_stride, a.segment_stride),
            LayerRegion(b.base + found.block_b * b.block_stride, 1, b.segments, b.segment_bytes,
                        b.block_stride, b.segment_stride),
        ]  # fmt: skip
        assert found.layer_a != found.layer_b and _covered_twice(pair)


@pytest.mark.parametrize("order", ["kv_blocks_layers", "blocks_layers_kv"])
def test_cross_layer_kv_first_views_load_without_the_sort(order):
    """Layers as kv_first views into one buffer that interleaves them block by block
    (vLLM's cross-layer layouts): proven apart, so a load takes no overlap sort,
    and every byte lands where it belongs."""
    rng = np.random.default_rng(47)
    nb, layers, shape = 12, 4, (16, 2, 8)
    if order == "kv_blocks_layers":
        buf = torch.zeros(2, nb, layers, *shape, dtype=torch.float16)
        views = [buf[:, :, i] for i in range(layers)]
    else:
        buf = torch.zeros(nb, layers, 2, *shape, dtype=torch.float16)
        views = [buf[:, i].transpose(0, 1) for i in range(layers)]
    buf.view(torch.int16).copy_(
        torch.from_numpy(rng.integers(-(2**15), 2**15, buf.shape, dtype=np.int16))
    )
    table = RegionTable([region_from_tensor(v, "kv_first") for v in views])
    assert table.paged_disjoint
    ids = [7, 2, 11, 0]
    pool = make_pool([r.slot_bytes for r in table.regions], len(ids), rng)
    HostCopier().save_blocks(table, ids, pool.addrs)
    images = reference_gather(views, ["kv_first"] * layers, ids)
    assert torch.equal(pool.buf, expected_pool(pool, images))
    buf.zero_()
    back = [5, 9, 1, 3]
    HostCopier().load_blocks(table, back, pool.addrs)
    assert all(
        torch.equal(a, b)
        for a, b in zip(reference_gather(views, ["kv_first"] * layers, back), images, strict=True)
    )
    nonzero = sum(int(torch.count_nonzero(x)) for x in images)  # bytes; nothing else written
    assert int(torch.count_nonzero(buf.view(torch.uint8))) == nonzero


def test_load_of_a_repeated_layer_falls_back_to_the_overlap_check():
    """Not proven apart (one layer twice): the load is refused by the sorting check."""
    rng = np.random.default_rng(46)
    t, raw = make_layer(layer_spec("mla", "NHD", torch.float16), rng)
    r = region_from_tensor(t, "mla")
    table = RegionTable([r, r])
    pool = make_pool([r.slot_bytes] * 2, 3, rng)
    before = raw.clone()
    with pytest.raises(KVError, match="overlap on the paged side") as err:
        HostCopier().load_blocks(table, [4, 9, 1], pool.addrs)
    assert err.value.code is Code.INVALID_ARGUMENT
    assert torch.equal(raw, before)
    HostCopier().save_blocks(table, [4, 9, 1], pool.addrs)  # saving it twice is fine
    img = reference_gather([t], ["mla"], [4, 9, 1])[0]
    assert torch.equal(pool.buf, expected_pool(pool, [img, img]))


# ---------------------------------------------------------------- refusals, no state change


REPEATS = [  # refused for a load only: two writes into one block would race
    ([4, 9, 4], r"block_ids\[2\] = 4 repeats block_ids\[0\]"),
    ([1, 7, 2, 7], r"block_ids\[3\] = 7 repeats block_ids\[1\]"),
]
BAD = [
    ([1, 20, 2], r"block_ids\[1\] = 20 out of range \[0, 20\) for layer index 2"),
    ([1, 21, 2], r"block_ids\[1\] = 21 out of range \[0, 21\) for layer index 1"),
    ([1, -1, 2], r"block_ids\[1\] = -1 out of range"),
    ([[1, 2, 3]], r"block_ids must be 1-D"),
    ([1.0, 2.0, 3.0], r"block_ids must be integers"),
]


@pytest.mark.parametrize("mode", HOST_MODES)
@pytest.mark.parametrize(
    "op,ids,message",
    [("save_blocks", *bad) for bad in BAD] + [("load_blocks", *bad) for bad in BAD + REPEATS],
)
def test_bad_request_refused_naming_the_field_and_nothing_moves(mode, op, ids, message):
    rng = np.random.default_rng(47)
    tensors, raws = spec_layers("kv_first", "NHD", torch.float16, rng)  # 20, 21, 22 blocks
    table = RegionTable([region_from_tensor(t, "kv_first") for t in tensors[::-1]])
    pool = make_pool([r.slot_bytes for r in table.regions], np.shape(ids)[-1], rng)
    before = [raw.clone() for raw in raws] + [pool.buf.clone()]
    with pytest.raises(KVError, match=message) as err:
        getattr(host_copier(mode), op)(table, ids, pool.addrs)
    assert err.value.code is Code.INVALID_ARGUMENT
    assert all(torch.equal(a, b) for a, b in zip([*raws, pool.buf], before, strict=True))
    # the table is not poisoned: the next good request works
    getattr(host_copier(mode), op)(table, np.arange(pool.addrs.shape[1]), pool.addrs)


@pytest.mark.parametrize("mode", HOST_MODES)
def test_a_save_may_copy_one_block_into_two_blocks_slots(mode):
    """The store takes one block_id under two hashes in a Save; the blocks path
    copies it into both blocks' slots, as the pieces path does."""
    save_one_block_twice(host_copier(mode))


def save_one_block_twice(copier) -> None:
    """save_blocks of ids [4, 9, 4]: block 4's bytes in the first and third slots."""
    rng = np.random.default_rng(50)
    tensors, _ = spec_layers("kv_first", "NHD", torch.float16, rng)
    kinds = ["kv_first"] * len(tensors)
    table = RegionTable([region_from_tensor(t, k) for t, k in zip(tensors, kinds, strict=True)])
    ids = [4, 9, 4]
    pool = make_pool([r.slot_bytes for r in table.regions], len(ids), rng)
    copier.save_blocks(table, ids, pool.addrs)
    assert torch.equal(pool.buf, expected_pool(pool, reference_gather(tensors, kinds, ids)))


def test_bad_slot_shape_refused():
    rng = np.random.default_rng(48)
    tensors, _ = spec_layers("mla", "NHD", torch.float16, rng)
    table = RegionTable([region_from_tensor(t, "mla") for t in tensors])
    with pytest.raises(KVError, match=r"slot_addrs must have shape \(layers, blocks\) = \(3, 2\)"):
        HostCopier().save_blocks(table, [1, 2], np.zeros((2, 2), dtype=np.uint64))
    with pytest.raises(KVError, match="slot_addrs must be non-negative"):
        HostCopier().save_blocks(table, [1, 2], -np.ones((3, 2), dtype=np.int64))


def test_empty_request_moves_nothing():
    rng = np.random.default_rng(49)
    tensors, _ = spec_layers("kv_first", "NHD", torch.float16, rng)
    table = RegionTable([region_from_tensor(t, "kv_first") for t in tensors])
    empty = np.zeros((3, 0), dtype=np.uint64)
    assert HostCopier().save_blocks(table, np.array([], dtype=np.int64), empty) == 0
    assert HostCopier().load_blocks(RegionTable([]), [], np.zeros((0, 0), np.uint64)) == 0


# ---------------------------------------------------------------- random geometry


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(geometry=geometries(), mode=st.sampled_from(list(HOST_MODES)))
def test_blocks_random_geometry(geometry: Geometry, mode):
    rng = geometry.rng()
    tensors, raws = make_layers(geometry.specs, rng)
    roundtrip(tensors, geometry.kinds, raws, host_copier(mode), rng, np.array(geometry.block_ids),
              pool_gap=geometry.pool_gap, pool_base=geometry.pool_base)  # fmt: skip
