"""UCX plumbing: the environment, connections, bounded waits, frames on an
endpoint, segment views, and pooled endpoints to peers."""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvstore.transfer.errors import PeerTimeout, PeerUnavailable, ProtocolError
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
# - MM_ERROR_HANDLING: endpoints with peer-failure handling (needed to notice a
#   dead peer) may otherwise not use the shared-memory transports, and
#   intra-node traffic falls back to tcp over loopback.
# - UCXPY_PROGRESS_MODE=blocking: the event loop progresses UCX when the
#   worker's fd is readable, instead of a progress thread handing completions
#   over: a control round trip costs one wake-up, not a thread hand-off
#   (measured in bench/H200_NOTES.md). The cost: UCX's own copies
#   (shared-memory rendezvous) run on the loop's thread. Set it to "thread"
#   to move them off.
# - UCXPY_ENABLE_PYTHON_FUTURE (only with a progress thread): a notifier
#   thread wakes the loop per batch of completions instead of every pending
#   request spinning on asyncio.sleep(0).
UCX_DEFAULTS = {
    "UCX_MM_ERROR_HANDLING": "y",
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


def ucxx_module() -> Any:
    """Import ucxx late, after our UCX defaults are in the environment."""
    for key, value in UCX_DEFAULTS.items():
        os.environ.setdefault(key, value)
    threaded = os.environ["UCXPY_PROGRESS_MODE"].startswith("thread")
    os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1" if threaded else "0")
    import ucxx

    return ucxx


def _is_ucx_error(exc: BaseException) -> bool:
    from ucxx.exceptions import UCXError

    return isinstance(exc, UCXError)


@dataclass(eq=False)
class Conn:
    """One UCX endpoint and whether it may still carry another fetch."""

    ep: Any
    peer: str
    broken: bool = False
    # Requests that were still in flight when we gave up on them.
    unsettled: list[asyncio.Task] = field(default_factory=list)

    def abort(self) -> None:
        """Close abruptly: UCX cancels every request still posted on the endpoint."""
        if not self.broken:
            self.broken = True
            try:
                self.ep.abort()
            except Exception:  # already closed by the peer's failure
                log.debug("abort of endpoint to %s failed", self.peer, exc_info=True)

    @property
    def usable(self) -> bool:
        return not self.broken and not self.ep.closed


async def run_ops(conn: Conn, ops: list[Awaitable], deadline: float | None, what: str) -> list:
    """Await UCX operations without ever abandoning one that may still touch memory.

    Cancelling a ucxx coroutine does not cancel its UCX request, which could then
    write into a buffer we freed. So operations run as tasks that are never
    cancelled: on failure, timeout or outer cancellation the endpoint is aborted
    (UCX then cancels its requests) and we wait for them to settle. Tasks that
    do not settle within the grace period are left in ``conn.unsettled``.
    """
    loop = asyncio.get_running_loop()
    tasks = [asyncio.ensure_future(op) for op in ops]
    if not tasks:
        return []
    timeout = None if deadline is None else max(0.0, deadline - loop.time())
    try:
        done, pending = await asyncio.wait(
            tasks, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION
        )
    except BaseException:  # cancelled from outside
        await abort_and_settle(conn, tasks)
        raise
    failed = [t for t in done if t.exception() is not None]
    if not failed and not pending:
        return [t.result() for t in tasks]
    await abort_and_settle(conn, tasks)
    if failed:
        raise _peer_error(failed[0].exception(), conn.peer, what)
    raise PeerTimeout(f"peer {conn.peer}: {what} did not finish within the deadline")


async def abort_and_settle(conn: Conn, tasks: list[asyncio.Task]) -> None:
    conn.abort()
    pending = [t for t in tasks if not t.done()]
    if pending:
        _, still = await asyncio.wait(pending, timeout=ABORT_GRACE_S)
        if still:
            log.error("%d UCX requests to %s did not settle after abort", len(still), conn.peer)
            conn.unsettled.extend(still)
    for t in tasks:  # mark exceptions as retrieved: the first one is reported
        if t.done() and not t.cancelled():
            t.exception()


def _peer_error(exc: BaseException, peer: str, what: str) -> Exception:
    if isinstance(exc, KVError):
        return exc
    if isinstance(exc, ProtocolError):
        return PeerUnavailable(f"peer {peer}: protocol error during {what}: {exc}")
    if _is_ucx_error(exc):
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
        conn.ep.send(np.frombuffer(m, dtype=np.uint8), tag=CONTROL_TAG)
        for m in encode_frame(kind, body)
    ]


async def send_frame(conn: Conn, kind: Kind, deadline: float | None, *, body: bytes) -> None:
    await run_ops(conn, frame_sends(conn, kind, body), deadline, f"sending {kind.name}")


async def recv_frame(
    conn: Conn, expect: Sequence[Kind], deadline: float | None, after: Sequence[Awaitable] = ()
) -> Frame:
    """Receive one frame (awaiting the operations ``after`` alongside: a frame just
    sent, so that a request and its answer cost one wake-up, not two). The first
    message lands in an INLINE_FRAME_BYTES buffer; a longer body, announced by the
    (bounded) preamble, in a buffer of exactly its size."""
    first = np.zeros(INLINE_FRAME_BYTES, dtype=np.uint8)
    await run_ops(
        conn, [*after, conn.ep.recv(first, tag=CONTROL_TAG)], deadline, "waiting for a frame"
    )
    kind, length = decode_preamble(first[: PREAMBLE.size].tobytes(), expect)
    end = PREAMBLE.size + length
    if end <= INLINE_FRAME_BYTES:
        return Frame(kind, length, first[PREAMBLE.size : end].tobytes())
    body = np.empty(length, dtype=np.uint8)
    await run_ops(conn, [conn.ep.recv(body, tag=CONTROL_TAG)], deadline, f"receiving {kind.name}")
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


_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EndpointPool] = (
    weakref.WeakKeyDictionary()
)


def endpoint_pool() -> EndpointPool:
    """The running event loop's pool (ucxx endpoints belong to one loop)."""
    loop = asyncio.get_running_loop()
    if loop not in _POOLS:
        _POOLS[loop] = EndpointPool()
    return _POOLS[loop]


async def close_endpoints() -> None:
    """Drop every pooled endpoint of the running loop (shutdown, tests)."""
    endpoint_pool().close()


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise KVError(Code.INVALID_ARGUMENT, f"bad peer address {address!r}")
    return host.strip("[]"), int(port)


async def connect(address: str, deadline: float) -> Conn:
    host, port = parse_address(address)
    ucxx = ucxx_module()
    remaining = deadline - asyncio.get_running_loop().time()
    if remaining <= 0:
        raise PeerTimeout(f"peer {address}: no time left to connect")
    try:
        ep = await asyncio.wait_for(
            ucxx.create_endpoint(host, port, connect_timeout=remaining), remaining
        )
    except (asyncio.TimeoutError, TimeoutError):
        raise PeerTimeout(f"peer {address}: connect did not finish in {remaining:.1f}s") from None
    except Exception as e:
        if _is_ucx_error(e) or isinstance(e, OSError | RuntimeError):
            raise PeerUnavailable(f"peer {address}: connect failed: {e}") from None
        raise
    return Conn(ep, peer=address)
