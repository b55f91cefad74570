"""One prefix of etcd followed: listed, watched from the next revision, listed again.

    directory = Directory(etcd, layout.stores, listener, "stores")
    directory.start()        # a task: listener.reset(entries), then listener.changed(change)...
    await directory.close()

The listener first gets the whole listing (``reset``: authoritative, it
replaces whatever it held), then every change in revision order. When the
watch breaks (etcd gone or restarted, the revision compacted) the directory
keeps the listener's state as it is, retries with backoff and, once etcd
answers, lists again and hands over the new listing, so a listener converges
on etcd's state without ever dropping what it knew while etcd was away.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from kvstore.membership.etcd import Change, Entry, Etcd, cancel_task
from kvstore.wire.errors import KVError

log = logging.getLogger(__name__)

RETRY_S = 0.2
MAX_RETRY_S = 1.0


class Listener(Protocol):
    def reset(self, entries: list[Entry]) -> None:
        """Everything under the prefix now; replaces what the listener held."""

    def changed(self, change: Change) -> None:
        """One change, in revision order after the last listing."""


class Directory:
    def __init__(self, etcd: Etcd, prefix: str, listener: Listener, what: str):
        self.etcd = etcd
        self.prefix = prefix
        self.listener = listener
        self.what = what
        self.listings = 0  # successful listings so far (tests wait on it)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._follow())

    async def _follow(self) -> None:
        delay, down = RETRY_S, False
        while True:
            try:
                entries, revision = await self.etcd.list_prefix(self.prefix)
                self._deliver(self.listener.reset, entries)
                self.listings += 1
                if down:
                    log.info("%s: etcd answers again; listed %d", self.what, len(entries))
                delay, down = RETRY_S, False
                async for change in self.etcd.watch_prefix(self.prefix, revision + 1):
                    self._deliver(self.listener.changed, change)
            except KVError as exc:
                if not down:
                    log.warning(
                        "%s: %s; keeping what is known, listing again when etcd answers",
                        self.what,
                        exc.message,
                    )
                down = True
            except Exception:  # a bug must not end the following for good, unheard
                log.exception("%s: following etcd failed; listing again", self.what)
                down = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_RETRY_S)

    def _deliver(self, fn, arg) -> None:
        try:
            fn(arg)
        except Exception:  # a listener's bug must not stop following etcd
            log.exception("%s: listener failed", self.what)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_task(task)
