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

import math
from collections.abc import Iterable

import numpy as np

from kvstore.store.block import Block, SlotSet, offset_rows, ranks_slots
from kvstore.store.pool import SlotPool, round_size


def device_slots(block: Block, device: str) -> SlotSet:
    """The slots of the block's ranks whose memory is on ``device``, by size
    (worked out once a layout and set of ranks: block.ranks_slots)."""
    here = tuple(r for r, d in enumerate(block.devices) if d == device)
    return ranks_slots(block.slot_bytes, block.tp_size, here)


def slots_on(block: Block, device: str) -> np.ndarray:
    """Indices of the block's allocated slots that live on ``device``."""
    idx = device_slots(block, device).slots
    return idx[block.offsets[idx] >= 0]


def same_size_victims(
    lru: Iterable[Block], pool: SlotPool, nbytes: int, need: int, budget: int | None = None
) -> list[Block]:
    """The oldest unpinned blocks holding slots of ``nbytes`` (rounded) in ``pool``,
    just enough of them to free ``need`` such slots (fewer when there are not);
    with ``budget``, no more once their pool bytes (every slot) reach it."""
    size, device = round_size(nbytes), pool.device
    counts: dict[tuple, tuple[int, int]] = {}  # (slot sizes, devices) -> slots of size, bytes
    out: list[Block] = []
    freed = taken = 0
    weigh, budget = budget is not None, math.inf if budget is None else budget
    last: tuple = (None, None)  # (slot sizes, devices) of the block before
    count = block_bytes = 0
    for block in lru:
        if freed >= need or taken >= budget:
            break
        if block.pins:
            continue
        if block.slot_bytes is not last[0] or block.devices is not last[1]:  # else: as before
            last = (block.slot_bytes, block.devices)
            key = (id(block.slot_bytes), block.devices)
            known = counts.get(key)
            if known is None:
                runs = device_slots(block, device).runs
                known = counts[key] = (
                    sum(len(r.cells) for r in runs if round_size(r.size) == size),
                    sum(map(round_size, block.slot_bytes.tolist())) if weigh else 0,
                )
            count, block_bytes = known
        if count:
            out.append(block)
            freed += count
            taken += block_bytes
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
    held: dict[int, int] = {}  # slab -> its slots the evictable blocks hold
    blocked: set[int] = set(skip)
    for rank, block in enumerate(lru):
        slabs = _slab_slots(pool, block)
        if block.pins:
            blocked.update(slabs)
            continue
        for slab, count in slabs.items():
            newest[slab] = rank
            members.setdefault(slab, []).append(block)
            held[slab] = held.get(slab, 0) + count
    for block in others:
        blocked.update(_slab_slots(pool, block))
    # A slab with slots no block here accounts for (a peer's fetch reserved them, or
    # the allocation under way took them) would not empty: its blocks are not evicted.
    candidates = [s for s in newest if s not in blocked and held[s] == pool.allocated_in_slab(s)]
    if not candidates:
        return None
    slab = min(candidates, key=newest.__getitem__)
    return slab, members[slab]


def _slab_slots(pool: SlotPool, block: Block) -> dict[int, int]:
    """The slabs of ``pool`` holding the block's slots, and how many of them each."""
    if pool.device not in block.devices:
        return {}
    slabs, counts = np.unique(
        pool.slab_of(block.offsets[slots_on(block, pool.device)]), return_counts=True
    )
    return dict(zip(slabs.tolist(), counts.tolist(), strict=True))


class SlotFrees:
    """Slots of dropped blocks, gathered by (device, size) so each pool frees them
    in one call. Blocks of one layout are gathered together (one stacked offsets
    array), so evicting a thousand blocks is a few numpy calls, not a thousand."""

    def __init__(self) -> None:
        self._offsets: dict[tuple[str, int], list[np.ndarray]] = {}

    @classmethod
    def free(cls, blocks: list[Block], pools: dict[str, SlotPool]) -> None:
        """Free every allocated slot of ``blocks`` now."""
        frees = cls()
        frees.add(blocks)
        frees.apply(pools)

    def add(self, blocks: list[Block]) -> None:
        """Take note of every allocated slot of ``blocks`` (read before they are reset)."""
        groups: dict[tuple, list[Block]] = {}  # blocks alike: same slot sizes and devices
        last: tuple = (None, None)
        group: list[Block] = []
        for block in blocks:
            if block.slot_bytes is not last[0] or block.devices is not last[1]:
                last = (block.slot_bytes, block.devices)  # blocks made together share both
                group = groups.setdefault((id(last[0]), last[1]), [])
            group.append(block)
        for alike in groups.values():
            self._add_alike(alike)

    def _add_alike(self, group: list[Block]) -> None:
        first = group[0]
        offsets = offset_rows(group)
        for device in {d for d in first.devices if d is not None}:
            for run in device_slots(first, device).runs:
                cells = offsets[:, run.where]
                # each block's in address order: its slots on a device are one run a
                # rank, in slot order interleaved when two ranks share the device,
                # and a save that takes them over (take) gets one run a rank back
                if cells.shape[1] > 1 and not (cells[:, 1:] > cells[:, :-1]).all():
                    cells = np.sort(cells, axis=1)
                cells = cells.ravel()
                self._offsets.setdefault((device, run.size), []).append(cells[cells >= 0])

    def count(self, device: str, nbytes: int) -> int:
        """How many gathered slots on ``device`` round as ``nbytes`` does."""
        size = round_size(nbytes)
        return sum(
            sum(map(len, parts))
            for (on, part_size), parts in self._offsets.items()
            if on == device and round_size(part_size) == size
        )

    def take(self, device: str, nbytes: int, count: int) -> np.ndarray:
        """Up to ``count`` of the gathered slots on ``device`` whose size rounds as
        ``nbytes`` does, kept out of :meth:`apply`: a save reuses the slots of
        the blocks it evicted as they are, one for one, without freeing them to
        the pool and taking them back (``SlotPool.alloc`` would). In the order
        gathered: block after block, each block's in address order, so a block
        made of a same-layout victim's slots lies in the runs it did."""
        size, out, got = round_size(nbytes), [], 0
        for key, parts in self._offsets.items():
            if got == count:
                break
            if key[0] != device or round_size(key[1]) != size:
                continue
            cells = np.concatenate(parts) if len(parts) > 1 else parts[0]
            n = min(count - got, len(cells))
            out.append(cells[:n])
            parts[:] = [cells[n:]]
            got += n
        if not out:
            return np.empty(0, dtype=np.int64)
        return out[0] if len(out) == 1 else np.concatenate(out)

    def apply(self, pools: dict[str, SlotPool]) -> None:
        for (device, size), offsets in self._offsets.items():
            freed = np.concatenate(offsets)
            if len(freed):
                pools[device].free(size, freed)
        self._offsets.clear()
