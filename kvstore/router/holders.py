"""Prefix index: block hash -> bitmask of the holders that have that block.

Block hashes are chained (each names its whole prefix), so a flat dict is a
radix tree in disguise: the longest prefix a holder has of a request is the
number of leading request hashes whose mask carries the holder's bit. Holders
(workers, or store nodes per tier) get small bit numbers; a mask is a Python
int, so one dict lookup answers for every holder at once and a block held by
a single holder shares one interned ``1 << bit`` object instead of owning
an int.

Per holder we also keep the hashes it holds, so a worker's death or removal
clears exactly its entries (O(its blocks), not O(index)). They are exact at
all times (a store adds, a remove deletes), so there is no compaction pass:
no step is proportional to a holder's size except ``clear`` and ``release``
(and CPython's own amortised table resizes, in C). They are a dict of
``hash -> None``, not a set: a dict holding only ints is not tracked by the
garbage collector, so a full collection never walks the index (a set of 1M
ints costs every gen-2 collection ~100 ms). An entry costs ~40 bytes; its
key is usually the mask table's own int object; ``nbytes`` counts it.

Bounds (bounds.py): each holder has a limit on its blocks, and every index of
a router shares one ``IndexBudget``; a new block past either is not indexed
and counted in the ``Refused`` a store or update returns. Both are kept as
counters (one comparison per new block), never found by a scan.

The masks live in 256 dicts chosen by a hash's low byte, not one: a CPython
dict rebuilds its whole table when churn has used up its free slots, which
for one 4M-entry dict is a ~250 ms stall under the router lock every ~1.4M
stores; a shard's rebuild is 1/256 of that. The prefix walk picks the shard
per hash in C (``map``) as well.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Iterable, Iterator, Sequence
from itertools import accumulate, groupby, repeat, takewhile
from operator import and_

from kvstore.router.bounds import NONE_REFUSED, UNBOUNDED, IndexBudget, Refused
from kvstore.wire import limits
from kvstore.wire.errors import exhausted


class HolderIndex:
    """hash -> holder bitmask, with holder <-> bit number bookkeeping."""

    def __init__(
        self, max_holders: int = limits.MAX_WORKERS_PER_DOMAIN, budget: IndexBudget | None = None
    ):
        self.max_holders = max_holders
        self.budget = budget if budget is not None else IndexBudget()
        self._shards: list[dict[int, int]] = [{} for _ in range(_SHARDS)]
        self._bit_of: dict[Hashable, int] = {}
        self._holder_of: dict[int, Hashable] = {}
        self._held: list[dict[int, None]] = []
        self._single: list[int] = []  # bit -> the shared ``1 << bit`` int
        self._limit: list[int] = []  # bit -> the most blocks its holder may hold
        self._free: list[int] = []
        self._assigned = 0  # the bits of every holder, OR-ed

    # -- holders -----------------------------------------------------------

    def assign(self, holder: Hashable, limit: int = UNBOUNDED) -> int:
        """The holder's bit number, assigned on first use (lowest free one); a
        new holder may hold at most ``limit`` blocks."""
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
            self._held.append({})
            self._single.append(1 << bit)
            self._limit.append(limit)
        self._limit[bit] = limit
        self._bit_of[holder] = bit
        self._holder_of[bit] = holder
        self._assigned |= self._single[bit]
        return bit

    def room(self) -> int:
        """How many more new holders :meth:`assign` can take."""
        return self.max_holders - len(self._held) + len(self._free)

    def bit_of(self, holder: Hashable) -> int | None:
        return self._bit_of.get(holder)

    def holders(self) -> list[Hashable]:
        return list(self._bit_of)

    def held(self, bit: int) -> int:
        """How many blocks holder ``bit`` holds."""
        return len(self._held[bit])

    def entries(self) -> int:
        """Blocks held, summed over holders (O(holders); what this index takes of its budget)."""
        return sum(map(len, self._held))

    def release(self, holder: Hashable) -> int:
        """Forget ``holder`` and every entry it had; return how many."""
        bit = self._bit_of.pop(holder, None)
        if bit is None:
            return 0
        cleared = self.clear(bit)
        del self._holder_of[bit]
        self._free.append(bit)
        self._assigned &= ~self._single[bit]
        return cleared

    # -- events ------------------------------------------------------------

    def store(self, bit: int, hashes: Iterable[int]) -> Refused:
        """Holder ``bit`` holds ``hashes``; those past its limit or the budget are not indexed."""
        held = self._held[bit]
        before = len(held)
        room = min(self._limit[bit] - before, self.budget.room())
        single, shards, low = self._single[bit], self._shards, _SHARD_MASK
        refused = 0
        for h in hashes:
            if h in held:
                continue
            if room <= 0:
                refused += 1
                continue
            room -= 1
            held[h] = None
            masks = shards[h & low]
            m = masks.get(h)
            masks[h] = single if m is None else m | single
        self.budget.used += len(held) - before
        return self._refused(bit, refused)

    def _refused(self, bit: int, count: int) -> Refused:
        """``count`` new blocks of holder ``bit`` found no room: which bound was met
        (its own when it is full, else the budget)."""
        if not count:
            return NONE_REFUSED
        if len(self._held[bit]) >= self._limit[bit]:
            return Refused(over_capacity=count)
        return Refused(index_full=count)

    def remove(self, bit: int, hashes: Iterable[int]) -> int:
        """Drop holder ``bit`` from ``hashes``; return how many it really had."""
        held = self._held[bit]
        before = len(held)
        for h in hashes:
            if h in held:
                del held[h]
                self._unset(h, bit)
        self.budget.used -= before - len(held)
        return before - len(held)

    def update(self, bit: int, hashes: Sequence[int], keeps: Sequence[bool]) -> Refused:
        """Apply events in order: ``hashes[i]`` stored (``keeps[i]``) or removed;
        a new block past the holder's limit or the budget is not indexed (a
        removal earlier in the run makes room for it).

        One mask lookup per hash decides; the holder's own table is touched
        only when its membership really changes.
        """
        held = self._held[bit]
        before = len(held)
        room = min(self._limit[bit] - before, self.budget.room())
        refused = 0
        single, unset = self._single[bit], ~self._single[bit]
        shards, low = self._shards, _SHARD_MASK
        for h, keep in zip(hashes, keeps, strict=True):
            masks = shards[h & low]
            m = masks.get(h, 0)
            if keep:
                if not m & single:
                    if room <= 0:
                        refused += 1
                        continue
                    room -= 1
                    held[h] = None
                    masks[h] = m | single if m else single
            elif m & single:
                room += 1
                del held[h]
                m &= unset
                if not m:
                    del masks[h]
                elif m & (m - 1):
                    masks[h] = m
                else:
                    masks[h] = self._single[m.bit_length() - 1]
        self.budget.used += len(held) - before
        return self._refused(bit, refused)

    def clear(self, bit: int) -> int:
        """Drop every entry of holder ``bit``; return how many there were."""
        held = self._held[bit]
        self._held[bit] = {}
        for h in held:
            self._unset(h, bit)
        self.budget.used -= len(held)
        return len(held)

    def _unset(self, h: int, bit: int) -> None:
        masks = self._shards[h & _SHARD_MASK]
        m = masks[h] & ~self._single[bit]
        if m & (m - 1):
            masks[h] = m
        elif m:
            masks[h] = self._single[m.bit_length() - 1]  # single holder: the shared int
        else:
            del masks[h]

    # -- queries -----------------------------------------------------------

    def __len__(self) -> int:
        return sum(map(len, self._shards))

    @property
    def masks(self) -> dict[int, int]:
        """Every hash's mask, merged into one new dict (O(index): tests, tools)."""
        return {h: m for shard in self._shards for h, m in shard.items()}

    def prefix_depths(self, hashes: Sequence[int], active: int) -> dict[int, int]:
        """For each holder bit set in ``active`` that holds at least the first of
        ``hashes``: how many leading ``hashes`` it holds (a miss is no entry).

        The running AND of the masks (seeded with ``active``) only ever loses
        bits, and a holder's depth is where its bit disappears. The lookups,
        the AND and the stop at the first empty value all run in C
        (map / accumulate / takewhile); Python only sees one step per distinct
        running value, i.e. per holder dropping out, not per block.
        """
        depths: dict[int, int] = {}
        running = takewhile(bool, accumulate(self._lookups(hashes), and_, initial=active))
        seen = 0  # running values consumed so far (the first is ``active`` itself)
        prev = 0
        for value, run in groupby(running):
            if seen > 1:  # bits gone at the first hash (seen == 1) have no prefix
                _record(depths, prev & ~value, seen - 1)
            prev = value
            seen += len(list(run))
        if prev and seen > 1:
            _record(depths, prev, seen - 1)
        return depths

    def _lookups(self, hashes: Sequence[int]) -> Iterator[int]:
        """Each hash's mask (0 when none), its shard picked per hash, all in C."""
        shards = map(self._shards.__getitem__, map(and_, hashes, repeat(_SHARD_MASK)))
        return map(dict.get, shards, hashes, repeat(0))

    def holder_depths(
        self, hashes: Sequence[int], holders: Iterable[Hashable] | None = None
    ) -> dict[Hashable, int]:
        """Leading ``hashes`` each of ``holders`` holds (default: every holder,
        at no cost per holder that misses).

        Holders without even the first block, and holders the index does not
        know, are left out of the answer.
        """
        if holders is None:
            active = self._assigned
        else:
            bits = {b for b in map(self._bit_of.get, holders) if b is not None}
            active = sum(map(self._single.__getitem__, bits))  # distinct bits: sum is OR
        if not active:
            return {}
        return {self._holder_of[b]: d for b, d in self.prefix_depths(hashes, active).items()}

    def nbytes(self) -> int:
        """Bytes of the index by ``sys.getsizeof``: the dict, its key ints, the
        multi-holder mask ints (single-holder masks are shared) and the holder
        dicts (whose keys are mostly the mask tables' own ints). Allocator slack is not counted."""
        total = sum(map(sys.getsizeof, self._shards)) + len(self) * sys.getsizeof(1 << 62)
        for shard in self._shards:
            total += sum(sys.getsizeof(v) for v in shard.values() if v & (v - 1))
        total += sum(sys.getsizeof(held) for held in self._held)
        return total


_SHARDS = 256
_SHARD_MASK = _SHARDS - 1


def _record(depths: dict[int, int], bits: int, depth: int) -> None:
    while bits:
        low = bits & -bits
        depths[low.bit_length() - 1] = depth
        bits ^= low
