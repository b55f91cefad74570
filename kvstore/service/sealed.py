"""A store node's sealed blocks at one moment, as the events that open a stream.

    taken = server.sealed()              # on the loop, one step: the keys, copied
    events = await events_of(server.sealed)  # the same, turned into events on a thread

The block index belongs to the event loop, so the keys are copied there, in the
same step as whatever must line up with them (an Events subscription, a resync
marker); grouping them into ``stored`` events is O(blocks) of Python (0.3 s a
million blocks on a 2-core host) and runs on a thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvstore.wire.events import STORED, StoreEvent

HASHES_PER_EVENT = 1024  # block hashes in one snapshot ``stored`` event


class Taken(Protocol):
    """A snapshot taken: its events, made wherever the caller runs this."""

    def events(self) -> list[StoreEvent]: ...


Snapshot = Callable[[], Taken]  # takes one, on the loop


@dataclass(frozen=True)
class Sealed:
    """A node's sealed block keys (``BlockIndex.snapshot()``)."""

    keys: list[tuple[str, int]]
    node_id: str

    def events(self) -> list[StoreEvent]:
        """The keys as STORED events of the node, batched per namespace."""
        by_ns: dict[str, list[int]] = {}
        for ns, block_hash in self.keys:
            by_ns.setdefault(ns, []).append(block_hash)
        n = HASHES_PER_EVENT
        return [
            StoreEvent(STORED, ns, hashes[i : i + n], self.node_id)
            for ns, hashes in by_ns.items()
            for i in range(0, len(hashes), n)
        ]


@dataclass(frozen=True)
class Listed:
    """A snapshot already held as events (a simulated store's)."""

    listed: list[StoreEvent]

    def events(self) -> list[StoreEvent]:
        return self.listed


NOTHING = Listed([])


async def events_of(snapshot: Snapshot) -> list[StoreEvent]:
    """Take ``snapshot`` now, on the loop, and make its events on a thread."""
    taken = snapshot()
    return await asyncio.to_thread(taken.events)
