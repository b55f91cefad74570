"""The block index: inflight and sealed blocks, LRU eviction, leases.

A block is keyed by ``(final_namespace, block_hash)`` and owns a slot array of
``num_layers * tp_size`` entries (slot = layer_id * tp_size + tp_rank), each
slot in the pool of the device of the rank that wrote it. A block is
*inflight* until every slot is written, then *sealed*: only sealed blocks
are visible to query and load and only they can be evicted (LRU, whole
blocks, never while pinned by a load or a lease).

Every state change happens in a synchronous method, so on the asyncio server
the check and the change can never interleave with another request; the
byte copies themselves run in a worker thread between a *prepare* and a
*finish* step.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvstore.copy import plan
from kvstore.store.pool import SlotPool
from kvstore.store.registry import Registration, Seal
from kvstore.wire.errors import exhausted, invalid, not_found
from kvstore.wire.events import CLEARED, REMOVED, STORED, StoreEvent
from kvstore.wire.limits import MAX_BLOCKS_PER_REQUEST, MAX_LEASE_MS

log = logging.getLogger(__name__)

Key = tuple[str, int]
DEFAULT_LEASE_MS = 30_000
INFLIGHT_TIMEOUT_S = 120.0


@dataclass(slots=True)
class Block:
    """One block's slot array and its life-cycle state."""

    key: Key
    slot_bytes: np.ndarray  # bytes per slot (the seal's read-only array, shared)
    tp_size: int
    offsets: np.ndarray = None  # int64 per slot, -1 while unallocated
    devices: list = None  # device of each tp_rank's slots
    # Bit s set: slot s has a writer (claimed) / its bytes are in (written).
    # Python ints, not bool arrays: a save tests and sets them for hundreds of
    # blocks, and a numpy reduction over 64 bools costs ~2 us, an int op ~50 ns.
    claimed: int = 0
    written: int = 0
    writers: set = field(default_factory=set)
    sealed: bool = False
    pins: int = 0
    created: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        self.offsets = np.full(len(self.slot_bytes), -1, dtype=np.int64)
        self.devices = [None] * self.tp_size

    @property
    def all_slots(self) -> int:
        return (1 << len(self.slot_bytes)) - 1

    @property
    def nbytes(self) -> int:
        return int(self.slot_bytes.sum())


@dataclass
class Lease:
    lease_id: str
    keys: list[Key]
    expires: float


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_saved: int = 0
    bytes_loaded: int = 0


@dataclass
class SaveResult:
    written: int = 0
    skipped: int = 0
    sealed: int = 0
    bytes: int = 0


@dataclass
class _Copy:
    """A prepared copy: which blocks, which of their slots, where the bytes go."""

    blocks: list[Block]
    block_ids: np.ndarray
    slots: np.ndarray  # slot index of each of the caller's layers, in layer order
    device: str
    nbytes: int


class BlockStore:
    """All blocks of one store server."""

    def __init__(
        self,
        pools: dict[str, SlotPool],
        copiers: dict,
        node_id: str = "store",
        on_event: Callable[[StoreEvent], None] | None = None,
    ):
        self.pools = pools
        self.copiers = copiers
        self.node_id = node_id
        self.blocks: dict[Key, Block] = {}
        self.lru: OrderedDict[Key, Block] = OrderedDict()  # sealed blocks, oldest first
        self.leases: dict[str, Lease] = {}
        self.by_session: dict[str, set[Key]] = {}
        self.counters = Counters()
        self._on_event = on_event or (lambda e: None)
        self._seq = 0

    # ------------------------------------------------------------------ save

    async def save(self, seal: Seal, reg: Registration, refs: list[tuple[int, int]]) -> SaveResult:
        """Copy the caller's slots of ``refs`` out of its paged cache."""
        result = SaveResult()
        job = self._prepare_save(seal, reg, refs, result)
        if job is None:
            return result
        reg.hold()
        try:
            await copy_in_thread(self._run_copy, job, reg, "save")
        except BaseException:
            self._abort(job, reg.session)
            raise
        finally:
            reg.unhold()
        self._finish_save(job, reg, result)
        return result

    def _prepare_save(
        self, seal: Seal, reg: Registration, refs: list[tuple[int, int]], result: SaveResult
    ) -> _Copy | None:
        check_refs(reg, refs)
        slots = caller_slots(seal, reg)
        mask = slot_mask(slots)
        device = reg.device
        todo: list[tuple[Block, int]] = []
        created: list[Block] = []
        for block_hash, block_id in refs:
            key = (seal.final_namespace, block_hash)
            block = self.blocks.get(key)
            if block is None:
                block = Block(key, seal.slot_bytes, seal.tp_size)
                created.append(block)
            elif block.sealed or block.claimed & mask:
                result.skipped += 1
                continue
            todo.append((block, block_id))
        if not todo:
            return None
        self._allocate(todo, slots, device, created)
        mine = self.by_session.setdefault(reg.session, set())
        for block, _ in todo:
            block.claimed |= mask
            block.devices[reg.tp_rank] = device
            block.writers.add(reg.session)
            self.blocks.setdefault(block.key, block)
            mine.add(block.key)
        nbytes = len(todo) * int(seal.slot_bytes[slots].sum())
        return _Copy(
            [b for b, _ in todo],
            np.array([i for _, i in todo], dtype=np.int64),
            slots,
            device,
            nbytes,
        )

    def _allocate(
        self, todo: list[tuple[Block, int]], slots: np.ndarray, device: str, created: list[Block]
    ) -> None:
        """Give every (block, caller slot) an offset, evicting LRU blocks as needed.

        All or nothing: on failure every offset taken here is returned.
        """
        pool = self.pools[device]
        sizes = todo[0][0].slot_bytes[slots]
        taken: list[tuple[int, np.ndarray]] = []
        try:
            for size in np.unique(sizes).tolist():
                where = np.nonzero(sizes == size)[0]
                count = len(where) * len(todo)
                offsets = self._alloc_or_evict(pool, size, count)
                taken.append((size, offsets))
                grid = offsets.reshape(len(todo), len(where))
                cells = slots[where]
                for row, (block, _) in enumerate(todo):
                    block.offsets[cells] = grid[row]
        except BaseException:
            for size, offsets in taken:
                pool.free(size, offsets)
            for block, _ in todo:
                block.offsets[slots] = -1
            raise

    def _alloc_or_evict(self, pool: SlotPool, size: int, count: int) -> np.ndarray:
        while not pool.can_alloc(size, count):
            if size > pool.slab_bytes or not self._evict_one(pool.device):
                raise exhausted(
                    f"pool on {pool.device} cannot hold {count} slots of {size} bytes: "
                    f"{pool.used_bytes} of {pool.pool_bytes} bytes used and every sealed "
                    f"block there is held by a load or lease"
                )
        return pool.alloc(size, count)

    def _finish_save(self, job: _Copy, reg: Registration, result: SaveResult) -> None:
        alive = reg.session in self.by_session
        mask = slot_mask(job.slots)
        sealed: list[Block] = []
        for block in job.blocks:
            if self.blocks.get(block.key) is not block:
                continue  # dropped while we copied (writer died, instance cleared)
            if not alive:
                self._drop(block)
                continue
            block.written |= mask
            result.written += 1
            if block.written == block.all_slots:
                sealed.append(block)
        self._seal(sealed)
        result.sealed += len(sealed)
        result.bytes = job.nbytes
        self.counters.bytes_saved += job.nbytes

    def _seal(self, blocks: list[Block]) -> None:
        """Make blocks visible; one STORED event per namespace for the lot."""
        stored: dict[str, list[int]] = {}
        for block in blocks:
            block.sealed = True
            for session in block.writers:
                self.by_session.get(session, set()).discard(block.key)
            block.writers.clear()
            self.lru[block.key] = block
            stored.setdefault(block.key[0], []).append(block.key[1])
        for namespace, hashes in stored.items():
            self._emit(STORED, namespace, hashes)

    def _abort(self, job: _Copy, session: str) -> None:
        for block in job.blocks:
            if self.blocks.get(block.key) is block and not block.sealed:
                self._drop(block)

    # ------------------------------------------------------------------ load

    async def load(self, seal: Seal, reg: Registration, refs: list[tuple[int, int]]) -> int:
        """Copy the caller's slots of sealed blocks ``refs`` into its paged cache."""
        check_load_refs(reg, refs)
        slots = caller_slots(seal, reg)
        blocks = []
        for block_hash, _ in refs:
            block = self.blocks.get((seal.final_namespace, block_hash))
            if block is None or not block.sealed:
                raise not_found(
                    f"block_hash {block_hash:#018x} is not sealed in namespace "
                    f"{seal.final_namespace}; nothing was loaded"
                )
            if block.devices[reg.tp_rank] != reg.device:
                raise invalid(
                    f"block_hash {block_hash:#018x} tp_rank {reg.tp_rank} slots live "
                    f"on {block.devices[reg.tp_rank]}, caller is on {reg.device}"
                )
            blocks.append(block)
        for block in blocks:
            block.pins += 1
            self.lru.move_to_end(block.key)
        nbytes = len(blocks) * int(seal.slot_bytes[slots].sum())
        job = _Copy(
            blocks, np.array([i for _, i in refs], dtype=np.int64), slots, reg.device, nbytes
        )
        reg.hold()
        try:
            await copy_in_thread(self._run_copy, job, reg, "load")
        finally:
            reg.unhold()
            for block in blocks:
                block.pins -= 1
        self.counters.bytes_loaded += nbytes
        return nbytes

    def _run_copy(self, job: _Copy, reg: Registration, op: str) -> None:
        base = self.pools[job.device].base
        regions = [reg.regions[layer.geometry.name] for layer in reg.layers]
        addrs = base + np.stack([b.offsets[job.slots] for b in job.blocks], axis=1)
        pieces = plan(regions, job.block_ids, addrs.astype(np.uint64))
        run_copy(self.copiers[job.device], job.device, op, pieces)

    # ----------------------------------------------------------------- query

    def query(
        self, namespace: str, hashes: list[int], lease: bool = False, lease_ms: int = 0
    ) -> tuple[int, str]:
        """Longest sealed prefix of ``hashes``; with ``lease`` it is pinned."""
        check_count("block_hashes", len(hashes))
        if lease_ms > MAX_LEASE_MS:
            raise invalid(f"lease_ms {lease_ms} is above {MAX_LEASE_MS}")
        keys = []
        for h in hashes:
            block = self.blocks.get((namespace, h))
            if block is None or not block.sealed:
                break
            keys.append(block.key)
        self.counters.hits += len(keys)
        self.counters.misses += len(hashes) - len(keys)
        if not lease or not keys:
            return len(keys), ""
        return len(keys), self.take_lease(keys, lease_ms or DEFAULT_LEASE_MS).lease_id

    def take_lease(self, keys: list[Key], lease_ms: int) -> Lease:
        lease = Lease(secrets.token_hex(12), keys, time.monotonic() + lease_ms / 1000)
        for key in keys:
            self.blocks[key].pins += 1
            self.lru.move_to_end(key)
        self.leases[lease.lease_id] = lease
        return lease

    def release(self, lease_id: str) -> int:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            raise not_found(f"lease_id {lease_id[:64]!r} is unknown or expired")
        for key in lease.keys:
            block = self.blocks.get(key)
            if block is not None:
                block.pins -= 1
        return len(lease.keys)

    # ------------------------------------------------------- peer transfer

    def sealed_prefix(self, namespace: str, hashes: list[int]) -> list[Block]:
        """The sealed blocks of the longest prefix of ``hashes`` held here."""
        out = []
        for h in hashes:
            block = self.blocks.get((namespace, h))
            if block is None or not block.sealed:
                break
            out.append(block)
        return out

    def slot_addresses(self, blocks: list[Block]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Address, size and memory key (0 for host memory, else the CUDA pool's base)
        of every slot of ``blocks``, block after block: what a peer transfer moves.
        Vectorised over blocks: a fetch of thousands of slots builds no per-slot object."""
        if not blocks:
            empty = np.zeros(0, dtype=np.int64)
            return empty.astype(np.uint64), empty, empty
        rows: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        bases, keys = [], []
        for block in blocks:
            devices = tuple(block.devices)
            row = rows.get(devices)
            if row is None:
                row = rows[devices] = self._slot_bases(block)
            bases.append(row[0])
            keys.append(row[1])
        ptr = np.concatenate(bases) + np.concatenate([b.offsets for b in blocks]).astype(np.uint64)
        size = np.concatenate([b.slot_bytes for b in blocks]).astype(np.int64)
        return ptr, size, np.concatenate(keys)

    def _slot_bases(self, block: Block) -> tuple[np.ndarray, np.ndarray]:
        """Per slot of a block laid out like ``block``: its pool's base and memory key."""
        pools = [self.pools[d] for d in block.devices]
        rank = np.arange(len(block.slot_bytes)) % block.tp_size
        base = np.array([p.base for p in pools], dtype=np.uint64)[rank]
        key = np.array([p.base if p.buffer.is_cuda else 0 for p in pools], dtype=np.int64)[rank]
        return base, key

    def reserve_detached(
        self, namespace: str, hashes: list[int], seal: Seal, devices: list[str]
    ) -> list[Block]:
        """Blocks with every slot allocated but kept out of the index (see adopt)."""
        blocks = [Block((namespace, h), seal.slot_bytes, seal.tp_size) for h in hashes]
        try:
            for tp_rank, device in enumerate(devices):
                slots = np.arange(tp_rank, len(seal.slot_bytes), seal.tp_size)
                todo = [(b, 0) for b in blocks]
                self._allocate(todo, slots, device, [])
                for block in blocks:
                    block.devices[tp_rank] = device
        except BaseException:
            for block in blocks:
                self.free_detached(block)
            raise
        return blocks

    def adopt(self, block: Block) -> bool:
        """Seal a fully received detached block into the index; False if one exists."""
        if block.key in self.blocks:
            self.free_detached(block)
            return False
        self.blocks[block.key] = block
        self._seal([block])
        return True

    def free_detached(self, block: Block) -> None:
        self._drop(block)

    # ------------------------------------------------------------ life-cycle

    def drop_session(self, session: str) -> int:
        """A writer died: its inflight blocks are dropped, never made visible."""
        keys = self.by_session.pop(session, set())
        dropped = 0
        for key in keys:
            block = self.blocks.get(key)
            if block is not None and not block.sealed:
                self._drop(block)
                dropped += 1
        if dropped:
            log.warning("dropped %d inflight blocks of a departed writer", dropped)
        return dropped

    def expire(self, now: float | None = None) -> None:
        """Drop expired leases and inflight blocks that no writer finished."""
        now = time.monotonic() if now is None else now
        for lease in [x for x in self.leases.values() if x.expires <= now]:
            self.release(lease.lease_id)
        stale = [
            b for b in self.blocks.values() if not b.sealed and now - b.created > INFLIGHT_TIMEOUT_S
        ]
        for block in stale:
            self._drop(block)

    def clear(self, namespace: str | None = None) -> int:
        """Drop every unpinned sealed block (of one namespace, or all)."""
        victims = [
            b
            for b in self.lru.values()
            if b.pins == 0 and (namespace is None or b.key[0] == namespace)
        ]
        namespaces = {namespace} if namespace else {b.key[0] for b in self.lru.values()}
        for block in victims:
            self._drop(block)
        for ns in sorted(namespaces):  # one event per namespace: routers index per namespace
            self._emit(CLEARED, ns, [])
        return len(victims)

    def _evict_one(self, device: str) -> bool:
        for key, block in self.lru.items():
            if block.pins == 0 and device in block.devices:
                self._drop(block)
                self.counters.evictions += 1
                self._emit(REMOVED, key[0], [key[1]])
                return True
        return False

    def _drop(self, block: Block) -> None:
        """Forget a block and free every slot it holds (detached ones too)."""
        if self.blocks.get(block.key) is block:
            del self.blocks[block.key]
            self.lru.pop(block.key, None)
        for session in block.writers:
            self.by_session.get(session, set()).discard(block.key)
        for tp_rank, device in enumerate(block.devices):
            if device is None:
                continue
            idx = np.arange(tp_rank, len(block.offsets), block.tp_size)
            idx = idx[block.offsets[idx] >= 0]
            for size in np.unique(block.slot_bytes[idx]).tolist():
                sel = idx[block.slot_bytes[idx] == size]
                self.pools[device].free(size, block.offsets[sel])
        block.offsets[:] = -1

    def _emit(self, kind: str, namespace: str, hashes: list[int]) -> None:
        self._seq += 1
        self._on_event(
            StoreEvent(
                type=kind,
                namespace=namespace,
                block_hashes=hashes,
                worker=self.node_id,
                tier="store",
                seq=self._seq,
            )
        )

    # ----------------------------------------------------------------- stats

    @property
    def sealed_blocks(self) -> int:
        return len(self.lru)

    @property
    def inflight_blocks(self) -> int:
        return len(self.blocks) - len(self.lru)


async def copy_in_thread(fn, *args) -> None:
    """Run a copy off the event loop; a cancelled caller still waits for it.

    Bytes already moving cannot be stopped: freeing their slots or unmapping
    their worker memory before the thread is done would corrupt other blocks
    or crash the server. So cancellation is deferred until the copy lands.
    """
    future = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    cancelled = False
    while True:
        try:
            await asyncio.shield(future)
            break
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                future.result()  # the copy's own error wins
                cancelled = True
                break
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


def run_copy(copier, device: str, op: str, pieces) -> None:
    """Run ``copier.save``/``load`` and return only once the bytes are in place.

    The CUDA copier only enqueues; each call gets its own stream on its device
    so concurrent requests overlap and each waits for just its own copy.
    """
    if device == "cpu":
        getattr(copier, op)(pieces)
        return
    import cupy

    with cupy.cuda.Device(int(device.partition(":")[2] or 0)):
        stream = cupy.cuda.Stream(non_blocking=True)
        getattr(copier, op)(pieces, stream)
        stream.synchronize()


def check_count(field_name: str, count: int) -> None:
    if count > MAX_BLOCKS_PER_REQUEST:
        raise invalid(f"{field_name} has {count} entries, more than {MAX_BLOCKS_PER_REQUEST}")


def check_refs(reg: Registration, refs: list[tuple[int, int]]) -> None:
    """Reject the whole request before anything is touched."""
    if not refs:
        raise invalid("blocks is empty")
    check_count("blocks", len(refs))
    limit = min(layer.num_blocks for layer in reg.layers)
    seen: set[int] = set()
    for block_hash, block_id in refs:
        if block_id >= limit:
            raise invalid(
                f"block_id {block_id} is outside the registered cache of rank "
                f"{reg.rank} ({limit} blocks)"
            )
        if block_hash in seen:
            raise invalid(f"block_hash {block_hash:#018x} appears twice in one request")
        seen.add(block_hash)


def check_load_refs(reg: Registration, refs: list[tuple[int, int]]) -> None:
    """check_refs, and distinct targets: a load writes each ref's block into the
    caller's cache, so two refs into one block_id would race on the same bytes."""
    check_refs(reg, refs)
    seen: set[int] = set()
    for _, block_id in refs:
        if block_id in seen:
            raise invalid(f"block_id {block_id} is the target of two blocks in one load")
        seen.add(block_id)


def slot_mask(slots: np.ndarray) -> int:
    """The bit set of ``slots`` (see Block.claimed)."""
    mask = 0
    for s in slots.tolist():
        mask |= 1 << s
    return mask


def caller_slots(seal: Seal, reg: Registration) -> np.ndarray:
    """Slot index of each of the caller's layers, in its registration order."""
    return np.array(
        [seal.slot_index(seal.layer_ids[layer.geometry.name], reg.tp_rank) for layer in reg.layers],
        dtype=np.int64,
    )
