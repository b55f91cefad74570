"""One SGLang rank's link to the store: its registration, and page save/load/query.

Plain Python (no SGLang import). The store is a cache, so nothing here
raises into SGLang: when the store cannot be reached the rank serves without
it (queries miss, loads and saves report failure, SGLang recomputes), logs
it once, and re-registers in the background until the store is back.

A store that hangs rather than dies (stopped, swapping, partitioned) answers
nothing until the deadlines pass, and SGLang's prefetch and backup threads
would wait out each one (a minute a Save) holding host pages. So once a call
failed for want of an answer (UNAVAILABLE, DEADLINE_EXCEEDED), calls skip the
store, as a miss or a failed save, for ``retry_s``; then one caller asks it a
prefix query (``timeout_s``) before its own call goes, while the others keep
skipping. ``skipped`` counts the calls that did not wait. A prefetch from
peers that fails (a peer slow, hung or gone) turns prefetch off for
``retry_s``, doubled while it keeps failing (at most 5 minutes):
``prefetches_skipped`` counts the queries answered from the node's store alone.
"""

from __future__ import annotations

import logging
import threading
import time

from kvstore.client.kept_rank import KeptRank
from kvstore.client.store_client import KVLayer, RankSession, StoreClient, request_chunks
from kvstore.integrations.sglang.identity import RankIdentity
from kvstore.wire.errors import Code, KVError
from kvstore.wire.limits import MAX_BLOCKS_PER_REQUEST

log = logging.getLogger(__name__)
UNANSWERED = (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED)  # the store, not the request
PROBE_KEY = 1  # any key: the probe asks whether the store answers, not what it holds
MAX_PREFETCH_BACKOFF_S = 300.0


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
        prefetch: bool = False,
    ):
        """``prefetch``: a query whose prefix the store lacks in part asks the
        store to pull the rest from a peer store (waiting ``io_timeout`` at most)."""
        self.client = client
        self.identity = identity
        self.layers = layers
        self.retry_s = retry_s
        self.io_timeout = io_timeout
        self.prefetch = prefetch
        self._rank = KeptRank(
            client,
            identity.spec,
            layers,
            seal_timeout=seal_timeout,
            retry_s=retry_s,
            engine="SGLang",
        )
        self._lock = threading.Lock()
        self._failing = False
        self._unreachable_until = 0.0  # monotonic: skip the store until then
        self._probing = False  # one caller is finding out whether it answers again
        self.skipped = 0
        self._prefetch_off_until = 0.0  # monotonic: no prefetch until then (peers failed)
        self._prefetch_backoff = 0.0
        self.prefetches_skipped = 0

    def start(self) -> None:
        """Register and wait for the seal once; keep trying in the background."""
        self._rank.start()

    def wait_ready(self, timeout: float) -> bool:
        """True once the rank is registered and sealed, waiting at most ``timeout`` s;
        raises the KVError of the store's refusal of the registration
        (KeptRank.wait_ready: retried all the same)."""
        return self._rank.wait_ready(timeout)

    @property
    def final_namespace(self) -> str:
        return self._rank.final_namespace

    # -------------------------------------------------------------- operations

    def save(self, pairs: list[tuple[int, int]]) -> bool:
        """Copy (key, page) pairs of this rank into the store; True when all are stored."""
        session = self._rank.live()
        if session is None or not self._reachable():
            return False
        try:
            for chunk in request_chunks(pairs):
                session.save(chunk, timeout=self.io_timeout)
        except KVError as err:
            self._failed("save", err)
            return False
        self._recovered()
        return True

    def load(self, pairs: list[tuple[int, int]]) -> int:
        """Copy the longest stored prefix of (key, page) pairs into this rank's pages;
        the number of pages loaded (a prefix of ``pairs``)."""
        session = self._rank.live()
        if session is None or not pairs or not self._reachable():
            return 0
        try:
            done = 0
            for chunk in request_chunks(pairs):
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
        session = self._rank.live()
        if session is None or not keys or not self._reachable():
            return 0
        try:
            n = self._prefix(keys)
        except KVError as err:
            self._failed("query", err)
            return 0
        self._recovered()
        if self.prefetch and n < len(keys) <= MAX_BLOCKS_PER_REQUEST:
            if time.monotonic() < self._prefetch_off_until:
                self.prefetches_skipped += 1
            else:
                n = max(n, self._fetched(keys))
        return n

    def _fetched(self, keys: list[int]) -> int:
        """Pull the missing part of ``keys``' prefix from a peer store; the prefix
        the node's store then holds. A failure is a miss, never the store's fault
        (the peer may be slow or gone: the store is not skipped for it)."""
        try:
            got = self.client.prefetch(self._rank.final_namespace, keys, self.io_timeout)
        except KVError as err:
            # a slow or hung peer would cost every miss its fetch timeout on SGLang's
            # one prefetch thread: off for retry_s, doubled while it keeps failing
            self._prefetch_backoff = min(
                2 * self._prefetch_backoff or self.retry_s, MAX_PREFETCH_BACKOFF_S
            )
            self._prefetch_off_until = time.monotonic() + self._prefetch_backoff
            log.warning(
                "kvstore: prefetch of %d pages from peers failed (%s); pages only from "
                "this node's store for %.0f s",
                len(keys),
                err,
                self._prefetch_backoff,
            )
            return 0
        self._prefetch_backoff = 0.0
        if got.fetched_blocks:
            log.debug("kvstore: %d pages fetched from peer %s", got.fetched_blocks, got.peer)
        return got.local_blocks + got.fetched_blocks

    def _prefix(self, keys: list[int]) -> int:
        """Longest sealed prefix of ``keys`` in this rank's (sealed, final) namespace."""
        done = 0
        for start in range(0, len(keys), MAX_BLOCKS_PER_REQUEST):
            chunk = keys[start : start + MAX_BLOCKS_PER_REQUEST]
            n = self.client.query(self._rank.final_namespace, chunk).prefix_blocks
            done += n
            if n < len(chunk):
                break
        return done

    # ------------------------------------------------------------------ health

    def _reachable(self) -> bool:
        """May this call go to the store? No while it is unreachable (the call
        skips it); after ``retry_s``, yes for the one caller whose prefix query
        it answers (see the module docstring)."""
        with self._lock:
            if not self._unreachable_until:
                return True
            if self._probing or time.monotonic() < self._unreachable_until:
                self.skipped += 1
                return False
            self._probing = True
        try:
            self.client.query(self._rank.final_namespace, [PROBE_KEY])
        except KVError as err:
            if err.code in UNANSWERED:
                self._failed("query", err)
                return False  # an answer, even a refusal, says the store is there
        finally:
            with self._lock:
                self._probing = False
        self._recovered()
        return True

    def _failed(self, op: str, err: KVError) -> None:
        """Log the first failure after a success as a warning, the rest at debug;
        a store that did not answer is skipped for ``retry_s``."""
        with self._lock:
            first, self._failing = not self._failing, True
            if err.code in UNANSWERED:
                self._unreachable_until = time.monotonic() + self.retry_s
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
            self._unreachable_until = 0.0
        if was:
            log.info("kvstore: store %s answers again", self.client.address)

    def close(self) -> None:
        self._rank.close()
