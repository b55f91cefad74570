"""Event feeds into the router: vLLM ZMQ publishers and store Events streams.

* A worker whose card names ``kv_events_endpoint`` gets a ZMQ SUB socket
  bound to *its generation*: when the worker is replaced or removed the
  subscription ends, and anything it still delivers is dropped by the core
  (stale generation). Static endpoints given on the command line
  (``NAME=tcp://...``) are attributed to whichever generation of NAME is
  admitted when a batch arrives.
* A store server given by address is followed through its ``Events`` stream;
  its node id comes from the events themselves. When the stream ends the
  node's blocks are dropped (the store died or restarted), and the
  subscription reconnects with backoff.

Decoding errors are logged and counted, never fatal: a feed must not take
the router down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import zmq
import zmq.asyncio

from kvstore.router.admission import Worker, WorkerRef
from kvstore.router.core import Router
from kvstore.router.vllm_events import decode_message
from kvstore.wire.events import StoreEvent

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
    """
    ctx = ctx or zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.connect(endpoint)
    if ready is not None:
        ready.set()
    last_seq: int | None = None
    try:
        while True:
            frames = await sock.recv_multipart()
            try:
                batch = decode_message(frames)
            except ValueError as exc:
                router.events_dropped += 1
                log.warning("vLLM events from %s: %s", endpoint, exc)
                continue
            if last_seq is not None and batch.seq != last_seq + 1:
                log.info("vLLM events from %s: seq jumped %d -> %d", endpoint, last_seq, batch.seq)
            last_seq = batch.seq
            target = ref
            if target is None:
                worker = router.admission.workers.get(name)
                target = worker.ref if worker is not None else WorkerRef(name, 0)
            router.apply_vllm_batch(target, batch)
    finally:
        sock.close(0)


async def follow_store(router: Router, address: str, retry_s: float = 1.0) -> None:
    """Follow one store server's Events stream until cancelled; reconnect on failure."""
    from kvstore._proto import store_pb2, store_pb2_grpc

    while True:
        bound: tuple[str, int] | None = None  # (node id, peer generation) this stream feeds
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = store_pb2_grpc.KVStoreStub(channel)
                async for message in stub.Events(store_pb2.EventsRequest()):
                    try:
                        event = StoreEvent.decode(message.payload)
                    except ValueError as exc:
                        router.events_dropped += 1
                        log.warning("store events from %s: %s", address, exc)
                        continue
                    if event.tier == "gpu":  # relayed for a worker: no peer needed
                        router.apply_relayed_worker_event(event)
                        continue
                    if bound is None:
                        peer = router.peers.peers.get(event.worker)
                        if peer is None:
                            peer = router.advertise_peer(event.worker, address, "", [])
                        bound = (peer.node_id, peer.generation)
                    router.apply_store_events(*bound, [event])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # network errors: log, drop the node, retry
            log.warning("store events from %s ended: %s", address, exc)
        if bound is not None:
            router.remove_peer(*bound)
        await asyncio.sleep(retry_s)


class Subscriptions:
    """Starts and stops per-worker vLLM subscriptions as workers come and go.

    Register with ``router.add_listener(subs.on_worker_change)``; the router
    may call it from any thread, tasks are created on ``loop``.
    """

    def __init__(self, router: Router, loop: asyncio.AbstractEventLoop):
        self.router = router
        self.loop = loop
        self.tasks: dict[WorkerRef, asyncio.Task] = {}
        self.static: list[asyncio.Task] = []

    def on_worker_change(self, admitted: Worker | None, removed: Worker | None) -> None:
        if not self.loop.is_closed():  # after shutdown the core may still be used directly
            self.loop.call_soon_threadsafe(self._apply, admitted, removed)

    def _apply(self, admitted: Worker | None, removed: Worker | None) -> None:
        if removed is not None:
            task = self.tasks.pop(removed.ref, None)
            if task is not None:
                task.cancel()
        if admitted is not None and admitted.card.kv_events_endpoint:
            self.tasks[admitted.ref] = self.loop.create_task(
                follow_vllm(self.router, admitted.card.kv_events_endpoint, ref=admitted.ref)
            )

    def add_static(self, spec: str) -> None:
        """``NAME=ENDPOINT``: a publisher whose events belong to worker NAME."""
        name, sep, endpoint = spec.partition("=")
        if not sep or not name or not endpoint:
            raise ValueError(f"--zmq-endpoint {spec!r}: expected NAME=tcp://host:port")
        self.static.append(self.loop.create_task(follow_vllm(self.router, endpoint, name=name)))

    def add_store(self, address: str) -> None:
        self.static.append(self.loop.create_task(follow_store(self.router, address)))

    async def close(self) -> None:
        tasks = [*self.tasks.values(), *self.static]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.tasks.clear()
        self.static.clear()
