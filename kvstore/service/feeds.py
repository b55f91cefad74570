"""Event feeds into the router: vLLM ZMQ publishers and store Events streams.

* A worker whose card names ``kv_events_endpoint`` gets a ZMQ SUB socket
  bound to *its generation* (the core admitted the card only if the router's
  ``--events-allow`` list allows that endpoint, ``kvstore.router.endpoints``;
  static ``--zmq-endpoint`` feeds are the operator's own and not checked
  against it): when the worker is replaced or removed the
  subscription ends, and anything it still delivers is dropped by the core
  (stale generation). Static endpoints given on the command line
  (``NAME=tcp://...``) are attributed to whichever generation of NAME is
  admitted when a batch arrives.
* A store server given by address is followed through its ``Events`` stream;
  its node id comes from the events themselves. The stream opens with a
  snapshot of the store's sealed blocks (its first event replaces whatever the
  router held for the node), then numbers every event (docs/design.md §6).
  When the stream ends the node's blocks are dropped (the store died or
  restarted, or cut us off for falling behind), and the subscription
  reconnects with backoff, logging the outage once, not every try
  (``kvstore.service.outage``); a gap in the numbers ends it at once and it
  resubscribes without waiting.

Decoding errors and the events a gap lost are logged and counted by cause,
never fatal: a feed must not take the router down. Feeds change router state
only through its public methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from kvstore._proto import store_pb2, store_pb2_grpc
from kvstore.client.tls import open_aio_channel
from kvstore.router.admission import Worker, WorkerRef
from kvstore.router.core import Router
from kvstore.router.drops import DropCause
from kvstore.router.vllm_events import decode_message
from kvstore.service.outage import FIRST_RETRY_S, Outage, grpc_reason
from kvstore.wire import limits
from kvstore.wire.errors import KVError
from kvstore.wire.events import GPU_TIER, StoreEvent
from kvstore.wire.tls import TlsFiles

# vLLM batches a subscriber's ZMQ queue holds before its publisher drops more
# (the default, 1,000 three-frame messages of up to MAX_EVENT_BYTES, is GiBs)
EVENT_QUEUE_MESSAGES = 128

log = logging.getLogger(__name__)


async def follow_vllm(
    router: Router,
    endpoint: str,
    ref: WorkerRef | None = None,
    name: str = "",
    topic: bytes = b"",
    ctx: zmq.asyncio.Context | None = None,
    ready: asyncio.Event | None = None,
) -> None:
    """Subscribe to one vLLM publisher until cancelled.

    With ``ref`` the events belong to that generation only; with ``name``
    they belong to the current generation of that worker name.

    A frame longer than MAX_EVENT_BYTES is refused by ZMQ as it arrives (never
    held whole in memory), which drops the connection; ZMQ does not reconnect
    after that, so every disconnection is answered with a fresh connect.
    """
    ctx = ctx or zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.MAX_EVENT_BYTES)
    sock.setsockopt(zmq.RCVHWM, EVENT_QUEUE_MESSAGES)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(endpoint)
    if ready is not None:
        ready.set()
    poller = zmq.asyncio.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    last_seq: int | None = None
    try:
        while True:
            readable = dict(await poller.poll())
            if monitor in readable:
                await _reconnect(sock, monitor, endpoint)
            if sock not in readable:
                continue
            frames = await sock.recv_multipart()
            try:
                batch = decode_message(frames)
            except ValueError as exc:
                router.record_dropped()
                log.warning("vLLM events from %s: %s", endpoint, exc)
                continue
            if last_seq is not None and batch.seq != last_seq + 1:
                lost = batch.seq - last_seq - 1 if batch.seq > last_seq else 1
                log.warning(
                    "vLLM events from %s: batch %d follows %d (%s); the worker's blocks "
                    "are forgotten until its events tell them again",
                    endpoint,
                    batch.seq,
                    last_seq,
                    f"{lost} lost" if batch.seq > last_seq else "the publisher started again",
                )
                router.vllm_batches_lost(ref if ref is not None else name, lost)
            last_seq = batch.seq
            try:
                if ref is not None:
                    router.apply_vllm_batch(ref, batch)
                else:
                    router.apply_named_vllm_batch(name, batch)
            except KVError as exc:  # a full domain index: this batch goes, the feed stays
                router.record_dropped(batch.events, DropCause.NO_ROOM)
                log.warning("vLLM events from %s: batch %d dropped: %s", endpoint, batch.seq, exc)
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


async def _reconnect(sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket, endpoint: str) -> None:
    """The publisher's connection dropped (it went away, or sent a frame over the
    bound): connect afresh, which ZMQ retries until the publisher is back."""
    await monitor.recv_multipart()  # the event: any one means the connection is gone
    log.warning(
        "vLLM events from %s: disconnected (the publisher stopped, or sent a frame over "
        "%d bytes); reconnecting",
        endpoint,
        limits.MAX_EVENT_BYTES,
    )
    with contextlib.suppress(zmq.ZMQError):  # no longer connected: nothing to undo
        sock.disconnect(endpoint)
    sock.connect(endpoint)


async def follow_store(
    router: Router,
    address: str,
    tls: TlsFiles | None = None,
    retry_s: float = FIRST_RETRY_S,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Follow one store server's Events stream until cancelled; reconnect on failure.
    (With TLS the store must list this router's CN as ``--admin`` to show it
    every namespace's events.) A store that is down is logged once, when lost
    (then a reminder every few minutes), and once when its stream opens again;
    it is retried after ``retry_s``, doubling (``kvstore.service.outage``)."""
    outage = Outage(
        log,
        f"store events from {address}",
        "its blocks are forgotten until it is back; retrying with backoff",
        first_s=retry_s,
        clock=clock,
    )
    while True:
        bound: list[tuple[str, int]] = []  # the (node id, peer generation) this stream feeds
        reason = "the stream ended"
        try:
            await _follow_store_once(router, address, bound, tls, outage.recovered)
        except asyncio.CancelledError:
            raise
        except StreamGap as exc:  # resubscribe at once: the new stream opens with a snapshot
            log.warning("store events from %s: %s; resubscribing", address, exc)
            reason = ""
        except Exception as exc:  # noqa: BLE001 -- any stream failure: drop the node, retry
            reason = grpc_reason(exc)
        for node_id, generation in bound:
            router.remove_peer(node_id, generation)
        if reason:
            outage.failed(reason)
            await asyncio.sleep(outage.delay())


class StreamGap(Exception):
    """An Events stream skipped numbers: events were lost."""


def out_of_sequence(seq: int, expected: int) -> tuple[int, DropCause]:
    """What an Events stream's message numbered ``seq`` in place of ``expected``
    costs (the stream is dropped with it): the numbers skipped and itself, or,
    numbered backwards, itself."""
    if seq < expected:
        return 1, DropCause.STALE_SEQUENCE
    return seq - expected + 1, DropCause.SEQUENCE_GAP


async def _follow_store_once(
    router: Router,
    address: str,
    bound: list[tuple[str, int]],
    tls: TlsFiles | None,
    opened_stream: Callable[[], None],
) -> None:
    """One Events stream; ``bound`` gets the peer it feeds once its node id is
    known; ``opened_stream`` is called once the store has answered (its headers
    or, from a store that sends none first, its first event)."""
    expected = 1  # the next number in this stream (a store that numbers nothing sends 0)
    opened = False  # the snapshot's first event has replaced the node's blocks
    async with open_aio_channel(address, tls) as channel:
        stub = store_pb2_grpc.KVStoreStub(channel)
        call = stub.Events(store_pb2.EventsRequest())
        await call.initial_metadata()
        if not call.done():  # a failed call has none either: it raises below
            opened_stream()
        async for message in call:
            opened_stream()
            if message.seq and message.seq != expected:
                router.record_dropped(*out_of_sequence(message.seq, expected))
                raise StreamGap(f"event {expected} is missing (got {message.seq})")
            expected += 1
            try:
                event = StoreEvent.decode(message.payload)
            except ValueError as exc:
                router.record_dropped()
                log.warning("store events from %s: %s", address, exc)
                continue
            if event.tier == GPU_TIER:  # relayed for a worker: no peer needed
                router.apply_relayed_worker_event(event)
                continue
            if not bound:
                peer = router.ensure_peer(event.worker, address)
                bound.append((peer.node_id, peer.generation))
            replaces = message.snapshot and not opened
            opened = opened or message.snapshot
            router.apply_store_events(*bound[0], [event], snapshot=replaces)


class Subscriptions:
    """A router's running feeds, as tasks on one event loop.

    Per-worker vLLM subscriptions follow admissions: :meth:`start` registers
    a router listener, which the router may call from any thread; tasks are
    created on ``loop``. Static vLLM endpoints and store streams are added
    with :meth:`add_vllm` and :meth:`add_store`. :meth:`close` ends them all.
    """

    def __init__(
        self, router: Router, loop: asyncio.AbstractEventLoop, tls: TlsFiles | None = None
    ):
        """``tls``: credentials for the store Events streams (plaintext when None)."""
        self.router = router
        self.loop = loop
        self.tls = tls
        self.tasks: dict[WorkerRef, asyncio.Task] = {}
        self.static: list[asyncio.Task] = []

    def start(self) -> None:
        self.router.add_listener(self.on_worker_change)

    def on_worker_change(self, admitted: Worker | None, removed: Worker | None) -> None:
        if not self.loop.is_closed():  # after shutdown the core may still be used directly
            self.loop.call_soon_threadsafe(self._apply, admitted, removed)

    def _apply(self, admitted: Worker | None, removed: Worker | None) -> None:
        if removed is not None:
            task = self.tasks.pop(removed.ref, None)
            if task is not None:
                task.cancel()
        if admitted is not None and admitted.card.kv_events_endpoint:
            endpoint = admitted.card.kv_events_endpoint
            self.tasks[admitted.ref] = self._start(
                follow_vllm(self.router, endpoint, ref=admitted.ref), f"vLLM events {endpoint}"
            )

    def add_vllm(self, name: str, endpoint: str) -> None:
        """A vLLM publisher whose events belong to whichever generation of ``name`` is admitted."""
        self.static.append(
            self._start(follow_vllm(self.router, endpoint, name=name), f"vLLM events {endpoint}")
        )

    def add_store(self, address: str) -> None:
        feed = follow_store(self.router, address, tls=self.tls)
        self.static.append(self._start(feed, f"store events {address}"))

    def _start(self, feed, what: str) -> asyncio.Task:
        """A feed's task; one that ends by an error says so (it is never awaited before
        shutdown, so asyncio would not)."""
        task = self.loop.create_task(feed)
        task.add_done_callback(functools.partial(_ended, what))
        return task

    async def close(self) -> None:
        self.router.remove_listener(self.on_worker_change)
        tasks = [*self.tasks.values(), *self.static]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.tasks.clear()
        self.static.clear()


def _ended(what: str, task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s: the feed stopped: %r", what, task.exception())
