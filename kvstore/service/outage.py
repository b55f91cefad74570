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
FIRST_RETRY_S = 0.5
MAX_RETRY_S = 15.0


class Outage:
    """Whether ``what`` (e.g. ``"store events from HOST:PORT"``) is down, since
    when, and after how many failed tries; logs its changes on ``log``."""

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        then: str = "retrying",
        remind_s: float = REMIND_S,
        first_s: float = FIRST_RETRY_S,
        cap_s: float = MAX_RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``then``: what happens while it is down, said on the first line."""
        self.log = log
        self.what = what
        self.then = then
        self.remind_s = remind_s
        self.first_s, self.cap_s = first_s, cap_s
        self.clock = clock
        self.since: float | None = None  # when the first failed try of this outage was
        self.tries = 0  # failed tries in this outage
        self._told = 0.0  # when it was last logged

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, reason: str) -> None:
        """One more try failed: logged when it begins an outage, or is the first
        failure ``remind_s`` after the outage was last logged."""
        now = self.clock()
        self.tries += 1
        if self.since is None:
            self.since = self._told = now
            self.log.warning("%s lost (%s); %s", self.what, reason, self.then)
        elif now - self._told >= self.remind_s:
            self._told = now
            self.log.warning(
                "%s still down after %.0f s (%d tries; the last: %s)",
                self.what,
                now - self.since,
                self.tries,
                reason,
            )

    def recovered(self, note: str = "") -> None:
        """It answers again: logged once, when it had been down (``note`` is added)."""
        if self.since is None:
            return
        self.log.info(
            "%s resumed after %.1f s (%d failed tries%s)",
            self.what,
            self.clock() - self.since,
            self.tries,
            f"; {note}" if note else "",
        )
        self.since, self.tries = None, 0

    def delay(self) -> float:
        """Seconds to wait before the next try: ``first_s`` after the first
        failure, doubling with each failure since, at most ``cap_s``; 0 when up."""
        if not self.tries:
            return 0.0
        return min(self.first_s * 2 ** min(self.tries - 1, 32), self.cap_s)


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
