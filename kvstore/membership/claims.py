"""Who may publish as a store node id, agreed by every router replica through etcd.

    claims = StoreClaims(etcd, layout, mirror)
    await claims.check("node-a", generation, caller)   # PERMISSION_DENIED or nothing

A store registers ``stores/<node id>`` itself, straight in etcd, so no gRPC
caller stands behind that write. Its owner is the first principal that
publishes events as that node id, that generation, through any replica: the
replica writes the caller into the key's value (``StoreRecord.owner``) with a
transaction that holds only while the value is the one it read, so of two
replicas claiming at once exactly one wins and the other reads the winner.
Every replica learns the owner from its watch (``StoreMirror``, then
``join_peer(..., owner)``) and refuses anyone else who is not an admin. A new
generation (the store registered again) starts unclaimed.

Cost: a publisher's first call per generation on each replica reads etcd
(and the first one anywhere writes it); later calls are checked from memory.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from kvstore.membership.etcd import Etcd, modified_at, put
from kvstore.membership.layout import Layout, StoreRecord
from kvstore.wire.errors import unavailable
from kvstore.wire.principal import Principal, check_owner

MAX_ATTEMPTS = 8


class KnownOwners(Protocol):
    """Owners as this replica last applied them from etcd (``StoreMirror``)."""

    def owner(self, node_id: str, generation: int) -> str | None: ...


class StoreClaims:
    def __init__(self, etcd: Etcd, layout: Layout, known: KnownOwners):
        self.etcd = etcd
        self.layout = layout
        self.known = known
        # node id -> (generation, owner) this replica wrote; one entry per node id
        self._claimed: dict[str, tuple[int, str]] = {}

    def _owner_here(self, node_id: str, generation: int) -> str | None:
        owner = self.known.owner(node_id, generation)
        if owner is not None:
            return owner
        claimed = self._claimed.get(node_id)
        return claimed[1] if claimed is not None and claimed[0] == generation else None

    async def check(self, node_id: str, generation: int, caller: Principal) -> None:
        """PERMISSION_DENIED unless ``caller`` owns ``node_id`` at ``generation`` (claiming
        it when nobody has) or is an admin. A generation etcd does not hold (stale,
        or not registered yet) passes here: the core answers it as stale."""
        owner = self._owner_here(node_id, generation)
        if owner is None:
            owner = await self._claim(node_id, generation, caller)
        if owner is not None:
            check_owner(f"peer node_id {node_id!r}", owner, caller)

    async def _claim(self, node_id: str, generation: int, caller: Principal) -> str | None:
        """The owner etcd records for that generation, writing ``caller`` when none
        is; None when etcd does not hold that generation."""
        key = self.layout.store(node_id)
        for _ in range(MAX_ATTEMPTS):
            entry = await self.etcd.get(key)
            if entry is None or entry.create_revision != generation:
                return None
            try:
                record = StoreRecord.decode(entry.value)
            except ValueError:  # not joined by the mirror either: the core says stale
                return None
            if record.owner is not None:
                return record.owner
            claimed = replace(record, owner=caller.name).encode()
            result = await self.etcd.txn(
                [modified_at(key, entry.mod_revision)], [put(key, claimed, entry.lease)]
            )
            if result.succeeded:
                self._claimed[node_id] = (generation, caller.name)
                return caller.name
        raise unavailable(f"store {node_id!r}: its etcd key changed {MAX_ATTEMPTS} times")
