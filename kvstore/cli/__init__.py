"""``kvstore`` command line: serve, router, demo, stats, events."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import math
import sys

from kvstore import __version__
from kvstore.wire import sizes
from kvstore.wire.principal import Tenancy, TenantBinding


def parse_size(text: str) -> int:
    """'1GiB', '512MiB', '4G', '1048576' -> bytes (binary units, at most 1 PiB)."""
    try:
        return sizes.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def port_number(text: str) -> int:
    """A TCP port, 0..65535 (0: the system picks a free one)."""
    return _whole(text, 0, 65535, "a port (0..65535)")


def positive_int(text: str) -> int:
    return _whole(text, 1, sys.maxsize, "a whole number >= 1")


def _whole(text: str, low: int, high: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def seconds(text: str) -> float:
    """A duration in seconds: finite and > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def host_and_port(text: str) -> str:
    """HOST:PORT (an IPv6 host in brackets), the port 1..65535."""
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (port 1..65535)")
    return text


def setup_logging(level: str) -> None:
    """kvstore's loggers at ``level``; other libraries' (grpc, asyncio) at INFO or
    above: their debug output is a line per call, not what --log-level debug asks."""
    level = level.upper()
    logging.basicConfig(
        level=max(logging.getLevelName(level), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )
    logging.getLogger("kvstore").setLevel(level)


STORE_METRICS = (
    "hits, misses, evictions, bytes in and out, pinned blocks, peer connections, fetch "
    "failures by cause, and the embedded router's (if any)"
)
ROUTER_METRICS = (
    "the router's stats: workers, sets, peers, indexed blocks, held blocks and their bound "
    "(--max-held-blocks), events applied and dropped by cause, active requests, load and "
    "hit reports, resyncs"
)


def add_metrics(p: argparse.ArgumentParser, what: str = STORE_METRICS) -> None:
    p.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (https, demanding a "
        "client certificate of the CA, with --tls-*; off by default; "
        f"0 picks a free port): {what}",
    )


def add_etcd(p) -> None:
    """--etcd and its settings (store servers and routers alike)."""
    p.add_argument(
        "--etcd",
        default="",
        metavar="URL",
        help="join a cluster on etcd: several routers and store servers sharing membership "
        "and worker admission (http://HOST:PORT, several comma-separated; https:// for TLS, "
        "see --etcd-ca). Without it, nothing is shared: one router decides everything",
    )
    p.add_argument(
        "--etcd-ca",
        default="",
        metavar="PEM",
        help="with https:// endpoints: the CA that signed etcd's server certificate "
        "(default: the system's roots)",
    )
    p.add_argument(
        "--etcd-cert",
        default="",
        metavar="PEM",
        help="with https:// endpoints: this process's client certificate for etcd, with "
        "--etcd-key (etcd --client-cert-auth; with etcd auth on, its CN is the etcd user, "
        "which needs read and write on --etcd-prefix)",
    )
    p.add_argument("--etcd-key", default="", metavar="PEM", help="the private key of --etcd-cert")
    p.add_argument(
        "--etcd-ttl",
        type=positive_int,
        default=10,
        metavar="SECONDS",
        help="lease of this process's etcd registrations; a process silent this long "
        "leaves routing (10; kept alive every third of it)",
    )
    p.add_argument(
        "--etcd-prefix",
        default="/kvstore/v1/",
        metavar="PREFIX",
        help="etcd key prefix of this cluster (/kvstore/v1/)",
    )


def etcd_config(args: argparse.Namespace):
    """The EtcdConfig of --etcd (None without it); ValueError names a bad flag.
    With --etcd the bound --host is the address others dial: 0.0.0.0 or :: is refused."""
    files = (args.etcd_ca, args.etcd_cert, args.etcd_key)
    if not args.etcd:
        if any(files):
            raise ValueError("--etcd-ca, --etcd-cert and --etcd-key are for --etcd: give it")
        return None
    from kvstore.membership.etcd import EtcdConfig, EtcdTls

    try:
        unspecified = ipaddress.ip_address(args.host.strip("[]")).is_unspecified
    except ValueError:  # a host name: what it resolves to is announced
        unspecified = False
    if unspecified:
        raise ValueError(
            f"--host {args.host} with --etcd: the bound address is announced in etcd, and "
            "others would dial their own host; give --host this host's routable address"
        )

    tls = EtcdTls(*files) if any(files) else None
    return EtcdConfig.parse(args.etcd, args.etcd_ttl, args.etcd_prefix, tls)


def check_identity_flags(security) -> None:
    """--admin and --tenant name certificate CNs: ValueError without TLS, where
    they would do nothing (every caller is an admin already), and when one
    namespace is bound to two CNs."""
    Tenancy(security.tenants)
    for flag, given in (("--admin", security.admins), ("--tenant", security.tenants)):
        if given and security.tls is None:
            raise ValueError(
                f"{flag} names certificate CNs: it needs --tls-ca/--tls-cert/--tls-key "
                "(without TLS every caller is an admin already)"
            )


def add_tls(p, server: bool = False) -> None:
    """--tls-ca/--tls-cert/--tls-key (and, for a server, --admin and --insecure)."""
    p.add_argument(
        "--tls-ca", default="", metavar="PEM", help="CA certificate that signs every component"
    )
    p.add_argument(
        "--tls-cert",
        default="",
        metavar="PEM",
        help="this component's certificate; its subject CN is its identity (mutual TLS "
        "needs --tls-ca, --tls-cert and --tls-key together)",
    )
    p.add_argument("--tls-key", default="", metavar="PEM", help="this component's private key")
    if not server:
        return
    p.add_argument(
        "--admin",
        action="append",
        default=[],
        metavar="CN",
        help="a client certificate CN trusted with everything: any worker, peer or "
        "namespace, Clear of all, every event (repeatable; with TLS)",
    )
    p.add_argument(
        "--tenant",
        action="append",
        default=[],
        type=tenant_binding,
        metavar="CN=NAMESPACE",
        help="a tenant's client certificate CN bound to its client namespace: only "
        "that certificate (or an admin) registers store instances there and admits "
        "router workers whose card names it, even before it first does, and it "
        "claims no namespace but those bound to it (repeatable; split at the last "
        "'='; with TLS; default: a namespace is the first claimer's)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --host without TLS, and a UCX peer port without "
        "--peer-secret-file under TLS or on such a host (logs a warning): anyone who "
        "reaches the ports may register, remove, clear and read anything",
    )


def tenant_binding(value: str) -> TenantBinding:
    """One --tenant value (argparse type): CN=NAMESPACE."""
    try:
        return TenantBinding.parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def tls_files(args: argparse.Namespace):
    """The TlsFiles of --tls-* (None without them); ValueError naming the flags
    missing when only some are given."""
    given = {"--tls-ca": args.tls_ca, "--tls-cert": args.tls_cert, "--tls-key": args.tls_key}
    missing = [flag for flag, path in given.items() if not path]
    if 0 < len(missing) < len(given):
        raise ValueError(
            f"--tls-ca, --tls-cert and --tls-key go together (mutual TLS); missing: "
            f"{', '.join(missing)}"
        )
    from kvstore.wire.tls import TlsFiles

    return TlsFiles.of(args.tls_ca, args.tls_cert, args.tls_key)


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level",
        default="info",
        type=str.lower,
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (info; any case); debug applies to kvstore's own loggers",
    )


def add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="run a store server (with an embedded router)",
        description="Run one store server: workers of this node register their KV-cache "
        "layers with it, save finished prompt blocks into its slot pool and load them back. "
        "By default it embeds a KV-aware router on the same port, a whole single-node "
        "deployment in one command.",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (127.0.0.1); any other needs --tls-* (or --insecure, on a "
        "trusted network only), and with --etcd a literal address peers reach (not 0.0.0.0)",
    )
    p.add_argument(
        "--port", type=port_number, default=50051, help="gRPC port (50051; 0 picks a free one)"
    )
    p.add_argument(
        "--pool-size",
        type=parse_size,
        default=parse_size("1GiB"),
        help="slot pool bytes per device, e.g. 64GiB (1GiB)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="where the pool lives: auto (every GPU if present, else host), cpu, "
        "cuda, cuda:N (auto)",
    )
    p.add_argument(
        "--gpu-copy",
        choices=("pieces", "blocks"),
        default="pieces",
        help="how Save/Load move bytes in GPU pools. pieces (default): the host plans "
        "every piece and uploads its table, a stream per request. blocks: only block ids "
        "and slot addresses travel; the kernel computes the pieces from the registration's "
        "table, on one stream per GPU (built to be faster; opt-in until measured on a GPU). "
        "Host pools always copy by blocks",
    )
    p.add_argument(
        "--node-id",
        default="",
        help="name of this store in events and peer lookups (hostname:port); one store's "
        "alone: a router (or etcd, with --etcd) refuses it while another live store holds it",
    )
    p.add_argument(
        "--router",
        default="",
        metavar="ADDRESS",
        help="advertise to a standalone `kvstore router` at ADDRESS instead of embedding one; "
        "several comma-separated are used one at a time, moving on when one fails "
        "(not with --etcd, which finds the routers)",
    )
    add_etcd(p)
    p.add_argument(
        "--no-transfer",
        action="store_true",
        help="do not serve or fetch blocks between store servers over UCX",
    )
    p.add_argument(
        "--no-rma",
        action="store_true",
        help="fetch and serve peer blocks two-sided only: no one-sided NIXL reads "
        "(used by default when nixl is installed and the pool is one allocation: the "
        "host's, or one GPU's)",
    )
    p.add_argument(
        "--ucx-port",
        type=port_number,
        default=0,
        help="UCX listener port for peer transfer (0 picks a free one). It listens "
        "on every interface (ucxx takes no bind address); with a loopback --host, "
        "UCX_NET_DEVICES=lo (unless set) makes UCX refuse connections from other "
        "interfaces. Otherwise firewall it. UCX_* variables pass through; "
        "UCXPY_PROGRESS_MODE=thread moves UCX progress off the event loop "
        "(default: blocking, on the loop)",
    )
    p.add_argument(
        "--peer-secret-file",
        default="",
        metavar="PATH",
        help="the cluster secret (16..4096 bytes, a file of this user's, mode 0600) "
        "that every peer proves on the UCX port before a block is served or "
        "accepted, both ways. Needed with TLS or a non-loopback --host (else "
        "--insecure)",
    )
    p.add_argument(
        "--peer",
        type=host_and_port,
        action="append",
        default=[],
        metavar="HOST:UCXPORT",
        help="a peer store's UCX address to fetch from when the router knows no "
        "holder (repeatable)",
    )
    p.add_argument(
        "--fetch-timeout",
        type=seconds,
        default=10.0,
        help="seconds a peer fetch may take before it fails over (10)",
    )
    p.add_argument(
        "--host-memory",
        choices=("owner", "any"),
        default="owner",
        help="whose host memory (a /dev/shm object, a worker's memfd) a rank may register. "
        "owner (default): only what the rank's own user could open read-write, that user "
        "read off its socket, so ranks with host memory connect from this node's network "
        "namespace. any: whatever this store can open (ranks in other network "
        "namespaces, e.g. containers, where every local user is trusted). GPU memory is "
        "not affected",
    )
    add_metrics(p)
    add_tls(p, server=True)
    add_common(p)
    from kvstore.cli.router import add_router_arguments

    group = p.add_argument_group("embedded router (ignored with --router)")
    add_router_arguments(group, embedded=True)


def add_demo(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="run the end-to-end demo: server, two TP workers, save, load, check",
        description="Start a store server and two tensor-parallel worker processes with "
        "KV caches in shared memory (or GPU memory), save prompts that share a long prefix, "
        "load them into a fresh instance and compare every byte, then show that the same "
        "model with MTP on lands in another namespace. Prints a summary table.",
    )
    p.add_argument("--layers", type=positive_int, default=32, help="model layers (32)")
    p.add_argument(
        "--heads",
        type=positive_int,
        default=8,
        help="KV heads in total, split between the two TP ranks: an even number (8)",
    )
    p.add_argument("--head-dim", type=positive_int, default=128, help="head dimension (128)")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per block (16)")
    p.add_argument("--prompts", type=positive_int, default=4, help="prompts sharing a prefix (4)")
    p.add_argument(
        "--prefix-tokens", type=positive_int, default=512, help="shared prefix tokens (512)"
    )
    p.add_argument(
        "--suffix-tokens", type=positive_int, default=128, help="tokens per prompt suffix (128)"
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto, cpu, cuda (the ranks spread over the GPUs) or cuda:N (auto)",
    )
    p.add_argument(
        "--pool-size", type=parse_size, default=parse_size("2GiB"), help="server pool size (2GiB)"
    )
    p.add_argument(
        "--log-level",
        default="error",
        type=str.lower,
        choices=["debug", "info", "warning", "error"],
        help="the demo's store server's log verbosity, on stderr (error; any case)",
    )


def add_stats(sub) -> None:
    p = sub.add_parser("stats", help="print a store server's counters")
    p.add_argument(
        "--address",
        type=host_and_port,
        default="127.0.0.1:50051",
        help="store server (127.0.0.1:50051)",
    )
    add_tls(p)


def add_clear(sub) -> None:
    p = sub.add_parser(
        "clear",
        help="drop a store server's unpinned sealed blocks",
        description="Drop every sealed block not held by a load or lease, of "
        "one final namespace or of all; routers see a 'cleared' event.",
    )
    p.add_argument(
        "--address",
        type=host_and_port,
        default="127.0.0.1:50051",
        help="store server (127.0.0.1:50051)",
    )
    p.add_argument("--namespace", default="", help="final namespace (default: every namespace)")
    add_tls(p)


def add_events(sub) -> None:
    p = sub.add_parser("events", help="print a store server's events as they happen")
    p.add_argument(
        "--address",
        type=host_and_port,
        default="127.0.0.1:50051",
        help="store server (127.0.0.1:50051)",
    )
    add_tls(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstore",
        description="kvstore: a GPU KV-cache block store and KV-aware router for LLM serving. "
        "Workers register their paged KV caches with the store server of their node, save "
        "prompt blocks and load them back; the router sends each request to the compatible "
        "worker that can reuse the most KV.",
    )
    parser.add_argument("--version", action="version", version=f"kvstore {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve(sub)
    add_router(sub)
    add_demo(sub)
    add_stats(sub)
    add_events(sub)
    add_clear(sub)
    return parser


def add_router(sub) -> None:
    from kvstore.cli.router import add_router_arguments

    p = sub.add_parser(
        "router",
        help="run a standalone KV-aware router for several store servers",
        description="Run the KV-aware router on its own: workers register cards, store "
        "servers and vLLM publishers feed its prefix index, requests are routed to the best "
        "compatible worker.",
    )
    add_router_arguments(p)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        setup_logging(args.log_level)
        return asyncio.run(_serve(args)) or 0
    if args.command == "router":
        from kvstore.cli.router import run_router

        setup_logging(args.log_level)
        return run_router(args)
    if args.command == "demo":
        from kvstore.demo import run_demo

        setup_logging(args.log_level)
        return run_demo(args)
    if args.command in ("stats", "clear", "events"):
        return _client_command(args)
    return 2


def stats_text(stats) -> str:
    """A StatsResponse as ``name: value`` lines, every field in the proto's order,
    zero counters too (protobuf's text form leaves them out); byte counts also in
    binary units."""
    from kvstore.wire.sizes import format_size

    lines = []
    for field in stats.DESCRIPTOR.fields:
        value = getattr(stats, field.name)
        if field.name.endswith("bytes") or field.name.startswith("bytes_"):
            value = f"{value} ({format_size(value)})"
        elif isinstance(value, str):
            value = value or "-"
        lines.append(f"{field.name}: {value}")
    return "\n".join(lines)


def _client_command(args: argparse.Namespace) -> int:
    """stats, clear, events: one call to a store server; a refusal prints its status."""
    from kvstore.client.store_client import StoreClient
    from kvstore.wire.errors import KVError

    try:
        tls = tls_files(args)
    except ValueError as exc:  # a flag: as argparse refuses one
        print(f"kvstore {args.command}: {exc}", file=sys.stderr)
        return 2
    try:
        if args.command == "events":
            return _print_events(args.address, tls)
        client = StoreClient(args.address, tls=tls)
        if args.command == "stats":
            print(stats_text(client.stats()))
        else:
            print(f"cleared {client.clear(args.namespace)} blocks")
    except (ValueError, KVError) as exc:
        print(f"kvstore {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve(args) -> None:
    from kvstore.service.store_server import (
        ServerConfig,
        StoreServer,
        serve_until_signal,
        stop_signal,
    )

    stop = stop_signal()  # before the pool is built: Ctrl-C meanwhile is not lost

    try:
        if args.etcd and args.router:
            raise ValueError("--router with --etcd: the routers are found in etcd; drop --router")
        from kvstore.cli.router import store_cns

        stores = store_cns(args.store_cn, args.store_node)
        config = ServerConfig(
            host=args.host,
            port=args.port,
            pool_size=args.pool_size,
            device=args.device,
            gpu_blocks=args.gpu_copy == "blocks",
            node_id=args.node_id,
            router_address=args.router,
            etcd=etcd_config(args),
            transfer=not args.no_transfer,
            rma=not args.no_rma,
            ucx_port=args.ucx_port,
            peers=tuple(args.peer),
            fetch_timeout_s=args.fetch_timeout,
            metrics_port=args.metrics_port,
            tls=tls_files(args),
            admins=tuple(args.admin),
            stores=stores.cns,
            store_nodes=stores.bound,
            tenants=tuple(args.tenant),
            insecure=args.insecure,
            peer_secret=_peer_secret(args),
            host_memory_any=args.host_memory == "any",
        )
        config.security.check_exposure(config.host, config.insecure)
        check_identity_flags(config.security)
        config.check_peer_exposure()
        router = None
        if not args.no_router and not args.router:
            from kvstore.cli.router import build_served_router, check_cn_flags

            check_cn_flags(config.security)
            router = build_served_router(args)
        server = StoreServer(config, router)
    except ValueError as exc:
        logging.getLogger("kvstore").error("%s", exc)
        return 2
    try:
        await serve_until_signal(server, stop)
    except OSError as exc:  # a port in use
        logging.getLogger("kvstore").error("kvstore serve: %s", exc)
        await server.stop(grace=0)
        return 1


def _peer_secret(args: argparse.Namespace):
    """The PeerSecret of --peer-secret-file (None without it; ValueError naming it)."""
    if not args.peer_secret_file:
        return None
    from kvstore.transfer.handshake import PeerSecret

    return PeerSecret.load(args.peer_secret_file)


def _print_events(address: str, tls) -> int:
    import grpc

    from kvstore._proto import store_pb2 as pb
    from kvstore._proto import store_pb2_grpc as pb_grpc
    from kvstore.client.tls import open_channel
    from kvstore.wire.events import StoreEvent

    stub = pb_grpc.KVStoreStub(open_channel(address, tls))
    try:
        for event in stub.Events(pb.EventsRequest()):
            print(StoreEvent.decode(event.payload), flush=True)
    except KeyboardInterrupt:
        pass
    except grpc.RpcError as exc:
        print(f"kvstore events: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
