"""The scheduler half of the vLLM connector: which blocks to load and save, never bytes.

It runs in vLLM's engine-core process and talks to the store for metadata
only: the instance's final namespace (``GetInstance``) and the longest sealed
prefix of a request's block hashes, leased until the request finishes
(``Query``). Every step it hands the workers one :class:`StepPlan`: the
(block hash, block id) pairs to load before the forward and to save after it.

Plain Python over duck-typed vLLM objects (``request.request_id``,
``request.block_hashes``, ``request.num_tokens``; a scheduler output's
``scheduled_new_reqs``, ``scheduled_cached_reqs`` and ``num_scheduled_tokens``),
so it is tested without an engine. A store that cannot be reached is a miss,
logged once per outage, never an error the engine sees. A lease the store
refuses (its per-certificate lease quota, RESOURCE_EXHAUSTED) is a miss of that
request only: the store answered, and is asked again by the next request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvstore.client.store_client import StoreClient
from kvstore.integrations.vllm.identity import block_key
from kvstore.wire.errors import Code, KVError
from kvstore.wire.limits import DEFAULT_LEASE_MS

log = logging.getLogger(__name__)

NOT_YET = None  # get_num_new_matched_tokens' "ask again next step"
# Plans whose saves a heard load failure plans again: at least vLLM's batch queue
# (2 with async scheduling, the pipeline's depth with pipeline parallelism), so
# every plan built before the scheduler heard is covered. Past it a skipped save
# is a miss, never stale KV (the failed rank never saves those plans).
RESAVE_PLANS = 16


class BlockPair(NamedTuple):
    key: int  # kvstore key of the block hash
    block_id: int  # vLLM block id in every rank's paged cache


@dataclass
class StepPlan:
    """What every worker does this step: load before the forward, save after it."""

    loads: list[BlockPair] = field(default_factory=list)
    saves: list[BlockPair] = field(default_factory=list)
    # numbers the plans: every rank saves under it, and the store seals a block only
    # once every rank wrote it in one step (a rank whose load failed saves nothing)
    step: int = 0


@dataclass
class _Lookup:
    """A request's answer from the store, kept so repeated asks agree."""

    keys: list[int]
    hit_blocks: int
    lease_id: str = ""
    local_tokens: int = 0
    fresh_until: float = float("inf")  # asked again from then on (half its lease gone)


@dataclass
class _Tracked:
    """A running request whose newly full blocks are saved step by step."""

    request: Any
    block_ids: list[int]
    saved_blocks: int
    # blocks from here on rest on a failed load that vLLM did not make this request
    # recompute (it shares them with the request that does): never saved
    stale_from: int | None = None


@dataclass
class SchedulerStats:
    queries: int = 0
    hit_blocks: int = 0
    load_blocks: int = 0
    save_blocks: int = 0
    store_errors: int = 0
    prefetches: int = 0
    lease_refusals: int = 0  # lookups the store answered RESOURCE_EXHAUSTED (a miss each)


class SchedulerSide:
    """Per-engine scheduler state; one per vLLM engine core."""

    def __init__(
        self,
        client: StoreClient,
        instance_id: str,
        block_size: int,
        *,
        expected_hash_format: Callable[[], str] | None = None,
        lease_ms: int = 60_000,
        prefetch: bool = False,
        retry_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.client = client
        self.instance_id = instance_id
        self.block_size = block_size
        self.expected_hash_format = expected_hash_format
        self.lease_ms = lease_ms
        self.prefetch = prefetch
        self.retry_s = retry_s
        self.clock = clock
        self.stats = SchedulerStats()
        self._namespace: str | None = None
        self._down_since: float | None = None
        self._refused_since: float | None = None  # first lease refusal of this episode
        self._next_try = 0.0
        self._lookups: dict[str, _Lookup] = {}
        self._prefetching: dict[str, threading.Thread] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._plan = StepPlan()
        self._steps = 0  # plans built
        # per recent plan, request -> the first block index it saved: a rank whose
        # load failed skips the saves of the plans built before the scheduler heard
        self._saved_in: deque[dict[str, int]] = deque([{}], maxlen=RESAVE_PLANS)

    # ------------------------------------------------------------ matching

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens the store can provide beyond ``num_computed_tokens`` (block-aligned).

        Idempotent while the answer is fresh: the first call queries (and
        leases) the whole chain, later calls reuse that answer until half its
        lease is gone (a request preempted or waiting long asks again, so its
        Load never relies on a lapsed lease). Never claims the last prompt
        token. None while a peer prefetch of the request is in flight.
        """
        req_id = request.request_id
        if req_id in self._prefetching:
            if self._prefetching[req_id].is_alive():
                return NOT_YET
            del self._prefetching[req_id]
            self._drop_lookup(req_id)
            self._lookup(request, prefetch=False)
        lookup = self._lookups.get(req_id)
        if lookup is not None and self.clock() >= lookup.fresh_until:
            stale = self._lookups.pop(req_id)
            lookup = self._lookup(request, self.prefetch)  # leased anew first,
            self._release(stale)  # then the old lease goes: the blocks stay pinned between
        elif lookup is None:
            lookup = self._lookup(request, self.prefetch)
        if lookup is None:
            return NOT_YET
        lookup.local_tokens = num_computed_tokens
        return max(0, lookup.hit_blocks * self.block_size - num_computed_tokens)

    def _lookup(self, request: Any, prefetch: bool) -> _Lookup | None:
        keys = self._claimable_keys(request)
        lookup = _Lookup(keys, 0)
        namespace = self._final_namespace() if keys else None
        answered = False
        if namespace is not None:
            asked = self.clock()
            try:
                answer = self.client.query(namespace, keys, lease=True, lease_ms=self.lease_ms)
                lookup.hit_blocks, lookup.lease_id = answer.prefix_blocks, answer.lease_id
                lease_ms = self.lease_ms or DEFAULT_LEASE_MS  # 0: the store's default
                lookup.fresh_until = asked + lease_ms / 2000
                answered = True
                self.stats.queries += 1
                self.stats.hit_blocks += lookup.hit_blocks
                self._store_ok()
                if lookup.lease_id:  # a miss takes no lease, and says nothing of the quota
                    self._leases_granted()
            except KVError as err:
                if err.code is Code.RESOURCE_EXHAUSTED:
                    self._lease_refused(err)  # no prefetch either: its lookup would be refused
                else:
                    self._store_failed(err)
        # a prefetch only where the store answered: one that did not would hold the
        # request back a whole prefetch timeout for a store that is down or hung
        if prefetch and answered and lookup.hit_blocks < len(keys):
            self._release(lookup)
            self._start_prefetch(request.request_id, namespace, keys)
            return None
        self._lookups[request.request_id] = lookup
        return lookup

    def _claimable_keys(self, request: Any) -> list[int]:
        """Keys of the request's full blocks that stop short of its last token."""
        limit = (request.num_tokens - 1) // self.block_size
        return [block_key(h) for h in request.block_hashes[:limit]]

    def _start_prefetch(self, req_id: str, namespace: str, keys: list[int]) -> None:
        def pull() -> None:
            try:
                result = self.client.prefetch(namespace, keys)
                if result.fetched_blocks:
                    log.info(
                        "prefetched %d blocks of %s from peer %s",
                        result.fetched_blocks,
                        req_id,
                        result.peer,
                    )
            except KVError as err:
                log.info("prefetch for %s failed: %s", req_id, err)

        self.stats.prefetches += 1
        thread = threading.Thread(target=pull, daemon=True, name=f"kvstore-prefetch-{req_id}")
        self._prefetching[req_id] = thread
        thread.start()

    def _final_namespace(self) -> str | None:
        """The instance's final namespace, once its workers have sealed it; None
        while the store is down (no call until its retry is due: a hung store
        would cost every request the client's timeout)."""
        if self._store_down():
            return None
        if self._namespace is not None or self.clock() < self._next_try:
            return self._namespace
        try:
            info = self.client.instance(self.instance_id)
        except KVError as err:
            self._store_failed(err)
            return None
        if not info.sealed:
            self._next_try = self.clock() + 1.0
            return None
        expected = self.expected_hash_format() if self.expected_hash_format else None
        if expected is not None and info.hash_format != expected:
            log.error(
                "instance %s registered hash_format %r but this scheduler hashes as %r; "
                "external prefix cache disabled",
                self.instance_id,
                info.hash_format,
                expected,
            )
            self._next_try = float("inf")
            return None
        self._namespace = info.final_namespace
        log.info("kvstore: instance %s sealed as %s", self.instance_id, self._namespace)
        return self._namespace

    def _store_down(self) -> bool:
        """A call to the store failed and its retry is not due yet."""
        return self._down_since is not None and self.clock() < self._next_try

    def _store_ok(self) -> None:
        if self._down_since is not None:
            log.warning(
                "kvstore store %s is back after %.1f s; external prefix cache on again",
                self.client.address,
                self.clock() - self._down_since,
            )
            self._down_since = None

    def _store_failed(self, err: KVError) -> None:
        self.stats.store_errors += 1
        self._next_try = self.clock() + self.retry_s
        if self._down_since is None:
            self._down_since = self.clock()
            log.warning(
                "kvstore store %s unreachable (%s): serving without the external prefix "
                "cache (prefixes are recomputed) and retrying every %.1f s",
                self.client.address,
                err,
                self.retry_s,
            )

    def _lease_refused(self, err: KVError) -> None:
        """The store refused this lookup's lease: its quota of leases per certificate
        (MAX_LEASES_PER_PRINCIPAL, every engine of the tenant together) is full.

        The store answered, so it is not down. Taken for down, it was not asked for
        ``retry_s``, and requests finishing meanwhile did not give their leases back
        (a down store's leases expire by themselves), which kept the quota full. This
        request misses; the next one asks again, and leases given back meanwhile make
        room. Logged once per episode (until a lease is granted again)."""
        self.stats.lease_refusals += 1
        if self._refused_since is None:
            self._refused_since = self.clock()
            log.warning(
                "kvstore store %s refused a lease (%s): requests miss the external prefix "
                "cache (prefixes are recomputed) until it grants leases again",
                self.client.address,
                err,
            )

    def _leases_granted(self) -> None:
        if self._refused_since is not None:
            log.warning(
                "kvstore store %s grants leases again after %.1f s; external prefix cache on",
                self.client.address,
                self.clock() - self._refused_since,
            )
            self._refused_since = None

    # ----------------------------------------------------------- allocation

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """Plan the load of ``num_external_tokens`` into the request's new blocks."""
        lookup = self._lookups.get(request.request_id)
        if num_external_tokens <= 0 or lookup is None:
            return
        first = lookup.local_tokens // self.block_size
        count = num_external_tokens // self.block_size
        pairs = [BlockPair(lookup.keys[i], block_ids[i]) for i in range(first, first + count)]
        self._plan.loads.extend(pairs)
        self.stats.load_blocks += len(pairs)

    # ----------------------------------------------------------------- steps

    def build_plan(self, scheduler_output: Any, requests: dict[str, Any]) -> StepPlan:
        """This step's plan; ``requests`` maps request ids to vLLM requests."""
        for new in scheduler_output.scheduled_new_reqs:
            request = requests.get(new.req_id)
            if request is not None:
                # from block 0: blocks vLLM found in its own cache may be gone from the
                # store (evicted, or a restarted store); Save skips what the store holds
                self._tracked[new.req_id] = _Tracked(request, list(new.block_ids[0]), 0)
            self._save_full_blocks(new.req_id, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0]) if new_ids else []
                tracked.saved_blocks = min(tracked.saved_blocks, len(tracked.block_ids))
            elif new_ids:
                tracked.block_ids.extend(new_ids[0])
            self._save_full_blocks(req_id, cached.num_computed_tokens[i], scheduler_output)
        plan, self._plan = self._plan, StepPlan()
        self._steps += 1
        plan.step = self._steps
        self._saved_in.append({})  # the next plan's
        # requests sharing a prefix (vLLM caches their blocks once) name the same
        # blocks; the store refuses a request with a hash twice, so each goes once
        first: dict[int, BlockPair] = {}
        for pair in plan.saves:
            first.setdefault(pair.key, pair)
        plan.saves = list(first.values())
        return plan

    def _save_full_blocks(self, req_id: str, computed: int, scheduler_output: Any) -> None:
        tracked = self._tracked.get(req_id)
        if tracked is None:
            return
        done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        hashes = tracked.request.block_hashes
        full = min(done // self.block_size, len(hashes), len(tracked.block_ids))
        if tracked.stale_from is not None:
            full = min(full, tracked.stale_from)
        for i in range(tracked.saved_blocks, full):
            self._plan.saves.append(BlockPair(block_key(hashes[i]), tracked.block_ids[i]))
        if full > tracked.saved_blocks:
            saved = self._saved_in[-1]
            saved[req_id] = min(saved.get(req_id, tracked.saved_blocks), tracked.saved_blocks)
        self.stats.save_blocks += max(0, full - tracked.saved_blocks)
        tracked.saved_blocks = max(tracked.saved_blocks, full)

    def load_failed(self, invalid_block_ids: set[int]) -> None:
        """A step's output reported blocks whose load failed. Called after vLLM
        handled them (``update_from_output``): it rewound the request that
        recomputes each failed block, and left any other request that shares it
        (through its prefix cache) as it was, although with a batch queue such a
        request may already have computed blocks on the stale KV.

        The saves of the last RESAVE_PLANS plans are planned again (the failed
        rank skipped those built before this: WorkerSide.save): a rewound
        request's from its first failed block on (vLLM recomputes them), a
        request that shares a failed block but was not rewound never from that
        block on. The store skips what it already holds."""
        redo: dict[str, int] = {}
        for saved in self._saved_in:
            for req_id, first in saved.items():
                redo[req_id] = min(redo.get(req_id, first), first)
        for req_id, tracked in self._tracked.items():
            keep = min(tracked.saved_blocks, redo.get(req_id, tracked.saved_blocks))
            failed = next(
                (i for i, b in enumerate(tracked.block_ids) if b in invalid_block_ids), None
            )
            if failed is not None:
                keep = min(keep, failed)
                if tracked.request.num_computed_tokens > failed * self.block_size:
                    stale = tracked.stale_from
                    tracked.stale_from = failed if stale is None else min(stale, failed)
            tracked.saved_blocks = keep
        self._saved_in.clear()
        self._saved_in.append({})

    def finished(self, req_id: str) -> None:
        """The request is done: end its lease and forget it."""
        self._tracked.pop(req_id, None)
        self._prefetching.pop(req_id, None)
        self._drop_lookup(req_id)

    def _drop_lookup(self, req_id: str) -> None:
        lookup = self._lookups.pop(req_id, None)
        if lookup is not None:
            self._release(lookup)

    def _release(self, lookup: _Lookup) -> None:
        """Give the lookup's lease back (not while the store is down: it expires)."""
        if not lookup.lease_id or self._store_down():
            lookup.lease_id = ""
            return
        try:
            self.client.release(lookup.lease_id)
        except KVError as err:  # the lease expires by itself
            log.debug("release of lease %s failed: %s", lookup.lease_id, err)
            if err.code in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED):
                self._store_failed(err)
        lookup.lease_id = ""
