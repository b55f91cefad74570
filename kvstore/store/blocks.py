"""The block index: every block of one node (:mod:`kvstore.store.block`), its
slots in the pools, LRU eviction and pins (docs/design.md §2).

* A save *claims* the caller's slots of *inflight* blocks, and *finishes* the
  claim once its bytes are in; a block whose every slot is written is
  *sealed*: visible to queries, loads and peers, and evictable (LRU, whole
  blocks; tenants over a fair share of the pool first: kvstore.store.shares).
  An inflight block is dropped, never shown, when a writer leaves,
  its copy fails, or it is still incomplete after ``INFLIGHT_TIMEOUT_S``.
* A :class:`Lease` *pins* sealed blocks (a load's copy, a client's query
  lease, a peer's fetch): a pinned block is never evicted or cleared. It is the
  one pin mechanism; only this index changes ``Block.pins``.
* *Detached* blocks (:meth:`BlockIndex.reserve`) take a peer's bytes outside
  the index and join it sealed (:meth:`BlockIndex.adopt`).

The index knows blocks, slots and pools; not registrations, not copies. Every
method is synchronous, so on the asyncio server a check and its change never
interleave with another request. Events are handed to ``on_event`` with an
empty ``worker``: the server that publishes them stamps its node id.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.store.block import (
    Block,
    BlockShape,
    Key,
    NewBlocks,
    SlotSet,
    new_blocks,
    offset_rows,
    placed,
    tp_rank_slots,
    unallocated,
)
from kvstore.store.eviction import SlotFrees, same_size_victims, slab_victims
from kvstore.store.pool import PoolStats, SlotPool, round_size
from kvstore.store.shares import Excess, OwnerPins, OwnerShares, Saver, pool_bytes_of
from kvstore.wire.errors import exhausted, not_found
from kvstore.wire.events import CLEARED, REMOVED, STORE_TIER, STORED, StoreEvent
from kvstore.wire.limits import MAX_HASHES_PER_EVENT
from kvstore.wire.sizes import format_size

log = logging.getLogger(__name__)

INFLIGHT_TIMEOUT_S = 120.0
_NO_SLOTS = np.empty(0, dtype=np.int64)
_NO_SLOTS.flags.writeable = False


@dataclass(eq=False)
class Lease:
    """Sealed blocks pinned until :meth:`BlockIndex.unpin` (docs/design.md §2)."""

    blocks: list[Block]
    lease_id: str = ""  # set when a client holds the lease by id; then it expires
    expires: float = math.inf
    owner: str = ""  # the principal that holds it by id
    released: bool = False

    @property
    def hashes(self) -> list[int]:
        return [b.block_hash for b in self.blocks]


@dataclass(frozen=True)
class Writer:
    """Who writes a claim's slots: a session, its tp_rank and its device, and the
    instance and engine step whose KV they are (step 0: the client counts none)."""

    session: str
    tp_rank: int
    device: str
    instance: str = ""
    step: int = 0

    @property
    def origin(self) -> tuple[str, int]:
        return (self.instance, self.step)


@dataclass
class Claim:
    """The slots one save took: the blocks it writes and where in its request they are."""

    writer: Writer
    slots: SlotSet  # the writer's slots (one a layer it registered)
    blocks: list[Block]
    picked: list[int]  # request position of each claimed block
    skipped: int  # requested blocks already sealed or claimed by another writer
    offsets: np.ndarray | None = None  # (blocks, slots): row i is blocks[i].offsets, if one array


@dataclass(frozen=True)
class Finished:
    written: int  # claimed blocks whose slots are now in
    sealed: int  # of them, blocks that became visible


@dataclass(frozen=True)
class IndexStats:
    sealed_blocks: int = 0
    inflight_blocks: int = 0
    leases: int = 0  # leases clients hold by id
    evictions: int = 0
    pinned_blocks: int = 0  # held by a load, a lease or a peer's fetch right now
    events_refused: int = 0  # events a listener raised on (the change stood; logged)


def _check_fits(pool: SlotPool, slots: SlotSet, num_blocks: int) -> None:
    """A request the pool could not hold even empty is refused before anything
    is evicted for it."""
    wanted = {run.size: len(run.cells) * num_blocks for run in slots.runs}
    if not pool.holds_when_empty(wanted):
        raise exhausted(
            f"{num_blocks} blocks of {len(slots.slots)} slots "
            f"({format_size(slots.nbytes * num_blocks)}) are more "
            f"than the pool on {pool.device} holds even empty ({format_size(pool.pool_bytes)} "
            "in slabs of one slot size each): save fewer blocks at a time or grow --pool-size"
        )


def _place(
    blocks: list[Block], where: slice | np.ndarray, grid: np.ndarray, rows: np.ndarray | None
) -> None:
    """Write row i of ``grid`` into cells ``where`` of block i's offsets: in one
    call when ``rows`` holds the blocks' offsets, else per block (a slice, when
    the cells are evenly spaced, is per block cheaper than a fancy index)."""
    if rows is not None:
        rows[:, where] = grid
        return
    for row, block in zip(grid, blocks, strict=True):
        block.offsets[where] = row


def _by_namespace(keys: list[Key]) -> dict[str, list[int]]:
    """The hashes of ``keys``, by namespace, in order (one namespace object a run
    of keys, as a rule: a lookup per run, not per key)."""
    out: dict[str, list[int]] = {}
    namespace, hashes = None, []
    for ns, block_hash in keys:
        if ns is not namespace:
            namespace = ns
            hashes = out.setdefault(ns, [])
        hashes.append(block_hash)
    return out


class BlockIndex:
    """All blocks of one node, over one slot pool per device."""

    def __init__(
        self,
        pools: dict[str, SlotPool],
        on_event: Callable[[StoreEvent], None] | None = None,
    ):
        self._pools = pools
        self.blocks: dict[Key, Block] = {}
        self._lru: OrderedDict[Key, Block] = OrderedDict()  # sealed blocks, oldest first
        self._leases: dict[str, Lease] = {}  # leases held by id
        self._writers: dict[str, set[Key]] = {}  # session -> inflight blocks it claimed
        self._on_event = on_event
        self._events_refused = 0  # events on_event raised on (logged; the change stands)
        self._seq = 0
        self._evictions = 0
        self._pinned = 0  # blocks with pins > 0 (Stats reads it; walking them is O(blocks))
        self._leases_of: Counter[str] = Counter()  # owner -> leases it holds by id
        self._pins_of: dict[str, OwnerPins] = {}  # owner -> what its id leases pin
        self._shares = OwnerShares()  # sealed blocks by owner: fair shares when evicting
        self._owner_of: Callable[[str], str] = lambda _namespace: ""

    def charge_to(self, owner_of: Callable[[str], str]) -> None:
        """Charge each block sealed from now on to ``owner_of(its namespace)``, the
        tenant owning it: a save that must evict takes first from tenants over a
        fair share of the pools (kvstore.store.shares). Until then every block is
        the one owner ""'s and eviction is the plain LRU."""
        self._owner_of = owner_of

    def _split_shares(self) -> None:
        """Keep per-owner books from now on (a tenant other than "" saves)."""
        if not self._shares.split:
            self._shares.split_from(list(self._lru.values()))

    def held_bytes_of(self, owner: str) -> int:
        """Pool bytes of the sealed blocks charged to ``owner``."""
        if not self._shares.split:  # every block is ""'s
            return pool_bytes_of(list(self._lru.values())) if owner == "" else 0
        return self._shares.held(owner)

    # --------------------------------------------------------------- look-ups

    def sealed_prefix(self, namespace: str, hashes: list[int]) -> list[Block]:
        """The sealed blocks of the longest prefix of ``hashes`` held here."""
        out = []
        for h in hashes:
            block = self.blocks.get((namespace, h))
            if block is None or not block.sealed:
                break
            out.append(block)
        return out

    def require_sealed(self, namespace: str, hashes: list[int]) -> list[Block]:
        """The sealed block of every hash; NOT_FOUND names the first that is not."""
        blocks = self.sealed_prefix(namespace, hashes)
        if len(blocks) < len(hashes):
            raise not_found(
                f"block_hash {hashes[len(blocks)]:#018x} is not sealed in namespace "
                f"{namespace}; nothing was loaded"
            )
        return blocks

    def snapshot(self) -> list[Key]:
        """The key of every sealed block, least recently used first."""
        return list(self._lru)

    def stats(self) -> IndexStats:
        return IndexStats(
            sealed_blocks=len(self._lru),
            inflight_blocks=len(self.blocks) - len(self._lru),
            leases=len(self._leases),
            evictions=self._evictions,
            pinned_blocks=self._pinned,
            events_refused=self._events_refused,
        )

    def slot_limit(self) -> int:
        """The largest slot any pool here can hold (a slot larger than a slab cannot
        be stored, docs/design.md §2)."""
        return min(pool.slab_bytes for pool in self._pools.values())

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices whose pools hold this index's slots."""
        return tuple(self._pools)

    def pool(self, device: str) -> SlotPool:
        """The slot pool of ``device``."""
        return self._pools[device]

    def pool_stats(self) -> PoolStats:
        """The slot pools of every device, summed."""
        return PoolStats.total([pool.stats() for pool in self._pools.values()])

    # ------------------------------------------------------------------- save

    def claim(
        self, namespace: str, hashes: list[int], shape: BlockShape, slots: SlotSet, by: Writer
    ) -> Claim:
        """Claim ``slots`` of every block of distinct ``hashes`` that is neither sealed
        nor already claimed there, allocating them (evicting as needed). All or
        nothing, but for inflight blocks of the writer's instance begun in another
        engine step: those are dropped and made anew, since ranks' slots of one
        block seal together only when computed in one step (a rank whose load
        failed in a step saves nothing, and the others' KV of that step may rest
        on its stale blocks). An inflight block another instance began in a step
        it counts is left to it (skipped): steps of two schedulers say nothing
        of each other. Writers that count no steps (0) join any, as ever."""
        mask = slots.mask
        picked, fresh, found, stale = self._sort(namespace, hashes, mask, by)
        if not picked:
            return Claim(by, slots, [], picked, skipped=len(hashes))
        for block in stale:  # they can never seal: their slots may serve this claim
            self._drop(block)
        if stale:
            log.info(
                "dropped %d inflight blocks of %s that ranks of %s began in another step",
                len(stale),
                namespace,
                by.instance,
            )
        mine_now = (by.session,)
        # new blocks are born claimed and placed: nothing sees them before they join the index
        made = new_blocks(
            namespace,
            fresh,
            shape,
            time.monotonic(),
            devices=placed((None,) * shape.tp_size, by.tp_rank, by.device),
            claimed=mask,
            writers=mine_now,
            copying=1,
            origin=by.origin,
        )
        if len(fresh) == len(picked):  # the usual save: every block new, one offsets array
            blocks, rows = made.blocks, made.offsets
        else:
            new = iter(made.blocks)
            blocks, rows = [b if b is not None else next(new) for b in found], None
        self._allocate(blocks, slots, by.device, rows, self._owner_of(namespace))
        mine = self._writers.setdefault(by.session, set())
        keys = [(namespace, h) for h in fresh]
        self.blocks.update(zip(keys, made.blocks, strict=True))
        mine.update(keys)
        moved: dict[tuple, tuple] = {}  # devices before -> after: one tuple per kind of block
        for block in found if rows is None else ():  # blocks other ranks claimed first
            if block is None:
                continue
            block.claimed |= mask
            block.copying += 1
            devices = moved.get(block.devices)
            if devices is None:
                devices = moved[block.devices] = block.placed(by.tp_rank, by.device)
            block.devices = devices
            block.writers += mine_now
            mine.add(block.key)
        return Claim(by, slots, blocks, picked, len(hashes) - len(blocks), rows)

    def _sort(
        self, namespace: str, hashes: list[int], mask: int, by: Writer
    ) -> tuple[list[int], list[int], list[Block | None], list[Block]]:
        """For a claim of ``mask`` slots by writer ``by``: the request positions it
        writes, the hashes it makes new blocks of, per position its inflight block
        (None if new), and the stale inflight blocks new ones replace. An inflight
        block whose slots of ``by``'s tp_rank lie on another device is left alone
        (skipped): a block keeps one device a tp_rank, and another instance's
        ranks of that tp_rank (pipeline stages) may have claimed some of them."""
        found = list(map(self.blocks.get, [(namespace, h) for h in hashes]))
        if found.count(None) == len(found):  # the usual save: every block new
            return list(range(len(hashes))), list(hashes), found, []
        return self._sort_known(hashes, found, mask, by)

    @staticmethod
    def _sort_known(
        hashes: list[int], known: list[Block | None], mask: int, by: Writer
    ) -> tuple[list[int], list[int], list[Block | None], list[Block]]:
        """:meth:`_sort` given the block each hash has in the index (or None)."""
        origin, tp_rank = by.origin, by.tp_rank
        picked, fresh = [], []
        found: list[Block | None] = []
        stale: list[Block] = []
        for i, (h, block) in enumerate(zip(hashes, known, strict=True)):
            if block is not None and not block.sealed and block.origin != origin:
                if block.origin[0] == origin[0]:  # this instance, another step
                    stale.append(block)
                    block = None
                elif block.origin[1] or origin[1]:  # another instance counting steps
                    continue
            if block is None:
                fresh.append(h)
            elif (
                block.sealed
                or block.claimed & mask
                or block.devices[tp_rank] not in (None, by.device)
            ):
                continue
            picked.append(i)
            found.append(block)
        return picked, fresh, found, stale

    def finish(self, claim: Claim) -> Finished:
        """The claim's bytes are in: mark its slots written, seal complete blocks.
        Every claim ends in finish or :meth:`abandon`, once its copy ended."""
        alive = claim.writer.session in self._writers
        mask = claim.slots.mask
        written, sealed = 0, []
        known = self.blocks.get
        full = claim.blocks[0].all_slots if claim.blocks else 0  # one layout a claim
        for block in claim.blocks:
            block.copying -= 1
            if known(block.key) is not block:  # dropped while the bytes moved
                self._free_slots(block)  # (a writer left, or it went stale): its slots now
                continue
            if not alive:
                self._drop(block)
                continue
            block.written |= mask
            written += 1
            if block.written == full:
                sealed.append(block)
        self._seal(sealed)
        return Finished(written, len(sealed))

    def abandon(self, claim: Claim) -> None:
        """The claim's copy failed, or never ran: drop its blocks that are still
        inflight (and free those dropped while it ran)."""
        for block in claim.blocks:
            block.copying -= 1
            if self.blocks.get(block.key) is not block:
                self._free_slots(block)
            elif not block.sealed:
                self._drop(block)

    def drop_writer(self, session: str) -> int:
        """A writer left: its inflight blocks are dropped, never made visible."""
        dropped = 0
        for key in self._writers.pop(session, set()):
            block = self.blocks.get(key)
            if block is not None and not block.sealed:
                self._drop(block)
                dropped += 1
        if dropped:
            log.warning("dropped %d inflight blocks of a departed writer", dropped)
        return dropped

    def addresses(
        self,
        blocks: list[Block],
        slots: np.ndarray,
        device: str,
        rows: np.ndarray | None = None,
    ) -> np.ndarray:
        """Address of ``slots`` of each block in ``device``'s pool, (slots, blocks);
        ``rows``: the blocks' offsets as one array, when they have it (Claim.offsets)."""
        if rows is None:
            rows = offset_rows(blocks)
        return (self._pools[device].base + rows[:, slots].T).astype(np.uint64)

    # ------------------------------------------------------------------- pins

    def pin(
        self, blocks: list[Block], *, ttl_ms: int = 0, refresh: bool = True, owner: str = ""
    ) -> Lease:
        """Pin sealed ``blocks`` until :meth:`unpin`. With ``ttl_ms`` the lease gets
        an id, is ``owner``'s, is found by :meth:`held` and expires. ``refresh``
        makes the blocks most recently used (a load and a client lease do; a peer's
        read does not)."""
        lease = Lease(blocks, owner=owner)
        for block in blocks:
            self._pinned += block.pins == 0
            block.pins += 1
            if refresh:
                self._lru.move_to_end(block.key)
                if self._shares.split:
                    self._shares.touch(block)
        if ttl_ms:
            lease.lease_id = secrets.token_hex(12)
            lease.expires = time.monotonic() + ttl_ms / 1000
            self._leases[lease.lease_id] = lease
            self._leases_of[owner] += 1
            self._pins_of.setdefault(owner, OwnerPins()).add(blocks)
        return lease

    def unpin(self, lease: Lease) -> None:
        """Release ``lease``'s pins; a second call does nothing."""
        if lease.released:
            return
        lease.released = True
        if self._leases.pop(lease.lease_id, None) is not None:
            self._leases_of[lease.owner] -= 1
            if not self._leases_of[lease.owner]:
                del self._leases_of[lease.owner]
            pins = self._pins_of[lease.owner]
            pins.remove(lease.blocks)
            if not pins.leases:
                del self._pins_of[lease.owner]
        for block in lease.blocks:
            block.pins -= 1
            self._pinned -= block.pins == 0

    def held(self, lease_id: str) -> Lease:
        """The lease held by id ``lease_id``: NOT_FOUND when unknown or expired (one
        past its expiry that :meth:`expire` has not swept yet is released now)."""
        lease = self._leases.get(lease_id)
        if lease is not None and lease.expires <= time.monotonic():
            self.unpin(lease)
            lease = None
        if lease is None:
            raise not_found(f"lease_id {lease_id[:64]!r} is unknown or expired")
        return lease

    def leases_of(self, owner: str) -> int:
        """How many leases ``owner`` holds by id."""
        return self._leases_of[owner]

    def leased_bytes_of(self, owner: str, more: Sequence[Block] = ()) -> int:
        """Pool bytes the leases ``owner`` holds by id pin (a block two of them hold
        counts once), with ``more`` leased too."""
        pins = self._pins_of.get(owner, OwnerPins())
        return pins.pool_bytes + pool_bytes_of(pins.unpinned(more))

    def pool_bytes(self) -> int:
        """Bytes of every device's pool together."""
        return sum(pool.pool_bytes for pool in self._pools.values())

    def fair_share(self, owner: str) -> int:
        """The pools' bytes over the tenants holding sealed blocks, ``owner``
        counted (every byte while one tenant alone holds blocks)."""
        share = self._shares.share(self.pool_bytes(), Saver(owner)) if self._shares.split else None
        return self.pool_bytes() if share is None else share

    # --------------------------------------------------------------- detached

    def reserve(
        self, namespace: str, hashes: list[int], shape: BlockShape, devices: list[str]
    ) -> NewBlocks:
        """Blocks with every slot allocated (tp_rank r's on ``devices[r]``) but kept
        out of the index until :meth:`adopt`; :meth:`discard` frees them."""
        made = new_blocks(namespace, hashes, shape, time.monotonic(), devices=tuple(devices))
        owner = self._owner_of(namespace)
        try:
            for tp_rank, device in enumerate(devices):
                slots = tp_rank_slots(shape.slot_bytes, shape.tp_size, tp_rank)
                self._allocate(made.blocks, slots, device, made.offsets, owner)
        except BaseException:
            self.discard(made.blocks)
            raise
        return made

    def adopt(self, blocks: list[Block]) -> int:
        """Seal fully received detached blocks into the index, one STORED event
        per namespace; a block the index holds already is freed instead. How
        many were adopted."""
        fresh, index = [], self.blocks
        full = blocks[0].all_slots if blocks else 0  # one reservation's: one layout
        for block in blocks:
            if block.key in index:
                self._drop(block)
                continue
            block.written = full
            index[block.key] = block
            fresh.append(block)
        self._seal(fresh)
        return len(fresh)

    def discard(self, blocks: list[Block]) -> None:
        """Free detached blocks that will not be adopted."""
        for block in blocks:
            self._drop(block)

    # ------------------------------------------------------------- life cycle

    def expire(self, now: float | None = None) -> None:
        """Release expired leases; drop inflight blocks that no writer finished."""
        now = time.monotonic() if now is None else now
        for lease in [x for x in self._leases.values() if x.expires <= now]:
            self.unpin(lease)
        stale = [
            b for b in self.blocks.values() if not b.sealed and now - b.created > INFLIGHT_TIMEOUT_S
        ]
        for block in stale:
            self._drop(block)

    def clear(self, namespace: str | None = None) -> int:
        """Drop every unpinned sealed block (of one namespace, or all). Each
        namespace's ``cleared`` event is followed by ``stored`` of its pinned
        blocks, which stay: a router that follows the events still knows them."""
        victims = [
            b
            for b in self._lru.values()
            if b.pins == 0 and (namespace is None or b.key[0] == namespace)
        ]
        namespaces = {namespace} if namespace else {b.key[0] for b in self._lru.values()}
        self._remove_sealed(victims)
        kept = _by_namespace([k for k in self._lru if namespace is None or k[0] == namespace])
        for ns in sorted(namespaces):  # one event per namespace: routers index per namespace
            self._emit(CLEARED, ns, [])
            if ns in kept:
                self._emit(STORED, ns, kept[ns])
        return len(victims)

    def _seal(self, blocks: list[Block]) -> None:
        """Make blocks visible; one STORED event per namespace for the lot."""
        if not blocks:
            return
        keys = [block.key for block in blocks]
        # a writer's inflight set loses every key at once (the blocks of a claim, as
        # a rule, have one or two writers between them)
        for session in set().union(*[block.writers for block in blocks]):
            mine = self._writers.get(session)
            if mine is not None:
                mine.difference_update(keys)
        namespace, owner, tenants = None, "", self._shares.split
        for block in blocks:
            block.sealed = True
            block.writers = ()
            if block.key[0] is not namespace:  # a run of one namespace, as a rule
                namespace = block.key[0]
                owner = self._owner_of(namespace)
                tenants = tenants or owner != ""
            block.owner = owner
        if tenants:
            self._split_shares()
            self._shares.add(blocks)
        self._lru.update(zip(keys, blocks))
        for namespace, hashes in _by_namespace(keys).items():
            self._emit(STORED, namespace, hashes)

    def _allocate(
        self,
        blocks: list[Block],
        slots: SlotSet,
        device: str,
        rows: np.ndarray | None = None,
        owner: str = "",
    ) -> None:
        """Give ``slots`` of every block an offset in ``device``'s pool, evicting LRU
        blocks as needed. All or nothing: on failure every offset taken is returned.
        ``rows``: the blocks' offsets as one array (row i is block i's), when they
        have it; ``owner``: the tenant the blocks will be charged to.

        Slots are laid out block after block, each block's in ascending slot index
        (layer id major, whatever order the caller registered its layers in): the
        order a peer reads them (kvstore.transfer: transfer order with lanes =
        tp_size), so a served block's slots of one size lie in one run."""
        pool = self._pools[device]
        taken: list[tuple[int, np.ndarray]] = []
        checked = False
        brought = sum(round_size(run.size) * len(run.cells) for run in slots.runs)
        saver = Saver(owner, brought * len(blocks))
        if owner and any(
            not pool.can_alloc(r.size, len(r.cells) * len(blocks)) for r in slots.runs
        ):
            self._check_within_share(pool, saver)  # before anything is evicted
        try:
            for run in slots.runs:
                count = len(run.cells) * len(blocks)
                if not checked and not pool.can_alloc(run.size, count):
                    _check_fits(pool, slots, len(blocks))  # else it would evict for nothing
                    checked = True
                offsets = self._alloc_or_evict(pool, run.size, count, saver)
                taken.append((run.size, offsets))
                _place(blocks, run.where, offsets.reshape(len(blocks), len(run.cells)), rows)
        except BaseException:
            for size, offsets in taken:
                pool.free(size, offsets)
            if rows is not None:
                rows[:, slots.slots] = -1
            else:
                for block in blocks:
                    block.offsets[slots.slots] = -1
            raise

    def _alloc_or_evict(self, pool: SlotPool, size: int, count: int, saver: Saver) -> np.ndarray:
        """``count`` slots of ``size``, evicting by bytes (kvstore.store.eviction):
        first from tenants over their fair share (kvstore.store.shares), then,
        unless the saver itself would stay over, from everyone's LRU. The
        same-size victims' slots are handed over as they are (a full pool in
        steady state frees and takes nothing); the rest come from the pool."""
        handed = _NO_SLOTS
        if round_size(size) <= pool.slab_bytes and not pool.can_alloc(size, count):
            if saver.owner:
                self._split_shares()
            over = self._shares.over(self.pool_bytes(), saver)
            if over:
                handed = self._evict_over_share(pool, size, count, over, saver)
            if not pool.can_alloc(size, count - len(handed)):
                more = self._evict_lru(pool, size, count - len(handed))
                handed = np.concatenate((handed, more)) if len(handed) else more
        if len(handed) == count:
            return handed
        offsets = pool.alloc(size, count - len(handed))
        if offsets is None:
            if len(handed):
                pool.free(size, handed)  # all or nothing: the victims stay evicted
            raise exhausted(
                f"pool on {pool.device} cannot hold {count} slots of {size} bytes: "
                f"{pool.used_bytes} of {pool.pool_bytes} bytes used, by blocks held by "
                "a load, a lease or a save in flight"
            )
        return np.concatenate((handed, offsets)) if len(handed) else offsets

    def _evict_lru(self, pool: SlotPool, size: int, count: int) -> np.ndarray:
        """Room for ``count`` slots of ``size`` from the global LRU: same-size
        victims (their slots returned, to be reused as they are), then slabs."""
        frees = SlotFrees()
        need = pool.shortfall(size, count)
        self._evict(same_size_victims(self._lru.values(), pool, size, need), frees)
        handed = frees.take(pool.device, size, count)
        frees.apply(self._pools)
        tried: set[int] = set()
        while not pool.can_alloc(size, count - len(handed)):
            others = (b for b in self.blocks.values() if not b.sealed)
            found = slab_victims(pool, list(self._lru.values()), others, tried)
            if found is None:
                break
            tried.add(found[0])
            self._evict(found[1])
        return handed

    def _evict_over_share(
        self, pool: SlotPool, size: int, count: int, over: list[Excess], saver: Saver
    ) -> np.ndarray:
        """Room for ``count`` slots of ``size`` from tenants over their share, most
        over first: its oldest same-size blocks, each tenant down to its share
        (their slots returned), then whole slabs only over-share tenants' blocks
        hold (a slab may take a tenant below its share)."""
        frees = SlotFrees()
        for excess in over:
            need = pool.shortfall(size, count) - frees.count(pool.device, size)
            if need <= 0:
                break
            oldest = self._shares.oldest(excess.owner)
            self._evict(same_size_victims(oldest, pool, size, need, excess.nbytes), frees)
        handed = frees.take(pool.device, size, count)
        frees.apply(self._pools)
        tried: set[int] = set()
        while not pool.can_alloc(size, count - len(handed)):
            over = self._shares.over(self.pool_bytes(), saver)
            # a slab whose every slot an over-share tenant's unpinned block holds
            # (another's, a pinned or an inflight block's slots make it not empty)
            held = [b for excess in over for b in self._shares.oldest(excess.owner)]
            found = slab_victims(pool, held, (), tried) if held else None
            if found is None:
                break
            tried.add(found[0])
            self._evict(found[1])
        return handed

    def _check_within_share(self, pool: SlotPool, saver: Saver) -> None:
        """RESOURCE_EXHAUSTED, before anything is evicted, when a save that must
        evict brings more than a fair share of the pool (the pools over the
        tenants holding blocks, its own counted): even every block of its tenant
        evicted would leave it over, and the rest would be other tenants' within
        theirs. A save within its share evicts tenants over theirs first (its own
        oldest when it is), then the LRU."""
        self._split_shares()
        share = self._shares.share(self.pool_bytes(), saver)
        if share is None or saver.nbytes <= share:
            return
        raise exhausted(
            f"no room on {pool.device} within a fair share of the pool: this save "
            f"brings {format_size(saver.nbytes)}, more than a tenant's share of "
            f"{format_size(share)} (the pool over the tenants holding blocks): save "
            "fewer blocks at a time. Nothing was evicted"
        )

    def _evict(self, blocks: list[Block], frees: SlotFrees | None = None) -> None:
        """Drop unpinned sealed blocks: one free per slot size, one event per
        namespace. With ``frees``, their slots are gathered there, for the caller
        to reuse and free."""
        if not blocks:
            return
        removed = self._remove_sealed(blocks, frees)
        self._evictions += len(blocks)
        for namespace, hashes in removed.items():
            self._emit(REMOVED, namespace, hashes)

    def _remove_sealed(
        self, blocks: list[Block], frees: SlotFrees | None = None
    ) -> dict[str, list[int]]:
        """Forget sealed blocks (they have no writers) and free their slots in one
        batch, or gather them in ``frees``; the hashes removed, by namespace."""
        if not blocks:
            return {}
        keys = [block.key for block in blocks]
        index, lru = self.blocks, self._lru
        for key in keys:
            del index[key]
            del lru[key]
        if self._shares.split:
            self._shares.remove(blocks)
        if frees is None:
            SlotFrees.free(blocks, self._pools)
        else:
            frees.add(blocks)
        width = len(blocks[0].offsets)
        blank = unallocated(width)  # read-only: a stale use of a removed block fails loudly
        for block in blocks:
            block.offsets = (
                blank if len(block.offsets) == width else unallocated(len(block.offsets))
            )
        return _by_namespace(keys)

    def _drop(self, block: Block) -> None:
        """Forget a block and free every slot it holds (detached ones too), or, while
        a save still copies into it, once the last such copy ended."""
        if self.blocks.get(block.key) is block:
            del self.blocks[block.key]
            if self._lru.pop(block.key, None) is not None and self._shares.split:
                self._shares.remove([block])
        for session in block.writers:
            self._writers.get(session, set()).discard(block.key)
        self._free_slots(block)

    def _free_slots(self, block: Block) -> None:
        """Free the slots of a block out of the index, unless a copy still writes
        into them: a slot freed under a running copy would be handed to another
        block, and the late bytes would land in it (its claim frees them then)."""
        if block.copying:
            return
        SlotFrees.free([block], self._pools)
        block.offsets[:] = -1

    def _emit(self, kind: str, namespace: str, hashes: list[int]) -> None:
        """Hand the change out: one event, or one per MAX_HASHES_PER_EVENT hashes
        (what an event may carry on the wire: a Clear's pinned survivors, a large
        eviction)."""
        step = MAX_HASHES_PER_EVENT
        for start in range(0, max(len(hashes), 1), step):
            self._emit_one(kind, namespace, hashes[start : start + step])

    def _emit_one(self, kind: str, namespace: str, hashes: list[int]) -> None:
        """Hand one event out. It is emitted after the change it tells of is made,
        so a listener that raises (a router refusing it) must not fail the Save,
        eviction or Clear that made it: that change stands, and the failure is logged."""
        self._seq += 1
        if self._on_event is None:
            return
        try:
            self._on_event(StoreEvent(kind, namespace, hashes, "", STORE_TIER, seq=self._seq))
        except Exception:
            self._events_refused += 1
            refused = self._events_refused
            if refused & (refused - 1) == 0:  # the 1st, 2nd, 4th, ...: not every one
                log.exception(
                    "a %s event of %d blocks of %s was refused downstream (%d so far)",
                    kind,
                    len(hashes),
                    namespace,
                    refused,
                )
