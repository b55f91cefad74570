"""A rank's registration kept alive: what every engine integration needs.

An engine rank registers its layers once, waits for the seal (which needs
every rank of the instance, so it may take a while), and then serves. The
store is a cache, so nothing here raises into the engine's serving path
(``start``, ``live``): while the store is down the rank serves without it,
and a background thread registers again until it is back (docs/design.md §7).

A registration that is in but not yet sealed (the other ranks are still
starting) is kept across attempts, never registered twice: a second
RegisterLayers for the same rank would be ALREADY_EXISTS.

A failure that another attempt can cure (the store down or restarting,
unreachable, slow, this rank's previous session not yet reaped) is retried
every ``retry_s`` and logged once an outage. So is a store short of its own
resources (:data:`STORE_SHORTAGE_CODES`: file descriptors, memory, GPU memory
to map this rank's KV cache), logged as the store's problem for its operator to
fix as the message says, never as this registration's. A refusal
(:data:`REFUSAL_CODES`: the store judged this registration and said no) is
logged once at ERROR with what to fix, and :meth:`KeptRank.wait_ready` raises it instead of waiting
out its timeout; it is still retried every ``retry_s``, because some pass
later without the engine changing anything: a check against the instance's
other ranks while a previous engine's ranks under the same instance id are
still held, a namespace another tenant's ranks hold, a store restarted with
its configuration fixed. Layers this client cannot describe to the store
(its own geometry check) end the attempts: they never change.
"""

from __future__ import annotations

import logging
import threading
import time

from kvstore.client.store_client import KVLayer, RankSession, RankSpec, SealInfo, StoreClient
from kvstore.wire.errors import Code, KVError

log = logging.getLogger(__name__)

# The store judged the registration and refused it: its fields, layers or memory,
# how they fit the instance's other ranks and this store, or who may use the
# namespace. Logged as an ERROR saying what to fix and raised by wait_ready, but
# retried like the rest: the other ranks or the store may change (see above).
# The rest is an outage: UNAVAILABLE (the store down or restarting, TLS failing,
# the node out of file descriptors), DEADLINE_EXCEEDED, CANCELLED, ALREADY_EXISTS
# (this rank's previous session, or another process's, is still registered: it
# goes once its call ends), INTERNAL and UNKNOWN (a store fault a restart may cure).
REFUSAL_CODES = frozenset(
    {Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION, Code.PERMISSION_DENIED, Code.UNAUTHENTICATED}
)
# The store ran short of its own resources taking the registration (out of file
# descriptors or memory mapping this rank's KV cache): an outage, retried, but
# logged as the store's to fix, not this rank's.
STORE_SHORTAGE_CODES = frozenset({Code.RESOURCE_EXHAUSTED})
_SHORTAGE_NOTE = (
    "; the store is short of its own resources, nothing is wrong with this rank's "
    "registration: the store's operator must act as the store says"
)

# What to do about a refusal, by code (the message names the field, layer and rank).
_FIXES = {
    Code.INVALID_ARGUMENT: "fix the registration it names (this rank's, or the engine "
    "configuration that makes the ranks disagree; a previous engine's ranks under this "
    "instance id must leave first)",
    Code.FAILED_PRECONDITION: "make the store able to map this memory and seal the instance "
    "as it says (same node, same user, a pool on the device; every layer owned by a tp_rank)",
    Code.PERMISSION_DENIED: "register with the certificate that owns this client namespace "
    "and instance, or under another namespace / instance id",
    Code.UNAUTHENTICATED: "give the engine a client certificate the store accepts "
    "(with a subject CN)",
}
_LAYER_FIX = (
    "the store copies whole blocks of a paged KV cache and cannot copy this tensor; give "
    "kvstore KV-cache tensors in a layout it supports (KVLayer, docs/design.md §3), "
    "then restart the engine"
)


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
        self._traced = False  # an unexpected exception's traceback was logged this outage
        self._refused: KVError | None = None  # the last attempt's refusal (cleared by a seal)
        self._final = False  # layers the client cannot describe: no more attempts
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Register and wait for the seal once; keep trying in the background."""
        self._attempt(self.seal_timeout)
        if self._final:
            return  # nothing to keep trying
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
        """True once the rank is registered and sealed, waiting at most ``timeout`` s;
        False when it is not by then (the store away, the other ranks not in).

        Raises the :class:`KVError` of a refusal (:attr:`refused`) at once: the
        rank is not ready until what it names is fixed, and waiting it out would
        hide why.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.live() is not None:
                return True
            refused = self._refused
            if refused is not None:
                raise KVError(refused.code, refused.message) from refused.__cause__
            if time.monotonic() >= deadline or self._stop.is_set():
                return False
            self._stop.wait(0.05)

    @property
    def refused(self) -> KVError | None:
        """Why the last attempt was refused (:data:`REFUSAL_CODES`, or layers the
        client cannot describe), or None: not refused, or sealed since."""
        return self._refused

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
            except Exception as exc:  # noqa: BLE001 - this thread must not end: sorted below
                refusal = self._layers_refusal()
                if refusal is not None:  # the client's own check of its layers: final
                    self._refuse(refusal, _LAYER_FIX, final=True)
                else:  # grpc's ValueError on a closed channel, and the like: retried
                    self._failed(KVError(Code.UNKNOWN, f"{type(exc).__name__}: {exc}"), exc)
                return
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
            self._waiting = self._traced = False
            refused, self._refused = self._refused, None
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
        if refused is not None:
            log.warning(
                "kvstore: rank %d of %s taken by the store after its refusal (%s)",
                s.rank,
                s.instance_id,
                refused.code.name,
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

    def _layers_refusal(self) -> KVError | None:
        """Why this client cannot describe its layers to the store (a tensor whose
        blocks the store cannot copy, a host tensor outside shared memory), or None.
        The layers never change, so neither does the answer: asked only when
        registering raised something other than a KVError."""
        for layer in self.layers:
            try:
                layer.spec()
            except Exception as exc:  # noqa: BLE001 - whatever it is, the layer is at fault
                err = KVError(
                    Code.INVALID_ARGUMENT,
                    f"layer {layer.name!r} of rank {self.spec.rank} cannot be registered: "
                    f"{type(exc).__name__}: {exc}",
                )
                err.__cause__ = exc
                return err
        return None

    def _failed(self, err: KVError, exc: BaseException | None = None) -> None:
        """A failed attempt, retried. A refusal is logged at ERROR once until the
        rank seals; any other failure, its first in a row a warning, the rest debug.
        ``exc``: an unexpected exception behind ``err``, its traceback logged once an
        outage."""
        if err.code in REFUSAL_CODES:
            with self._lock:
                self._failures += 1
            self._refuse(err)
            return
        with self._lock:
            self._failures += 1
            first = self._failures == 1
            trace = exc is not None and not self._traced
            self._traced = self._traced or trace
        s = self.spec
        (log.warning if first or trace else log.debug)(
            "kvstore: rank %d of %s could not register with %s (%s)%s; serving without "
            "the store and retrying every %.1f s",
            s.rank,
            s.instance_id,
            self.client.address,
            err,
            _SHORTAGE_NOTE if err.code in STORE_SHORTAGE_CODES else "",
            self.retry_s,
            exc_info=exc if trace else None,
        )

    def _refuse(self, err: KVError, fix: str = "", final: bool = False) -> None:
        """Say what to fix (once until the rank seals) and hand it to the waiters;
        ``final``: no attempt can succeed, stop them."""
        fix = fix or _FIXES[err.code]
        refused = KVError(err.code, f"{err.message}; {fix}")
        refused.__cause__ = err.__cause__
        with self._lock:
            first = self._refused is None
            self._refused, self._final = refused, final
        if not first:
            return
        s = self.spec
        log.error(
            "kvstore: %s rank %d of %s cannot register with %s (%s); it serves without "
            "the store and %s",
            self.engine,
            s.rank,
            s.instance_id,
            self.client.address,
            refused,
            "no longer retries" if final else f"retries every {self.retry_s:.1f} s",
        )

    def _keep(self) -> None:
        while not self._final and not self._stop.wait(self.retry_s):
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
