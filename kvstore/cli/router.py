"""``kvstore router``: the router standalone, and the flags ``kvstore serve`` embeds.

add_router_arguments(parser)          # flags (standalone, or embedded=True for serve)
served = build_served_router(args)    # validated flags -> router core + feed specs
run_router(args)                      # the whole standalone server, until a signal

Serving itself lives in ``kvstore.service.router_server``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable

from kvstore.router.core import Router, RouterConfig
from kvstore.router.identity import IdentityAlgorithm
from kvstore.router.scoring import ScoringConfig
from kvstore.service.router_server import FeedSpecs, ServedRouter, serve_router

log = logging.getLogger(__name__)
DEFAULT_PORT = 50061


# (flag, ScoringConfig field, help): the defaults are ScoringConfig's own.
_SCORING_FLAGS = (
    (
        "--overlap-weight",
        "overlap_weight",
        "weight of prefill blocks against decode blocks in the cost",
    ),
    ("--temperature", "temperature", "0 picks the cheapest worker; >0 samples softmax(-cost/T)"),
    ("--gpu-weight", "gpu_weight", "credit for a cached block on the worker's own GPU"),
    ("--store-weight", "store_weight", "credit for a cached block in the worker's node store"),
    ("--remote-weight", "remote_weight", "credit for a cached block in a peer store"),
    (
        "--request-timeout",
        "request_timeout_s",
        "seconds after which a routed request never reported done is freed",
    ),
)


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
    defaults = ScoringConfig()
    for flag, name, text in _SCORING_FLAGS:
        parser.add_argument(flag, type=float, default=getattr(defaults, name), help=text)
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


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The core's configuration from ``args``; ValueError names a bad flag."""
    for flag, value in (
        ("--temperature", args.temperature),
        ("--overlap-weight", args.overlap_weight),
        ("--request-timeout", args.request_timeout),
    ):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    scoring = ScoringConfig(
        overlap_weight=args.overlap_weight,
        temperature=args.temperature,
        gpu_weight=args.gpu_weight,
        store_weight=args.store_weight,
        remote_weight=args.remote_weight,
        request_timeout_s=args.request_timeout,
        seed=args.seed,
    )
    return RouterConfig(IdentityAlgorithm(args.identity), scoring)


def feed_specs(args: argparse.Namespace) -> FeedSpecs:
    """The --zmq-endpoint and --store feeds; ValueError names a bad one."""
    return FeedSpecs(
        vllm=tuple(_zmq_endpoint(spec) for spec in args.zmq_endpoint),
        stores=tuple(args.store),
    )


def _zmq_endpoint(spec: str) -> tuple[str, str]:
    name, sep, endpoint = spec.partition("=")
    if not sep or not name or not endpoint:
        raise ValueError(f"--zmq-endpoint {spec!r}: expected NAME=tcp://host:port")
    return name, endpoint


def build_served_router(args: argparse.Namespace) -> ServedRouter:
    """The router core and its feeds, configured from ``args``; nothing runs yet."""
    return ServedRouter(Router(router_config(args)), feed_specs(args))


def run_router(args: argparse.Namespace) -> int:
    """The standalone router until SIGINT or SIGTERM; 2 when a flag is refused."""
    try:
        served = build_served_router(args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    asyncio.run(serve_router(served, args.host, args.port, _announcer(args.host)))
    return 0


def _announcer(host: str) -> Callable[[int], None]:
    """Prints the listening line that scripts and tests wait for on stdout."""

    def announce(port: int) -> None:
        print(f"kvstore router listening on {host}:{port}", flush=True)

    return announce


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvstore router", description=__doc__.splitlines()[0])
    add_router_arguments(parser)
    args = parser.parse_args(argv)
    try:
        served = build_served_router(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(serve_router(served, args.host, args.port, _announcer(args.host)))


if __name__ == "__main__":
    main()
