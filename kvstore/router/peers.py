"""Store peers and their sealed blocks, indexed per final namespace.

A store server advertises itself (node id, gRPC and UCX addresses, the final
namespaces it serves) and streams its events. Its blocks go into one index
*per final namespace* (holder = (node id, tier)), never a shared one: the
final namespace carries the layout fingerprint, so keying by it is what makes
"only peers with the same final namespace are ever asked" (docs/design.md
§4, §5) true by construction. QueryPrefix reads exactly one of these indexes.

Every advertisement gets a generation; a re-advertisement without one is a
restart, which clears the old generation's blocks. An optional lease makes a
silent peer expire. A new advertisement (generation 0) of a node id whose peer
is still live at another store address is refused ALREADY_EXISTS until that
peer's lease lapses or it leaves: two stores started with one ``--node-id``
would otherwise take the entry from each other on every re-advertisement
(the router's view of the node flipping between them). A store restarting at
its own address still replaces its old entry at once; the UCX address does not
count (a restarted store may listen for peer reads elsewhere). Replicas on
etcd instead ``join`` peers with the generation etcd gave them (their key's
create revision, the same on every replica); etcd's lease is their liveness,
and the check is made in etcd: a store's registration does not take
``stores/<node id>`` from a live store at another address (service/router_link.py).

A peer's event batches may be numbered (``seq``, per node and generation, one
more per batch; docs/design.md §6): :meth:`Peer.sequence_fault` says whether a
batch follows the last one applied, and :meth:`Peers.forget_blocks` empties a
peer's index when a snapshot replaces it wholesale.

A store advertises no pool size, so its blocks have no bound of their own:
they count against the router's ``IndexBudget`` (bounds.py), which every
index shares, and a stored block past it is not indexed.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.router.bounds import NONE_REFUSED, IndexBudget, Refused
from kvstore.router.drops import DropCause
from kvstore.router.holders import HolderIndex
from kvstore.wire import limits
from kvstore.wire.errors import exhausted, exists, not_found
from kvstore.wire.events import REMOVED, STORE_TIER, STORED, StoreEvent
from kvstore.wire.peers import PeerPrefix
from kvstore.wire.principal import LOCAL, Principal, check_owner, check_quota, owned_by

log = logging.getLogger(__name__)

Holder = tuple[str, str]  # (node id, tier)


# Worker names a peer is remembered to have relayed for in vain (Peer.awaited):
# a store relays for the few workers of its node; the names come from its events.
MAX_AWAITED_PER_PEER = 32
# Store addresses refused a live peer's node id that are remembered (and so
# warned of once) per peer: past it, further ones are refused unlogged.
MAX_CONFLICTS_PER_PEER = 8


@dataclass
class Peer:
    node_id: str
    generation: int
    store_address: str
    ucx_address: str
    namespaces: set[str] = field(default_factory=set)
    lease_ms: int = 0
    expires: float | None = None
    # The principal that advertised it, or the one etcd records for it; None:
    # joined from etcd with no owner recorded yet, claimed by its first publisher.
    owner: str | None = None
    last_seq: int = 0  # the last numbered batch applied under this generation (0: none)
    # Workers whose relays it sent were dropped (not admitted, or not its to
    # relay for) or went with them (they left or were replaced), by name, the
    # oldest first: when one is admitted anew this peer owes its snapshot.
    awaited: dict[str, None] = field(default_factory=dict)
    # Its next numbered batch is answered resync; its snapshot states the relays again.
    owes_snapshot: bool = False
    # Store addresses refused this node id while this peer is live (Peers.advertise),
    # each warned of once; at most MAX_CONFLICTS_PER_PEER, gone with the peer.
    conflicts: set[str] = field(default_factory=set)

    def await_worker(self, name: str) -> str | None:
        """Its relays for worker ``name`` did not land, or were forgotten; past
        MAX_AWAITED_PER_PEER names its own oldest goes (a publisher's flood of
        made-up names pushes out no other peer's): returned."""
        self.awaited.pop(name, None)  # back in at the end: the most recent
        self.awaited[name] = None
        if len(self.awaited) <= MAX_AWAITED_PER_PEER:
            return None
        oldest = next(iter(self.awaited))
        del self.awaited[oldest]
        return oldest

    def snapshot_taken(self) -> None:
        """A snapshot of it applies: it owes none, and its relays are what that
        snapshot says (those in vain are remembered anew as it relays them)."""
        self.owes_snapshot = False
        self.awaited.clear()

    def admitted(self, name: str) -> bool:
        """Worker ``name`` was admitted anew: True when this peer now owes its
        snapshot. A peer that numbers no batches is never asked: it could not
        answer (the embedded router's link and a ``--store`` feed send seq 0)."""
        if name not in self.awaited:
            return False
        del self.awaited[name]
        if self.last_seq:
            self.owes_snapshot = True
        return self.owes_snapshot

    def sequence_fault(self, seq: int, snapshot: bool) -> DropCause | None:
        """None when a batch numbered ``seq`` may apply now, else why it may not.

        ``seq`` 0 is unsequenced and always applies; so does a snapshot (it is
        the node's whole state as its sender knows it, and numbering restarts
        from it). Any other numbered batch must be the very next one after the
        last applied, and a snapshot must have come first (and come again
        when the node owes one).
        """
        if seq == 0 or snapshot:
            return None
        if self.owes_snapshot:
            return DropCause.SNAPSHOT_OWED
        if seq <= self.last_seq:
            return DropCause.STALE_SEQUENCE
        if self.last_seq and seq == self.last_seq + 1:
            return None
        return DropCause.SEQUENCE_GAP

    def check_caller(self, caller: Principal, claim: bool = True) -> None:
        """PERMISSION_DENIED unless ``caller`` may speak for this node (with
        ``claim``, claiming it when nobody has yet; without, an unclaimed node
        is nobody's to refuse)."""
        if self.owner is None:
            if not claim:
                return
            self.owner = caller.name
        check_owner(f"peer node_id {self.node_id!r}", self.owner, caller)


@dataclass(frozen=True)
class StoreDepths:
    """How far each store holder of one final namespace reaches into one request."""

    deepest_first: tuple[tuple[int, Holder], ...] = ()  # (depth > 0, holder)

    def own(self, node_id: str) -> int:
        """Blocks the store of ``node_id`` itself holds."""
        mine = (node_id, STORE_TIER)
        return next((d for d, holder in self.deepest_first if holder == mine), 0)

    def elsewhere(self, node_id: str) -> int:
        """The longest prefix any other holder has: what a peer fetch could bring."""
        mine = (node_id, STORE_TIER)
        return next((d for d, holder in self.deepest_first if holder != mine), 0)


class Peers:
    """Registry of store peers plus one :class:`HolderIndex` per final namespace.
    Called under the router's lock."""

    def __init__(self, budget: IndexBudget | None = None):
        self.peers: dict[str, Peer] = {}
        self.indexes: dict[str, HolderIndex] = {}
        self.budget = budget if budget is not None else IndexBudget()
        # worker name -> node ids of the peers that await it (Peer.awaited), so an
        # admission asks them without a look at every peer
        self._awaiting: dict[str, set[str]] = {}
        self._next_generation = 1
        self._leases: list[tuple[float, str, int]] = []

    def advertise(
        self,
        node_id: str,
        store_address: str,
        ucx_address: str,
        namespaces: list[str],
        generation: int,
        lease_ms: int,
        now: float,
        caller: Principal = LOCAL,
    ) -> Peer:
        """New advertisement (generation 0) or refresh of a current one.

        The fields are checked already (``requests.check_peer``), and lapsed
        leases expired (at ``now``). A node id advertised by one principal is
        PERMISSION_DENIED to another (not admin); a new advertisement of a live
        peer's node id from another store address is ALREADY_EXISTS
        (:meth:`_check_takeover`).
        """
        old = self.peers.get(node_id)
        if old is not None:
            old.check_caller(caller)
        if generation:
            if old is None or old.generation != generation:
                raise not_found(
                    f"peer {node_id!r} generation {generation} is not current; "
                    "advertise again with generation 0"
                )
            peer = old
            serving = len(peer.namespaces | set(namespaces))
            if serving > limits.MAX_NAMESPACES_PER_PEER:
                raise exhausted(
                    f"final_namespaces: would make peer {node_id!r} serve {serving} "
                    f"namespaces, at most {limits.MAX_NAMESPACES_PER_PEER}"
                )
            peer.store_address, peer.ucx_address = store_address, ucx_address
            peer.namespaces.update(namespaces)
        else:
            if old is None and len(self.peers) >= limits.MAX_PEERS:
                raise exhausted(f"router already has {limits.MAX_PEERS} peers")
            if old is None:  # one certificate cannot fill MAX_PEERS
                owned = owned_by(caller, (peer.owner for peer in self.peers.values()))
                check_quota("store nodes", owned, limits.MAX_PEERS_PER_PRINCIPAL, caller)
            if old is not None:
                self._check_takeover(old, store_address, now)
                self.remove(node_id)
            peer = Peer(node_id, self._next_generation, store_address, ucx_address, set(namespaces))
            peer.owner = caller.name
            self._next_generation += 1
            self.peers[node_id] = peer
        peer.lease_ms = lease_ms
        peer.expires = now + lease_ms / 1000 if lease_ms else None
        if peer.expires is not None:
            heapq.heappush(self._leases, (peer.expires, node_id, peer.generation))
            if len(self._leases) > 2 * len(self.peers) + 1024:  # drop refreshed-over entries
                self._leases = [
                    (p.expires, p.node_id, p.generation)
                    for p in self.peers.values()
                    if p.expires is not None
                ]
                heapq.heapify(self._leases)
        return peer

    def _check_takeover(self, old: Peer, store_address: str, now: float) -> None:
        """ALREADY_EXISTS when ``old`` (live: its lease has not lapsed) was
        advertised from another store address than a new advertisement of its
        node id: most likely two stores given one ``--node-id``. The same
        address is the store restarting, which replaces its entry at once.
        Logged once per refused address while ``old`` lives."""
        if old.store_address == store_address:
            return
        if old.expires is not None and old.expires <= now:
            return  # lapsed, if not expired yet
        if old.expires is None:
            until = "it holds no lease: it may be taken over once that store leaves"
        else:
            left = max(old.expires - now, 0.0)
            until = f"it may be taken over when its lease lapses, in {left:.1f} s"
        message = (
            f"node_id {old.node_id!r} is advertised by the live store at "
            f"{old.store_address!r}, not {store_address!r} ({until}); two stores "
            "cannot share a node id: give this store another --node-id (if it is "
            "that store restarted on a new address, it is accepted then by itself)"
        )
        if store_address not in old.conflicts and len(old.conflicts) < MAX_CONFLICTS_PER_PEER:
            old.conflicts.add(store_address)
            log.warning("refused a store's advertisement: %s (logged once)", message)
        raise exists(message)

    def join(
        self,
        node_id: str,
        generation: int,
        store_address: str,
        ucx_address: str,
        owner: str | None = None,
    ) -> Peer:
        """The peer as etcd knows it: the same generation updates its addresses
        (and takes the owner etcd recorded), another replaces it (its blocks go
        with the old one). No lease here."""
        old = self.peers.get(node_id)
        if old is not None and old.generation == generation:
            old.store_address, old.ucx_address = store_address, ucx_address
            old.owner = owner if owner is not None else old.owner
            return old
        if old is None and len(self.peers) >= limits.MAX_PEERS:
            raise exhausted(f"router already has {limits.MAX_PEERS} peers")
        if old is not None:
            self.remove(node_id)
        peer = Peer(node_id, generation, store_address, ucx_address, owner=owner)
        self.peers[node_id] = peer
        return peer

    def current(self, node_id: str, generation: int) -> Peer | None:
        peer = self.peers.get(node_id)
        if peer is None or peer.generation != generation:
            return None
        return peer

    def remove(self, node_id: str, generation: int = 0) -> Peer | None:
        """Forget a peer (that generation only, when given) and all its blocks."""
        peer = self.peers.get(node_id)
        if peer is None or (generation and peer.generation != generation):
            return None
        del self.peers[node_id]
        self.forget_blocks(peer)
        self._unawait_all(peer)
        return peer

    def forget_blocks(self, peer: Peer) -> int:
        """Drop every block ``peer`` holds, in every namespace it serves (indexing
        a block adds its namespace to them); return how many."""
        dropped = 0
        for ns in list(peer.namespaces):
            index = self.indexes.get(ns)
            if index is None:
                continue
            for holder in [h for h in index.holders() if h[0] == peer.node_id]:
                dropped += index.release(holder)
            if not index.holders():
                del self.indexes[ns]
        return dropped

    def expire(self, now: float) -> list[Peer]:
        gone = []
        while self._leases and self._leases[0][0] <= now:
            expires, node_id, generation = heapq.heappop(self._leases)
            peer = self.current(node_id, generation)
            if peer is not None and peer.expires == expires:
                self.remove(node_id)
                gone.append(peer)
        return gone

    def get(self, node_id: str) -> Peer | None:
        return self.peers.get(node_id)

    def await_worker(self, peer: Peer, name: str) -> None:
        """``peer`` awaits worker ``name`` (:meth:`Peer.await_worker`)."""
        self._awaiting.setdefault(name, set()).add(peer.node_id)
        dropped = peer.await_worker(name)
        if dropped is not None:
            self._unawait(dropped, peer.node_id)

    def snapshot_taken(self, peer: Peer) -> None:
        """A snapshot of ``peer`` applies (:meth:`Peer.snapshot_taken`)."""
        self._unawait_all(peer)
        peer.snapshot_taken()

    def admitted(self, name: str) -> list[str]:
        """Worker ``name`` was admitted anew: the node ids of the peers that owe
        their snapshot for it now (:meth:`Peer.admitted`), sorted."""
        owing = []
        for node_id in sorted(self._awaiting.pop(name, ())):
            peer = self.peers.get(node_id)
            if peer is not None and peer.admitted(name):
                owing.append(node_id)
        return owing

    def _unawait(self, name: str, node_id: str) -> None:
        waiting = self._awaiting.get(name)
        if waiting is not None:
            waiting.discard(node_id)
            if not waiting:
                del self._awaiting[name]

    def _unawait_all(self, peer: Peer) -> None:
        for name in peer.awaited:
            self._unawait(name, peer.node_id)

    def index_for(self, peer: Peer, namespace: str) -> HolderIndex:
        """The namespace's index; a namespace seen in events joins the peer's set."""
        if namespace not in peer.namespaces:
            if len(peer.namespaces) >= limits.MAX_NAMESPACES_PER_PEER:
                raise exhausted(
                    f"peer {peer.node_id!r} already serves "
                    f"{limits.MAX_NAMESPACES_PER_PEER} namespaces"
                )
            peer.namespaces.add(namespace)
        index = self.indexes.get(namespace)
        if index is None:
            index = self.indexes[namespace] = HolderIndex(limits.MAX_PEERS * 3, self.budget)
        return index

    def check_room(self, peer: Peer, events: Sequence[StoreEvent]) -> None:
        """RESOURCE_EXHAUSTED when ``events`` (all to be indexed for ``peer``)
        would take it past MAX_NAMESPACES_PER_PEER: checked before a batch
        applies, so a refused one changes nothing. (Holder bits cannot run out:
        a namespace's index holds at most two tiers of each current peer.)"""
        # a removal adds none, nor a stored event naming no block (see apply)
        stored = {e.namespace for e in events if e.type == STORED and e.block_hashes}
        serving = len(peer.namespaces) + len(stored - peer.namespaces)
        if serving > limits.MAX_NAMESPACES_PER_PEER:
            raise exhausted(
                f"events: would make peer {peer.node_id!r} serve {serving} namespaces, "
                f"at most {limits.MAX_NAMESPACES_PER_PEER}"
            )

    def apply(self, peer: Peer, event: StoreEvent) -> Refused:
        """Index one of ``peer``'s own events; return the stored blocks the
        router's budget could not take. A removal where the peer holds nothing
        indexed changes nothing (it makes no index and no namespace for the
        peer), nor does a stored event naming no block (256 of them took 4 MiB
        of index and every namespace slot of the peer for nothing)."""
        if event.type == STORED and not event.block_hashes:
            return NONE_REFUSED
        if event.type == STORED:
            index = self.index_for(peer, event.namespace)
            return index.store(index.assign((peer.node_id, event.tier)), event.block_hashes)
        index = self.indexes.get(event.namespace)
        bit = index.bit_of((peer.node_id, event.tier)) if index is not None else None
        if bit is None:
            return NONE_REFUSED
        if event.type == REMOVED:
            index.remove(bit, event.block_hashes)
        else:
            index.clear(bit)
        return NONE_REFUSED

    def owned_by(self, name: str) -> bool:
        """Whether principal ``name`` owns a peer here (advertised or published as it)."""
        return any(peer.owner == name for peer in self.peers.values())

    def query_prefix(
        self, namespace: str, hashes: list[int], exclude_node_id: str = ""
    ) -> list[PeerPrefix]:
        """Peers with sealed blocks of exactly ``namespace``, longest prefix first.

        Only the store tier counts (blocks sealed in a peer's pool); peers
        whose prefix is empty are left out.
        """
        index = self.indexes.get(namespace)
        if index is None or not hashes:
            return []
        wanted = [
            (node_id, tier)
            for node_id, tier in index.holders()
            if tier == STORE_TIER and node_id != exclude_node_id and node_id in self.peers
        ]
        out = []
        for (node_id, _), depth in index.holder_depths(hashes, wanted).items():
            if depth:
                peer = self.peers[node_id]
                out.append(PeerPrefix(peer.node_id, peer.store_address, peer.ucx_address, depth))
        out.sort(key=lambda p: (-p.prefix_blocks, p.node_id))
        return out

    def store_depths(self, namespace: str, hashes: list[int]) -> StoreDepths:
        """Every store's sealed prefix of ``hashes`` in ``namespace``, for routing.
        Only the store tier counts, as for QueryPrefix: a block no peer fetch can
        serve is no block to credit."""
        index = self.indexes.get(namespace)
        if index is None or not hashes:
            return StoreDepths()
        depths = index.holder_depths(hashes)
        ranked = sorted(
            ((d, h) for h, d in depths.items() if d and h[1] == STORE_TIER), key=lambda x: -x[0]
        )
        return StoreDepths(tuple(ranked))

    def indexed_blocks(self) -> int:
        return sum(len(i) for i in self.indexes.values())

    def nbytes(self) -> int:
        return sum(i.nbytes() for i in self.indexes.values())
