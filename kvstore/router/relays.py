"""Which store node relayed GPU-tier events for which worker.

A store relays its attached workers' GPU-tier events in its batches
(docs/design.md §6); they land in the worker's own domain index (domains.py),
where a relayed block looks like any other of the worker's. A store's snapshot
is its whole state, relays included, so it replaces the GPU tier of every
worker that node relayed for before: this ledger says which those are. It is
kept per node id, not per peer generation, because a store that advertises
again as a new generation sends its snapshot there; a peer that leaves keeps
its entries, as the blocks it relayed are the workers' (they go with the
worker, or with that node's next snapshot).

A worker admitted anew starts with an empty GPU tier (a new generation may be
a new process), and one admitted after a store relayed for it got none of
those relays (dropped: unknown worker). Either way the node ids that relayed
for it are remembered by the worker's *name* (:meth:`RelayLedger.await_worker`)
until it is admitted (:meth:`RelayLedger.admitted`); the router then asks each
of them for its snapshot again. Called under the router's lock.
"""

from __future__ import annotations

from kvstore.router.admission import WorkerRef
from kvstore.wire import limits

# Node ids remembered per worker: a worker is attached to one store, so more is
# churn (a node id advertised anew each time); past it the longest-remembered
# goes, and what it relayed stays until the worker leaves. Bounds the ledger by
# the admitted workers, whatever node ids come and go.
MAX_RELAYERS_PER_WORKER = 16
# Worker names remembered as awaited (relayed for while not admitted, or after
# they left): the names come from the publishers' events, so they are bounded;
# past it the longest-remembered name goes (its nodes are then not asked again).
MAX_AWAITED_WORKERS = 4096


class RelayLedger:
    """node id <-> the worker generations it relayed for since its last snapshot."""

    def __init__(self):
        self._workers: dict[str, set[WorkerRef]] = {}  # node id -> workers it relayed for
        # worker -> nodes that relayed for it, in the order first recorded (a dict as set)
        self._nodes: dict[WorkerRef, dict[str, None]] = {}
        # worker name not admitted now -> nodes that relayed for it (a dict as set),
        # the longest-remembered name first
        self._awaited: dict[str, dict[str, None]] = {}

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
        """Worker ``ref`` left or was replaced (its blocks went with it): the nodes
        that relayed for it are awaited by its name."""
        for node_id in list(self._nodes.get(ref, ())):
            self._unlink(node_id, ref)
            self.await_worker(node_id, ref.name)

    def await_worker(self, node_id: str, name: str) -> None:
        """``node_id`` relayed for ``name`` while no generation of it was admitted
        here (a name no worker may have is not remembered)."""
        if not 0 < len(name) <= limits.MAX_NAME_LEN:
            return
        nodes = self._awaited.pop(name, {})  # back in at the end: the most recent
        if node_id not in nodes and len(nodes) >= MAX_RELAYERS_PER_WORKER:
            del nodes[next(iter(nodes))]
        nodes[node_id] = None
        self._awaited[name] = nodes
        if len(self._awaited) > MAX_AWAITED_WORKERS:
            del self._awaited[next(iter(self._awaited))]

    def admitted(self, name: str) -> list[str]:
        """A generation of ``name`` was admitted: the node ids that relayed for it
        before (they owe it their snapshot), forgotten here."""
        return list(self._awaited.pop(name, ()))

    def nodes_of(self, ref: WorkerRef) -> list[str]:
        """The node ids recorded as relaying for ``ref``, longest-remembered first."""
        return list(self._nodes.get(ref, ()))
