"""The router core: admission, indexes, scoring and peers behind one lock.

Plain Python, no network: the gRPC service and the event feeds call these
methods, tests call them directly. Every public method validates its input
completely before it changes anything, and makes its decision under one
lock, so a registration, an event batch or a route is atomic with respect to
every other (the asyncio server calls from one thread; the lock is what makes
the threaded admission tests meaningful). Router state changes only here.

State:
    admission   workers and WorkerSets (admission.py)
    domains     workers' own blocks, one HolderIndex per indexer domain (domains.py)
    peers       store peers and one HolderIndex per final namespace (peers.py)
    relays      which store node relayed GPU-tier events for which worker (relays.py)
    budget      blocks every index holds together, and its bound (bounds.py)
    loads       per-worker load: workers' reports and routed requests (load.py)
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kvstore.router.admission import Admission, Decided, Worker, WorkerRef, WorkerSetKey
from kvstore.router.bounds import (
    BYTES_PER_HELD_BLOCK,
    DEFAULT_CAPACITY_BLOCKS,
    DEFAULT_MAX_HELD_BLOCKS,
    SETTLED,
    IndexBudget,
    Overflows,
    Refused,
)
from kvstore.router.domains import LOCAL_TIERS, DomainIndexes
from kvstore.router.drops import DropCause, EventDrops
from kvstore.router.endpoints import EndpointAllowList
from kvstore.router.identity import IdentityAlgorithm, domain_of
from kvstore.router.load import LoadReport, LoadTracker, TrackedRequest
from kvstore.router.peers import Peer, Peers
from kvstore.router.relays import RelayLedger
from kvstore.router.requests import (
    check_cached_blocks,
    check_hashes,
    check_load_report,
    check_peer,
    check_request_id,
    check_route,
    decode_store_events,
)
from kvstore.router.routing import (
    RouteResult,
    candidates,
    draw_worker_set,
    hash_takers,
    hash_tokens,
    route_result,
    token_takers,
)
from kvstore.router.scoring import Candidate, Candidates, ScoringConfig, choose, score_all
from kvstore.router.vllm_events import BlockEvent, EventRun, VllmBatch, fold_events
from kvstore.wire import limits
from kvstore.wire.card import WorkerCard, card_checksum, validate_card
from kvstore.wire.errors import exists, invalid, not_found
from kvstore.wire.events import GPU_TIER, STORED, StoreEvent
from kvstore.wire.names import check_final_namespace, check_name, is_final_namespace, is_name
from kvstore.wire.peers import PeerPrefix
from kvstore.wire.principal import (
    LOCAL,
    Principal,
    Tenancy,
    check_owner,
    check_quota,
    check_store,
    denied,
)

log = logging.getLogger(__name__)


@dataclass
class RouterConfig:
    identity: IdentityAlgorithm = IdentityAlgorithm.R2
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    events_allow: EndpointAllowList = field(default_factory=EndpointAllowList)  # loopback
    # Certificate CNs of the trusted store nodes (--store-cn, Security.stores; the
    # served router adds its server's): a shared store serving several tenants'
    # workers, it may relay GPU-tier events for every worker attached to the node
    # it publishes as (the card's node_id). Any other publisher relays only for
    # workers it admitted itself (docs/design.md §8).
    store_cns: frozenset[str] = frozenset()
    # node id -> the store CN bound to it (--store-node CN=NODE_ID): only that
    # certificate (or an admin) may advertise or publish as it, and a CN bound
    # to some node ids as no other.
    node_owners: dict[str, str] = field(default_factory=dict)
    # Client namespaces bound to tenants' CNs (--tenant CN=NAMESPACE): only that
    # certificate (or an admin) admits workers whose card names it, and a CN
    # bound to some namespaces admits into no other.
    tenancy: Tenancy = field(default_factory=Tenancy)
    # Blocks indexed per worker tier when its card states no capacity_blocks
    # (--default-capacity-blocks), and by every holder together (--max-held-blocks).
    default_capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS
    max_held_blocks: int = DEFAULT_MAX_HELD_BLOCKS


@dataclass(frozen=True)
class EventsApplied:
    """What became of a batch of store events."""

    applied: int
    dropped: int
    # Why nothing applied: the publisher's (node id, generation) is not a current
    # peer (stale), or the batch is out of sequence and the publisher must send a
    # snapshot (resync). Not part of equality: the counts are what became of it.
    stale: bool = field(default=False, compare=False)
    resync: bool = field(default=False, compare=False)


@dataclass
class RouterStats:
    workers: int
    worker_sets: int
    domains: int
    peers: int
    indexed_blocks: int
    events_applied: int
    events_dropped: int
    blocks_ingested: int
    active_requests: int
    rejected_registrations: int
    load_reports: int  # LoadReports accepted
    hit_reports: int  # finished requests that said how many blocks they hit
    hit_blocks_predicted: int  # over those: the cached prefix their route saw
    hit_blocks_reported: int  # over those: the blocks they hit
    dropped_by: EventDrops  # events_dropped by cause (they add up to it)
    resyncs_requested: int  # store batches answered with "send a snapshot"
    # blocks indexed per holder, summed (a block two holders hold counts twice),
    # and their bound (--max-held-blocks): past it, stored blocks are index_full
    held_blocks: int
    held_blocks_limit: int


WorkerListener = Callable[[Worker | None, Worker | None], None]  # (admitted, removed)


class Router:
    def __init__(
        self, config: RouterConfig | None = None, clock: Callable[[], float] = time.monotonic
    ):
        self.config = config or RouterConfig()
        self.clock = clock
        self.admission = Admission(self.config.identity, self._bound_owner)
        self.budget = IndexBudget(self.config.max_held_blocks)
        self.domains = DomainIndexes(self.budget, self.config.default_capacity_blocks)
        self.peers = Peers(self.budget)
        self._overflows = Overflows()
        self.relays = RelayLedger()
        self.loads = LoadTracker()
        self.rng = random.Random(self.config.scoring.seed)
        self._events_applied = 0
        self._drops = EventDrops()
        self._resyncs = 0
        self._blocks_ingested = 0
        self._lock = threading.RLock()
        self._listeners: list[WorkerListener] = []
        self._request_ids = itertools.count(1)

    def add_listener(self, fn: WorkerListener) -> None:
        """Call ``fn`` (outside the lock) after each admission, replacement or removal."""
        with self._lock:
            self._listeners.append(fn)

    def remove_listener(self, fn: WorkerListener) -> None:
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

    def _notify(self, admitted: Worker | None, removed: Worker | None) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for fn in listeners:
            fn(admitted, removed)

    # -- workers -----------------------------------------------------------

    def _bound_owner(self, namespace: str) -> str | None:
        return self.config.tenancy.owner(namespace)  # the config's tenancy is set late

    def register_worker(
        self,
        name: str,
        card: WorkerCard,
        generation: int = 0,
        caller: Principal = LOCAL,
        set_owner: str | None = None,
    ) -> Worker:
        """Admit ``card`` as ``name`` (replacing its previous generation).

        ``generation``: the one etcd gave this admission (replicas on etcd);
        admitting the generation already current changes nothing. ``caller``
        owns the name while it is admitted: another principal (not admin) is
        PERMISSION_DENIED. ``set_owner``: the owner etcd's card gives the
        worker's set (replicas on etcd; else the set's first member's owner).
        """
        check_name("name", name)
        validate_card(card)
        self.config.events_allow.check(card.kv_events_endpoint)
        self.config.tenancy.check("card.namespace", card.namespace, caller)
        with self._lock:
            current = self.admission.workers.get(name)
            if generation and current is not None and current.ref.generation == generation:
                return current
            decided = Decided(generation, set_owner) if generation else None
            worker, old = self.admission.admit(name, card, caller, decided)
            self.config.tenancy.claim(card.namespace, caller)  # admitted: now it claims
            if old is not None:
                self._forget(old)
            owing = self.peers.admitted(name)
        if owing:
            log.info(
                "%s admitted anew: asking node(s) %s for their snapshots again (they "
                "relayed GPU-tier events for it)",
                name,
                ", ".join(owing),
            )
        log.info(
            "admitted %s gen %d into %s (domain %s)%s",
            name,
            worker.ref.generation,
            worker.key,
            worker.domain,
            f", replacing gen {old.ref.generation}" if old else "",
        )
        self._notify(worker, old)
        return worker

    def check_worker_quota(
        self, name: str, caller: Principal, card: WorkerCard | None = None
    ) -> None:
        """RESOURCE_EXHAUSTED when admitting ``name`` (with ``card``, a validated
        card: into its indexer domain) would give ``caller`` more than its share
        of workers (register_worker checks it; a replica on etcd asks before
        etcd admits, judged by what it has seen of etcd)."""
        domain = None
        if card is not None:
            domain = domain_of(card, card_checksum(card), self.admission.algorithm)
        with self._lock:
            self.admission.check_quota(name, caller, domain)

    def remove_worker(self, name: str, generation: int = 0, caller: Principal = LOCAL) -> Worker:
        """Remove a worker; its index entries and tracked load go with it.
        Only its owner or an admin may (PERMISSION_DENIED)."""
        with self._lock:
            worker = self.admission.remove(name, generation, caller)
            self._forget(worker)
        log.info("removed %s gen %d", name, worker.ref.generation)
        self._notify(None, worker)
        return worker

    def _forget(self, worker: Worker) -> None:
        for node_id in self.relays.nodes_of(worker.ref):  # their relays went with it
            peer = self.peers.get(node_id)
            if peer is not None:
                self.peers.await_worker(peer, worker.ref.name)
        self._forget_blocks(worker)
        self.relays.forget_worker(worker.ref)
        self.loads.drop_worker(worker.ref)

    def record_rejected(self) -> None:
        """Count a registration refused elsewhere (by etcd's admission)."""
        with self._lock:
            self.admission.rejected += 1

    def worker_generations(self) -> dict[str, int]:
        """Every admitted worker's name and generation."""
        with self._lock:
            return {name: w.ref.generation for name, w in self.admission.workers.items()}

    def worker(self, ref: WorkerRef) -> Worker | None:
        with self._lock:
            return self.admission.current(ref)

    def members(self, key: WorkerSetKey) -> int:
        """How many workers the WorkerSet ``key`` has now (0 when it has none)."""
        with self._lock:
            wset = self.admission.sets.get(key)
            return len(wset.members) if wset else 0

    # -- worker events -----------------------------------------------------

    def apply_worker_events(self, ref: WorkerRef, events: Sequence[BlockEvent]) -> int:
        """Index a worker's own events; a stale or unknown generation is dropped.

        Returns how many events were applied.
        """
        with self._lock:
            return self._apply_runs(ref, fold_events(events), len(events), _stored(events))

    def apply_vllm_batch(self, ref: WorkerRef, batch: VllmBatch) -> int:
        with self._lock:
            self._drops.add(DropCause.OTHER_KV_GROUP, batch.skipped)
            return self._apply_runs(ref, batch.runs, batch.events, batch.blocks_stored)

    def _apply_runs(self, ref: WorkerRef, runs: list[EventRun], events: int, stored: int) -> int:
        worker = self.admission.current(ref)
        if worker is None:
            self._drops.add(DropCause.UNKNOWN_WORKER, events)
            return 0
        # all or nothing: a domain index without room refuses the batch before any of it lands
        tiers = {tier for run in runs for tier, ops in run.tiers.items() if ops.hashes}
        self.domains.check_room((worker, tier) for tier in tiers)
        refused = self.domains.apply(worker, runs)
        for tier, count in refused.items():
            self._worker_refused(worker, tier, count)
        if self._overflows:
            self._settle(worker)
        self._blocks_ingested += stored
        self._events_applied += events
        return events

    def _forget_blocks(self, worker: Worker, tiers: Sequence[str] = LOCAL_TIERS) -> None:
        """Drop ``worker``'s blocks in ``tiers``; its overflow episodes there end
        with them."""
        self.domains.forget(worker, tiers)
        for tier in tiers:
            self._overflows.close((worker.ref, tier))

    def _worker_refused(self, worker: Worker, tier: str, refused: Refused) -> None:
        """Count ``worker``'s stored blocks of ``tier`` that were not indexed;
        warn once per episode of each bound."""
        if refused.over_capacity:
            self._drops.add(DropCause.OVER_CAPACITY, refused.over_capacity)
            if self._overflows.refused((worker.ref, tier), refused.over_capacity):
                log.warning(
                    "worker %r gen %d %s tier: holds %d indexed blocks, its capacity (%s); "
                    "stored blocks past it are not indexed (over_capacity, logged once until "
                    "it is back to %d%%). An engine evicts before it stores past its "
                    "capacity: check that its removals reach the router (BlockRemoved lost in "
                    "its publisher's queue or a relaying store) and that capacity_blocks is "
                    "not below what its engine holds",
                    worker.ref.name,
                    worker.ref.generation,
                    tier,
                    self.domains.limit_of(worker, tier),
                    f"its card's capacity_blocks {worker.card.capacity_blocks}"
                    if worker.card.capacity_blocks
                    else "--default-capacity-blocks: its card states no capacity_blocks",
                    SETTLED * 100,
                )
        if refused.index_full:
            self._index_full(f"worker {worker.ref.name!r}", refused.index_full)

    def _index_full(self, holder: str, count: int) -> None:
        """``count`` stored blocks of ``holder`` met the router-wide bound."""
        self._drops.add(DropCause.INDEX_FULL, count)
        if self._overflows.refused(Overflows.INDEX, count):
            log.warning(
                "router index full: %d blocks held, its bound (--max-held-blocks %d); stored "
                "blocks past it are not indexed (index_full, first of %s; logged once until "
                "it is back to %d%%). Removals make room again: check for holders whose "
                "removals are lost, or raise --max-held-blocks (~%d B a block)",
                self.budget.used,
                self.budget.limit,
                holder,
                SETTLED * 100,
                BYTES_PER_HELD_BLOCK,
            )

    def _settle(self, worker: Worker | None = None) -> None:
        """End the overflow episodes (``worker``'s, and the index's) that are back
        within their bounds: O(1), run after each batch while any is open."""
        if worker is not None:
            for tier in LOCAL_TIERS:
                if self._overflows.is_open((worker.ref, tier)):
                    fill = self.domains.fill(worker, tier)
                    what = f"worker {worker.ref.name!r} gen {worker.ref.generation} {tier} tier"
                    self._settled(what, fill.held, fill.limit, (worker.ref, tier))
        self._settled("the router index", self.budget.used, self.budget.limit, Overflows.INDEX)

    def _settled(self, what: str, held: int, limit: int, key: object) -> None:
        refused = self._overflows.settle(key, held, limit)
        if refused is not None:
            log.info(
                "%s is back within its bound: %d of %d blocks indexed (%d stored blocks "
                "were not indexed while past it)",
                what,
                held,
                limit,
                refused,
            )

    def apply_named_vllm_batch(self, name: str, batch: VllmBatch) -> int:
        """A batch for whichever generation of worker ``name`` is admitted now
        (dropped when none is)."""
        with self._lock:
            worker = self.admission.workers.get(name)
            ref = worker.ref if worker is not None else WorkerRef(name, 0)
            return self.apply_vllm_batch(ref, batch)

    def vllm_batches_lost(self, worker: WorkerRef | str, lost: int) -> None:
        """A worker's vLLM feed lost ``lost`` batches (its numbers skipped, or
        started again: a publisher restarted, a ZMQ queue overflowed, a
        reconnection): what they told is unknown, so the worker's own blocks
        (``WorkerRef``, or whichever generation of a name is admitted) are
        forgotten until its events tell them anew, and the loss is counted
        (``sequence_gap``). Indexing blocks it may have evicted would route to a
        hit that is not there."""
        with self._lock:
            self._drops.add(DropCause.SEQUENCE_GAP, lost)
            if isinstance(worker, str):
                found = self.admission.workers.get(worker)
            else:
                found = self.admission.current(worker)
            if found is not None:
                self._forget_blocks(found)

    def record_dropped(self, count: int = 1, cause: DropCause = DropCause.UNDECODABLE) -> None:
        """Count events a feed lost or received but could not use (by default:
        could not decode)."""
        with self._lock:
            self._drops.add(cause, count)

    def apply_relayed_worker_event(self, event: StoreEvent, caller: Principal = LOCAL) -> bool:
        """A GPU-tier event a store relays for a worker it serves (no peer needed),
        applied only when ``caller``, the relaying store, may speak for that worker
        (:meth:`may_relay_for`); else dropped and counted (``relay_refused``), and
        nothing of that worker's changes. Relayed outside a peer's batch, no
        snapshot replaces it (:meth:`apply_store_events` relays do), and no node
        id names the relayer: only the worker's owner or an admin may, a
        ``--store-cn`` store's trust being for its own node's workers."""
        with self._lock:
            return self._relay(event, caller) is not None

    def _relay(
        self, event: StoreEvent, caller: Principal, peer: Peer | None = None
    ) -> Worker | None:
        """Apply ``event``, relayed by ``caller`` publishing as ``peer`` (None for no
        node): the worker it applied for, else None (counted, and the peer asked
        again once the worker is admitted anew: Peer.await_worker)."""
        worker = self.admission.workers.get(event.worker)
        if event.tier != GPU_TIER or worker is None:
            if peer is not None and event.tier == GPU_TIER and is_name(event.worker):
                self.peers.await_worker(peer, event.worker)
            self._drops.add(DropCause.UNKNOWN_WORKER)
            return None
        if not self.may_relay_for(caller, worker, peer.node_id if peer else ""):
            if peer is not None and self.trusted_store(caller):  # a new card may allow it
                self.peers.await_worker(peer, event.worker)
            self._drops.add(DropCause.RELAY_REFUSED)
            return None
        applied = self.apply_worker_events(worker.ref, [BlockEvent(event.type, event.block_hashes)])
        return worker if applied == 1 else None

    def may_relay_for(self, caller: Principal, worker: Worker, node_id: str = "") -> bool:
        """May ``caller``, publishing as store ``node_id`` ("" for no node), relay
        GPU-tier events for ``worker``: its owner, an admin, or a trusted store
        (``RouterConfig.store_cns``) publishing as the node the worker is attached
        to (its card's ``node_id``). Without ``--store-cn`` any certificate may
        publish as a store, so a publisher's word about another principal's worker
        counts for nothing: it would steer that worker's routes (routing-index
        poisoning); and a trusted store speaks only for its own node's workers."""
        if caller.may_act_for(worker.owner):
            return True
        attached = bool(node_id) and worker.card.node_id == node_id
        return attached and self.trusted_store(caller)

    def trusted_store(self, caller: Principal) -> bool:
        """``caller`` is a ``--store-cn`` store: it relays for the workers attached
        to the node it publishes as, whoever owns them (refused for any other,
        it may be allowed once a worker's card names its node)."""
        return caller.name in self.config.store_cns

    def _relay_target(self, event: StoreEvent, caller: Principal, node_id: str) -> Worker | None:
        """The worker a GPU-tier ``event`` of ``caller``'s batch as ``node_id`` will
        be indexed for (None: it will be dropped)."""
        if event.tier != GPU_TIER:
            return None
        worker = self.admission.workers.get(event.worker)
        if worker is None or not self.may_relay_for(caller, worker, node_id):
            return None
        return worker

    # -- store events ------------------------------------------------------

    def publish_store_events(
        self,
        node_id: str,
        generation: int,
        payloads: Sequence[bytes],
        caller: Principal = LOCAL,
        seq: int = 0,
        snapshot: bool = False,
    ) -> EventsApplied:
        """Decode and apply a store's events, the whole batch or none of it.

        All payloads are decoded first, so a malformed one refuses the whole
        call with INVALID_ARGUMENT naming it and changes nothing. A stale
        generation drops everything (the peer restarted since); so does a batch
        out of sequence (see :meth:`apply_store_events`).
        """
        events = decode_store_events(node_id, payloads)
        return self.apply_store_events(node_id, generation, events, caller, seq, snapshot)

    def apply_store_events(
        self,
        node_id: str,
        generation: int,
        events: Sequence[StoreEvent],
        caller: Principal = LOCAL,
        seq: int = 0,
        snapshot: bool = False,
    ) -> EventsApplied:
        """Apply decoded store events from peer (node_id, generation).

        Only the principal that advertised ``node_id`` (or an admin) may
        publish as it, and only one that may act as a store: PERMISSION_DENIED.
        A GPU-tier event it relays for a worker it may not speak for as
        ``node_id`` (:meth:`may_relay_for`) is dropped and counted
        (``relay_refused``); the rest of the batch applies.
        Room for every namespace and holder the batch brings is checked before
        its first event applies: RESOURCE_EXHAUSTED changes nothing.

        ``seq`` numbers the peer's batches (0: unsequenced, always applied); a
        numbered batch that does not follow the last one applied is dropped
        whole and answered ``resync`` (docs/design.md §6). A ``snapshot`` batch
        replaces every block indexed for the peer, and the GPU tier of every
        worker that node id relayed for (under any of its generations) and
        ``caller`` may relay for as ``node_id``, then applies: that node's
        relays are then what its snapshot says.
        """
        check_store("PublishEvents", caller)
        self.check_bound("PublishEvents", node_id, caller)
        with self._lock:
            known = self.peers.get(node_id)
            peer = self.peers.current(node_id, generation)
            if known is not None:  # only a publisher of the current generation claims it
                known.check_caller(caller, claim=peer is known)
            if peer is None:
                return self._drop_batch(len(events), DropCause.STALE_GENERATION)
            fault = peer.sequence_fault(seq, snapshot)
            if fault is not None:
                self._resyncs += 1
                return self._drop_batch(len(events), fault)
            self.peers.check_room(peer, [e for e in events if self._indexable(peer, e)])
            self.domains.check_room(  # only the relays that will apply take room
                (worker, GPU_TIER)
                for e in events
                if (worker := self._relay_target(e, caller, node_id))
            )
            if snapshot:
                self.peers.forget_blocks(peer)
                self._forget_relays(node_id, caller)
            if seq or snapshot:
                peer.last_seq = seq
            if snapshot:
                self.peers.snapshot_taken(peer)
            applied = sum(self._apply_store_event(peer, e, caller) for e in events)
            if self._overflows:
                self._settle()
            return EventsApplied(applied, len(events) - applied)

    def _drop_batch(self, count: int, cause: DropCause) -> EventsApplied:
        self._drops.add(cause, count)
        if cause is DropCause.STALE_GENERATION:
            return EventsApplied(0, count, stale=True)
        return EventsApplied(0, count, resync=True)

    @staticmethod
    def _indexable(peer: Peer, event: StoreEvent) -> bool:
        """A store reports only its own blocks, per final namespace, in its own tiers."""
        return (
            event.tier != GPU_TIER
            and event.worker == peer.node_id
            and is_final_namespace(event.namespace)
        )

    def _forget_relays(self, node_id: str, caller: Principal) -> None:
        """Drop the GPU-tier blocks of every worker ``node_id`` relayed for that
        ``caller`` may relay for as ``node_id``; the others stay, recorded (a node
        id taken over after its peer left erases no other tenant's worker's
        blocks, and a trusted store's snapshot none of a worker attached to
        another node)."""
        for ref in self.relays.take(node_id):
            worker = self.admission.current(ref)
            if worker is None:
                continue
            if self.may_relay_for(caller, worker, node_id):
                self._forget_blocks(worker, (GPU_TIER,))
            else:
                self.relays.record(node_id, ref)

    def _apply_store_event(self, peer: Peer, event: StoreEvent, caller: Principal) -> bool:
        if event.tier == GPU_TIER:
            worker = self._relay(event, caller, peer)
            if worker is not None:
                self.relays.record(peer.node_id, worker.ref)
            return worker is not None
        if not self._indexable(peer, event):
            self._drops.add(DropCause.NOT_INDEXABLE)
            return False
        refused = self.peers.apply(peer, event)
        if refused.index_full:
            self._index_full(f"store node {peer.node_id!r}", refused.index_full)
        if event.type == STORED:
            self._blocks_ingested += len(event.block_hashes)
        self._events_applied += 1
        return True

    # -- peers -------------------------------------------------------------

    def advertise_peer(
        self,
        node_id: str,
        store_address: str,
        ucx_address: str,
        final_namespaces: Sequence[str],
        generation: int = 0,
        lease_ms: int = 0,
        caller: Principal = LOCAL,
    ) -> Peer:
        """Advertise store ``node_id`` for ``caller``, who then owns that node id
        (PERMISSION_DENIED unless ``caller`` may act as a store node)."""
        final_namespaces = list(final_namespaces)
        check_peer(node_id, store_address, ucx_address, final_namespaces, lease_ms)
        check_store("AdvertisePeer", caller)
        self.check_bound("AdvertisePeer", node_id, caller)
        with self._lock:
            now = self.clock()
            self.peers.expire(now)
            return self.peers.advertise(
                node_id,
                store_address,
                ucx_address,
                final_namespaces,
                generation,
                lease_ms,
                now,
                caller,
            )

    def check_bound(self, call: str, node_id: str, caller: Principal) -> None:
        """PERMISSION_DENIED when ``node_id`` is bound to another certificate, or
        ``caller``'s certificate to other node ids (``RouterConfig.node_owners``):
        then a store's certificate, not whoever advertises first, decides which
        node it is, and so which attached workers it may relay for."""
        if caller.admin:
            return
        owners = self.config.node_owners
        owner = owners.get(node_id)
        if owner is not None and owner != caller.name:
            raise denied(  # the owner unnamed: a refusal tells no other identity's name
                f"{call}: node_id {node_id!r} is bound to another certificate "
                f"(--store-node), not to {caller}"
            )
        if owner is None and caller.name in owners.values():
            mine = sorted(n for n, cn in owners.items() if cn == caller.name)
            raise denied(
                f"{call}: {caller} is bound by --store-node to node ids {mine}, not to "
                f"node_id {node_id[:64]!r}"
            )

    def join_peer(
        self,
        node_id: str,
        generation: int,
        store_address: str,
        ucx_address: str,
        owner: str | None = None,
    ) -> Peer:
        """Peer ``node_id`` as etcd registers it, at etcd's ``generation``: the
        current generation keeps its blocks, another starts empty. ``owner``: the
        principal etcd records for it (None: claimed by its first publisher)."""
        check_peer(node_id, store_address, ucx_address, [], 0)
        if generation < 1:
            raise invalid(f"generation: must be >= 1, got {generation}")
        with self._lock:
            return self.peers.join(node_id, generation, store_address, ucx_address, owner)

    def peer_generations(self) -> dict[str, int]:
        """Every current peer's node id and generation."""
        with self._lock:
            return {node_id: p.generation for node_id, p in self.peers.peers.items()}

    def ensure_peer(self, node_id: str, store_address: str) -> Peer:
        """The current advertisement of ``node_id``; when it has none, advertise it
        at ``store_address`` (no UCX address, no namespaces yet). A store the
        router follows through its Events stream joins this way."""
        with self._lock:
            peer = self.peers.get(node_id)
            if peer is not None:
                return peer
            return self.advertise_peer(node_id, store_address, "", [])

    def remove_peer(self, node_id: str, generation: int = 0) -> bool:
        with self._lock:
            return self.peers.remove(node_id, generation) is not None

    def query_prefix(
        self,
        final_namespace: str,
        hashes: Sequence[int],
        exclude_node_id: str = "",
        caller: Principal = LOCAL,
    ) -> list[PeerPrefix]:
        """For each peer with sealed blocks of exactly ``final_namespace``: its longest
        prefix. Asked by store nodes (a caller that owns one) and admins only: the
        answer tells which prefixes a tenant holds (PERMISSION_DENIED otherwise)."""
        check_final_namespace("final_namespace", final_namespace)
        hashes = check_hashes("block_hashes", hashes)
        check_store("QueryPrefix", caller)
        with self._lock:
            if not (caller.admin or self.peers.owned_by(caller.name)):
                raise denied(
                    f"QueryPrefix is for store nodes and admins: {caller} owns no store "
                    "node here (advertise or publish as one first)"
                )
            self.peers.expire(self.clock())
            return self.peers.query_prefix(final_namespace, hashes, exclude_node_id)

    # -- routing -----------------------------------------------------------

    def route(
        self,
        model: str,
        *,
        namespace: str = "",
        role: str = "",
        token_ids: Sequence[int] | None = None,
        hashes: Sequence[int] | None = None,
        request_id: str = "",
        track: bool = True,
        decode_tokens: int = 0,
        caller: Principal = LOCAL,
    ) -> RouteResult:
        """Pick a WorkerSet for ``model`` among those ``caller`` owns (every
        set, for an admin) and the worker in it with the lowest expected time
        to first token (scoring.py). ``track`` adds the request to
        the chosen worker's queue until ``caller`` (or an admin) reports it
        started and finished; a ``request_id`` another principal's tracked
        request holds is ALREADY_EXISTS.
        ``decode_tokens`` is checked but not scored: a request's output length
        does not change its own first token. Every refusal comes before the
        WorkerSet draw (token ids or block hashes are judged against each
        matching set, and the draw is among those that can take them): a
        refused Route changes nothing."""
        hashes = check_route(model, token_ids, hashes, request_id, decode_tokens, namespace, role)
        cfg = self.config.scoring
        with self._lock:
            if track and request_id and self.loads.taken_by_another(request_id, caller):
                raise exists(f"request_id {request_id!r}: another caller's request")
            now = self.clock()
            self.loads.expire(now)
            if track and not self.loads.tracks(request_id):  # one certificate cannot fill it
                owned = self.loads.owned.get(caller.name, 0)
                check_quota(
                    "tracked requests", owned, limits.MAX_ACTIVE_REQUESTS_PER_PRINCIPAL, caller
                )
            self.peers.expire(now)
            sets = self.admission.resolve(model, namespace, role, caller)
            if token_ids:  # judged on every set before the draw: a refusal draws nothing
                sets = token_takers(sets, len(token_ids), decode_tokens)
            elif hashes:
                sets = hash_takers(sets, len(hashes), decode_tokens)
            wset = draw_worker_set(sets, self.rng)
            if token_ids:
                hashes = hash_tokens(wset, token_ids)
            block_size = wset.reference.kv_block_size
            prompt_tokens = len(token_ids) if token_ids else len(hashes) * block_size
            cands = candidates(wset, hashes, self.domains, self.peers)
            best = self._choose(cands, prompt_tokens, block_size, now)
            rid = request_id or self._fresh_request_id()
            if track:
                queued = best.estimate.uncached_tokens
                deadline = now + cfg.request_timeout_s
                tracked = TrackedRequest(
                    best.ref, queued, best.overlap, deadline, owner=caller.name
                )
                self.loads.add(rid, tracked)
            return route_result(wset, sets, best, cands, rid, len(hashes), cfg)

    def _fresh_request_id(self) -> str:
        """r1, r2, ...: one no tracked request holds (a caller may have chosen it)."""
        while self.loads.tracks(rid := f"r{next(self._request_ids)}"):
            pass
        return rid

    def _choose(
        self, cands: Candidates, prompt_tokens: int, block_size: int, now: float
    ) -> Candidate:
        cfg = self.config.scoring
        loads = self.loads.loads_of(cands.refs, now, cfg.load_staleness_s)
        score_all(cands, prompt_tokens, block_size, loads, cfg)
        return choose(cands, cfg, self.rng)

    # -- load and request life cycle ---------------------------------------

    def report_load(self, worker: str, report: LoadReport, caller: Principal = LOCAL) -> None:
        """Worker ``worker`` (its current generation) reports its load; routes use
        it for ``load_staleness_s`` seconds, then fall back to the router's own
        accounting. NOT_FOUND when no worker of that name is admitted,
        PERMISSION_DENIED unless ``caller`` admitted it or is an admin."""
        check_load_report(worker, report)
        with self._lock:
            admitted = self.admission.workers.get(worker)
            if admitted is None:
                raise not_found(f"worker: {worker!r} is not registered")
            check_owner(f"worker {worker!r}", admitted.owner, caller)
            self.loads.report(admitted.ref, report, self.clock())

    def request_started(self, request_id: str, caller: Principal = LOCAL) -> None:
        """A routed request's prefill began: it leaves its worker's queue and runs.
        An unknown, untracked or already started request, or another
        principal's, changes nothing."""
        check_request_id(request_id)
        with self._lock:
            self.loads.start(request_id, caller)

    def request_finished(
        self, request_id: str, cached_blocks: int | None = None, caller: Principal = LOCAL
    ) -> None:
        """A routed request is done (or abandoned): its load is freed.
        ``cached_blocks``, the prefix blocks it really found cached, is set
        against what its route saw (``RouterStats.hit_blocks_*``). Another
        principal's request changes nothing."""
        check_request_id(request_id)
        check_cached_blocks(cached_blocks)
        with self._lock:
            self.loads.finish(request_id, cached_blocks, caller)

    # -- introspection -----------------------------------------------------

    def stats(self) -> RouterStats:
        with self._lock:
            return RouterStats(
                len(self.admission.workers),
                len(self.admission.sets),
                len(self.domains),
                len(self.peers.peers),
                self.domains.indexed_blocks() + self.peers.indexed_blocks(),
                self._events_applied,
                self._drops.total(),
                self._blocks_ingested,
                len(self.loads.requests),
                self.admission.rejected,
                self.loads.load_reports,
                self.loads.hits.reports,
                self.loads.hits.blocks_predicted,
                self.loads.hits.blocks_reported,
                replace(self._drops),
                self._resyncs,
                self.budget.used,
                self.budget.limit,
            )

    def index_bytes(self) -> int:
        with self._lock:
            return self.domains.nbytes() + self.peers.nbytes()


def _stored(events: Sequence[BlockEvent]) -> int:
    return sum(len(e.hashes) for e in events if e.kind == STORED)
