"""What each worker has to do before a new request's first token: its load.

Two sources, per worker:

    reported   the worker's own LoadReport (queued prefill tokens, running
               requests, KV usage), sent by the engine or by the store server
               on its behalf; used while younger than the staleness window
    own        the router's accounting of what it routed there: prefill
               tokens of requests routed and not started (queued), and
               requests started and not finished (running)

A fresh report is the truth as of its arrival, so the load a route sees is
the report moved on by what happened since: prefill tokens routed there are
added, those of requests started (or finished unstarted) are taken off, and
requests started or finished move the running count. A burst between two
reports does not all land on the worker that last reported idle, and a queue
that drained since is not held against it. Without a fresh report the router
uses its own accounting alone. A request leaves the queue when it is reported started and
leaves the load when it is reported finished, or when its deadline passes.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from kvstore.router.admission import WorkerRef
from kvstore.wire import limits
from kvstore.wire.principal import LOCAL, Principal


@dataclass(frozen=True)
class LoadReport:
    """One worker's load as it reports it."""

    queued_prefill_tokens: int  # prompt tokens waiting for prefill, not yet computed
    running_requests: int  # requests past their prefill, decoding
    kv_usage: float = 0.0  # fraction of its KV blocks in use, 0..1


class WorkerLoad(NamedTuple):
    """The load one route sees on one worker. (A NamedTuple: a route reads one
    per member, and a tuple is made in C.)"""

    queued_tokens: int
    running_requests: int
    report_age_s: float | None  # None: no fresh report, the router's own accounting
    kv_usage: float = 0.0


IDLE = WorkerLoad(0, 0, None)  # a worker the router has no accounting of


@dataclass
class TrackedRequest:
    ref: WorkerRef
    prefill_tokens: int  # uncached prompt tokens the route expected
    predicted_blocks: int  # the longest cached prefix the route saw
    deadline: float
    started: bool = False
    owner: str = ""  # the principal that routed it: only it (or an admin) starts or ends it


@dataclass
class _Accounting:
    """One worker's own counts and its latest report."""

    queued_tokens: int = 0  # routed, not started
    running: int = 0  # started, not finished
    queued_since_report: int = 0  # tokens routed since the latest report, less those started
    running_since_report: int = 0  # started since the latest report, less those finished
    report: LoadReport | None = None
    reported_at: float = -math.inf
    requests: set[str] = field(default_factory=set)  # ids of its tracked requests


@dataclass
class HitCounts:
    """Finished requests that said how many blocks they hit, against their routes."""

    reports: int = 0
    blocks_predicted: int = 0  # the cached prefix their routes saw
    blocks_reported: int = 0  # the blocks they hit


@dataclass
class LoadTracker:
    """Per-worker load from reports and from routed requests."""

    requests: dict[str, TrackedRequest] = field(default_factory=dict)
    workers: dict[WorkerRef, _Accounting] = field(default_factory=dict)
    load_reports: int = 0
    hits: HitCounts = field(default_factory=HitCounts)
    owned: Counter[str] = field(default_factory=Counter)  # principal -> requests it tracks
    _deadlines: list[tuple[float, str]] = field(default_factory=list)

    def load(self, ref: WorkerRef, now: float, staleness_s: float) -> WorkerLoad:
        """The worker's fresh report moved on by what happened since, else own counts."""
        acc = self.workers.get(ref)
        if acc is None:
            return IDLE
        age = now - acc.reported_at
        if acc.report is None or age > staleness_s:
            return WorkerLoad(acc.queued_tokens, acc.running, None)
        rep = acc.report
        queued = max(0, rep.queued_prefill_tokens + acc.queued_since_report)
        running = max(0, rep.running_requests + acc.running_since_report)
        return WorkerLoad(queued, running, max(0.0, age), rep.kv_usage)

    def loads_of(
        self, refs: list[WorkerRef], now: float, staleness_s: float
    ) -> dict[WorkerRef, WorkerLoad]:
        """:meth:`load` of those of ``refs`` with any accounting here; the others
        are :data:`IDLE` (left out: a route of hundreds of idle workers reads none)."""
        known = self.workers
        return {ref: self.load(ref, now, staleness_s) for ref in refs if ref in known}

    def report(self, ref: WorkerRef, report: LoadReport, now: float) -> None:
        """A worker's report replaces its previous one; what happened before it
        arrived is counted in it."""
        acc = self.workers.setdefault(ref, _Accounting())
        acc.report, acc.reported_at = report, now
        acc.queued_since_report = acc.running_since_report = 0
        self.load_reports += 1

    def add(self, request_id: str, request: TrackedRequest) -> None:
        """Track a routed request: its prefill tokens join its worker's queue
        (one of the same id and owner is finished first; another owner's id is
        taken by the caller: check :meth:`taken_by_another` first)."""
        if request_id in self.requests:
            self.finish(request_id)
        if len(self.requests) >= limits.MAX_ACTIVE_REQUESTS:
            self.expire(math.inf, limit=1)
        acc = self.workers.setdefault(request.ref, _Accounting())
        self.requests[request_id] = request
        self.owned[request.owner] += 1
        acc.requests.add(request_id)
        acc.queued_tokens += request.prefill_tokens
        acc.queued_since_report += request.prefill_tokens
        heapq.heappush(self._deadlines, (request.deadline, request_id))
        if len(self._deadlines) > 2 * len(self.requests) + 1024:  # drop entries of done requests
            self._deadlines = [(r.deadline, rid) for rid, r in self.requests.items()]
            heapq.heapify(self._deadlines)

    def tracks(self, request_id: str) -> bool:
        return request_id in self.requests

    def taken_by_another(self, request_id: str, caller: Principal) -> bool:
        """Whether ``request_id`` tracks a request ``caller`` may not act on."""
        req = self.requests.get(request_id)
        return req is not None and not caller.may_act_for(req.owner)

    def start(self, request_id: str, caller: Principal = LOCAL) -> bool:
        """The request's prefill began: it leaves the queue and runs. Another
        principal's request is as an unknown one: nothing changes."""
        req = self.requests.get(request_id)
        if req is None or req.started or not caller.may_act_for(req.owner):
            return False
        self._dequeue(req)
        req.started = True
        acc = self.workers[req.ref]
        acc.running += 1
        acc.running_since_report += 1
        return True

    def finish(
        self, request_id: str, cached_blocks: int | None = None, caller: Principal = LOCAL
    ) -> bool:
        """The request is done: its load is freed, and ``cached_blocks`` (what it
        really hit) counted against its route. False when it is unknown, or
        ``caller``'s to end it is not (nothing changes then)."""
        req = self.requests.get(request_id)
        if req is None or not caller.may_act_for(req.owner):
            return False
        del self.requests[request_id]
        self._disown(req.owner)
        acc = self.workers[req.ref]
        acc.requests.discard(request_id)
        if req.started:
            acc.running = max(0, acc.running - 1)
            acc.running_since_report -= 1
        else:
            self._dequeue(req)
        if cached_blocks is not None:
            self.hits.reports += 1
            self.hits.blocks_predicted += req.predicted_blocks
            self.hits.blocks_reported += cached_blocks
        return True

    def _dequeue(self, req: TrackedRequest) -> None:
        acc = self.workers[req.ref]
        acc.queued_tokens = max(0, acc.queued_tokens - req.prefill_tokens)
        acc.queued_since_report -= req.prefill_tokens

    def expire(self, now: float, limit: int | None = None) -> int:
        """Free requests whose deadline passed (at most ``limit`` of them)."""
        freed = 0
        while self._deadlines and self._deadlines[0][0] <= now and (limit is None or freed < limit):
            deadline, rid = heapq.heappop(self._deadlines)
            req = self.requests.get(rid)
            if req is not None and req.deadline == deadline:
                self.finish(rid)
                freed += 1
        return freed

    def drop_worker(self, ref: WorkerRef) -> None:
        """A removed worker's requests and report are gone with it (its own
        requests only are looked at: a worker leaving under a million tracked
        requests of others costs what it held)."""
        acc = self.workers.pop(ref, None)
        for rid in acc.requests if acc is not None else ():
            self._disown(self.requests.pop(rid).owner)

    def _disown(self, owner: str) -> None:
        self.owned[owner] -= 1
        if not self.owned[owner]:
            del self.owned[owner]
