"""Which sealed blocks go when a pool has no room: eviction by bytes.

A slab serves one slot size while it holds any slot (:mod:`kvstore.store.pool`),
so freeing slots of another size helps only once a whole slab empties. Room for
``count`` slots of size S is therefore made in two steps, each in LRU order:

1. *Same size*: evict unpinned blocks that hold slots of size S on the device,
   oldest first, just enough to free the slots missing; their slots are
   reused as they are, one for one.
2. *Whole slabs*: when no such block is left, empty one slab at a time: the
   slab none of whose blocks is pinned or inflight and whose most recently used
   block is the oldest. Every block with a slot in it goes.

Saving one block of size S into a full pool so evicts about S when blocks of
that size exist, and otherwise at most one slab plus the blocks that straddle
its edges: never the whole cache, and two layouts sharing a pool do not flush
each other. Plain functions over blocks; the block index applies the result.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvstore.store.block import Block
from kvstore.store.pool import SlotPool, round_size


def slots_on(block: Block, device: str) -> np.ndarray:
    """Indices of the block's allocated slots that live on ``device``."""
    ranks = [r for r, d in enumerate(block.devices) if d == device]
    if len(ranks) == block.tp_size:  # every rank here: the common case, one pass
        return np.flatnonzero(block.offsets >= 0)
    if not ranks:
        return np.zeros(0, dtype=np.int64)
    idx = np.concatenate([np.arange(r, len(block.offsets), block.tp_size) for r in ranks])
    return idx[block.offsets[idx] >= 0]


def same_size_victims(lru: Iterable[Block], pool: SlotPool, nbytes: int, need: int) -> list[Block]:
    """The oldest unpinned blocks holding slots of ``nbytes`` (rounded) in ``pool``,
    just enough of them to free ``need`` such slots (fewer when there are not)."""
    size, device = round_size(nbytes), pool.device
    counts: dict[tuple[int, tuple], int] = {}  # (slot sizes, ranks here) -> slots of size
    out: list[Block] = []
    freed = 0
    for block in lru:
        if freed >= need:
            break
        if block.pins or device not in block.devices:
            continue
        key = (id(block.slot_bytes), tuple(d == device for d in block.devices))
        if key not in counts:
            counts[key] = int(
                np.count_nonzero(round_size(block.slot_bytes[slots_on(block, device)]) == size)
            )
        if counts[key]:
            out.append(block)
            freed += counts[key]
    return out


def slab_victims(
    pool: SlotPool, lru: list[Block], others: Iterable[Block], skip: set[int]
) -> tuple[int, list[Block]] | None:
    """The slab to empty next (see the module docstring) and its blocks, or None.

    ``lru`` is every sealed block oldest first; ``others`` the blocks that may
    not go (pinned ones are found in ``lru``); ``skip`` slabs already tried.
    """
    newest: dict[int, int] = {}  # slab -> LRU rank of its most recent block
    members: dict[int, list[Block]] = {}
    blocked: set[int] = set(skip)
    for rank, block in enumerate(lru):
        slabs = _slabs_of(pool, block)
        if block.pins:
            blocked.update(slabs)
            continue
        for slab in slabs:
            newest[slab] = rank
            members.setdefault(slab, []).append(block)
    for block in others:
        blocked.update(_slabs_of(pool, block))
    candidates = [s for s in newest if s not in blocked]
    if not candidates:
        return None
    slab = min(candidates, key=newest.__getitem__)
    return slab, members[slab]


def _slabs_of(pool: SlotPool, block: Block) -> set[int]:
    if pool.device not in block.devices:
        return set()
    return set(pool.slab_of(block.offsets[slots_on(block, pool.device)]).tolist())


class SlotFrees:
    """Slots of dropped blocks, gathered by (device, size) so each pool frees them
    in one call: evicting a thousand blocks is then a few numpy calls, not a
    thousand."""

    def __init__(self) -> None:
        self._offsets: dict[tuple[str, int], list[np.ndarray]] = {}

    def add(self, block: Block) -> None:
        """Take note of every allocated slot of ``block`` (read before it is reset)."""
        for device in {d for d in block.devices if d is not None}:
            idx = slots_on(block, device)
            if not len(idx):
                continue
            sizes = block.slot_bytes[idx]
            uniform = bool((sizes == sizes[0]).all())
            for size in [int(sizes[0])] if uniform else np.unique(sizes).tolist():
                self._offsets.setdefault((device, size), []).append(
                    block.offsets[idx[sizes == size]]
                )

    def apply(self, pools: dict[str, SlotPool]) -> None:
        for (device, size), offsets in self._offsets.items():
            pools[device].free(size, np.concatenate(offsets))
        self._offsets.clear()
