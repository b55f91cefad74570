"""A store server's link to the router: advertise, forward events, find peers.

The router may run inside the same process (``kvstore serve`` embeds it) or
stand alone (``kvstore serve --router HOST:PORT[,HOST:PORT...]``), or be
several replicas found in etcd (``kvstore serve --etcd URL``). Every link
offers the same three operations to the server.

The remote link batches events onto a background task, keeps its
advertisement alive with a lease, and replays every sealed block after the
router restarts so its index is whole again.

Every batch a remote or cluster link sends is numbered (``seq``: one more per
batch sent to that router, docs/design.md §6), and a full replay is a
*snapshot*: its first batch is flagged, so the router drops whatever it held
for this node before applying it. A router that sees a batch out of sequence
(one was lost, or it restarted and never had a snapshot from us) drops it and
answers ``resync``; the link then sends a snapshot. Given several routers it uses
one at a time and moves to the next when the current one stops answering,
advertising there as a new peer with a full snapshot.

A router that refuses the advertisement ALREADY_EXISTS holds this node id for
another live store (two stores given one ``--node-id``): the link logs that
once, as an ERROR, keeps serving locally (no events forwarded, lookups fall
back to ``--peer``) and advertises again at the normal pace, to that router
only; once the other store's lease lapses it is accepted, and says so.

A publish that fails (the router is down, hung or slow) may or may not have
been applied, so the link does not guess: it advertises again as a new
generation, which drops what the router held for this node, and replays every
sealed block. Until then lookups do not wait on the router: a Load that misses
falls back to the ``--peer`` list at once, and a lookup of a reachable router
waits at most ``QUERY_TIMEOUT_S``.

The cluster link (etcd) registers the store under its own lease (its
generation is the key's create revision, the same on every replica) and
publishes to every router replica registered in etcd, one :class:`RouterFeed`
each. A feed that fails, whose replica does not know this generation yet, or
whose replica asks for a resync, sends a snapshot, so the replica's index of
this store is exact again without a new generation. A store silent past its
TTL (hung, stopped, partitioned) loses its key, so every replica drops it;
when it answers again it registers anew and every feed replays its snapshot.
Its lease is kept alive from a thread of its own (``membership/keeper.py``),
so a loop busy with events cannot let it lapse. A worker it relays GPU-tier
events for that is admitted again gets them again: every feed replays its
snapshot (``membership/relayed.py``). etcd being away stops nothing local:
events keep flowing to the replicas already known.

A store's node id is one store's in etcd too: registration creates
``stores/<node id>`` only when no live store holds it, or replaces it when the
store holding it is this one (the same store address: a restart, whose old
key may outlive a crash by up to the TTL). A key held by another store address
is left alone (two stores given one ``--node-id``): the link logs that once,
as an ERROR naming the node id and the other store's address, keeps serving
locally (no replica indexes its blocks, no feed sends), tries again every
TTL/3, and once the other's lease lapses (it stopped) registers and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial

from kvstore.membership.directory import Directory
from kvstore.membership.etcd import Change, Entry, Etcd, EtcdConfig
from kvstore.membership.keeper import LeaseKeeper
from kvstore.membership.layout import Layout, RouterRecord, StoreRecord
from kvstore.membership.lease import KeyLease
from kvstore.membership.relayed import RelayedWorkers
from kvstore.service.outage import Outage, grpc_reason
from kvstore.service.sealed import NOTHING, Snapshot, events_of
from kvstore.wire.errors import Code, KVError, unavailable
from kvstore.wire.events import GPU_TIER, StoreEvent
from kvstore.wire.peers import PeerPrefix
from kvstore.wire.tls import TlsFiles

log = logging.getLogger(__name__)

LEASE_MS = 10_000
REFRESH_S = 3.0
MAX_BATCH = 1024
# block hashes one batch gathers at most, plus those of the event that crosses it
# (at most MAX_HASHES_PER_EVENT): ~1.8 MB encoded, under a router's 4 MiB message
MAX_BATCH_HASHES = 1 << 17
# events a feed holds for a replica slower than this store seals; past it the
# queue is dropped for a snapshot, which subsumes it
MAX_QUEUED_EVENTS = 1 << 16
RESYNC_BATCH = 64  # snapshot events (up to HASHES_PER_EVENT hashes each) per publish
QUERY_TIMEOUT_S = 1.0  # a Load miss waits this long on the router at most
RETRY_S = 0.1  # a feed's first retry; doubling up to REFRESH_S
STOP_WAIT_S = 5.0  # stop() waits this long for its cancelled tasks to end


def router_addresses(addresses: str | Sequence[str]) -> list[str]:
    """``"a:1,b:2"`` or a sequence -> the addresses, in order, empty ones dropped."""
    items = addresses.split(",") if isinstance(addresses, str) else addresses
    return [a.strip() for a in items if a.strip()]


class LocalRouterLink:
    """The router lives in this process: calls go straight to its core."""

    def __init__(self, router, node_id: str):
        self.router = router
        self.node_id = node_id
        self.generation = 0

    async def start(self, store_address: str, ucx_address: str, snapshot: Snapshot) -> None:
        peer = self.router.advertise_peer(self.node_id, store_address, ucx_address, [])
        self.generation = peer.generation
        events = snapshot().events()
        self.router.apply_store_events(self.node_id, self.generation, events, snapshot=True)

    def publish(self, event: StoreEvent) -> None:
        self.router.apply_store_events(self.node_id, self.generation, [event])

    async def query_prefix(self, namespace: str, hashes: list[int]) -> list[PeerPrefix]:
        return self.router.query_prefix(namespace, hashes, exclude_node_id=self.node_id)

    async def stop(self) -> None:
        self.router.remove_peer(self.node_id, self.generation)


class RemoteRouterLink:
    """The router is another process (one of ``addresses``, in order of
    preference): gRPC through RouterClient, off the loop."""

    def __init__(self, addresses: str | Sequence[str], node_id: str, tls: TlsFiles | None = None):
        """``tls``: mutual TLS to the routers (plaintext when None)."""
        self.addresses = router_addresses(addresses)
        if not self.addresses:
            raise ValueError("no router address given")
        self._active = 0
        self.tls = tls
        self.client, self.lookups = _clients(self.addresses[0], tls)
        self.node_id = node_id
        self._queue: asyncio.Queue[StoreEvent | None] = asyncio.Queue()  # None: a snapshot
        self._tasks: list[asyncio.Task] = []
        self.seq = 0  # the last batch number sent
        self._args: tuple = ()
        self.advertised = False
        self._failed_publishes = 0  # publishes that may not have reached the router
        self._synced = 0  # _failed_publishes when the last full snapshot was sent
        self._snapshot: Snapshot = lambda: NOTHING
        self._snapshots_begun = 0  # snapshots the pump has begun to take and send
        self._snapshot_running = False  # one is being taken or sent now
        # The router whose ALREADY_EXISTS (our node id held by another live store)
        # was logged; None when no such conflict is going on.
        self._conflict: str | None = None
        self._outage = Outage(  # logged once, not per batch or keepalive round
            log,
            f"router {', '.join(self.addresses)}",
            f"our events are dropped until it answers (a snapshot replays them); "
            f"retrying every {REFRESH_S:g} s",
        )
        self.dropped = RouterLinkStats()
        self._dropped_in_outage = 0  # events dropped since the router was lost
        self._forgotten = asyncio.Event()  # the router answered it knows us not

    async def start(self, store_address: str, ucx_address: str, snapshot: Snapshot) -> None:
        """Advertise now if the router answers; else keep trying in the background."""
        self._args = (store_address, ucx_address)
        self._snapshot = snapshot
        await self._advertise_or_warn()
        self._tasks = [asyncio.create_task(self._pump()), asyncio.create_task(self._keepalive())]

    async def _advertise(self, refresh: bool) -> None:
        failed = self._failed_publishes  # a failure from now on needs another snapshot
        begun = self._snapshots_begun
        await asyncio.to_thread(
            self.client.advertise_peer,
            self.node_id,
            *self._args,
            [],
            lease_ms=LEASE_MS,
            refresh=refresh,
        )
        if not refresh:  # a new generation: the router knows none of our blocks yet
            self._queue.put_nowait(None)
            self._synced = failed
            if self._conflict is not None:
                log.info(
                    "router %s accepted node id %r for us now (the other store's "
                    "advertisement lapsed or left)",
                    self.client.address,
                    self.node_id,
                )
                self._conflict = None
            log.info(
                "advertised to router %s as %s (generation %d)",
                self.client.address,
                self.node_id,
                self.client.generation,
            )
        elif self.client.owes_snapshot and self._snapshot_unasked(begun):
            self._queue.put_nowait(None)  # a worker we relayed for was admitted anew
            log.info("router %s asked for our snapshot; sending it", self.client.address)
        self.advertised = True
        if self._outage.down:
            self._outage.recovered(f"{self._dropped_in_outage} events dropped meanwhile")
            self._dropped_in_outage = 0

    async def _advertise_or_warn(self) -> None:
        fresh = not (self.advertised and self._in_sync)
        try:
            await self._advertise(refresh=not fresh)
            return
        except Exception as exc:  # noqa: BLE001 -- router down or restarted: start over
            failure = exc
            if self._refused(exc):
                return
        if self.advertised:
            self._outage.failed(f"it lost our advertisement: {grpc_reason(failure)}")
            self.advertised = False
        tries = len(self.addresses)  # the current router anew, then the others
        if fresh:  # the current one just failed a fresh advertisement: the others
            tries -= 1
            self._move_on()
        for _ in range(tries):
            try:
                await self._advertise(refresh=False)
                return
            except Exception as exc:  # noqa: BLE001 -- unreachable: try the next one
                failure = exc
                if self._refused(exc):
                    return
                self._move_on()
        self._outage.failed(f"unreachable: {grpc_reason(failure)}")  # logged once an outage

    def _refused(self, exc: Exception) -> bool:
        """Whether ``exc`` is the router refusing our node id: another live store
        advertised it (ALREADY_EXISTS). Logged once until it is accepted; the
        link stays on this router (it answered) and the keepalive tries again."""
        if not (isinstance(exc, KVError) and exc.code is Code.ALREADY_EXISTS):
            return False
        self.advertised = False  # the node id is the other store's there now
        if self._conflict != self.client.address:
            self._conflict = self.client.address
            log.error(
                "router %s refuses node id %r to this store: %s. Serving locally "
                "meanwhile (the router indexes none of our blocks; our misses ask "
                "--peer only); advertising again every %.0f s, not logged again",
                self.client.address,
                self.node_id,
                exc.message,
                REFRESH_S,
            )
        return True

    def _snapshot_unasked(self, begun: int) -> bool:
        """Whether no snapshot is on its way that answers a refresh sent when
        ``begun`` snapshots had begun: none is being sent, and none began since.
        (Should the router have begun to owe one only after such a snapshot's
        first batch, a later batch of it is answered resync, or the next
        refresh asks again.)"""
        return not self._snapshot_running and self._snapshots_begun == begun

    def _move_on(self) -> None:
        """Use the next router address (nothing changes with only one)."""
        if len(self.addresses) == 1:
            return
        self._active = (self._active + 1) % len(self.addresses)
        self.client.close()
        self.lookups.close()
        self.client, self.lookups = _clients(self.addresses[self._active], self.tls)
        log.info("moving to router %s", self.client.address)

    @property
    def _in_sync(self) -> bool:
        """No publish has failed since the last full snapshot was queued."""
        return self._synced == self._failed_publishes

    async def _keepalive(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):  # every REFRESH_S, or when told
                async with asyncio.timeout(REFRESH_S):
                    await self._forgotten.wait()
            self._forgotten.clear()
            await self._advertise_or_warn()

    def publish(self, event: StoreEvent) -> None:
        self._queue.put_nowait(event)

    async def _pump(self) -> None:
        while True:
            batch = next_batch(await self._queue.get(), self._queue)
            if not self.advertised:
                self._drop(batch)  # the snapshot replays them once the router is back
                continue
            sent_as = self.client.generation
            try:
                if batch is None:
                    in_sequence = await self._send_snapshot()
                else:
                    in_sequence = await self._send(batch)
                if not in_sequence:
                    self._queue.put_nowait(None)
            except Exception as exc:  # noqa: BLE001 -- any RPC failure: resync, keep pumping
                forgotten = isinstance(exc, KVError) and exc.code is Code.NOT_FOUND
                if forgotten and sent_as != self.client.generation:
                    self._drop(batch)  # sent under the generation just replaced: its
                    continue  # snapshot, queued by that advertisement, covers the batch
                self._failed_publishes += 1  # the next keepalive re-advertises, replays all
                if forgotten:  # it does not know us (restarted): advertise now, not later
                    self.advertised = False
                    self._forgotten.set()
                self._drop(batch)
                what = "the snapshot" if batch is None else f"{len(batch)} events"
                self._outage.failed(f"could not forward {what}: {grpc_reason(exc)}")

    def _drop(self, batch: list[StoreEvent] | None) -> None:
        """Count a batch (None: a snapshot) that did not reach the router."""
        self.dropped.batches_dropped += 1
        if batch is not None:
            self.dropped.events_dropped += len(batch)
            self._dropped_in_outage += len(batch)

    def stats(self) -> RouterLinkStats:
        """What did not reach the router (under ``router_link`` on /metrics)."""
        return RouterLinkStats(**vars(self.dropped))

    async def _send_snapshot(self) -> bool:
        self._snapshots_begun += 1
        self._snapshot_running = True
        try:
            return await send_snapshot(self._send, await events_of(self._snapshot))
        finally:
            self._snapshot_running = False

    async def _send(self, batch: list[StoreEvent], snapshot: bool = False) -> bool:
        """Publish one numbered batch; False when the router asks for a snapshot."""
        self.seq += 1
        reply = await asyncio.to_thread(self.client.publish, batch, seq=self.seq, snapshot=snapshot)
        if reply.resync:
            log.info("router %s missed some of our events; sending a snapshot", self.client.address)
        return not reply.resync

    async def query_prefix(self, namespace: str, hashes: list[int]) -> list[PeerPrefix]:
        if not (self.advertised and self._in_sync):
            raise unavailable(f"router {self.client.address} is not reachable right now")
        return await asyncio.to_thread(self.lookups.query_prefix, namespace, hashes, self.node_id)

    async def stop(self) -> None:
        """Stop the pump (what is still queued is not sent) and close the clients."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:  # ended before the clients close under them
            await asyncio.wait(self._tasks, timeout=STOP_WAIT_S)
        self._tasks.clear()
        self.client.close()
        self.lookups.close()


@dataclass
class RouterLinkStats:
    """Batches (and their events) a remote link could not forward: the router
    was down or failed the publish; a snapshot replays their blocks after."""

    batches_dropped: int = 0
    events_dropped: int = 0


def _clients(address: str, tls: TlsFiles | None):
    """(publishing client, lookup client) for one router."""
    from kvstore.client.router_client import RouterClient

    return (
        RouterClient(address, timeout_s=5.0, tls=tls),
        RouterClient(address, timeout_s=QUERY_TIMEOUT_S, tls=tls),
    )


class RouterFeed:
    """This store's events to one router replica, under the store's etcd generation.

    Events go in order, in numbered batches, off the loop. Any failure
    (unreachable, the replica does not know this generation yet, or it answers
    ``resync``) is followed, after a backoff, by a snapshot of every sealed
    block, which subsumes whatever was queued.
    """

    def __init__(
        self,
        address: str,
        node_id: str,
        snapshot: Snapshot,
        tls: TlsFiles | None = None,
    ):
        self.address = address
        self.node_id = node_id
        self.client, self.lookups = _clients(address, tls)
        self.generation = 0
        self.synced = False  # the replica holds exactly our sealed blocks (as of the last send)
        self.seq = 0  # the last batch number sent
        self.overflows = 0  # times the queue filled and was dropped for a snapshot
        self._snapshot = snapshot
        self._outage = Outage(
            log, f"router replica {address}", then="sending a snapshot once it takes one"
        )
        self._queue: asyncio.Queue[StoreEvent | None] = asyncio.Queue()  # None: resync
        self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def queued(self) -> int:
        """Events (and resync markers) waiting to go to the replica."""
        return self._queue.qsize()

    def publish(self, event: StoreEvent) -> None:
        if not self.generation:
            return
        if self._queue.qsize() < MAX_QUEUED_EVENTS:
            self._queue.put_nowait(event)
            return
        self.overflows += 1
        if self.overflows == 1:  # once until a snapshot is taken, not every MAX_QUEUED_EVENTS
            log.warning(
                "router %s: %d events queued (it takes them slower than we seal); "
                "sending a snapshot instead, and dropping events until it is taken",
                self.address,
                MAX_QUEUED_EVENTS,
            )
        drain(self._queue)  # the snapshot covers them
        self._queue.put_nowait(None)

    def pause(self) -> None:
        """Send nothing until ``resync(generation)``: the store holds no registration
        (another store holds its node id in etcd)."""
        self.generation = 0
        self.synced = False
        drain(self._queue)

    def resync(self, generation: int = 0) -> None:
        """Send everything again (as ``generation`` from now, when given)."""
        self.generation = generation or self.generation
        self.synced = False
        if self.generation:
            self._queue.put_nowait(None)

    async def _run(self) -> None:
        while True:
            batch = next_batch(await self._queue.get(), self._queue)
            if not self.generation:  # paused meanwhile
                drain(self._queue)
                continue
            if batch is None or not self.synced:
                drain(self._queue)  # the snapshot covers them
                await self._resync()
                continue
            try:
                self.synced = await self._send(batch)
            except Exception as exc:  # noqa: BLE001 -- any failure: resync, keep going
                self._outage.failed(f"{len(batch)} events not taken: {grpc_reason(exc)}")
                self.synced = False
            if not self.synced:
                self._queue.put_nowait(None)

    async def _resync(self) -> None:
        """Until it succeeds: drop what is queued, send a snapshot."""
        delay = RETRY_S
        while True:
            drain(self._queue)  # the snapshot covers them
            if not self.generation:  # paused: resync(generation) starts it again
                return
            events: list[StoreEvent] = []
            try:
                events = await events_of(self._snapshot)
                if await send_snapshot(self._send, events):
                    break
                reason = "it asked for a snapshot again"
            except Exception as exc:  # noqa: BLE001 -- unreachable or not known yet: retry
                reason = grpc_reason(exc)
            self._outage.failed(reason)  # logged once an outage
            await asyncio.sleep(delay)
            delay = min(delay * 2, REFRESH_S)
        self.synced = True
        self._outage.recovered()
        log.info(
            "router %s holds our %d sealed-block events (generation %d, seq %d%s)",
            self.address,
            len(events),
            self.generation,
            self.seq,
            f"; the queue overflowed {self.overflows} times before" if self.overflows else "",
        )
        self.overflows = 0

    async def _send(self, batch: list[StoreEvent], snapshot: bool = False) -> bool:
        """Publish one numbered batch; False when the replica asks for a snapshot."""
        generation = self.generation
        self.seq += 1
        reply = await asyncio.to_thread(
            self.client.publish, batch, self.node_id, generation, self.seq, snapshot
        )
        if reply.resync:
            log.info("router %s missed some of our events; sending a snapshot", self.address)
        return not reply.resync

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.client.close()
        self.lookups.close()


class ClusterRouterLink:
    """Router replicas found in etcd; this store registered there under a lease."""

    def __init__(
        self,
        config: EtcdConfig,
        node_id: str,
        local_router=None,
        tls: TlsFiles | None = None,
        keeper: LeaseKeeper | None = None,
    ):
        """``local_router``: the embedded router core, asked first for peers;
        ``tls``: mutual TLS to the replicas (plaintext when None); ``keeper``:
        the thread that keeps the lease alive, shared by links of one process
        (by default the link starts its own and ends it in :meth:`stop`)."""
        self.config = config
        self.tls = tls
        self.node_id = node_id
        self.local_router = local_router
        self.etcd = Etcd(config)
        self._own_keeper = keeper is None
        self.keeper = keeper or LeaseKeeper(config, f"store {node_id}")
        self.layout = Layout(config.prefix)
        self.feeds: dict[str, RouterFeed] = {}
        self._router_generations: dict[str, int] = {}
        self._snapshot: Snapshot = lambda: NOTHING
        self.registration: KeyLease | None = None
        self.directory = Directory(
            self.etcd, self.layout.routers, self, f"store {node_id}: routers"
        )
        self.relayed = RelayedWorkers(self.etcd, self.layout, self._resync, f"store {node_id}")
        self._closing: set[asyncio.Task] = set()
        self._store_address = ""
        # The store address found holding our node id at the last refused
        # registration, and the one whose refusal was logged (None: no conflict).
        self._holder = ""
        self._conflict: str | None = None

    @property
    def generation(self) -> int:
        """Our registration's generation; 0 while we hold none (not registered yet,
        or the lease was lost and not registered again)."""
        registration = self.registration
        return registration.generation if registration is not None and registration.lease else 0

    async def start(self, store_address: str, ucx_address: str, snapshot: Snapshot) -> None:
        """Register in etcd now if it answers (else keep trying), follow the replicas."""
        self._snapshot = snapshot
        self._store_address = store_address
        record = StoreRecord(store_address, ucx_address).encode()
        key = self.layout.store(self.node_id)
        self.registration = KeyLease(
            self.etcd,
            self.keeper,
            partial(self.etcd.recreate, key, record, refuse=self._held_by_another),
            f"store {self.node_id}",
            on_registered=self._registered,
            on_refused=self._refused,
        )
        try:
            generation = await self.registration.register()
            log.info("store %s registered in etcd (generation %d)", self.node_id, generation)
        except KVError as exc:
            if exc.code is Code.ALREADY_EXISTS:
                self._refused(exc)
            else:
                log.warning("store %s not registered in etcd yet: %s", self.node_id, exc.message)
        self.registration.keep()
        self.directory.start()

    def _held_by_another(self, entry: Entry) -> KVError | None:
        """ALREADY_EXISTS when ``entry`` (our node id's key, live: etcd deletes it
        with its lease) names another store address than ours: another store
        given our --node-id. None for our own address (a restart: replace it)
        or a value that names no store (replace it)."""
        try:
            holder = StoreRecord.decode(entry.value).store_address
        except ValueError:
            return None
        if not holder or holder == self._store_address:
            return None
        self._holder = holder
        return KVError(
            Code.ALREADY_EXISTS,
            f"node_id {self.node_id!r} is registered in etcd by the live store at "
            f"{holder!r}, not {self._store_address!r} (it may be taken over when that "
            f"store's lease lapses, within {self.config.ttl_s} s of it stopping); two "
            "stores cannot share a node id: give this store another --node-id (if it "
            "is that store restarted on a new address, it registers then by itself)",
        )

    def _refused(self, exc: KVError) -> None:
        """Our registration was refused ALREADY_EXISTS (``_held_by_another``): logged
        once per store found holding the node id; tried again every TTL/3."""
        log.debug("store %s: registration refused: %s", self.node_id, exc.message)
        if self._conflict == self._holder:
            return
        self._conflict = self._holder
        for feed in self.feeds.values():  # a lost lease's generation is the other's now
            feed.pause()
        log.error(
            "store %s not registered in etcd: %s. Serving locally meanwhile (no router "
            "replica indexes our blocks); trying again every %.1f s, not logged again",
            self.node_id,
            exc.message,
            self.keeper.interval_s,
        )

    def _registered(self, generation: int) -> None:
        if self._conflict is not None:
            log.info(
                "store %s registered in etcd now (generation %d): node id %r is ours "
                "(the store at %s that held it left, or its lease lapsed)",
                self.node_id,
                generation,
                self.node_id,
                self._conflict,
            )
            self._conflict = None
        for feed in self.feeds.values():
            feed.resync(generation)

    def _resync(self) -> None:
        for feed in self.feeds.values():
            feed.resync()

    # -- the replicas, as the directory of routers/ tells them -------------

    def reset(self, entries: list[Entry]) -> None:
        listed = {}
        for entry in entries:
            with contextlib.suppress(ValueError):
                listed[RouterRecord.decode(entry.value).address] = entry.create_revision
        for address in set(self.feeds) - set(listed):
            self._drop(address)
        for address, revision in listed.items():
            self._add(address, revision)

    def changed(self, change: Change) -> None:
        try:
            address = RouterRecord.decode(change.entry.value).address
        except ValueError:
            return
        if change.deleted:
            self._drop(address)
        else:
            self._add(address, change.entry.create_revision)

    def _add(self, address: str, revision: int) -> None:
        feed = self.feeds.get(address)
        if feed is None:
            feed = self.feeds[address] = RouterFeed(address, self.node_id, self._snapshot, self.tls)
            log.info("store %s: router replica %s joined", self.node_id, address)
        if self._router_generations.get(address) != revision:  # new, or restarted
            self._router_generations[address] = revision
            feed.resync(self.generation)

    def _drop(self, address: str) -> None:
        feed = self.feeds.pop(address, None)
        self._router_generations.pop(address, None)
        if feed is not None:
            log.info("store %s: router replica %s left", self.node_id, address)
            task = asyncio.get_running_loop().create_task(feed.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    # -- the link ------------------------------------------------------------

    def publish(self, event: StoreEvent) -> None:
        if event.tier == GPU_TIER:  # relayed for a worker: resent when it is admitted again
            self.relayed.add(event.worker)
        for feed in self.feeds.values():
            feed.publish(event)

    async def query_prefix(self, namespace: str, hashes: list[int]) -> list[PeerPrefix]:
        if self.local_router is not None:
            return self.local_router.query_prefix(namespace, hashes, exclude_node_id=self.node_id)
        feeds = sorted((f for f in self.feeds.values() if f.synced), key=lambda f: f.address)
        for feed in feeds[:2]:
            try:
                return await asyncio.to_thread(
                    feed.lookups.query_prefix, namespace, hashes, self.node_id
                )
            except KVError as exc:
                log.debug("router %s lookup failed: %s", feed.address, exc)
        raise unavailable("no router replica is reachable right now")

    async def stop(self) -> None:
        """Leave etcd at once (the key is revoked) and stop the feeds."""
        await self.directory.close()
        await self.relayed.close()
        if self.registration is not None:
            await self.registration.release()
        for address in list(self.feeds):
            await self.feeds.pop(address).close()
        for task in list(self._closing):
            await task
        await self.etcd.close()
        if self._own_keeper:
            await self.keeper.aclose()


def next_batch(
    first: StoreEvent | None, queue: asyncio.Queue[StoreEvent | None]
) -> list[StoreEvent] | None:
    """``first`` and the events queued after it, up to ``MAX_BATCH`` events and
    about ``MAX_BATCH_HASHES`` hashes; None when a snapshot is asked for (``None``
    queued), the queue then drained: it covers them."""
    batch = [first]
    hashes = len(first.block_hashes) if first is not None else 0
    while (
        first is not None
        and len(batch) < MAX_BATCH
        and hashes < MAX_BATCH_HASHES
        and not queue.empty()
    ):
        batch.append(queue.get_nowait())
        first = batch[-1]
        hashes += len(first.block_hashes) if first is not None else 0
    if first is None:
        drain(queue)
        return None
    return batch


def drain(queue: asyncio.Queue) -> None:
    while not queue.empty():
        queue.get_nowait()


async def send_snapshot(
    send: Callable[[list[StoreEvent], bool], Awaitable[bool]], events: list[StoreEvent]
) -> bool:
    """Send ``events`` as one snapshot: numbered batches of ``RESYNC_BATCH``, the
    first flagged (at least one, so an empty snapshot still empties the router's
    view of this node). False when the router asked for a snapshot again."""
    for i in range(0, max(len(events), 1), RESYNC_BATCH):
        if not await send(events[i : i + RESYNC_BATCH], i == 0):
            return False
    return True
