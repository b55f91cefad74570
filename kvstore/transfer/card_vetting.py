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
MAX_VERDICTS = 1024
_LENGTH_BYTES = 4


class CardVetter:
    """Loads cards in a child process with the NIXL ``module`` and ``backend`` this
    process reads with; safe to share by the fetches of one event loop."""

    def __init__(self, module: str, backend: str):
        self.module, self.backend = module, backend
        self._child: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._verdicts: OrderedDict[bytes, bool] = OrderedDict()
        self._reaping: set[asyncio.Task] = set()
        self.children = 0  # started, for logs and tests

    async def loads(self, metadata: bytes, deadline: float) -> bool | None:
        """True: a child loaded ``metadata`` and lived; False: it died of it or
        NIXL refused it; None: no verdict by ``deadline`` (time.monotonic; nothing
        kept, the next card asks again)."""
        key = blake3.blake3(metadata).digest()
        if (kept := self._verdicts.get(key)) is not None:
            return kept
        async with self._lock:
            if (kept := self._verdicts.get(key)) is not None:
                return kept
            try:
                verdict = await asyncio.wait_for(
                    self._vet(metadata), max(0.0, deadline - time.monotonic())
                )
            except TimeoutError:
                self._kill()  # mid-answer: its next byte would answer the wrong card
                return None
            except BaseException:  # cancelled likewise
                self._kill()
                raise
            self._verdicts[key] = verdict
            while len(self._verdicts) > MAX_VERDICTS:
                self._verdicts.popitem(last=False)
            return verdict

    async def _vet(self, metadata: bytes) -> bool:
        child = await self._running()
        if child is None:
            return False
        assert child.stdin is not None and child.stdout is not None
        try:
            child.stdin.write(len(metadata).to_bytes(_LENGTH_BYTES, "big") + metadata)
            await child.stdin.drain()
            answer = await child.stdout.readexactly(1)
        except (ConnectionError, asyncio.IncompleteReadError):
            code = await child.wait()
            self._child = None
            log.warning(
                "a peer's card ended the process that loaded it (exit %s): not loaded here; "
                "that peer is fetched from two-sided",
                code,
            )
            return False
        return answer == b"\1"

    async def _running(self) -> asyncio.subprocess.Process | None:
        """The child, started if there is none (None: it could not start)."""
        if self._child is not None and self._child.returncode is None:
            return self._child
        env = {k: v for k, v in os.environ.items() if k not in TWO_SIDED_ONLY_ENV}
        # -P: CHILD's folder (modules named wire, errors, ...) stays off sys.path
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-P", str(CHILD), self.module, self.backend,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        self._child, self.children = child, self.children + 1
        assert child.stdout is not None
        try:
            ready = await asyncio.wait_for(child.stdout.readexactly(1), START_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError):
            ready = b""
        if ready != b"R":
            self._kill()
            log.error("the card check process did not start: peers are fetched from two-sided")
            return None
        return child

    def _kill(self) -> None:
        """End the child, if any; it is reaped in the background."""
        child, self._child = self._child, None
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
