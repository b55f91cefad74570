"""Why the router did not index an event it received, counted by cause.

No event is dropped silently (docs/design.md §6): every event the router
receives and does not index is counted under exactly one cause, and the causes
add up to ``RouterStats.events_dropped``. The two bounds of the index
(bounds.py) count blocks, not events: a stored event's hashes past a bound are
dropped one by one (its leading ones may still be indexed), so
``over_capacity`` and ``index_full`` count the hashes not indexed (one per
event for vLLM's usual one-block BlockStored).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum


class DropCause(StrEnum):
    """One reason an event is not indexed; the value names its counter."""

    STALE_GENERATION = "stale_generation"  # the publishing store's (node, generation) is gone
    SEQUENCE_GAP = "sequence_gap"  # a batch after a lost one, or before any snapshot
    STALE_SEQUENCE = "stale_sequence"  # a batch numbered at or below the last applied one
    UNKNOWN_WORKER = "unknown_worker"  # a worker event for a worker (generation) not admitted
    NOT_INDEXABLE = "not_indexable"  # a store event about another holder, or not final
    UNDECODABLE = "undecodable"  # a feed message that does not decode
    OTHER_KV_GROUP = "other_kv_group"  # vLLM events of KV-cache groups other than 0
    NO_ROOM = "no_room"  # a worker's batch whose new holders a full domain index cannot take
    # a GPU-tier event relayed for a worker the publisher may not speak for
    # (Router.may_relay_for: not its owner, an admin or a --store-cn store
    # publishing as the node the worker is attached to)
    RELAY_REFUSED = "relay_refused"
    # a numbered batch of a node that owes a snapshot: a worker it relayed for
    # was admitted anew (Peer.owes_snapshot), so it is answered resync
    SNAPSHOT_OWED = "snapshot_owed"
    # stored blocks past the bound of the worker tier they were for (its card's
    # capacity_blocks, else --default-capacity-blocks): removals lost, or a card
    # that states too little
    OVER_CAPACITY = "over_capacity"
    # stored blocks past the router-wide bound on blocks held (--max-held-blocks)
    INDEX_FULL = "index_full"


@dataclass
class EventDrops:
    """Dropped events per cause (one field per :class:`DropCause`)."""

    stale_generation: int = 0
    sequence_gap: int = 0
    stale_sequence: int = 0
    unknown_worker: int = 0
    not_indexable: int = 0
    undecodable: int = 0
    other_kv_group: int = 0
    no_room: int = 0
    relay_refused: int = 0
    snapshot_owed: int = 0
    over_capacity: int = 0
    index_full: int = 0

    def add(self, cause: DropCause, count: int = 1) -> None:
        setattr(self, cause.value, getattr(self, cause.value) + count)

    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))
