"""UCX progress on the event loop: polled while the worker is busy, asleep when idle.

ucxx's ``blocking`` mode progresses the worker when the worker's epoll fd turns
readable, but arms that fd only once: after the first UCX event the fd stays
readable and the loop wakes on every turn, a core busy for as long as the
process lives. And a request awaited without Python futures polls
``asyncio.sleep(0)`` until it completes, so a receive posted for a message that
comes later (a peer's next REQUEST, up to a minute away) spins the loop the
same way.

:class:`LoopProgress` replaces ucxx's progress on a loop (ucxx starts none of
its own where one is installed):

* while one of our operations is in flight (:meth:`LoopProgress.polling`), or
  progress was made in the last ``QUIET_S``, it progresses the worker on every
  turn of the loop, as the spinning requests did: a control round trip costs
  one wake-up;
* then it arms the fd (``ucp_worker_arm``: BUSY while events are pending, so it
  progresses until the arm holds) and the loop sleeps in epoll until the next
  event, or ``BACKSTOP_S`` at most;
* operations are posted at once (kvstore.transfer.ucx ``Posted``) and held
  here, buffers and all, until UCX settles them; :meth:`LoopProgress.completion`
  is a future done on the turn a set of them completes, so the awaiting
  coroutine runs on the next turn (a ucxx request awaited in a task of its own
  polled ``asyncio.sleep(0)``, then woke its waiter through two more turns). A
  wait for a peer's next frame is such a receive, awaited outside
  :meth:`LoopProgress.polling`: the loop sleeps until UCX's fd says it came.
  Code that progresses the worker itself, or aborts an endpoint, calls
  :meth:`LoopProgress.kick`: completions it made are looked at on the next turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Protocol

from kvstore.transfer.errors import PeerUnavailable

log = logging.getLogger(__name__)

QUIET_S = 0.005  # polled this long after the last progress or operation, then armed
BACKSTOP_S = 1.0  # asleep at most this long: progress once more, whatever the fd says
FULL_EVERY = 64  # turns: ucxx's full progress (its scheduled cancels), completions looked at


class Operation(Protocol):
    """A UCX operation already posted: done (or failed) once UCX says so; a failed
    one is settled."""

    @property
    def settled(self) -> bool: ...

    @property
    def failed(self) -> bool: ...


class _Watch(NamedTuple):
    future: asyncio.Future
    ops: Sequence[Operation]
    settle: bool  # wait for every operation, failed or not


class LoopProgress:
    """This process's UCX worker, progressed on one event loop."""

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop):
        self.worker: Any = worker
        self.loop = loop
        worker.init_blocking_progress_mode()
        self._fd = worker.epoll_file_descriptor
        self._in_flight = 0
        self._last_activity = time.monotonic()
        self._asleep: asyncio.Future | None = None  # set while the fd is armed
        self._look = False  # completions may have happened outside our progress
        self._held: list[Operation] = []  # posted, not settled yet
        self._watches: list[_Watch] = []  # looked at on every turn that made progress
        self.sleeps = 0  # times the loop went to sleep on the armed fd
        self.task = loop.create_task(self._run(), name="kvstore-ucx-progress")
        self.task.add_done_callback(_report_end)

    def current(self, worker: Any) -> bool:
        """Whether this still progresses ``worker`` (not stopped, not failed)."""
        return self.worker is worker and not self.task.done()

    def retire(self) -> None:
        """Stop progressing (the worker is dropped); the task ends on its next turn.
        Operations not settled by now never will be (nothing progresses the
        worker any more): whoever waits for them hears why."""
        self.worker = None
        watches, self._watches = self._watches, []
        for watch in watches:
            if not watch.future.done():
                watch.future.set_exception(_stopped())
        self.kick()

    async def stop(self, grace_s: float) -> None:
        """:meth:`retire`, and wait for the task to end."""
        self.retire()
        await asyncio.wait([self.task], timeout=grace_s)

    def kick(self) -> None:
        """Something happened that UCX's fd may not tell: progress made outside
        this loop's turns, or an endpoint aborted here. Poll, and look at the
        held operations on the next turn."""
        self._last_activity = time.monotonic()
        self._look = True
        self._wake_poller()

    @contextlib.contextmanager
    def polling(self) -> Iterator[None]:
        """While the block runs, the worker is progressed on every turn of the loop."""
        self._in_flight += 1
        self._wake_poller()
        try:
            yield
        finally:
            self._in_flight -= 1
            self._last_activity = time.monotonic()

    def hold(self, op: Operation) -> None:
        """Keep a posted operation (and the buffer it holds) until it settles; the
        worker is polled a while (a rendezvous receive goes on in progress)."""
        self._held.append(op)
        self.kick()

    def completion(self, ops: Sequence[Operation], settle: bool = False) -> asyncio.Future:
        """A future done once every operation of ``ops`` settled or, unless
        ``settle``, one of them failed (checked on every turn after progress, on
        the operations not settled when asked: a wait for a frame is one look a
        turn, however many idle connections wait); failed with PeerUnavailable
        once this progress is retired."""
        future = self.loop.create_future()
        if self.worker is None:
            future.set_exception(_stopped())
            return future
        if _finished(ops, settle):
            future.set_result(None)
        else:  # only the operations not settled yet are looked at
            self._watches.append(_Watch(future, [op for op in ops if not op.settled], settle))
        return future

    async def _run(self) -> None:
        turn = 0
        while (worker := self.worker) is not None:
            turn += 1
            # progress_once says whether anything happened; progress() drains the
            # rest and cancels what ucxx scheduled for cancelling
            made = worker.progress_once()
            full = turn % FULL_EVERY == 0
            if made or full:
                worker.progress()
            now = time.monotonic()
            if made:
                self._last_activity = now
            if made or full or self._look:  # requests complete only in progress
                self._look = False
                self._check_operations(prune=full)
            quiet = not self._in_flight and now - self._last_activity >= QUIET_S
            if not quiet or not worker.arm():
                del worker  # a dropped worker must not stay alive in this frame
                await asyncio.sleep(0)
                continue
            del worker
            await self._sleep()

    async def _sleep(self) -> None:
        """Wait on the armed fd (or an operation starting, or the backstop)."""
        self.sleeps += 1
        self._asleep = self.loop.create_future()
        self.loop.add_reader(self._fd, self._wake_poller)
        try:
            async with asyncio.timeout(BACKSTOP_S):
                await self._asleep
        except TimeoutError:
            self._look = True  # something may have completed that no event told
        finally:
            self.loop.remove_reader(self._fd)
            self._asleep = None
            self._last_activity = time.monotonic()  # woken: poll until quiet again

    def _check_operations(self, prune: bool) -> None:
        if prune and self._held:
            self._held = [op for op in self._held if not op.settled]
        self._watches = _unfinished(self._watches)

    def _wake_poller(self) -> None:
        if self._asleep is not None and not self._asleep.done():
            self._asleep.set_result(None)


def _unfinished(watches: list[_Watch]) -> list[_Watch]:
    """Complete the watches whose operations are done; the others, to look at again."""
    left = []
    for watch in watches:
        if watch.future.done():  # its waiter gave up: the operations stay held
            continue
        if _finished(watch.ops, watch.settle):
            watch.future.set_result(None)
        else:
            left.append(watch)
    return left


def _finished(ops: Sequence[Operation], settle: bool) -> bool:
    """Whether every operation settled or, unless ``settle``, one failed. One
    operation (a wait for a frame, as a rule) costs one look: failed ones are settled."""
    if len(ops) == 1:
        return ops[0].settled
    return all(op.settled for op in ops) or (not settle and any(op.failed for op in ops))


def _stopped() -> PeerUnavailable:
    return PeerUnavailable("UCX progress stopped: the worker was dropped")


def _report_end(task: asyncio.Task) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error(
            "UCX progress stopped (%s: %s): peer transfers on this loop will time out",
            type(exc).__name__,
            exc,
        )
