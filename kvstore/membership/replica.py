"""A router replica on etcd: registered, mirroring the cluster, admitting workers.

    replica = RouterReplica(etcd, config, router)     # router: the core (mirror.RouterCore)
    await replica.start("10.0.0.5:50061")            # register, follow stores/ and worksets/
    outcome = await replica.admit("w0", card, caller) # Admitted(generation) | Refused(...)
    await replica.seen("w0", outcome.generation)       # this replica's view has it
    replica.release("w0", outcome.generation)         # a WorkerSession ended
    await replica.remove("w0", generation, caller)    # RemoveWorker
    await replica.check_publisher("node-a", generation, caller)   # PublishEvents
    await replica.close()                             # leave: its key and its workers go

The replica registers ``routers/<address>`` under its own lease, so store
servers find it and publish their events to it. It follows ``stores/`` and
``worksets/`` into its core (``mirror.py``). A worker admitted through it is
written under a lease of its own that this replica keeps alive for as long as
it holds the worker: until RemoveWorker, the end of the worker's session, or
the replica's own end. If that lease is lost (the replica was silent past the
TTL, or etcd lost its data) the replica admits the worker again, as a new
generation, when etcd answers; if it is refused then (another checksum took
the set meanwhile) the worker is let go. A worker re-registered through
another replica (a put of its member key newer than this replica's admission:
the watch may still deliver the one it replaced), or removed through one, is
let go here too; a hold checks its name claim in etcd once in place and after
every listing, for what the watch could not bring.

Admission returns once this replica's own core shows the admitted generation,
so a Route through the same replica right after it sees the worker.

Ownership (docs/design.md §8) is recorded in etcd, so it holds whichever
replica a call lands on: a worker name belongs to the caller that admitted it
(``worksets.py``), a store node id to its first publisher (``claims.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from functools import partial

from kvstore.membership.claims import StoreClaims
from kvstore.membership.directory import Directory
from kvstore.membership.etcd import Change, Etcd, EtcdConfig
from kvstore.membership.keeper import LeaseKeeper
from kvstore.membership.layout import Layout, RouterRecord, SetId
from kvstore.membership.lease import KeyLease, under_new_lease
from kvstore.membership.mirror import RouterCore, StoreMirror, WorkerMirror
from kvstore.membership.worksets import Admitted, Refused, WorkerSets
from kvstore.wire.card import WorkerCard, card_checksum
from kvstore.wire.errors import Code, KVError
from kvstore.wire.principal import LOCAL, Principal, check_store

log = logging.getLogger(__name__)

SETTLE_S = 5.0  # how long an admission or removal waits for this replica's own core
SNAPSHOT_SETTLE_S = 2.0  # how long a store's snapshot waits for the admissions in etcd


@dataclass
class HeldWorker:
    """A worker this replica admitted and keeps alive."""

    lease: KeyLease
    first_generation: int  # the generation its admission here returned


class RouterReplica:
    def __init__(self, etcd: Etcd, config: EtcdConfig, router: RouterCore):
        self.etcd = etcd
        self.layout = Layout(config.prefix)
        self.worksets = WorkerSets(etcd, self.layout)
        self.stores = StoreMirror(router, self.layout)
        self.claims = StoreClaims(etcd, self.layout, self.stores)
        self.workers = WorkerMirror(
            router, self.layout, self._dissolve_soon, self._member_changed, self._listed
        )
        self.directories = (
            Directory(etcd, self.layout.stores, self.stores, "router: stores in etcd"),
            Directory(etcd, self.layout.worksets, self.workers, "router: worker sets in etcd"),
        )
        self.keeper = LeaseKeeper(config, "router replica")
        self.registration: KeyLease | None = None
        self._held: dict[str, HeldWorker] = {}
        self._tasks: set[asyncio.Task] = set()

    async def start(self, address: str) -> None:
        """Follow the cluster and register as a replica reachable at ``address``.
        With etcd unreachable it keeps trying in the background."""
        for directory in self.directories:
            directory.start()
        key, record = self.layout.router(address), RouterRecord(address).encode()
        self.registration = KeyLease(
            self.etcd,
            self.keeper,
            partial(self.etcd.recreate, key, record),
            f"router replica {address}",
        )
        try:
            generation = await self.registration.register()
            log.info("router replica %s registered in etcd (generation %d)", address, generation)
        except KVError as exc:
            log.warning("router replica %s not registered yet: %s", address, exc.message)
        self.registration.keep()

    # -- workers -----------------------------------------------------------

    async def admit(
        self, name: str, card: WorkerCard, caller: Principal = LOCAL, set_owner: str | None = None
    ) -> Admitted | Refused:
        """Admit a validated ``card`` as ``name`` for ``caller`` through etcd;
        UNAVAILABLE when etcd does not answer, PERMISSION_DENIED when the name is
        admitted for another principal. ``set_owner``: see ``WorkerSets.admit``."""
        checksum = card_checksum(card)
        lease, outcome = await under_new_lease(
            self.etcd,
            self.keeper,
            partial(self.worksets.admit, name, card, checksum, caller=caller, set_owner=set_owner),
            f"worker {name}",
        )
        if isinstance(outcome, Refused):
            self.keeper.drop(lease)
            await self.etcd.revoke(lease)
            return outcome
        keys = KeyLease(
            self.etcd,
            self.keeper,
            partial(self._readmit, name, card, checksum, caller, set_owner),
            f"worker {name}",
            on_registered=lambda _generation: self._verify_soon(name, held),
            on_lost=partial(self._let_go, name),
        )
        keys.adopt(lease, outcome.generation)
        held = HeldWorker(keys, outcome.generation)
        self._replace_held(name, held)
        keys.keep()
        self._verify_soon(name, held)
        return outcome

    async def seen(self, name: str, generation: int) -> bool:
        """Wait (SETTLE_S at most) until this replica has seen the admission of
        ``name`` at ``generation``; False when it has not by then."""
        if await self.workers.wait(lambda: self.workers.generation(name) == generation, SETTLE_S):
            return True
        log.warning("worker %s admitted at %d; this replica has not seen it yet", name, generation)
        return False

    async def _readmit(
        self,
        name: str,
        card: WorkerCard,
        checksum: str,
        caller: Principal,
        set_owner: str | None,
        lease: int,
    ) -> int:
        # only while nobody admitted the name meanwhile (the worker re-registered
        # elsewhere: that admission is the worker now, not this replica's old card)
        outcome = await self.worksets.admit(
            name, card, checksum, lease, caller, set_owner=set_owner, unclaimed_only=True
        )
        if isinstance(outcome, Refused):
            raise KVError(
                Code.FAILED_PRECONDITION,
                f"WorkerSet {SetId.of(card)} now holds checksum {outcome.checksum[:12]}",
            )
        return outcome.generation

    def _replace_held(self, name: str, held: HeldWorker | None) -> None:
        old = self._held.pop(name, None)
        if held is not None:
            self._held[name] = held
        if old is not None and old is not held:
            self._soon(old.lease.release())  # its keys moved to the new lease, or are gone

    def _let_go(self, name: str) -> None:
        self._replace_held(name, None)

    def holds(self, name: str) -> bool:
        """Whether this replica keeps an admission of ``name`` alive."""
        return name in self._held

    def release(self, name: str, first_generation: int) -> None:
        """The session that admitted ``name`` at ``first_generation`` ended: revoke
        its lease, so every replica drops it (unless it registered again since)."""
        held = self._held.get(name)
        if held is not None and held.first_generation == first_generation:
            self._replace_held(name, None)

    async def remove(self, name: str, generation: int = 0, caller: Principal = LOCAL) -> bool:
        """RemoveWorker: False when ``name`` (that generation, when given; any,
        else: etcd's, not this replica's possibly older view) is not admitted;
        PERMISSION_DENIED unless ``caller`` admitted it or is an admin."""
        removed = await self.worksets.remove(name, generation, caller)
        if not removed:
            return False
        held = self._held.get(name)
        if held is not None and held.lease.generation == removed:
            self._replace_held(name, None)
        await self.workers.wait(lambda: self.workers.generation(name) != removed, SETTLE_S)
        return True

    async def check_publisher(self, node_id: str, generation: int, caller: Principal) -> None:
        """PublishEvents as store ``node_id`` at ``generation``: PERMISSION_DENIED
        unless ``caller`` may act as a store node and is its first publisher
        (recorded in etcd), or is an admin."""
        check_store("PublishEvents", caller)
        await self.claims.check(node_id, generation, caller)

    async def workers_settled(self, timeout_s: float = SNAPSHOT_SETTLE_S) -> bool:
        """Wait until this replica has applied every admission etcd holds now, so
        GPU-tier blocks a store relays by worker name land on the workers' current
        generations (``relayed.py``). False when etcd does not answer, or after
        ``timeout_s``."""
        try:  # one key read, not every claim: each store's snapshot asks this
            latest = await self.etcd.last_modified(self.layout.workers)
        except KVError:
            return False
        return await self.workers.wait(lambda: self.workers.revision >= latest, timeout_s)

    def _member_changed(self, name: str, change: Change) -> None:
        """Let go of a worker that registered through another replica, or was removed.
        Only a put newer than our admission is someone else's: the watch may
        deliver the admission ours replaced after our own transaction returned."""
        held = self._held.get(name)
        if held is None or not held.lease.lease:
            return
        entry = change.entry
        if not change.deleted:
            if entry.lease != held.lease.lease and entry.mod_revision > held.lease.generation:
                self._replace_held(name, None)  # re-registered elsewhere: the keys are not ours
        elif entry.lease == held.lease.lease:
            self._verify_soon(name, held)

    def _listed(self) -> None:
        """A listing (the first, or after the watch broke) brings no event for
        what changed unheard: check every worker held."""
        for name, held in self._held.items():
            self._verify_soon(name, held)

    def _verify_soon(self, name: str, held: HeldWorker) -> None:
        self._soon(self._verify(name, held))

    async def _verify(self, name: str, held: HeldWorker) -> None:
        """Let go of ``held`` when etcd's claim on ``name`` is not under its lease
        while that lease lives: the worker was removed, or registered again
        through another replica, by a change this replica heard before it held
        the worker (the watch and a transaction's answer race), or never heard
        (the watch broke). Read afresh: a listing taken before our admission
        would show it absent. A lease that is gone is the keepalive's to
        handle (it admits again only an unclaimed name)."""
        lease = held.lease.lease
        if not lease:
            return  # being admitted again: verified once that is done
        with contextlib.suppress(KVError):
            claim = await self.etcd.get(self.layout.worker(name))
            if claim is not None and claim.lease == lease:
                return
            ours = await held.lease.alive() and self._held.get(name) is held
            if ours and held.lease.lease == lease:
                log.info("worker %s: its keys in etcd are no longer ours; letting go", name)
                self._replace_held(name, None)

    def _dissolve_soon(self, set_id: SetId) -> None:
        self._soon(self._dissolve(set_id))

    async def _dissolve(self, set_id: SetId) -> None:
        with contextlib.suppress(KVError):  # unreachable: the next replica or listing does it
            if await self.worksets.dissolve(set_id):
                log.info("WorkerSet %s has no member left: dissolved", set_id)

    def _soon(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def listed(self, timeout_s: float) -> bool:
        """Whether both directories have listed etcd at least once (within ``timeout_s``)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not all(d.listings for d in self.directories):
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def close(self) -> None:
        """Leave: the replica's key and the workers it holds vanish at once."""
        for directory in self.directories:
            await directory.close()
        if self.registration is not None:
            await self.registration.release()
        for name in list(self._held):
            held = self._held.pop(name)
            await held.lease.release()
        for task in list(self._tasks):
            with contextlib.suppress(Exception):
                await task
        await self.keeper.aclose()
