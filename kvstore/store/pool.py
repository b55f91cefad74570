"""The slot pool: one big allocation per device, carved into slots.

Slot sizes differ by namespace and layer, so the pool is split into equal
*slabs*; a slab serves one slot size (rounded up to ``ALIGN``) while it holds
any slot, and goes back to the shared free list the moment its last slot is
freed. Churn between sizes therefore never strands memory in a size class:
the worst case is one partly used slab per size class, and only empty slabs
move between classes. Allocation and free are O(1) per slab touched; free
slots are kept as integer stacks in numpy arrays, never as Python objects.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.wire.sizes import format_size

ALIGN = 256  # bytes; keeps every slot 16-byte aligned for the copy kernels
DEFAULT_SLAB_BYTES = 8 << 20
# A host pool at least this large is logged as it is faulted in (~2.6 s a GiB on 2 cores)
LOGGED_ZEROING_BYTES = 1 << 30

log = logging.getLogger(__name__)


def round_size(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _ascending(idx: np.ndarray) -> np.ndarray:
    """Slot indices taken off a free stack, in ascending order: slots allocated
    together then lie back to back where they can, so a block's slots are one run.
    Stacks are usually in order already (a fresh slab's, or slots freed in the
    order they were taken), so the sort is mostly a check."""
    if len(idx) < 2 or bool(np.all(idx[1:] > idx[:-1])):
        return idx.copy()
    if bool(np.all(idx[1:] < idx[:-1])):
        return idx[::-1].copy()
    return np.sort(idx)


def _slab_runs(slab_ids: np.ndarray) -> tuple[list[tuple[int, int, int]], np.ndarray | None]:
    """(slab, first, end) of each slab's stretch of ``slab_ids`` once grouped by
    slab (a stable sort, or None where they were grouped already); slots of one
    slab (a block's, as a rule) cost no sort and no scan."""
    n = len(slab_ids)
    first, last = int(slab_ids[0]), int(slab_ids[-1])
    if first == last and (n < 3 or bool((slab_ids == first).all())):
        return [(first, 0, n)], None
    order = None
    if not bool((slab_ids[1:] >= slab_ids[:-1]).all()):
        order = np.argsort(slab_ids, kind="stable")
        slab_ids = slab_ids[order]
    firsts = np.flatnonzero(np.diff(slab_ids, prepend=-1))
    ends = np.append(firsts[1:], n)
    return list(zip(slab_ids[firsts].tolist(), firsts.tolist(), ends.tolist(), strict=True)), order


@dataclass(frozen=True)
class PoolStats:
    """Bytes of one pool, or of several summed (see :meth:`PoolStats.total`)."""

    pool_bytes: int = 0
    used_bytes: int = 0
    free_bytes: int = 0

    @staticmethod
    def total(parts: list[PoolStats]) -> PoolStats:
        return PoolStats(
            sum(p.pool_bytes for p in parts),
            sum(p.used_bytes for p in parts),
            sum(p.free_bytes for p in parts),
        )


@dataclass
class _Slab:
    """A slab serving one slot size: a stack of its free slot indices."""

    slot_bytes: int
    free: np.ndarray  # int32 stack of free slot indices
    top: int  # number of free entries in ``free``

    @property
    def capacity(self) -> int:
        return len(self.free)


class SlotPool:
    """Slots of any size up to ``slab_bytes`` out of one allocation on ``device``."""

    def __init__(self, pool_bytes: int, device: str = "cpu", slab_bytes: int = DEFAULT_SLAB_BYTES):
        if slab_bytes % ALIGN or slab_bytes <= 0:
            raise ValueError(f"slab_bytes {slab_bytes} must be a positive multiple of {ALIGN}")
        num_slabs = pool_bytes // slab_bytes
        if num_slabs < 1:
            raise ValueError(
                f"pool of {pool_bytes} bytes is smaller than one slab ({slab_bytes} bytes)"
            )
        self.device = device
        self.slab_bytes = slab_bytes
        self.num_slabs = num_slabs
        try:
            self.buffer = torch.empty(num_slabs * slab_bytes, dtype=torch.uint8, device=device)
        except RuntimeError as exc:  # out of memory (torch.OutOfMemoryError among them)
            reason = str(exc).strip().splitlines()[0][:300]
            raise ValueError(
                f"pool_size {format_size(num_slabs * slab_bytes)} cannot be allocated on "
                f"{device}: {reason}"
            ) from None
        if device == "cpu":
            if self.buffer.numel() >= LOGGED_ZEROING_BYTES:  # seconds a GiB on a small host
                log.info(
                    "faulting in the %s host pool (zeroing it) before serving",
                    format_size(self.buffer.numel()),
                )
            self.buffer.zero_()  # fault every page in now, not inside the first saves
        self.base = self.buffer.data_ptr()
        # what tells this pool's slots apart from other memory in a transfer's runs:
        # 0 for host memory, else the CUDA allocation (its base)
        self.memory_key = self.base if self.buffer.is_cuda else 0
        self._free_slabs = list(range(num_slabs - 1, -1, -1))
        self._slabs: dict[int, _Slab] = {}
        self._partial: dict[int, dict[int, None]] = {}  # size -> ordered set of slab ids
        self._class_free: dict[int, int] = {}  # size -> free slots in its slabs
        self.used_bytes = 0

    @property
    def pool_bytes(self) -> int:
        return self.num_slabs * self.slab_bytes

    @property
    def free_bytes(self) -> int:
        return self.pool_bytes - self.used_bytes

    def stats(self) -> PoolStats:
        return PoolStats(self.pool_bytes, self.used_bytes, self.free_bytes)

    def slab_of(self, offsets: np.ndarray) -> np.ndarray:
        """The slab each offset lies in."""
        return np.asarray(offsets, dtype=np.int64) // self.slab_bytes

    def allocated_in_slab(self, slab_id: int) -> int:
        """How many slots of slab ``slab_id`` are allocated (0 for a free slab)."""
        slab = self._slabs.get(slab_id)
        return 0 if slab is None else slab.capacity - slab.top

    def can_alloc(self, nbytes: int, count: int) -> bool:
        return self.shortfall(nbytes, count) == 0

    def shortfall(self, nbytes: int, count: int) -> int:
        """Slots of ``nbytes`` missing for ``alloc(nbytes, count)`` to succeed."""
        size = round_size(nbytes)
        if size > self.slab_bytes:
            return count
        have = self._class_free.get(size, 0) + len(self._free_slabs) * (self.slab_bytes // size)
        return max(0, count - have)

    def holds_when_empty(self, wanted: dict[int, int]) -> bool:
        """Whether this pool, emptied of every slot, could hold ``wanted`` (slot
        bytes -> count) at once: each size class takes whole slabs of its own."""
        per_class: dict[int, int] = {}  # (a Counter costs more than the check, on every save)
        for nbytes, count in wanted.items():
            size = round_size(nbytes)
            if size > self.slab_bytes:
                return False
            per_class[size] = per_class.get(size, 0) + count
        slabs = sum(-(-count // (self.slab_bytes // size)) for size, count in per_class.items())
        return slabs <= self.num_slabs

    def alloc(self, nbytes: int, count: int) -> np.ndarray | None:
        """``count`` slot offsets of at least ``nbytes`` each, or None (nothing taken)."""
        if not self.can_alloc(nbytes, count):
            return None
        size = round_size(nbytes)
        out = np.empty(count, dtype=np.int64)
        got = 0
        while got < count:
            if not self._partial.get(size):
                got += self._whole_slabs(size, out[got:])
                if got == count:
                    break
            slab_id = self._partial_slab(size)
            slab = self._slabs[slab_id]
            take = min(slab.top, count - got)
            idx = _ascending(slab.free[slab.top - take : slab.top])
            out[got : got + take] = slab_id * self.slab_bytes + idx.astype(np.int64) * size
            slab.top -= take
            got += take
            if slab.top == 0:
                del self._partial[size][slab_id]
        self._class_free[size] -= count
        self.used_bytes += count * size
        return out

    def free(self, nbytes: int, offsets: np.ndarray) -> None:
        """Return slots allocated with ``alloc(nbytes, ...)``: grouped by slab (a
        stable sort, keeping their order within a slab), then one slice per slab
        touched, so a thousand evicted blocks are a few numpy calls. Slots of
        another size, or more of a slab's slots than it has allocated (a double
        free of that kind; a repeated slot among fewer is not caught), raise
        ValueError before anything is freed."""
        size = round_size(nbytes)
        offsets = np.asarray(offsets, dtype=np.int64)
        if not len(offsets):
            return
        slab_ids = offsets // self.slab_bytes
        runs, order = _slab_runs(slab_ids)
        if order is not None:
            offsets = offsets[order]
        for slab_id, first, end in runs:
            slab = self._slabs.get(slab_id)
            if slab is None or slab.slot_bytes != size:
                held = "nothing" if slab is None else f"{slab.slot_bytes}-byte slots"
                raise ValueError(f"slot of slab {slab_id} freed as {size} bytes, it holds {held}")
            if slab.top + end - first > slab.capacity:
                raise ValueError(
                    f"{end - first} slots of slab {slab_id} freed, only "
                    f"{slab.capacity - slab.top} are allocated (a double free)"
                )
        idx_all = ((offsets % self.slab_bytes) // size).astype(np.int32)
        for slab_id, first, end in runs:
            slab = self._slabs[slab_id]
            count = end - first
            if count == slab.capacity:  # every slot of it: straight back to the free slabs
                self._release_slab(slab_id, size)
                continue
            slab.free[slab.top : slab.top + count] = idx_all[first:end][::-1]  # first on top
            slab.top += count
            self._partial[size][slab_id] = None
            if slab.top == slab.capacity:
                self._release_slab(slab_id, size)
        self._class_free[size] += len(offsets)
        self.used_bytes -= len(offsets) * size

    def _whole_slabs(self, size: int, out: np.ndarray) -> int:
        """Fill ``out`` with the slots of as many whole fresh slabs as fit in it
        (vectorised: a fresh slab hands out its slots in ascending order, so a
        save of thousands of slots costs a few numpy calls, not one per slab);
        how many slots that was."""
        capacity = self.slab_bytes // size
        n = min(len(out) // capacity, len(self._free_slabs))
        if n == 0:
            return 0
        self._partial.setdefault(size, {})
        ids = sorted(self._free_slabs.pop() for _ in range(n))  # ascending: one run
        for slab_id in ids:  # full: no free slot to stack, not partial
            self._slabs[slab_id] = _Slab(size, np.empty(capacity, dtype=np.int32), 0)
        starts = np.array(ids, dtype=np.int64)[:, None] * self.slab_bytes
        cells = np.arange(capacity, dtype=np.int64) * size
        out[: n * capacity] = (starts + cells).ravel()
        self._class_free[size] = self._class_free.get(size, 0) + n * capacity
        return n * capacity

    def _partial_slab(self, size: int) -> int:
        partial = self._partial.setdefault(size, {})
        if partial:
            return next(iter(partial))
        slab_id = self._free_slabs.pop()
        capacity = self.slab_bytes // size
        self._slabs[slab_id] = _Slab(
            size, np.arange(capacity - 1, -1, -1, dtype=np.int32), capacity
        )
        partial[slab_id] = None
        self._class_free[size] = self._class_free.get(size, 0) + capacity
        return slab_id

    def _release_slab(self, slab_id: int, size: int) -> None:
        slab = self._slabs.pop(slab_id)
        self._partial[size].pop(slab_id, None)
        self._class_free[size] -= slab.capacity
        self._free_slabs.append(slab_id)

    def check(self) -> None:
        """Invariants, for tests: byte accounting and no slot both free and used."""
        total_free = sum(self._class_free.values())
        assert total_free == sum(s.top for s in self._slabs.values())
        used = sum((s.capacity - s.top) * s.slot_bytes for s in self._slabs.values())
        assert used == self.used_bytes, (used, self.used_bytes)
        assert len(self._free_slabs) + len(self._slabs) == self.num_slabs
        for slab in self._slabs.values():
            assert len(set(slab.free[: slab.top].tolist())) == slab.top
