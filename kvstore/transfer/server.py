"""The serving side: a UCX listener that answers fetches from a SlotSource."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.transfer.errors import ProtocolError, VersionMismatch
from kvstore.transfer.handshake import PeerSecret, authenticate_fetcher
from kvstore.transfer.rma import Region, RmaEndpoint, inside
from kvstore.transfer.slots import (
    Lease,
    SlotSource,
    SlotTable,
    choose_lanes,
    run_starts,
    segment_bounds,
    transfer_order,
)
from kvstore.transfer.ucx import (
    ABORT_GRACE_S,
    DATA_TAG_BASE,
    SEND_WINDOW,
    Conn,
    frame_sends,
    is_ucx_error,
    loop_progress,
    pump,
    recv_frame,
    remote_address,
    run_ops,
    segment_views,
    send_frame,
    started,
    ucxx_module,
    when_settled,
    worker_health,
)
from kvstore.transfer.wire import (
    MAX_SLOT_BYTES,
    MAX_SLOTS_PER_BLOCK,
    MAX_SLOTS_PER_FETCH,
    PROTOCOL_VERSION,
    FetchRequest,
    Grant,
    Kind,
    decode_go,
    decode_release,
    decode_request,
    decode_run_starts,
    encode_card,
    encode_error,
    encode_layouts,
    encode_offer,
)
from kvstore.wire.errors import Code, KVError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PortLimits:
    """What one UCX peer port gives any caller; every resource a caller can make
    it hold is bounded in size and in time, before and after the handshake.

    ``go_timeout_s`` is how long a lease waits for the fetcher's GO: shorter
    than a client's query lease, so a REQUEST without GO pins blocks briefly.
    With a cluster secret, a connection must finish the handshake within
    ``handshake_s``; it pins nothing until it has. A connection must send its
    first REQUEST within ``first_request_s`` and each later one within
    ``idle_s``, else it is closed. A one-sided read's lease (no GO: the
    fetcher reads while the blocks are pinned) lasts until its RELEASE or
    ``rma_lease_s``: a connection that closes first does not end it, since the
    fetcher's read, on another transport, may still be landing.
    """

    max_connections: int = 256  # each costs UCX endpoint descriptors
    max_pinned_blocks: int = 16384  # over every connection's lease at once
    go_timeout_s: float = 2.0
    first_request_s: float = 5.0
    idle_s: float = 60.0
    handshake_s: float = 5.0
    rma_lease_s: float = 15.0


@dataclass(frozen=True)
class PortStats:
    connections: int
    pinned_blocks: int
    refused_connections: int
    busy_refusals: int
    auth_failures: int  # connections closed for a failed or missing handshake
    rma_leases: int = 0  # one-sided leases granted
    rma_leases_expired: int = 0  # of those, released by expiry or close, not RELEASE


class PeerServer:
    """UCX listener on a store server that serves fetch requests from a SlotSource.

    One connection serves its fetches one after another; a fetcher that wants
    parallelism opens more endpoints. ``timeout_s`` bounds a whole fetch (GO,
    then every slot send); ``limits`` bound what callers can hold (PortLimits).
    With ``secret``, a connection is served only once it has proven the cluster
    secret, and has seen this server prove it (kvstore.transfer.handshake).
    """

    def __init__(
        self,
        source: SlotSource,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        timeout_s: float = 30.0,
        send_window: int = SEND_WINDOW,
        limits: PortLimits | None = None,
        secret: PeerSecret | None = None,
        rma: RmaEndpoint | None = None,
    ):
        """``rma``: the endpoint whose region holds the source's slots; with it,
        authenticated fetchers get its card and may read leased slots one-sided."""
        self.source = source
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self.send_window = send_window
        self.limits = limits or PortLimits()
        self.secret = secret
        self._listener: Any = None
        self._started = False
        self._conns: set[Conn] = set()
        self._handlers: set[asyncio.Task] = set()
        self._pinned = 0
        self._refused_connections = 0
        self._busy_refusals = 0
        self._auth_failures = 0
        self.rma = rma
        self._card = rma.card().encode() if rma is not None else b""
        self._lease_ids = itertools.count(int.from_bytes(os.urandom(4), "little") << 16)
        self._rma_held = 0  # one-sided leases held now: the progress loop runs while > 0
        self._rma_granted = 0
        self._rma_expired = 0
        self._progress: asyncio.Task | None = None
        # leases kept past their connection's close, until their end: by a key of each
        self._kept: dict[int, tuple[asyncio.TimerHandle, Lease, int]] = {}
        self._kept_ids = itertools.count()

    @property
    def address(self) -> str:
        """``host:port`` to advertise to the router (it stays the same across a
        worker recreation, during which the port briefly does not listen)."""
        if not self._started:
            raise RuntimeError("PeerServer is not started")
        return f"{self.host}:{self.port}"

    def stats(self) -> PortStats:
        return PortStats(
            len(self._conns),
            self._pinned,
            self._refused_connections,
            self._busy_refusals,
            self._auth_failures,
            self._rma_granted,
            self._rma_expired,
        )

    async def start(self) -> None:
        ucxx = ucxx_module()
        loop_progress()  # kvstore's, not ucxx's
        try:
            self._listener = ucxx.create_listener(self._on_connect, port=self.port)
        except Exception as exc:
            if not is_ucx_error(exc):
                raise
            raise OSError(f"cannot listen for UCX peers on port {self.port}: {exc}") from exc
        self.port = self._listener.port
        self._started = True
        worker_health().add_listener(self)

    async def stop(self) -> None:
        """Stop listening, cut every connection, and wait for leases to be released;
        those kept past their connection's close end now (the port is going away,
        its memory with it: no Save comes to reuse their slots)."""
        worker_health().remove_listener(self)
        await self.suspend()
        for key in list(self._kept):
            self._end_kept(key)
        if self._progress is not None:
            self._progress.cancel()
        self._started = False

    async def suspend(self) -> None:
        """Stop listening and cut every connection (stop, or a worker recreation)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        for conn in list(self._conns):
            conn.abort()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=ABORT_GRACE_S)

    async def resume(self, attempts: int = 10, every_s: float = 0.5) -> None:
        """Listen again on the same port, on the fresh worker (retrying while the
        port is still taken)."""
        for attempt in range(attempts):
            if not self._started or self._listener is not None:
                return
            try:
                loop_progress()  # the fresh worker's
                self._listener = ucxx_module().create_listener(self._on_connect, port=self.port)
                return
            except Exception as exc:
                if attempt == attempts - 1 or not is_ucx_error(exc):
                    raise
                await asyncio.sleep(every_s)

    async def _on_connect(self, ep: Any) -> None:
        conn = Conn(ep, peer="fetcher")
        if len(self._conns) >= self.limits.max_connections:
            self._refused_connections += 1
            if self._refused_connections & (self._refused_connections - 1) == 0:  # 1, 2, 4, ...
                log.warning(
                    "peer port full (%d connections): refused %d so far",
                    len(self._conns),
                    self._refused_connections,
                )
            conn.abort()
            return
        task = asyncio.current_task()
        self._conns.add(conn)
        if task is not None:
            self._handlers.add(task)
        try:
            await self._serve_connection(conn)
        except (KVError, ProtocolError) as e:
            log.debug("connection from a fetcher ended: %s", e)
        except Exception:
            log.exception("peer transfer connection failed")
        finally:
            conn.abort()
            self._conns.discard(conn)
            if task is not None:
                self._handlers.discard(task)

    async def _serve_connection(self, conn: Conn) -> None:
        """The handshake, then REQUESTs one after another, each within its idle deadline."""
        if not await self._authenticate(conn):
            return
        wait_s = self.limits.first_request_s
        while conn.usable:
            deadline = asyncio.get_running_loop().time() + wait_s
            try:
                kind, _, body = await recv_frame(conn, [Kind.REQUEST, Kind.CARD_REQUEST], deadline)
            except VersionMismatch as e:  # say which version this peer speaks, then close
                message = f"{e} (this peer speaks protocol {PROTOCOL_VERSION})"
                await self._refuse(conn, Code.FAILED_PRECONDITION, message, deadline)
                raise
            if kind is Kind.CARD_REQUEST:  # only here: after the handshake, to this connection
                await send_frame(conn, Kind.CARD, deadline, body=encode_card(self._card))
            else:
                await self._serve(conn, body)
            wait_s = self.limits.idle_s

    async def _authenticate(self, conn: Conn) -> bool:
        """Whether the fetcher proved the cluster secret within ``handshake_s`` (True
        without a secret). A failure is counted and logged with the fetcher's
        address (each of the first 8, then the 16th, 32nd, ...); the caller closes."""
        if self.secret is None:
            return True
        deadline = asyncio.get_running_loop().time() + self.limits.handshake_s
        fetcher = remote_address(conn.ep)  # now: a failed handshake aborts the endpoint
        try:
            await authenticate_fetcher(conn, self.secret, deadline)
            return True
        except (KVError, ProtocolError) as e:
            self._auth_failures += 1
            n = self._auth_failures
            if n <= 8 or n & (n - 1) == 0:
                log.warning(
                    "peer port: connection from %s failed authentication (%s); %d so far",
                    fetcher,
                    e,
                    n,
                )
            return False

    async def _serve(self, conn: Conn, body: bytes) -> None:
        """One fetch: refuse, or lease, offer, await GO, send, release (or, one-sided:
        lease, grant, await RELEASE)."""
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        try:
            request = decode_request(body)
            namespace, hashes = request.namespace, request.hashes
        except ProtocolError as e:
            await self._refuse(conn, Code.INVALID_ARGUMENT, str(e), deadline)
            return
        room = self.limits.max_pinned_blocks - self._pinned
        if room <= 0:
            self._busy_refusals += 1
            await self._refuse(conn, Code.RESOURCE_EXHAUSTED, "peer busy: try another", deadline)
            return
        lease = await self._lease(conn, namespace, hashes[:room], deadline)
        if lease is None:
            return
        held = len(lease.hashes)
        self._pinned += held
        granted = _Granted()
        try:
            await self._send_lease(conn, lease, request, deadline, granted)
        finally:
            when_settled(conn, functools.partial(self._release, lease, held, granted))

    async def _lease(
        self, conn: Conn, namespace: str, hashes: list[int], deadline: float
    ) -> Lease | None:
        """The source's lease of the longest sealed prefix, or None once answered."""
        try:
            lease = self.source.lease(namespace, hashes)
        except KVError as e:
            await self._refuse(conn, e.code, e.message, deadline)
            return None
        except Exception as e:
            log.exception("SlotSource.lease failed")
            await self._refuse(conn, Code.INTERNAL, f"lease failed: {e}", deadline)
            return None
        if lease is None:
            await send_frame(conn, Kind.REPLY, deadline, body=encode_offer([]))
        return lease

    def _release(self, lease: Lease, held: int, granted: _Granted) -> None:
        """Unpin now, or, while a one-sided read of the lease may still be landing
        (granted, never RELEASEd: the connection closed under it, the RELEASE was
        wrong or never came), when the lease ends: the fetcher reads only until
        then, and a slot reused before would reach it torn."""
        loop = asyncio.get_running_loop()
        wait = granted.until - loop.time()
        if wait <= 0:
            self._unpin(lease, held)
            return
        self._hold_rma()  # the read may need this side's NIXL progress to land
        key = next(self._kept_ids)
        self._kept[key] = (loop.call_later(wait, self._end_kept, key), lease, held)

    def _end_kept(self, key: int) -> None:
        handle, lease, held = self._kept.pop(key)
        handle.cancel()  # a no-op when it is what runs this
        self._unpin(lease, held, rma_held=True)

    def _unpin(self, lease: Lease, held: int, rma_held: bool = False) -> None:
        self._pinned -= held
        self._rma_held -= rma_held
        lease.release()

    def _hold_rma(self) -> None:
        """One more one-sided lease held: progress NIXL while any is."""
        self._rma_held += 1
        if self._progress is None or self._progress.done():
            self._progress = asyncio.ensure_future(self._progress_rma())

    async def _send_lease(
        self, conn: Conn, lease: Lease, request: FetchRequest, deadline: float, granted: _Granted
    ) -> None:
        try:
            table = _offerable(lease, request.hashes)
        except (KVError, ValueError) as e:
            log.error("SlotSource returned a bad lease: %s", e)
            await self._refuse(conn, Code.INTERNAL, f"bad lease: {e}", deadline)
            return
        layouts, block_layout = table.layouts()
        lanes = choose_lanes(table)
        if request.rma and table.num_blocks and self._readable(table):
            offer = functools.partial(encode_layouts, layouts, block_layout, (), lanes)
            await self._grant(conn, table, offer, granted)
            return
        order = transfer_order(table.counts.tolist(), lanes)
        ptr, size, memory = table.take(order)
        mine = run_starts(ptr, size, memory)
        offer = encode_layouts(layouts, block_layout, mine, lanes)
        if not table.num_blocks:
            await send_frame(conn, Kind.REPLY, deadline, body=offer)
            return
        go_deadline = min(deadline, asyncio.get_running_loop().time() + self.limits.go_timeout_s)
        _, _, body = await recv_frame(
            conn, [Kind.GO], go_deadline, after=frame_sends(conn, Kind.REPLY, offer)
        )
        accepted, packed = decode_go(body, table.num_blocks)
        if accepted:  # GO accepts all that was offered, or nothing
            theirs = decode_run_starts(packed, len(order))
            bounds = segment_bounds(len(order), mine, theirs)
            views = segment_views(ptr, size, memory, bounds, writable=False, owner=table.owner)
            await self._send_slots(conn, views, deadline)

    def _readable(self, table: SlotTable) -> bool:
        """Whether every slot lies in the registered region (else: two-sided)."""
        return self.rma is not None and readable(table, self.rma.region)

    async def _grant(self, conn: Conn, table: SlotTable, offer: Any, granted: _Granted) -> None:
        """A one-sided read: REPLY with the grant, then wait for the fetcher's
        RELEASE (returns), its connection's close or ``rma_lease_s`` (raises).
        ``granted.until`` says until when a read may land: the lease's end, from
        before the grant goes out until its RELEASE comes (then 0), so a caller
        that hears of no RELEASE keeps the lease that long. A RELEASE naming
        another lease closes the connection. ``offer(grant=...)`` encodes the REPLY."""
        lease_s = self.limits.rma_lease_s
        grant = Grant(next(self._lease_ids) & ((1 << 64) - 1), lease_s, table.ptr)
        expiry = granted.until = asyncio.get_running_loop().time() + lease_s
        # The REPLY's send is posted first: the progress loop's first turn waits.
        body = offer(grant=grant)
        reply = started(frame_sends(conn, Kind.REPLY, body))
        self._rma_granted += 1
        self._hold_rma()
        released = False
        try:
            _, _, body = await recv_frame(conn, [Kind.RELEASE], expiry, after=reply)
            released = decode_release(body) == grant.lease_id
        finally:
            self._rma_held -= 1
            self._rma_expired += not released
        if not released:
            raise ProtocolError(f"RELEASE names another lease than {grant.lease_id}")
        granted.until = 0.0

    async def _progress_rma(self) -> None:
        """Progress the NIXL endpoint every millisecond while a one-sided lease is
        held: a fetcher's first read connects through it (docs/design.md §4)."""
        failing = False
        while self._rma_held > 0 and self.rma is not None:
            try:
                notices = self.rma.progress()
            except self.rma.errors as e:  # the loop goes on: reads over tcp wait for it
                if not failing:
                    log.warning("rma: progressing NIXL failed (%s); retrying every 1 ms", e)
                failing, notices = True, []
            else:
                failing = False
            for notice in notices:
                log.debug("rma notice from %s ignored", notice.peer)
            await asyncio.sleep(1e-3)

    async def _send_slots(
        self, conn: Conn, views: list[Any], deadline: float, first: int = 0
    ) -> None:
        """Send segments ``first``, ``first + 1``, ... each on its own tag."""

        async def send(i: int, view: Any) -> None:
            await conn.ep.send(view, tag=DATA_TAG_BASE + first + i)

        await run_ops(conn, pump(send, views, self.send_window), deadline, "sending slots")

    async def _refuse(self, conn: Conn, code: Code, message: str, deadline: float) -> None:
        await send_frame(conn, Kind.ERROR, deadline, body=encode_error(code, message))


@dataclass
class _Granted:
    """Until when a one-sided read of one fetch's lease may land (loop time; 0:
    none was granted, or its RELEASE came)."""

    until: float = 0.0


def _offerable(lease: Lease, hashes: list[int]) -> SlotTable:
    """The leased prefix's slots, trimmed to the per-fetch bounds."""
    table, n = lease.slots, len(lease.hashes)
    if n > len(hashes) or list(lease.hashes) != hashes[:n] or table.num_blocks != n:
        raise ValueError("lease is not a prefix of the request")
    counts = table.counts
    if n and not (  # three reductions when every block fits (the rule)
        int(counts.min()) > 0
        and int(counts.max()) <= MAX_SLOTS_PER_BLOCK
        and int(counts.sum()) <= MAX_SLOTS_PER_FETCH
    ):
        fits = (
            (counts > 0)
            & (counts <= MAX_SLOTS_PER_BLOCK)
            & (np.cumsum(counts) <= MAX_SLOTS_PER_FETCH)
        )
        if not bool(fits.all()):
            table = table.prefix(int(np.argmin(fits)))
    if len(table.nbytes) and not (
        int(table.nbytes.min()) > 0 and int(table.nbytes.max()) <= MAX_SLOT_BYTES
    ):
        raise ValueError("slot size out of bounds")
    return table


def readable(table: SlotTable, region: Region) -> bool:
    """Whether every slot of ``table`` lies in ``region`` and in its memory: host
    memory (memory key 0) for DRAM, the one GPU allocation the region is (its
    base is the slots' memory key) for VRAM."""
    key = 0 if region.mem == "DRAM" else region.addr
    if not bool((table.memory == key).all()):
        return False
    return inside(table.ptr, table.nbytes.astype(np.uint64), region)
