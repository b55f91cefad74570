"""Each tenant's part of the pools: which sealed blocks it holds, least recently
used first, their pool bytes, and who holds more than a fair share when a save
must evict (docs/design.md §2, §8); and what its query leases pin
(:class:`OwnerPins`, against its lease bound).

A sealed block is charged to its *owner*, the principal owning its client
namespace (``Tenants.owner_of``; "" when none: no TLS, or an admin's). A
tenant's *fair share* is the pools' bytes over the tenants holding sealed
blocks, the saving one counted too; when a save must evict, the tenants
holding more than that (the saver with the bytes it brings) lose their least
recently used blocks first. With one owner (every caller without TLS is the
same one) nobody is ever over and eviction is the plain global LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvstore.store.block import Block, Key
from kvstore.store.pool import round_size


def pool_bytes_of(blocks: list[Block]) -> int:
    """Pool bytes the slots of ``blocks`` take (each slot rounded as the pool
    rounds it); blocks of one layout share one slot array: summed once."""
    sizes: dict[int, int] = {}  # id(slot_bytes) -> one block's pool bytes
    total = 0
    for block in blocks:
        size = sizes.get(id(block.slot_bytes))
        if size is None:
            size = sizes[id(block.slot_bytes)] = sum(map(round_size, block.slot_bytes.tolist()))
        total += size
    return total


@dataclass(frozen=True)
class Saver:
    """Who a save's slots are for, and the pool bytes it brings (all its sizes)."""

    owner: str = ""
    nbytes: int = 0


@dataclass(frozen=True)
class Excess:
    """A tenant over its fair share, by how many pool bytes."""

    owner: str
    nbytes: int


def _by_owner(blocks: list[Block]) -> dict[str, list[Block]]:
    """``blocks`` by owner, in order (one owner a run of blocks, as a rule)."""
    out: dict[str, list[Block]] = {}
    owner, mine = None, []
    for block in blocks:
        if block.owner is not owner:
            owner = block.owner
            mine = out.setdefault(owner, [])
        mine.append(block)
    return out


class OwnerShares:
    """Per owner: its sealed blocks, least recently used first, and their pool
    bytes. The block index keeps it in step with its own LRU once ``split``:
    until a block of an owner other than "" seals (no TLS: never), every block
    is ""'s, the index's LRU is ""'s, and no books are kept (a save pays
    nothing for them)."""

    def __init__(self) -> None:
        self._lru: dict[str, OrderedDict[Key, Block]] = {}
        self._bytes: dict[str, int] = {}
        self.split = False

    def split_from(self, everyone: list[Block]) -> None:
        """Start keeping books, ``everyone`` being every sealed block (all ""'s),
        least recently used first."""
        self.split = True
        self.add(everyone)

    def add(self, blocks: list[Block]) -> None:
        """Sealed ``blocks`` (their owner set) join their owners' LRU, newest."""
        for owner, mine in _by_owner(blocks).items():
            lru = self._lru.get(owner)
            if lru is None:
                lru = self._lru[owner] = OrderedDict()
                self._bytes[owner] = 0
            lru.update([(b.key, b) for b in mine])
            self._bytes[owner] += pool_bytes_of(mine)

    def remove(self, blocks: list[Block]) -> None:
        """Sealed ``blocks`` left the index (evicted, cleared)."""
        for owner, mine in _by_owner(blocks).items():
            lru = self._lru[owner]
            for block in mine:
                del lru[block.key]
            if lru:
                self._bytes[owner] -= pool_bytes_of(mine)
            else:
                del self._lru[owner], self._bytes[owner]

    def touch(self, block: Block) -> None:
        """``block`` is most recently used."""
        self._lru[block.owner].move_to_end(block.key)

    def held(self, owner: str) -> int:
        """Pool bytes of ``owner``'s sealed blocks."""
        return self._bytes.get(owner, 0)

    def oldest(self, owner: str) -> Iterator[Block]:
        """``owner``'s sealed blocks, least recently used first."""
        return iter(self._lru.get(owner, {}).values())

    def share(self, pool_bytes: int, saver: Saver) -> int | None:
        """A fair share: ``pool_bytes`` over the tenants holding blocks, ``saver``
        counted; None while one tenant alone holds blocks and saves."""
        holders = len(self._lru) + (saver.owner not in self._lru)
        return None if holders == 1 else pool_bytes // holders

    def over(self, pool_bytes: int, saver: Saver) -> list[Excess]:
        """Tenants holding more than a fair share (``saver`` with what it brings),
        most over first; none while one tenant alone holds blocks and saves."""
        share = self.share(pool_bytes, saver)
        if share is None:
            return []
        held = dict(self._bytes)
        held[saver.owner] = held.get(saver.owner, 0) + saver.nbytes
        out = [Excess(owner, n - share) for owner, n in held.items() if n > share]
        return sorted(out, key=lambda e: -e.nbytes)


@dataclass
class OwnerPins:
    """The blocks one owner's id leases pin, each counted once however many of
    its leases hold it (a shared prompt leased by every request), and their
    pool bytes."""

    leases: dict[int, int] = field(default_factory=dict)  # id(block) -> leases holding it
    pool_bytes: int = 0

    def unpinned(self, blocks: Sequence[Block]) -> list[Block]:
        """Those of ``blocks`` none of this owner's leases holds yet."""
        return [block for block in blocks if id(block) not in self.leases]

    def add(self, blocks: list[Block]) -> None:
        self.pool_bytes += pool_bytes_of(self.unpinned(blocks))
        for block in blocks:
            self.leases[id(block)] = self.leases.get(id(block), 0) + 1

    def remove(self, blocks: list[Block]) -> None:
        freed = []
        for block in blocks:
            held = self.leases.pop(id(block)) - 1
            if held:
                self.leases[id(block)] = held
            else:
                freed.append(block)
        self.pool_bytes -= pool_bytes_of(freed)
