"""The KVStore gRPC handlers: decode, call the core, encode; nothing more.

Core errors (:class:`KVError`) become ``context.abort`` with their status
code and message, so every refusal reaches the client as a precise status.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from kvstore._proto import store_pb2 as pb
from kvstore._proto import store_pb2_grpc as pb_grpc
from kvstore.service import status
from kvstore.service import store_codec as codec
from kvstore.store.blocks import BlockStore, check_count, check_load_refs
from kvstore.store.registry import Instance, Registry
from kvstore.wire.errors import KVError, precondition
from kvstore.wire.events import StoreEvent
from kvstore.wire.limits import MAX_NAMESPACE_LEN

log = logging.getLogger(__name__)
EVENT_QUEUE_MAX = 65536


class KVStoreService(pb_grpc.KVStoreServicer):
    def __init__(self, registry: Registry, store: BlockStore, device: str):
        self.registry = registry
        self.store = store
        self.device = device
        self.fetcher = None  # set by the server when peer transfer is on
        self.ucx_address = ""
        self.source = None  # the StoreSource peers fetch from
        self._watchers: dict[str, asyncio.Queue] = {}  # session -> updates
        self._subscribers: set[asyncio.Queue] = set()
        registry.on_change(self._instance_changed)

    # -------------------------------------------------------- registration

    async def RegisterLayers(self, request, context) -> AsyncIterator[pb.RegistrationUpdate]:
        try:
            reg = codec.decode_registration(request)
            inst = self.registry.register(reg)
        except KVError as err:
            log.warning("RegisterLayers refused: %s", err)
            await status.abort(context, err)
        queue: asyncio.Queue = asyncio.Queue()
        self._watchers[reg.session] = queue
        was_sealed = False
        try:
            update = codec.registration_update(inst, reg)
            while True:
                if update.state == pb.RegistrationUpdate.ACCEPTED and was_sealed:
                    update.state = pb.RegistrationUpdate.UNSEALED
                was_sealed = update.state == pb.RegistrationUpdate.SEALED
                yield update
                inst = await queue.get()
                update = codec.registration_update(inst, reg)
        finally:
            self._watchers.pop(reg.session, None)
            self.registry.unregister(reg.session)
            self.store.drop_session(reg.session)
            log.info("session of %s ended; registration removed", reg.where())

    def _instance_changed(self, inst: Instance) -> None:
        for reg in inst.ranks.values():
            queue = self._watchers.get(reg.session)
            if queue is not None:
                queue.put_nowait(inst)

    # -------------------------------------------------------------- blocks

    async def Save(self, request, context):
        try:
            inst, reg = self.registry.caller(request.instance_id, request.rank, request.session)
            res = await self.store.save(inst.seal, reg, codec.refs(request.blocks))
        except KVError as err:
            await status.abort(context, err)
        return pb.SaveResponse(
            written=res.written, skipped=res.skipped, sealed=res.sealed, bytes=res.bytes
        )

    async def Load(self, request, context):
        try:
            inst, reg = self.registry.caller(request.instance_id, request.rank, request.session)
            refs = codec.refs(request.blocks)
            check_load_refs(reg, refs)  # before a fetch brings anything in
            await self._fetch_missing(inst.seal.final_namespace, [h for h, _ in refs])
            nbytes = await self.store.load(inst.seal, reg, refs)
        except KVError as err:
            await status.abort(context, err)
        return pb.LoadResponse(loaded=len(request.blocks), bytes=nbytes)

    async def _fetch_missing(self, namespace: str, hashes: list[int]) -> None:
        if self.fetcher is None or len(self.store.sealed_prefix(namespace, hashes)) == len(hashes):
            return
        await self.fetcher.prefetch(namespace, hashes)

    async def Prefetch(self, request, context):
        try:
            if self.fetcher is None:
                raise precondition("peer transfer is off on this server (--no-transfer)")
            check_count("block_hashes", len(request.block_hashes))
            result = await self.fetcher.prefetch(request.namespace, list(request.block_hashes))
        except KVError as err:
            await status.abort(context, err)
        return pb.PrefetchResponse(
            local_blocks=result.local_blocks, fetched_blocks=result.fetched_blocks, peer=result.peer
        )

    async def Query(self, request, context):
        try:
            n, lease_id = self.store.query(
                request.namespace, list(request.block_hashes), request.lease, request.lease_ms
            )
        except KVError as err:
            await status.abort(context, err)
        return pb.QueryResponse(prefix_blocks=n, lease_id=lease_id)

    async def Release(self, request, context):
        try:
            n = self.store.release(request.lease_id)
        except KVError as err:
            await status.abort(context, err)
        return pb.ReleaseResponse(released_blocks=n)

    async def Clear(self, request, context):
        if len(request.namespace) > MAX_NAMESPACE_LEN + 17:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "namespace is too long")
        n = self.store.clear(request.namespace or None)
        log.warning("cleared %d blocks of %s on request", n, request.namespace or "every namespace")
        return pb.ClearResponse(cleared_blocks=n)

    async def Stats(self, request, context):
        s, c = self.store, self.store.counters
        pools = s.pools.values()
        instances = self.registry.instances.values()
        return pb.StatsResponse(
            device=self.device,
            pool_bytes=sum(p.pool_bytes for p in pools),
            used_bytes=sum(p.used_bytes for p in pools),
            free_bytes=sum(p.free_bytes for p in pools),
            sealed_blocks=s.sealed_blocks,
            inflight_blocks=s.inflight_blocks,
            hits=c.hits,
            misses=c.misses,
            evictions=c.evictions,
            bytes_saved=c.bytes_saved,
            bytes_loaded=c.bytes_loaded,
            instances=len(self.registry.instances),
            sealed_instances=sum(1 for i in instances if i.seal is not None),
            leases=len(s.leases),
            ucx_address=self.ucx_address,
            fetched_blocks=self.fetcher.fetched_blocks if self.fetcher else 0,
            served_blocks=self.source.served_blocks if self.source else 0,
        )

    # -------------------------------------------------------------- events

    def publish(self, event: StoreEvent) -> None:
        """Fan an event out to every subscriber; a stalled one is cut off."""
        payload = event.encode()
        for queue in list(self._subscribers):
            if queue.full():
                log.warning(
                    "event subscriber fell %d events behind; disconnecting it", queue.qsize()
                )
                self._subscribers.discard(queue)  # its handler aborts on its next event
                continue
            queue.put_nowait(payload)

    async def Events(self, request, context):
        queue: asyncio.Queue = asyncio.Queue(maxsize=EVENT_QUEUE_MAX)
        self._subscribers.add(queue)
        try:
            while True:
                payload = await queue.get()
                if queue not in self._subscribers:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED, "event subscriber too slow; resubscribe"
                    )
                yield pb.Event(payload=payload)
        finally:
            self._subscribers.discard(queue)
