"""A discrete-event serving cluster for replaying traces through routing policies.

Deterministic plain Python: N workers, each with

- an LRU prefix cache of ``cache_blocks`` blocks of ``block_tokens`` tokens;
  a prompt's blocks are inserted (or touched) when its prefill completes,
  tail blocks first out (the prefix is the most recently used, as in vLLM),
  and a request's output blocks (when the trace names them) when its decode
  completes;
- one FIFO prefill queue, one prefill at a time (no chunking, no batching of
  prefills): a request's cached prefix is the longest prefix of its block ids
  in the cache **when its prefill starts**, and the prefill takes

      prefill_ms = overhead_ms + uncached_tokens / prefill_tokens_per_ms
                   * (1 + decode_interference * running_decodes)

  where ``running_decodes`` counts this worker's requests decoding when the
  prefill starts (a continuous-batching engine steps decodes together with
  the prefill, so each running decode slows it a little);
- decode of ``output_tokens - 1`` further tokens at ``decode_ms_per_token``
  after the first token, all decodes in parallel (no batch limit).

TTFT = queue wait + prefill, the first token leaving at the end of the
prefill. ``uncached_tokens = input_tokens - min(cached_blocks * block_tokens,
input_tokens - 1)``: at least one token is always computed.

Limits of the model: no attention term (prefill cost is linear in new
tokens, whatever the context), no KV memory pressure from running requests
(the cache holds finished prefixes only, decodes never preempt), no prefill
batching across requests, no network or transfer time, the decode count is
frozen for the length of a prefill, output blocks are cached only when the
trace names them (the Mooncake trace does not). Workers are independent: a
worker's future is fully known from its queue, cache and decodes, which is
what makes the oracle policy exact (``SimWorker.ttft_if_added``).

Policies (``kvstore.testing.cluster_policies``) see each arrival in time
order and pick a worker; ``replay`` returns one ``JobRecord`` per request, and
``kvstore.testing.cluster_metrics`` sums them up.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: arrival, lengths and its prompt's block ids."""

    arrival_ms: float
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]
    session: int = -1  # multi-turn session id, -1 when the trace has none
    output_ids: tuple[int, ...] = ()  # full blocks the answer completes, cached after decode


@dataclass(frozen=True)
class CostModel:
    block_tokens: int = 512
    cache_blocks: int = 1000
    prefill_tokens_per_ms: float = 25.0
    prefill_overhead_ms: float = 5.0
    decode_interference: float = 0.005
    decode_ms_per_token: float = 20.0

    def uncached_tokens(self, request: TraceRequest, cached_blocks: int) -> int:
        cached = min(cached_blocks * self.block_tokens, request.input_tokens - 1)
        return request.input_tokens - max(0, cached)

    def prefill_ms(self, uncached_tokens: int, running_decodes: int) -> float:
        slow = 1.0 + self.decode_interference * running_decodes
        return self.prefill_overhead_ms + uncached_tokens / self.prefill_tokens_per_ms * slow


@dataclass
class Job:
    """A request on a worker; times are filled in as it runs."""

    request_id: str
    request: TraceRequest
    worker: int
    start_ms: float = math.nan
    first_token_ms: float = math.nan
    done_ms: float = math.nan
    cached_blocks: int = 0
    uncached_tokens: int = 0


@dataclass(frozen=True)
class WorkerEvent:
    """What a worker did, for policies that listen (the router's feed)."""

    kind: str  # "started" | "prefilled" | "finished"
    time_ms: float
    job: Job
    stored: tuple[int, ...] = ()
    evicted: tuple[int, ...] = ()


@dataclass(frozen=True)
class CacheChange:
    stored: tuple[int, ...]
    evicted: tuple[int, ...]


class LruBlocks:
    """A worker's prefix cache: LRU over block ids, the prefix kept most recent."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.blocks)

    def prefix(self, ids: Sequence[int]) -> int:
        n = 0
        for h in ids:
            if h not in self.blocks:
                break
            n += 1
        return n

    def touch(self, ids: Sequence[int]) -> None:
        for h in reversed(ids):
            self.blocks.move_to_end(h)

    def insert(self, ids: Sequence[int]) -> CacheChange:
        """Insert or touch ``ids``; evict the least recently used past capacity."""
        new = []
        for h in reversed(ids):
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                self.blocks[h] = None
                new.append(h)
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        gone = set(evicted)
        return CacheChange(tuple(h for h in reversed(new) if h not in gone), tuple(evicted))

    def copy(self) -> LruBlocks:
        other = LruBlocks(self.capacity)
        other.blocks = self.blocks.copy()
        return other


EventSink = Callable[[WorkerEvent], None]


def _drop(_event: WorkerEvent) -> None:
    return None


class SimWorker:
    """One worker: a FIFO prefill queue, one prefill at a time, parallel decodes."""

    def __init__(self, index: int, model: CostModel, sink: EventSink = _drop):
        self.index = index
        self.model = model
        self.sink = sink
        self.cache = LruBlocks(model.cache_blocks)
        self.queue: deque[Job] = deque()
        self.current: Job | None = None
        self.decodes: list[tuple[float, int, Job]] = []  # (done_ms, seq, job) heap
        self.busy_ms = 0.0
        self._seq = 0

    def next_time(self) -> float:
        t = self.current.first_token_ms if self.current is not None else math.inf
        return min(t, self.decodes[0][0]) if self.decodes else t

    def advance(self, until: float) -> None:
        """Run every prefill end and decode end at or before ``until``."""
        while (t := self.next_time()) <= until and t < math.inf:
            self.step()

    def step(self) -> None:
        now = self.next_time()
        if self.current is not None and self.current.first_token_ms == now:
            self._prefilled(self.current)
        else:
            self._finished(heapq.heappop(self.decodes)[2])

    def enqueue(self, job: Job, now: float) -> None:
        """Add ``job`` at ``now`` (the worker must have been advanced to ``now``)."""
        self.queue.append(job)
        if self.current is None:
            self._start_next(now)

    def _start_next(self, now: float) -> None:
        if not self.queue:
            self.current = None
            return
        job = self.current = self.queue.popleft()
        ids = job.request.block_ids
        job.cached_blocks = self.cache.prefix(ids)
        self.cache.touch(ids[: job.cached_blocks])
        job.uncached_tokens = self.model.uncached_tokens(job.request, job.cached_blocks)
        job.start_ms = now
        prefill = self.model.prefill_ms(job.uncached_tokens, len(self.decodes))
        job.first_token_ms = now + prefill
        self.busy_ms += prefill
        self.sink(WorkerEvent("started", now, job))

    def _prefilled(self, job: Job) -> None:
        now = job.first_token_ms
        change = self.cache.insert(job.request.block_ids)
        job.done_ms = now + max(0, job.request.output_tokens - 1) * self.model.decode_ms_per_token
        self._seq += 1
        heapq.heappush(self.decodes, (job.done_ms, self._seq, job))
        self.sink(WorkerEvent("prefilled", now, job, change.stored, change.evicted))
        self._start_next(now)

    def _finished(self, job: Job) -> None:
        change = CacheChange((), ())
        if job.request.output_ids:
            change = self.cache.insert(job.request.block_ids + job.request.output_ids)
        self.sink(WorkerEvent("finished", job.done_ms, job, change.stored, change.evicted))

    # -- what a worker knows about itself ------------------------------------

    def prefix(self, ids: Sequence[int]) -> int:
        """Blocks of ``ids`` this worker's cache holds now, from the first."""
        return self.cache.prefix(ids)

    def cached_blocks(self) -> int:
        return len(self.cache)

    def kv_usage(self) -> float:
        return len(self.cache) / self.model.cache_blocks

    def decoding(self) -> int:
        return len(self.decodes)

    def queued_tokens(self) -> int:
        """Input tokens waiting or in prefill (what a least-loaded policy compares)."""
        n = sum(j.request.input_tokens for j in self.queue)
        return n + (self.current.request.input_tokens if self.current is not None else 0)

    def queued_uncached_tokens(self, now: float) -> int:
        """Tokens still to prefill: the waiting requests' (their hits as today's
        cache has them) and what the running prefill has left."""
        model = self.model
        n = sum(
            model.uncached_tokens(j.request, self.prefix(j.request.block_ids)) for j in self.queue
        )
        job = self.current
        if job is not None:
            left = (job.first_token_ms - now) / max(1e-9, job.first_token_ms - job.start_ms)
            n += round(job.uncached_tokens * min(1.0, max(0.0, left)))
        return n

    def requests(self) -> int:
        """Requests on this worker: waiting, in prefill or decoding."""
        return len(self.decodes) + (1 if self.current is not None else 0) + len(self.queue)

    def ttft_if_added(self, request: TraceRequest, now: float) -> float:
        """The exact TTFT ``request`` would get here (FIFO: later arrivals cannot change it)."""
        if self.current is None:
            cached = self.cache.prefix(request.block_ids)
            uncached = self.model.uncached_tokens(request, cached)
            return self.model.prefill_ms(uncached, len(self.decodes))
        probe = Job("probe", request, self.index)
        twin = self._twin()
        twin.enqueue(probe, now)
        while math.isnan(probe.start_ms):
            twin.step()
        return probe.first_token_ms - now

    def _twin(self) -> SimWorker:
        twin = SimWorker(self.index, self.model)
        twin.cache = self.cache.copy()
        twin.current = replace(self.current) if self.current is not None else None
        twin.queue = deque(replace(j) for j in self.queue)
        twin.decodes = list(self.decodes)
        twin._seq = self._seq
        return twin


# -- replay ---------------------------------------------------------------------


class Policy(Protocol):
    name: str
    report_every_ms: float  # > 0: the replay calls report() at that period

    def choose(
        self, request: TraceRequest, request_id: str, now: float, workers: Sequence[SimWorker]
    ) -> int: ...

    def observe(self, event: WorkerEvent) -> None: ...

    def report(self, now: float, workers: Sequence[SimWorker]) -> None: ...


@dataclass(frozen=True)
class JobRecord:
    request_id: str
    worker: int
    arrival_ms: float
    ttft_ms: float
    queue_ms: float
    done_ms: float
    input_tokens: int
    cached_tokens: int
    best_prefix_blocks: int  # the longest prefix any worker held when it was routed
    routed_prefix_blocks: int  # the prefix the chosen worker held then


@dataclass
class Replay:
    records: list[JobRecord] = field(default_factory=list)
    busy_ms: list[float] = field(default_factory=list)
    span_ms: float = 0.0


def replay(trace: Sequence[TraceRequest], policy: Policy, model: CostModel, workers: int) -> Replay:
    """Route every request of ``trace`` (in arrival order) and run the cluster to the end."""
    sims = [SimWorker(i, model, policy.observe) for i in range(workers)]
    jobs, routed = [], []
    next_report = policy.report_every_ms if policy.report_every_ms > 0 else math.inf
    for i, request in enumerate(trace):
        now = request.arrival_ms
        while next_report <= now:
            _advance_all(sims, next_report)
            policy.report(next_report, sims)
            next_report += policy.report_every_ms
        _advance_all(sims, now)
        rid = f"r{i}"
        w = policy.choose(request, rid, now, sims)
        prefixes = [s.prefix(request.block_ids) for s in sims]
        routed.append((max(prefixes), prefixes[w]))
        job = Job(rid, request, w)
        jobs.append(job)
        sims[w].enqueue(job, now)
    _advance_all(sims, math.inf)
    out = Replay(busy_ms=[s.busy_ms for s in sims])
    out.span_ms = max(j.first_token_ms for j in jobs) - min(r.arrival_ms for r in trace)
    for job, (best, got) in zip(jobs, routed, strict=True):
        out.records.append(_record(job, model, best, got))
    return out


def _advance_all(sims: Sequence[SimWorker], until: float) -> None:
    for s in sims:
        s.advance(until)


def _record(job: Job, model: CostModel, best: int, got: int) -> JobRecord:
    r = job.request
    return JobRecord(
        job.request_id,
        job.worker,
        r.arrival_ms,
        job.first_token_ms - r.arrival_ms,
        job.start_ms - r.arrival_ms,
        job.done_ms,
        r.input_tokens,
        r.input_tokens - job.uncached_tokens,
        best,
        got,
    )
