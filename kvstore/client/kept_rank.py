"""A rank's registration kept alive: what every engine integration needs.

An engine rank registers its layers once, waits for the seal (which needs
every rank of the instance, so it may take a while), and then serves. The
store is a cache, so nothing here raises into the engine: while the store is
down the rank serves without it, and a background thread registers again
until it is back (docs/design.md §7).

A registration that is in but not yet sealed (the other ranks are still
starting) is kept across attempts, never registered twice: a second
RegisterLayers for the same rank would be ALREADY_EXISTS.
"""

from __future__ import annotations

import logging
import threading
import time

from kvstore.client.store_client import KVLayer, RankSession, RankSpec, SealInfo, StoreClient
from kvstore.wire.errors import Code, KVError

log = logging.getLogger(__name__)


class KeptRank:
    """One rank's registration, sealed once and re-made whenever the store is lost."""

    def __init__(
        self,
        client: StoreClient,
        spec: RankSpec,
        layers: list[KVLayer],
        *,
        seal_timeout: float,
        retry_s: float,
        engine: str,
    ):
        self.client = client
        self.spec = spec
        self.layers = layers
        self.seal_timeout = seal_timeout
        self.retry_s = retry_s
        self.engine = engine  # for the logs: "vLLM", "SGLang"
        self._lock = threading.Lock()
        self._pending: RankSession | None = None  # registered, not yet sealed
        self._session: RankSession | None = None  # sealed
        self._namespace = ""
        self._failures = 0  # attempts failed in a row
        self._lost = False  # a sealed session was lost and is being made again
        self._waiting = False  # logged that the other ranks are awaited
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Register and wait for the seal once; keep trying in the background."""
        self._attempt(self.seal_timeout)
        self._thread = threading.Thread(
            target=self._keep, daemon=True, name=f"kvstore-register-{self.spec.rank}"
        )
        self._thread.start()

    def live(self) -> RankSession | None:
        """The sealed session, or None while the store is away.

        A registration whose seal arrived between two attempts (the last rank
        came in) is live at once, not at the next retry tick: saves resume the
        moment the instance seals.
        """
        with self._lock:
            session, pending = self._session, self._pending
        if session is None and pending is not None:
            seal = pending.seal  # read once: a failing stream resets it
            if seal is not None:
                session = self._sealed(pending, seal)
        if session is None or session.error is not None:
            return None
        return session

    def wait_ready(self, timeout: float) -> bool:
        """True once the rank is registered and sealed, waiting at most ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while self.live() is None and time.monotonic() < deadline and not self._stop.is_set():
            self._stop.wait(0.05)
        return self.live() is not None

    @property
    def final_namespace(self) -> str:
        """The sealed namespace ('' before the first seal)."""
        return self._namespace

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.retry_s + 1)
        with self._lock:
            sessions = [s for s in (self._session, self._pending) if s is not None]
            self._session = self._pending = None
        for session in sessions:
            session.close()

    # ----------------------------------------------------------------- attempts

    def _attempt(self, timeout: float) -> None:
        with self._lock:
            pending = self._pending
        if pending is None:
            try:
                pending = self.client.register_rank(self.spec, self.layers)
            except KVError as err:
                self._failed(err)
                return
            except Exception as exc:  # grpc's ValueError on a closed channel, and the like:
                log.exception("kvstore: registering rank %d failed", self.spec.rank)
                self._failed(KVError(Code.UNKNOWN, f"{type(exc).__name__}: {exc}"))
                return  # retried like any failure: this thread must not end
            with self._lock:
                closed = self._stop.is_set()  # close() ran while this registered
                if not closed:
                    self._pending = pending
            if closed:
                pending.close()
                return
        try:
            seal = pending.wait_sealed(timeout)
        except KVError as err:
            if pending.error is None and err.code is Code.DEADLINE_EXCEEDED:
                self._awaiting_others(pending)
                return
            pending.close()
            with self._lock:
                if self._pending is pending:
                    self._pending = None
            self._failed(err)
            return
        self._sealed(pending, seal)

    def _sealed(self, pending: RankSession, seal: SealInfo) -> RankSession | None:
        """Make ``pending`` the live session (once, whichever thread sees the seal first)."""
        with self._lock:
            if self._pending is not pending or self._stop.is_set():
                return self._session
            self._session, self._pending = pending, None
            self._namespace = seal.final_namespace
            self._waiting = False
            failures, self._failures = self._failures, 0
            lost, self._lost = self._lost, False
        s = self.spec
        # back after an outage is a warning, as the loss was: the pair brackets it in the log
        (log.warning if lost or failures else log.info)(
            "kvstore: %s rank %d of %s sealed %sas %s (%d layers, store %s%s)",
            self.engine,
            s.rank,
            s.instance_id,
            "again " if lost else "",
            seal.final_namespace,
            len(self.layers),
            self.client.address,
            f", after {failures} failed attempts" if failures else "",
        )
        return pending

    def _awaiting_others(self, pending: RankSession) -> None:
        s = self.spec
        (log.debug if self._waiting else log.info)(
            "kvstore: rank %d of %s registered, waiting for the other ranks (%d of %d in)",
            s.rank,
            s.instance_id,
            pending.ranks_registered,
            s.world_size,
        )
        self._waiting = True

    def _failed(self, err: KVError) -> None:
        """The first failure in a row is a warning, the rest debug."""
        with self._lock:
            self._failures += 1
            first = self._failures == 1
        s = self.spec
        (log.warning if first else log.debug)(
            "kvstore: rank %d of %s could not register with %s (%s); serving without "
            "the store and retrying every %.1f s",
            s.rank,
            s.instance_id,
            self.client.address,
            err,
            self.retry_s,
        )

    def _keep(self) -> None:
        while not self._stop.wait(self.retry_s):
            if self.live() is not None:
                continue
            with self._lock:
                old = self._session
                if old is not None and old.error is None:
                    continue  # promoted by an engine thread meanwhile: healthy
                self._session = None
                self._lost = self._lost or old is not None
            if old is not None:
                old.close()
                log.warning("kvstore: store %s lost; re-registering", self.client.address)
            self._attempt(self.retry_s)
