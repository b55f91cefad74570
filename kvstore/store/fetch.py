"""Peer transfer on a node: both ends of the transfer engine, and the fetch policy
(docs/design.md §4).

* :class:`StoreSource` serves a fetching peer: it pins the longest sealed
  prefix asked for (a :class:`~kvstore.store.blocks.Lease`, so nothing it
  sends is evicted) until the last byte is out.
* :class:`StoreSink` reserves slots for incoming blocks in *detached* blocks,
  outside the index, so nothing half-written is ever seen; ``commit`` adopts
  them into the index in one synchronous step, ``abort`` frees them.
* :class:`Fetcher` decides whom to ask. Which peers: the router's
  ``QueryPrefix`` answer for exactly this final namespace (so a peer with
  another layout is never asked), or, without a router, an explicit ``--peer``
  list. A failed or hung peer costs at most ``timeout_s``; the fetch then
  retries once on the next peer that holds the prefix. A peer that dies
  mid-transfer costs only that attempt: later fetches go to the others (and a
  local UCX worker found wedged is recreated, counted in ``worker_recreations``).
  With a cluster secret, a block is accepted only from a peer that the router
  (or ``--peer``) listed for its namespace AND that proved the secret on the
  connection before any request went out (docs/design.md §8); a peer that
  cannot is skipped like a failed one and counted in ``fetches_failed_auth``.
  With an :class:`~kvstore.transfer.onesided.RmaReader` the bytes are read
  one-sided where the peer allows it; a failed one-sided read is counted in
  ``fetches_failed_rma`` and retried once two-sided from the same peer.

The transfer engine (:mod:`kvstore.transfer`) moves slots and knows nothing of
blocks; these adapters are the only place the two meet.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvstore.store.block import Block
from kvstore.store.blocks import BlockIndex, Lease
from kvstore.store.registry import Instance, Registry
from kvstore.transfer import PeerTimeout, PeerUnavailable, SlotTable, fetch, worker_recreations
from kvstore.transfer.errors import PeerUnauthenticated, RmaFailed
from kvstore.transfer.handshake import PeerSecret
from kvstore.transfer.onesided import RmaReader
from kvstore.wire.errors import Code, KVError, precondition, unavailable
from kvstore.wire.peers import PeerPrefix

log = logging.getLogger(__name__)

FindPeers = Callable[[str, list[int]], Awaitable[list[PeerPrefix]]]


def slot_table(index: BlockIndex, blocks: list[Block], rows: np.ndarray | None = None) -> SlotTable:
    """Every slot of ``blocks``, block after block, as a transfer reads or writes it
    (straight in the pool). Vectorised over blocks: a fetch of thousands of slots
    builds no per-slot object, and blocks of one layout placed alike (a fetch's,
    as a rule) share one row of bases, repeated. ``rows``: the blocks' offsets as
    one array, when they have it (blocks reserved together)."""
    if not blocks:
        empty = np.zeros(0, dtype=np.int64)
        return SlotTable(empty.astype(np.uint64), empty, empty, empty, owner=index)
    joined = rows.reshape(-1) if rows is not None else np.concatenate([b.offsets for b in blocks])
    offsets = joined.astype(np.uint64)
    first, n = blocks[0], len(blocks)
    if all(b.devices == first.devices and b.slot_bytes is first.slot_bytes for b in blocks):
        row = _placed_row(index, first)
        if n == 1:  # the cached row itself (read-only)
            return SlotTable(offsets + row.base, row.nbytes, row.memory, row.counts, owner=index)
        return SlotTable(  # rows repeated by broadcasting: np.tile costs more per call
            (offsets.reshape(n, len(row.base)) + row.base).reshape(-1),
            _repeat(row.nbytes, n),
            _repeat(row.memory, n),
            np.full(n, len(row.base), dtype=np.int64),
            owner=index,  # keeps the pools, and so the slots' memory, alive
        )
    bases, memories = [], []
    for block in blocks:
        row = _placed_row(index, block)  # cached per placement and layout
        bases.append(row.base)
        memories.append(row.memory)
    return SlotTable(
        np.concatenate(bases) + offsets,
        np.concatenate([b.slot_bytes for b in blocks]).astype(np.int64),
        np.concatenate(memories),
        np.fromiter((len(b.slot_bytes) for b in blocks), dtype=np.int64, count=n),
        owner=index,
    )


def _repeat(row: np.ndarray, n: int) -> np.ndarray:
    """``row``, ``n`` times over, in one array."""
    return row[None, :].repeat(n, axis=0).reshape(-1)


class _PlacedRow(NamedTuple):
    """Per slot of a block placed like another: its pool's base, its size and its
    memory key (0 for host memory, else the CUDA pool's base: runs never cross
    allocations); ``counts`` is [slots] (one block's). Read-only, cached."""

    base: np.ndarray  # uint64
    nbytes: np.ndarray  # int64
    memory: np.ndarray  # int64
    counts: np.ndarray  # int64, one entry


def _placed_row(index: BlockIndex, block: Block) -> _PlacedRow:
    pools = [index.pool(d) for d in block.devices]
    return _placed(
        tuple(p.base for p in pools),
        tuple(p.memory_key for p in pools),
        block.slot_bytes.astype(np.int64, copy=False).tobytes(),  # a few hundred bytes at most
    )


@functools.lru_cache(maxsize=256)
def _placed(bases: tuple[int, ...], keys: tuple[int, ...], slot_bytes: bytes) -> _PlacedRow:
    """The row of a block whose rank r lies in a pool at ``bases[r]`` with memory
    key ``keys[r]`` (slot s is rank s % tp_size's), its slots of ``slot_bytes``
    (int64, packed): the same few rows for every fetch, so cached."""
    nbytes = np.frombuffer(slot_bytes, dtype=np.int64).copy()
    rank = np.arange(len(nbytes)) % len(bases)
    row = _PlacedRow(
        np.array(bases, dtype=np.uint64)[rank],
        nbytes,
        np.array(keys, dtype=np.int64)[rank],
        np.array([len(nbytes)], dtype=np.int64),
    )
    for column in row:
        column.flags.writeable = False
    return row


@dataclass
class PeerLease:
    """What a serving peer holds for one fetch: pinned blocks and their slots."""

    hashes: list[int]
    slots: SlotTable
    index: BlockIndex
    lease: Lease

    def release(self) -> None:
        self.index.unpin(self.lease)  # a second call does nothing


@dataclass(frozen=True)
class SourceStats:
    served_blocks: int = 0  # blocks leased to fetching peers


class StoreSource:
    """Serves a peer's fetch out of this node's sealed blocks."""

    def __init__(self, index: BlockIndex):
        self.index = index
        self._served = 0

    def lease(self, namespace: str, hashes: list[int]) -> PeerLease | None:
        blocks = self.index.sealed_prefix(namespace, hashes)
        if not blocks:
            return None
        self._served += len(blocks)
        lease = self.index.pin(blocks, refresh=False)
        return PeerLease(lease.hashes, slot_table(self.index, blocks), self.index, lease)

    def stats(self) -> SourceStats:
        return SourceStats(self._served)


@dataclass
class StoreReservation:
    """Detached blocks a fetch writes into; invisible until commit."""

    index: BlockIndex
    blocks: list[Block]
    slots: SlotTable
    adopted: Callable[[int], None] = lambda _n: None  # told how many a commit adopted
    done: bool = False

    def keep(self, num_blocks: int) -> None:
        """Free every block past the first ``num_blocks`` (the peer offered fewer)."""
        if num_blocks >= len(self.blocks):
            return
        self.index.discard(self.blocks[num_blocks:])
        self.blocks = self.blocks[:num_blocks]
        self.slots = self.slots.prefix(num_blocks)

    def commit(self) -> None:
        """Make every received block visible (a block saved meanwhile wins)."""
        if self.done:
            return
        self.done = True
        kept = self.index.adopt(self.blocks)
        self.adopted(kept)
        log.debug("fetched %d blocks from a peer (%d already here)", kept, len(self.blocks) - kept)

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        self.index.discard(self.blocks)


class StoreSink:
    """Reserves local slots for blocks of a namespace that a local instance serves.

    Every block of a namespace has its seal's layout, so a fetch from a peer the
    router named can reserve ahead, while the peer prepares its answer
    (docs/design.md §4, "Reserving ahead")."""

    def __init__(self, index: BlockIndex, registry: Registry):
        self.index = index
        self.registry = registry
        # blocks commits made visible: not those the index held by then (a Save, or
        # another fetch of an overlapping prefix, sealed them first: freed instead)
        self.adopted = 0

    def reserve_ahead(self, namespace: str, hashes: list[int]) -> StoreReservation:
        """Slots for every block of ``hashes``, in the namespace's layout."""
        inst = self._instance(namespace)
        made = self.index.reserve(namespace, hashes, inst.seal, inst.devices)
        table = slot_table(self.index, *made)
        return StoreReservation(self.index, made.blocks, table, self._count_adopted)

    def _count_adopted(self, n: int) -> None:
        self.adopted += n

    def reserve(
        self, namespace: str, hashes: list[int], slot_sizes: list[list[int]]
    ) -> StoreReservation:
        """Slots for the blocks a peer offered, in the slot sizes it offered. Sizes
        other than the namespace's layout are the peer's fault (PeerUnavailable:
        the fetch goes to the next peer), nothing reserved."""
        expect = self._instance(namespace).seal.slot_bytes.tolist()
        for i, sizes in enumerate(slot_sizes):
            if list(sizes) != expect:
                raise PeerUnavailable(
                    f"peer offered block {i} with slot sizes that do not match "
                    f"the layout of namespace {namespace}"
                )
        return self.reserve_ahead(namespace, hashes)

    def _instance(self, namespace: str) -> Instance:
        inst = self.registry.sealed(namespace)
        if inst is None or inst.seal is None:
            raise precondition(
                f"no sealed local instance serves namespace {namespace}; "
                "register one before fetching its blocks"
            )
        return inst


@dataclass(frozen=True)
class FetchResult:
    local_blocks: int  # prefix already here before the fetch
    fetched_blocks: int  # blocks pulled from the peer
    peer: str = ""

    @property
    def prefix_blocks(self) -> int:
        return self.local_blocks + self.fetched_blocks


@dataclass(frozen=True)
class FetcherStats:
    # blocks pulled from peers that a commit made visible, each counted once (not
    # one a Save or another fetch sealed while it moved: that copy is freed)
    fetched_blocks: int = 0
    fetches_failed_unavailable: int = 0  # a peer refused, died or could not be reached
    fetches_failed_timeout: int = 0  # a peer did not finish within the fetch timeout
    # This process's UCX worker found wedged and recreated (kvstore.transfer, "Peer death").
    worker_recreations: int = 0
    fetches_failed_auth: int = 0  # a peer did not prove the cluster secret
    fetches_rma: int = 0  # fetches whose bytes were read one-sided
    fetches_failed_rma: int = 0  # one-sided reads that failed (then retried two-sided)


class Fetcher:
    """Pulls blocks this node misses from a peer store that holds them."""

    def __init__(
        self,
        index: BlockIndex,
        sink: StoreSink,
        find_peers: FindPeers,
        timeout_s: float = 10.0,
        secret: PeerSecret | None = None,
        rma: RmaReader | None = None,
    ):
        """``secret``: the cluster secret each peer must prove (None: no handshake);
        ``rma``: read one-sided from peers that allow it (None: two-sided only)."""
        self.index = index
        self.sink = sink
        self.find_peers = find_peers
        self.timeout_s = timeout_s
        self.secret = secret
        self.rma = rma
        self._failed_rma = 0
        self._running: dict[tuple, asyncio.Future[FetchResult | None]] = {}
        # By cause, the most specific first (PeerUnauthenticated is a PeerUnavailable).
        self._failed = {PeerUnauthenticated: 0, PeerUnavailable: 0, PeerTimeout: 0}

    def stats(self) -> FetcherStats:
        return FetcherStats(
            self.sink.adopted,
            self._failed[PeerUnavailable],
            self._failed[PeerTimeout],
            worker_recreations(),
            self._failed[PeerUnauthenticated],
            self.rma.reads if self.rma is not None else 0,
            self._failed_rma,
        )

    async def prefetch(self, namespace: str, hashes: list[int]) -> FetchResult:
        """Make the longest prefix of ``hashes`` that any peer holds local.

        Callers asking for the same missing blocks at once (the ranks of one
        load) share one fetch, run in the first caller's task (no task of its
        own: that cost two turns of the loop a fetch). When that caller is
        cancelled its fetch is aborted, and a caller still waiting on it
        fetches for itself, from the start (a caller that came while the
        aborted fetch settled, ABORT_GRACE_S at most, waited for that too)."""
        while True:
            prefix = self.index.sealed_prefix(namespace, hashes)
            local, missing = len(prefix), hashes[len(prefix) :]
            if not missing:
                return FetchResult(local, 0)
            # what the fetch extends stays: the reservation (or any Save meanwhile)
            # evicting the oldest blocks would otherwise take the caller's own prefix
            held = self.index.pin(prefix)
            try:
                key = (namespace, tuple(missing))
                shared = self._running.get(key)
                if shared is None:
                    fetched = await self._lead(key, namespace, missing)
                else:
                    fetched = await asyncio.shield(shared)
            finally:
                self.index.unpin(held)
            if fetched is not None:
                return FetchResult(local, fetched.fetched_blocks, fetched.peer)

    async def _lead(self, key: tuple, namespace: str, missing: list[int]) -> FetchResult:
        """Fetch ``missing``, publishing the outcome to callers that ask for the
        same meanwhile: the result, the error, or None when this caller was
        cancelled (they then fetch for themselves)."""
        shared: asyncio.Future[FetchResult | None] = asyncio.get_running_loop().create_future()
        self._running[key] = shared
        try:
            fetched = await self._fetch(namespace, missing)
        except Exception as err:
            shared.set_exception(err)
            shared.exception()  # retrieved: with no other caller, nothing to log
            raise
        except BaseException:  # cancelled, or the process going down: not theirs to raise
            shared.set_result(None)
            raise
        finally:
            del self._running[key]
        shared.set_result(fetched)
        return fetched

    async def _fetch(self, namespace: str, missing: list[int]) -> FetchResult:
        peers = await self.find_peers(namespace, missing)
        if not peers:
            return FetchResult(0, 0)
        last: KVError | None = None
        for peer in peers[:2]:  # the best, then one retry elsewhere
            want = missing[: peer.prefix_blocks] if peer.prefix_blocks else missing
            try:
                n = await self._fetch_from(peer, namespace, want)
            except (PeerUnavailable, PeerTimeout) as err:
                self._failed[next(c for c in self._failed if isinstance(err, c))] += 1
                log.warning(
                    "fetch of %d blocks from %s (%s) failed: %s",
                    len(want),
                    peer.node_id,
                    peer.ucx_address,
                    err,
                )
                last = err
                continue
            log.info("fetched %d/%d blocks of %s from %s", n, len(missing), namespace, peer.node_id)
            return FetchResult(0, n, peer.node_id)
        raise last or unavailable("no peer could serve the fetch")

    async def _fetch_from(self, peer: PeerPrefix, namespace: str, want: list[int]) -> int:
        """One peer, within ``timeout_s`` all told: one-sided where it allows it; a
        failed one-sided read once more two-sided in the time left (the
        reservation of the failed read is already aborted). Slots are reserved
        while the peer answers only when the router said the peer holds ``want``
        (a reservation evicts; a --peer may hold nothing). What the peer or its
        advertised address gets wrong (INVALID_ARGUMENT from the transfer) is
        the peer's failure: PeerUnavailable, and the next peer is asked."""
        try:
            return await self._fetch_within(peer.ucx_address, namespace, want, peer.prefix_blocks)
        except KVError as err:
            if err.code is not Code.INVALID_ARGUMENT:
                raise
            raise PeerUnavailable(f"peer {peer.node_id}: {err.message}") from err

    async def _fetch_within(
        self, address: str, namespace: str, want: list[int], prefix_blocks: int
    ) -> int:
        sink, ahead, secret, timeout_s = self.sink, prefix_blocks > 0, self.secret, self.timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            return await fetch(address, namespace, want, sink, timeout_s, secret, self.rma, ahead)
        except RmaFailed as err:
            self._failed_rma += 1
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # the read failed because we were
                raise asyncio.CancelledError from err  # cancelled: not a reason to go on
            left = deadline - loop.time()
            if left <= 0:  # a hung peer costs timeout_s, not once per way of reading
                raise PeerTimeout(
                    f"peer {address}: {err.message}; no time left to fetch two-sided"
                ) from err
            log.warning("one-sided fetch from %s failed (%s); retrying two-sided", address, err)
        return await fetch(address, namespace, want, sink, left, secret, ahead=ahead)
