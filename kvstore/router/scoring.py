"""Choosing a worker: cost = overlap_weight x prefill blocks + decode blocks.

For each candidate the router knows three prefix lengths of the request:

    gpu     blocks on the worker's own GPU (its vLLM events)
    store   blocks in its node's store (or its own offload tier)
    remote  blocks a peer store of the same final namespace holds

Cached blocks are credited by tier (a GPU hit saves the whole prefill of a
block, a store hit saves most of it, a remote hit less), so

    cached  = w_gpu*gpu + w_store*max(0, store-gpu) + w_remote*max(0, remote-max(gpu, store))
    prefill = active prefill blocks of the worker + (request blocks - cached)
    decode  = active decode blocks of the worker + (request blocks - gpu) + output blocks
    cost    = overlap_weight * prefill + decode

The decode term is the KV memory the request will hold: blocks already on
the worker's GPU are shared with the cache (paged attention with prefix
caching references them, it does not copy them), so only the rest is new;
blocks fetched from a store land in fresh GPU blocks and count in full.

Temperature 0 takes the argmin (ties: more cached blocks, then less load,
then name, so the answer is reproducible); a positive temperature samples
from softmax(-cost / (temperature * max cost)), which spreads load when
costs are close.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from kvstore.router.admission import WorkerRef
from kvstore.wire import limits


@dataclass
class ScoringConfig:
    overlap_weight: float = 1.0
    temperature: float = 0.0
    gpu_weight: float = 1.0
    store_weight: float = 0.75
    remote_weight: float = 0.5
    request_timeout_s: float = 600.0  # a tracked request never reported done is freed after this
    seed: int | None = None


@dataclass
class Candidate:
    """One worker's prefix lengths (blocks) and the cost they give it."""

    ref: WorkerRef
    gpu: int
    store: int
    remote: int
    cached: float = 0.0
    prefill: float = 0.0
    decode: float = 0.0
    cost: float = 0.0

    @property
    def overlap(self) -> int:
        return max(self.gpu, self.store, self.remote)


def score_all(
    cands: list[Candidate],
    total_blocks: int,
    new_decode_blocks: int,
    loads: dict[WorkerRef, list[float]],
    cfg: ScoringConfig,
) -> None:
    """Fill in ``cached``, ``prefill``, ``decode`` and ``cost`` of every candidate."""
    wg, ws, wr, ow = cfg.gpu_weight, cfg.store_weight, cfg.remote_weight, cfg.overlap_weight
    fresh = total_blocks + new_decode_blocks
    for c in cands:
        g, st = c.gpu, c.store
        local = g if g > st else st
        cached = (
            wg * g
            + (ws * (st - g) if st > g else 0.0)
            + (wr * (c.remote - local) if c.remote > local else 0.0)
        )
        load = loads.get(c.ref)
        c.cached = cached
        c.prefill = total_blocks - cached + (load[0] if load else 0.0)
        c.decode = fresh - g + (load[1] if load else 0.0)
        c.cost = ow * c.prefill + c.decode


def choose(cands: list[Candidate], cfg: ScoringConfig, rng: random.Random) -> Candidate:
    """Argmin with a deterministic tie-break, or softmax sampling."""
    if cfg.temperature <= 0 or len(cands) == 1:
        return min(cands, key=lambda c: (c.cost, -c.cached, c.prefill + c.decode, c.ref.name))
    top = max(c.cost for c in cands) or 1.0
    lo = min(c.cost for c in cands)
    weights = [math.exp(-(c.cost - lo) / (cfg.temperature * top)) for c in cands]
    return rng.choices(cands, weights=weights, k=1)[0]


def explain(best: Candidate, cands: list[Candidate], total: int, cfg: ScoringConfig) -> str:
    """Why ``best`` won, in one line: its tiers, its cost, and the runner-up."""
    text = (
        f"{best.ref.name}: {best.overlap}/{total} blocks cached (gpu {best.gpu}, "
        f"store {best.store}, remote {best.remote}); cost {best.cost:.1f} = "
        f"{cfg.overlap_weight:g} x {best.prefill:.1f} prefill + {best.decode:.1f} decode"
    )
    others = [c for c in cands if c is not best]
    if others:
        runner = min(others, key=lambda c: (c.cost, c.ref.name))
        how = (
            "lowest cost" if cfg.temperature <= 0 else f"sampled at temperature {cfg.temperature:g}"
        )
        text += f"; {how} of {len(cands)} workers, next {runner.ref.name} cost {runner.cost:.1f}"
    return text


@dataclass
class ActiveRequest:
    ref: WorkerRef
    prefill: float
    decode: float
    deadline: float


@dataclass
class LoadTracker:
    """Per-worker load from routed requests: added on route, freed on
    completion (RequestDone) or when the request's deadline passes."""

    requests: dict[str, ActiveRequest] = field(default_factory=dict)
    per_worker: dict[WorkerRef, list[float]] = field(default_factory=dict)
    _deadlines: list[tuple[float, str]] = field(default_factory=list)

    def load(self, ref: WorkerRef) -> tuple[float, float]:
        pd = self.per_worker.get(ref)
        return (pd[0], pd[1]) if pd else (0.0, 0.0)

    def add(
        self, request_id: str, ref: WorkerRef, prefill: float, decode: float, deadline: float
    ) -> None:
        if request_id in self.requests:
            self.done(request_id)
        if len(self.requests) >= limits.MAX_ACTIVE_REQUESTS:
            self.expire(math.inf, limit=1)
        self.requests[request_id] = ActiveRequest(ref, prefill, decode, deadline)
        pd = self.per_worker.setdefault(ref, [0.0, 0.0])
        pd[0] += prefill
        pd[1] += decode
        heapq.heappush(self._deadlines, (deadline, request_id))
        if len(self._deadlines) > 2 * len(self.requests) + 1024:  # drop entries of done requests
            self._deadlines = [(r.deadline, rid) for rid, r in self.requests.items()]
            heapq.heapify(self._deadlines)

    def done(self, request_id: str, prefill_only: bool = False) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        pd = self.per_worker.get(req.ref)
        if pd is not None:
            pd[0] = max(0.0, pd[0] - req.prefill)
            if not prefill_only:
                pd[1] = max(0.0, pd[1] - req.decode)
        req.prefill = 0.0
        if not prefill_only:
            del self.requests[request_id]
            if pd is not None and pd[0] == 0 and pd[1] == 0:
                del self.per_worker[req.ref]
        return True

    def expire(self, now: float, limit: int | None = None) -> int:
        """Free requests whose deadline passed (at most ``limit`` of them)."""
        freed = 0
        while self._deadlines and self._deadlines[0][0] <= now and (limit is None or freed < limit):
            deadline, rid = heapq.heappop(self._deadlines)
            req = self.requests.get(rid)
            if req is not None and req.deadline == deadline:
                self.done(rid)
                freed += 1
        return freed

    def drop_worker(self, ref: WorkerRef) -> None:
        """A removed worker's requests are gone with it."""
        self.per_worker.pop(ref, None)
        for rid in [rid for rid, r in self.requests.items() if r.ref == ref]:
            del self.requests[rid]
