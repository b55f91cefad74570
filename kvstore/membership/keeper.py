"""Lease keepalives on a thread of their own, so a busy event loop cannot starve them.

    keeper = LeaseKeeper(config, "store a")
    keeper.hold(lease, on_lost)   # from a running loop: refreshed every TTL/3 from now on
    keeper.drop(lease)            # no longer refreshed (revoke it yourself to end it now)
    keeper.close()                # stop refreshing; the thread ends (joined)

A process's event loop also decodes and indexes events and builds snapshots;
a burst of them (200 stores sending 4M blocks at once) held loops past a 2 s
TTL, and keepalives on those loops lapsed. The keeper refreshes every lease
it holds from a daemon thread running its own asyncio loop with its own etcd
client (its own gRPC channel), so a refresh waits for the interpreter lock at
most one switch interval (5 ms) of someone else's CPU-bound work, never for
their loop. When etcd answers a refresh with TTL 0 (the process was silent
past the TTL anyway: stopped, partitioned, or etcd lost its data) the keeper
stops refreshing that lease and calls its ``on_lost`` on the loop that held
it, where the holder registers again (``lease.py``). docs/design.md §5.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

from kvstore.membership.etcd import Etcd, EtcdConfig
from kvstore.wire.errors import KVError

log = logging.getLogger(__name__)

THREAD_NAME = "kvstore-lease-keeper"
CLOSE_S = 5.0  # close() waits this long for the thread at most


class Holder(NamedTuple):
    """Who to tell, and on which loop, when a lease is found gone."""

    loop: asyncio.AbstractEventLoop | None
    on_lost: Callable[[], None] | None


class LeaseKeeper:
    """Every lease of one process (or of one simulated store group), kept alive."""

    def __init__(self, config: EtcdConfig, what: str):
        self.config = config
        self.what = what
        self.refreshed = 0  # refreshes etcd answered alive (tests and logs read it)
        self._held: dict[int, Holder] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._unreachable = False

    @property
    def ttl_s(self) -> int:
        return self.config.ttl_s

    @property
    def interval_s(self) -> float:
        return self.config.ttl_s / 3

    @property
    def attempt_s(self) -> float:
        """One refresh's bound on one endpoint: a refresh that tries every endpoint
        ends within one interval, so a lease is tried again before it lapses even
        when one endpoint is blackholed (the 2 s call bound would outlast a TTL of 2)."""
        return min(self.config.timeout_s, self.interval_s / len(self.config.endpoints))

    def hold(self, lease: int, on_lost: Callable[[], None] | None = None) -> None:
        """Refresh ``lease`` from now on; ``on_lost`` runs on the calling loop once
        etcd says the lease is gone."""
        loop = asyncio.get_running_loop() if on_lost is not None else None
        with self._lock:
            if self._closed:
                return
            self._held[lease] = Holder(loop, on_lost)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                self._thread.start()

    def drop(self, lease: int) -> None:
        with self._lock:
            self._held.pop(lease, None)

    def holds(self, lease: int) -> bool:
        with self._lock:
            return lease in self._held

    def close(self) -> None:
        """Stop refreshing and end the thread (blocking: from a loop, use ``aclose``)."""
        with self._lock:
            self._closed = True
            self._held.clear()
            thread = self._thread
        if thread is None:
            return
        if self._ready.wait(CLOSE_S) and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # its loop has ended already
                self._loop.call_soon_threadsafe(self._stop.set)
        thread.join(CLOSE_S)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    # -- the thread ----------------------------------------------------------

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._keep())
        finally:
            loop.close()

    async def _keep(self) -> None:
        etcd = Etcd(replace(self.config, timeout_s=self.attempt_s))
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        try:
            while not self._stop.is_set():
                tick = time.monotonic() + self.interval_s
                with self._lock:
                    leases = list(self._held)
                await self._refresh(etcd, leases)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, tick - time.monotonic())):
                        await self._stop.wait()
        finally:
            await etcd.close()

    async def _refresh(self, etcd: Etcd, leases: list[int]) -> None:
        """One round: every lease refreshed (``Etcd.refresh_all``: a stream per
        KEEPALIVE_STREAM_LEASES leases); a lease etcd says is gone is dropped and
        its holder told; failures are logged (``_report``)."""
        try:
            refreshed = await etcd.refresh_all(leases)
        except KVError as exc:  # unreachable: try again next tick, the leases may still live
            self._report(len(leases), len(leases), exc.message)
            return
        except Exception as exc:  # nothing may end the keeper's thread: log, retry
            log.exception("%s: lease keepalives failed", self.what)
            self._report(len(leases), len(leases), f"lease keepalives: {exc!r}")
            return
        for lease, ttl in refreshed.ttls.items():
            if ttl > 0:
                self.refreshed += 1
            else:
                self._lost(lease)
        answered = len(refreshed.ttls)
        why = f"; {refreshed.failure.message}" if refreshed.failure is not None else ""
        self._report(len(leases) - answered, len(leases), f"etcd answered {answered}{why}")

    def _lost(self, lease: int) -> None:
        with self._lock:
            holder = self._held.pop(lease, None)
        if holder is None or holder.on_lost is None:
            return
        with contextlib.suppress(RuntimeError):  # the holder's loop has ended: nobody to tell
            holder.loop.call_soon_threadsafe(holder.on_lost)

    def _report(self, failed: int, tried: int, reason: str) -> None:
        """Log a round's failures when they begin, and when they end."""
        if failed and not self._unreachable:
            log.warning(
                "%s: %d of %d lease keepalives failed (%s); retrying every %.1f s",
                self.what,
                failed,
                tried,
                reason,
                self.interval_s,
            )
        elif not failed and self._unreachable:
            log.info("%s: lease keepalives answered again", self.what)
        self._unreachable = bool(failed)
