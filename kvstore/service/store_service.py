"""The KVStore gRPC handlers: decode, make one call to the node, encode.

A core refusal (:class:`KVError`) ends the call through :meth:`_call`, the
one place it is mapped to a gRPC status, so every refusal reaches the client
with its precise code and message.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import grpc

from kvstore._proto import store_pb2 as pb
from kvstore._proto import store_pb2_grpc as pb_grpc
from kvstore.service import malformed, status
from kvstore.service import store_codec as codec
from kvstore.service.peer_cred import peer_uid
from kvstore.service.sealed import NOTHING, Snapshot, events_of
from kvstore.service.tls import PLAINTEXT, Security
from kvstore.store.local_user import CallerUser
from kvstore.store.node import StoreNode, check_wait_ms
from kvstore.store.registry import Instance
from kvstore.transfer import PeerServer
from kvstore.wire import limits
from kvstore.wire.errors import KVError, exhausted, unavailable
from kvstore.wire.events import StoreEvent
from kvstore.wire.principal import Principal, check_quota, owned_by

log = logging.getLogger(__name__)
EVENT_QUEUE_MAX = 65536


class KVStoreService(pb_grpc.KVStoreServicer):
    def __init__(
        self,
        node: StoreNode,
        peer_server: PeerServer | None = None,
        security: Security = PLAINTEXT,
        snapshot: Snapshot = lambda: NOTHING,
        host_memory_any: bool = False,
    ):
        """``peer_server``: the node's peer-transfer listener, None when transfer is off.
        ``security``: who callers are (their certificate CN with TLS); the node
        decides what each may see and do (tenant scoping). ``snapshot``: the
        sealed blocks' keys of this node, which open every Events stream as
        ``stored`` events. ``host_memory_any``: a rank may register any host
        memory the store can open (``--host-memory any``); else only what the
        user owning the caller's socket may open itself."""
        self.node = node
        self.host_memory_any = host_memory_any
        self.snapshot = snapshot
        self.event_queue_max = EVENT_QUEUE_MAX  # events a subscriber may fall behind
        self._fanout = FanoutStats()
        self.peer_server = peer_server
        self.security = security
        self._watchers: dict[str, asyncio.Queue] = {}  # session -> updates
        self._subscribers: dict[asyncio.Queue, Principal] = {}  # queue -> who watches
        # every Events stream open, cut or not (a cut one lives until its client reads)
        self._streams: dict[asyncio.Queue, str] = {}  # queue -> its caller's name
        self._seal_waiters: set[asyncio.Event] = set()  # GetInstance calls waiting
        self._stopping = False  # the server is stopping: long streams end (end_streams)
        node.watch(self._instance_changed)

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable, *args: Any) -> Any:
        """``fn(*args)``, awaited if it is a coroutine; a KVError aborts the call."""
        try:
            result = fn(*args)
            return await result if inspect.isawaitable(result) else result
        except KVError as err:
            await status.abort(context, err)

    async def _caller(self, context: grpc.aio.ServicerContext) -> Principal:
        return await self._call(context, self.security.principal, context)

    def end_streams(self) -> None:
        """The server is stopping: end every registration and Events stream now,
        UNAVAILABLE, so that its grace period waits for none of them (ranks
        register and routers subscribe again once a server answers); one opened
        from now on ends at once."""
        self._stopping = True
        for queue in self._watchers.values():
            queue.put_nowait(STOPPING)
        for queue in self._subscribers:
            _cut(queue)  # wakes its handler, which sees _stopping

    async def _end_if_stopping(self, context: grpc.aio.ServicerContext, stream: str) -> None:
        if self._stopping:
            await status.abort(
                context, unavailable(f"store server shutting down; {stream} once it is back")
            )

    def _caller_user(self, context: grpc.aio.ServicerContext) -> CallerUser:
        """The node's user behind this call, looked up off its socket when its host
        memory is checked (docs/design.md §1)."""
        if self.host_memory_any:
            return CallerUser.unchecked()
        return CallerUser(functools.partial(peer_uid, context.peer()))

    # -------------------------------------------------------- registration

    async def RegisterLayers(self, request, context) -> AsyncIterator[pb.RegistrationUpdate]:
        await self._end_if_stopping(context, "register again")
        caller = await self._caller(context)
        user = self._caller_user(context)
        reg = await self._call(context, codec.decode_registration, request, caller, user)
        inst = await self._call(context, self.node.register, reg)
        queue: asyncio.Queue = asyncio.Queue()
        self._watchers[reg.session] = queue
        if self._stopping:  # end_streams ran while this call awaited: it missed the queue
            queue.put_nowait(STOPPING)
        was_sealed = False
        try:
            update = codec.registration_update(inst, reg)
            while True:
                if update.state == pb.RegistrationUpdate.ACCEPTED and was_sealed:
                    update.state = pb.RegistrationUpdate.UNSEALED
                was_sealed = update.state == pb.RegistrationUpdate.SEALED
                yield update
                inst = await queue.get()
                if inst is STOPPING:
                    await self._end_if_stopping(context, "register again")
                update = codec.registration_update(inst, reg)
        finally:
            self._watchers.pop(reg.session, None)
            self.node.leave(reg.session)
            log.info("session of %s ended; registration removed", reg.where())

    async def GetInstance(self, request, context):
        caller = await self._caller(context)
        await self._call(context, check_wait_ms, request.wait_ms)
        deadline = asyncio.get_running_loop().time() + request.wait_ms / 1000
        inst = await self._call(context, self.node.instance, request.instance_id)
        while inst is None or inst.seal is None:
            if inst is not None:  # another's: refused at once (a wait tells when it seals)
                await self._call(context, self.node.registered, request.instance_id, caller)
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            changed = asyncio.Event()
            self._seal_waiters.add(changed)
            try:
                async with asyncio.timeout(left):
                    await changed.wait()
            except TimeoutError:
                pass
            finally:
                self._seal_waiters.discard(changed)
            inst = self.node.instance(request.instance_id)
        inst = await self._call(context, self.node.registered, request.instance_id, caller)
        return codec.instance_info(inst)

    def _instance_changed(self, inst: Instance) -> None:
        for changed in self._seal_waiters:
            changed.set()
        for reg in inst.ranks.values():
            queue = self._watchers.get(reg.session)
            if queue is not None:
                queue.put_nowait(inst)

    # -------------------------------------------------------------- blocks

    async def Save(self, request, context):
        await self._end_if_stopping(context, "save again")  # its evictions could free leased slots
        who, refs = codec.caller_id(request), await self._call(context, codec.refs, request)
        saved = await self._call(context, self.node.save, who, refs, request.step)
        return codec.save_response(saved)

    async def Load(self, request, context):
        await self._end_if_stopping(context, "load again")  # its peer fetch could evict
        who, refs = codec.caller_id(request), await self._call(context, codec.refs, request)
        left = context.time_remaining()  # None: the caller set no deadline
        if request.start_within_ms:  # the caller waits past it for a copy begun
            left = (
                request.start_within_ms / 1000
                if left is None
                else min(left, request.start_within_ms / 1000)
            )
        deadline = None if left is None else time.monotonic() + left
        return codec.load_response(await self._call(context, self.node.load, who, refs, deadline))

    async def Prefetch(self, request, context):
        await self._end_if_stopping(context, "prefetch again")
        caller = await self._caller(context)
        hashes = await self._call(context, codec.block_hashes, request)
        result = await self._call(context, self.node.prefetch, request.namespace, hashes, caller)
        return codec.prefetch_response(result)

    async def Query(self, request, context):
        caller = await self._caller(context)
        hashes = await self._call(context, codec.block_hashes, request)
        result = await self._call(
            context,
            self.node.query,
            request.namespace,
            hashes,
            request.lease,
            request.lease_ms,
            caller,
        )
        return codec.query_response(result)

    async def Release(self, request, context):
        caller = await self._caller(context)
        n = await self._call(context, self.node.release, request.lease_id, caller)
        return pb.ReleaseResponse(released_blocks=n)

    async def Clear(self, request, context):
        caller = await self._caller(context)
        n = await self._call(context, self.node.clear, request.namespace, caller)
        return pb.ClearResponse(cleared_blocks=n)

    async def Stats(self, request, context):  # noqa: ARG002 -- the servicer's signature
        ucx_address = self.peer_server.address if self.peer_server is not None else ""
        return codec.stats_response(self.node.stats(), self.fanout_stats(), ucx_address)

    def fanout_stats(self) -> FanoutStats:
        """What the Events fan-out has not delivered so far, and to how many
        streams it fans out now (a copy; docs/design.md §6)."""
        return replace(self._fanout, event_subscribers=len(self._streams))

    # -------------------------------------------------------------- events

    def publish(self, event: StoreEvent) -> None:
        """Fan an event out to every subscriber that may see its namespace;
        a stalled one is cut off, and what it will not receive is counted."""
        payload = b""
        for queue, watcher in list(self._subscribers.items()):
            if not self.node.may_see(event.namespace, watcher):
                continue
            payload = payload or event.encode()
            if queue.full():
                log.warning(
                    "event subscriber fell %d events behind; disconnecting it", queue.qsize()
                )
                del self._subscribers[queue]
                self._fanout.event_subscribers_cut += 1
                self._fanout.events_dropped += queue.qsize() + 1  # the queued ones and this
                _cut(queue)
                continue
            queue.put_nowait(payload)

    async def Events(self, request, context):  # noqa: ARG002 -- the servicer's signature
        """A snapshot of the sealed blocks, then store events as they happen, each
        numbered in this stream (docs/design.md §6); a non-admin sees only its own
        namespaces'. A subscriber that falls ``event_queue_max`` events behind is
        cut off with RESOURCE_EXHAUSTED; so is a non-admin's stream past
        MAX_EVENT_STREAMS_PER_PRINCIPAL (each may queue ``event_queue_max`` events)."""
        await self._end_if_stopping(context, "subscribe again")
        caller = await self._caller(context)
        owned = owned_by(caller, self._streams.values())
        limit = limits.MAX_EVENT_STREAMS_PER_PRINCIPAL
        await self._call(context, check_quota, "event streams", owned, limit, caller)
        await context.send_initial_metadata(())  # the stream is open: the router says so
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.event_queue_max)
        self._subscribers[queue] = caller
        self._streams[queue] = caller.name
        if self._stopping:  # end_streams ran while this call awaited
            _cut(queue)
        seq = 0
        try:
            # taken in the same step as subscribing (no gap, no overlap), made off the loop
            events = await events_of(self.snapshot)
            sealed = [e for e in events if self.node.may_see(e.namespace, caller)]
            for seq, event in enumerate(sealed, 1):
                yield pb.Event(payload=event.encode(), seq=seq, snapshot=True)
            while True:
                payload = await queue.get()
                await self._end_if_stopping(context, "subscribe again")
                if queue not in self._subscribers:
                    await status.abort(context, exhausted("event subscriber too slow; resubscribe"))
                seq += 1
                yield pb.Event(payload=payload, seq=seq)
        finally:
            self._subscribers.pop(queue, None)
            del self._streams[queue]


STOPPING = object()  # put in a registration's queue: the server is stopping


@dataclass
class FanoutStats:
    """What the Events fan-out could not deliver (docs/design.md §6), and its
    open streams; the fields are named as in ``StatsResponse`` and, under the
    ``store`` part, on /metrics."""

    events_dropped: int = 0  # events cut-off subscribers did not receive
    event_subscribers_cut: int = 0  # subscribers cut off for falling behind
    event_subscribers: int = 0  # Events streams open now (a gauge)


# ------------------------------------------------------------ registration on a server

SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]


def add_to_server(service: KVStoreService, server: grpc.aio.Server) -> None:
    """``add_KVStoreServicer_to_server``, but a request that does not parse is
    INVALID_ARGUMENT naming its message type, never UNKNOWN."""
    malformed.add_service(server, SERVICE, pb, service)


def _cut(queue: asyncio.Queue) -> None:
    """Empty a cut subscriber's queue and leave one payload in it, which wakes
    its handler to abort: a client that stopped reading holds its handler at a
    yield, and with it the queue, until its stream ends; empty, that costs
    nothing."""
    while not queue.empty():
        queue.get_nowait()
    queue.put_nowait(b"")
