"""Prefix index: block hash -> bitmask of the holders that have that block.

Block hashes are chained (each names its whole prefix), so a flat dict is a
radix tree in disguise: the longest prefix a holder has of a request is the
number of leading request hashes whose mask carries the holder's bit. Holders
(workers, or store nodes per tier) get small slot numbers; a mask is a Python
int, so one dict lookup answers for every holder at once and a block held by
a single holder shares one interned ``1 << slot`` object instead of owning
an int.

Per slot we also keep a plain list of the hashes it was told it stores, so
a worker's death or removal clears exactly its entries (O(its blocks), not
O(index)). A list costs 8 bytes an entry (the ints are the dict's own keys)
where a set costs over 100; removals leave stale entries behind, which are
filtered out whenever the list has doubled since it was last compacted.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Iterable, Sequence
from itertools import accumulate, groupby, repeat, takewhile
from operator import and_

from kvstore.wire import limits
from kvstore.wire.errors import exhausted


class SlotIndex:
    """hash -> holder bitmask, with holder <-> slot bookkeeping."""

    def __init__(self, max_slots: int = limits.MAX_WORKERS_PER_DOMAIN):
        self.max_slots = max_slots
        self.masks: dict[int, int] = {}
        self._slot_of: dict[Hashable, int] = {}
        self._holder_of: dict[int, Hashable] = {}
        self._held: list[list[int]] = []
        self._compact_at: list[int] = []
        self._bits: list[int] = []
        self._free: list[int] = []

    # -- holders -----------------------------------------------------------

    def slot(self, holder: Hashable) -> int:
        """The holder's slot, assigned on first use (lowest free one)."""
        slot = self._slot_of.get(holder)
        if slot is not None:
            return slot
        if self._free:
            slot = min(self._free)
            self._free.remove(slot)
        else:
            slot = len(self._held)
            if slot >= self.max_slots:
                raise exhausted(f"index already has {self.max_slots} holders")
            self._held.append([])
            self._compact_at.append(_MIN_COMPACT)
            self._bits.append(1 << slot)
        self._slot_of[holder] = slot
        self._holder_of[slot] = holder
        return slot

    def slot_of(self, holder: Hashable) -> int | None:
        return self._slot_of.get(holder)

    def holder_of(self, slot: int) -> Hashable:
        return self._holder_of[slot]

    def holders(self) -> list[Hashable]:
        return list(self._slot_of)

    @property
    def all_slots_mask(self) -> int:
        mask = 0
        for slot in self._holder_of:
            mask |= self._bits[slot]
        return mask

    def release(self, holder: Hashable) -> int:
        """Forget ``holder`` and every entry it had; return how many."""
        slot = self._slot_of.pop(holder, None)
        if slot is None:
            return 0
        cleared = self.clear(slot)
        del self._holder_of[slot]
        self._free.append(slot)
        return cleared

    # -- events ------------------------------------------------------------

    def store(self, slot: int, hashes: Sequence[int]) -> None:
        bit = self._bits[slot]
        masks = self.masks
        get = masks.get
        for h in hashes:
            m = get(h)
            masks[h] = bit if m is None else m | bit
        held = self._held[slot]
        held.extend(hashes)
        if len(held) > self._compact_at[slot]:
            self._compact(slot)

    def remove(self, slot: int, hashes: Iterable[int]) -> int:
        """Drop the slot's bit from ``hashes``; return how many it really had."""
        bit = self._bits[slot]
        keep = ~bit
        masks = self.masks
        get = masks.get
        removed = 0
        for h in hashes:
            m = get(h)
            if m is None or not m & bit:
                continue
            removed += 1
            m &= keep
            if m:
                masks[h] = self._intern(m)
            else:
                del masks[h]
        return removed

    def clear(self, slot: int) -> int:
        """Drop every entry of the slot; return how many there were."""
        held = self._held[slot]
        self._held[slot] = []
        self._compact_at[slot] = _MIN_COMPACT
        return self.remove(slot, dict.fromkeys(held))

    def _compact(self, slot: int) -> None:
        bit = self._bits[slot]
        get = self.masks.get
        live = [h for h in dict.fromkeys(self._held[slot]) if get(h, 0) & bit]
        self._held[slot] = live
        self._compact_at[slot] = max(_MIN_COMPACT, 2 * len(live))

    def _intern(self, mask: int) -> int:
        """A single-holder mask becomes the shared ``1 << slot`` object."""
        if mask & (mask - 1) == 0:
            return self._bits[mask.bit_length() - 1]
        return mask

    # -- queries -----------------------------------------------------------

    def __len__(self) -> int:
        return len(self.masks)

    def prefix_depths(self, hashes: Sequence[int], active: int) -> dict[int, int]:
        """For each slot bit in ``active``: how many leading ``hashes`` it holds.

        The running AND of the masks (seeded with ``active``) only ever loses
        bits, and a holder's depth is where its bit disappears. The lookups,
        the AND and the stop at the first empty value all run in C
        (map / accumulate / takewhile); Python only sees one step per distinct
        running value, i.e. per holder dropping out, not per block.
        """
        depths: dict[int, int] = {}
        running = takewhile(
            bool, accumulate(map(self.masks.get, hashes, repeat(0)), and_, initial=active)
        )
        seen = 0  # running values consumed so far (the first is ``active`` itself)
        prev = 0
        for value, run in groupby(running):
            if seen:
                _record(depths, prev & ~value, seen - 1)
            prev = value
            seen += len(list(run))
        if prev:
            _record(depths, prev, seen - 1)
        return depths

    def prefix_length(self, hashes: Sequence[int], slot: int) -> int:
        """Leading ``hashes`` that one slot holds."""
        bit = self._bits[slot] if slot < len(self._bits) else 0
        get = self.masks.get
        for i, h in enumerate(hashes):
            if not get(h, 0) & bit:
                return i
        return len(hashes)

    def nbytes(self) -> int:
        """Approximate bytes of the index: dict, key ints, shared-mask ints, held lists."""
        total = sys.getsizeof(self.masks) + len(self.masks) * sys.getsizeof(1 << 62)
        total += sum(sys.getsizeof(v) for v in self.masks.values() if v & (v - 1))
        total += sum(sys.getsizeof(held) for held in self._held)
        return total


_MIN_COMPACT = 1024


def _record(depths: dict[int, int], bits: int, depth: int) -> None:
    while bits:
        low = bits & -bits
        depths[low.bit_length() - 1] = depth
        bits ^= low
