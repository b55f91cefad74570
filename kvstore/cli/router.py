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
import math
import re
import sys
from collections.abc import Callable
from typing import NamedTuple

from kvstore.cli import (
    ROUTER_METRICS,
    add_etcd,
    add_metrics,
    add_tls,
    check_identity_flags,
    etcd_config,
    port_number,
    positive_int,
    tls_files,
)
from kvstore.router.bounds import (
    BYTES_PER_HELD_BLOCK,
    DEFAULT_CAPACITY_BLOCKS,
    DEFAULT_MAX_HELD_BLOCKS,
    SETTLED,
)
from kvstore.router.core import Router, RouterConfig
from kvstore.router.endpoints import LOOPBACK, EndpointAllowList
from kvstore.router.identity import IdentityAlgorithm
from kvstore.router.scoring import ScoringConfig
from kvstore.service.router_server import FeedSpecs, ServedRouter, serve_router
from kvstore.service.tls import Security, host_port
from kvstore.wire.limits import MAX_NAME_LEN
from kvstore.wire.principal import NodeBinding, node_owners

log = logging.getLogger(__name__)
DEFAULT_PORT = 50061
SETTLED_PERCENT = round(SETTLED * 100)  # an overflow episode ends back at this share of its bound
ZMQ_ENDPOINT = re.compile(r"tcp://\S+:\d{1,5}|ipc://\S+")  # what a vLLM publisher binds


# (flag, ScoringConfig field, help): the defaults are ScoringConfig's own; every
# one must be finite and >= 0, the FRACTIONS at most 1. The cost they feed is in
# kvstore/router/scoring.py.
# Past this a score's product of flags, tokens (<= 2**40 queued) and weights could
# overflow to inf, and inf x 0 is NaN: no route would rank (a review).
MAX_SCORING_VALUE = 1e6
_SCORING_FLAGS = (
    (
        "--prefill-ms-per-token",
        "prefill_ms_per_token",
        "ms one worker spends prefilling one prompt token, which scales queued and "
        "uncached tokens in the expected ttft (the default, ~25k tokens/s, is an 8B "
        "model on one H100)",
    ),
    (
        "--decode-interference-ms",
        "decode_interference_ms",
        "ms one running (decoding) request adds to a new request's time to first token",
    ),
    (
        "--recompute-weight",
        "recompute_weight",
        "also charge a worker w x its uncached prefill time, the delay that recompute "
        "adds for the requests queuing behind it (0: rank by expected ttft alone)",
    ),
    ("--temperature", "temperature", "0 picks the lowest score; >0 samples softmax(-score/T)"),
    ("--gpu-weight", "gpu_weight", "fraction of a block's prefill a hit on the worker's GPU saves"),
    (
        "--store-weight",
        "store_weight",
        "fraction of a block's prefill a hit in the worker's node store saves (the rest "
        "stands for the transfer)",
    ),
    ("--remote-weight", "remote_weight", "fraction of a block's prefill a peer-store hit saves"),
    (
        "--load-staleness",
        "load_staleness_s",
        "seconds a worker's ReportLoad is used; older, the router counts its own routed requests",
    ),
    (
        "--request-timeout",
        "request_timeout_s",
        "seconds after which a routed request never reported finished is freed",
    ),
)


FRACTIONS = ("--gpu-weight", "--store-weight", "--remote-weight")


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
            type=port_number,
            default=DEFAULT_PORT,
            help=f"gRPC port (default {DEFAULT_PORT}; 0 picks a free one)",
        )
        parser.add_argument(
            "--log-level",
            default="info",
            type=str.lower,
            choices=["debug", "info", "warning", "error"],
            help="log verbosity (info; any case); debug applies to kvstore's own loggers",
        )
        add_metrics(parser, ROUTER_METRICS)
        add_etcd(parser)
        add_tls(parser, server=True)
    parser.add_argument(
        "--store-cn",
        action="append",
        default=[],
        metavar="CN",
        help="a client certificate CN of a store node: only these (and admins) may "
        "advertise store nodes, publish their events and ask which peers hold a "
        "prefix, and relay GPU-tier events for other tenants' workers attached to "
        "the node they publish as (a worker card's node_id; a shared store needs "
        "it; repeatable; with TLS; default: any certificate of the CA, each "
        "relaying only for workers it admitted itself). Such a certificate may "
        "act as any node id it advertises first: bind it with --store-node",
    )
    parser.add_argument(
        "--store-node",
        action="append",
        default=[],
        type=store_node,
        metavar="CN=NODE_ID",
        help="a store certificate CN bound to the node id it serves as (its "
        "--node-id; a store CN too, as --store-cn): it may act only as the node ids "
        "bound to it, and no other certificate but an admin's as them, so it cannot "
        "take a node id no store holds yet and relay for the workers attached to "
        "it (repeatable; split at the last '='; with TLS)",
    )
    parser.add_argument(
        "--identity",
        choices=[a.value for a in IdentityAlgorithm],
        default="r2",
        help="cache-semantics material: r2 = display name (default), r1 = card checksum",
    )
    defaults = ScoringConfig()
    for flag, name, text in _SCORING_FLAGS:
        default = getattr(defaults, name)
        parser.add_argument(flag, type=float, default=default, help=f"{text} (default {default:g})")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed for WorkerSet draws, softmax sampling and tie draws",
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
        "--events-allow",
        action="append",
        default=[],
        metavar="PATTERN",
        help="a ZMQ event endpoint a worker card may name for the router to subscribe to "
        "(repeatable): tcp://HOST:PORT with HOST an address, a CIDR range (10.0.0.0/8, "
        "[fd00::/8]), an exact host name or *, PORT a number, LOW-HIGH or *; or "
        "ipc://GLOB. A card naming another endpoint is refused (PERMISSION_DENIED). "
        f"Default: loopback only ({' '.join(LOOPBACK)})",
    )
    parser.add_argument(
        "--store",
        action="append",
        default=[],
        metavar="ADDRESS",
        help="follow a store server's Events stream (repeatable)",
    )
    parser.add_argument(
        "--default-capacity-blocks",
        type=positive_int,
        default=DEFAULT_CAPACITY_BLOCKS,
        metavar="N",
        help="blocks the router indexes for one tier of a worker whose card states no "
        "capacity_blocks (a card's capacity_blocks bounds its GPU tier; its offload tier "
        "takes the larger of the two); stored blocks past it are not indexed and count "
        f"as over_capacity, logged once per worker tier until it is back to {SETTLED_PERCENT}%% "
        f"of its bound (default {DEFAULT_CAPACITY_BLOCKS})",
    )
    parser.add_argument(
        "--max-held-blocks",
        type=positive_int,
        default=DEFAULT_MAX_HELD_BLOCKS,
        metavar="N",
        help="blocks the router indexes in all, summed over workers' tiers and store "
        f"nodes (a block two hold counts twice; ~{BYTES_PER_HELD_BLOCK} B each); stored "
        "blocks past it are not indexed and count as index_full, logged once until "
        f"removals bring it back to {SETTLED_PERCENT}%% of its bound "
        f"(default {DEFAULT_MAX_HELD_BLOCKS}, ~2 GiB)",
    )


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The core's configuration from ``args``; ValueError names a bad flag
    (an --events-allow pattern that does not parse among them)."""
    values = {}
    for flag, name, _ in _SCORING_FLAGS:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if not (math.isfinite(value) and 0 <= value <= MAX_SCORING_VALUE):
            raise ValueError(f"{flag} must be a number in 0..{MAX_SCORING_VALUE:g}, got {value}")
        if flag in FRACTIONS and value > 1:
            raise ValueError(f"{flag} is a fraction of a block's prefill: 0..1, got {value}")
        values[name] = value
    return RouterConfig(
        IdentityAlgorithm(args.identity),
        ScoringConfig(**values, seed=args.seed),
        EndpointAllowList(args.events_allow or LOOPBACK),
        default_capacity_blocks=args.default_capacity_blocks,
        max_held_blocks=args.max_held_blocks,
    )


def feed_specs(args: argparse.Namespace) -> FeedSpecs:
    """The --zmq-endpoint and --store feeds; ValueError names a bad one."""
    return FeedSpecs(
        vllm=tuple(_zmq_endpoint(spec) for spec in args.zmq_endpoint),
        stores=tuple(args.store),
    )


def _zmq_endpoint(spec: str) -> tuple[str, str]:
    """NAME=ENDPOINT, ENDPOINT a ZMQ address (tcp://HOST:PORT, ipc://PATH): a bad one
    is refused here (ZMQ refused it in the feed's task, which ended unheard)."""
    name, sep, endpoint = spec.partition("=")
    if not sep or not name or not endpoint:
        raise ValueError(f"--zmq-endpoint {spec!r}: expected NAME=tcp://host:port")
    if len(name) > MAX_NAME_LEN or not name.isprintable():
        raise ValueError(
            f"--zmq-endpoint {spec!r}: NAME must be 1-{MAX_NAME_LEN} printable characters"
        )
    if not ZMQ_ENDPOINT.fullmatch(endpoint):
        raise ValueError(
            f"--zmq-endpoint {spec!r}: {endpoint!r} is no ZMQ endpoint "
            "(tcp://HOST:PORT or ipc://PATH)"
        )
    return name, endpoint


def build_served_router(args: argparse.Namespace) -> ServedRouter:
    """The router core and its feeds (and its replica on etcd, with --etcd),
    configured from ``args``; nothing runs yet."""
    etcd = etcd_config(args)
    if etcd is not None and args.store:
        raise ValueError(
            "--store with --etcd: store servers on etcd publish to every router replica; "
            "drop --store"
        )
    return ServedRouter(Router(router_config(args)), feed_specs(args), etcd)


def security(args: argparse.Namespace) -> Security:
    """TLS, admins and store nodes of --tls-*/--admin/--store-cn; ValueError
    when a TLS flag is missing, --store-cn comes without TLS, or a non-loopback
    --host has no TLS and no --insecure."""
    stores = store_cns(args.store_cn, args.store_node)
    result = Security(
        tls_files(args), tuple(args.admin), stores.cns, stores.bound, tuple(args.tenant)
    )
    result.check_exposure(args.host, args.insecure)
    check_cn_flags(result)
    return result


def store_node(value: str) -> NodeBinding:
    """One --store-node value (argparse type): CN=NODE_ID."""
    try:
        return NodeBinding.parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class StoreCNs(NamedTuple):
    """What the --store-cn and --store-node flags say."""

    cns: tuple[str, ...]  # every store CN, once
    bound: tuple[NodeBinding, ...]  # the --store-node ones


def store_cns(cns: list[str], bound: list[NodeBinding]) -> StoreCNs:
    """The --store-cn and --store-node flags; ValueError when a node id is bound
    to two CNs."""
    node_owners(bound)
    return StoreCNs(tuple(dict.fromkeys([*cns, *(b.cn for b in bound)])), tuple(bound))


def check_cn_flags(served: Security) -> None:
    """A served router's --store-cn and --admin: ValueError without TLS (there are
    no CNs); a warning under TLS without --store-cn (any certificate may act as a
    store)."""
    if served.stores and served.tls is None:
        raise ValueError(
            "--store-cn and --store-node name certificate CNs: they need "
            "--tls-ca/--tls-cert/--tls-key"
        )
    check_identity_flags(served)
    if served.tls is not None and not served.stores:
        log.warning(
            "no --store-cn: any certificate of the CA may act as a store node here "
            "(advertise, publish events, ask which peers hold a tenant's prefix); "
            "a store's relayed GPU-tier events apply only to workers its own "
            "certificate admitted, so a store shared by tenants needs --store-cn"
        )


def run_router(args: argparse.Namespace) -> int:
    """The standalone router until SIGINT or SIGTERM; 2 when a flag is refused."""
    try:
        guard = security(args)
        served = build_served_router(args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    try:
        asyncio.run(_serve(served, args, guard))
    except OSError as exc:  # a port in use
        log.error("kvstore router: %s", exc)
        return 1
    return 0


def _serve(served: ServedRouter, args: argparse.Namespace, guard: Security):
    return serve_router(
        served,
        args.host,
        args.port,
        _announcer(args.host),
        args.metrics_port,
        security=guard,
        insecure=args.insecure,
    )


def _announcer(host: str) -> Callable[[int], None]:
    """Prints the listening line that scripts and tests wait for on stdout."""

    def announce(port: int) -> None:
        print(f"kvstore router listening on {host_port(host, port)}", flush=True)

    return announce


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstore.cli.router``: ``kvstore router`` by another name."""
    from kvstore.cli import main as kvstore_main

    return kvstore_main(["router", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
