"""UCX progress on the event loop: polled while the worker is busy, asleep when idle.

ucxx's ``blocking`` mode progresses the worker when the worker's epoll fd turns
readable, but arms that fd only once: after the first UCX event the fd stays
readable and the loop wakes on every turn, a core at 100 % for as long as the
process lives (measured: a store that served or made one peer fetch used a
whole core, idle, with a pooled endpoint open). And a request awaited without
Python futures polls ``asyncio.sleep(0)`` until it completes, so a receive
posted for a message that comes later (a peer's next REQUEST, up to a minute
away) spins the loop the same way.

:class:`LoopProgress` replaces ucxx's progress on a loop (ucxx starts none of
its own where one is installed):

* after a UCX event, or while one of our operations is in flight
  (:meth:`LoopProgress.busy`), it progresses the worker on every turn of the
  loop, as the spinning requests did: a control round trip costs one wake-up;
* once nothing happened for ``QUIET_S`` it arms the fd (``ucp_worker_arm``:
  BUSY while events are pending, so it progresses until the arm holds) and the
  loop sleeps in epoll until the next event, or ``BACKSTOP_S`` at most;
* :meth:`LoopProgress.arrival` waits for a message without posting its
  receive, so an idle connection costs nothing until its next frame is queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

QUIET_S = 0.005  # polled this long after the last event or operation, then armed
BACKSTOP_S = 1.0  # asleep at most this long: progress once more, whatever the fd says


class LoopProgress:
    """This process's UCX worker, progressed on one event loop."""

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop):
        self.worker: Any = worker
        self.event_loop = loop
        worker.init_blocking_progress_mode()
        self._fd = worker.epoll_file_descriptor
        self._busy = 0
        self._last = time.monotonic()  # the last progress made, or operation ended
        self._asleep: asyncio.Future | None = None  # set while the fd is armed
        self._waiters: list[asyncio.Future] = []  # arrivals waiting while asleep
        self.arms = 0  # times the loop went to sleep on the armed fd
        self.progress_task = loop.create_task(self._run(), name="kvstore-ucx-progress")

    async def stop(self, grace_s: float) -> None:
        """Stop progressing (the worker is being dropped) and wait for the task to end."""
        self.worker = None
        self._wake()
        await asyncio.wait([self.progress_task], timeout=grace_s)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """While the block runs, the worker is progressed on every turn of the loop."""
        self._busy += 1
        self._wake()
        try:
            yield
        finally:
            self._busy -= 1
            self._last = time.monotonic()

    async def arrival(self, ep: Any, tag: int, deadline: float | None) -> None:
        """Return once a message with ``tag`` is queued for ``ep``, the endpoint
        failed or closed, or ``deadline`` (loop time) passed: the caller's receive
        then completes (or fails) at once instead of polling while it waits.

        Probes again whenever progress was made (or the loop woke up)."""
        loop = self.event_loop
        # closed first: an aborted endpoint can no longer be probed (a closed one's
        # last frame, still queued, is the receive's to take)
        while self.worker is not None and not ep.closed and not ep.tag_probe(tag).matched:
            if deadline is not None and loop.time() >= deadline:
                return
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except TimeoutError:
                return

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        loop = self.event_loop
        turn = 0
        while (worker := self.worker) is not None:
            turn += 1
            # progress_once says whether anything happened; progress() drains the
            # rest and cancels what ucxx scheduled for cancelling
            made = worker.progress_once()
            if made or turn % 64 == 0:
                worker.progress()
                # arrivals probe again: something may be queued (every 64th turn
                # too, for a message queued by a progress call elsewhere)
                self._wake_arrivals()
            if made:
                self._last = time.monotonic()
            if self._busy or time.monotonic() - self._last < QUIET_S or not worker.arm():
                del worker  # a dropped worker must not stay alive in this frame
                await asyncio.sleep(0)
                continue
            del worker
            await self._sleep(loop)

    async def _sleep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait on the armed fd (or an operation starting, or the backstop)."""
        self.arms += 1
        self._asleep = loop.create_future()
        loop.add_reader(self._fd, self._wake)
        try:
            async with asyncio.timeout(BACKSTOP_S):
                await self._asleep
        except TimeoutError:
            pass
        finally:
            loop.remove_reader(self._fd)
            self._asleep = None
            self._last = time.monotonic()  # woken: poll until quiet again
            self._wake()  # arrivals probe again (a backstop: something may be queued)

    def _wake(self) -> None:
        if self._asleep is not None and not self._asleep.done():
            self._asleep.set_result(None)
        self._wake_arrivals()

    def _wake_arrivals(self) -> None:
        if not self._waiters:
            return
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
