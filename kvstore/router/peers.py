"""Store peers and their sealed blocks, indexed per final namespace.

A store server advertises itself (node id, gRPC and UCX addresses, the final
namespaces it serves) and streams its events. Its blocks go into one index
*per final namespace* (holder = (node id, tier)), never a shared one: the
final namespace carries the layout fingerprint, so keying by it is what makes
"only peers with the same final namespace are ever asked" (DESIGN.md section
4) true by construction. QueryPrefix reads exactly one of these indexes.

Every advertisement gets a generation; a re-advertisement without one is a
restart, which clears the old generation's blocks. An optional lease makes a
silent peer expire.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from kvstore.router.card import FINAL_NAMESPACE_RE
from kvstore.router.holders import SlotIndex
from kvstore.wire import limits
from kvstore.wire.errors import exhausted, invalid, not_found
from kvstore.wire.peers import PeerPrefix

STORE_TIER = "store"


@dataclass
class Peer:
    node_id: str
    generation: int
    store_address: str
    ucx_address: str
    namespaces: set[str] = field(default_factory=set)
    lease_ms: int = 0
    expires: float | None = None


def check_final_namespace(where: str, ns: str) -> None:
    if not FINAL_NAMESPACE_RE.fullmatch(ns):
        raise invalid(f"{where}: {ns[:64]!r} is not '<client namespace>.<16 hex fingerprint>'")


class Peers:
    """Registry of store peers plus one :class:`SlotIndex` per final namespace.
    Called under the router's lock."""

    def __init__(self):
        self.peers: dict[str, Peer] = {}
        self.indexes: dict[str, SlotIndex] = {}
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
    ) -> Peer:
        """New advertisement (generation 0) or refresh of a current one."""
        if len(namespaces) > limits.MAX_NAMESPACES_PER_PEER:
            raise invalid(
                f"final_namespaces: {len(namespaces)} given, at most "
                f"{limits.MAX_NAMESPACES_PER_PEER}"
            )
        for i, ns in enumerate(namespaces):
            check_final_namespace(f"final_namespaces[{i}]", ns)
        if not 0 <= lease_ms <= limits.MAX_LEASE_MS:
            raise invalid(f"lease_ms: {lease_ms} not in [0, {limits.MAX_LEASE_MS}]")
        old = self.peers.get(node_id)
        if generation:
            if old is None or old.generation != generation:
                raise not_found(
                    f"peer {node_id!r} generation {generation} is not current; "
                    "advertise again with generation 0"
                )
            peer = old
            peer.store_address, peer.ucx_address = store_address, ucx_address
            peer.namespaces.update(namespaces)
        else:
            if old is None and len(self.peers) >= limits.MAX_PEERS:
                raise exhausted(f"router already has {limits.MAX_PEERS} peers")
            if old is not None:
                self.remove(node_id)
            peer = Peer(node_id, self._next_generation, store_address, ucx_address, set(namespaces))
            self._next_generation += 1
            self.peers[node_id] = peer
        peer.lease_ms = lease_ms
        peer.expires = now + lease_ms / 1000 if lease_ms else None
        if peer.expires is not None:
            heapq.heappush(self._leases, (peer.expires, node_id, peer.generation))
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
        for ns in list(self.indexes):
            index = self.indexes[ns]
            for holder in [h for h in index.holders() if h[0] == node_id]:
                index.release(holder)
            if not index.holders():
                del self.indexes[ns]
        return peer

    def expire(self, now: float) -> list[Peer]:
        gone = []
        while self._leases and self._leases[0][0] <= now:
            expires, node_id, generation = heapq.heappop(self._leases)
            peer = self.current(node_id, generation)
            if peer is not None and peer.expires == expires:
                self.remove(node_id)
                gone.append(peer)
        return gone

    def index_for(self, peer: Peer, namespace: str) -> SlotIndex:
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
            index = self.indexes[namespace] = SlotIndex(limits.MAX_PEERS * 3)
        return index

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
        active = 0
        for holder in index.holders():
            node_id, tier = holder
            if tier == STORE_TIER and node_id != exclude_node_id and node_id in self.peers:
                active |= 1 << index.slot_of(holder)
        if not active:
            return []
        out = []
        for slot, depth in index.prefix_depths(hashes, active).items():
            if depth:
                peer = self.peers[index.holder_of(slot)[0]]
                out.append(PeerPrefix(peer.node_id, peer.store_address, peer.ucx_address, depth))
        out.sort(key=lambda p: (-p.prefix_blocks, p.node_id))
        return out
