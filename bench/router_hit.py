"""Prefix hit rate of the KV-aware router on a synthetic multi-turn trace (bench/router.py §6).

A trace shaped like published serving traces (Mooncake: long shared system
prompts, multi-turn sessions whose prompts carry the whole history, mean input
several thousand tokens, short outputs) over N workers with LRU caches too
small for it; the router (fed by the workers' own stored/removed events, with
load tracking) against round-robin and random routing on the same trace.
bench/router_trace.py replays real traces with TTFT against stronger baselines.
"""

from __future__ import annotations

import heapq
import random
from collections import deque

import numpy as np

from bench.router_index import BLOCK, u64s
from kvstore.router.core import Router, RouterConfig
from kvstore.router.scoring import ScoringConfig
from kvstore.router.vllm_events import BlockEvent
from kvstore.testing.cluster_sim import LruBlocks
from kvstore.wire.card import WorkerCard

SESSION_RATE = 2.0  # new sessions per time unit; think time between turns ~30 units
CACHE_BLOCKS = 8192  # per worker: 128k tokens of KV, a modest GPU's prefix cache


def make_trace(sessions: int, seed: int = 3):
    """Requests as block-hash lists, in arrival order, plus each one's output blocks.

    30 system prompts of 1k-6k tokens with Zipf popularity; sessions of 1-12
    turns (mean ~4); each turn adds 200-1500 user tokens; answers of 100-600
    tokens become part of the next turn's prompt. Turns of different sessions
    interleave (Poisson arrivals, think time between turns).
    """
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    n_sys = 30
    systems = [u64s(nrng, rng.randint(1000, 6000) // BLOCK) for _ in range(n_sys)]
    weights = [1 / (k + 1) ** 1.1 for k in range(n_sys)]
    events = []
    for s in range(sessions):
        t = rng.uniform(0, sessions / SESSION_RATE)  # same concurrency at any trace size
        turns = min(12, 1 + int(rng.expovariate(1 / 3)))
        events.append((t, s, turns))
    heapq.heapify(events)
    context = {}
    trace = []
    while events:
        t, s, turns_left = heapq.heappop(events)
        if s not in context:
            context[s] = list(systems[rng.choices(range(n_sys), weights)[0]])
        prompt = context[s] + u64s(nrng, rng.randint(200, 1500) // BLOCK)
        output = u64s(nrng, rng.randint(100, 600) // BLOCK)
        trace.append((prompt, output))
        context[s] = prompt + output
        if turns_left > 1:
            heapq.heappush(events, (t + rng.expovariate(1 / 30), s, turns_left - 1))
        else:
            del context[s]
    return trace


def simulate(trace, policy: str, workers: int, capacity: int, in_flight: int, seed: int = 4):
    caches = [LruBlocks(capacity) for _ in range(workers)]
    rng = random.Random(seed)
    router = None
    if policy == "kv_aware":
        router = Router(RouterConfig(scoring=ScoringConfig(seed=4)))
        refs = [
            router.register_worker(f"w{i}", WorkerCard("sim", BLOCK)).ref for i in range(workers)
        ]
    hit = total = 0
    per_worker = [0] * workers
    window: deque[str] = deque()
    for i, (prompt, output) in enumerate(trace):
        if policy == "round_robin":
            w = i % workers
        elif policy == "random":
            w = rng.randrange(workers)
        else:
            r = router.route(
                "sim", hashes=prompt, request_id=f"r{i}", decode_tokens=len(output) * BLOCK
            )
            w = int(r.worker.name[1:])
            window.append(r.request_id)
            if len(window) > in_flight:  # the oldest in-flight request completes
                router.request_finished(window.popleft())
        hit += caches[w].prefix(prompt)
        total += len(prompt)
        per_worker[w] += 1
        change = caches[w].insert(prompt + output)
        stored, evicted = list(change.stored), list(change.evicted)
        if router is not None:
            evs = []
            if evicted:
                evs.append(BlockEvent("removed", evicted))
            if stored:
                evs.append(BlockEvent("stored", stored))
            router.apply_worker_events(refs[w], evs)
    return hit / total, max(per_worker) / (sum(per_worker) / workers)
