"""What etcd says exists, applied to a router replica's core.

    StoreMirror   stores/<node>       -> join_peer(node, create_revision, addresses, owner)
                                         / remove_peer
    WorkerMirror  worksets/.../members/<worker>
                                      -> register_worker(name, card, generation=mod_revision,
                                                         caller=the owner etcd records,
                                                         set_owner=its set card's owner)
                                         / remove_worker; a set that lost its last member
                                         is handed to ``on_empty`` (the replica dissolves it)

On etcd, the mirrors are the only writers of a replica's peers and workers,
and they apply changes in etcd's revision order, so the core holds etcd's
state at some revision. Every member of a set carries the set's checksum at
every revision (``worksets.py``), so the core's own first-wins check never
refuses what etcd admitted. A listing (the first, or after etcd was away) is
applied by difference: a peer or worker whose generation is unchanged keeps
its indexed blocks and its load; anything else is replaced or removed.

Generations are etcd revisions, so every replica agrees on them: a store's is
its key's create revision (each registration creates the key anew), a
worker's the revision of the transaction that admitted it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

from kvstore.membership.etcd import Change, Entry
from kvstore.membership.layout import Layout, MemberRecord, SetCard, SetId, StoreRecord
from kvstore.wire.card import WorkerCard
from kvstore.wire.errors import KVError
from kvstore.wire.principal import Principal

log = logging.getLogger(__name__)


class RouterCore(Protocol):
    """The router core's methods a mirror applies etcd's state with
    (``kvstore.router.core.Router`` has them)."""

    def join_peer(
        self,
        node_id: str,
        generation: int,
        store_address: str,
        ucx_address: str,
        owner: str | None = None,
    ) -> object: ...

    def remove_peer(self, node_id: str, generation: int = 0) -> bool: ...

    def peer_generations(self) -> dict[str, int]: ...

    def register_worker(
        self,
        name: str,
        card: WorkerCard,
        generation: int = 0,
        caller: Principal = ...,
        set_owner: str | None = None,
    ) -> object: ...

    def remove_worker(self, name: str, generation: int = 0) -> object: ...

    def worker_generations(self) -> dict[str, int]: ...


class StoreOwner(NamedTuple):
    """Who etcd says speaks for one generation of a store node id."""

    generation: int
    owner: str


class StoreMirror:
    """``stores/`` applied as the core's peers."""

    def __init__(self, router: RouterCore, layout: Layout):
        self.router = router
        self.layout = layout
        self._owners: dict[str, StoreOwner] = {}  # node id -> its recorded owner

    def _node(self, entry: Entry) -> str:
        return self.layout.name_under(self.layout.stores, entry.key)

    def reset(self, entries: list[Entry]) -> None:
        wanted: dict[str, tuple[int, StoreRecord]] = {}
        for entry in entries:
            record = _decode(StoreRecord.decode, entry)
            if record is not None:
                wanted[self._node(entry)] = (entry.create_revision, record)
        known = self.router.peer_generations()
        for node_id, generation in known.items():
            if wanted.get(node_id, (0,))[0] != generation:
                self.router.remove_peer(node_id, generation)
                self._owners.pop(node_id, None)
                log.info("store %s (generation %d) is gone from etcd", node_id, generation)
        for node_id, (generation, record) in wanted.items():
            self._join(node_id, generation, record, known.get(node_id, 0))

    def changed(self, change: Change) -> None:
        node_id = self._node(change.entry)
        if change.deleted:
            if self.router.remove_peer(node_id, change.entry.create_revision):
                self._owners.pop(node_id, None)
                log.info("store %s left (generation %d)", node_id, change.entry.create_revision)
            return
        record = _decode(StoreRecord.decode, change.entry)
        if record is not None:
            known = self.router.peer_generations().get(node_id, 0)
            self._join(node_id, change.entry.create_revision, record, known)

    def owner(self, node_id: str, generation: int) -> str | None:
        """The owner etcd records for ``node_id`` at ``generation``, as last applied
        here (None: none recorded yet, or another generation)."""
        known = self._owners.get(node_id)
        return known.owner if known is not None and known.generation == generation else None

    def _join(self, node_id: str, generation: int, record: StoreRecord, known: int) -> None:
        try:
            self.router.join_peer(
                node_id, generation, record.store_address, record.ucx_address, record.owner
            )
        except KVError as exc:
            log.warning("store %s in etcd not joined: %s", node_id, exc)
            return
        if record.owner is not None:
            self._owners[node_id] = StoreOwner(generation, record.owner)
        if generation != known:
            log.info(
                "store %s joined (generation %d) at %s", node_id, generation, record.store_address
            )


class WorkerMirror:
    """``worksets/`` applied as the core's admitted workers."""

    def __init__(
        self,
        router: RouterCore,
        layout: Layout,
        on_empty: Callable[[SetId], None],
        on_member: Callable[[str, Change], None],
        on_listed: Callable[[], None] = lambda: None,
    ):
        self.router = router
        self.layout = layout
        self.on_empty = on_empty  # a set lost its last member
        self.on_member = on_member  # every member change, after it applied
        self.on_listed = on_listed  # every listing, after it applied
        self._members: dict[str, tuple[SetId, int]] = {}  # name -> (set, generation) applied
        self._set_owners: dict[SetId, str] = {}  # what each set's card in etcd names its owner
        self.revision = 0  # the latest admission (member put) applied, refused ones included
        self._tick = asyncio.Event()

    def generation(self, name: str) -> int:
        """The generation of ``name`` applied here (0: none)."""
        return self._members.get(name, (None, 0))[1]

    def reset(self, entries: list[Entry]) -> None:
        listed: dict[str, tuple[SetId, int, MemberRecord]] = {}
        cards = set()
        self._set_owners.clear()
        # etcd's revisions, not a maximum kept across listings: etcd that lost its
        # data counts from 1 again, and readers wait for its admissions
        self.revision = max((entry.mod_revision for entry in entries), default=0)
        for entry in entries:
            parsed = self.layout.parse_workset_key(entry.key)
            if parsed is None:
                continue
            set_id, name = parsed
            if name is None:
                cards.add(set_id)
                self._card_changed(set_id, entry)
                continue
            record = _decode(MemberRecord.decode, entry)
            if record is not None:
                listed[name] = (set_id, entry.mod_revision, record)
        for name, generation in self.router.worker_generations().items():
            if listed.get(name, (None, 0))[1] != generation:
                self._remove(name)
        for name, (set_id, generation, record) in listed.items():
            self._admit(name, set_id, generation, record)
        for set_id in cards - {set_id for set_id, _, _ in listed.values()}:
            self.on_empty(set_id)
        self.on_listed()
        self._changed()

    def changed(self, change: Change) -> None:
        parsed = self.layout.parse_workset_key(change.entry.key)
        if parsed is None:
            return
        set_id, name = parsed
        if name is None:  # a card: its owner is what the core's set needs of it
            self._card_changed(set_id, None if change.deleted else change.entry)
            return
        if change.deleted:
            if self._members.get(name, (None, 0))[0] == set_id:
                self._remove(name)
                if not any(s == set_id for s, _ in self._members.values()):
                    self.on_empty(set_id)
        else:
            record = _decode(MemberRecord.decode, change.entry)
            if record is not None:
                self._admit(name, set_id, change.entry.mod_revision, record)
            self.revision = max(self.revision, change.entry.mod_revision)
        self.on_member(name, change)
        self._changed()

    def _card_changed(self, set_id: SetId, entry: Entry | None) -> None:
        """A set's card was written (``entry``) or deleted (None). Its owner is
        etcd's word on who may join and route to the set: the core takes it
        with the next member applied (a card is written in the transaction of
        the member that fixes it, before that member's key)."""
        card = _decode(SetCard.decode, entry) if entry is not None else None
        if card is None:
            self._set_owners.pop(set_id, None)
        else:
            self._set_owners[set_id] = card.owner

    def _admit(self, name: str, set_id: SetId, generation: int, record: MemberRecord) -> None:
        if self._members.get(name) == (set_id, generation):
            return
        try:  # etcd decided, ownership included: the core applies it as an admin would
            owner = Principal(record.owner, admin=True)
            set_owner = self._set_owners.get(set_id)
            self.router.register_worker(name, record.card, generation, owner, set_owner)
        except KVError as exc:  # a card etcd holds but this core refuses: say so, go on
            log.error("worker %s (generation %d) from etcd not admitted: %s", name, generation, exc)
            if name in self._members:  # its older generation is no longer the worker
                self._remove(name)
            return
        self._members[name] = (set_id, generation)

    def _remove(self, name: str) -> None:
        self._members.pop(name, None)
        with contextlib.suppress(KVError):  # not admitted here: nothing to remove
            self.router.remove_worker(name)

    def _changed(self) -> None:
        self._tick.set()
        self._tick = asyncio.Event()

    async def wait(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``done()`` holds after a change (at most ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._tick.wait()
        return True


def _decode(decode, entry: Entry):
    try:
        return decode(entry.value)
    except ValueError as exc:
        log.warning("etcd key %s: record skipped: %s", entry.key, exc)
        return None
