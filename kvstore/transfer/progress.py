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
* :meth:`LoopProgress.arrival` waits for a message without posting its
  receive, so an idle connection costs nothing until its next frame is queued.
  Waiters probe again when progress is made, at most every ``SWEEP_S`` while
  polling, at each backstop, and on :meth:`LoopProgress.kick` (for progress
  made by someone else, or an endpoint aborted here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

QUIET_S = 0.005  # polled this long after the last progress or operation, then armed
BACKSTOP_S = 1.0  # asleep at most this long: progress once more, whatever the fd says
SWEEP_S = 0.01  # while polling, waiters probe again at least this often
FULL_EVERY = 64  # turns: ucxx's full progress (its scheduled cancels) without activity


class LoopProgress:
    """This process's UCX worker, progressed on one event loop."""

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop):
        self.worker: Any = worker
        self.loop = loop
        worker.init_blocking_progress_mode()
        self._fd = worker.epoll_file_descriptor
        self._in_flight = 0
        self._last_activity = time.monotonic()
        self._last_sweep = 0.0
        self._asleep: asyncio.Future | None = None  # set while the fd is armed
        self._waiters: list[asyncio.Future] = []  # arrivals not yet seen
        self.sleeps = 0  # times the loop went to sleep on the armed fd
        self.task = loop.create_task(self._run(), name="kvstore-ucx-progress")
        self.task.add_done_callback(_report_end)

    def current(self, worker: Any) -> bool:
        """Whether this still progresses ``worker`` (not stopped, not failed)."""
        return self.worker is worker and not self.task.done()

    def retire(self) -> None:
        """Stop progressing (the worker is dropped); the task ends on its next turn."""
        self.worker = None
        self.kick()

    async def stop(self, grace_s: float) -> None:
        """:meth:`retire`, and wait for the task to end."""
        self.retire()
        await asyncio.wait([self.task], timeout=grace_s)

    def kick(self) -> None:
        """Something happened that UCX's fd may not tell: progress made outside
        this loop's turns, or an endpoint aborted here. Poll, and probe again."""
        self._last_activity = time.monotonic()
        self._wake_poller()
        self._wake_arrivals()

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

    async def arrival(self, ep: Any, tag: int, deadline: float | None) -> None:
        """Return once a message with ``tag`` is queued for ``ep``, the endpoint
        failed or closed, or ``deadline`` (loop time) passed: the caller's receive
        then completes (or fails) at once instead of polling while it waits."""
        try:
            async with asyncio.timeout_at(deadline):
                # closed first: an aborted endpoint can no longer be probed (a
                # closed one's last frame, still queued, is the receive's to take)
                while self.worker is not None and not ep.closed and not ep.tag_probe(tag).matched:
                    waiter = self.loop.create_future()
                    self._waiters.append(waiter)
                    await waiter
        except TimeoutError:
            return

    async def _run(self) -> None:
        turn = 0
        while (worker := self.worker) is not None:
            turn += 1
            # progress_once says whether anything happened; progress() drains the
            # rest and cancels what ucxx scheduled for cancelling
            made = worker.progress_once()
            if made or turn % FULL_EVERY == 0:
                worker.progress()
            now = time.monotonic()
            if made:
                self._last_activity = now
            if made or now - self._last_sweep >= SWEEP_S:
                self._last_sweep = now
                self._wake_arrivals()
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
            self._wake_arrivals()  # something may be queued that no event told
        finally:
            self.loop.remove_reader(self._fd)
            self._asleep = None
            self._last_activity = time.monotonic()  # woken: poll until quiet again

    def _wake_poller(self) -> None:
        if self._asleep is not None and not self._asleep.done():
            self._asleep.set_result(None)

    def _wake_arrivals(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


def _report_end(task: asyncio.Task) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error(
            "UCX progress stopped (%s: %s): peer transfers on this loop will time out",
            type(exc).__name__,
            exc,
        )
