"""A store server's link to the router: advertise, forward events, find peers.

The router may run inside the same process (``kvstore serve`` embeds it) or
stand alone (``kvstore serve --router HOST:PORT``). Both links offer the same
three operations to the server; the remote one batches events onto a
background task, keeps its advertisement alive with a lease, and replays
every sealed block after the router restarts so its index is whole again.

A publish that fails (the router is down, hung or slow) may or may not have
been applied, so the link does not guess: it advertises again as a new
generation, which drops what the router held for this node, and replays every
sealed block. Until then lookups do not wait on the router: a Load that misses
falls back to the ``--peer`` list at once, and a lookup of a reachable router
waits at most ``QUERY_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvstore.wire.errors import unavailable
from kvstore.wire.events import STORED, StoreEvent
from kvstore.wire.peers import PeerPrefix

log = logging.getLogger(__name__)

LEASE_MS = 10_000
REFRESH_S = 3.0
MAX_BATCH = 1024
QUERY_TIMEOUT_S = 1.0  # a Load miss waits this long on the router at most


class LocalRouterLink:
    """The router lives in this process: calls go straight to its core."""

    def __init__(self, router, node_id: str):
        self.router = router
        self.node_id = node_id
        self.generation = 0

    async def start(
        self, store_address: str, ucx_address: str, snapshot: Callable[[], list[StoreEvent]]
    ) -> None:
        peer = self.router.advertise_peer(self.node_id, store_address, ucx_address, [])
        self.generation = peer.generation
        self.router.apply_store_events(self.node_id, self.generation, snapshot())

    def publish(self, event: StoreEvent) -> None:
        self.router.apply_store_events(self.node_id, self.generation, [event])

    async def query_prefix(self, namespace: str, hashes: list[int]) -> list[PeerPrefix]:
        return self.router.query_prefix(namespace, hashes, exclude_node_id=self.node_id)

    async def stop(self) -> None:
        self.router.remove_peer(self.node_id, self.generation)


class RemoteRouterLink:
    """The router is another process: gRPC through RouterClient, off the loop."""

    def __init__(self, address: str, node_id: str):
        from kvstore.client.router_client import RouterClient

        self.client = RouterClient(address, timeout_s=5.0)
        self.lookups = RouterClient(address, timeout_s=QUERY_TIMEOUT_S)
        self.node_id = node_id
        self._queue: asyncio.Queue[StoreEvent] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._args: tuple = ()
        self.advertised = False
        self._failed_publishes = 0  # publishes that may not have reached the router
        self._synced = 0  # _failed_publishes when the last full snapshot was sent
        self._snapshot: Callable[[], list[StoreEvent]] = list

    async def start(
        self, store_address: str, ucx_address: str, snapshot: Callable[[], list[StoreEvent]]
    ) -> None:
        """Advertise now if the router answers; else keep trying in the background."""
        self._args = (store_address, ucx_address)
        self._snapshot = snapshot
        await self._advertise_or_warn()
        self._tasks = [asyncio.create_task(self._pump()), asyncio.create_task(self._keepalive())]

    async def _advertise(self, refresh: bool) -> None:
        failed = self._failed_publishes  # a failure from now on needs another snapshot
        await asyncio.to_thread(
            self.client.advertise_peer,
            self.node_id,
            *self._args,
            [],
            lease_ms=LEASE_MS,
            refresh=refresh,
        )
        if not refresh:  # a new generation: the router knows none of our blocks yet
            for event in self._snapshot():
                self._queue.put_nowait(event)
            self._synced = failed
            log.info(
                "advertised to router %s as %s (generation %d)",
                self.client.address,
                self.node_id,
                self.client.generation,
            )
        self.advertised = True

    async def _advertise_or_warn(self) -> None:
        try:
            await self._advertise(refresh=self.advertised and self._in_sync)
        except Exception as exc:  # noqa: BLE001 -- router down or restarted: start over next time
            if self.advertised:
                log.warning(
                    "router %s lost our advertisement (%s); re-advertising",
                    self.client.address,
                    _brief(exc),
                )
                self.advertised = False
                await self._advertise_or_warn()
            else:
                log.warning(
                    "router %s unreachable (%s); retrying every %.0f s",
                    self.client.address,
                    _brief(exc),
                    REFRESH_S,
                )

    @property
    def _in_sync(self) -> bool:
        """No publish has failed since the last full snapshot was queued."""
        return self._synced == self._failed_publishes

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            await self._advertise_or_warn()

    def publish(self, event: StoreEvent) -> None:
        self._queue.put_nowait(event)

    async def _pump(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty() and len(batch) < MAX_BATCH:
                batch.append(self._queue.get_nowait())
            if not self.advertised:
                continue  # the snapshot replays them once the router is back
            try:
                await asyncio.to_thread(self.client.publish, batch)
            except Exception as exc:  # noqa: BLE001 -- any RPC failure: resync, keep pumping
                self._failed_publishes += 1  # the next keepalive re-advertises, replays all
                log.warning(
                    "could not forward %d events to router %s (%s); re-advertising "
                    "with a full snapshot within %.0f s",
                    len(batch),
                    self.client.address,
                    _brief(exc),
                    REFRESH_S,
                )

    async def query_prefix(self, namespace: str, hashes: list[int]) -> list[PeerPrefix]:
        if not (self.advertised and self._in_sync):
            raise unavailable(f"router {self.client.address} is not reachable right now")
        return await asyncio.to_thread(self.lookups.query_prefix, namespace, hashes, self.node_id)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.client.close()
        self.lookups.close()


def _brief(exc: Exception) -> str:
    details = getattr(exc, "details", None)
    return details() if callable(details) else str(exc)


def snapshot_events(sealed: list[tuple[str, int]], node_id: str) -> list[StoreEvent]:
    """Sealed block keys (``BlockIndex.snapshot()``) as STORED events of ``node_id``,
    batched per namespace."""
    by_ns: dict[str, list[int]] = {}
    for ns, block_hash in sealed:
        by_ns.setdefault(ns, []).append(block_hash)
    return [
        StoreEvent(STORED, ns, hashes[i : i + MAX_BATCH], node_id)
        for ns, hashes in by_ns.items()
        for i in range(0, len(hashes), MAX_BATCH)
    ]
