"""One outage of a peer at the service edge, logged once, not once per try.

A feed or link whose peer is down retries for as long as it stays down; each
failed try is told to an :class:`Outage`, which logs one WARNING when the peer
is lost, a reminder at most every ``remind_s`` while it stays down (how long,
how many tries), and one INFO line when it is back. It also gives the retry
delay: ``first_s`` doubling per failed try up to ``cap_s``.

The clock is injected (``time.monotonic`` by default); nothing here does I/O
but the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvstore.wire.errors import KVError

REMIND_S = 300.0  # a peer still down is logged again at most this often
SETTLE_S = 60.0  # a peer lost again sooner after it came back is flapping
FIRST_RETRY_S = 0.5
MAX_RETRY_S = 15.0


class Outage:
    """Whether ``what`` (e.g. ``"store events from HOST:PORT"``) is down, since
    when, and after how many failed tries; logs its changes on ``log``.

    A peer lost again within ``settle_s`` of coming back (a stream that opens
    and is cut at once) is flapping: its losses and returns are logged at most
    once a ``remind_s`` (how many times it was lost meanwhile), and its retry
    backoff goes on from where the last outage left it rather than starting over.
    """

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        then: str = "retrying",
        remind_s: float = REMIND_S,
        first_s: float = FIRST_RETRY_S,
        cap_s: float = MAX_RETRY_S,
        clock: Callable[[], float] = time.monotonic,
        settle_s: float = SETTLE_S,
    ):
        """``then``: what happens while it is down, said on the first line."""
        self.log = log
        self.what = what
        self.then = then
        self.remind_s = remind_s
        self.settle_s = settle_s
        self.first_s, self.cap_s = first_s, cap_s
        self.clock = clock
        self.since: float | None = None  # when the first failed try of this outage was
        self.tries = 0  # failed tries in this outage
        self._told = 0.0  # when it was last logged
        self._quiet = False  # this outage's loss went unlogged: so does its end
        self._back: float | None = None  # when it last came back
        self._backoff = 0  # failed tries the retry delay counts (kept while flapping)
        self._relapses = 0  # losses soon after a return, not logged yet

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, reason: str) -> None:
        """One more try failed: logged when it begins an outage (a relapse only
        ``remind_s`` after the last line), or is the first failure ``remind_s``
        after the outage was last logged."""
        now = self.clock()
        self.tries += 1
        if self.since is not None:
            self._backoff += 1
            if now - self._told >= self.remind_s:
                self._told, self._quiet = now, False
                self.log.warning(
                    "%s still down after %.0f s (%d tries; the last: %s)",
                    self.what,
                    now - self.since,
                    self.tries,
                    reason,
                )
            return
        self.since = now
        if self._back is None or now - self._back >= self.settle_s:
            self._told, self._quiet, self._backoff, self._relapses = now, False, 1, 0
            self.log.warning("%s lost (%s); %s", self.what, reason, self.then)
            return
        self._backoff += 1  # flapping: back off as if it had stayed down
        self._relapses += 1
        self._quiet = now - self._told < self.remind_s
        if not self._quiet:
            self._told = now
            self.log.warning(
                "%s lost again (%s), %d times within %.0f s of coming back since the last line; %s",
                self.what,
                reason,
                self._relapses,
                self.settle_s,
                self.then,
            )
            self._relapses = 0

    def recovered(self, note: str = "") -> None:
        """It answers again: logged once, when it had been down and that was
        logged (``note`` is added)."""
        if self.since is None:
            return
        if not self._quiet:
            self.log.info(
                "%s resumed after %.1f s (%d failed tries%s)",
                self.what,
                self.clock() - self.since,
                self.tries,
                f"; {note}" if note else "",
            )
        self.since, self.tries, self._back = None, 0, self.clock()

    def delay(self) -> float:
        """Seconds to wait before the next try: ``first_s`` after the first
        failure, doubling with each failure since (and across outages while
        it flaps), at most ``cap_s``; 0 when up."""
        if self.since is None:
            return 0.0
        return min(self.first_s * 2 ** min(self._backoff - 1, 32), self.cap_s)


def grpc_reason(exc: BaseException) -> str:
    """A failure in one line: a gRPC error's (or a :class:`KVError`'s) status code
    and details (never its debug string or traceback), else the exception's type
    and text."""
    if isinstance(exc, KVError):
        return str(exc)  # "CODE: message"
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        name = getattr(code(), "name", code())
        return f"{name}: {details()}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
