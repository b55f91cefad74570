"""Keys held under one etcd lease: kept alive, and registered again when the lease is lost.

    held = KeyLease(etcd, ttl_s, register, "store a", on_registered=resync)
    await held.register()   # grant a lease, write the keys (KVError if etcd is unreachable)
    held.keep()             # keepalive every ttl_s / 3; registers again when the lease is gone
    await held.release()    # revoke: every key of the lease vanishes in one revision

``register(lease)`` writes the keys under ``lease`` and returns their
generation (an etcd revision); ``on_registered(generation)`` hears of every
registration. A lease is lost when etcd answers a keepalive with TTL 0: its
holder was silent past the TTL (hung, stopped, partitioned) or etcd lost its
data. The holder then registers again, as a new generation. While etcd is
unreachable the keepalive just keeps trying and nothing local stops. A
registration refused for another reason than UNAVAILABLE (a worker whose set
now holds another checksum) ends the holding and calls ``on_lost``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from kvstore.membership.etcd import Etcd
from kvstore.wire.errors import Code, KVError

log = logging.getLogger(__name__)


class KeyLease:
    def __init__(
        self,
        etcd: Etcd,
        ttl_s: int,
        register: Callable[[int], Awaitable[int]],
        what: str,
        on_registered: Callable[[int], None] | None = None,
        on_lost: Callable[[], None] | None = None,
    ):
        self.etcd = etcd
        self.ttl_s = ttl_s
        self.what = what
        self.lease = 0  # 0 while not registered
        self.generation = 0  # of the last registration
        self._register = register
        self._on_registered = on_registered
        self._on_lost = on_lost
        self._task: asyncio.Task | None = None
        self._unreachable = False

    @property
    def interval_s(self) -> float:
        return self.ttl_s / 3

    async def register(self) -> int:
        """Grant a lease and write the keys under it; the new generation."""
        lease = self.lease = await self.etcd.grant(self.ttl_s)  # ours while it registers
        try:
            generation = await self._register(lease)
        except BaseException:
            self.lease = 0
            with contextlib.suppress(KVError):  # unreachable: it expires on its own
                await self.etcd.revoke(lease)
            raise
        self.adopt(lease, generation)
        if self._on_registered is not None:
            self._on_registered(generation)
        return generation

    def adopt(self, lease: int, generation: int) -> None:
        """Hold keys someone already wrote under ``lease``."""
        self.lease, self.generation = lease, generation

    def keep(self) -> None:
        """Keep the lease alive from now on (a task on the running loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._keepalive())

    async def alive(self) -> bool:
        """Whether the lease is still alive in etcd now (UNAVAILABLE if unreachable)."""
        return bool(self.lease) and await self.etcd.refresh(self.lease) > 0

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self._renew()
            except KVError as exc:
                if exc.code is not Code.UNAVAILABLE:
                    log.warning("%s: not registered again: %s", self.what, exc.message)
                    self.lease = 0
                    if self._on_lost is not None:
                        self._on_lost()
                    return
                if not self._unreachable:
                    log.warning(
                        "%s: %s; keeping the last registration, retrying every %.1f s",
                        self.what,
                        exc.message,
                        self.interval_s,
                    )
                self._unreachable = True
                continue
            if self._unreachable:
                log.info("%s: etcd reachable again (generation %d)", self.what, self.generation)
            self._unreachable = False

    async def _renew(self) -> None:
        if self.lease and await self.etcd.refresh(self.lease) > 0:
            return
        if self.lease:
            log.warning(
                "%s: lease lost (silent past its %d s TTL, or etcd lost its data); "
                "registering again",
                self.what,
                self.ttl_s,
            )
            self.lease = 0
        generation = await self.register()
        log.info("%s registered (generation %d)", self.what, generation)

    async def release(self, revoke: bool = True) -> None:
        """Stop the keepalive; with ``revoke`` also end the lease (its keys vanish now)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        lease, self.lease = self.lease, 0
        if revoke and lease:
            with contextlib.suppress(KVError):  # unreachable: it expires within the TTL
                await self.etcd.revoke(lease)
