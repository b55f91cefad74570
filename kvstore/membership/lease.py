"""Keys held under one etcd lease: kept alive, and registered again when the lease is lost.

    keeper = LeaseKeeper(config, "store a")            # keeper.py: a thread of its own
    held = KeyLease(etcd, keeper, register, "store a", on_registered=resync)
    await held.register()   # grant a lease, write the keys (KVError if etcd is unreachable)
    held.keep()             # registered again whenever the keeper finds the lease gone
    await held.release()    # revoke: every key of the lease vanishes in one revision

``register(lease)`` writes the keys under ``lease`` and returns their
generation (an etcd revision); ``on_registered(generation)`` hears of every
registration. The keeper refreshes the lease every TTL/3 from its own thread,
from the moment it is granted, so neither a busy event loop here nor a slow
registration lets it lapse. A lease is lost when etcd answers a keepalive
with TTL 0: its holder was silent past the TTL anyway (stopped, partitioned)
or etcd lost its data. The holder then registers again, as a new generation.
While etcd is unreachable registration retries every TTL/3 and nothing local
stops. A registration refused ALREADY_EXISTS (a store's node id held in etcd
by another live store) goes to ``on_refused`` when given, and is tried again
every TTL/3 until it succeeds (the other's lease lapsed); ``on_registered``
then hears of it, and says so (the generic "registered" line is left to it).
A registration refused for another reason than UNAVAILABLE (a worker whose set
now holds another checksum) ends the holding and calls ``on_lost``.

A lease that is gone before the keys are written under it (etcd answers
NOT_FOUND) is replaced by a fresh one, at most ``LEASE_TRIES`` times, then
the registration is UNAVAILABLE and retried later like any other outage.
docs/design.md §5 (On etcd).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar

from kvstore.membership.etcd import Etcd, cancel_task, is_lease_gone
from kvstore.membership.keeper import LeaseKeeper
from kvstore.wire.errors import Code, KVError, unavailable

log = logging.getLogger(__name__)

LEASE_TRIES = 4  # fresh leases granted for one registration before it counts as an outage
T = TypeVar("T")


async def under_new_lease(
    etcd: Etcd, keeper: LeaseKeeper, write: Callable[[int], Awaitable[T]], what: str
) -> tuple[int, T]:
    """Grant a lease, kept alive by ``keeper`` at once, and ``write(lease)``:
    (lease, what ``write`` returned). A lease found gone meanwhile is replaced by
    a fresh one (logged once); after ``LEASE_TRIES`` such leases, UNAVAILABLE."""
    for attempt in range(1, LEASE_TRIES + 1):
        lease = await etcd.grant(keeper.ttl_s)
        keeper.hold(lease)
        try:
            return lease, await write(lease)
        except BaseException as exc:
            keeper.drop(lease)
            with contextlib.suppress(KVError):  # unreachable: it expires on its own
                await etcd.revoke(lease)
            if not is_lease_gone(exc):
                raise
            if attempt == 1:
                log.warning(
                    "%s: lease %x was gone before its keys were written; "
                    "granting a fresh one (at most %d tries)",
                    what,
                    lease,
                    LEASE_TRIES,
                )
    raise unavailable(f"{what}: {LEASE_TRIES} leases were gone before the keys were written")


class KeyLease:
    def __init__(
        self,
        etcd: Etcd,
        keeper: LeaseKeeper,
        register: Callable[[int], Awaitable[int]],
        what: str,
        on_registered: Callable[[int], None] | None = None,
        on_lost: Callable[[], None] | None = None,
        on_refused: Callable[[KVError], None] | None = None,
    ):
        self.etcd = etcd
        self.keeper = keeper
        self.what = what
        self.lease = 0  # 0 while not registered
        self.generation = 0  # of the last registration
        self._register = register
        self._on_registered = on_registered
        self._on_lost = on_lost
        self._on_refused = on_refused
        self._task: asyncio.Task | None = None
        self._gone = asyncio.Event()  # the keeper found the lease gone

    @property
    def ttl_s(self) -> int:
        return self.keeper.ttl_s

    @property
    def interval_s(self) -> float:
        return self.keeper.interval_s

    async def register(self) -> int:
        """Grant a lease and write the keys under it; the new generation."""
        lease, generation = await under_new_lease(self.etcd, self.keeper, self._register, self.what)
        self.adopt(lease, generation)
        if self._on_registered is not None:
            self._on_registered(generation)
        return generation

    def adopt(self, lease: int, generation: int) -> None:
        """Hold keys written under ``lease`` (from a running loop): the keeper
        refreshes it, and its loss is heard here."""
        self.lease, self.generation = lease, generation
        self._gone.clear()
        self.keeper.hold(lease, partial(self._lost, lease))

    def _lost(self, lease: int) -> None:
        if lease == self.lease:
            self._gone.set()

    def keep(self) -> None:
        """Register again whenever the lease is lost (a task on the running loop);
        registers first when not registered yet."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._keep())

    async def alive(self) -> bool:
        """Whether the lease is still alive in etcd now (UNAVAILABLE if unreachable)."""
        return bool(self.lease) and await self.etcd.refresh(self.lease) > 0

    async def _keep(self) -> None:
        unreachable = refused = False
        while True:
            if self.lease:
                await self._gone.wait()
                log.warning(
                    "%s: lease lost (silent past its %d s TTL, or etcd lost its data); "
                    "registering again",
                    self.what,
                    self.ttl_s,
                )
                self.lease = 0
            try:
                generation = await self.register()
            except KVError as exc:
                if exc.code is Code.ALREADY_EXISTS and self._on_refused is not None:
                    self._on_refused(exc)  # logs it, once
                    refused = True
                    await asyncio.sleep(self.interval_s)
                    continue
                if exc.code is not Code.UNAVAILABLE:
                    log.warning("%s: not registered again: %s", self.what, exc.message)
                    if self._on_lost is not None:
                        self._on_lost()
                    return
                if not unreachable:
                    log.warning(
                        "%s: not registered (%s); retrying every %.1f s",
                        self.what,
                        exc.message,
                        self.interval_s,
                    )
                unreachable = True
                await asyncio.sleep(self.interval_s)
                continue
            except Exception:  # a bug: log it and try again, the holding must go on
                log.exception("%s: registering again failed; retrying", self.what)
                await asyncio.sleep(self.interval_s)
                continue
            if not refused:  # else on_registered says so, with why it was refused
                log.info("%s registered (generation %d)", self.what, generation)
            unreachable = refused = False

    async def release(self, revoke: bool = True) -> None:
        """Stop holding; with ``revoke`` also end the lease (its keys vanish now)."""
        if self._task is not None:
            await cancel_task(self._task)
            self._task = None
        lease, self.lease = self.lease, 0
        if lease:
            self.keeper.drop(lease)
        if revoke and lease:
            with contextlib.suppress(KVError):  # unreachable: it expires within the TTL
                await self.etcd.revoke(lease)
