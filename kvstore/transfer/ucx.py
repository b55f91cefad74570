"""UCX plumbing: the environment, connections, bounded waits, frames on an
endpoint, segment views, pooled endpoints to peers, and the health of the
process's worker (recreated when wedged)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import gc
import ipaddress
import itertools
import logging
import os
import socket
import sys
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from kvstore.transfer.errors import PeerTimeout, PeerUnavailable, ProtocolError
from kvstore.transfer.progress import LoopProgress
from kvstore.transfer.wire import INLINE_FRAME_BYTES, PREAMBLE, Kind, decode_preamble, encode_frame
from kvstore.wire.errors import Code, KVError

log = logging.getLogger(__name__)

# Outstanding segment messages per fetch. Receives run ahead of sends so data
# lands in posted receives (the expected, zero-copy path) rather than UCX's
# unexpected-message queue.
SEND_WINDOW = 64
RECV_WINDOW = 256
# How long to wait, after aborting an endpoint, for its requests to settle.
ABORT_GRACE_S = 5.0

# Tags are hashed by ucxx with the endpoint's own tag; ints hash identically
# in every process, which is why tags are ints and never strings.
CONTROL_TAG = 1
DATA_TAG_BASE = 2

# Settings applied (unless already set) before this process first starts UCX.
# - No UCX_MM_ERROR_HANDLING=y: every endpoint handles peer failure, so UCX uses
#   no shared-memory (posix/sysv) transport for it, and intra-node traffic goes
#   over tcp. Those transports deliver every sender's messages through ONE
#   receive FIFO in the receiver's shared memory; a peer killed while writing
#   its element leaves a slot that is never marked written, and the receiving
#   worker never reads past it: nothing arrives any more from any peer, and
#   every later connect times out (README.md, "Peer death"). Setting it to "y"
#   buys shared-memory speed for host memory at that risk; WorkerHealth then
#   recreates a wedged worker.
# - CM_REUSEADDR=y: a listener binds its port again while connections it
#   accepted linger in TIME_WAIT (a worker recreation, a quick restart).
# - UCXPY_PROGRESS_MODE=blocking: the event loop progresses UCX, instead of a
#   progress thread handing completions over: a control round trip costs one
#   wake-up, not a thread hand-off (measured in bench/H200_NOTES.md). The loop
#   runs kvstore's LoopProgress (kvstore.transfer.progress), not ucxx's, which
#   spun a core for good after the first UCX event. The cost: UCX's own copies
#   (shared-memory rendezvous) run on the loop's thread. Set it to "thread"
#   to move them off.
# - UCXPY_ENABLE_PYTHON_FUTURE (only with a progress thread): a notifier
#   thread wakes the loop per batch of completions instead of every pending
#   request spinning on asyncio.sleep(0).
UCX_DEFAULTS = {
    "UCX_CM_REUSEADDR": "y",
    "UCXPY_PROGRESS_MODE": "blocking",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}


class _Span:
    """A byte range exposed through the array interface UCX reads (host or CUDA);
    ``owner`` keeps the memory it lies in alive."""

    def __init__(self, ptr: int, nbytes: int, cuda: bool, readonly: bool, owner: Any):
        face = {"data": (ptr, readonly), "shape": (nbytes,), "typestr": "|u1", "version": 3}
        if cuda:  # no "stream": the slots' writers finished before they were offered
            self.__cuda_array_interface__ = face
        else:
            self.__array_interface__ = face
        self.owner = owner


def segment_views(
    ptr: np.ndarray,
    size: np.ndarray,
    memory: np.ndarray,
    bounds: list[tuple[int, int]],
    writable: bool,
    owner: Any,
) -> list[Any]:
    """One UCX-wrapped view per segment [a, b) of slots that lie back to back."""
    from ucxx._lib.arr import Array

    csum = np.concatenate(([0], np.cumsum(size, dtype=np.int64))).tolist()
    starts, cuda = ptr.tolist(), (memory != 0).tolist()
    views = []
    for a, b in bounds:
        nbytes = csum[b] - csum[a]
        span = _Span(starts[a], nbytes, cuda[a], not writable, owner)
        arr = Array(span if cuda[a] else np.asarray(span))  # host: UCX reads the buffer protocol
        if arr.ptr != starts[a] or arr.nbytes != nbytes:
            raise ValueError("segment view does not cover its slots")
        views.append(arr)
    return views


# The interface a loopback-only store confines UCX's network transports to.
LOOPBACK_DEVICE = "lo"


def restrict_net_devices(devices: str) -> bool:
    """Confine UCX's network transports to ``devices`` (UCX_NET_DEVICES) in this
    process, unless the user set it or UCX has started already; whether it applies.

    With UCX_NET_DEVICES=lo the tcp transport listens on 127.0.0.1 only, and UCX
    rejects a connection request that reaches the listener (which ucxx binds on
    every interface) through another device (docs/design.md §8)."""
    if "UCX_NET_DEVICES" in os.environ:
        return os.environ["UCX_NET_DEVICES"] == devices
    ucxx = sys.modules.get("ucxx")
    if ucxx is not None and getattr(ucxx.core, "_ctx", None) is not None:
        log.warning("UCX started already: UCX_NET_DEVICES=%s does not apply", devices)
        return False
    os.environ["UCX_NET_DEVICES"] = devices
    return True


def ucxx_module() -> Any:
    """Import ucxx late, after our UCX defaults are in the environment."""
    _set_ucx_defaults()
    import ucxx

    return ucxx


@functools.cache
def _set_ucx_defaults() -> None:
    """Once a process: ucxx reads them when it first starts."""
    for key, value in UCX_DEFAULTS.items():
        os.environ.setdefault(key, value)
    threaded = os.environ["UCXPY_PROGRESS_MODE"].startswith("thread")
    os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1" if threaded else "0")


def loop_progress() -> LoopProgress | None:
    """The running loop's UCX progress, started on first use: kvstore's
    :class:`~kvstore.transfer.progress.LoopProgress` in the blocking mode (ucxx's
    own, which its context starts, is retired first); None in ucxx's thread
    modes, which progress on a thread of their own."""
    from ucxx._lib_async import application_context as app

    loop = asyncio.get_running_loop()
    ctx = _context()
    progress = app.ProgressTasks.get(loop)
    if isinstance(progress, LoopProgress) and progress.current(ctx.worker):
        return progress
    if ctx.progress_mode != "blocking":
        ctx.continuous_ucx_progress()
        return None
    for closed in [other for other in app.ProgressTasks if other.is_closed()]:
        del app.ProgressTasks[closed]  # a loop that ended without stop_progress: let go
    theirs = app.ProgressTasks.pop(loop, None)
    if isinstance(theirs, LoopProgress):  # a recreated worker's predecessor, or failed
        theirs.retire()
    elif theirs is not None:  # ucxx's own, which its context started
        _retire_ucxx_progress(loop, theirs)
        _run_finalizers(theirs)  # its socket
    progress = app.ProgressTasks[loop] = LoopProgress(ctx.worker, loop)
    return progress


def _context() -> Any:
    """ucxx's application context of this process (its worker, progress mode)."""
    return ucxx_module().core._get_ctx()  # noqa: SLF001 -- no public handle on it


def _kick_progress() -> None:
    """Tell the running loop's progress (if any: none is started here) that UCX
    may have done something its fd will not tell: progress made outside it, an
    endpoint aborted."""
    from ucxx._lib_async import application_context as app

    try:
        progress = app.ProgressTasks.get(asyncio.get_running_loop())
    except RuntimeError:  # no running loop (a shutdown): nothing waits
        return
    if isinstance(progress, LoopProgress):
        progress.kick()


def _progress_now(worker: Any) -> None:
    """Progress ``worker`` here, outside the loop's turns, and tell the loop's
    progress (what completed meanwhile is looked at on its next turn)."""
    worker.progress()
    _kick_progress()


def is_ucx_error(exc: BaseException) -> bool:
    from ucxx.exceptions import UCXError

    return isinstance(exc, UCXError)


@dataclass(eq=False)
class Conn:
    """One UCX endpoint and whether it may still carry another fetch."""

    ep: Any
    peer: str
    broken: bool = False
    # Requests that were still in flight when we gave up on them.
    unsettled: list[asyncio.Future] = field(default_factory=list)
    # run_ops calls awaiting requests on this endpoint right now.
    active: int = 0
    # Both ends proved the cluster secret on it (kvstore.transfer.handshake).
    authenticated: bool = False
    # The peer's card was asked for on it (kvstore.transfer.onesided).
    card_asked: bool = False

    def __post_init__(self) -> None:
        worker_health().track(self)

    def abort(self) -> None:
        """Close abruptly: UCX cancels every request still posted on the endpoint."""
        if not self.broken:
            self.broken = True
            try:
                self.ep.abort()
            except Exception:  # already closed by the peer's failure
                log.debug("abort of endpoint to %s failed", self.peer, exc_info=True)
            _kick_progress()  # a frame awaited on it: its wait ends now

    @property
    def usable(self) -> bool:
        return not self.broken and not self.ep.closed

    @property
    def busy(self) -> bool:
        """Whether a request of this endpoint may still complete (and touch memory)."""
        return self.active > 0 or any(not t.done() for t in self.unsettled)


class Posted:
    """A UCX tag send or receive posted when made (not a coroutine that posts once
    a task runs it). :func:`run_ops` awaits it through the loop's progress, which
    holds it, buffer and all, until UCX settles it; awaited on its own (or in a
    task), it does the same."""

    __slots__ = ("_buffer", "_error", "_progress", "_request")

    def __init__(self, progress: LoopProgress, post: Callable[[Any], Any], buffer: Any):
        self._progress = progress
        self._buffer = ucxx_array(buffer)
        self._request: Any = None
        self._error: BaseException | None = None
        try:
            self._request = post(self._buffer)
        except Exception as exc:  # the endpoint failed or closed: raised when awaited
            if not is_ucx_error(exc):
                raise
            # kept without its frames: they hold the endpoint, and so the worker
            self._error = exc.with_traceback(None)
            return
        if not self._request.completed:
            progress.hold(self)

    @property
    def progress(self) -> LoopProgress:
        """The loop's progress that holds it until it settles."""
        return self._progress

    @property
    def settled(self) -> bool:
        return self._request is None or self._request.completed

    @property
    def failed(self) -> bool:
        return self._request is None or (self._request.completed and self._request.status != 0)

    @property
    def succeeded(self) -> bool:
        """Settled without error: a send that is out, a receive that has landed."""
        return self._request is not None and self._request.completed and self._request.status == 0

    def error(self) -> BaseException | None:
        """Why it failed (None: it did not, or has not yet)."""
        if self._request is None:
            return self._error
        if self.failed:
            try:
                self._request.check_error()
            except Exception as exc:
                if not is_ucx_error(exc):
                    raise
                return exc.with_traceback(None)
        return None

    def __await__(self) -> Generator[Any, None, None]:
        if not self.settled:
            yield from self._progress.completion([self]).__await__()
        if (exc := self.error()) is not None:
            raise exc


def post_send(endpoint: Any, buffer: Any, tag: int) -> Awaitable:
    """Send ``buffer`` with ``tag`` (hashed as ucxx's Endpoint.send does), posted
    now where kvstore progresses UCX; else ucxx's coroutine, which posts when it
    first runs."""
    progress = loop_progress()
    if progress is None:
        return endpoint.send(buffer, tag=tag)
    send_tag = _hashed_tag(endpoint, "msg_send", tag)
    return Posted(progress, functools.partial(_checked_send, endpoint, send_tag), buffer)


def post_recv(endpoint: Any, buffer: Any, tag: int) -> Awaitable:
    """Receive into ``buffer`` with ``tag``, as :func:`post_send` sends. On an
    endpoint already closed, ucxx's coroutine: it takes a last frame still
    queued for it."""
    progress = loop_progress()
    if progress is None or endpoint.closed:
        return endpoint.recv(buffer, tag=tag)
    ep = endpoint._ep  # noqa: SLF001 -- ucxx's endpoint: no public handle on it
    recv_tag = _hashed_tag(endpoint, "msg_recv", tag)
    return Posted(progress, lambda array: ep.tag_recv(array, recv_tag, _tag_mask_full()), buffer)


class _Arrival:
    """The wait for a tagged message to arrive, without receiving it: settled once
    UCX holds it (then taken off UCX's queue: ``probe`` has its length and handle)
    or the endpoint closed. Looked at by the loop's progress like a request."""

    __slots__ = ("_endpoint", "_tag", "_worker", "probe")

    def __init__(self, endpoint: Any, worker: Any, tag: Any):
        self._endpoint, self._worker, self._tag = endpoint, worker, tag
        self.probe: Any = None

    @property
    def settled(self) -> bool:
        if self.probe is None:
            probe = self._worker.tag_probe(self._tag, remove=True)
            if probe.matched:
                self.probe = probe
        return self.probe is not None or self._endpoint.closed

    @property
    def failed(self) -> bool:
        return self.settled and self.probe is None


async def recv_exact(endpoint: Any, buffer: Any, tag: int) -> None:
    """Receive into ``buffer`` a message with ``tag`` (as :func:`post_recv`) that
    fills it exactly, else ProtocolError.

    ucxx completes a receive of a shorter message without error and without
    its length (rapidsai/ucxx#104): the buffer's old bytes would stay under a
    peer's short slot segment and be committed as its. So the message is
    waited for first, where UCX tells its length, then received by its handle:
    a rendezvous one is still read straight into ``buffer``."""
    from ucxx.exceptions import UCXCloseError

    array = ucxx_array(buffer)
    progress = loop_progress()
    worker = _context().worker if progress is None else progress.worker
    arrival = _Arrival(endpoint, worker, _hashed_tag(endpoint, "msg_recv", tag))
    if progress is not None:
        if not arrival.settled:
            await progress.completion([arrival])
    else:  # ucxx's thread progresses the worker: look again every turn, then less often
        for turn in itertools.count():
            if arrival.settled:
                break
            await asyncio.sleep(0 if turn < 64 else 0.0005)
    if arrival.probe is None:
        raise UCXCloseError("Endpoint closed")
    if progress is not None:
        post = functools.partial(_recv_with_handle, worker, arrival.probe)
        await Posted(progress, post, array)
    else:
        await worker.tag_recv_with_handle(array, arrival.probe).wait()
    if arrival.probe.length != array.nbytes:  # a longer one failed: truncated
        raise ProtocolError(f"{arrival.probe.length} bytes where {array.nbytes} were due")


def _recv_with_handle(worker: Any, probe: Any, array: Any) -> Any:
    return worker.tag_recv_with_handle(array, probe)


def _checked_send(endpoint: Any, tag: Any, array: Any) -> Any:
    """ucxx's Endpoint.send up to its request: a failed or closed (aborted: ucxx
    let go of it) endpoint raises a UCX error, which the await reports."""
    if endpoint.closed:
        from ucxx.exceptions import UCXCloseError

        raise UCXCloseError("Endpoint closed")
    ep = endpoint._ep  # noqa: SLF001 -- as in post_recv
    ep.raise_on_error()
    return ep.tag_send(array, tag)


def _hashed_tag(endpoint: Any, which: str, tag: int) -> Any:
    """The tag ucxx's Endpoint.send / recv would use: ours, hashed with the
    endpoint's own (agreed with the peer when it connected)."""
    return _tag(endpoint._tags[which], tag)  # noqa: SLF001 -- no public handle on it


@functools.lru_cache(maxsize=4096)
def _tag(own: int, tag: int) -> Any:
    """ucxx's Tag of ``tag`` on an endpoint whose own tag is ``own`` (a hash: cached)."""
    from ucxx._lib_async.utils import hash64bits
    from ucxx.types import Tag

    return Tag(hash64bits(own, hash(tag)))


@functools.cache
def _tag_mask_full() -> Any:
    from ucxx.types import TagMaskFull

    return TagMaskFull


def ucxx_array(buffer: Any) -> Any:
    from ucxx._lib.arr import Array

    return buffer if isinstance(buffer, Array) else Array(buffer)


def started(ops: list[Awaitable]) -> list[Awaitable]:
    """``ops`` posted now: coroutines as tasks, Posted ones as they are."""
    return [op if isinstance(op, Posted) else asyncio.ensure_future(op) for op in ops]


def all_posted(ops: Sequence[Awaitable]) -> bool:
    """Whether UCX holds every operation already (no task still has to post one)."""
    return all(isinstance(op, Posted) for op in ops)


def all_out(ops: Sequence[Awaitable]) -> bool:
    """Whether every operation is a Posted one that UCX completed without error:
    nothing of them is still in flight (the usual send, done when posted)."""
    return all(isinstance(op, Posted) and op.succeeded for op in ops)


async def run_ops(
    conn: Conn, ops: list[Awaitable], deadline: float | None, what: str, *, asleep: bool = False
) -> None:
    """Await UCX operations without ever abandoning one that may still touch memory.

    Cancelling a ucxx coroutine does not cancel its UCX request, which could then
    write into a buffer we freed. So operations run as tasks that are never
    cancelled, or are Posted ones, which the loop's progress holds until they
    settle: on failure, timeout or outer cancellation the endpoint is aborted
    (UCX then cancels its requests) and we wait for them to settle. Those that
    do not settle within the grace period are left in ``conn.unsettled``.

    The loop's progress polls the worker meanwhile, unless ``asleep`` (Posted
    operations that may wait long, a peer's next frame): then the loop sleeps
    until UCX's fd tells of an event.
    """
    progress = loop_progress()  # first: once a task runs, nothing may fail before we await it
    if progress is not None and ops and all_posted(ops):
        await _run_posted(conn, progress, ops, deadline, what, asleep)
        return
    loop = asyncio.get_running_loop()
    tasks = [asyncio.ensure_future(op) for op in ops]
    if not tasks:
        return
    timeout = None if deadline is None else max(0.0, deadline - loop.time())
    conn.active += 1
    try:
        with progress.polling() if progress is not None else contextlib.nullcontext():
            try:
                done, pending = await asyncio.wait(
                    tasks, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION
                )
            except BaseException:  # cancelled from outside
                await abort_and_settle(conn, tasks)
                raise
            failed = [t for t in done if t.exception() is not None]
            if not failed and not pending:
                return
            await abort_and_settle(conn, tasks)
    finally:
        conn.active -= 1
    if failed:
        raise _peer_error(failed[0].exception(), conn.peer, what)
    raise PeerTimeout(f"peer {conn.peer}: {what} did not finish within the deadline")


async def _run_posted(
    conn: Conn,
    progress: LoopProgress,
    ops: list[Posted],
    deadline: float | None,
    what: str,
    asleep: bool,
) -> None:
    """run_ops of Posted operations: no task each, one future for them all."""
    if all_out(ops):
        return  # the usual send: done when posted
    conn.active += 1
    try:
        with contextlib.nullcontext() if asleep else progress.polling():
            if not any(op.failed for op in ops):
                try:
                    async with asyncio.timeout_at(deadline):
                        await progress.completion(ops)
                except TimeoutError:
                    pass
                except BaseException:  # cancelled from outside
                    await abort_and_settle(conn, ops)
                    raise
                if all_out(ops):
                    return
            failed = next((op for op in ops if op.failed), None)
            await abort_and_settle(conn, ops)
    finally:
        conn.active -= 1
    if failed is not None:
        error = failed.error()
        if error is None:
            raise PeerUnavailable(f"peer {conn.peer}: {what} failed")
        raise _peer_error(error, conn.peer, what)
    raise PeerTimeout(f"peer {conn.peer}: {what} did not finish within the deadline")


async def abort_and_settle(conn: Conn, ops: Sequence[Awaitable]) -> None:
    """Abort ``conn`` and give its operations ``ops`` (tasks, Posted ones)
    ABORT_GRACE_S to settle; those that do not are left in ``conn.unsettled``."""
    conn.abort()
    tasks = [op for op in ops if isinstance(op, asyncio.Future)]
    waits: list[asyncio.Future] = [t for t in tasks if not t.done()]
    posted = [op for op in ops if isinstance(op, Posted) and not op.settled]
    if posted:  # one loop's, all of them (its progress retired: abandoned, kept there)
        waits.append(posted[0].progress.completion(posted, settle=True))
    if waits:
        conn.unsettled.extend(waits)  # busy until they settle, even if we are cancelled here
        try:
            _, still = await asyncio.wait(waits, timeout=ABORT_GRACE_S)
        finally:
            conn.unsettled[:] = [t for t in conn.unsettled if not t.done()]
        if still:
            left = sum(not op.settled for op in posted) + sum(not t.done() for t in tasks)
            log.error("%d UCX requests to %s did not settle after abort", left, conn.peer)
    for t in {*tasks, *waits}:  # mark exceptions as retrieved: the first one is reported
        if t.done() and not t.cancelled() and (exc := t.exception()) is not None:
            # With Python futures (progress thread), ucxx keeps the failed future,
            # and so this exception: its traceback's frames would keep the
            # buffers, the endpoint and the worker alive for good.
            exc.__traceback__ = None


def _peer_error(exc: BaseException, peer: str, what: str) -> Exception:
    if isinstance(exc, KVError):
        return exc
    if isinstance(exc, ProtocolError):
        return PeerUnavailable(f"peer {peer}: protocol error during {what}: {exc}")
    if is_ucx_error(exc):
        return PeerUnavailable(f"peer {peer}: {what} failed: {type(exc).__name__}: {exc}")
    return exc if isinstance(exc, Exception) else RuntimeError(repr(exc))


def when_settled(conn: Conn, fn: Callable[[], None]) -> None:
    """Run ``fn`` (free slots, drop a lease) once no request of ``conn`` can touch them."""
    pending = [t for t in conn.unsettled if not t.done()]
    if not pending:
        fn()
        return
    remaining = len(pending)

    def one_done(_task: asyncio.Task) -> None:
        nonlocal remaining
        remaining -= 1
        if remaining == 0:
            fn()

    for t in pending:
        t.add_done_callback(one_done)


def frame_sends(conn: Conn, kind: Kind, body: bytes) -> list[Awaitable]:
    """Send operations of one frame, to be awaited together with what comes next."""
    return [
        post_send(conn.ep, np.frombuffer(m, dtype=np.uint8), CONTROL_TAG)
        for m in encode_frame(kind, body)
    ]


def post_frame(conn: Conn, kind: Kind, body: bytes, deadline: float) -> asyncio.Task | None:
    """Send a frame one-way, posted now (before any later frame on ``conn``): None
    when it is out at once (the usual case), else the task that waits for it to
    go out by ``deadline``, which fails (PeerUnavailable, PeerTimeout) if it
    does not (the loop asleep meanwhile: a peer that does not take it may take
    long). Until it is out, the endpoint is not idle (``conn.unsettled``); a
    send that fails or runs out aborts it."""
    ops = started(frame_sends(conn, kind, body))
    if all_out(ops):
        return None
    what = f"sending {kind.name}"
    send = asyncio.ensure_future(run_ops(conn, ops, deadline, what, asleep=True))
    send.add_done_callback(lambda t: t.cancelled() or t.exception())  # the caller reports it
    conn.unsettled[:] = [t for t in conn.unsettled if not t.done()]
    conn.unsettled.append(send)
    return send


async def send_frame(conn: Conn, kind: Kind, deadline: float | None, *, body: bytes) -> None:
    await run_ops(conn, frame_sends(conn, kind, body), deadline, f"sending {kind.name}")


async def recv_frame(
    conn: Conn, expect: Sequence[Kind], deadline: float | None, after: Sequence[Awaitable] = ()
) -> Frame:
    """Receive one frame (awaiting the operations ``after`` alongside: a frame just
    sent, so that a request and its answer cost one wake-up, not two). The first
    message lands in an INLINE_FRAME_BYTES buffer; a longer body, announced by the
    (bounded) preamble, in a buffer of exactly its size."""
    if conn.broken:  # aborted here (a stop): ucxx has let go of the endpoint
        await abort_and_settle(conn, after)
        raise PeerUnavailable(f"peer {conn.peer}: connection closed")
    first = np.zeros(INLINE_FRAME_BYTES, dtype=np.uint8)  # a short message reads as zeros
    # with nothing of ours still in flight (the frame just sent is out: the usual
    # case), the loop may sleep while the peer takes its time
    asleep = all_out(after)
    ops = [*after, post_recv(conn.ep, first, CONTROL_TAG)]
    await run_ops(conn, ops, deadline, "waiting for a frame", asleep=asleep)
    worker_health().received()
    kind, length = decode_preamble(first[: PREAMBLE.size].tobytes(), expect)
    end = PREAMBLE.size + length
    if end <= INLINE_FRAME_BYTES:
        return Frame(kind, length, first[PREAMBLE.size : end].tobytes())
    # zeros, not empty: ucxx completes a shorter message than the buffer without
    # error (rapidsai/ucxx#104), and the rest must not be this process's old heap
    body = np.zeros(length, dtype=np.uint8)
    await run_ops(conn, [post_recv(conn.ep, body, CONTROL_TAG)], deadline, f"receiving {kind.name}")
    return Frame(kind, length, body.tobytes())


class Frame(NamedTuple):
    kind: Kind
    length: int
    body: bytes


def pump(
    op: Callable[[int, Any], Awaitable[Any]], views: list[Any], window: int
) -> list[Coroutine]:
    """At most ``window`` operations in flight, issued in slot order."""
    items = iter(enumerate(views))

    async def worker() -> None:
        for i, view in items:
            await op(i, view)

    return [worker() for _ in range(min(window, len(views)))]


class EndpointPool:
    """Idle endpoints per peer address: creating one costs a connection handshake."""

    def __init__(self, max_idle_per_peer: int = 4):
        self.max_idle_per_peer = max_idle_per_peer
        self._idle: dict[str, list[Conn]] = {}

    async def acquire(self, address: str, deadline: float) -> Conn:
        idle = self._idle.get(address, [])
        while idle:
            conn = idle.pop()
            if conn.usable:
                return conn
            conn.abort()
        return await connect(address, deadline)

    def release(self, conn: Conn, reusable: bool) -> None:
        idle = self._idle.setdefault(conn.peer, [])
        if reusable and conn.usable and len(idle) < self.max_idle_per_peer:
            idle.append(conn)
        else:
            conn.abort()

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()


def close_all_pools() -> None:
    """Drop the pooled endpoints of every event loop."""
    for pool in list(_POOLS.values()):
        pool.close()


_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EndpointPool] = (
    weakref.WeakKeyDictionary()
)


def endpoint_pool() -> EndpointPool:
    """The running event loop's pool (ucxx endpoints belong to one loop)."""
    loop = asyncio.get_running_loop()
    pool = _POOLS.get(loop)
    if pool is None:
        pool = _POOLS[loop] = EndpointPool()
    return pool


async def close_endpoints() -> None:
    """Drop every pooled endpoint of the running loop (shutdown, tests)."""
    endpoint_pool().close()


class _EpAttr(ctypes.Structure):  # ucp_ep_attr_t, up to remote_sockaddr
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("name", ctypes.c_char * 32),  # UCP_ENTITY_NAME_MAX
        ("local_sockaddr", ctypes.c_uint8 * 128),  # struct sockaddr_storage
        ("remote_sockaddr", ctypes.c_uint8 * 128),
        ("rest", ctypes.c_uint8 * 64),  # transports, user_data: room to spare
    ]


_EP_ATTR_FIELD_REMOTE_SOCKADDR = 1 << 2


@functools.cache
def _libucp() -> ctypes.CDLL:
    import libucx

    return ctypes.CDLL(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so.0"))


def remote_address(ep: Any) -> str:
    """``host:port`` the endpoint is connected to (UCX's ucp_ep_query, which ucxx
    does not wrap), or "unknown" when UCX cannot tell."""
    try:
        lib = _libucp()
        attr = _EpAttr(field_mask=_EP_ATTR_FIELD_REMOTE_SOCKADDR)
        if lib.ucp_ep_query(ctypes.c_void_p(ep.ucp_endpoint), ctypes.byref(attr)) != 0:
            return "unknown"
        raw = bytes(attr.remote_sockaddr)
        family, port = int.from_bytes(raw[:2], "little"), int.from_bytes(raw[2:4], "big")
        if family == socket.AF_INET:
            return f"{ipaddress.IPv4Address(raw[4:8])}:{port}"
        if family == socket.AF_INET6:
            return f"[{ipaddress.IPv6Address(raw[8:24])}]:{port}"
    except Exception:
        log.debug("cannot query the remote address of an endpoint", exc_info=True)
    return "unknown"


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise KVError(Code.INVALID_ARGUMENT, f"bad peer address {address!r}")
    return host.strip("[]"), int(port)


async def connect(address: str, deadline: float) -> Conn:
    host, port = parse_address(address)
    ucxx_module()  # imported with our UCX defaults set before anything starts it
    health = worker_health()
    await health.ready(deadline)
    remaining = deadline - asyncio.get_running_loop().time()
    if remaining <= 0:
        raise PeerTimeout(f"peer {address}: no time left to connect")
    health.connecting += 1
    try:
        ep = await _create_endpoint(host, port, remaining)
    except TimeoutError:
        health.connect_timed_out(address)
        raise PeerTimeout(f"peer {address}: connect did not finish in {remaining:.1f}s") from None
    except Exception as e:
        if is_ucx_error(e) or isinstance(e, OSError | RuntimeError):
            raise PeerUnavailable(f"peer {address}: connect failed: {e}") from None
        raise
    finally:
        health.connecting -= 1
    health.received()  # the peer info exchange came back
    return Conn(ep, peer=address)


async def _create_endpoint(host: str, port: int, timeout: float) -> Any:
    """``ucxx.create_endpoint``, except that an endpoint whose peer info exchange
    fails or times out is closed rather than dropped.

    A dropped one, its receive still posted, crashed the process (SIGSEGV) when
    the peer answered later. And the close is UCX's plain one where it can be
    (progressed here, not by a thread), which completes that (stream) receive:
    ucxx's blocking close first tries to cancel it, which UCX cannot do for a
    stream receive, and then keeps request, endpoint and worker alive for good
    (a worker recreation would leave the old one behind).
    """
    from ucxx._lib import libucxx as ucx_api
    from ucxx._lib_async.endpoint import Endpoint
    from ucxx._lib_async.exchange_peer_info import exchange_peer_info
    from ucxx._lib_async.utils import hash64bits
    from ucxx.exceptions import UCXMessageTruncatedError

    progress = loop_progress()
    ctx = _context()
    ucx_ep = ucx_api.UCXEndpoint.create(ctx.worker, host, port, True)  # peer-failure handling
    if progress is not None:
        _progress_now(ctx.worker)
    msg_tag = hash64bits("msg_tag", os.urandom(16), ucx_ep.handle)
    try:
        ucx_ep.raise_on_error()  # refused already: a receive posted now would never end
        # Inline, not in a task of its own: the receive must be posted at once,
        # before progress can fail the endpoint (UCX ends it then; a receive
        # posted on a failed endpoint is only ever cancelled, and that fails).
        with progress.polling() if progress is not None else contextlib.nullcontext():
            info = await exchange_peer_info(
                endpoint=ucx_ep, msg_tag=msg_tag, listener=False, connect_timeout=timeout
            )
    except UCXMessageTruncatedError:  # the peer closed: say why
        try:
            ucx_ep.raise_on_error()
            raise
        finally:
            _close_unconnected(ctx, ucx_ep)
    except BaseException:
        _close_unconnected(ctx, ucx_ep)
        raise
    return Endpoint(
        endpoint=ucx_ep, ctx=ctx, tags={"msg_send": info["msg_tag"], "msg_recv": msg_tag}
    )


def _close_unconnected(ctx: Any, ucx_ep: Any) -> None:
    if ctx.progress_mode.startswith("thread"):
        # The progress thread may fail the endpoint meanwhile: only the blocking
        # close copes with that (it leaves the stream receive behind, though).
        ucx_ep.close_blocking(period=int(ABORT_GRACE_S * 1e9), max_attempts=1)
    elif ucx_ep.alive:  # a failed one is closed already: ucxx's close() crashes on it
        ucx_ep.close()  # completes on progress
        worker_health().closing(ucx_ep)
        _progress_now(ctx.worker)


# ---- the local worker: noticing it wedged, and recreating it --------------------------

# After this many connect timeouts in a row, with nothing received over UCX in
# between, the local worker is presumed wedged (README.md, "Peer death").
WEDGED_AFTER_CONNECT_TIMEOUTS = 2


class Suspendable(Protocol):
    """A listener that stops for a worker recreation and listens again after it."""

    async def suspend(self) -> None: ...

    async def resume(self) -> None: ...


class WorkerHealth:
    """This process's UCX worker: notices it stopped receiving and recreates it.

    The fallback for a worker that no message reaches any more (a peer died in
    the middle of writing into a shared-memory FIFO, when those transports are
    enabled): then every connect times out, since the peer info exchange never
    comes back, while connects to a live peer normally finish well within a
    fetch deadline. WEDGED_AFTER_CONNECT_TIMEOUTS of them in a row, nothing
    received in between, start a recreation in the background: listeners
    suspend, every endpoint is aborted and its requests get ABORT_GRACE_S to
    settle, the worker stops being progressed and ucxx drops its context (and
    with it the worker, its descriptors and its shared memory); ucxx creates a
    fresh one on next use and the listeners listen again on their ports.
    Connects wait for a recreation in progress, within their deadline.
    """

    def __init__(self) -> None:
        self.recreations = 0
        self.connecting = 0  # connects in progress
        self._timeouts = 0
        self._conns: weakref.WeakSet[Conn] = weakref.WeakSet()
        self._closing: list[Any] = []  # ucxx endpoints closing (UCXEndpoint)
        self._listeners: weakref.WeakSet[Any] = weakref.WeakSet()
        self._recreating: asyncio.Task | None = None

    def track(self, conn: Conn) -> None:
        self._conns.add(conn)

    def closing(self, ucx_ep: Any) -> None:
        """An endpoint whose close completes on progress: held until it has."""
        self._closing = [ep for ep in self._closing if ep.alive]
        self._closing.append(ucx_ep)

    def add_listener(self, listener: Suspendable) -> None:
        self._listeners.add(listener)

    def remove_listener(self, listener: Suspendable) -> None:
        self._listeners.discard(listener)

    def received(self) -> None:
        """Something arrived over UCX: the worker is alive."""
        self._timeouts = 0

    def connect_timed_out(self, peer: str) -> None:
        self._timeouts += 1
        if self._timeouts >= WEDGED_AFTER_CONNECT_TIMEOUTS and self._recreating is None:
            reason = f"{self._timeouts} connects in a row timed out, the last one to {peer}"
            self._recreating = asyncio.ensure_future(self._recreate(reason))

    @property
    def recreating(self) -> bool:
        return self._recreating is not None

    async def ready(self, deadline: float) -> None:
        """Wait for a recreation in progress: no connect starts on the old worker."""
        task = self._recreating
        if task is None or task.done():
            return
        remaining = deadline - asyncio.get_running_loop().time()
        await asyncio.wait([task], timeout=max(0.0, remaining))
        if not task.done():
            raise PeerTimeout("the UCX worker is being recreated")

    async def _recreate(self, reason: str) -> None:
        log.error("UCX worker presumed wedged (%s): recreating it", reason)
        loop = asyncio.get_running_loop()
        try:
            listeners = list(self._listeners)
            for listener in listeners:
                await listener.suspend()
            close_all_pools()
            self._abort_all()
            await self._settle(loop.time() + ABORT_GRACE_S)
            await _drop_worker(loop)
            self.recreations += 1
            self._timeouts = 0
            for listener in listeners:
                try:
                    await listener.resume()
                except Exception:
                    log.exception("a UCX listener did not come back after the worker recreation")
            log.warning("UCX worker recreated (%d so far)", self.recreations)
        except Exception:
            log.exception("recreating the UCX worker failed")
        finally:
            self._recreating = None

    def _abort_all(self) -> None:
        """Abort every tracked connection (in a frame of its own: a loop variable
        left in the recreation's frame would keep the last one, and with it the
        old worker, alive)."""
        for conn in list(self._conns):
            conn.abort()

    async def _settle(self, deadline: float) -> None:
        """Wait until no request, connect or close can still complete on the old
        worker (progressing it: a wedged one only wakes up on a timer)."""
        loop = asyncio.get_running_loop()
        ctx = getattr(ucxx_module().core, "_ctx", None)
        blocking = ctx is not None and not ctx.progress_mode.startswith("thread")
        while True:
            self._closing = [ep for ep in self._closing if ep.alive]
            busy = any(conn.busy for conn in list(self._conns))
            if not (self.connecting or busy or self._closing):
                return
            if loop.time() >= deadline:
                log.warning("UCX requests still pending while the worker is recreated")
                return
            if blocking:
                _progress_now(ctx.worker)
            await asyncio.sleep(0.05)


async def _drop_worker(loop: asyncio.AbstractEventLoop) -> None:
    """Stop progressing this process's UCX worker and drop ucxx's context (ucxx
    makes a fresh context and worker on next use).

    ucxx's own reset() is made for shutdown: it leaves the progress machinery of
    a running loop in place, still holding the old worker (progress tasks, the
    epoll fd reader, a progress thread), so that goes first; and the old
    context's finalizer, which would clear the NEW context's progress entry
    were it to run late, is detached.
    """
    ucxx = ucxx_module()
    await _stop_progress(loop)
    ctx = getattr(ucxx.core, "_ctx", None)
    if ctx is not None:
        for ref in weakref.getweakrefs(ctx):
            if isinstance(ref.__callback__, weakref.finalize):
                ref.__callback__.detach()
    del ctx
    try:
        ucxx.reset()
    except Exception as exc:
        if not is_ucx_error(exc):
            raise
        # Something still holds the old context: it goes once released.
        log.warning("the old UCX context is still referenced: %s", str(exc).split("\n")[0])
    # Endpoints of the old worker may still be on their way out (a handler
    # unwinding); until they are, the old listener holds its port.
    deadline = loop.time() + ABORT_GRACE_S
    while _ucxx_objects_alive() and loop.time() < deadline:
        await asyncio.sleep(0.1)


async def stop_progress() -> None:
    """Stop progressing UCX on the running loop (before ``ucxx.reset()`` at shutdown)."""
    await _stop_progress(asyncio.get_running_loop())


async def _stop_progress(loop: asyncio.AbstractEventLoop) -> None:
    """Stop progressing the worker on ``loop`` (ours, or ucxx's tasks, fd reader, thread)."""
    from ucxx._lib_async import application_context as app

    progress = app.ProgressTasks.pop(loop, None)
    if progress is None:
        return
    if isinstance(progress, LoopProgress):
        await progress.stop(ABORT_GRACE_S)
        return
    tasks = _retire_ucxx_progress(loop, progress)
    if tasks:
        await asyncio.wait(tasks, timeout=ABORT_GRACE_S)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: how it ended does not matter
    del tasks
    # ucxx cancels whatever stands there when the loop closes: finished futures.
    for name in ("arm_task", "progress_task"):
        if getattr(progress, name, None) is not None:
            done = loop.create_future()
            done.set_result(None)
            setattr(progress, name, done)
    _run_finalizers(progress)  # close its socket, stop the progress thread


def _retire_ucxx_progress(loop: asyncio.AbstractEventLoop, progress: Any) -> list[asyncio.Task]:
    """Make ucxx's progress of ``loop`` let go of the worker; its tasks, which end
    on their next turn."""
    epoll_fd = getattr(progress.worker, "epoll_file_descriptor", None)
    if getattr(progress, "rsock", None) is not None and epoll_fd is not None:  # blocking mode
        loop.remove_reader(epoll_fd)
    # The progress loops end on their next turn once they find no worker. Not
    # cancelled: a cancelled one's traceback keeps the worker in its frame (and
    # one of them eats a cancel and carries on).
    progress.worker = None
    arm = getattr(progress, "arm_task", None)
    if arm is not None:
        arm.cancel()  # it waits on a socket, holding no worker
    return [t for t in getattr(progress, "_tasks", ()) if t is not None]


def _ucxx_objects_alive() -> int:
    """ucxx workers, endpoints and listeners still alive in this process."""
    from ucxx._lib import libucxx as ucx_api

    kinds = (ucx_api.UCXWorker, ucx_api.UCXEndpoint, ucx_api.UCXListener)
    gc.collect()
    return sum(1 for obj in gc.get_objects() if isinstance(obj, kinds))


def _run_finalizers(obj: object) -> None:
    for ref in weakref.getweakrefs(obj):
        if isinstance(ref.__callback__, weakref.finalize):
            try:
                ref.__callback__()
            except Exception:
                log.debug("a ucxx finalizer failed", exc_info=True)


_HEALTH = WorkerHealth()


def worker_health() -> WorkerHealth:
    """This process's (ucxx has one context and one worker per process)."""
    return _HEALTH


def worker_recreations() -> int:
    """How many times this process recreated its UCX worker."""
    return _HEALTH.recreations
