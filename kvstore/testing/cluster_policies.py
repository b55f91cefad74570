"""Routing policies for ``kvstore.testing.cluster_sim.replay``.

- ``KvRouterPolicy``: the real ``kvstore.router.Router``, fed the simulated
  workers' cache changes as vLLM ``KVEventBatch`` payloads (BlockRemoved then
  BlockStored, through the real decoder) ``event_lag_ms`` after they happen.
  With the load API (``report_load``, ``request_started``,
  ``request_finished``, detected by name), a request is marked started when
  its prefill starts and finished, with the blocks it really hit, when its
  decode ends, at once; and each worker reports every ``report_every_ms``
  (0: never) its queued prefill tokens (the waiting requests' hits estimated
  on its cache at that moment, plus what the running prefill has left), its
  decoding requests and its cache fill. Without the API (the router before
  it), ``request_done`` marks the end of the prefill and of the decode.
- Baselines that need no index: round-robin, random, least-loaded (fewest
  input tokens waiting or in prefill, read from the workers with no lag),
  prefix-affinity hashing on the first ``depth`` blocks, session affinity.
- ``OraclePolicy``: the worker with the lowest true TTFT for this request,
  computed exactly from the simulated queues and caches. It is greedy (it
  ignores what its choice does to later requests), so it is a strong
  reference rather than a bound.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.router.core import Router, RouterConfig
from kvstore.router.scoring import ScoringConfig
from kvstore.router.vllm_events import decode_batch
from kvstore.testing.cluster_sim import CostModel, SimWorker, TraceRequest, WorkerEvent
from kvstore.testing.vllm_events import encode_batch
from kvstore.wire.card import WorkerCard

MODEL = "trace"
_MASK = (1 << 64) - 1


def stable_hash(values: Sequence[int]) -> int:
    """FNV-1a over u64 values, then a splitmix finaliser: the same in every process."""
    h = 0xCBF29CE484222325
    for v in values:
        h = ((h ^ (v & _MASK)) * 0x100000001B3) & _MASK
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK
    return h ^ (h >> 31)


@dataclass
class BasePolicy:
    """No feed, no reports: the baselines only choose."""

    name: str = ""
    report_every_ms: float = 0.0

    def observe(self, event: WorkerEvent) -> None:
        return None

    def report(self, now: float, workers: Sequence[SimWorker]) -> None:
        return None


@dataclass
class RoundRobin(BasePolicy):
    name: str = "round_robin"
    _next: int = 0

    def choose(self, request, request_id, now, workers) -> int:
        self._next += 1
        return (self._next - 1) % len(workers)


@dataclass
class RandomPolicy(BasePolicy):
    seed: int = 0
    name: str = "random"
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def choose(self, request, request_id, now, workers) -> int:
        return self.rng.randrange(len(workers))


@dataclass
class LeastLoaded(RandomPolicy):
    """Fewest input tokens waiting or in prefill; ties by fewer requests, then at random."""

    name: str = "least_loaded"

    def choose(self, request, request_id, now, workers) -> int:
        keys = [(w.queued_tokens(), w.requests(), self.rng.random()) for w in workers]
        return min(range(len(workers)), key=keys.__getitem__)


@dataclass
class PrefixHash(BasePolicy):
    """The worker a hash of the first ``depth`` block ids names (no index at all)."""

    depth: int = 1
    name: str = ""

    def __post_init__(self) -> None:
        self.name = self.name or f"prefix_hash_{self.depth}"

    def choose(self, request, request_id, now, workers) -> int:
        return stable_hash(request.block_ids[: self.depth]) % len(workers)


@dataclass
class SessionAffinity(BasePolicy):
    """All turns of a session on the worker its id hashes to."""

    name: str = "session_affinity"

    def choose(self, request, request_id, now, workers) -> int:
        return stable_hash([request.session]) % len(workers)


@dataclass
class OraclePolicy(RandomPolicy):
    """The lowest exact TTFT; ties by fewer queued tokens, then at random."""

    name: str = "oracle"

    def choose(self, request, request_id, now, workers) -> int:
        keys = [
            (w.ttft_if_added(request, now), w.queued_tokens(), self.rng.random()) for w in workers
        ]
        return min(range(len(workers)), key=keys.__getitem__)


def has_load_api(router: Router) -> bool:
    return all(hasattr(router, m) for m in ("report_load", "request_started", "request_finished"))


def _load_report_type():
    import kvstore.router as router_pkg

    return getattr(router_pkg, "LoadReport", None)


class KvRouterPolicy:
    """The kvstore Router, fed like a deployment feeds it (see the module docstring)."""

    def __init__(
        self,
        workers: int,
        model: CostModel,
        event_lag_ms: float = 0.0,
        report_every_ms: float = 0.0,
        seed: int = 0,
        name: str = "router",
    ):
        self.name = name
        self.now_s = 0.0
        self.router = Router(RouterConfig(scoring=ScoringConfig(seed=seed)), clock=self._clock)
        card = WorkerCard(MODEL, model.block_tokens)
        self.refs = [self.router.register_worker(f"w{i}", card).ref for i in range(workers)]
        self.index = {ref.name: i for i, ref in enumerate(self.refs)}
        self.event_lag_ms = event_lag_ms
        self.block_tokens = model.block_tokens
        self.lifecycle_api = has_load_api(self.router)
        self.load_report = _load_report_type() if self.lifecycle_api else None
        reporting = self.load_report is not None and report_every_ms > 0
        self.report_every_ms = report_every_ms if reporting else 0.0
        self._pending: list[tuple[float, int, Callable[[], object]]] = []
        self._seq = 0
        self.predicted: dict[str, float] = {}  # request id -> the route's expected TTFT (ms)

    def _clock(self) -> float:
        return self.now_s

    def _later(self, at_ms: float, fn: Callable[[], object]) -> None:
        self._seq += 1
        heapq.heappush(self._pending, (at_ms, self._seq, fn))

    def _deliver(self, now: float) -> None:
        while self._pending and self._pending[0][0] <= now:
            at_ms, _, fn = heapq.heappop(self._pending)
            self.now_s = at_ms / 1e3
            fn()
        self.now_s = now / 1e3

    def observe(self, event: WorkerEvent) -> None:
        job, t = event.job, event.time_ms
        if event.stored or event.evicted:
            payload = _vllm_payload(event.stored, event.evicted, t, self.block_tokens)
            ref = self.refs[job.worker]
            self._later(t + self.event_lag_ms, lambda: self._apply(ref, payload))
        rid, router, blocks = job.request_id, self.router, job.cached_blocks
        if self.lifecycle_api and event.kind == "started":
            self._later(t, lambda: router.request_started(rid))
        elif self.lifecycle_api and event.kind == "finished":
            self._later(t, lambda: router.request_finished(rid, cached_blocks=blocks))
        elif not self.lifecycle_api and event.kind == "prefilled":
            self._later(t, lambda: router.request_done(rid, prefill_only=True))
        elif not self.lifecycle_api and event.kind == "finished":
            self._later(t, lambda: router.request_done(rid))

    def _apply(self, ref, payload: bytes) -> None:
        self.router.apply_vllm_batch(ref, decode_batch(payload))

    def report(self, now: float, workers: Sequence[SimWorker]) -> None:
        self._deliver(now)
        for ref, w in zip(self.refs, workers, strict=True):
            report = self.load_report(
                queued_prefill_tokens=w.queued_uncached_tokens(now),
                running_requests=w.decoding(),
                kv_usage=w.kv_usage(),
            )
            self.router.report_load(ref.name, report)

    def choose(
        self, request: TraceRequest, request_id: str, now: float, workers: Sequence[SimWorker]
    ) -> int:
        self._deliver(now)
        answer = self.router.route(
            MODEL,
            hashes=list(request.block_ids),
            request_id=request_id,
            decode_tokens=request.output_tokens,
        )
        estimate = getattr(answer, "ttft", None)  # the router's TTFT forecast, when it makes one
        if estimate is not None:
            self.predicted[request_id] = estimate.ttft_ms
        return self.index[answer.worker.name]


def _vllm_payload(
    stored: Sequence[int], evicted: Sequence[int], t_ms: float, block_tokens: int
) -> bytes:
    """One vLLM batch: the evictions, then the new blocks (vLLM frees before it stores)."""
    events: list[list] = []
    if evicted:
        events.append(["BlockRemoved", list(evicted), "GPU"])
    if stored:
        events.append(["BlockStored", list(stored), None, [], block_tokens, None, "GPU", None])
    return encode_batch(events, ts=t_ms / 1e3)
