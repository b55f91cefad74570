"""Which store node relayed GPU-tier events for which worker.

A store relays its attached workers' GPU-tier events in its batches
(docs/design.md §6); they land in the worker's own domain index (domains.py),
where a relayed block looks like any other of the worker's. A store's snapshot
is its whole state, relays included, so it replaces the GPU tier of every
worker that node relayed for before: this ledger says which those are. It is
kept per node id, not per peer generation, because a store that advertises
again as a new generation sends its snapshot there; a peer that leaves keeps
its entries, as the blocks it relayed are the workers' (they go with the
worker, or with that node's next snapshot). Called under the router's lock.
"""

from __future__ import annotations

from kvstore.router.admission import WorkerRef


class RelayLedger:
    """node id <-> the worker generations it relayed for since its last snapshot."""

    def __init__(self):
        self._workers: dict[str, set[WorkerRef]] = {}  # node id -> workers it relayed for
        self._nodes: dict[WorkerRef, set[str]] = {}  # worker -> nodes that relayed for it

    def record(self, node_id: str, ref: WorkerRef) -> None:
        """``node_id`` relayed an event that applied for worker ``ref``."""
        self._workers.setdefault(node_id, set()).add(ref)
        self._nodes.setdefault(ref, set()).add(node_id)

    def take(self, node_id: str) -> set[WorkerRef]:
        """The workers ``node_id`` relayed for, forgotten here (its snapshot
        records them anew)."""
        refs = self._workers.pop(node_id, set())
        for ref in refs:
            nodes = self._nodes[ref]
            nodes.discard(node_id)
            if not nodes:
                del self._nodes[ref]
        return refs

    def forget_worker(self, ref: WorkerRef) -> None:
        """Worker ``ref`` left (its blocks went with it)."""
        for node_id in self._nodes.pop(ref, set()):
            refs = self._workers[node_id]
            refs.discard(ref)
            if not refs:
                del self._workers[node_id]
