"""Prefix index: block hash -> bitmask of the holders that have that block.

Block hashes are chained (each names its whole prefix), so a flat dict is a
radix tree in disguise: the longest prefix a holder has of a request is the
number of leading request hashes whose mask carries the holder's bit. Holders
(workers, or store nodes per tier) get small bit numbers; a mask is a Python
int, so one dict lookup answers for every holder at once and a block held by
a single holder shares one interned ``1 << bit`` object instead of owning
an int.

Per holder we also keep a plain list of the hashes it was told it stores, so
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


class HolderIndex:
    """hash -> holder bitmask, with holder <-> bit number bookkeeping."""

    def __init__(self, max_holders: int = limits.MAX_WORKERS_PER_DOMAIN):
        self.max_holders = max_holders
        self.masks: dict[int, int] = {}
        self._bit_of: dict[Hashable, int] = {}
        self._holder_of: dict[int, Hashable] = {}
        self._held: list[list[int]] = []
        self._compact_at: list[int] = []
        self._single: list[int] = []  # bit -> the shared ``1 << bit`` int
        self._free: list[int] = []

    # -- holders -----------------------------------------------------------

    def assign(self, holder: Hashable) -> int:
        """The holder's bit number, assigned on first use (lowest free one)."""
        bit = self._bit_of.get(holder)
        if bit is not None:
            return bit
        if self._free:
            bit = min(self._free)
            self._free.remove(bit)
        else:
            bit = len(self._held)
            if bit >= self.max_holders:
                raise exhausted(f"index already has {self.max_holders} holders")
            self._held.append([])
            self._compact_at.append(_MIN_COMPACT)
            self._single.append(1 << bit)
        self._bit_of[holder] = bit
        self._holder_of[bit] = holder
        return bit

    def bit_of(self, holder: Hashable) -> int | None:
        return self._bit_of.get(holder)

    def holders(self) -> list[Hashable]:
        return list(self._bit_of)

    def release(self, holder: Hashable) -> int:
        """Forget ``holder`` and every entry it had; return how many."""
        bit = self._bit_of.pop(holder, None)
        if bit is None:
            return 0
        cleared = self.clear(bit)
        del self._holder_of[bit]
        self._free.append(bit)
        return cleared

    # -- events ------------------------------------------------------------

    def store(self, bit: int, hashes: Sequence[int]) -> None:
        single = self._single[bit]
        masks = self.masks
        get = masks.get
        for h in hashes:
            m = get(h)
            masks[h] = single if m is None else m | single
        held = self._held[bit]
        held.extend(hashes)
        if len(held) > self._compact_at[bit]:
            self._compact(bit)

    def remove(self, bit: int, hashes: Iterable[int]) -> int:
        """Drop holder ``bit`` from ``hashes``; return how many it really had."""
        single = self._single[bit]
        keep = ~single
        masks = self.masks
        get = masks.get
        removed = 0
        for h in hashes:
            m = get(h)
            if m is None or not m & single:
                continue
            removed += 1
            m &= keep
            if m:
                masks[h] = self._intern(m)
            else:
                del masks[h]
        return removed

    def clear(self, bit: int) -> int:
        """Drop every entry of holder ``bit``; return how many there were."""
        held = self._held[bit]
        self._held[bit] = []
        self._compact_at[bit] = _MIN_COMPACT
        return self.remove(bit, dict.fromkeys(held))

    def _compact(self, bit: int) -> None:
        single = self._single[bit]
        get = self.masks.get
        live = [h for h in dict.fromkeys(self._held[bit]) if get(h, 0) & single]
        self._held[bit] = live
        self._compact_at[bit] = max(_MIN_COMPACT, 2 * len(live))

    def _intern(self, mask: int) -> int:
        """A single-holder mask becomes the shared ``1 << bit`` object."""
        if mask & (mask - 1) == 0:
            return self._single[mask.bit_length() - 1]
        return mask

    # -- queries -----------------------------------------------------------

    def __len__(self) -> int:
        return len(self.masks)

    def prefix_depths(self, hashes: Sequence[int], active: int) -> dict[int, int]:
        """For each holder bit set in ``active``: how many leading ``hashes`` it holds.

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

    def holder_depths(
        self, hashes: Sequence[int], holders: Iterable[Hashable] | None = None
    ) -> dict[Hashable, int]:
        """Leading ``hashes`` each of ``holders`` holds (default: every holder).

        Holders the index does not know are left out of the answer.
        """
        if holders is None:
            bits = list(self._holder_of)
        else:
            bits = [b for b in map(self._bit_of.get, holders) if b is not None]
        active = 0
        for bit in bits:
            active |= self._single[bit]
        if not active:
            return {}
        return {self._holder_of[b]: d for b, d in self.prefix_depths(hashes, active).items()}

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
