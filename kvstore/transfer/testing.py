"""Test doubles for the transfer engine: slot tables from arbitrary views, and a
numpy-pool SlotSource / SlotSink whose bytes are known in every process.

Both pools place slots back to back, so runs of slots coalesce into one UCX
message; ``gap_every=k`` leaves a gap after every k-th slot, which splits runs
there, and ``lanes=L`` allocates like the store does with tp_size L (slot s of
every block belongs to lane s % L; a lane's slots of all blocks come first).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.transfer.slots import SlotTable
from kvstore.wire.errors import Code, KVError

log = logging.getLogger(__name__)


class SlotRef:
    """Where one slot view lies (``obj`` keeps it alive)."""

    __slots__ = ("cuda", "nbytes", "obj", "ptr")

    def __init__(self, obj: Any, ptr: int, nbytes: int, cuda: bool):
        self.obj, self.ptr, self.nbytes, self.cuda = obj, ptr, nbytes, cuda


def slot_ref(buf: Any) -> SlotRef:
    """Address and size of a contiguous slot view (numpy, torch CPU/CUDA, cupy)."""
    if type(buf) is np.ndarray:
        if not buf.flags.c_contiguous:
            raise ValueError("slot views must be contiguous")
        return SlotRef(buf, buf.__array_interface__["data"][0], buf.nbytes, False)
    if type(buf).__module__.startswith("torch") and buf.device.type in ("cpu", "cuda"):
        if not buf.is_contiguous():
            raise ValueError("slot views must be contiguous")
        return SlotRef(buf, buf.data_ptr(), buf.numel() * buf.element_size(), buf.is_cuda)
    from ucxx._lib.arr import Array

    arr = Array(buf)
    if not arr.c_contiguous:
        raise ValueError("slot views must be contiguous")
    return SlotRef(buf, arr.ptr, arr.nbytes, arr.cuda)


def _alloc_key(ref: SlotRef) -> int:
    """Which allocation a CUDA view lies in (adjacent allocations must not be merged),
    or a unique negative number when that cannot be told."""
    obj = ref.obj
    try:
        if type(obj).__module__.startswith("torch"):
            return int(obj.untyped_storage().data_ptr()) or -1 - id(ref)
        mem = getattr(getattr(obj, "data", None), "mem", None)  # cupy
        if mem is not None and getattr(mem, "ptr", 0):
            return int(mem.ptr)
    except Exception:
        log.debug("cannot tell the allocation of a CUDA view", exc_info=True)
    return -1 - id(ref)


def table_from_views(buffers: list[list[Any]]) -> SlotTable:
    """The table of per-block lists of contiguous 1-D views (numpy, torch, cupy or
    anything with an array interface): the general, slower way to build one."""
    refs = [slot_ref(v) for views in buffers for v in views]
    return SlotTable(
        np.fromiter((r.ptr for r in refs), dtype=np.uint64, count=len(refs)),
        np.fromiter((r.nbytes for r in refs), dtype=np.int64, count=len(refs)),
        np.fromiter(
            (_alloc_key(r) if r.cuda else 0 for r in refs), dtype=np.int64, count=len(refs)
        ),
        np.asarray([len(v) for v in buffers], dtype=np.int64),
        owner=buffers,
    )


def slot_content(h: int, slot: int, size: int) -> np.ndarray:
    """Deterministic bytes for (block hash, slot), the same in every process."""
    rng = np.random.default_rng([h & 0xFFFFFFFF, h >> 32, slot])
    return rng.integers(0, 256, size, dtype=np.uint8)


GAP = 64


class Pool:
    """A bump allocator over one numpy array: slots are views into it, never copies.

    Slots follow each other with no gap, except after every ``gap_every``-th one."""

    def __init__(self, nbytes: int, gap_every: int = 0):
        self.mem = np.zeros(nbytes, dtype=np.uint8)
        self.top = 0
        self.gap_every = gap_every
        self.count = 0

    def alloc(self, size: int) -> np.ndarray:
        assert self.top + size <= len(self.mem), "test pool exhausted"
        view = self.mem[self.top : self.top + size]
        self.top += size
        self.count += 1
        if self.gap_every and self.count % self.gap_every == 0:
            self.top += GAP
        return view


@dataclass
class MemLease:
    hashes: list[int]
    buffers: list[list[np.ndarray]]
    source: MemorySource

    @property
    def slots(self):
        return table_from_views(self.buffers)

    def release(self) -> None:
        self.source.active -= 1
        self.source.released += 1
        if self.source.reuse_on_release:  # as a store whose Save reuses the slots at once
            for block in self.buffers:
                for view in block:
                    view[:] = REUSED


REUSED = 0xEE  # what a slot holds once reused (never a slot_content byte pattern alone)


def lane_major(slot_counts: list[int], lanes: int) -> list[tuple[int, int]]:
    """(block, slot) in the order a store with tp_size ``lanes`` allocates them."""
    return [
        (b, s) for r in range(lanes) for b, n in enumerate(slot_counts) for s in range(r, n, lanes)
    ]


class MemorySource:
    """Serves ``blocks`` (hash -> slot sizes) of ``namespace`` with slot_content bytes."""

    def __init__(
        self,
        namespace: str,
        blocks: dict[int, list[int]],
        pool_bytes: int,
        gap_every: int = 0,
        lanes: int = 1,
    ):
        self.namespace = namespace
        self.pool = Pool(pool_bytes, gap_every)
        hashes = list(blocks)
        views: list[list[Any]] = [[None] * len(blocks[h]) for h in hashes]
        for b, s in lane_major([len(blocks[h]) for h in hashes], lanes):
            views[b][s] = self._fill(hashes[b], s, blocks[hashes[b]][s])
        self.blocks = dict(zip(hashes, views, strict=True))
        self.active = 0
        self.released = 0
        self.reuse_on_release = False  # overwrite a lease's slots the moment it ends

    def _fill(self, h: int, slot: int, size: int) -> np.ndarray:
        view = self.pool.alloc(size)
        view[:] = slot_content(h, slot, size)
        return view

    def lease(self, namespace: str, hashes: list[int]) -> MemLease | None:
        prefix = []
        for h in hashes:
            if namespace != self.namespace or h not in self.blocks:
                break
            prefix.append(h)
        if not prefix:
            return None
        self.active += 1
        return MemLease(prefix, [self.blocks[h] for h in prefix], self)


@dataclass
class MemReservation:
    hashes: list[int]
    buffers: list[list[np.ndarray]]
    sink: MemorySink
    state: str = "reserved"

    @property
    def slots(self):
        return table_from_views(self.buffers)

    def keep(self, num_blocks: int) -> None:
        assert self.state == "reserved"
        self.hashes, self.buffers = self.hashes[:num_blocks], self.buffers[:num_blocks]

    def commit(self) -> None:
        assert self.state == "reserved"
        self.state = "committed"
        self.sink.visible.update(zip(self.hashes, self.buffers, strict=True))
        self.sink.committed()

    def abort(self) -> None:
        assert self.state == "reserved"
        self.state = "aborted"


_SIGNALS = {"kill": (signal.SIGKILL, "ZX"), "stop": (signal.SIGSTOP, "T")}


def _wait_for_state(pid: int, states: str, timeout_s: float = 10.0) -> None:
    """Wait until process ``pid`` is in one of ``states`` (/proc's letters; a
    process gone counts as dead)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            state = "X"
        if state in states:
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} not in state {states} after {timeout_s} s")


@dataclass
class MemorySink:
    pool: Pool
    visible: dict[int, list[np.ndarray]] = field(default_factory=dict)
    reservations: list[MemReservation] = field(default_factory=list)
    # "die": kill this process; "hang": block its loop; "stall:S": block it S seconds;
    # "kill:PID": kill process PID;
    # "exhausted": refuse with RESOURCE_EXHAUSTED
    on_reserve: str = ""
    lanes: int = 1
    # "kill:PID" / "stop:PID": once a reservation commits, SIGKILL / SIGSTOP process
    # PID and wait (blocking this loop) until it is dead / stopped
    on_commit: str = ""

    def committed(self) -> None:
        how, _, pid = self.on_commit.partition(":")
        if how in _SIGNALS:
            sig, states = _SIGNALS[how]
            os.kill(int(pid), sig)
            _wait_for_state(int(pid), states)

    def reserve(
        self, namespace: str, hashes: list[int], slot_sizes: list[list[int]]
    ) -> MemReservation:
        if self.on_reserve == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.on_reserve.startswith("kill:"):  # kill the serving peer, then go on
            os.kill(int(self.on_reserve[5:]), signal.SIGKILL)
            time.sleep(0.3)
        if self.on_reserve == "hang":
            time.sleep(3600)
        if self.on_reserve.startswith("stall:"):  # block the loop that long, then go on
            time.sleep(float(self.on_reserve[6:]))
        if self.on_reserve == "exhausted":  # as a store whose every block is pinned
            raise KVError(Code.RESOURCE_EXHAUSTED, "test sink: no room")
        buffers: list[list[Any]] = [[None] * len(sizes) for sizes in slot_sizes]
        for b, s in lane_major([len(sizes) for sizes in slot_sizes], self.lanes):
            buffers[b][s] = self.pool.alloc(slot_sizes[b][s])
        r = MemReservation(list(hashes), buffers, self)
        self.reservations.append(r)
        return r

    def report(self) -> dict:
        bad = [
            h
            for h, views in self.visible.items()
            if not all(np.array_equal(v, slot_content(h, s, len(v))) for s, v in enumerate(views))
        ]
        return {
            "visible": sorted(self.visible),
            "corrupt": bad,
            "states": [r.state for r in self.reservations],
        }


@dataclass
class AheadMemorySink(MemorySink):
    """A MemorySink whose blocks all have ``layout``: it reserves before the offer."""

    layout: list[int] = field(default_factory=list)
    ahead: list[int] = field(default_factory=list)  # blocks asked of each reserve_ahead

    def reserve_ahead(self, namespace: str, hashes: list[int]) -> MemReservation:
        self.ahead.append(len(hashes))
        return self.reserve(namespace, hashes, [self.layout] * len(hashes))

    def report(self) -> dict:
        return super().report() | {"ahead": self.ahead}
