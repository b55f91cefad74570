"""Thin gRPC handlers: proto in, core call, proto out, KVError -> status.

No decisions are made here; every check lives in the core so it is tested
without a network, and handlers use only the Router's public methods. Cards
are decoded by ``kvstore.wire.card_proto``, errors mapped by
``kvstore.service.status``. ``WorkerSession`` is the one handler with a
lifetime: the worker stays admitted while its call is open.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import asdict

import grpc

from kvstore._proto import router_pb2, router_pb2_grpc
from kvstore.router.admission import Worker
from kvstore.router.core import EventsApplied, Router
from kvstore.router.load import LoadReport
from kvstore.router.requests import decode_store_events
from kvstore.router.routing import RouteResult
from kvstore.service import malformed, status
from kvstore.service.tls import PLAINTEXT, Security
from kvstore.wire import limits
from kvstore.wire.card_proto import card_from_proto
from kvstore.wire.errors import KVError, not_found, unavailable
from kvstore.wire.events import StoreEvent
from kvstore.wire.principal import Principal

log = logging.getLogger(__name__)


def admitted_reply(worker: Worker, members: int) -> router_pb2.RegisterWorkerResponse:
    return router_pb2.RegisterWorkerResponse(
        name=worker.name,
        generation=worker.ref.generation,
        card_checksum=worker.checksum,
        model=worker.key.model,
        namespace=worker.key.namespace,
        role=worker.key.role,
        semantics_id=worker.domain.semantics_id,
        scope_id=worker.domain.scope_id,
        members=members,
    )


def _routed(result: RouteResult) -> router_pb2.RouteResponse:
    w, ttft = result.worker, result.ttft
    return router_pb2.RouteResponse(
        worker=w.name,
        generation=w.ref.generation,
        address=w.card.address,
        request_id=result.request_id,
        total_blocks=result.total_blocks,
        overlap_blocks=result.overlap_blocks,
        gpu_blocks=result.gpu_blocks,
        store_blocks=result.store_blocks,
        remote_blocks=result.remote_blocks,
        ttft_ms=ttft.ttft_ms,
        reason=result.reason,
        worker_set=str(result.worker_set),
        worker_sets=result.worker_sets,
        queued_tokens=ttft.queued_tokens,
        uncached_tokens=ttft.uncached_tokens,
        running_requests=ttft.running_requests,
        load_reported=ttft.report_age_s is not None,
    )


def published_reply(result: EventsApplied) -> router_pb2.PublishEventsResponse:
    return router_pb2.PublishEventsResponse(
        applied=result.applied, dropped=result.dropped, resync=result.resync
    )


class RouterService(router_pb2_grpc.RouterServicer):
    """``security``: who callers are (their certificate CN with TLS); the core
    decides what each may do (worker names and peer node ids have owners)."""

    def __init__(self, router: Router, security: Security = PLAINTEXT):
        self.router = router
        self.security = security
        self._stopping = asyncio.Event()  # set once: the server is stopping

    def end_sessions(self) -> None:
        """The server is stopping: end every worker session now, UNAVAILABLE, so
        that its grace period waits for none (workers register again once a
        router answers); a session opened from now on ends at once."""
        self._stopping.set()

    async def _hold_session(self, context: grpc.aio.ServicerContext) -> None:
        """Hold a worker's session until its client ends it (cancelling this) or
        the server stops."""
        await self._stopping.wait()
        await status.abort(context, unavailable("router shutting down; register again"))

    async def _call(self, context: grpc.aio.ServicerContext, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KVError as exc:
            await status.abort(context, exc)

    async def _caller(self, context: grpc.aio.ServicerContext) -> Principal:
        return await self._call(context, self.security.principal, context)

    async def _register(self, request, context):
        caller = await self._caller(context)
        card = card_from_proto(request.card)
        return await self._call(
            context, self.router.register_worker, request.name, card, caller=caller
        )

    async def RegisterWorker(self, request, context):
        worker = await self._register(request, context)
        return admitted_reply(worker, self.router.members(worker.key))

    async def WorkerSession(self, request, context):
        worker = await self._register(request, context)
        try:
            yield admitted_reply(worker, self.router.members(worker.key))
            await self._hold_session(context)
        finally:
            if self.router.worker(worker.ref) is not None:
                self.router.remove_worker(worker.name, worker.ref.generation)

    async def RemoveWorker(self, request, context):
        caller = await self._caller(context)
        await self._call(
            context, self.router.remove_worker, request.name, request.generation, caller
        )
        return router_pb2.RemoveWorkerResponse(removed=True)

    async def Route(self, request, context):
        caller = await self._caller(context)
        result = await self._call(
            context,
            functools.partial(self.router.route, caller=caller),
            request.model,
            namespace=request.namespace,
            role=request.role,
            token_ids=listed(request.token_ids, limits.MAX_TOKEN_IDS) or None,
            hashes=listed(request.block_hashes, limits.MAX_BLOCK_HASHES) or None,
            request_id=request.request_id,
            track=request.track,
            decode_tokens=request.decode_tokens,
        )
        return _routed(result)

    async def ReportLoad(self, request, context):
        report = LoadReport(
            request.queued_prefill_tokens, request.running_requests, request.kv_usage
        )
        caller = await self._caller(context)
        await self._call(context, self.router.report_load, request.worker, report, caller)
        return router_pb2.ReportLoadResponse()

    async def RequestStarted(self, request, context):
        caller = await self._caller(context)
        await self._call(context, self.router.request_started, request.request_id, caller)
        return router_pb2.RequestStartedResponse()

    async def RequestFinished(self, request, context):
        caller = await self._caller(context)
        cached = request.cached_blocks if request.HasField("cached_blocks") else None
        await self._call(context, self.router.request_finished, request.request_id, cached, caller)
        return router_pb2.RequestFinishedResponse()

    async def AdvertisePeer(self, request, context):
        caller = await self._caller(context)
        peer = await self._call(
            context,
            self.router.advertise_peer,
            request.node_id,
            request.store_address,
            request.ucx_address,
            listed(request.final_namespaces, limits.MAX_NAMESPACES_PER_PEER),
            request.generation,
            request.lease_ms,
            caller,
        )
        # a refresh of a node that owes its snapshot (a new advertisement owes none)
        return router_pb2.AdvertisePeerResponse(
            generation=peer.generation, resync=peer.owes_snapshot
        )

    async def QueryPrefix(self, request, context):
        caller = await self._caller(context)
        peers = await self._call(
            context,
            self.router.query_prefix,
            request.final_namespace,
            listed(request.block_hashes, limits.MAX_BLOCK_HASHES),
            request.exclude_node_id,
            caller,
        )
        return router_pb2.QueryPrefixResponse(
            peers=[
                router_pb2.PeerPrefix(
                    node_id=p.node_id,
                    store_address=p.store_address,
                    ucx_address=p.ucx_address,
                    prefix_blocks=p.prefix_blocks,
                )
                for p in peers
            ]
        )

    async def PublishEvents(self, request, context):
        result = await self._publish(request, context)
        if result.stale:  # answered OK, the store would go on sending into the void
            await status.abort(
                context,
                not_found(
                    f"node_id {request.node_id!r} generation {request.generation} is not "
                    "advertised to this router (it restarted, or the peer's lease lapsed): "
                    "advertise again; its events were dropped"
                ),
            )
        return published_reply(result)

    async def _publish(self, request, context, events: list[StoreEvent] | None = None):
        """Apply a PublishEvents request as its caller (``events``: its payloads
        already decoded); the core's result."""
        caller = await self._caller(context)
        if events is None:
            events = await self._call(
                context,
                decode_store_events,
                request.node_id,
                listed(request.events, limits.MAX_EVENTS_PER_PUBLISH),
            )
        return await self._call(
            context,
            self.router.apply_store_events,
            request.node_id,
            request.generation,
            events,
            caller,
            request.seq,
            request.snapshot,
        )

    async def RouterStats(self, request, context):  # noqa: ARG002 -- the servicer's signature
        return router_pb2.RouterStatsResponse(**asdict(self.router.stats()))


def listed(repeated, limit: int):
    """A repeated field as a list when it holds at most ``limit`` items; past that
    the field itself, which the core refuses by its length before reading an item
    (a 16 MiB Route copied first held the loop 0.5 s and 270 MB)."""
    return list(repeated) if len(repeated) <= limit else repeated


def add_to_server(service: RouterService, server: grpc.aio.Server) -> None:
    """``add_RouterServicer_to_server``, but a request that does not parse is
    INVALID_ARGUMENT naming its message type, never UNKNOWN."""
    malformed.add_service(
        server, router_pb2.DESCRIPTOR.services_by_name["Router"], router_pb2, service
    )
