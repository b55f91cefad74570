"""GPU copy path: one CUDA launch per request moves every piece (docs/design.md §3).

The kernel source ships inside the package (``kvstore/copy/kernels/``, also
reachable as the repository's top-level ``kernels/``) and is compiled at run
time by CuPy through NVRTC (cached by CuPy per device and source). CuPy is
imported lazily so the host path works without it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvstore.copy.plan import Pieces, check_disjoint, split_pieces
from kvstore.copy.table import RegionTable

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
KERNEL_FILE = KERNELS_DIR / "copy.cu"
KERNEL_NAME = "kvstore_copy_chunks"
BLOCKS_KERNEL_NAME = "kvstore_copy_blocks"
MAX_GRID = 65535  # CUDA blocks stride over chunks beyond this
VECTOR_BYTES = 16  # one uint4 load / store
DEPTH = 8  # loads in flight per thread in kvstore_copy_blocks (copy_range<8>)
MIN_GROUP = 32  # a warp
MAX_THREADS_PER_BLOCK = 1024  # CUDA's limit
DESC_WORDS = 8  # u64 words of one LayerDesc row in copy.cu
STAGING_RING = 2  # pinned input buffers, used in turn


class BlocksLaunch(NamedTuple):
    """How a table's requests are cut for kvstore_copy_blocks: a group of `group` threads
    moves one item of at most `chunk` bytes; `items_per_block` items per request block."""

    group: int
    chunk: int
    items_per_block: int


class DeviceFault(RuntimeError):
    """A CUDA call failed under a copy (a launch, or the wait that reports a fault of
    the kernel): the device's error; after an illegal address its context is lost."""


def cuda_errors() -> tuple[type[Exception], ...]:
    """What CuPy raises for a failed CUDA runtime or driver call (none without CuPy)."""
    try:
        from cupy_backends.cuda.api import driver, runtime
    except ImportError:
        return ()
    return (runtime.CUDARuntimeError, driver.CUDADriverError)


def kernel_source() -> str:
    return KERNEL_FILE.read_text()


def check_threads_per_block(threads_per_block: int) -> None:
    """A power of two from a warp to CUDA's 1,024: the blocks kernel cuts a CTA
    into whole groups of a power-of-two size (fewer threads than a warp make no
    group; other counts leave a partial group copying its neighbour's bytes)."""
    n = threads_per_block
    if not (isinstance(n, int) and MIN_GROUP <= n <= MAX_THREADS_PER_BLOCK and n & (n - 1) == 0):
        raise ValueError(
            f"threads_per_block must be a power of two from {MIN_GROUP} to "
            f"{MAX_THREADS_PER_BLOCK}, got {threads_per_block!r}"
        )


def blocks_launch(table: RegionTable, threads_per_block: int) -> BlocksLaunch:
    """Group and chunk for a table: the largest power-of-two group (a warp up to the CTA)
    that still gives every thread DEPTH vectors of the smallest segment."""
    group = MIN_GROUP
    while group * 2 <= threads_per_block and group * 2 * VECTOR_BYTES * DEPTH <= (
        table.min_segment_bytes
    ):
        group *= 2
    chunk = group * VECTOR_BYTES * DEPTH
    seg = table.descriptors[:, 3].astype(np.int64)
    per_block = int((table.descriptors[:, 4].astype(np.int64) * (-(-seg // chunk))).sum())
    return BlocksLaunch(group, chunk, per_block)


def layer_rows(table: RegionTable, launch: BlocksLaunch) -> np.ndarray:
    """The LayerDesc rows of copy.cu for a table cut by `launch` (uint64, layers x 8)."""
    d = table.descriptors.astype(np.uint64)
    seg, segments = d[:, 3], d[:, 4]
    items_per_segment = (seg + np.uint64(launch.chunk - 1)) // np.uint64(launch.chunk)
    per_block = segments * items_per_segment
    first = np.concatenate((np.zeros(1, np.uint64), np.cumsum(per_block)[:-1]))
    rows = np.zeros((len(d), DESC_WORDS), dtype=np.uint64)
    rows[:, :5] = d[:, :5]
    rows[:, 5] = items_per_segment
    rows[:, 6] = first
    return rows


class CudaCopier:
    """Moves a request's bytes between device memory ranges on one GPU.

    ``save_blocks``/``load_blocks`` (the hot path): the table's per-layer rows
    are uploaded once per table and device; per request the block ids and
    slot addresses go through a reused pinned buffer into a reused device
    buffer, and `kvstore_copy_blocks` computes every piece on the GPU, on a
    persistent grid sized from the kernel's measured occupancy. Work runs on
    the copier's own stream (one per copier); a caller's `stream` is ordered
    before it and waits for it. ``wait=True`` returns once the bytes are in place.

    ``save``/``load`` (the older path, for planned `Pieces`): pieces are cut
    into chunks of at most `chunk_bytes`, uploaded as one table, and copied by
    `kvstore_copy_chunks` on `stream` (per call, else the one given at
    construction, else CuPy's current stream). All return the bytes moved once
    the work is enqueued.
    """

    def __init__(
        self,
        device: int = 0,
        stream: Any | None = None,
        threads_per_block: int = 256,
        chunk_bytes: int = 64 << 10,
        check_overlap: bool = True,
    ) -> None:
        if chunk_bytes % 16:
            raise ValueError("chunk_bytes must be a multiple of 16 to keep 16-byte alignment")
        check_threads_per_block(threads_per_block)
        import cupy

        self._cp = cupy
        self.device = device
        self.stream = stream
        self.threads_per_block = threads_per_block
        self.chunk_bytes = chunk_bytes
        self.check_overlap = check_overlap
        with cupy.cuda.Device(device):
            module = cupy.RawModule(code=kernel_source(), options=("--std=c++17",))
            self._kernel = module.get_function(KERNEL_NAME)
            self._blocks_kernel = module.get_function(BLOCKS_KERNEL_NAME)
        self._lock = threading.Lock()
        self._own_stream: Any | None = None  # made on first blocks call
        self._max_ctas = 0  # persistent grid: CTAs resident at once (occupancy x SMs)
        self._tables: weakref.WeakKeyDictionary[RegionTable, _DeviceTable] = (
            weakref.WeakKeyDictionary()
        )
        self._staging = _PinnedRing(cupy, STAGING_RING)
        self.occupancy_grid()  # a CTA size that cannot launch is refused here, not per call
        self._inputs: Any | None = None  # device buffer of the last request's inputs

    # ------------------------------------------------------------ blocks path

    def save_blocks(
        self,
        table: RegionTable,
        block_ids: Sequence[int] | np.ndarray,
        slot_addrs: np.ndarray,
        stream: Any | None = None,
        *,
        wait: bool = False,
    ) -> int:
        """Paged KV -> slots for `block_ids`; `slot_addrs[l, i]` is block i's slot of layer l.

        Raises KVError INVALID_ARGUMENT (nothing enqueued) for ids out of range or
        repeated, or slots of the wrong shape.
        """
        return self._blocks(table, block_ids, slot_addrs, True, stream, wait)

    def load_blocks(
        self,
        table: RegionTable,
        block_ids: Sequence[int] | np.ndarray,
        slot_addrs: np.ndarray,
        stream: Any | None = None,
        *,
        wait: bool = False,
    ) -> int:
        """Slots -> paged KV (see save_blocks)."""
        return self._blocks(table, block_ids, slot_addrs, False, stream, wait)

    def occupancy_grid(self) -> int:
        """CTAs of kvstore_copy_blocks resident at once on this device: the persistent grid."""
        if not self._max_ctas:
            cp = self._cp
            with cp.cuda.Device(self.device):
                per_sm = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                    self._blocks_kernel.kernel.ptr, self.threads_per_block, 0
                )  # a RawKernel's CUfunction is its .kernel's .ptr
                sms = cp.cuda.Device(self.device).attributes["MultiProcessorCount"]
            if per_sm < 1:  # every launch would fail "too many resources requested"
                raise ValueError(
                    f"threads_per_block {self.threads_per_block}: no CTA of "
                    f"{BLOCKS_KERNEL_NAME} fits on an SM of cuda:{self.device} (its registers "
                    f"per thread x {self.threads_per_block} exceed the SM's); use 256"
                )
            self._max_ctas = per_sm * sms
        return self._max_ctas

    def _blocks(self, table, block_ids, slot_addrs, save: bool, stream, wait: bool) -> int:
        args = table.check(block_ids, slot_addrs, distinct=not save)
        cp = self._cp
        if not save and not table.paged_disjoint:  # not proven apart: the sorting path,
            if stream is None:  # after earlier blocks calls, on their stream
                with self._lock, cp.cuda.Device(self.device):
                    stream = self._stream()
            return self._synced(self.load(table.pieces(args), stream), stream, wait)
        total = args.num_blocks * table.bytes_per_block
        if total == 0:
            return 0
        with self._lock, cp.cuda.Device(self.device):
            dev = self._device_table(table)
            s = self._stream()
            if stream is not None:
                s.wait_event(stream.record())  # the caller's earlier work comes first
            n = args.num_blocks * (len(table) + 1)
            slot, host = self._staging.take(n)
            try:
                host[: args.num_blocks] = args.ids.view(np.uint64)
                host[args.num_blocks :] = args.slots.ravel()
                inputs = self._device_inputs(n, s)
                inputs.data.copy_from_host_async(host.ctypes.data, n * 8, s)
                items = args.num_blocks * dev.launch.items_per_block
                groups_per_cta = self.threads_per_block // dev.launch.group
                grid = min(-(-items // groups_per_cta), self.occupancy_grid())
                self._blocks_kernel(
                    (grid,),
                    (self.threads_per_block,),
                    (dev.rows, np.uint32(len(table)), inputs, np.uint64(args.num_blocks),
                     np.uint64(items), np.uint64(dev.launch.chunk), np.uint32(dev.launch.group),
                     np.uint32(save)),
                    stream=s,
                )  # fmt: skip
            finally:  # a failed launch too: the upload out of the slot may still be queued
                done = s.record()
                self._staging.release(slot, done)
            if stream is not None:
                stream.wait_event(done)
        if wait:
            done.synchronize()
        return total

    def _synced(self, nbytes: int, stream: Any | None, wait: bool) -> int:
        if wait:
            with self._cp.cuda.Device(self.device):  # the stream the work went to
                self._pick_stream(stream).synchronize()
        return nbytes

    def _stream(self) -> Any:
        """The copier's one stream (made on first use): under the lock and on the
        copier's device, as every use of its reused input buffers must be."""
        if self._own_stream is None:
            self._own_stream = self._cp.cuda.Stream(non_blocking=True)
        return self._own_stream

    def _device_table(self, table: RegionTable) -> _DeviceTable:
        """The table's rows on this device, uploaded on first use and kept with the table."""
        dev = self._tables.get(table)
        if dev is None:
            launch = blocks_launch(table, self.threads_per_block)
            with self._stream():
                rows = self._cp.asarray(layer_rows(table, launch))
            dev = _DeviceTable(launch, rows)
            self._tables[table] = dev
        return dev

    def _device_inputs(self, n: int, s: Any) -> Any:
        """A device buffer of at least n u64, grow-only; reused in the order of stream s."""
        held = 0 if self._inputs is None else self._inputs.size
        if held < n:
            with s:
                self._inputs = self._cp.empty(max(n, 2 * held), self._cp.uint64)
        return self._inputs[:n]

    # ------------------------------------------------------------ pieces path

    def save(self, pieces: Pieces, stream: Any | None = None) -> int:
        """Paged KV -> slots (enqueued on the stream)."""
        return self._launch(pieces.paged_addr, pieces.slot_addr, pieces.nbytes, "slot", stream)

    def load(self, pieces: Pieces, stream: Any | None = None) -> int:
        """Slots -> paged KV (enqueued on the stream)."""
        return self._launch(pieces.slot_addr, pieces.paged_addr, pieces.nbytes, "paged", stream)

    def _launch(
        self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, side: str, stream: Any | None
    ) -> int:
        if len(nbytes) == 0:
            return 0
        if self.check_overlap:
            check_disjoint(dst, nbytes, side)
        total = int(nbytes.sum(dtype=np.uint64))
        src, dst, nbytes = split_pieces(src, dst, nbytes, self.chunk_bytes)
        table = np.ascontiguousarray(np.concatenate([src, dst, nbytes]), dtype=np.uint64)
        count = len(nbytes)
        cp = self._cp
        with cp.cuda.Device(self.device):
            s = self._pick_stream(stream)
            with s:  # the table's memory belongs to this stream, so reuse is stream-ordered
                d_table = cp.empty(table.size, dtype=cp.uint64)
                d_table.set(table, stream=s)
                grid = (min(count, MAX_GRID),)
                block = (self.threads_per_block,)
                self._kernel(grid, block, (d_table, np.uint64(count)), stream=s)
        return total

    def _pick_stream(self, stream: Any | None) -> Any:
        """The call's stream, else the copier's, else CuPy's current one."""
        if stream is not None:
            return stream
        if self.stream is not None:
            return self.stream
        return self._cp.cuda.get_current_stream()


class _DeviceTable(NamedTuple):
    """A table's kvstore_copy_blocks rows on one device, with the cut they were made for."""

    launch: BlocksLaunch
    rows: Any  # cupy uint64 array, layers x DESC_WORDS


class _PinnedRing:
    """Pinned host buffers for the request inputs, used in turn and grown on demand.

    A buffer is reused only after the event of its last upload has passed, so
    the asynchronous copy never reads bytes of the next request.
    """

    def __init__(self, cupy: Any, count: int) -> None:
        self._cp = cupy
        self._buffers: list[np.ndarray | None] = [None] * count
        self._events: list[Any | None] = [None] * count
        self._next = 0

    def take(self, n: int) -> tuple[int, np.ndarray]:
        """(slot, a pinned uint64 view of n words), waiting for the slot's last upload."""
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        event = self._events[slot]
        if event is not None:
            event.synchronize()
        buf = self._buffers[slot]
        if buf is None or buf.size < n:
            size = max(n, 2 * (0 if buf is None else buf.size), 1 << 12)
            mem = self._cp.cuda.alloc_pinned_memory(size * 8)
            buf = np.frombuffer(mem, dtype=np.uint64, count=size)
            self._buffers[slot] = buf
        return slot, buf[:n]

    def release(self, slot: int, event: Any) -> None:
        self._events[slot] = event
