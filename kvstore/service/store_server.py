"""Assemble and run a store server: pools, copy engines, registry, store, gRPC.

``kvstore serve`` calls :func:`run`; tests and the demo use
:class:`StoreServer` directly to start one on a loopback port.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore.copy import copier_for
from kvstore.membership.etcd import EtcdConfig
from kvstore.service.metrics import MetricsServer
from kvstore.service.router_link import (
    ClusterRouterLink,
    LocalRouterLink,
    RemoteRouterLink,
)
from kvstore.service.router_server import ServedRouter
from kvstore.service.sealed import Sealed
from kvstore.service.store_service import KVStoreService, add_to_server
from kvstore.service.tls import BIND_OPTIONS, Security, host_port, is_loopback
from kvstore.store.attach import attach
from kvstore.store.blocks import BlockIndex
from kvstore.store.fetch import Fetcher, StoreSink, StoreSource
from kvstore.store.node import StoreNode
from kvstore.store.pool import DEFAULT_SLAB_BYTES, SlotPool
from kvstore.store.registry import Registry
from kvstore.store.tenants import NodeClaims
from kvstore.transfer import PeerServer, rma
from kvstore.transfer.handshake import PeerSecret
from kvstore.transfer.onesided import RmaReader
from kvstore.transfer.ucx import LOOPBACK_DEVICE, restrict_net_devices
from kvstore.wire.devices import Device
from kvstore.wire.errors import Code, KVError
from kvstore.wire.events import StoreEvent
from kvstore.wire.peers import PeerPrefix
from kvstore.wire.principal import NodeBinding, Tenancy, TenantBinding
from kvstore.wire.sizes import format_size
from kvstore.wire.tls import TlsFiles

log = logging.getLogger(__name__)
SERVICE_NAME = "kvstore.v1.KVStore"
EXPIRE_EVERY_S = 1.0

# Liveness: a rank's registration is its open RegisterLayers call. A killed
# process closes its socket at once; a hung host stops answering keepalive
# pings and its calls are cancelled after about keepalive_time + timeout.
SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 16 << 20),
]


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    pool_size: int = 1 << 30
    device: str = "auto"
    gpu_blocks: bool = False  # GPU pools copy by blocks (kvstore.store.copying), not pieces
    slab_bytes: int = DEFAULT_SLAB_BYTES
    node_id: str = ""
    # Standalone routers to advertise to, "HOST:PORT[,HOST:PORT...]", one at a time
    # in this order; "" = none/embedded.
    router_address: str = ""
    etcd: EtcdConfig | None = None  # register in etcd, publish to every router replica there
    transfer: bool = False  # run a UCX listener and fetch missing blocks from peers
    rma: bool = True  # with transfer: one-sided NIXL reads where both ends allow them
    ucx_port: int = 0
    peers: tuple[str, ...] = ()  # explicit UCX peer addresses when no router answers
    fetch_timeout_s: float = 10.0
    metrics_port: int | None = None  # Prometheus /metrics on host:port; None = off, 0 = free
    # Mutual TLS for gRPC, served and to the routers; None = plaintext (loopback only
    # unless insecure). admins: certificate CNs trusted with everything.
    tls: TlsFiles | None = None
    admins: tuple[str, ...] = ()
    stores: tuple[str, ...] = ()  # the embedded router's store CNs; () = any caller
    store_nodes: tuple[NodeBinding, ...] = ()  # of them, those bound to node ids
    tenants: tuple[TenantBinding, ...] = ()  # CNs bound to client namespaces (store and router)
    insecure: bool = False  # allow plaintext on a non-loopback host (logs a warning)
    # The cluster secret every UCX peer proves (docs/design.md §8); None = no handshake.
    peer_secret: PeerSecret | None = None
    # ranks may register any host memory the store can open, not only what the user
    # owning their socket may (for workers in another network namespace)
    host_memory_any: bool = False

    @property
    def security(self) -> Security:
        return Security(self.tls, self.admins, self.stores, self.store_nodes, self.tenants)

    def check_peer_exposure(self) -> None:
        """The UCX peer port without a secret is for loopback-only, plaintext use:
        with TLS or a non-loopback host it needs ``insecure`` (then a warning)."""
        if not self.transfer or self.peer_secret is not None:
            return
        loopback = is_loopback(self.host)
        if self.tls is None and loopback:
            return
        why = "TLS is configured" if loopback else f"--host {self.host} is not loopback"
        if not self.insecure:
            raise ValueError(
                f"{why} but the UCX peer port has no authentication: anyone who reaches it "
                "could read every block and serve forged ones. Give --peer-secret-file, "
                "or --no-transfer, or --insecure on a network you trust"
            )
        log.warning("UCX peer port without authentication (--insecure): %s", why)


def resolve_devices(device: str) -> list[str]:
    """``auto``: every GPU when present, else the host; ``cuda``: every GPU. Also
    cpu and cuda:N. ValueError names what is wrong with ``--device``."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        where = Device.parse(device)
    except ValueError:
        raise ValueError(f"--device {device!r}: expected auto, cpu, cuda or cuda:N") from None
    if where.is_host:
        return ["cpu"]
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is visible")
    if device == "cuda":
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if where.gpu >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} devices")
    return [str(where)]


class StoreServer:
    """One store server: start it, read ``.port``, stop it."""

    def __init__(self, config: ServerConfig, router: ServedRouter | None = None):
        """``router``: a router (with its feeds) to embed and serve on this server's port."""
        self.config = config
        self.embedded_router = router
        self.router = router.router if router is not None else None
        self.devices = resolve_devices(config.device)
        self.node_id = config.node_id or f"{socket.gethostname()}:{config.port}"
        pools = {d: SlotPool(config.pool_size, d, config.slab_bytes) for d in self.devices}
        self.registry = Registry(mapper=attach)
        self.index = BlockIndex(pools, on_event=self._on_event)
        self.peer_server: PeerServer | None = None
        if config.transfer and is_loopback(config.host):  # before UCX and NIXL's UCX start
            restrict_net_devices(LOOPBACK_DEVICE)  # bind what is advertised (§8)
        self.rma = rma_endpoint(pools) if config.transfer and config.rma else None
        fetcher = source = None
        self._reader: RmaReader | None = None
        if config.transfer:
            source = StoreSource(self.index)
            self.peer_server = PeerServer(
                source, config.host, config.ucx_port, secret=config.peer_secret, rma=self.rma
            )
            sink = StoreSink(self.index, self.registry)
            reader = self._reader = RmaReader(self.rma) if self.rma is not None else None
            fetcher = Fetcher(
                self.index,
                sink,
                self._find_peers,
                config.fetch_timeout_s,
                config.peer_secret,
                reader,
            )
        copiers = {d: copier_for(d) for d in self.devices}
        self.node = StoreNode(
            self.registry,
            self.index,
            copiers,
            fetcher,
            source,
            gpu_blocks=config.gpu_blocks,
            tenancy=Tenancy(config.tenants),
        )
        self.service = KVStoreService(
            self.node, self.peer_server, config.security, self.sealed, config.host_memory_any
        )
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._event_sinks = [self.service.publish]
        self._expirer: asyncio.Task | None = None
        self.link: LocalRouterLink | RemoteRouterLink | ClusterRouterLink | None = None
        self.metrics: MetricsServer | None = None
        if config.metrics_port is not None:
            self.metrics = MetricsServer(
                self._stats_records, config.host, config.metrics_port, config.tls
            )

    def _stats_records(self) -> dict[str, object]:
        """Every part's stats records, for /metrics; the Events fan-out's fields
        are the store's (``kvstore_store_events_dropped_total``)."""
        records: dict[str, object] = {"store": (self.node.stats(), self.service.fanout_stats())}
        if self.peer_server is not None:
            records["peer_port"] = self.peer_server.stats()
        if self.router is not None:
            records["router"] = self.router.stats()
        if isinstance(self.link, RemoteRouterLink):
            records["router_link"] = self.link.stats()
        return records

    def sealed(self) -> Sealed:
        """Every sealed block's key now (its events: ``.events()``, off the loop)."""
        return Sealed(self.index.snapshot(), self.node_id)

    def add_event_sink(self, sink) -> None:
        """Also hand every store event to ``sink`` (the embedded router)."""
        self._event_sinks.append(sink)

    def _on_event(self, event: StoreEvent) -> None:
        event.worker = self.node_id  # the index does not know which node it is
        for sink in self._event_sinks:
            sink(event)

    async def start(self) -> int:
        security = self.config.security
        security.check_exposure(self.config.host, self.config.insecure)
        self.config.check_peer_exposure()
        if self.peer_server is not None:  # first: Stats reports its address
            await self.peer_server.start()
            log.info(
                "peer transfer listening on %s (UCX; %s; %s)",
                self.peer_server.address,
                "one-sided NIXL reads on" if self.rma is not None else "two-sided only",
                "peers authenticated" if self.config.peer_secret else "no peer secret",
            )
        self.server = grpc.aio.server(options=[*SERVER_OPTIONS, *BIND_OPTIONS])
        add_to_server(self.service, self.server)  # a request that does not parse: INVALID_ARGUMENT
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.embedded_router is not None:
            # its admissions claim client namespaces with the store's ranks: one owner each
            self.embedded_router.start(self.server, security, NodeClaims(self.node.tenants))
        self.port = security.bind(self.server, host_port(self.config.host, self.config.port))
        if not self.config.node_id:
            self.node_id = f"{socket.gethostname()}:{self.port}"
        if self.metrics is not None:  # a taken port fails here, before the cluster hears of us
            await self.metrics.start()
        await self.server.start()
        if self.embedded_router is not None:
            await self.embedded_router.announce(host_port(self.config.host, self.port))
        await self._link_router()
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._expirer = asyncio.create_task(self._expire_loop())
        log.info(
            "kvstore store server listening on %s (devices %s, pool %s each)",
            host_port(self.config.host, self.port),
            ",".join(self.devices),
            format_size(self.config.pool_size),
        )
        return self.port

    async def _find_peers(self, namespace: str, hashes: list[int]) -> list[PeerPrefix]:
        """Peers for a fetch: the router's answer, else the --peer list."""
        peers = []
        if self.link is not None:
            try:
                peers = [
                    p for p in await self.link.query_prefix(namespace, hashes) if p.ucx_address
                ]
            except KVError as exc:  # an outage is logged once by the link, not per Load
                quiet = exc.code is Code.UNAVAILABLE
                (log.debug if quiet else log.warning)(
                    "router peer lookup failed (%s); trying the --peer list", exc
                )
            except Exception as exc:  # noqa: BLE001 -- any other router failure: fall back
                log.warning("router peer lookup failed (%s); trying the --peer list", exc)
        return peers or [PeerPrefix(a, "", a, 0) for a in self.config.peers]

    async def _link_router(self) -> None:
        if self.config.etcd is not None:
            self.link = ClusterRouterLink(
                self.config.etcd, self.node_id, self.router, self.config.tls
            )
        elif self.router is not None:
            self.link = LocalRouterLink(self.router, self.node_id)
        elif self.config.router_address:
            self.link = RemoteRouterLink(self.config.router_address, self.node_id, self.config.tls)
        if self.link is None:
            return
        await self.link.start(
            f"{self.config.host}:{self.port}",
            self.peer_server.address if self.peer_server is not None else "",
            self.sealed,
        )
        self.add_event_sink(self.link.publish)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_EVERY_S)
            try:
                self.node.expire()
            except Exception:
                log.exception("expiring leases and stale inflight blocks failed; next in 1 s")

    async def stop(self, grace: float = 2.0) -> None:
        if self._expirer:
            self._expirer.cancel()
            await asyncio.wait([self._expirer])  # it never holds a cancellation
        if self.metrics is not None:
            await self.metrics.stop()
        await self.health.enter_graceful_shutdown()
        self.service.end_streams()  # else the grace waits for every rank and subscriber
        if self.embedded_router is not None:
            self.embedded_router.end_sessions()
        if self.link is not None:
            await self.link.stop()
        if self.peer_server is not None:
            await self.peer_server.stop()
            await stop_ucx()
        if self._reader is not None:
            await self._reader.close()
        if self.rma is not None:
            self.rma.close()
            self.rma = None
        if self.server:
            await self.server.stop(grace)
        if self.embedded_router is not None:
            await self.embedded_router.close()
        log.info("kvstore store server stopped")


def rma_endpoint(pools: dict[str, SlotPool]) -> rma.RmaEndpoint | None:
    """The pool registered with NIXL for one-sided reads (docs/design.md §4), or
    None (logged why): NIXL missing or failing to register, or pools on several
    devices (one region per store is built: those fetch two-sided). A pool is
    one allocation: one region, host memory (DRAM) or one GPU's (VRAM)."""
    if len(pools) != 1:
        log.info("one-sided peer reads off: pools on %s (one pool only)", ",".join(pools))
        return None
    ok = rma.available()
    if not ok:
        log.info("one-sided peer reads off: %s", ok.reason)
        return None
    ((device, pool),) = pools.items()
    try:
        errors = (KVError, *rma.nixl_errors())
    except ImportError as exc:  # the package imports, its bindings do not
        log.warning("one-sided peer reads off: NIXL's bindings do not load: %s", exc)
        return None
    try:
        endpoint = rma.RmaEndpoint(rma.pool_region(device, pool.base, pool.pool_bytes))
    except errors as exc:  # e.g. a UCX without CUDA for VRAM
        log.warning(
            "one-sided peer reads off: NIXL could not register the %s pool: %s", device, exc
        )
        return None
    log.info("one-sided peer reads on: the %s pool registered with NIXL", device)
    return endpoint


async def stop_ucx() -> None:
    """Close pooled endpoints and UCX's notifier thread so the process can exit."""
    import ucxx

    from kvstore.transfer import close_endpoints
    from kvstore.transfer.ucx import stop_progress

    await close_endpoints()
    await stop_progress()  # before reset: it drops the context the progress holds
    try:
        ucxx.stop_notifier_thread()
        ucxx.reset()
    except Exception as exc:  # noqa: BLE001 -- still referenced somewhere: exit reclaims it
        log.warning("UCX did not shut down cleanly: %s", exc)


def stop_signal() -> asyncio.Event:
    """An event that SIGINT or SIGTERM sets from now on. Made before the server is
    built, a signal while a large pool is faulted in is acted on as soon as that
    ends (before, asyncio's own Ctrl-C handling lost it: the store went on serving)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def serve_until_signal(server: StoreServer, stop: asyncio.Event | None = None) -> None:
    """Run until SIGINT/SIGTERM (``stop``: from :func:`stop_signal`, made before
    ``server`` was built), then drain in-flight calls and exit."""
    stop = stop or stop_signal()
    await server.start()
    await stop.wait()
    log.info("signal received; shutting down")
    await server.stop()
