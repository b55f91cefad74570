"""The router core: admission, indexes, scoring and peers behind one lock.

Plain Python, no network: the gRPC service and the event subscribers call
these methods, tests call them directly. Every public method validates its
input completely before it changes anything, and makes its decision under
one lock, so a registration, an event batch or a route is atomic with
respect to every other (the asyncio server calls from one thread; the lock
is what makes the threaded admission tests meaningful).

State:
    admission   workers and WorkerSets (admission.py)
    domains     indexer domain -> SlotIndex of (worker ref, tier) holders
    peers       store peers and one SlotIndex per final namespace (peers.py)
    loads       active load per worker from routed requests (scoring.py)
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.router.admission import Admission, Worker, WorkerRef, WorkerSet, WorkerSetKey
from kvstore.router.card import WorkerCard, validate_card
from kvstore.router.holders import SlotIndex
from kvstore.router.identity import Domain, IdentityAlgorithm
from kvstore.router.peers import STORE_TIER, Peer, PeerPrefix, Peers, check_final_namespace
from kvstore.router.scoring import Candidate, LoadTracker, ScoringConfig, choose, score_all
from kvstore.router.vllm_events import BlockEvent, VllmBatch
from kvstore.wire import limits
from kvstore.wire.errors import invalid, precondition
from kvstore.wire.events import CLEARED, REMOVED, STORED, StoreEvent
from kvstore.wire.hashing import HASH_FORMAT, block_hashes

log = logging.getLogger(__name__)
_U64 = (1 << 64) - 1
GPU_TIER = "gpu"


@dataclass
class RouterConfig:
    identity: IdentityAlgorithm = IdentityAlgorithm.R2
    scoring: ScoringConfig = field(default_factory=ScoringConfig)


@dataclass
class RouteResult:
    worker: Worker
    request_id: str
    total_blocks: int
    overlap_blocks: int
    gpu_blocks: int
    store_blocks: int
    remote_blocks: int
    cost: float
    reason: str
    worker_set: WorkerSetKey
    worker_sets: int


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


WorkerListener = Callable[[Worker | None, Worker | None], None]  # (admitted, removed)


class Router:
    def __init__(
        self, config: RouterConfig | None = None, clock: Callable[[], float] = time.monotonic
    ):
        self.config = config or RouterConfig()
        self.clock = clock
        self.admission = Admission(self.config.identity)
        self.domains: dict[Domain, SlotIndex] = {}
        self.peers = Peers()
        self.loads = LoadTracker()
        self.rng = random.Random(self.config.scoring.seed)
        self.events_applied = 0
        self.events_dropped = 0
        self.blocks_ingested = 0
        self._lock = threading.RLock()
        self._listeners: list[WorkerListener] = []
        self._request_ids = itertools.count(1)
        # Set by cli.build_router / add_router_to_server: the event feeds to run.
        self.feed_specs: tuple[list[str], list[str]] = (
            [],
            [],
        )  # (NAME=zmq endpoints, store addresses)
        self.subscriptions = None  # subscribers.Subscriptions once serving

    def add_listener(self, fn: WorkerListener) -> None:
        """Called (outside the lock) after each admission, replacement or removal."""
        self._listeners.append(fn)

    def _notify(self, admitted: Worker | None, removed: Worker | None) -> None:
        for fn in self._listeners:
            fn(admitted, removed)

    # -- workers -----------------------------------------------------------

    def register_worker(self, name: str, card: WorkerCard) -> Worker:
        """Admit ``card`` as ``name`` (replacing its previous generation)."""
        _check_name("name", name)
        validate_card(card)
        with self._lock:
            worker, old = self.admission.admit(name, card)
            if old is not None:
                self._forget(old)
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

    def remove_worker(self, name: str, generation: int = 0) -> Worker:
        """Remove a worker; its index entries and tracked load go with it."""
        with self._lock:
            worker = self.admission.remove(name, generation)
            self._forget(worker)
        log.info("removed %s gen %d", name, worker.ref.generation)
        self._notify(None, worker)
        return worker

    def _forget(self, worker: Worker) -> None:
        index = self.domains.get(worker.domain)
        if index is not None:
            for tier in (GPU_TIER, STORE_TIER):
                index.release((worker.ref, tier))
            if not index.holders():
                del self.domains[worker.domain]
        self.loads.drop_worker(worker.ref)

    def worker(self, ref: WorkerRef) -> Worker | None:
        with self._lock:
            return self.admission.current(ref)

    # -- events ------------------------------------------------------------

    def apply_worker_events(self, ref: WorkerRef, events: Sequence[BlockEvent]) -> int:
        """Index a worker's own events; a stale or unknown generation is dropped.

        Returns how many events were applied.
        """
        with self._lock:
            worker = self.admission.current(ref)
            if worker is None:
                self.events_dropped += len(events)
                return 0
            index = self.domains.get(worker.domain)
            if index is None:
                index = self.domains[worker.domain] = SlotIndex()
            for event in events:
                if event.kind == CLEARED:
                    for tier in (GPU_TIER, STORE_TIER):
                        slot = index.slot_of((ref, tier))
                        if slot is not None:
                            index.clear(slot)
                    continue
                slot = index.slot((ref, event.tier))
                if event.kind == STORED:
                    index.store(slot, event.hashes)
                    self.blocks_ingested += len(event.hashes)
                else:
                    index.remove(slot, event.hashes)
            self.events_applied += len(events)
            return len(events)

    def apply_vllm_batch(self, ref: WorkerRef, batch: VllmBatch) -> int:
        with self._lock:
            self.events_dropped += batch.skipped
            return self.apply_worker_events(ref, batch.events)

    def publish_store_events(
        self, node_id: str, generation: int, payloads: Sequence[bytes]
    ) -> tuple[int, int]:
        """Decode and apply a store's events; (applied, dropped).

        All payloads are decoded first, so a malformed one refuses the whole
        call with INVALID_ARGUMENT naming it and changes nothing. A stale
        generation drops everything (the peer restarted since).
        """
        if len(payloads) > limits.MAX_EVENTS_PER_PUBLISH:
            raise invalid(
                f"events: {len(payloads)} events, at most {limits.MAX_EVENTS_PER_PUBLISH}"
            )
        events = []
        for i, payload in enumerate(payloads):
            if len(payload) > limits.MAX_EVENT_BYTES:
                raise invalid(
                    f"events[{i}]: {len(payload)} bytes, at most {limits.MAX_EVENT_BYTES}"
                )
            try:
                event = StoreEvent.decode(payload)
            except ValueError as exc:
                raise invalid(f"events[{i}]: {exc}") from exc
            if len(event.block_hashes) > limits.MAX_HASHES_PER_EVENT:
                raise invalid(f"events[{i}].block_hashes: more than {limits.MAX_HASHES_PER_EVENT}")
            events.append(event)
        return self.apply_store_events(node_id, generation, events)

    def apply_store_events(
        self, node_id: str, generation: int, events: Sequence[StoreEvent]
    ) -> tuple[int, int]:
        """Apply decoded store events from peer (node_id, generation)."""
        with self._lock:
            peer = self.peers.current(node_id, generation)
            if peer is None:
                self.events_dropped += len(events)
                return 0, len(events)
            applied = sum(self._apply_store_event(peer, e) for e in events)
            return applied, len(events) - applied

    def apply_relayed_worker_event(self, event: StoreEvent) -> bool:
        """A GPU-tier event a store relays for a worker it serves (no peer needed)."""
        with self._lock:
            worker = self.admission.workers.get(event.worker)
            if event.tier != GPU_TIER or worker is None:
                self.events_dropped += 1
                return False
            return (
                self.apply_worker_events(worker.ref, [BlockEvent(event.type, event.block_hashes)])
                == 1
            )

    def _apply_store_event(self, peer: Peer, event: StoreEvent) -> bool:
        if event.tier == GPU_TIER:
            return self.apply_relayed_worker_event(event)
        if event.worker != peer.node_id or not _is_final_namespace(event.namespace):
            self.events_dropped += 1  # a store reports only its own blocks, per final namespace
            return False
        index = self.peers.index_for(peer, event.namespace)
        slot = index.slot((peer.node_id, event.tier))
        if event.type == STORED:
            index.store(slot, event.block_hashes)
            self.blocks_ingested += len(event.block_hashes)
        elif event.type == REMOVED:
            index.remove(slot, event.block_hashes)
        else:
            index.clear(slot)
        self.events_applied += 1
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
    ) -> Peer:
        _check_name("node_id", node_id)
        for where, addr in (("store_address", store_address), ("ucx_address", ucx_address)):
            if len(addr) > limits.MAX_ADDRESS_LEN:
                raise invalid(f"{where}: longer than {limits.MAX_ADDRESS_LEN}")
        with self._lock:
            now = self.clock()
            self.peers.expire(now)
            return self.peers.advertise(
                node_id,
                store_address,
                ucx_address,
                list(final_namespaces),
                generation,
                lease_ms,
                now,
            )

    def remove_peer(self, node_id: str, generation: int = 0) -> bool:
        with self._lock:
            return self.peers.remove(node_id, generation) is not None

    def query_prefix(
        self, final_namespace: str, hashes: Sequence[int], exclude_node_id: str = ""
    ) -> list[PeerPrefix]:
        """For each peer with sealed blocks of exactly ``final_namespace``: its longest prefix."""
        check_final_namespace("final_namespace", final_namespace)
        hashes = _check_hashes("block_hashes", hashes)
        with self._lock:
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
    ) -> RouteResult:
        """Pick a WorkerSet for ``model`` and the cheapest worker in it."""
        _check_name("model", model)
        if token_ids and hashes:
            raise invalid("token_ids and block_hashes: give one of them, not both")
        if token_ids is not None and len(token_ids) > limits.MAX_TOKEN_IDS:
            raise invalid(f"token_ids: {len(token_ids)} tokens, at most {limits.MAX_TOKEN_IDS}")
        if hashes:
            hashes = _check_hashes("block_hashes", hashes)
        if len(request_id) > limits.MAX_REQUEST_ID_LEN:
            raise invalid(f"request_id: longer than {limits.MAX_REQUEST_ID_LEN}")
        if not 0 <= decode_tokens <= limits.MAX_DECODE_TOKENS:
            raise invalid(f"decode_tokens: {decode_tokens} not in [0, {limits.MAX_DECODE_TOKENS}]")
        cfg = self.config.scoring
        with self._lock:
            now = self.clock()
            self.loads.expire(now)
            self.peers.expire(now)
            sets = self.admission.resolve(model, namespace, role)
            wset = (
                sets[0]
                if len(sets) == 1
                else self.rng.choices(sets, weights=[len(s.members) for s in sets], k=1)[0]
            )
            block_size = wset.reference.kv_block_size
            if token_ids:
                if wset.reference.hash_format != HASH_FORMAT:
                    raise precondition(
                        f"token_ids: WorkerSet {wset.key} uses hash format "
                        f"{wset.reference.hash_format!r}; send block_hashes"
                    )
                hashes = block_hashes(token_ids, block_size)
            hashes = list(hashes or [])
            total = len(hashes)
            decode_blocks = -(-decode_tokens // block_size)
            cands = self._candidates(wset, hashes)
            score_all(cands, total, decode_blocks, self.loads.per_worker, cfg)
            best = choose(cands, cfg, self.rng)
            worker = wset.members[best.ref.name]
            rid = request_id or f"r{next(self._request_ids)}"
            if track:
                self.loads.add(
                    rid,
                    best.ref,
                    total - best.cached,
                    total - best.gpu + decode_blocks,
                    now + cfg.request_timeout_s,
                )
            reason = _reason(best, cands, total, cfg, wset, sets)
            local = max(best.gpu, best.store)
            return RouteResult(
                worker,
                rid,
                total,
                best.overlap,
                best.gpu,
                max(0, best.store - best.gpu),
                max(0, best.remote - local),
                best.cost,
                reason,
                wset.key,
                len(sets),
            )

    def _candidates(self, wset: WorkerSet, hashes: list[int]) -> list[Candidate]:
        """Per member: its gpu / local store / remote prefix lengths of ``hashes``."""
        members = list(wset.members.values())
        cands = [Candidate(w.ref, 0, 0, 0) for w in members]
        if not hashes:
            return cands
        by_domain: dict[Domain, list[int]] = {}
        for i, w in enumerate(members):
            by_domain.setdefault(w.domain, []).append(i)
        for domain, positions in by_domain.items():
            index = self.domains.get(domain)
            if index is None:
                continue
            slots: dict[int, tuple[int, bool]] = {}  # slot -> (member position, is gpu tier)
            active = 0
            for i in positions:
                ref = members[i].ref
                for tier in (GPU_TIER, STORE_TIER):
                    slot = index.slot_of((ref, tier))
                    if slot is not None:
                        slots[slot] = (i, tier == GPU_TIER)
                        active |= 1 << slot
            if not active:
                continue
            for slot, depth in index.prefix_depths(hashes, active).items():
                i, is_gpu = slots[slot]
                if is_gpu:
                    cands[i].gpu = depth
                else:
                    cands[i].store = depth
        by_ns: dict[str, list[int]] = {}
        for i, w in enumerate(members):
            if w.card.final_namespace:
                by_ns.setdefault(w.card.final_namespace, []).append(i)
        for ns, positions in by_ns.items():
            index = self.peers.indexes.get(ns)
            if index is None:
                continue
            depths = index.prefix_depths(hashes, index.all_slots_mask)
            ranked = sorted(
                ((d, index.holder_of(s)) for s, d in depths.items() if d), key=lambda x: -x[0]
            )
            for i in positions:
                mine = (members[i].card.node_id, STORE_TIER)
                slot = index.slot_of(mine)
                c = cands[i]
                if slot is not None:
                    c.store = max(c.store, depths.get(slot, 0))
                c.remote = next((d for d, holder in ranked if holder != mine), 0)
        return cands

    def request_done(self, request_id: str, prefill_only: bool = False) -> bool:
        if len(request_id) > limits.MAX_REQUEST_ID_LEN:
            raise invalid(f"request_id: longer than {limits.MAX_REQUEST_ID_LEN}")
        with self._lock:
            return self.loads.done(request_id, prefill_only)

    # -- introspection -----------------------------------------------------

    def stats(self) -> RouterStats:
        with self._lock:
            indexed = sum(len(i) for i in self.domains.values())
            indexed += sum(len(i) for i in self.peers.indexes.values())
            return RouterStats(
                len(self.admission.workers),
                len(self.admission.sets),
                len(self.domains),
                len(self.peers.peers),
                indexed,
                self.events_applied,
                self.events_dropped,
                self.blocks_ingested,
                len(self.loads.requests),
                self.admission.rejected,
            )

    def index_bytes(self) -> int:
        with self._lock:
            return sum(i.nbytes() for i in self.domains.values()) + sum(
                i.nbytes() for i in self.peers.indexes.values()
            )


def _reason(
    best: Candidate,
    cands: list[Candidate],
    total: int,
    cfg: ScoringConfig,
    wset: WorkerSet,
    sets: list[WorkerSet],
) -> str:
    text = (
        f"{best.ref.name}: {best.overlap}/{total} blocks cached (gpu {best.gpu}, store {best.store}, "
        f"remote {best.remote}); cost {best.cost:.1f} = {cfg.overlap_weight:g} x {best.prefill:.1f} "
        f"prefill + {best.decode:.1f} decode"
    )
    others = [c for c in cands if c is not best]
    if others:
        runner = min(others, key=lambda c: (c.cost, c.ref.name))
        how = (
            "lowest cost" if cfg.temperature <= 0 else f"sampled at temperature {cfg.temperature:g}"
        )
        text += f"; {how} of {len(cands)} workers, next {runner.ref.name} cost {runner.cost:.1f}"
    if len(sets) > 1:
        n = sum(len(s.members) for s in sets)
        text += f"; WorkerSet {wset.key} drawn by worker count ({len(wset.members)}/{n})"
    return text


def _check_name(where: str, value: str) -> None:
    if not value or len(value) > limits.MAX_NAME_LEN or not value.isprintable():
        raise invalid(
            f"{where}: must be 1-{limits.MAX_NAME_LEN} printable characters, got {value[:64]!r}"
        )


def _check_hashes(where: str, hashes: Sequence[int]) -> list[int]:
    if len(hashes) > limits.MAX_BLOCK_HASHES:
        raise invalid(f"{where}: {len(hashes)} hashes, at most {limits.MAX_BLOCK_HASHES}")
    hashes = list(hashes)
    if hashes and (min(hashes) < 0 or max(hashes) > _U64):
        raise invalid(f"{where}: hashes must be u64")
    return hashes


def _is_final_namespace(ns: str) -> bool:
    try:
        check_final_namespace("namespace", ns)
    except Exception:
        return False
    return True
