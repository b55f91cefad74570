"""How many blocks the router indexes: per holder, and in all.

Every event feed an admitted tenant controls (a vLLM publisher, a store's
PublishEvents, a relay) can name new block hashes without end, and each one
indexed costs memory (~130 B, holders.py). Two bounds keep the index finite:

- a worker's tier holds at most what its card says the worker can hold
  (``capacity_blocks``; ``RouterConfig.default_capacity_blocks`` when the card
  states none). The offload tier (``store``) is bounded by the larger of the
  two: an engine's CPU or disk tier outgrows its device cache, and the card
  states no size for it. A well-behaved engine evicts (BlockRemoved) before it
  stores past its capacity, so only lost removals or a card that says too
  little meet this bound.
- all holders together (workers' tiers, relays into them, store peers) hold at
  most ``RouterConfig.max_held_blocks`` blocks: an :class:`IndexBudget` every
  index of the router shares. A store advertises no pool size, so this is its
  only bound.

A stored block past a bound is not indexed and counted (``DropCause``
``over_capacity`` / ``index_full``); :class:`Overflows` says when to log: one
WARNING per holder per episode, an episode ending once the holder (or the
whole index) is back at or below ``SETTLED`` of its bound. Counting is O(1) per event: the
budget is one shared counter, a holder's count its own table's length.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

# Blocks indexed per worker tier when its card states no capacity_blocks: above
# any one engine's device cache today (an H200 holds ~70k blocks of 16 tokens of
# an 8B model, ~1.1M one-token pages of it: SGLang's default page size), ~520 MiB
# of index at most.
DEFAULT_CAPACITY_BLOCKS = 1 << 22
# Blocks indexed by the whole router (a block two holders hold counts twice).
# Measured by RSS (/proc/self/statm) over 2M random hashes in one HolderIndex:
# ~127 B a block held by one holder alone, ~99 B with 64 holders overlapping by
# half, ~67 B a block shared by four; so ~2 GiB at most, and up to half as much
# again while CPython's dicts resize.
DEFAULT_MAX_HELD_BLOCKS = 1 << 24
BYTES_PER_HELD_BLOCK = 130  # what the flags' help quotes
# An overflow episode ends once its holder is back at or below this share of its bound.
SETTLED = 0.9
UNBOUNDED = 1 << 62


@dataclass
class IndexBudget:
    """Blocks every index of one router may hold together, and how many they do."""

    limit: int = UNBOUNDED
    used: int = 0

    def room(self) -> int:
        return self.limit - self.used


@dataclass(frozen=True)
class Refused:
    """New blocks a store or update did not index, by the bound they met."""

    over_capacity: int = 0  # past the holder's own bound
    index_full: int = 0  # past the router-wide IndexBudget

    def __bool__(self) -> bool:
        return bool(self.over_capacity or self.index_full)

    def __add__(self, other: Refused) -> Refused:
        if not other:
            return self
        return Refused(self.over_capacity + other.over_capacity, self.index_full + other.index_full)


NONE_REFUSED = Refused()


class Overflows:
    """Holders (and the whole index) past their bound now: their episodes.

    At most one entry per holder that overflowed and is still indexed (a
    forgotten holder's goes with it: :meth:`close`), plus one for the index."""

    INDEX = "index"  # the key of the router-wide episode

    def __init__(self):
        self._open: dict[Hashable, int] = {}  # key -> blocks refused this episode

    def refused(self, key: Hashable, count: int) -> bool:
        """``count`` blocks of ``key`` were refused: True when this starts an
        episode (the one time to warn)."""
        opened = key not in self._open
        self._open[key] = self._open.get(key, 0) + count
        return opened

    def settle(self, key: Hashable, held: int, limit: int) -> int | None:
        """End ``key``'s episode, if one is open, when ``held`` is back at or
        below SETTLED of ``limit``: the blocks it refused (None: no episode ended)."""
        if key in self._open and held <= limit * SETTLED:
            return self._open.pop(key)
        return None

    def is_open(self, key: Hashable) -> bool:
        return key in self._open

    def close(self, key: Hashable) -> None:
        """Forget ``key``'s episode unlogged (its holder's blocks went with it)."""
        self._open.pop(key, None)

    def __bool__(self) -> bool:
        return bool(self._open)
