"""Prometheus ``/metrics`` for a store server or a router, read from stats records.

Nothing on a hot path is instrumented: on each scrape the collector asks the
core for its ``stats()`` records (the node, the block index, the pool, the
registry, the fetcher, the Events fan-out, the peer port; or the router) and
flattens their numeric fields into metrics named ``kvstore_<part>_<field>``
(a part may have several records; their fields share the part's name).
Fields that only grow are counters (``_total``), the rest gauges. The HTTP endpoint answers on
the server's own event loop, so a scrape reads the records between requests,
never in the middle of one.

With the server's TLS files (docs/design.md §8) the endpoint is HTTPS with the
server's own certificate and demands a client certificate signed by the same
CA (the scraper gets one like any other component); without them it is plain
HTTP on the server's ``--host``, loopback unless ``--insecure``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import ssl
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvstore.router.drops import DropCause
from kvstore.wire.tls import TlsFiles

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_REQUEST_BYTES = 8 << 10
READ_TIMEOUT_S = 5.0

# Fields that only grow over a server's life: exposed as counters.
COUNTERS = frozenset({
    "hits", "misses", "bytes_saved", "bytes_loaded", "evictions", "fetched_blocks",
    "fetches_failed_unavailable", "fetches_failed_timeout", "served_blocks",
    "refused_connections", "busy_refusals", "events_applied", "events_dropped",
    "blocks_ingested", "rejected_registrations", "load_reports", "hit_reports",
    "hit_blocks_predicted", "hit_blocks_reported", "worker_recreations",
    "resyncs_requested", "event_subscribers_cut", "auth_failures", "fetches_failed_auth",
    "fetches_rma", "fetches_failed_rma", "rma_leases", "rma_leases_expired",
    "events_refused", "batches_dropped",
    # RouterStats.dropped_by: one counter per drop cause
    *(cause.value for cause in DropCause),
})  # fmt: skip

Record = object  # a dataclass stats record
Reader = Callable[[], dict[str, Record | tuple[Record, ...]]]  # part name -> its record(s)


class RecordCollector:
    """A prometheus collector over the stats records ``read()`` returns."""

    def __init__(self, read: Reader):
        self.read = read

    def collect(self) -> Iterator[Metric]:
        for part, records in self.read().items():
            for name, leaf, value in flatten_all(records):
                full = f"kvstore_{part}_{name}"
                family = CounterMetricFamily if leaf in COUNTERS else GaugeMetricFamily
                metric = family(full, f"{part} {name.replace('_', ' ')}")
                metric.add_metric([], float(value))
                yield metric


def flatten_all(records: Record | tuple[Record, ...]) -> Iterator[tuple[str, str, float]]:
    """:func:`flatten` of one record, or of each of several."""
    for record in records if isinstance(records, tuple) else (records,):
        yield from flatten(record)


def flatten(record: Record, prefix: str = "") -> Iterator[tuple[str, str, float]]:
    """(joined name, field name, number) for every numeric field of a dataclass
    record, nested records' fields joined to their parent's name."""
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        name = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value):
            yield from flatten(value, f"{name}_")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield name, field.name, value


def server_context(tls: TlsFiles) -> ssl.SSLContext:
    """TLS for the metrics endpoint: the server's certificate, and a client
    certificate signed by ``tls.ca`` required (ValueError naming a bad file)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.verify_mode = ssl.CERT_REQUIRED
    for name, load in (
        ("tls_ca", lambda: context.load_verify_locations(cafile=tls.ca)),
        ("tls_cert", lambda: context.load_cert_chain(tls.cert, tls.key)),
    ):
        try:
            load()
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"{name} for /metrics: {exc}") from None
    return context


class MetricsServer:
    """``GET /metrics`` on ``host:port`` (port 0 picks a free one), on the running loop;
    HTTPS demanding a client certificate when ``tls`` is given."""

    def __init__(
        self,
        read: Reader,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: TlsFiles | None = None,
    ):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RecordCollector(read))
        self.host, self.port = host, port
        self.tls = tls
        self._server: asyncio.Server | None = None

    @property
    def scheme(self) -> str:
        return "http" if self.tls is None else "https"

    async def start(self) -> int:
        context = None if self.tls is None else server_context(self.tls)
        try:
            self._server = await asyncio.start_server(
                self._handle,
                self.host.strip("[]"),  # an IPv6 host as gRPC takes it, [::1]
                self.port,
                ssl=context,
                ssl_handshake_timeout=READ_TIMEOUT_S if context is not None else None,
            )
        except OSError as exc:  # a port in use: say it is the metrics port
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            msg = f"cannot serve /metrics on {self.host}:{self.port}: {why}"
            raise OSError(exc.errno, msg) from None
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("metrics on %s://%s:%d/metrics", self.scheme, self.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            status, body = self._answer(head)
            writer.write(
                f"HTTP/1.0 {status}\r\nContent-Type: {CONTENT_TYPE}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # a slow, short or oversized request gets no answer
        except OSError as exc:
            log.debug("metrics client went away: %s", exc)
        finally:
            writer.close()

    def _answer(self, head: bytes) -> tuple[str, bytes]:
        if len(head) > MAX_REQUEST_BYTES:
            return "431 Request Header Fields Too Large", b""
        line = head.split(b"\r\n", 1)[0].split()
        if len(line) < 2 or line[0] != b"GET":
            return "405 Method Not Allowed", b""
        if line[1].split(b"?", 1)[0] != b"/metrics":
            return "404 Not Found", b"try /metrics\n"
        return "200 OK", generate_latest(self.registry)
