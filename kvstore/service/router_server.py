"""Serve a router: its gRPC service and its event feeds, embedded or standalone.

    served = ServedRouter(Router(config), FeedSpecs(vllm=(("w", "tcp://..."),)))
    served.start(server)   # inside the running loop, before server.start()
    await served.announce("127.0.0.1:50061")   # once bound: joins etcd when configured
    await served.close()   # after server.stop()

    await serve_router(served, "127.0.0.1", 50061)   # standalone, until a signal

``kvstore serve`` hands a :class:`ServedRouter` to its StoreServer, which
starts and closes it with its own gRPC server; ``kvstore router`` runs
:func:`serve_router`. The router core itself knows nothing of either.

With an :class:`EtcdConfig` the router is one replica of several: worker
admission and removal go through etcd transactions and store servers are
known from etcd (``kvstore.membership``), served by
:class:`ClusterRouterService`; everything else (Route, loads, events) is the
plain service on this replica's own core.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvstore._proto import router_pb2
from kvstore.membership.etcd import Etcd, EtcdConfig
from kvstore.membership.replica import RouterReplica
from kvstore.membership.worksets import Refused
from kvstore.router.admission import Worker, WorkerRef, key_of, refusal
from kvstore.router.core import Router
from kvstore.router.requests import decode_store_events
from kvstore.service import status
from kvstore.service.feeds import Subscriptions
from kvstore.service.metrics import MetricsServer
from kvstore.service.router_service import (
    RouterService,
    add_to_server,
    admitted_reply,
    listed,
    published_reply,
)
from kvstore.service.tls import BIND_OPTIONS, PLAINTEXT, Security, host_port
from kvstore.wire import limits
from kvstore.wire.card import WorkerCard, validate_card
from kvstore.wire.card_proto import card_from_proto
from kvstore.wire.errors import KVError, not_found, precondition, unavailable
from kvstore.wire.names import check_name
from kvstore.wire.principal import Tenancy, node_owners

log = logging.getLogger(__name__)
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
STOP_GRACE_S = 5.0
FIRST_LISTING_S = 3.0  # a replica waits this long for etcd's listing before serving


@dataclass(frozen=True)
class FeedSpecs:
    """The event feeds a served router follows from its start."""

    vllm: tuple[tuple[str, str], ...] = ()  # (worker name, ZMQ endpoint) of vLLM publishers
    stores: tuple[str, ...] = ()  # store server addresses whose Events streams to follow


class ServedRouter:
    """A router core, the gRPC service that serves it, and the feeds it owns;
    with ``etcd``, also its replica on etcd."""

    def __init__(
        self,
        router: Router,
        feeds: FeedSpecs | None = None,
        etcd: EtcdConfig | None = None,
    ):
        self.router = router
        self.feeds = feeds or FeedSpecs()
        self.etcd_config = etcd
        self.replica: RouterReplica | None = None
        self._etcd: Etcd | None = None
        self._subscriptions: Subscriptions | None = None
        self._service: RouterService | None = None

    def start(
        self, server: grpc.aio.Server, security: Security = PLAINTEXT, claims: Tenancy | None = None
    ) -> None:
        """Add the Router service to ``server`` and start the feeds.

        ``security``: the server's TLS and admins (who callers are; the store
        feeds present the same credentials); its store CNs (``--store-cn``) join
        the core's trusted stores, which may relay GPU-tier events for any
        tenant's workers attached to the node they publish as; its tenant
        bindings (``--tenant``) join the core's, or ``claims`` (a store's
        embedded router: the store's claims, bindings included) stand in for
        them. Call it from inside the running event loop (the feeds are tasks
        on it).
        """
        config = self.router.config
        config.store_cns = config.store_cns | frozenset(security.stores)
        config.node_owners = config.node_owners | node_owners(security.store_nodes)
        config.tenancy = claims or Tenancy([*config.tenancy.bindings, *security.tenants])
        if self.etcd_config is None:
            service = RouterService(self.router, security)
        else:
            self._etcd = Etcd(self.etcd_config)
            self.replica = RouterReplica(self._etcd, self.etcd_config, self.router)
            service = ClusterRouterService(self.router, self.replica, security)
        add_to_server(service, server)  # unparseable: INVALID_ARGUMENT
        self._service = service
        subs = Subscriptions(self.router, asyncio.get_running_loop(), security.tls)
        subs.start()
        for name, endpoint in self.feeds.vllm:
            subs.add_vllm(name, endpoint)
        for address in self.feeds.stores:
            subs.add_store(address)
        self._subscriptions = subs

    def follow_store(self, address: str) -> None:
        """Also follow the store server at ``address`` (on the loop :meth:`start` ran in)."""
        if self._subscriptions is None:
            raise RuntimeError("start the served router first")
        self._subscriptions.add_store(address)

    async def announce(self, address: str) -> None:
        """The server is bound at ``address``: on etcd, register this replica there
        and follow the cluster (waiting a moment for etcd's first listing)."""
        if self.replica is None:
            return
        await self.replica.start(address)
        if not await self.replica.listed(FIRST_LISTING_S):
            log.warning("etcd has not answered yet; serving, and following it once it does")

    def end_sessions(self) -> None:
        """The server is stopping: end its workers' sessions (before its grace)."""
        if self._service is not None:
            self._service.end_sessions()

    async def close(self) -> None:
        """Stop the feeds and leave etcd (the core stays usable)."""
        if self._subscriptions is not None:
            await self._subscriptions.close()
            self._subscriptions = None
        if self.replica is not None:
            await self.replica.close()
        if self._etcd is not None:
            await self._etcd.close()


class ClusterRouterService(RouterService):
    """The Router service of a replica on etcd.

    RegisterWorker, WorkerSession and RemoveWorker decide in etcd (first-wins
    in a transaction; the worker's lease held by this replica) and answer once
    this replica's core shows the outcome. Store servers are known from etcd,
    so AdvertisePeer is refused; PublishEvents from a (node, generation) this
    replica does not know (yet) is NOT_FOUND, which tells the store to send its
    snapshot again shortly. A snapshot applies once this replica has applied
    every admission etcd holds (its GPU-tier blocks are relayed by worker name,
    kvstore/membership/relayed.py). Everything else is the plain service.

    Ownership is recorded in etcd, so it holds on every replica alike
    (docs/design.md §8): a worker name belongs to the caller that admitted it
    (only it or an admin may re-register or remove it), a store node id to the
    first caller that publishes as it, per store generation.
    """

    def __init__(self, router: Router, replica: RouterReplica, security: Security = PLAINTEXT):
        super().__init__(router, security)
        self.replica = replica

    async def _admit(self, context, name: str, card: WorkerCard, session: bool = False) -> Worker:
        """Admit through etcd, then wait for this replica to see it. For a
        ``session``, an admission whose call fails or ends after etcd took it
        (not seen in time, the client gone) is released: nothing holds it."""
        try:
            check_name("name", name)
            validate_card(card)
            self.router.config.events_allow.check(card.kv_events_endpoint)
            caller = self.security.principal(context)
            self.router.config.tenancy.check("card.namespace", card.namespace, caller)
            self.router.check_worker_quota(name, caller, card)
            bound = self.router.config.tenancy.owner(card.namespace)
            outcome = await self.replica.admit(name, card, caller, bound)
            if isinstance(outcome, Refused):
                self.router.record_rejected()
                raise refusal(
                    name, key_of(card), outcome.checksum, outcome.reference, card, outcome.others
                )
            try:
                await self.replica.seen(name, outcome.generation)
                worker = self.router.worker(WorkerRef(name, outcome.generation))
                if worker is None:
                    raise unavailable(
                        f"worker {name!r} admitted in etcd (generation {outcome.generation}) "
                        "but not yet seen by this replica; register again"
                    )
            except BaseException:
                if session:
                    self.replica.release(name, outcome.generation)
                raise
            return worker
        except KVError as exc:
            await status.abort(context, exc)
            raise  # abort raises; this keeps the type checker honest

    async def RegisterWorker(self, request, context):
        worker = await self._admit(context, request.name, card_from_proto(request.card))
        return admitted_reply(worker, self.router.members(worker.key))

    async def WorkerSession(self, request, context):
        worker = await self._admit(context, request.name, card_from_proto(request.card), True)
        try:
            yield admitted_reply(worker, self.router.members(worker.key))
            await self._hold_session(context)
        finally:
            self.replica.release(worker.name, worker.ref.generation)

    async def RemoveWorker(self, request, context):
        try:
            check_name("name", request.name)  # before it names an etcd key
            caller = self.security.principal(context)
            if not await self.replica.remove(request.name, request.generation, caller):
                generation = request.generation or "any"
                raise not_found(f"worker {request.name!r} generation {generation} is not admitted")
        except KVError as exc:
            await status.abort(context, exc)
        return router_pb2.RemoveWorkerResponse(removed=True)

    async def AdvertisePeer(self, request, context):  # noqa: ARG002 -- the servicer's signature
        await status.abort(
            context,
            precondition(
                "this router replica learns store servers from etcd: start the store "
                "with --etcd (AdvertisePeer is for a router without etcd)"
            ),
        )

    async def PublishEvents(self, request, context):
        try:
            # decoded and bounded first: a refused batch claims no node in etcd
            events = decode_store_events(
                request.node_id, listed(request.events, limits.MAX_EVENTS_PER_PUBLISH)
            )
            caller = self.security.principal(context)
            # a node id bound to another certificate is refused before it is claimed
            self.router.check_bound("PublishEvents", request.node_id, caller)
            await self.replica.check_publisher(request.node_id, request.generation, caller)
        except KVError as exc:
            await status.abort(context, exc)
        if request.snapshot:  # its relayed GPU-tier blocks go to the current admissions
            await self.replica.workers_settled()
        result = await self._publish(request, context, events)
        if result.stale:
            await status.abort(
                context,
                not_found(
                    f"peer {request.node_id!r} generation {request.generation} is not current "
                    "on this replica (not seen in etcd yet, or it left); send a snapshot again"
                ),
            )
        return published_reply(result)


async def serve_router(
    served: ServedRouter,
    host: str,
    port: int,
    on_listening: Callable[[int], None] | None = None,
    metrics_port: int | None = None,
    security: Security = PLAINTEXT,
    insecure: bool = False,
) -> None:
    """The standalone router: gRPC + health on ``host:port`` until SIGINT or SIGTERM.

    ``on_listening`` gets the bound port (``port`` 0 picks a free one); with
    ``metrics_port`` it also serves Prometheus /metrics there (HTTPS with
    client certificates when ``security`` has TLS). ``security``:
    TLS and admins; a non-loopback ``host`` without TLS is a ValueError unless
    ``insecure``.
    """
    security.check_exposure(host, insecure)
    metrics = None
    if metrics_port is not None:
        metrics = MetricsServer(
            lambda: {"router": served.router.stats()}, host, metrics_port, security.tls
        )
    server = grpc.aio.server(options=BIND_OPTIONS)
    served.start(server, security)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    try:
        bound = security.bind(server, host_port(host, port))
        if metrics is not None:  # a taken port fails here, before etcd hears of this replica
            await metrics.start()
    except OSError:
        await server.stop(None)
        await served.close()
        raise
    await server.start()
    await served.announce(host_port(host, bound))
    gc.freeze()  # startup's objects never die: full collections need not walk them
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "router listening on %s:%d (identity %s)",
        host,
        bound,
        served.router.config.identity.value,
    )
    if on_listening is not None:
        on_listening(bound)
    try:
        await _until_signal()
    finally:
        log.info("router shutting down")
        await health.enter_graceful_shutdown()
        served.end_sessions()
        await server.stop(grace=STOP_GRACE_S)
        await served.close()
        if metrics is not None:
            await metrics.stop()


async def _until_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
