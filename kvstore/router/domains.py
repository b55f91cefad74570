"""Workers' own blocks, one prefix index per indexer domain.

A worker's events (its vLLM publisher, or GPU-tier events a store relays for
it) land in the index of its domain (identity.py), holder = (worker ref,
tier) with tier ``gpu`` (its device cache) or ``store`` (its own offload
tier). Workers of one domain share prefix-hit accounting; a domain's index
goes away with its last holder. Called under the router's lock.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.router.admission import Worker, WorkerRef
from kvstore.router.holders import HolderIndex
from kvstore.router.identity import Domain
from kvstore.router.vllm_events import BlockEvent
from kvstore.wire.events import CLEARED, GPU_TIER, STORE_TIER, STORED

LOCAL_TIERS = (GPU_TIER, STORE_TIER)
Holder = tuple[WorkerRef, str]  # (worker generation, tier)


class DomainIndexes:
    """Indexer domain -> :class:`HolderIndex` of (worker ref, tier) holders."""

    def __init__(self):
        self.indexes: dict[Domain, HolderIndex] = {}

    def __len__(self) -> int:
        return len(self.indexes)

    def apply(self, worker: Worker, events: Sequence[BlockEvent]) -> int:
        """Index ``worker``'s events; return how many blocks they stored."""
        index = self.indexes.get(worker.domain)
        if index is None:
            index = self.indexes[worker.domain] = HolderIndex()
        stored = 0
        for event in events:
            if event.kind == CLEARED:
                for tier in LOCAL_TIERS:
                    bit = index.bit_of((worker.ref, tier))
                    if bit is not None:
                        index.clear(bit)
                continue
            bit = index.assign((worker.ref, event.tier))
            if event.kind == STORED:
                index.store(bit, event.hashes)
                stored += len(event.hashes)
            else:
                index.remove(bit, event.hashes)
        return stored

    def forget(self, worker: Worker) -> None:
        """Drop every block of ``worker`` (all tiers), and its domain's index if emptied."""
        index = self.indexes.get(worker.domain)
        if index is None:
            return
        for tier in LOCAL_TIERS:
            index.release((worker.ref, tier))
        if not index.holders():
            del self.indexes[worker.domain]

    def depths(self, workers: Sequence[Worker], hashes: Sequence[int]) -> dict[Holder, int]:
        """Each worker's prefix of ``hashes`` per local tier; holders with no index are left out.

        One prefix walk per domain answers for all of its workers at once.
        """
        by_domain: dict[Domain, list[Holder]] = {}
        for w in workers:
            by_domain.setdefault(w.domain, []).extend((w.ref, tier) for tier in LOCAL_TIERS)
        out: dict[Holder, int] = {}
        for domain, holders in by_domain.items():
            index = self.indexes.get(domain)
            if index is not None:
                out.update(index.holder_depths(hashes, holders))
        return out

    def indexed_blocks(self) -> int:
        return sum(len(i) for i in self.indexes.values())

    def nbytes(self) -> int:
        return sum(i.nbytes() for i in self.indexes.values())
