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

# Node ids remembered per worker: a worker is attached to one store, so more is
# churn (a node id advertised anew each time); past it the longest-remembered
# goes, and what it relayed stays until the worker leaves. Bounds the ledger by
# the admitted workers, whatever node ids come and go.
MAX_RELAYERS_PER_WORKER = 16


class RelayLedger:
    """node id <-> the worker generations it relayed for since its last snapshot."""

    def __init__(self):
        self._workers: dict[str, set[WorkerRef]] = {}  # node id -> workers it relayed for
        # worker -> nodes that relayed for it, in the order first recorded (a dict as set)
        self._nodes: dict[WorkerRef, dict[str, None]] = {}

    def record(self, node_id: str, ref: WorkerRef) -> None:
        """``node_id`` relayed an event that applied for worker ``ref``."""
        nodes = self._nodes.setdefault(ref, {})
        if node_id not in nodes and len(nodes) >= MAX_RELAYERS_PER_WORKER:
            self._unlink(next(iter(nodes)), ref)
        self._workers.setdefault(node_id, set()).add(ref)
        nodes[node_id] = None

    def _unlink(self, node_id: str, ref: WorkerRef) -> None:
        """Forget that ``node_id`` relayed for ``ref`` (and either side left empty)."""
        nodes = self._nodes[ref]
        del nodes[node_id]
        if not nodes:
            del self._nodes[ref]
        refs = self._workers[node_id]
        refs.discard(ref)
        if not refs:
            del self._workers[node_id]

    def take(self, node_id: str) -> set[WorkerRef]:
        """The workers ``node_id`` relayed for, forgotten here (its snapshot
        records them anew)."""
        refs = set(self._workers.get(node_id, ()))
        for ref in refs:
            self._unlink(node_id, ref)
        return refs

    def forget_worker(self, ref: WorkerRef) -> None:
        """Worker ``ref`` left (its blocks went with it)."""
        for node_id in list(self._nodes.get(ref, ())):
            self._unlink(node_id, ref)

    def nodes_of(self, ref: WorkerRef) -> list[str]:
        """The node ids recorded as relaying for ``ref``, longest-remembered first."""
        return list(self._nodes.get(ref, ()))
