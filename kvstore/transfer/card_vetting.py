"""A peer's card is loaded in a child process before this one loads it.

NIXL hands a card's agent metadata to UCX, and UCX's parser of a worker address
asserts rather than fails: a card that is malformed, hostile or from a UCX of
another address version aborts (SIGABRT) or crashes the process that loads it,
which for a store means every block it holds. So the fetching side asks a child
(:mod:`kvstore.transfer.card_check`, one per reader, started on the first new
card and kept) to load each card it has not seen; only a card the child loaded
and lived is loaded here. A child that died is started again for the next card.
Verdicts are kept by the card's digest (``MAX_VERDICTS``, oldest out): a peer's
card is vetted once, not once per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections import OrderedDict
from pathlib import Path

import blake3

from kvstore.transfer.rma import TWO_SIDED_ONLY_ENV

log = logging.getLogger(__name__)

CHILD = Path(__file__).with_name("card_check.py")
START_TIMEOUT_S = 30.0  # a child's NIXL agent up (about 1 s on a 2-core host)
RESTART_AFTER_S = 10.0  # after a child could not start, no new one before this
MAX_VERDICTS = 1024
MAX_HANGS = 2  # a card the child was still loading when time ran out this often: refused
_LENGTH_BYTES = 4


class CardVetter:
    """Loads cards in a child process with the NIXL ``module`` and ``backend`` this
    process reads with; safe to share by the fetches of one event loop."""

    def __init__(self, module: str, backend: str, restart_after_s: float = RESTART_AFTER_S):
        self.module, self.backend = module, backend
        self.restart_after_s = restart_after_s
        self._child: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._verdicts: OrderedDict[bytes, bool] = OrderedDict()
        self._hangs: OrderedDict[bytes, int] = OrderedDict()  # card -> times it outlasted
        self._asking: bytes | None = None  # the card the child is loading now
        self._start_after = 0.0  # time.monotonic() before which no child is started
        self._reaping: set[asyncio.Task] = set()
        self.children = 0  # started, for logs and tests

    async def loads(self, metadata: bytes, deadline: float) -> bool | None:
        """True: a child loaded ``metadata`` and lived; False: it died of it, NIXL
        refused it, or it outlasted MAX_HANGS checks; None: no verdict by
        ``deadline`` (time.monotonic), or no child could start: nothing kept, the
        next card asks again."""
        key = blake3.blake3(metadata).digest()
        if (kept := self._verdicts.get(key)) is not None:
            return kept
        async with self._lock:
            if (kept := self._verdicts.get(key)) is not None:
                return kept
            left = deadline - time.monotonic()
            if left <= 0:  # out of time while another card was checked: the child stays
                return None
            try:
                verdict = await asyncio.wait_for(self._vet(key, metadata), left)
            except TimeoutError:
                if self._asking == key and self._hung(key) >= MAX_HANGS:
                    self._keep(key, False)
                    log.warning("a peer's card outlasted %d checks: not loaded here", MAX_HANGS)
                self._kill()  # mid-answer: its next byte would answer the wrong card
                return None
            except BaseException:  # cancelled likewise
                self._kill()
                raise
            if verdict is not None:
                self._keep(key, verdict)
            return verdict

    def _keep(self, key: bytes, verdict: bool) -> None:
        self._verdicts[key] = verdict
        while len(self._verdicts) > MAX_VERDICTS:
            self._verdicts.popitem(last=False)

    def _hung(self, key: bytes) -> int:
        self._hangs[key] = self._hangs.pop(key, 0) + 1
        while len(self._hangs) > MAX_VERDICTS:
            self._hangs.popitem(last=False)
        return self._hangs[key]

    async def _vet(self, key: bytes, metadata: bytes) -> bool | None:
        child = await self._running()
        if child is None:
            return None
        assert child.stdin is not None and child.stdout is not None
        try:
            child.stdin.write(len(metadata).to_bytes(_LENGTH_BYTES, "big") + metadata)
            self._asking = key
            await child.stdin.drain()
            answer = await child.stdout.readexactly(1)
        except (ConnectionError, asyncio.IncompleteReadError):
            self._asking = None
            code = await child.wait()
            self._child = None
            log.warning(
                "a peer's card ended the process that loaded it (exit %s): not loaded here; "
                "that peer is fetched from two-sided",
                code,
            )
            return False
        self._asking = None  # (left set when cancelled mid-answer: see loads)
        if answer not in (b"\0", b"\1"):  # out of step: no verdict, a fresh child
            log.error("the card check process answered %r: restarted", answer)
            self._kill()
            return None
        return answer == b"\1"

    async def _running(self) -> asyncio.subprocess.Process | None:
        """The child, started if there is none (None: it could not start; none is
        tried again for ``restart_after_s``)."""
        if self._child is not None and self._child.returncode is None:
            return self._child
        if time.monotonic() < self._start_after:
            return None
        env = {k: v for k, v in os.environ.items() if k not in TWO_SIDED_ONLY_ENV}
        # -P: CHILD's folder (modules named wire, errors, ...) stays off sys.path
        try:
            child = await asyncio.create_subprocess_exec(
                sys.executable, "-P", str(CHILD), self.module, self.backend,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
            )  # fmt: skip
        except OSError as exc:  # out of processes or descriptors
            return self._not_started(f"{exc}")
        self._child, self.children = child, self.children + 1
        assert child.stdout is not None
        try:
            ready = await asyncio.wait_for(child.stdout.readexactly(1), START_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError):
            ready = b""
        if ready != b"R":
            self._kill()
            return self._not_started("no ready byte (its stderr says why)")
        return child

    def _not_started(self, why: str) -> None:
        self._start_after = time.monotonic() + self.restart_after_s
        log.error(
            "the card check process did not start (%s): peers are fetched two-sided, a new "
            "one is tried in %.0f s",
            why,
            self.restart_after_s,
        )

    def _kill(self) -> None:
        """End the child, if any; it is reaped in the background."""
        child, self._child, self._asking = self._child, None, None
        if child is None or child.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        with contextlib.suppress(RuntimeError):  # no running loop: the process is ending
            task = asyncio.get_running_loop().create_task(child.wait())
            self._reaping.add(task)
            task.add_done_callback(self._reaping.discard)

    async def close(self) -> None:
        """Stop the child and reap it (it also ends by itself when this process does)."""
        self._kill()
        if self._reaping:
            await asyncio.wait(list(self._reaping), timeout=START_TIMEOUT_S)
