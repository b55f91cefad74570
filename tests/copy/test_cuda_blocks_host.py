"""CudaCopier's blocks path without a GPU: the real kernel code, run on the host.

copy.cu's work is __host__ __device__, so nvcc builds it into a host library
that runs every thread of every CTA of a launch one after another (threads of
the kernel never depend on each other). A stand-in for CuPy whose "device"
memory is host memory hands CudaCopier's launches to that library, so what is
checked byte for byte against the torch oracle is CudaCopier's own packing of
block ids, slot addresses and layer rows, and the kernel's address arithmetic.
On a GPU, tests/copy/test_copy.py and the marked tests below run the real thing.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from kvstore.copy import RegionTable, region_from_tensor
from kvstore.copy.cuda import (
    BLOCKS_KERNEL_NAME,
    KERNEL_NAME,
    KERNELS_DIR,
    CudaCopier,
    blocks_launch,
    layer_rows,
)
from kvstore.copy.testing import reference_gather
from kvstore.wire.errors import KVError
from tests.copy.geometry import FP8, LAYOUTS, layer_spec, make_layer, make_pool
from tests.copy.test_blocks import paged_layers, roundtrip, save_one_block_twice, spec_layers

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
HAS_CUDA = torch.cuda.is_available()

EMULATOR = r"""
#include "copy.cu"

// Every thread of every CTA of one kvstore_copy_blocks launch, one after another.
extern "C" int emulate_blocks(const LayerDesc* layers, unsigned num_layers, const u64* inputs,
                              u64 blocks, u64 total, u64 chunk, unsigned group, unsigned save,
                              unsigned grid, unsigned nthreads) {
    const long long* ids = reinterpret_cast<const long long*>(inputs);
    for (unsigned cta = 0; cta < grid; ++cta)
        for (unsigned tid = 0; tid < nthreads; ++tid)
            copy_blocks_thread(layers, num_layers, ids, inputs + blocks, blocks, total, chunk,
                               group, save, cta, grid, tid, nthreads);
    return 0;
}
"""


@pytest.fixture(scope="module")
def emulator(tmp_path_factory) -> ctypes.CDLL:
    out = tmp_path_factory.mktemp("emu")
    src, lib = out / "emulator.cu", out / "emulator.so"
    src.write_text(EMULATOR)
    cmd = [NVCC, "-std=c++17", "-shared", "-Xcompiler", "-fPIC", f"-I{KERNELS_DIR}", "-o",
           str(lib), str(src)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return ctypes.CDLL(str(lib))


class HostArray:
    """A 'device' array that is host memory (what the stand-in CuPy allocates)."""

    def __init__(self, host: np.ndarray) -> None:
        self.host = host
        self.size = host.size
        data = types.SimpleNamespace(copy_from_host_async=self._copy_from_host)
        self.data = Strict(data, cupy_real().cuda.MemoryPointer)

    def __getitem__(self, key) -> Strict:
        return device_array(self.host[key])

    def _copy_from_host(self, ptr: int, nbytes: int, stream=None) -> None:
        ctypes.memmove(self.host.ctypes.data, ptr, nbytes)

    @property
    def ptr(self) -> int:
        return self.host.ctypes.data


def device_array(host: np.ndarray) -> Strict:
    return Strict(HostArray(host), cupy_real().ndarray)


class Launches:
    """The kernel functions of the stand-in module; the blocks kernel runs on the emulator."""

    def __init__(self, emulator: ctypes.CDLL, sms: int, per_sm: int) -> None:
        self.emulate = emulator.emulate_blocks
        self.emulate.restype = ctypes.c_int
        self.grids: list[tuple[int, int]] = []  # (grid, items) per blocks launch
        self.sms, self.per_sm = sms, per_sm

    def function(self, name: str):
        real = cupy_real().RawKernel
        if name == BLOCKS_KERNEL_NAME:
            return Strict(_Kernel(self._blocks), real)
        assert name == KERNEL_NAME
        return Strict(_Kernel(lambda *a, **k: pytest.fail("the chunks kernel was launched")), real)

    def _blocks(self, grid, block, args, stream=None):
        rows, num_layers, inputs, blocks, total, chunk, group, save = args
        rows, inputs = fake(rows), fake(inputs)
        assert stream is not None and block[0] % int(group) == 0 and int(group) >= 32
        assert 1 <= grid[0] <= self.sms * self.per_sm
        c = ctypes
        self.emulate(c.c_void_p(rows.ptr), c.c_uint(int(num_layers)), c.c_void_p(inputs.ptr),
                     c.c_uint64(int(blocks)), c.c_uint64(int(total)), c.c_uint64(int(chunk)),
                     c.c_uint(int(group)), c.c_uint(int(save)), c.c_uint(grid[0]),
                     c.c_uint(block[0]))  # fmt: skip
        self.grids.append((grid[0], int(total)))


class _Kernel:
    """A launchable function (a RawKernel) with the CUfunction occupancy takes."""

    def __init__(self, run) -> None:
        self.run = run
        self.kernel = Strict(types.SimpleNamespace(ptr=1234), cupy_real().cuda.function.Function)

    def __call__(self, *args, **kwargs):
        return self.run(*args, **kwargs)


@functools.cache
def cupy_real():
    """Real CuPy (asked first before the stand-in replaces it in sys.modules)."""
    return pytest.importorskip("cupy")


class Strict:
    """A stand-in that answers only the names its CuPy counterpart has: a copier
    that asks for a name real CuPy lacks fails here, not on a lent GPU (it once
    took a RawKernel's ``ptr``, which is its ``kernel.ptr``, and no copier could be
    made on any GPU)."""

    __slots__ = ("_fake", "_real")

    def __init__(self, fake, real) -> None:
        object.__setattr__(self, "_fake", fake)
        object.__setattr__(self, "_real", real)

    def __getattr__(self, name: str):
        if not hasattr(self._real, name):
            raise AttributeError(f"CuPy's {self._real.__name__} has no {name!r}")
        return getattr(self._fake, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._fake, name, value)

    def __call__(self, *args, **kwargs):
        return self._fake(*args, **kwargs)

    def __getitem__(self, key):
        return self._fake[key]

    def __enter__(self):
        self._fake.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._fake.__exit__(*exc)


def fake(obj):
    """The stand-in behind a Strict one (what the emulator reads)."""
    return obj._fake if isinstance(obj, Strict) else obj


CURRENT_DEVICE = [0]  # the fake's current device, set by ``with Device(i)``


class Stream:
    def __init__(self, non_blocking: bool = False) -> None:
        self.waited: list[object] = []
        self.device = CURRENT_DEVICE[0]  # CUDA makes a stream on the current device

    def record(self):
        return Strict(types.SimpleNamespace(synchronize=lambda: None), cupy_real().cuda.Event)

    def wait_event(self, event) -> None:
        self.waited.append(event)

    def synchronize(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


@pytest.fixture
def fake_cupy(monkeypatch, emulator):
    """CuPy as far as CudaCopier uses it, host memory standing in for the device's."""
    real = cupy_real()
    launches = Launches(emulator, sms=3, per_sm=2)
    module = types.SimpleNamespace(get_function=launches.function)
    driver = types.SimpleNamespace(
        occupancyMaxActiveBlocksPerMultiprocessor=lambda fn, threads, smem: launches.per_sm
    )
    cuda = types.SimpleNamespace(
        Device=lambda i=0: Strict(_Device(launches.sms, i), real.cuda.Device),
        Stream=lambda non_blocking=False: Strict(Stream(non_blocking), real.cuda.Stream),
        get_current_stream=lambda: Strict(Stream(), real.cuda.Stream),
        alloc_pinned_memory=bytearray,
        driver=Strict(driver, real.cuda.driver),
    )
    stand_in = types.SimpleNamespace(
        uint64=np.uint64,
        empty=lambda n, dtype: device_array(np.zeros(n, dtype=dtype)),
        asarray=lambda a: device_array(np.ascontiguousarray(a)),
        RawModule=lambda code, options=(): Strict(module, real.RawModule),
        cuda=Strict(cuda, real.cuda),
    )
    monkeypatch.setitem(sys.modules, "cupy", Strict(stand_in, real))
    return launches


class _Device:
    def __init__(self, sms: int, index: int = 0) -> None:
        self.attributes = {"MultiProcessorCount": sms}
        self.index, self._before = index, []

    def __enter__(self):
        self._before.append(CURRENT_DEVICE[0])
        CURRENT_DEVICE[0] = self.index
        return self

    def __exit__(self, *exc) -> None:
        CURRENT_DEVICE[0] = self._before.pop()


@pytest.mark.parametrize("kind,order", LAYOUTS)
def test_cuda_blocks_every_layout(fake_cupy, kind, order):
    rng = np.random.default_rng(60)
    tensors, raws = spec_layers(kind, order, torch.bfloat16, rng)
    roundtrip(tensors, [kind] * 3, raws, CudaCopier(0), rng, rng.permutation(20)[:9])
    assert len(fake_cupy.grids) == 2  # one launch per save, one per load


def test_cuda_blocks_paged_views_unaligned_and_mixed(fake_cupy):
    rng = np.random.default_rng(61)
    tensors, raw = paged_layers(4, 16, rng, lead=6)
    roundtrip(tensors, ["paged"] * 4, [raw], CudaCopier(0), rng, [3, 15, 0, 7, 8], pool_gap=5,
              pool_base=3)  # fmt: skip
    odd = layer_spec("kv_first", "HND_view", FP8, num_blocks=12, bs=3, h=1, d=7, offset=1)
    mla = layer_spec("mla", "NHD", torch.float16, num_blocks=12, h=1, d=36)
    layers = [make_layer(odd, rng), make_layer(mla, rng)]
    roundtrip([t for t, _ in layers], ["kv_first", "mla"], [r for _, r in layers], CudaCopier(0),
              rng, [11, 2, 5], pool_gap=3, pool_base=5)  # fmt: skip


def test_cuda_blocks_large_segments_use_the_whole_cta_and_a_persistent_grid(fake_cupy):
    """32 KiB segments: groups of 256 threads, items of 32 KiB, grid capped at SMs x occupancy
    (6 here) while there are far more items; every byte still lands."""
    rng = np.random.default_rng(62)
    spec = layer_spec("kv_first", "NHD", torch.float16, num_blocks=10, bs=16, h=8, d=128)
    layers = [make_layer(spec, rng) for _ in range(2)]
    tensors, raws = [t for t, _ in layers], [r for _, r in layers]
    table = roundtrip(tensors, ["kv_first"] * 2, raws, CudaCopier(0), rng, [9, 0, 4, 5])
    assert blocks_launch(table, 256) == (256, 32 << 10, 2 * 2 * 1)
    assert fake_cupy.grids == [(6, 4 * 4), (6, 4 * 4)]


def test_cuda_blocks_table_rows_uploaded_once(fake_cupy):
    """The layer rows go to the device on first use of a table and are reused after."""
    rng = np.random.default_rng(63)
    tensors, _ = spec_layers("mla", "NHD", torch.float16, rng)
    table = RegionTable([region_from_tensor(t, "mla") for t in tensors])
    copier, uploads = CudaCopier(0), []
    real_asarray = sys.modules["cupy"].asarray
    sys.modules["cupy"].asarray = lambda a: uploads.append(a.shape) or real_asarray(a)
    pool = torch.zeros(3 * 4 * table.regions[0].slot_bytes, dtype=torch.uint8)
    for ids in ([1, 2, 3, 4], [7, 0, 9, 5], [19, 18, 17, 16]):
        slots = pool.data_ptr() + table.regions[0].slot_bytes * np.arange(12).reshape(3, 4)
        copier.save_blocks(table, ids, slots.astype(np.uint64), wait=True)
        images = reference_gather(tensors, ["mla"] * 3, ids)
        assert torch.equal(pool.view(3, 4, -1), torch.stack(images))
    assert uploads == [(3, 8)]
    launch = blocks_launch(table, 256)
    assert layer_rows(table, launch)[:, 6].tolist() == [0, 1, 2]  # first item of each layer


def test_cuda_blocks_refuses_repeated_ids_before_any_launch(fake_cupy):
    rng = np.random.default_rng(64)
    tensors, _ = spec_layers("kv_first", "NHD", torch.float16, rng)
    table = RegionTable([region_from_tensor(t, "kv_first") for t in tensors])
    slots = np.arange(9, dtype=np.uint64).reshape(3, 3) * 4096 + (1 << 40)  # never touched
    with pytest.raises(KVError, match=r"block_ids\[2\] = 4 repeats block_ids\[0\]"):
        CudaCopier(0).load_blocks(table, [4, 9, 4], slots)
    assert fake_cupy.grids == []


def test_the_copiers_stream_is_made_on_its_own_device_whichever_path_comes_first(fake_cupy):
    """A copier of cuda:1 whose first blocks call was a load not proven disjoint
    (here a layer listed twice, refused) made its one stream outside the lock and
    on the current device, 0: every later blocks launch on cuda:1 went to a
    stream of GPU 0 ("invalid resource handle"), and two first calls at once
    could make two streams, breaking the one-stream reuse of its buffers."""
    rng = np.random.default_rng(65)
    tensors, _ = spec_layers("kv_first", "NHD", torch.float16, rng)
    region = region_from_tensor(tensors[0], "kv_first")
    table = RegionTable([region, region])
    assert not table.paged_disjoint
    slots = np.arange(4, dtype=np.uint64).reshape(2, 2) * 4096 + (1 << 40)  # never touched
    copier = CudaCopier(1)
    with pytest.raises(KVError):
        copier.load_blocks(table, [1, 2], slots)
    assert fake(copier._stream()).device == 1  # white box: the copier's own stream


def test_a_cta_size_no_sm_can_hold_is_refused_when_the_copier_is_made(fake_cupy):
    """1,024 threads x 80 registers exceed an SM's 65,536: the occupancy query says
    0, which was taken as 1, and every launch failed "too many resources"."""
    fake_cupy.per_sm = 0
    with pytest.raises(ValueError, match="threads_per_block 1024"):
        CudaCopier(0, threads_per_block=1024)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind,order", LAYOUTS)
def test_cuda_blocks_on_the_gpu(kind, order):
    """The real kernel: save_blocks / load_blocks with wait=True, byte-exact on the device."""
    rng = np.random.default_rng(65)
    specs = [layer_spec(kind, order, torch.bfloat16, num_blocks=30 + i, bs=16, h=2, d=64)
             for i in range(3)]  # fmt: skip
    layers = [make_layer(s, rng, "cuda") for s in specs]
    copier = _WaitingCopier(CudaCopier(0))
    roundtrip([t for t, _ in layers], [kind] * 3, [r for _, r in layers], copier, rng,
              rng.permutation(30)[:17], device="cuda")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_blocks_on_the_gpu_unaligned_mixed_and_large_segments():
    """What only the emulator checked before, on the real kernel (whose misaligned
    vector loads would fault where the host's do not): vLLM's paged views 6 bytes
    off alignment; an FP8 layer of odd segments beside an MLA one (1- to 8-byte
    moves, a short last item); 32 KiB segments (groups of a whole CTA, several
    items a segment)."""
    rng = np.random.default_rng(66)
    copier = _WaitingCopier(CudaCopier(0))
    tensors, raw = paged_layers(4, 16, rng, lead=6, device="cuda")
    roundtrip(tensors, ["paged"] * 4, [raw], copier, rng, [3, 15, 0, 7, 8], pool_gap=5,
              pool_base=3, device="cuda")  # fmt: skip
    odd = layer_spec("kv_first", "HND_view", FP8, num_blocks=12, bs=3, h=1, d=7, offset=1)
    mla = layer_spec("mla", "NHD", torch.float16, num_blocks=12, h=1, d=36)
    layers = [make_layer(odd, rng, "cuda"), make_layer(mla, rng, "cuda")]
    roundtrip([t for t, _ in layers], ["kv_first", "mla"], [r for _, r in layers], copier, rng,
              [11, 2, 5], pool_gap=3, pool_base=5, device="cuda")  # fmt: skip
    big = layer_spec("kv_first", "NHD", torch.float16, num_blocks=10, bs=16, h=8, d=128)
    layers = [make_layer(big, rng, "cuda") for _ in range(2)]
    roundtrip([t for t, _ in layers], ["kv_first"] * 2, [r for _, r in layers], copier, rng,
              [9, 0, 4, 5], device="cuda")  # fmt: skip


class _WaitingCopier:
    """CudaCopier's blocks calls that return once the bytes are in place."""

    def __init__(self, copier: CudaCopier) -> None:
        self.copier = copier

    def save_blocks(self, *args):
        return self.copier.save_blocks(*args, wait=True)

    def load_blocks(self, *args):
        return self.copier.load_blocks(*args, wait=True)


def test_cuda_blocks_save_may_copy_one_block_into_two_blocks_slots(fake_cupy):
    """As the host copier: a Save may name one block_id under two hashes."""
    save_one_block_twice(_WaitingCopier(CudaCopier(0)))


@pytest.mark.parametrize("threads", [0, 16, 48, 96, 2048, 256.0])
def test_threads_per_block_is_a_power_of_two_from_a_warp(threads):
    """96 threads cut into groups of 64 left a partial group copying its
    neighbour's bytes; under 32 no group was made at all. Refused at once."""
    with pytest.raises(ValueError, match="threads_per_block must be a power of two"):
        CudaCopier(0, threads_per_block=threads)


def test_a_failed_launch_still_fences_its_staging_buffer(fake_cupy, monkeypatch):
    """The inputs' upload out of the pinned buffer is queued before the launch; a
    launch that fails must still leave an event behind it, or the buffer would be
    rewritten under that upload two requests later."""
    rng = np.random.default_rng(67)
    tensors, _ = spec_layers("kv_first", "NHD", torch.float16, rng)
    table = RegionTable([region_from_tensor(t, "kv_first") for t in tensors])
    pool = make_pool([r.slot_bytes for r in table.regions], 3, rng)
    fences: list[object] = []
    monkeypatch.setattr(Stream, "record", lambda self: fences.append(object()) or fences[-1])

    def refuse(*args, **kwargs):
        raise RuntimeError("too many resources requested for launch")

    monkeypatch.setattr(fake_cupy, "_blocks", refuse)  # the kernel the copier gets
    copier = CudaCopier(0)
    with pytest.raises(RuntimeError, match="too many resources"):
        copier.save_blocks(table, [1, 2, 3], pool.addrs)
    assert len(fences) == 1  # recorded after the upload, though the launch failed
