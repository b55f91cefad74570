"""One SGLang rank's link to the store: its registration, and page save/load/query.

Plain Python (no SGLang import). The store is a cache, so nothing here
raises into SGLang: when the store cannot be reached the rank serves without
it (queries miss, loads and saves report failure, SGLang recomputes), logs
it once, and re-registers in the background until the store is back.
"""

from __future__ import annotations

import logging
import threading
import time

from kvstore.client.store_client import KVLayer, RankSession, StoreClient
from kvstore.integrations.sglang.identity import RankIdentity
from kvstore.wire.errors import Code, KVError
from kvstore.wire.limits import MAX_BLOCKS_PER_REQUEST

log = logging.getLogger(__name__)


class RankLink:
    """A rank's registration, kept alive, and the three operations SGLang needs."""

    def __init__(
        self,
        client: StoreClient,
        identity: RankIdentity,
        layers: list[KVLayer],
        *,
        seal_timeout: float = 60.0,
        retry_s: float = 5.0,
        io_timeout: float = 60.0,
    ):
        self.client = client
        self.identity = identity
        self.layers = layers
        self.seal_timeout = seal_timeout
        self.retry_s = retry_s
        self.io_timeout = io_timeout
        self._lock = threading.Lock()
        self._pending: RankSession | None = None  # registered, not yet sealed
        self._session: RankSession | None = None  # sealed at least once
        self._namespace = ""
        self._failing = False
        self._waiting = False  # logged that the other ranks are awaited
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ registration

    def start(self) -> None:
        """Register and wait for the seal once; keep trying in the background."""
        self._attempt(self.seal_timeout)
        self._thread = threading.Thread(
            target=self._keep_registered, daemon=True, name="kvstore-sglang-register"
        )
        self._thread.start()

    def wait_ready(self, timeout: float) -> bool:
        """True once the rank is registered and sealed, waiting at most ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while self._live() is None and time.monotonic() < deadline:
            self._stop.wait(0.05)
        return self._live() is not None

    @property
    def final_namespace(self) -> str:
        return self._namespace

    def _attempt(self, timeout: float) -> None:
        i = self.identity
        with self._lock:
            pending = self._pending
        if pending is None:
            try:
                pending = self.client.register_rank(i.spec, self.layers)
            except KVError as err:
                self._failed("register", err)
                return
            with self._lock:
                self._pending = pending
        try:
            seal = pending.wait_sealed(timeout)
        except KVError as err:
            if pending.error is None and err.code is Code.DEADLINE_EXCEEDED:
                (log.debug if self._waiting else log.info)(
                    "kvstore: rank %d of %s registered, waiting for the other ranks (%d of %d in)",
                    i.rank,
                    i.instance_id,
                    pending.ranks_registered,
                    i.world_size,
                )
                self._waiting = True
                return
            pending.close()
            with self._lock:
                self._pending = None
            self._failed("register", err)
            return
        with self._lock:
            self._session, self._pending = pending, None
            self._namespace = seal.final_namespace
            self._waiting = False
        self._recovered()
        log.info(
            "kvstore: SGLang rank %d of %s sealed as %s (%d layers, page %d tokens, store %s)",
            i.rank,
            i.instance_id,
            seal.final_namespace,
            len(self.layers),
            i.block_size,
            self.client.address,
        )

    def _keep_registered(self) -> None:
        while not self._stop.wait(self.retry_s):
            if self._live() is not None:
                continue
            with self._lock:
                old, self._session = self._session, None
            if old is not None:
                old.close()
                log.warning("kvstore: store %s lost; re-registering", self.client.address)
            self._attempt(self.retry_s)

    def _live(self) -> RankSession | None:
        with self._lock:
            session = self._session
        if session is None or session.error is not None:
            return None
        return session

    # -------------------------------------------------------------- operations

    def save(self, pairs: list[tuple[int, int]]) -> bool:
        """Copy (key, page) pairs of this rank into the store; True when all are stored."""
        session = self._live()
        if session is None:
            return False
        try:
            for chunk in _chunks(pairs):
                session.save(chunk, timeout=self.io_timeout)
        except KVError as err:
            self._failed("save", err)
            return False
        self._recovered()
        return True

    def load(self, pairs: list[tuple[int, int]]) -> int:
        """Copy the longest stored prefix of (key, page) pairs into this rank's pages;
        the number of pages loaded (a prefix of ``pairs``)."""
        session = self._live()
        if session is None or not pairs:
            return 0
        try:
            done = 0
            for chunk in _chunks(pairs):
                n = self._load_prefix(session, chunk)
                done += n
                if n < len(chunk):
                    break
            self._recovered()
            return done
        except KVError as err:
            self._failed("load", err)
            return 0

    def _load_prefix(self, session: RankSession, pairs: list[tuple[int, int]]) -> int:
        try:
            session.load(pairs, timeout=self.io_timeout)
            return len(pairs)
        except KVError as err:
            if err.code is not Code.NOT_FOUND:
                raise
        # a page is missing (never stored, or evicted since the query): load what is there
        n = self._prefix([h for h, _ in pairs])
        if n:
            session.load(pairs[:n], timeout=self.io_timeout)
        return n

    def query(self, keys: list[int]) -> int:
        """Length of the longest stored prefix of ``keys`` (0 while not registered)."""
        session = self._live()
        if session is None or not keys:
            return 0
        try:
            n = self._prefix(keys)
        except KVError as err:
            self._failed("query", err)
            return 0
        self._recovered()
        return n

    def _prefix(self, keys: list[int]) -> int:
        """Longest sealed prefix of ``keys`` in this rank's (sealed, final) namespace."""
        done = 0
        for start in range(0, len(keys), MAX_BLOCKS_PER_REQUEST):
            chunk = keys[start : start + MAX_BLOCKS_PER_REQUEST]
            n = self.client.query(self._namespace, chunk).prefix_blocks
            done += n
            if n < len(chunk):
                break
        return done

    # ------------------------------------------------------------------ health

    def _failed(self, op: str, err: KVError) -> None:
        """Log the first failure after a success as a warning, the rest at debug."""
        with self._lock:
            first, self._failing = not self._failing, True
        i = self.identity
        (log.warning if first else log.debug)(
            "kvstore: %s for rank %d of %s at %s failed (%s); SGLang recomputes what the "
            "store cannot give, retrying every %.0f s",
            op,
            i.rank,
            i.instance_id,
            self.client.address,
            err,
            self.retry_s,
        )

    def _recovered(self) -> None:
        with self._lock:
            was, self._failing = self._failing, False
        if was:
            log.info("kvstore: store %s answers again", self.client.address)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.retry_s + 1)
        with self._lock:
            sessions = [s for s in (self._session, self._pending) if s is not None]
            self._session = self._pending = None
        for session in sessions:
            session.close()


def _chunks(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    return [
        pairs[i : i + MAX_BLOCKS_PER_REQUEST] for i in range(0, len(pairs), MAX_BLOCKS_PER_REQUEST)
    ]
