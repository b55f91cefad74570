"""Workers' own blocks, one prefix index per indexer domain.

A worker's events (its vLLM publisher, or GPU-tier events a store relays for
it) land in the index of its domain (identity.py), holder = (worker ref,
tier) with tier ``gpu`` (its device cache) or ``store`` (its own offload
tier). Workers of one domain share prefix-hit accounting; a domain's index
goes away with its last holder. Each tier of a worker holds at most its
bound (:meth:`DomainIndexes.limit_of`, bounds.py), and every index shares the
router's ``IndexBudget``. Called under the router's lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvstore.router.admission import Worker, WorkerRef
from kvstore.router.bounds import DEFAULT_CAPACITY_BLOCKS, NONE_REFUSED, IndexBudget, Refused
from kvstore.router.holders import HolderIndex
from kvstore.router.identity import Domain
from kvstore.router.vllm_events import EventRun
from kvstore.wire import limits
from kvstore.wire.errors import exhausted
from kvstore.wire.events import GPU_TIER, STORE_TIER

LOCAL_TIERS = (GPU_TIER, STORE_TIER)
Holder = tuple[WorkerRef, str]  # (worker generation, tier)


@dataclass(frozen=True)
class TierFill:
    """How many blocks one tier of a worker has indexed, of how many it may."""

    held: int
    limit: int


class DomainIndexes:
    """Indexer domain -> :class:`HolderIndex` of (worker ref, tier) holders."""

    def __init__(
        self,
        budget: IndexBudget | None = None,
        default_capacity: int = DEFAULT_CAPACITY_BLOCKS,
    ):
        self.indexes: dict[Domain, HolderIndex] = {}
        self.budget = budget if budget is not None else IndexBudget()
        self.default_capacity = default_capacity

    def __len__(self) -> int:
        return len(self.indexes)

    def limit_of(self, worker: Worker, tier: str) -> int:
        """The most blocks ``worker``'s ``tier`` is indexed for: its card's
        capacity_blocks (the default when it states none); its offload tier the
        larger of the two (a CPU or disk tier outgrows the device cache)."""
        stated = worker.card.capacity_blocks or self.default_capacity
        return stated if tier == GPU_TIER else max(stated, self.default_capacity)

    def apply(self, worker: Worker, runs: Sequence[EventRun]) -> dict[str, Refused]:
        """Index ``worker``'s events (``vllm_events.EventRun``s), in order; the
        blocks each tier could not take (its bound, or the budget) are returned
        by tier (tiers that refused none are left out)."""
        index = self.indexes.get(worker.domain)
        if index is None:
            index = self.indexes[worker.domain] = HolderIndex(budget=self.budget)
        refused: dict[str, Refused] = {}
        for run in runs:
            if run.cleared_first:  # the device cache was reset: its offload tier stays
                bit = index.bit_of((worker.ref, GPU_TIER))
                if bit is not None:
                    index.clear(bit)
            for tier, ops in run.tiers.items():
                if ops.hashes:
                    bit = index.assign((worker.ref, tier), self.limit_of(worker, tier))
                    more = index.update(bit, ops.hashes, ops.keeps)
                    if more:
                        refused[tier] = refused.get(tier, NONE_REFUSED) + more
        return refused

    def fill(self, worker: Worker, tier: str) -> TierFill:
        """Blocks ``worker``'s ``tier`` holds now, and its bound (O(1))."""
        limit = self.limit_of(worker, tier)
        index = self.indexes.get(worker.domain)
        bit = index.bit_of((worker.ref, tier)) if index is not None else None
        return TierFill(index.held(bit) if bit is not None else 0, limit)

    def check_room(self, holders: Iterable[tuple[Worker, str]]) -> None:
        """RESOURCE_EXHAUSTED when the (worker, tier) holders new to their
        domains' indexes do not all fit: checked before a batch applies."""
        new: dict[Domain, set[Holder]] = {}
        for worker, tier in holders:
            index = self.indexes.get(worker.domain)
            if index is None or index.bit_of((worker.ref, tier)) is None:
                new.setdefault(worker.domain, set()).add((worker.ref, tier))
        for domain, fresh in new.items():
            index = self.indexes.get(domain)
            room = index.room() if index is not None else limits.MAX_WORKERS_PER_DOMAIN
            if len(fresh) > room:
                raise exhausted(
                    f"events: {len(fresh)} new holders for domain {domain}, "
                    f"whose index has room for {room}"
                )

    def forget(self, worker: Worker, tiers: Sequence[str] = LOCAL_TIERS) -> None:
        """Drop every block of ``worker`` in ``tiers`` (by default all), and its
        domain's index if emptied."""
        index = self.indexes.get(worker.domain)
        if index is None:
            return
        for tier in tiers:
            index.release((worker.ref, tier))
        if not index.holders():
            del self.indexes[worker.domain]

    def depths(self, workers: Sequence[Worker], hashes: Sequence[int]) -> dict[Holder, int]:
        """Each worker's prefix of ``hashes`` per local tier; misses are left out."""
        mine = {(w.ref, tier) for w in workers for tier in LOCAL_TIERS}
        hits = self.hits({w.domain for w in workers}, hashes)
        return {holder: depth for holder, depth in hits.items() if holder in mine}

    def hits(self, domains: Iterable[Domain], hashes: Sequence[int]) -> dict[Holder, int]:
        """The prefix of ``hashes`` of every holder in ``domains`` that has at
        least its first block. One prefix walk per domain answers for all of its
        holders at once, and costs nothing per holder that misses (a route's
        many workers without the prefix)."""
        out: dict[Holder, int] = {}
        for domain in domains:
            index = self.indexes.get(domain)
            if index is not None:
                out.update(index.holder_depths(hashes))
        return out

    def indexed_blocks(self) -> int:
        return sum(len(i) for i in self.indexes.values())

    def nbytes(self) -> int:
        return sum(i.nbytes() for i in self.indexes.values())
