"""Serve a router: its gRPC service and its event feeds, embedded or standalone.

    served = ServedRouter(Router(config), FeedSpecs(vllm=(("w", "tcp://..."),)))
    served.start(server)   # inside the running loop, before server.start()
    await served.close()   # after server.stop()

    await serve_router(served, "127.0.0.1", 50061)   # standalone, until a signal

``kvstore serve`` hands a :class:`ServedRouter` to its StoreServer, which
starts and closes it with its own gRPC server; ``kvstore router`` runs
:func:`serve_router`. The router core itself knows nothing of either.
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
from kvstore.router.core import Router
from kvstore.service.feeds import Subscriptions
from kvstore.service.metrics import MetricsServer
from kvstore.service.router_service import RouterService, add_to_server

log = logging.getLogger(__name__)
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class FeedSpecs:
    """The event feeds a served router follows from its start."""

    vllm: tuple[tuple[str, str], ...] = ()  # (worker name, ZMQ endpoint) of vLLM publishers
    stores: tuple[str, ...] = ()  # store server addresses whose Events streams to follow


class ServedRouter:
    """A router core, the gRPC service that serves it, and the feeds it owns."""

    def __init__(self, router: Router, feeds: FeedSpecs | None = None):
        self.router = router
        self.feeds = feeds or FeedSpecs()
        self._subscriptions: Subscriptions | None = None

    def start(self, server: grpc.aio.Server) -> None:
        """Add the Router service to ``server`` and start the feeds.

        Call it from inside the running event loop (the feeds are tasks on it).
        """
        add_to_server(RouterService(self.router), server)  # unparseable: INVALID_ARGUMENT
        subs = Subscriptions(self.router, asyncio.get_running_loop())
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

    async def close(self) -> None:
        """Stop the feeds (the core stays usable)."""
        if self._subscriptions is not None:
            await self._subscriptions.close()
            self._subscriptions = None


async def serve_router(
    served: ServedRouter,
    host: str,
    port: int,
    on_listening: Callable[[int], None] | None = None,
    metrics_port: int | None = None,
) -> None:
    """The standalone router: gRPC + health on ``host:port`` until SIGINT or SIGTERM.

    ``on_listening`` gets the bound port (``port`` 0 picks a free one); with
    ``metrics_port`` it also serves Prometheus /metrics there.
    """
    metrics = None
    if metrics_port is not None:
        metrics = MetricsServer(lambda: {"router": served.router.stats()}, host, metrics_port)
    server = grpc.aio.server()
    served.start(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        await served.close()
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    gc.freeze()  # startup's objects never die: full collections need not walk them
    if metrics is not None:
        await metrics.start()
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
