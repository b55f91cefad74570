"""The fetching side of one-sided reads: peers' cards, cached per peer, and a
granted offer read straight into reserved slots (docs/design.md §4).

    reader = RmaReader(endpoint)          # the local pool, registered once
    await fetch(address, namespace, hashes, sink, rma=reader)

:func:`kvstore.transfer.fetch` asks a peer for its card once per connection
(CARD_REQUEST, only on a connection whose handshake succeeded), loads it into
the local NIXL agent and keeps it per peer address; a card that differs from
the kept one (the peer restarted at the same address) replaces it. A REQUEST
with the rma flag may then be answered with a grant: the peer's slot addresses
under a lease. The reader turns slots into runs (adjacent on both sides,
vectorised), checks every run lies in both registered regions and reads them
all; the caller commits, then RELEASEs the lease. A failed read drops the
peer's card (asked again next time) and raises
:class:`~kvstore.transfer.errors.RmaFailed`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from kvstore.transfer.card_vetting import CardVetter
from kvstore.transfer.errors import PeerUnavailable, ProtocolError, RmaFailed
from kvstore.transfer.rma import (
    Peer,
    PeerCard,
    PendingRead,
    ReadStats,
    ReadUnsettled,
    RmaEndpoint,
    SlotRuns,
    nixl_module,
)
from kvstore.transfer.slots import SlotTable, run_starts, transfer_order
from kvstore.transfer.ucx import Conn, frame_sends, recv_frame
from kvstore.transfer.wire import NO_CAP, Grant, Kind, decode_card, encode_card_request
from kvstore.wire.errors import KVError

log = logging.getLogger(__name__)

# A read must end this long before the peer's lease does (the peer's clock
# started after ours: the grant's expiry is counted from our REQUEST).
EXPIRY_MARGIN = 0.25  # of the lease


def runs_for(local: SlotTable, grant: Grant, lanes: int) -> SlotRuns:
    """The slot runs of a granted read, in transfer order: a run ends where
    either side's memory breaks (no per-slot Python work)."""
    if lanes == 1:  # transfer order is slot order: nothing to gather
        ptr, size, memory, remote = local.ptr, local.nbytes, local.memory, grant.addresses
    else:
        order = transfer_order(local.counts.tolist(), lanes)
        ptr, size, memory = local.take(order)
        remote = grant.addresses[order]
    mine = run_starts(ptr, size, memory, cap=NO_CAP)
    theirs = run_starts(remote, size, np.zeros(len(size), dtype=np.int64), cap=NO_CAP)
    if not len(theirs) or np.array_equal(mine, theirs):
        cuts = mine
    else:
        cuts = theirs if not len(mine) else np.union1d(mine, theirs)
    if not len(cuts) and len(size):  # one run: both sides contiguous (one slot, as a rule)
        return SlotRuns.of(remote[:1], ptr[:1], [size.sum(dtype=np.uint64)])
    starts = np.concatenate(([0], cuts)).astype(np.int64)
    nbytes = np.add.reduceat(size.astype(np.uint64), starts) if len(size) else size
    return SlotRuns.of(remote[starts], ptr[starts], nbytes)


class LoadedCard(NamedTuple):
    """A peer's card as it came (compared on each new connection) and the NIXL
    peer loaded from it (None: the peer offers no one-sided reads)."""

    blob: bytes
    peer: Peer | None


class PeerReads(NamedTuple):
    """One-sided reads from the peer at ``address`` with the card its connection
    brought (a failure drops that card only, not one loaded since)."""

    reader: RmaReader
    address: str
    card: LoadedCard

    async def read(
        self, local: SlotTable, grant: Grant, lanes: int, deadline: float, asked: float
    ) -> ReadStats:
        return await self.reader.read(self, local, grant, lanes, deadline, asked)


class RmaReader:
    """One-sided reads of this process: its registered endpoint and the peers
    whose cards it loaded, by address."""

    def __init__(self, endpoint: RmaEndpoint, vetter: CardVetter | None = None):
        self.endpoint = endpoint
        self.vetter = vetter or CardVetter(nixl_module(), endpoint.backend)
        self._cards: dict[str, LoadedCard] = {}
        self.reads = 0  # one-sided reads that completed

    async def peer(self, conn: Conn, deadline: float) -> PeerReads | None:
        """Reads from the peer behind ``conn`` (None: it offers none), its card
        asked for once per connection (the caller has run the handshake on
        ``conn`` when a secret is configured). A card that changed since the
        last connection (the peer restarted at the same address) replaces the
        loaded one before any read uses it."""
        loaded = self._cards.get(conn.peer)
        if loaded is None or not conn.card_asked:
            loaded = await self._ask(conn, deadline)
        return PeerReads(self, conn.peer, loaded) if loaded.peer is not None else None

    async def _ask(self, conn: Conn, deadline: float) -> LoadedCard:
        request = frame_sends(conn, Kind.CARD_REQUEST, encode_card_request())
        try:
            _, _, body = await recv_frame(conn, [Kind.CARD], deadline, after=request)
            blob = decode_card(body)
        except ProtocolError as e:
            conn.abort()
            raise PeerUnavailable(f"peer {conn.peer}: bad card: {e}") from None
        conn.card_asked = True
        loaded = self._cards.get(conn.peer)  # another fetch may have loaded it meanwhile
        if loaded is not None and loaded.blob == blob:
            return loaded
        card = self._decode(conn.peer, blob)
        vetted = False
        if card is not None:  # loaded by a child first; half the time left, the rest fetches
            vetted = await self.vetter.loads(card.metadata, (time.monotonic() + deadline) / 2)
            if vetted is None:  # no verdict yet: two-sided this time, the card asked again
                conn.card_asked = False
                return LoadedCard(blob, None)
        loaded = self._cards.get(conn.peer)  # the same, after the wait
        if loaded is None or loaded.blob != blob:
            self.forget(conn.peer)
            peer = self._load(conn.peer, card) if card is not None and vetted else None
            loaded = self._cards[conn.peer] = LoadedCard(blob, peer)
        return loaded

    @staticmethod
    def _decode(address: str, blob: bytes) -> PeerCard | None:
        """The card in ``blob`` (None: the peer offers none, or a malformed one)."""
        if not blob:
            return None
        try:
            return PeerCard.decode(blob)
        except KVError as e:
            log.warning("peer %s: card malformed (%s); fetching two-sided", address, e)
            return None

    def _load(self, address: str, card: PeerCard) -> Peer | None:
        try:
            return self.endpoint.connect(card)
        except KVError as e:  # NIXL could not load it: two-sided
            log.warning("peer %s: card not usable (%s); fetching two-sided", address, e)
            return None

    async def close(self) -> None:
        """Stop the card check process (the endpoint is its owner's to close)."""
        await self.vetter.close()

    def forget(self, address: str, card: LoadedCard | None = None) -> None:
        """Drop a peer's card (asked for again on the next fetch); with ``card``,
        only if it is still the one kept."""
        if card is not None and self._cards.get(address) is not card:
            return
        loaded = self._cards.pop(address, None)
        if loaded is not None and loaded.peer is not None:
            self.endpoint.forget(loaded.peer)

    async def read(
        self,
        reads: PeerReads,
        local: SlotTable,
        grant: Grant,
        lanes: int,
        deadline: float,
        asked: float,
    ) -> ReadStats:
        """Read every granted slot into ``local`` before ``deadline`` and before the
        lease ends, counted from ``asked`` (loop time when the REQUEST went out:
        the peer's lease started after it). Raises RmaFailed (ReadUnsettled as its
        cause when the local slots may still be written: never reuse them)."""
        address, card = reads.address, reads.card
        end = min(deadline, asked + grant.expiry_s * (1 - EXPIRY_MARGIN))
        if asyncio.get_running_loop().time() >= end:  # the peer may have reused the slots
            raise RmaFailed(
                f"one-sided read from {address}: the {grant.expiry_s:g} s lease (or the "
                "deadline) ran out before the read began; nothing was read"
            )
        try:
            if card.peer is None:
                raise PeerUnavailable(f"peer {address}: no card loaded")
            pending = self.endpoint.start_read(card.peer, runs_for(local, grant, lanes))
            stats = await _wait(pending, end, lambda: self.forget(address, card))
        except ReadUnsettled as e:
            self.forget(address, card)
            raise RmaFailed(f"one-sided read from {address}: {e}", unsettled=True) from e
        except KVError as e:  # bad runs (outside a region), peer gone, deadline
            self.forget(address, card)
            raise RmaFailed(f"one-sided read from {address}: {e.message}") from e
        self.reads += 1
        return stats


async def _wait(pending: PendingRead, deadline: float, drop_peer: Callable[[], None]) -> ReadStats:
    """Wait for a posted read. Cancelled from outside, its requests are released
    and the peer dropped first; if a request will not release, the caller hears
    RmaFailed(unsettled) instead of the cancellation, so the slots stay reserved."""
    try:
        return await pending.wait_async(deadline)
    except KVError:
        raise  # the read settled itself (or raised ReadUnsettled)
    except BaseException as e:
        settled = pending.cancel()
        drop_peer()
        if not settled:
            log.error("one-sided read cancelled with a request in flight: slots kept")
            raise RmaFailed("one-sided read cancelled in flight", unsettled=True) from e
        raise
