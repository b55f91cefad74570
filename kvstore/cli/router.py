"""``kvstore router``: the router standalone, and the hooks ``kvstore serve`` embeds.

add_router_arguments(parser)          # flags (standalone, or embedded=True for serve)
router = build_router(args)           # plain-Python core, no network yet
add_router_to_server(server, router)  # inside the running loop, before server.start()
await close_router(router)            # after server.stop()
await run_router(args)                # the whole standalone server
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvstore._proto import router_pb2, router_pb2_grpc
from kvstore.router.core import Router, RouterConfig
from kvstore.router.identity import IdentityAlgorithm
from kvstore.router.scoring import ScoringConfig
from kvstore.service.feeds import Subscriptions
from kvstore.service.router_service import RouterService

log = logging.getLogger(__name__)
DEFAULT_PORT = 50061
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


def add_router_arguments(parser: argparse.ArgumentParser, embedded: bool = False) -> None:
    """Router flags. ``embedded=True`` (for ``kvstore serve``) leaves out
    --host/--port/--log-level, which the embedding command owns, and adds
    --no-router."""
    if embedded:
        parser.add_argument(
            "--no-router",
            action="store_true",
            help="do not embed the KV-aware router in this server",
        )
    else:
        parser.add_argument(
            "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)"
        )
        parser.add_argument(
            "--port",
            type=int,
            default=DEFAULT_PORT,
            help=f"gRPC port (default {DEFAULT_PORT}; 0 picks a free one)",
        )
        parser.add_argument(
            "--log-level",
            default="INFO",
            type=str.upper,
            choices=["DEBUG", "INFO", "WARNING", "ERROR"],
            help="logging level (INFO; any case)",
        )
    parser.add_argument(
        "--identity",
        choices=[a.value for a in IdentityAlgorithm],
        default="r2",
        help="cache-semantics material: r2 = display name (default), r1 = card checksum",
    )
    parser.add_argument(
        "--overlap-weight",
        type=float,
        default=1.0,
        help="weight of prefill blocks against decode blocks in the cost",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 picks the cheapest worker; >0 samples softmax(-cost/T)",
    )
    parser.add_argument(
        "--gpu-weight",
        type=float,
        default=1.0,
        help="credit for a cached block on the worker's own GPU",
    )
    parser.add_argument(
        "--store-weight",
        type=float,
        default=0.75,
        help="credit for a cached block in the worker's node store",
    )
    parser.add_argument(
        "--remote-weight", type=float, default=0.5, help="credit for a cached block in a peer store"
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds after which a routed request never reported done is freed",
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="seed for WorkerSet draws and softmax sampling"
    )
    parser.add_argument(
        "--zmq-endpoint",
        action="append",
        default=[],
        metavar="NAME=ENDPOINT",
        help="subscribe to a vLLM KV event publisher whose events belong to "
        "worker NAME (repeatable)",
    )
    parser.add_argument(
        "--store",
        action="append",
        default=[],
        metavar="ADDRESS",
        help="follow a store server's Events stream (repeatable)",
    )


def build_router(args: argparse.Namespace) -> Router:
    """The router core configured from ``args``; feeds start in add_router_to_server."""
    for name, value in (
        ("--temperature", args.temperature),
        ("--overlap-weight", args.overlap_weight),
        ("--request-timeout", args.request_timeout),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    for spec in args.zmq_endpoint:
        if "=" not in spec:
            raise ValueError(f"--zmq-endpoint {spec!r}: expected NAME=tcp://host:port")
    scoring = ScoringConfig(
        overlap_weight=args.overlap_weight,
        temperature=args.temperature,
        gpu_weight=args.gpu_weight,
        store_weight=args.store_weight,
        remote_weight=args.remote_weight,
        request_timeout_s=args.request_timeout,
        seed=args.seed,
    )
    router = Router(RouterConfig(IdentityAlgorithm(args.identity), scoring))
    router.feed_specs = (list(args.zmq_endpoint), list(args.store))  # started with the server
    return router


def add_router_to_server(server: grpc.aio.Server, router: Router) -> None:
    """Serve ``router`` on ``server`` and start its event feeds.

    Call it from inside the running event loop (the feeds are tasks on it).
    """
    router_pb2_grpc.add_RouterServicer_to_server(RouterService(router), server)
    subs = Subscriptions(router, asyncio.get_running_loop())
    router.add_listener(subs.on_worker_change)
    zmq_specs, stores = router.feed_specs
    for spec in zmq_specs:
        subs.add_static(spec)
    for address in stores:
        subs.add_store(address)
    router.subscriptions = subs


async def close_router(router: Router) -> None:
    """Stop the router's event feeds."""
    subs = router.subscriptions
    if subs is not None:
        await subs.close()


async def run_router(args: argparse.Namespace) -> None:
    """The standalone router: gRPC + health, until SIGINT or SIGTERM."""
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    router = build_router(args)
    server = grpc.aio.server()
    add_router_to_server(server, router)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    if port == 0:
        raise OSError(f"cannot bind {args.host}:{args.port}")
    await server.start()
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info("router listening on %s:%d (identity %s)", args.host, port, args.identity)
    print(f"kvstore router listening on {args.host}:{port}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("router shutting down")
        await health.enter_graceful_shutdown()
        await server.stop(grace=5)
        await close_router(router)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvstore router", description=__doc__.splitlines()[0])
    add_router_arguments(parser)
    args = parser.parse_args(argv)
    try:
        asyncio.run(run_router(args))
    except ValueError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    main()
