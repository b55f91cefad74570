"""Slots as the transfer engine sees them: tables of (address, size, memory),
the store's side of the contract, and the run arithmetic (pure numpy).

A run is a stretch of slots that lie back to back in one memory; both sides
split a fetch at the union of their run starts, so each segment travels as one
message (see the package docstring).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvstore.transfer.wire import MAX_LANES, MAX_SEGMENT_BYTES, NO_CAP, distinct_layouts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlotTable:
    """Where slots lie, block after block: one row per slot, no Python object per slot.

    ``memory`` tells runs apart: 0 for host memory, else a key of the CUDA
    allocation the slot lies in (adjacent allocations are never merged into
    one message). ``owner`` keeps the memory alive while the table is in use.
    """

    ptr: np.ndarray  # uint64 address of each slot
    nbytes: np.ndarray  # int64 size of each slot
    memory: np.ndarray  # int64: 0 = host, else the CUDA allocation's key
    counts: np.ndarray  # int64 slots per block
    owner: Any = None

    def __post_init__(self) -> None:
        n = len(self.ptr)
        if not (len(self.nbytes) == len(self.memory) == n == int(self.counts.sum())):
            raise ValueError("slot table columns disagree")

    @property
    def num_blocks(self) -> int:
        return len(self.counts)

    def layouts(self) -> tuple[list[list[int]], np.ndarray]:
        """The distinct per-block slot-size lists and each block's index into them."""
        n = len(self.counts)
        if not n:
            return [], np.zeros(0, dtype=np.int64)
        k = int(self.counts[0])
        if n == 1 or bool((self.counts == k).all()):
            rows = self.nbytes.reshape(n, k)
            if n == 1 or bool((rows == rows[0]).all()):
                return [rows[0].tolist()], np.zeros(n, dtype=np.int64)
            unique, index = np.unique(rows, axis=0, return_inverse=True)
            return unique.tolist(), index.reshape(-1).astype(np.int64)
        return distinct_layouts(
            b.tolist() for b in np.split(self.nbytes, np.cumsum(self.counts)[:-1])
        )

    def prefix(self, num_blocks: int) -> SlotTable:
        """The table of the first ``num_blocks`` blocks."""
        end = int(self.counts[:num_blocks].sum())
        return SlotTable(
            self.ptr[:end],
            self.nbytes[:end],
            self.memory[:end],
            self.counts[:num_blocks],
            self.owner,
        )

    def take(self, order: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ptr, nbytes, memory) of the slots in ``order`` (flat slot indices)."""
        return self.ptr[order], self.nbytes[order], self.memory[order]


class Lease(Protocol):
    """Pinned sealed blocks on the serving peer, valid until release()."""

    hashes: list[int]  # the leased prefix of the requested hashes
    slots: SlotTable  # their slots, block after block, read straight out of the pool

    def release(self) -> None: ...


class Reservation(Protocol):
    """Local slots allocated for incoming blocks, invisible until commit()."""

    slots: SlotTable  # writable, sized as asked

    def keep(self, num_blocks: int) -> None:
        """Free the slots of every block past the first ``num_blocks``."""
        ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


class SlotSource(Protocol):
    """Implemented by the block store on the serving peer."""

    def lease(self, namespace: str, hashes: list[int]) -> Lease | None: ...


class SlotSink(Protocol):
    """Implemented by the block store on the fetching node."""

    def reserve(
        self, namespace: str, hashes: list[int], slot_sizes: list[list[int]]
    ) -> Reservation: ...


@runtime_checkable
class AheadSink(SlotSink, Protocol):
    """A sink that knows the one layout of a namespace's blocks: a fetch reserves
    its slots while the peer prepares the offer, then keeps what was offered."""

    def reserve_ahead(self, namespace: str, hashes: list[int]) -> Reservation: ...


def _breaks(ptr: np.ndarray, size: np.ndarray, memory: np.ndarray) -> np.ndarray:
    """Per slot after the first: True where it does not continue the one before."""
    size = size.astype(np.uint64, copy=False)
    return (ptr[1:] != ptr[:-1] + size[:-1]) | (memory[1:] != memory[:-1])


def run_starts(
    ptr: np.ndarray, size: np.ndarray, memory: np.ndarray, cap: int | None = None
) -> np.ndarray:
    """Indices ``i > 0`` where slot ``i`` does not continue slot ``i - 1`` in memory.

    A run also breaks between host and CUDA memory, between CUDA allocations,
    and before it would pass ``cap`` bytes (MAX_SEGMENT_BYTES).
    """
    n = len(ptr)
    if n < 2:
        return np.zeros(0, dtype=np.int64)
    cap = MAX_SEGMENT_BYTES if cap is None else cap
    size = size.astype(np.uint64, copy=False)
    starts = (np.nonzero(_breaks(ptr, size, memory))[0] + 1).astype(np.int64)
    if cap >= NO_CAP:
        return starts
    # Cut runs longer than cap greedily: one binary search per cut, not a walk
    # over the run's slots (a 256 MiB run of 16 KiB slots has 16384 of them).
    edges = np.concatenate(([0], starts, [n]))
    csum = np.concatenate(([0], np.cumsum(size, dtype=np.uint64))).astype(np.int64)
    long_runs = np.nonzero(csum[edges[1:]] - csum[edges[:-1]] > cap)[0]
    if not len(long_runs):
        return starts
    extra = []
    for r in long_runs.tolist():
        first, end = int(edges[r]), int(edges[r + 1])
        while True:  # slots first .. cut-1 are the most that fit in cap (at least one)
            cut = max(first + 1, int(np.searchsorted(csum, csum[first] + cap, "right")) - 1)
            if cut >= end:
                break
            extra.append(cut)
            first = cut
    return np.union1d(starts, np.asarray(extra, dtype=np.int64))


def transfer_order(slot_counts: Sequence[int], lanes: int) -> np.ndarray:
    """Flat (block, slot) indices in transfer order: lane-major, then block, then slot."""
    counts = np.asarray(slot_counts, dtype=np.int64)
    n = int(counts.sum())
    if lanes == 1 or n == 0:
        return np.arange(n, dtype=np.int64)
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    if bool(np.all(counts == counts[0])):  # one layout: a reshape does it
        k = int(counts[0])
        grid = first[:, None] + np.arange(k, dtype=np.int64)[None, :]
        return grid.reshape(len(counts), k // lanes, lanes).transpose(2, 0, 1).ravel()
    return np.concatenate(
        [
            f + np.arange(r, c, lanes, dtype=np.int64)
            for r in range(lanes)
            for f, c in zip(first.tolist(), counts.tolist(), strict=True)
        ]
    )


def choose_lanes(table: SlotTable) -> int:
    """The lane count (a power of two dividing every block's slot count) whose
    transfer order leaves the fewest runs in this side's memory. Cuts at the
    segment cap do not count: every order has those."""
    if len(table.ptr) < 2:  # one slot (or none): one run whatever the order
        return 1
    best, fewest = 1, None
    lanes = 1
    counts = table.counts
    listed = counts.tolist()
    while lanes <= MAX_LANES and all(c % lanes == 0 for c in listed):
        columns = (table.ptr, table.nbytes, table.memory)  # lanes 1: slot order
        if lanes > 1:
            columns = table.take(transfer_order(listed, lanes))
        runs = int(np.count_nonzero(_breaks(*columns)))
        if fewest is None or runs < fewest:
            best, fewest = lanes, runs
        if runs == 0:
            break
        lanes *= 2
    return best


def segment_bounds(num_slots: int, *lists: np.ndarray) -> list[tuple[int, int]]:
    """[first, end) slot ranges split at the union of the run-start lists."""
    cuts = np.zeros(0, dtype=np.int64)
    for starts in lists:
        cuts = np.union1d(cuts, starts[starts < num_slots])
    edges = [0, *cuts.tolist(), num_slots]
    return list(itertools.pairwise(edges))
