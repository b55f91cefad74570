"""One store node's use cases: register, save, load, prefetch, query, release, clear.

What a store request does, start to end, over the node's parts: the registry
(who may call, and the seal), the block index (which slots), the copy engine
(the bytes) and, with peer transfer on, the fetcher (docs/design.md §2, §4).
The gRPC handlers in :mod:`kvstore.service.store_service` decode a request,
make one call here and encode its result. A refusal is a ``KVError``, and
a request is checked whole before it changes anything.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.copy import DeviceFault, MemoryFault
from kvstore.store.block import Block, SlotSet
from kvstore.store.blocks import BlockIndex, IndexStats, Writer
from kvstore.store.copying import LOAD, SAVE, CopyJob, run_job
from kvstore.store.fetch import Fetcher, FetcherStats, FetchResult, SourceStats, StoreSource
from kvstore.store.pool import PoolStats, round_size
from kvstore.store.registry import (
    Caller,
    CallerId,
    Instance,
    Listener,
    Registration,
    Registry,
    RegistryStats,
)
from kvstore.store.tenants import Tenants
from kvstore.store.validation import check_instance_id
from kvstore.wire import limits
from kvstore.wire.errors import Code, KVError, exhausted, invalid, not_found, precondition
from kvstore.wire.limits import (
    DEFAULT_LEASE_MS,
    MAX_BLOCKS_PER_REQUEST,
    MAX_LEASE_MS,
    MAX_WAIT_MS,
)
from kvstore.wire.names import MAX_FINAL_NAMESPACE_LEN, check_final_namespace
from kvstore.wire.principal import LOCAL, Principal, Tenancy, check_owner, check_quota
from kvstore.wire.sizes import format_size

log = logging.getLogger(__name__)

# A Load starts its copy only with time for it left before the caller's deadline:
# a copy goes on once begun, and one the caller stopped waiting for would land in
# pages its engine reuses. Far below either copier's pace: time to spare.
MIN_COPY_BYTES_PER_S = 1e9
COPY_START_S = 0.05
BlockRef = tuple[int, int]  # (block_hash, block_id)


@dataclass(frozen=True)
class SaveResult:
    written: int = 0  # blocks whose caller slots this save wrote
    skipped: int = 0  # blocks already sealed, or whose caller slots another writer has
    sealed: int = 0  # blocks this save completed
    bytes: int = 0


@dataclass(frozen=True)
class LoadResult:
    loaded: int
    bytes: int


@dataclass(frozen=True)
class QueryResult:
    prefix_blocks: int
    lease_id: str = ""  # set when a lease was asked for and the prefix is not empty


@dataclass
class Counters:
    """What the node's requests did since it started."""

    hits: int = 0  # queried hashes found sealed
    misses: int = 0
    bytes_saved: int = 0
    bytes_loaded: int = 0


@dataclass(frozen=True)
class NodeStats:
    """The node's counters and every part's own stats record."""

    devices: tuple[str, ...]
    requests: Counters
    index: IndexStats
    pool: PoolStats  # every device's pool, summed
    registry: RegistryStats
    fetcher: FetcherStats = field(default_factory=FetcherStats)
    source: SourceStats = field(default_factory=SourceStats)


class StoreNode:
    """One node's core; peer transfer is on when a fetcher and a source are given."""

    def __init__(
        self,
        registry: Registry,
        index: BlockIndex,
        copiers: dict[str, Any],
        fetcher: Fetcher | None = None,
        source: StoreSource | None = None,
        *,
        gpu_blocks: bool = False,
        tenancy: Tenancy | None = None,
    ):
        """``copiers``: the copy engine of each device of ``index``'s pools;
        ``gpu_blocks``: GPU pools copy by blocks too (host pools always do);
        ``tenancy``: the client namespaces bound to certificates (``--tenant``)."""
        self.registry = registry
        self.index = index
        self.copiers = copiers
        self.gpu_blocks = gpu_blocks
        self.fetcher = fetcher
        self.source = source
        self.counters = Counters()
        self.tenants = Tenants(tenancy)
        self.index.charge_to(self.tenants.owner_of)  # fair shares of the pool (design §2)
        self._device_faults: dict[str, int] = {}  # CUDA errors under copies, by device

    # ---------------------------------------------------------- registration

    def register(self, reg: Registration) -> Instance:
        """Register a rank for ``reg.principal``, who then owns its client namespace."""
        try:
            check_slot_sizes(reg, self.index.slot_limit())
            self.tenants.check_register(reg.client_namespace, reg.principal)
            inst = self.registry.register(reg, self.index.devices)
        except KVError as err:
            log.warning("registration of %s refused: %s", reg.where(), err)
            raise
        self.tenants.claim(reg.client_namespace, reg.principal)
        return inst

    def may_see(self, final_namespace: str, caller: Principal) -> bool:
        """May ``caller`` see events and blocks of ``final_namespace``? (tenant scoping)"""
        return self.tenants.may_see(final_namespace, caller)

    def leave(self, session: str) -> None:
        """A rank's session ended: unregister it, drop what it left inflight."""
        self.registry.unregister(session)
        self.index.drop_writer(session)

    def instance(self, instance_id: str) -> Instance | None:
        """The registered instance ``instance_id`` (sealed or not), or None."""
        check_instance_id(instance_id)
        return self.registry.get(instance_id)

    def registered(self, instance_id: str, caller: Principal = LOCAL) -> Instance:
        """Like :meth:`instance`, but an unknown instance is NOT_FOUND, and another
        principal's PERMISSION_DENIED (its final namespace would let a stranger
        ask a router which peers hold that tenant's prefixes)."""
        inst = self.instance(instance_id)
        if inst is None:
            raise not_found(f"instance_id {instance_id[:128]!r} is not registered")
        check_owner(f"instance_id {instance_id!r}", inst.first.principal.name, caller)
        return inst

    def watch(self, listener: Listener) -> None:
        """Call ``listener(instance)`` after every registration change."""
        self.registry.on_change(listener)

    # ---------------------------------------------------------------- blocks

    async def save(self, who: CallerId, refs: list[BlockRef], step: int = 0) -> SaveResult:
        """Copy the caller's slots of ``refs`` out of its paged cache; ``step``: the
        engine step that computed them (a block seals once every rank wrote it
        in one step)."""
        caller = self.registry.caller(who)
        reg = caller.reg
        check_refs(reg, refs)
        slots = caller.seal.slots_of(reg)
        claim = self.index.claim(
            caller.seal.final_namespace,
            [h for h, _ in refs],
            caller.seal,
            slots,
            Writer(reg.session, reg.tp_rank, reg.device, reg.instance_id, step),
        )
        if not claim.blocks:
            return SaveResult(skipped=claim.skipped)
        block_ids = [refs[i][1] for i in claim.picked]
        try:
            job = self._job(SAVE, caller, claim.blocks, block_ids, slots, claim.offsets)
            await self._copy(job, reg)
        except BaseException:
            self.index.abandon(claim)
            raise
        done = self.index.finish(claim)
        kept = done.written * slots.nbytes  # not of blocks dropped while they copied
        self.counters.bytes_saved += kept
        return SaveResult(done.written, claim.skipped, done.sealed, kept)

    async def load(
        self, who: CallerId, refs: list[BlockRef], deadline: float | None = None
    ) -> LoadResult:
        """Copy the caller's slots of sealed blocks ``refs`` into its paged cache,
        fetching a missing prefix from a peer first when peer transfer is on.
        ``deadline`` (time.monotonic): when the caller stops waiting; a copy that
        might not end by then is not begun (DEADLINE_EXCEEDED, nothing copied)."""
        caller = self.registry.caller(who)
        reg = caller.reg
        check_load_refs(reg, refs)  # before a fetch brings anything in
        namespace, hashes = caller.seal.final_namespace, [h for h, _ in refs]
        if self.fetcher is not None:
            await self.fetcher.prefetch(namespace, hashes)
            # the rank's session may have ended meanwhile (its memory unmapped):
            # refused as any call of an ended session is, nothing copied
            self.registry.caller(who)
        blocks = self.index.require_sealed(namespace, hashes)
        for block in blocks:
            if block.devices[reg.tp_rank] != reg.device:
                raise invalid(
                    f"block_hash {block.block_hash:#018x} tp_rank {reg.tp_rank} slots live "
                    f"on {block.devices[reg.tp_rank]}, caller is on {reg.device}"
                )
        job = self._job(LOAD, caller, blocks, [i for _, i in refs], caller.seal.slots_of(reg))
        _check_time_for(job, deadline)
        lease = self.index.pin(blocks)  # kept from eviction and clear while the bytes move
        try:
            await self._copy(job, reg)
        finally:
            self.index.unpin(lease)
        self.counters.bytes_loaded += job.nbytes
        return LoadResult(len(refs), job.nbytes)

    def _job(
        self,
        op: str,
        caller: Caller,
        blocks: list[Block],
        block_ids: list[int],
        slots: SlotSet,
        rows: np.ndarray | None = None,
    ) -> CopyJob:
        """``rows``: the blocks' offsets as one array, when they have it (a claim's)."""
        device = caller.reg.device
        return CopyJob(
            op,
            device,
            device == "cpu" or self.gpu_blocks,
            caller.reg.copy_table,
            np.array(block_ids, dtype=np.int64),
            self.index.addresses(blocks, slots.slots, device, rows),
            len(blocks) * slots.nbytes,
        )

    async def _copy(self, job: CopyJob, reg: Registration) -> None:
        reg.hold()  # the rank's memory stays mapped until the copy is done
        try:
            await run_job(job, self.copiers[job.device])
        except DeviceFault as err:
            self._device_faults[job.device] = n = self._device_faults.get(job.device, 0) + 1
            if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ...: a lost context fails every copy
                log.error("%s on %s: CUDA failed under the copy (%d so far): %s",
                          job.op, job.device, n, err)  # fmt: skip
            raise KVError(
                Code.INTERNAL,
                f"{job.op}: CUDA failed under the copy on {job.device} ({err}); if every copy "
                "there fails so, the device's CUDA context is lost: restart the store",
            ) from None
        except MemoryFault as err:
            raise precondition(
                f"{job.op}: the registered KV memory of rank {reg.rank} of instance "
                f"{reg.instance_id!r} shrank or vanished under the copy ({err}); "
                "re-register it"
            ) from None
        finally:
            reg.unhold()

    async def prefetch(
        self, namespace: str, hashes: list[int], caller: Principal = LOCAL
    ) -> FetchResult:
        """Make the longest prefix of ``hashes`` that a peer holds local."""
        check_count("block_hashes", len(hashes))
        check_final_namespace("namespace", namespace)
        self.tenants.check_see("namespace", namespace, caller)
        check_distinct("block_hashes", hashes)  # a peer would serve, and we store, each copy
        if self.fetcher is None:
            raise precondition("peer transfer is off on this server (--no-transfer)")
        if self.registry.sealed(namespace) is None:  # else peers are asked, then nothing kept
            raise precondition(
                f"namespace {namespace!r}: no sealed local instance serves it; "
                "register one before prefetching its blocks"
            )
        return await self.fetcher.prefetch(namespace, hashes)

    def query(
        self,
        namespace: str,
        hashes: list[int],
        lease: bool = False,
        lease_ms: int = 0,
        caller: Principal = LOCAL,
    ) -> QueryResult:
        """Longest sealed prefix of ``hashes``; with ``lease`` it is pinned for
        ``lease_ms`` (DEFAULT_LEASE_MS when 0) or until released. Only a caller
        that owns the namespace (or an admin) may ask: PERMISSION_DENIED. A
        non-admin holds at most MAX_LEASES_PER_PRINCIPAL leases: RESOURCE_EXHAUSTED."""
        check_count("block_hashes", len(hashes))
        check_final_namespace("namespace", namespace)  # a client namespace never holds blocks
        self.tenants.check_see("namespace", namespace, caller)
        check_distinct("block_hashes", hashes)  # a lease would pin a block once a copy
        if lease_ms > MAX_LEASE_MS:
            raise invalid(f"lease_ms {lease_ms} is above {MAX_LEASE_MS}")
        blocks = self.index.sealed_prefix(namespace, hashes)
        leased = lease and bool(blocks)
        if leased:  # each pins up to MAX_BLOCKS_PER_REQUEST blocks for up to MAX_LEASE_MS
            owned = self.index.leases_of(caller.name)
            check_quota("query leases", owned, limits.MAX_LEASES_PER_PRINCIPAL, caller)
            self._check_leased_bytes(blocks, caller)
        self.counters.hits += len(blocks)
        self.counters.misses += len(hashes) - len(blocks)
        if not leased:
            return QueryResult(len(blocks))
        held = self.index.pin(blocks, ttl_ms=lease_ms or DEFAULT_LEASE_MS, owner=caller.name)
        return QueryResult(len(blocks), held.lease_id)

    def _check_leased_bytes(self, blocks: list[Block], caller: Principal) -> None:
        """RESOURCE_EXHAUSTED when leasing ``blocks`` would have ``caller`` (not an
        admin) pin by query leases more than MAX_LEASED_POOL_FRACTION of the pool,
        or more than a fair share of it when that is less (the pool over the
        tenants holding blocks): pinned blocks are never evicted, so tenants
        leasing all the pool between them would leave another's saves no room."""
        if caller.admin:
            return
        held = self.index.leased_bytes_of(caller.name)
        more = self.index.leased_bytes_of(caller.name, blocks) - held
        fraction = limits.MAX_LEASED_POOL_FRACTION
        limit = min(int(self.index.pool_bytes() * fraction), self.index.fair_share(caller.name))
        if held + more > limit:
            raise exhausted(
                f"lease: {caller} pins {format_size(held)} by query leases and this one "
                f"would pin {format_size(more)} more: at most {format_size(limit)} a "
                f"certificate ({fraction:.0%} of this store's pool, or a fair share of it "
                "between the tenants holding blocks if less, so that others' saves find "
                "room); release leases or lease a shorter prefix. Nothing was leased"
            )

    def release(self, lease_id: str, caller: Principal = LOCAL) -> int:
        """Release a query lease; the number of blocks it held. Only the
        principal that took it (or an admin) may: PERMISSION_DENIED."""
        held = self.index.held(lease_id)
        check_owner(f"lease_id {lease_id[:64]!r}", held.owner, caller)
        self.index.unpin(held)
        return len(held.blocks)

    def clear(self, namespace: str = "", caller: Principal = LOCAL) -> int:
        """Drop every unpinned sealed block of final namespace ``namespace`` ("" = all).
        The namespace's owner or an admin may; every namespace, an admin only."""
        if len(namespace) > MAX_FINAL_NAMESPACE_LEN:
            raise invalid("namespace is too long")
        if namespace:
            check_final_namespace("namespace", namespace)  # "llama" alone would clear nothing
        self.tenants.check_see("namespace", namespace, caller)
        n = self.index.clear(namespace or None)
        log.warning("cleared %d blocks of %s on request", n, namespace or "every namespace")
        return n

    def expire(self) -> None:
        """Release expired leases and drop stale inflight blocks (run every second)."""
        self.index.expire()

    # ----------------------------------------------------------------- stats

    def stats(self) -> NodeStats:
        return NodeStats(
            devices=self.index.devices,
            requests=dataclasses.replace(self.counters),
            index=self.index.stats(),
            pool=self.index.pool_stats(),
            registry=self.registry.stats(),
            fetcher=self.fetcher.stats() if self.fetcher else FetcherStats(),
            source=self.source.stats() if self.source else SourceStats(),
        )


def check_wait_ms(wait_ms: int) -> None:
    if wait_ms > MAX_WAIT_MS:
        raise invalid(f"wait_ms {wait_ms} is above {MAX_WAIT_MS}")


def check_count(field_name: str, count: int) -> None:
    if count > MAX_BLOCKS_PER_REQUEST:
        raise invalid(f"{field_name} has {count} entries, more than {MAX_BLOCKS_PER_REQUEST}")


def check_distinct(field_name: str, hashes: list[int]) -> None:
    """INVALID_ARGUMENT naming the first repeated hash (one pass: a request holds
    up to MAX_BLOCKS_PER_REQUEST of them)."""
    seen: set[int] = set()
    for h in hashes:
        if h in seen:
            raise invalid(f"{field_name}: block_hash {h:#018x} appears more than once")
        seen.add(h)


def check_slot_sizes(reg: Registration, limit: int) -> None:
    """Every layer's slot (its bytes of one block) fits a slab of the pools: else
    every Save of the instance would fail, so its registration is refused."""
    for layer in reg.layers:
        size = layer.geometry.bytes_per_block
        if round_size(size) > limit:
            raise invalid(
                f"layer {layer.geometry.name[:64]!r} of {reg.where()}: bytes_per_block {size} "
                f"is larger than this server's slabs ({limit} bytes): its blocks cannot be "
                "stored; use smaller blocks (block_size) or fewer heads a rank"
            )


def _check_time_for(job: CopyJob, deadline: float | None) -> None:
    """DEADLINE_EXCEEDED unless ``job`` has time to end before ``deadline``."""
    if deadline is None:
        return
    left, need = deadline - time.monotonic(), COPY_START_S + job.nbytes / MIN_COPY_BYTES_PER_S
    if left < need:
        raise KVError(
            Code.DEADLINE_EXCEEDED,
            f"{job.op}: {max(left, 0.0):.3f}s of the caller's deadline left, and copying "
            f"{job.nbytes} bytes may take {need:.3f}s: nothing copied (a copy the caller "
            "stopped waiting for would land in pages it reuses)",
        )


def check_refs(reg: Registration, refs: list[BlockRef]) -> None:
    """(block_hash, block_id) pairs of a Save or Load: 1..MAX_BLOCKS_PER_REQUEST of
    them, no hash twice, every block_id inside the caller's registered cache."""
    if not refs:
        raise invalid("block_hashes is empty")
    check_count("block_hashes", len(refs))
    limit = reg.num_blocks
    hashes, block_ids = zip(*refs, strict=True)
    if max(block_ids) < limit and len(set(hashes)) == len(hashes):  # the rule: no loop
        return
    seen: set[int] = set()
    for block_hash, block_id in refs:  # name the first bad ref
        if block_id >= limit:
            raise invalid(
                f"block_id {block_id} is outside the registered cache of rank "
                f"{reg.rank} ({limit} blocks)"
            )
        if block_hash in seen:
            raise invalid(f"block_hash {block_hash:#018x} appears twice in one request")
        seen.add(block_hash)


def check_load_refs(reg: Registration, refs: list[BlockRef]) -> None:
    """check_refs, and distinct targets: a load writes each ref's block into the
    caller's cache, so two refs into one block_id would race on the same bytes."""
    check_refs(reg, refs)
    if len({block_id for _, block_id in refs}) == len(refs):
        return
    seen: set[int] = set()
    for _, block_id in refs:
        if block_id in seen:
            raise invalid(f"block_id {block_id} is the target of two blocks in one load")
        seen.add(block_id)
