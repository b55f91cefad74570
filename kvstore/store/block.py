"""One block: its key, its slot array, and the life-cycle bits the block index keeps.

A block is keyed by ``(final_namespace, block_hash)`` and owns a slot array of
``num_layers * tp_size`` entries (slot = layer_id * tp_size + tp_rank), each
slot in the pool of the device of the rank that wrote it (docs/design.md §2).
Only :class:`kvstore.store.blocks.BlockIndex` changes a block; everyone else
reads the blocks it hands out.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

Key = tuple[str, int]  # (final namespace, block hash)


class BlockShape(Protocol):
    """The slots of a namespace's blocks (a registry ``Seal`` is one)."""

    @property
    def slot_bytes(self) -> np.ndarray: ...  # bytes of each slot, by slot index

    @property
    def tp_size(self) -> int: ...


NO_ORIGIN = ("", 0)  # no instance, no step: a block reserved for a fetch, or a test's


@dataclass(slots=True, eq=False)
class Block:
    """One block's slot array and its life-cycle state.

    ``devices`` and ``writers`` are tuples, replaced on change: a tuple of strings
    is no container the garbage collector keeps tracking, so a block costs it one
    object (the block), not three, and a save of a thousand blocks stays cheap.
    Blocks made together (:func:`new_blocks`) hold their offsets as rows of one
    array, so a claim or reservation places and reads them in one numpy call."""

    key: Key
    slot_bytes: np.ndarray  # bytes per slot (the seal's read-only array, shared)
    tp_size: int
    created: float
    offsets: np.ndarray  # int64 per slot, -1 while unallocated
    devices: tuple[str | None, ...]  # device of each tp_rank's slots (None: not placed)
    # Bit s set: slot s has a writer (claimed) / its bytes are in (written).
    # Python ints, not bool arrays: a save tests and sets them for hundreds of
    # blocks, and a numpy reduction over 64 bools costs ~2 us, an int op ~50 ns.
    claimed: int = 0
    written: int = 0
    writers: tuple[str, ...] = ()  # sessions with claimed slots
    sealed: bool = False
    pins: int = 0
    copying: int = 0  # saves whose copy into its slots has not ended (a claim each)
    # (instance, engine step) of the writer that began it: see BlockIndex.claim
    origin: tuple[str, int] = NO_ORIGIN
    # the tenant charged with it once sealed: its namespace's owner ("" for none)
    owner: str = ""

    def placed(self, tp_rank: int, device: str) -> tuple[str | None, ...]:
        """``devices`` with ``tp_rank``'s slots on ``device``."""
        return placed(self.devices, tp_rank, device)

    @property
    def block_hash(self) -> int:
        return self.key[1]

    @property
    def all_slots(self) -> int:
        return (1 << len(self.slot_bytes)) - 1

    @property
    def nbytes(self) -> int:
        return int(self.slot_bytes.sum())


class NewBlocks(NamedTuple):
    """Blocks made together, and their offsets: row i is ``blocks[i].offsets``."""

    blocks: list[Block]
    offsets: np.ndarray  # int64 (blocks, slots)


def new_blocks(
    namespace: str,
    hashes: list[int],
    shape: BlockShape,
    created: float,
    *,
    devices: tuple[str | None, ...] = (),
    claimed: int = 0,
    writers: tuple[str, ...] = (),
    copying: int = 0,
    origin: tuple[str, int] = NO_ORIGIN,
) -> NewBlocks:
    """Unallocated blocks of ``hashes``, one offsets array for all of them (a
    row view each: cheaper to make than a copy each, and placed in one call)."""
    slot_bytes, tp_size = shape.slot_bytes, shape.tp_size
    devices = devices or (None,) * tp_size
    offsets = np.full((len(hashes), len(slot_bytes)), -1, dtype=np.int64)
    blocks = [  # by position, no __post_init__: half the ~1 us a block of keywords and checks
        Block(
            (namespace, h),
            slot_bytes,
            tp_size,
            created,
            row,
            devices,
            claimed,
            0,
            writers,
            False,
            0,
            copying,
            origin,
        )
        for h, row in zip(hashes, offsets, strict=True)
    ]
    return NewBlocks(blocks, offsets)


def offset_rows(blocks: list[Block]) -> np.ndarray:
    """The offsets of blocks of one layout as one (blocks, slots) array (a copy)."""
    if len(blocks) == 1:
        return blocks[0].offsets[None, :]
    # one concatenate of the rows: np.stack costs ~0.4 us more a block
    return np.concatenate([b.offsets for b in blocks]).reshape(len(blocks), -1)


def placed(devices: tuple[str | None, ...], tp_rank: int, device: str) -> tuple[str | None, ...]:
    """``devices`` with ``tp_rank``'s slots on ``device``."""
    return (*devices[:tp_rank], device, *devices[tp_rank + 1 :])


@functools.cache
def unallocated(num_slots: int) -> np.ndarray:
    """A read-only offsets array with no slot allocated (copied: cheaper than np.full)."""
    out = np.full(num_slots, -1, dtype=np.int64)
    out.flags.writeable = False
    return out


def slot_mask(slots: np.ndarray) -> int:
    """The bit set of ``slots`` (see Block.claimed)."""
    mask = 0
    for s in slots.tolist():
        mask |= 1 << s
    return mask


class SlotRun(NamedTuple):
    """The slots of one size in a :class:`SlotSet`, ascending."""

    size: int  # bytes of each
    cells: np.ndarray  # their slot indices, ascending
    where: slice | np.ndarray  # the same as a slice when evenly spaced (cheaper to index by)


@dataclass(frozen=True, eq=False)
class SlotSet:
    """Slots of one block layout that one writer claims or one copy moves, in the
    forms the index reads them in, worked out once (a rank's are, at its seal).

    Pool order is ascending slot index (layer id major): a block's slots of one
    size are allocated in ``runs`` order, so a peer reads them in one run."""

    slots: np.ndarray  # slot indices, in the caller's order (its registration's); read-only
    mask: int  # their bit set (Block.claimed)
    runs: tuple[SlotRun, ...]  # by slot size, ascending
    nbytes: int  # bytes of these slots of one block

    @classmethod
    def of(cls, slots: np.ndarray | list[int], slot_bytes: np.ndarray) -> SlotSet:
        """``slots`` of a layout whose slot s has ``slot_bytes[s]`` bytes."""
        slots = np.array(slots, dtype=np.int64)
        slots.flags.writeable = False
        ordered = np.sort(slots)
        sizes = slot_bytes[ordered]
        if len(sizes) and bool((sizes == sizes[0]).all()):  # one size, as a rule
            runs: tuple[SlotRun, ...] = (SlotRun(int(sizes[0]), ordered, _as_slice(ordered)),)
        else:
            runs = tuple(
                SlotRun(int(size), cells, _as_slice(cells))
                for size in np.unique(sizes).tolist()
                for cells in [ordered[sizes == size]]
            )
        for run in runs:  # cached and shared (a seal's, a layout's): read-only
            run.cells.flags.writeable = False
        return cls(slots, slot_mask(slots), runs, int(sizes.sum()))


def tp_rank_slots(slot_bytes: np.ndarray, tp_size: int, tp_rank: int) -> SlotSet:
    """Every slot of ``tp_rank`` in a layout of ``slot_bytes`` (layer major, ``tp_size``
    ranks), worked out once a layout: a fetch reserves them per rank each time."""
    return ranks_slots(slot_bytes, tp_size, (tp_rank,))


def ranks_slots(slot_bytes: np.ndarray, tp_size: int, tp_ranks: tuple[int, ...]) -> SlotSet:
    """Every slot of ``tp_ranks`` in a layout of ``slot_bytes``, worked out once a
    layout and set of ranks (a fetch reserves a rank's, an eviction reads those
    of the ranks on one device, each time)."""
    return _ranks_slots(slot_bytes.tobytes(), slot_bytes.dtype.str, tp_size, tp_ranks)


@functools.lru_cache(maxsize=1024)
def _ranks_slots(raw: bytes, dtype: str, tp_size: int, tp_ranks: tuple[int, ...]) -> SlotSet:
    sizes = np.frombuffer(raw, dtype=dtype)
    return SlotSet.of(np.flatnonzero(np.isin(np.arange(len(sizes)) % tp_size, tp_ranks)), sizes)


def _as_slice(cells: np.ndarray) -> slice | np.ndarray:
    """Ascending ``cells`` as a slice when evenly spaced, else themselves."""
    if len(cells) == 0:
        return cells
    step = int(cells[1] - cells[0]) if len(cells) > 1 else 1
    if step > 0 and bool((np.diff(cells) == step).all()):
        return slice(int(cells[0]), int(cells[-1]) + 1, step)
    return cells
