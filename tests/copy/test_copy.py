"""Copy engine: every byte of every layout, host copier and (on a GPU) CUDA copier.

The oracle is kvstore.copy.testing (torch indexing on the original tensors).
Tensors are views over a raw uint8 buffer, so results are compared byte for
byte on the buffers (bf16 noise contains NaNs; torch.equal would lie).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import types

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from kvstore.copy import (
    CudaCopier,
    HostCopier,
    LayerRegion,
    Pieces,
    copier_for,
    merge_adjacent,
    plan,
    region_from_tensor,
    split_pieces,
)
from kvstore.copy.plan import check_disjoint
from kvstore.copy.testing import reference_gather, reference_scatter
from kvstore.wire.errors import Code, KVError
from tests.copy.copiers import HOST_MODES, host_copier
from tests.copy.geometry import (
    DTYPES,
    FP8,
    LAYOUTS,
    MIXED_SPECS,
    Geometry,
    element_size,
    expected_pool,
    geometries,
    layer_spec,
    make_layer,
    make_pool,
)

HAS_CUDA = torch.cuda.is_available()


# ---------------------------------------------------------------- regions


@pytest.mark.parametrize("kind,order", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_region_geometry(kind, order, dtype):
    spec = layer_spec(kind, order, dtype)
    t, _ = make_layer(spec, np.random.default_rng(0))
    r = region_from_tensor(t, kind)
    el = element_size(dtype)
    block_elems = spec.block_size * spec.heads * spec.head_dim
    assert r.base == t.data_ptr() and r.num_blocks == spec.num_blocks
    if kind == "kv_first":
        assert (r.segments, r.segment_bytes) == (2, block_elems * el)
        assert r.block_stride == block_elems * el
        assert r.segment_stride == spec.num_blocks * block_elems * el
    elif kind == "blocks_first":
        assert (r.segments, r.segment_bytes, r.segment_stride) == (1, 2 * block_elems * el, 0)
        assert r.block_stride == 2 * block_elems * el
    else:
        assert (r.segments, r.segment_bytes, r.block_stride) == (
            1,
            block_elems * el,
            block_elems * el,
        )
    assert r.slot_bytes == (2 if kind != "mla" else 1) * block_elems * el


@pytest.mark.parametrize(
    "shape,kind",
    [
        ((3, 4, 2, 2, 2), "kv_first"),
        ((4, 3, 2, 2, 2), "blocks_first"),
        ((4, 2, 2, 2), "mla"),
        ((2, 4, 2, 2), "kv_first"),
        ((2, 4, 2, 2, 2), "bogus"),
        ((8,), "paged"),
    ],
)
def test_region_rejects_bad_shapes(shape, kind):
    with pytest.raises(ValueError):
        region_from_tensor(torch.zeros(shape, dtype=torch.float16), kind)


def test_region_rejects_non_dense_segment():
    t = torch.zeros(2, 4, 16, 8, 128, dtype=torch.float16)[..., :64]  # head_dim slice: gaps
    with pytest.raises(ValueError, match="dense"):
        region_from_tensor(t, "kv_first")


def test_region_accepts_padded_block_stride():
    """A cache whose blocks are padded apart still has dense segments: allowed."""
    t = torch.zeros(2, 4, 2, 3, 2, 8, dtype=torch.float16)[:, :, 0]  # block stride 2x the segment
    r = region_from_tensor(t, "kv_first")
    assert r.block_stride == 2 * r.segment_bytes


def test_layer_region_validates():
    with pytest.raises(ValueError):
        LayerRegion(0, 4, 3, 16, 16, 0)
    with pytest.raises(ValueError):
        LayerRegion(0, 4, 1, 16, 16, 64)


# ---------------------------------------------------------------- plan


def test_plan_rows_follow_layer_block_segment_order():
    r = LayerRegion(
        base=1000, num_blocks=10, segments=2, segment_bytes=16, block_stride=16, segment_stride=160
    )
    p = plan([r], [4, 2], np.array([[5000, 9000]], dtype=np.uint64))
    assert p.paged_addr.tolist() == [1064, 1224, 1032, 1192]
    assert p.slot_addr.tolist() == [5000, 5016, 9000, 9016]
    assert p.nbytes.tolist() == [16] * 4 and p.total_bytes == 64
    assert p.paged_addr.dtype == p.slot_addr.dtype == p.nbytes.dtype == np.uint64


def test_plan_merges_runs_adjacent_on_both_sides():
    r = LayerRegion(
        base=0, num_blocks=100, segments=1, segment_bytes=64, block_stride=64, segment_stride=0
    )
    slots = np.array([[6400, 6464, 6528, 9000]], dtype=np.uint64)
    p = plan([r], [10, 11, 12, 13], slots)
    assert p.paged_addr.tolist() == [640, 832] and p.slot_addr.tolist() == [6400, 9000]
    assert p.nbytes.tolist() == [192, 64]
    assert len(plan([r], [10, 11, 12, 13], slots, merge=False)) == 4


def test_plan_never_merges_kv_first():
    r = LayerRegion(
        base=0, num_blocks=100, segments=2, segment_bytes=64, block_stride=64, segment_stride=6400
    )
    slots = (100_000 + 128 * np.arange(5, dtype=np.uint64))[None]
    assert len(plan([r], np.arange(5), slots)) == 10


def test_plan_mixed_segment_counts():
    kv = LayerRegion(0, 8, 2, 32, 32, 256)
    mla = LayerRegion(10_000, 8, 1, 48, 96, 0)
    p = plan([kv, mla], [1, 3], np.array([[50_000, 60_000], [70_000, 80_000]]), merge=False)
    assert len(p) == 6 and p.total_bytes == 2 * 64 + 2 * 48
    assert p.slot_addr.tolist() == [50_000, 50_032, 60_000, 60_032, 70_000, 80_000]
    assert p.paged_addr.tolist()[4:] == [10_096, 10_288]


@pytest.mark.parametrize("bad,layer", [(10, 1), (11, 1), (50, 0), (-1, 0)])
def test_plan_rejects_out_of_range_block(bad, layer):
    ok = LayerRegion(0, 50, 1, 16, 16, 0)
    small = LayerRegion(0, 10, 1, 16, 16, 0)
    slots = np.zeros((3, 3), dtype=np.uint64)
    with pytest.raises(ValueError, match=rf"block id {bad} out of range .*layer index {layer}"):
        plan([ok, small, ok], [1, bad, 2], slots)


def test_plan_rejects_bad_slot_shape():
    r = LayerRegion(0, 10, 1, 16, 16, 0)
    with pytest.raises(ValueError, match="shape"):
        plan([r], [1, 2], np.zeros((2, 2), dtype=np.uint64))


def test_plan_empty():
    r = LayerRegion(0, 10, 2, 16, 16, 160)
    p = plan([r], np.array([], dtype=np.int64), np.zeros((1, 0), dtype=np.uint64))
    assert len(p) == 0 and p.total_bytes == 0
    assert HostCopier().save(p) == 0


def test_split_pieces_covers_every_byte_once():
    rng = np.random.default_rng(3)
    n = rng.integers(1, 300, 50).astype(np.uint64)
    src = rng.integers(0, 1 << 40, 50).astype(np.uint64)
    dst = rng.integers(0, 1 << 40, 50).astype(np.uint64)
    s, d, k = split_pieces(src, dst, n, 48)
    assert k.max() <= 48 and k.sum() == n.sum()
    owner = np.repeat(np.arange(50), ((n + np.uint64(47)) // np.uint64(48)).astype(np.int64))
    assert np.array_equal(s - src[owner], d - dst[owner])  # same offset on both sides
    merged = merge_adjacent(Pieces(s, d, k))  # chunks of one piece fuse back into it
    assert merged.nbytes.tolist() == n.tolist() and merged.slot_addr.tolist() == dst.tolist()


# ---------------------------------------------------------------- host copier, every byte


def _roundtrip_case(
    specs,
    copier,
    rng,
    *,
    ids=None,
    pool_gap=0,
    pool_base=0,
    shuffle=True,
    device="cpu",
):
    """Save random blocks into a pool, check every pool byte; load them into other blocks of
    fresh layers, check every layer byte. Returns the pieces of the save."""
    layers = [make_layer(s, rng, device) for s in specs]
    tensors = [t for t, _ in layers]
    kinds = [s.kind for s in specs]
    nb = min(s.num_blocks for s in specs)
    ids = rng.choice(nb, size=min(9, nb), replace=False) if ids is None else np.asarray(ids)
    regions = [region_from_tensor(t, k) for t, k in zip(tensors, kinds, strict=True)]
    pool = make_pool(
        [r.slot_bytes for r in regions],
        len(ids),
        rng,
        gap=pool_gap,
        base=pool_base,
        shuffle=shuffle,
        device=device,
    )
    before = [raw.clone() for _, raw in layers]

    pieces = plan(regions, ids, pool.addrs)
    assert copier.save(pieces) == sum(r.slot_bytes for r in regions) * len(ids)
    images = reference_gather(tensors, kinds, ids)
    assert torch.equal(pool.buf, expected_pool(pool, images)), "pool bytes differ"
    for (_, raw), old in zip(layers, before, strict=True):
        assert torch.equal(raw, old), "save touched the paged cache"

    # load the same slots into other blocks of fresh layers
    targets = rng.permutation(nb)[: len(ids)]
    fresh = [make_layer(s, rng, device) for s in specs]
    want_raws = [raw.clone() for _, raw in fresh]
    want = [s.build(w) for s, w in zip(specs, want_raws, strict=True)]
    reference_scatter(want, kinds, targets, images)
    fresh_regions = [region_from_tensor(t, k) for (t, _), k in zip(fresh, kinds, strict=True)]
    pool_before = pool.buf.clone()
    assert copier.load(plan(fresh_regions, targets, pool.addrs)) == pieces.total_bytes
    for (_, raw), w in zip(fresh, want_raws, strict=True):
        assert torch.equal(raw, w), "loaded layer bytes differ"
    assert torch.equal(pool.buf, pool_before), "load touched the pool"
    return pieces


@pytest.mark.parametrize("mode", HOST_MODES)
@pytest.mark.parametrize("kind,order", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_host_every_layout_and_dtype(mode, kind, order, dtype):
    rng = np.random.default_rng(hash((kind, order, str(dtype))) % 2**32)
    specs = [layer_spec(kind, order, dtype, num_blocks=20 + i) for i in range(3)]
    _roundtrip_case(specs, host_copier(mode), rng)


@pytest.mark.parametrize("mode", HOST_MODES)
@pytest.mark.parametrize(
    "kind,order", [("kv_first", "NHD"), ("blocks_first", "HND_view"), ("mla", "NHD")]
)
def test_host_odd_sizes_and_unaligned_addresses(mode, kind, order):
    """1-byte dtype, odd segment sizes, odd tensor base and odd slot offsets: the tail path."""
    rng = np.random.default_rng(11)
    specs = [
        layer_spec(kind, order, torch.uint8, num_blocks=13, bs=3, h=1, d=5, offset=o)
        for o in (1, 3, 0)
    ]
    _roundtrip_case(specs, host_copier(mode), rng, pool_gap=3, pool_base=5)


@pytest.mark.parametrize("mode", HOST_MODES)
def test_host_mixed_layouts_in_one_request(mode):
    rng = np.random.default_rng(5)
    _roundtrip_case(list(MIXED_SPECS), host_copier(mode), rng, pool_gap=1)


@pytest.mark.parametrize("mode", HOST_MODES)
@pytest.mark.parametrize("kind", ["blocks_first", "mla"])
def test_host_merged_runs(mode, kind):
    """Consecutive block ids into consecutive slots: merged into one copy per layer."""
    rng = np.random.default_rng(8)
    specs = [layer_spec(kind, "NHD", torch.float16, num_blocks=32)]
    pieces = _roundtrip_case(specs, host_copier(mode), rng, ids=np.arange(5, 17), shuffle=False)
    assert len(pieces) == 1


@pytest.mark.parametrize("mode", HOST_MODES)
def test_host_large_pieces(mode):
    """128 KiB pieces: threaded modes cut them into 64 KiB chunks across threads."""
    rng = np.random.default_rng(9)
    specs = [layer_spec("kv_first", "HND_view", torch.float16, num_blocks=8, bs=16, h=32, d=128)]
    _roundtrip_case(specs, host_copier(mode), rng, ids=[7, 0, 3])


@pytest.mark.parametrize("mode", HOST_MODES)
def test_host_repeated_layer_in_save(mode):
    """One layer listed twice (two slot arrays read the same blocks)."""
    rng = np.random.default_rng(4)
    spec = layer_spec("kv_first", "NHD", torch.float16)
    t, _ = make_layer(spec, rng)
    r = region_from_tensor(t, "kv_first")
    ids = np.array([5, 1, 17, 2])
    pool = make_pool([r.slot_bytes] * 2, len(ids), rng)
    host_copier(mode).save(plan([r, r], ids, pool.addrs))
    img = reference_gather([t], ["kv_first"], ids)[0]
    assert torch.equal(pool.buf, expected_pool(pool, [img, img]))


def test_host_load_rejects_overlapping_destinations():
    rng = np.random.default_rng(6)
    spec = layer_spec("mla", "NHD", torch.float16)
    t, _ = make_layer(spec, rng)
    r = region_from_tensor(t, "mla")
    pool = make_pool([r.slot_bytes], 3, rng)
    with pytest.raises(KVError, match="overlap on the paged side") as err:
        HostCopier().load(plan([r], [4, 9, 4], pool.addrs))
    assert err.value.code is Code.INVALID_ARGUMENT


def test_shares_already_handed_to_threads_are_waited_for_when_a_later_hand_off_fails():
    """A submit that raised (the pool shut down by close(), or the interpreter
    going down) left the shares already submitted copying while the error
    reached the store, which then unpinned and unmapped the memory under them."""
    import time

    from kvstore.copy.host import HostJob

    copier = HostCopier(num_threads=3)
    pool = copier._executor()  # white box: its hand-off fails the second time
    finished, handed = [], []
    real_submit = pool.submit

    def submit(fn):
        handed.append(fn)
        if len(handed) == 2:
            raise RuntimeError("cannot schedule new futures after shutdown")
        return real_submit(fn)

    def slow() -> None:
        time.sleep(0.3)
        finished.append("second share")

    pool.submit = submit
    job = HostJob(0, (lambda: finished.append("first share"), slow, lambda: None))
    try:
        with pytest.raises(RuntimeError, match="after shutdown"):
            copier.run(job)
        assert finished == ["second share"]  # ended before run raised; the first never ran
    finally:
        copier.close()


def test_python_and_native_backends_agree():
    if "native" not in HOST_MODES:
        pytest.skip("no C compiler")
    rng = np.random.default_rng(12)
    spec = layer_spec("kv_first", "HND_view", torch.bfloat16, num_blocks=40)
    t, _ = make_layer(spec, rng)
    r = region_from_tensor(t, "kv_first")
    ids = rng.permutation(40)[:17]
    pools = [make_pool([r.slot_bytes], len(ids), np.random.default_rng(1)) for _ in range(2)]
    for pool, mode in zip(pools, ["python", "native-threads"], strict=True):
        host_copier(mode).save(plan([r], ids, pool.addrs))
    assert torch.equal(pools[0].buf, pools[1].buf)


def test_check_disjoint_exact_path():
    """Pieces of mixed sizes closer than the largest one: decided by the exact check."""
    addr = np.array([110, 0, 100], dtype=np.uint64)
    check_disjoint(addr, np.array([190, 100, 10], dtype=np.uint64), "slot")
    with pytest.raises(KVError, match="overlap on the slot side at 0x64"):
        check_disjoint(addr, np.array([190, 101, 10], dtype=np.uint64), "slot")


def test_copier_for_devices():
    assert isinstance(copier_for("cpu"), HostCopier)
    assert copier_for("cpu") is copier_for("cpu")
    with pytest.raises(ValueError):
        copier_for("tpu:0")
    with pytest.raises(ValueError):
        copier_for("cuda:x")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(geometry=geometries())
def test_host_random_geometry(geometry: Geometry):
    _roundtrip_case(
        list(geometry.specs),
        host_copier(list(HOST_MODES)[-1]),
        geometry.rng(),
        ids=geometry.block_ids,
        pool_gap=geometry.pool_gap,
        pool_base=geometry.pool_base,
    )


# ---------------------------------------------------------------- GPU


class _CudaCopierSync:
    """CudaCopier on torch's current stream, waited for after each call, so the shared
    round-trip checks (which use torch ops around the copies) apply as they are."""

    def __init__(self, **kw):
        import cupy

        self.stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        self.copier = CudaCopier(0, stream=self.stream, **kw)

    def save(self, pieces):
        n = self.copier.save(pieces)
        torch.cuda.synchronize()
        return n

    def load(self, pieces):
        n = self.copier.load(pieces)
        torch.cuda.synchronize()
        return n


def _cuda_roundtrip(specs, rng, copier_kw=None, **kw):
    """Run _roundtrip_case with every tensor and the pool on the GPU."""
    copier = _CudaCopierSync(**(copier_kw or {}))
    return _roundtrip_case(specs, copier, rng, device="cuda", **kw)


class _FakeKernel:
    """Runs kvstore_copy_chunks' contract on the host: table = [src..., dst..., nbytes...]."""

    def __init__(self):
        self.launches: list[int] = []
        self.kernel = types.SimpleNamespace(ptr=1234)  # the CUfunction occupancy takes

    def __call__(self, grid, block, args, stream=None):
        d_table, count = args
        count, table = int(count), d_table.host
        assert table.dtype == np.uint64 and len(table) == 3 * count
        assert 1 <= grid[0] <= 65535 and block == (256,)
        for b in range(grid[0]):  # blocks stride over the chunks
            for c in range(b, count, grid[0]):
                ctypes.memmove(int(table[count + c]), int(table[c]), int(table[2 * count + c]))
        self.launches.append(count)


class _FakeDevice(contextlib.nullcontext):
    attributes = {"MultiProcessorCount": 4}


class _FakeDeviceArray:
    def __init__(self, n, dtype):
        self.host = np.zeros(n, dtype=dtype)

    def set(self, arr, stream=None):
        self.host[:] = arr


@pytest.mark.parametrize("chunk", [16, 48, 64 << 10])
@pytest.mark.parametrize("kind,order", [("kv_first", "HND_view"), ("mla", "NHD")])
def test_cuda_copier_host_side_with_fake_cupy(monkeypatch, kind, order, chunk):
    """Without a GPU: CudaCopier's planning, chunking and table upload, through a fake CuPy
    whose kernel follows the .cu contract. Exactly one launch per save and per load."""
    kernel = _FakeKernel()
    fake = types.SimpleNamespace(
        uint64=np.uint64,
        empty=_FakeDeviceArray,
        RawModule=lambda code, options=(): types.SimpleNamespace(
            get_function=lambda name: kernel if name in code else None
        ),
        cuda=types.SimpleNamespace(
            Device=lambda i: _FakeDevice(),
            get_current_stream=contextlib.nullcontext,
            driver=types.SimpleNamespace(  # the blocks kernel's occupancy, asked once
                occupancyMaxActiveBlocksPerMultiprocessor=lambda fn, threads, smem: 2
            ),
        ),
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)
    rng = np.random.default_rng(31)
    specs = [layer_spec(kind, order, FP8, num_blocks=12, bs=3, h=1, d=7, offset=o) for o in (1, 0)]
    _roundtrip_case(specs, CudaCopier(0, chunk_bytes=chunk), rng, pool_gap=5, pool_base=3)
    assert len(kernel.launches) == 2


@pytest.mark.parametrize("kind,order", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_every_layout_and_dtype(kind, order, dtype):
    rng = np.random.default_rng(21)
    specs = [layer_spec(kind, order, dtype, num_blocks=30 + i, bs=16, h=2, d=64) for i in range(3)]
    _cuda_roundtrip(specs, rng)


@pytest.mark.parametrize("chunk", [16, 48, 64 << 10])
@pytest.mark.parametrize("kind", ["kv_first", "blocks_first", "mla"])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_unaligned_tail_path(kind, chunk):
    rng = np.random.default_rng(22)
    specs = [
        layer_spec(kind, "NHD", torch.uint8, num_blocks=13, bs=3, h=1, d=5 + 2 * o, offset=o)
        for o in (1, 3, 0)
    ]
    _cuda_roundtrip(specs, rng, pool_gap=3, pool_base=5, copier_kw={"chunk_bytes": chunk})


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_matches_host_and_large_pieces():
    """Pieces far larger than a chunk, many blocks: CUDA output equals the host copier's."""
    rng = np.random.default_rng(23)
    spec = layer_spec("kv_first", "HND_view", torch.bfloat16, num_blocks=64, bs=16, h=8, d=128)
    raw_gpu = torch.from_numpy(rng.integers(0, 256, spec.nbytes + 7, dtype=np.uint8)).cuda()
    t_gpu = spec.build(raw_gpu)
    t_cpu = spec.build(raw_gpu.cpu())
    ids = rng.permutation(64)[:40]
    slot = region_from_tensor(t_cpu, "kv_first").slot_bytes
    offsets = (rng.permutation(40) * slot)[None]
    host_pool = torch.zeros(40 * slot, dtype=torch.uint8)
    gpu_pool = torch.zeros(40 * slot, dtype=torch.uint8, device="cuda")
    HostCopier().save(
        plan(
            [region_from_tensor(t_cpu, "kv_first")],
            ids,
            (host_pool.data_ptr() + offsets).astype(np.uint64),
        )
    )
    c = _CudaCopierSync()
    c.save(
        plan(
            [region_from_tensor(t_gpu, "kv_first")],
            ids,
            (gpu_pool.data_ptr() + offsets).astype(np.uint64),
        )
    )
    assert torch.equal(gpu_pool.cpu(), host_pool)


def test_one_thread_copies_without_a_pool():
    """With num_threads 1 (a one-CPU host: min(4, os.cpu_count())) run() made a
    ThreadPoolExecutor of 0 workers, which raises: every host Save and Load failed."""
    src = torch.arange(1 << 20, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    pieces = Pieces(
        np.array([src.data_ptr()], dtype=np.uint64),
        np.array([dst.data_ptr()], dtype=np.uint64),
        np.array([src.numel()], dtype=np.uint64),
    )
    copier = HostCopier(num_threads=1, parallel_min_bytes=1)  # 1 MiB: "parallel", one thread
    assert copier.save(pieces) == src.numel()
    assert torch.equal(src, dst)
    copier.close()
