"""The workload of bench/router.py: a many-worker index built through the vLLM
decoder, steady-state churn payloads, and route requests that overlap it; and
bench/cluster.py's index built in one process (the route A/B)."""

from __future__ import annotations

import random
import time
from array import array
from dataclasses import dataclass

import numpy as np

from kvstore.router.admission import WorkerRef
from kvstore.router.core import Router, RouterConfig
from kvstore.router.scoring import ScoringConfig
from kvstore.router.vllm_events import decode_batch
from kvstore.testing.cluster_nodes import FINAL_NAMESPACE, ClusterShape
from kvstore.testing.vllm_events import churn_batches, encode_batch, stored_event
from kvstore.wire.card import WorkerCard
from kvstore.wire.events import GPU_TIER, STORE_TIER, STORED, StoreEvent

BLOCK = 16
TOKENS = list(range(BLOCK))  # a block's token ids, carried by every BlockStored


def u64s(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, 2**63, size=n, dtype=np.uint64).tolist()


@dataclass
class BenchIndex:
    router: Router
    refs: list[WorkerRef]
    systems: list[list[int]]
    histories: list[array]  # each worker's own blocks, oldest first, kept current (u64
    # arrays: the garbage collector does not walk them, so it walks only the router)
    build_s: float
    rng: np.random.Generator


def build_index(workers: int, per_worker: int, n_system: int = 64, system_blocks: int = 256):
    rng = np.random.default_rng(0)
    router = Router(RouterConfig())
    card = WorkerCard("bench", BLOCK, hash_format="vllm-sha256")
    refs = [router.register_worker(f"w{i}", card).ref for i in range(workers)]
    systems = [u64s(rng, system_blocks) for _ in range(n_system)]
    histories, build_s = [], 0.0
    for i, ref in enumerate(refs):
        own = u64s(rng, per_worker)
        histories.append(array("Q", own))
        events = [stored_event(systems[(i * 7 + k) % n_system]) for k in range(n_system // 4)]
        events += [stored_event(own[s : s + 64]) for s in range(0, per_worker, 64)]
        payloads = [encode_batch(events[s : s + 32]) for s in range(0, len(events), 32)]
        t0 = time.perf_counter()
        for payload in payloads:
            router.apply_vllm_batch(ref, decode_batch(payload))
        build_s += time.perf_counter() - t0
    return BenchIndex(router, refs, systems, histories, build_s, rng)


def churn_payloads(idx: BenchIndex, workers: range, stored: int, per_event: int):
    """(ref, payload) in arrival order: ``stored`` blocks over ``workers``, round-robin."""
    per_worker = [
        churn_batches(
            idx.histories[w], u64s(idx.rng, stored // len(workers)), per_event, 32, TOKENS
        )
        for w in workers
    ]
    out = []
    for k in range(max(len(p) for p in per_worker)):
        out += [(idx.refs[w], p[k]) for w, p in zip(workers, per_worker, strict=True) if k < len(p)]
    return out


def request(idx: BenchIndex, rng: random.Random, n_blocks: int) -> list[int]:
    """A system prompt shared with other workers, a slice of one worker's history, new tail."""
    w = rng.randrange(len(idx.histories))
    system = idx.systems[(w * 7) % len(idx.systems)]
    sys_part = system[: min(len(system), n_blocks // 4)]
    history = idx.histories[w]
    hist_len = rng.randint(0, min(len(history), max(0, n_blocks - len(sys_part))))
    start = rng.randrange(0, len(history) - hist_len + 1)
    hist = history[start : start + hist_len].tolist()
    return (
        sys_part + hist + [rng.getrandbits(63) for _ in range(n_blocks - len(sys_part) - hist_len)]
    )


def build_cluster_index(shape: ClusterShape, clock=time.monotonic) -> Router:
    """bench/cluster.py's index in one process, no etcd: every worker admitted
    with its card (node, final namespace), every store advertised, each worker's
    GPU part relayed and its history sealed in its node's store."""
    router = Router(RouterConfig(scoring=ScoringConfig(seed=1)), clock=clock)
    for j in range(shape.workers):
        router.register_worker(shape.worker(j), shape.card(j))
    for i in range(shape.stores):
        node = shape.node(i)
        peer = router.advertise_peer(node, shape.store_address(i), "", [FINAL_NAMESPACE])
        events = []
        for j in shape.workers_on(i):
            history = shape.history(j)
            gpu = history[: shape.gpu_blocks].tolist()
            events.append(StoreEvent(STORED, FINAL_NAMESPACE, gpu, shape.worker(j), GPU_TIER))
            events.append(StoreEvent(STORED, FINAL_NAMESPACE, history.tolist(), node, STORE_TIER))
        router.apply_store_events(node, peer.generation, events)
    return router
