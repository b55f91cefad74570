"""Pull blocks this node misses from a peer store that holds them.

Which peers: the router's ``QueryPrefix`` answer for exactly this final
namespace (so a peer with another layout is never asked), or, without a
router, an explicit ``--peer`` list. How: :func:`kvstore.transfer.fetch`
into a :class:`StoreSink` reservation, committed only when every byte is in.
A failed or hung peer costs at most ``timeout_s``; the fetch then retries
once on the next peer that holds the prefix.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvstore.store.blocks import BlockStore
from kvstore.store.peer_store import StoreSink
from kvstore.transfer import PeerTimeout, PeerUnavailable, fetch
from kvstore.wire.errors import KVError, unavailable
from kvstore.wire.peers import PeerPrefix

log = logging.getLogger(__name__)

FindPeers = Callable[[str, list[int]], Awaitable[list[PeerPrefix]]]


@dataclass
class FetchResult:
    local_blocks: int  # prefix already here before the fetch
    fetched_blocks: int  # blocks pulled from the peer
    peer: str = ""

    @property
    def prefix_blocks(self) -> int:
        return self.local_blocks + self.fetched_blocks


class Fetcher:
    def __init__(
        self, store: BlockStore, sink: StoreSink, find_peers: FindPeers, timeout_s: float = 10.0
    ):
        self.store = store
        self.sink = sink
        self.find_peers = find_peers
        self.timeout_s = timeout_s
        self._running: dict[tuple, asyncio.Task] = {}
        self.fetched_blocks = 0  # committed blocks pulled from peers, each counted once

    async def prefetch(self, namespace: str, hashes: list[int]) -> FetchResult:
        """Make the longest prefix of ``hashes`` that any peer holds local."""
        local = len(self.store.sealed_prefix(namespace, hashes))
        missing = hashes[local:]
        if not missing:
            return FetchResult(local, 0)
        key = (namespace, tuple(missing))
        task = self._running.get(key)
        if task is None:  # ranks loading the same blocks share one fetch
            task = asyncio.ensure_future(self._fetch(namespace, missing))
            self._running[key] = task
            task.add_done_callback(lambda _t: self._running.pop(key, None))
        peer, fetched = await asyncio.shield(task)
        return FetchResult(local, fetched, peer)

    async def _fetch(self, namespace: str, missing: list[int]) -> tuple[str, int]:
        peers = await self.find_peers(namespace, missing)
        if not peers:
            return "", 0
        last: KVError | None = None
        for peer in peers[:2]:  # the best, then one retry elsewhere
            want = missing[: peer.prefix_blocks] if peer.prefix_blocks else missing
            try:
                n = await fetch(peer.ucx_address, namespace, want, self.sink, self.timeout_s)
                self.fetched_blocks += n
                log.info(
                    "fetched %d/%d blocks of %s from %s", n, len(missing), namespace, peer.node_id
                )
                return peer.node_id, n
            except (PeerUnavailable, PeerTimeout) as err:
                log.warning(
                    "fetch of %d blocks from %s (%s) failed: %s",
                    len(want),
                    peer.node_id,
                    peer.ucx_address,
                    err,
                )
                last = err
        raise last or unavailable("no peer could serve the fetch")
