"""Simulated store servers and timed router replicas for the cluster benchmark.

    shape = ClusterShape(stores=200, workers=256, gpu_blocks=4096, history_blocks=12288)
    python -m kvstore.testing.cluster_nodes stores --etcd URL --ttl 2 --prefix P \\
        --shape '<ClusterShape JSON>' --nodes 0:45 --events-per-s 50   # 0: unpaced
        # prints "ready"; stdin "go": register, "fill": seal and publish every block
    python -m kvstore.testing.cluster_nodes router --etcd URL --ttl 2 --prefix P \\
        --timings out.json                              # prints "port N"; SIGTERM ends it

A simulated store is everything of a store server the cluster sees, without
its blocks: a :class:`ClusterRouterLink` (the real one: its own etcd client,
its key under its own lease kept alive every TTL/3, one ``RouterFeed`` per
router replica found in etcd, ``PublishEvents`` with a snapshot on every
(re)sync), whose blocks are generated from the shape, not saved into a pool.
A store starts empty, as a new store server does, and seals its blocks when
told to, at a bounded rate (or all at once), one event of up to 1024 blocks
at a time. Many of them run as asyncio tasks in one process, their leases
kept alive by one keepalive thread (``membership/keeper.py``). docs/design.md §5 (peers,
final namespaces), §6 (store events); kvstore/membership/README.md (keys,
liveness).

The workload: worker ``j`` lives on node ``j % stores`` and has a history of
``history_blocks`` random u64 block hashes (seeded by ``j``). Its first
``gpu_blocks`` are on its GPU (GPU-tier events its node relays for it), and the
whole history is sealed in its node's store (store-tier events of the node).
A request that starts inside a worker's GPU part has exactly one best worker,
so replicas that hold the same index must give the same answer.

The router runner serves one replica (``serve_router`` on etcd) whose core
times each of its own ``Route`` calls whose request id starts with ``lat-``,
and writes those seconds to ``--timings`` when it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvstore.membership.etcd import EtcdConfig
from kvstore.membership.keeper import LeaseKeeper
from kvstore.router.core import Router, RouterConfig, RouteResult
from kvstore.router.scoring import ScoringConfig
from kvstore.service.router_link import ClusterRouterLink
from kvstore.service.router_server import ServedRouter, serve_router
from kvstore.service.sealed import HASHES_PER_EVENT, Listed
from kvstore.wire.card import WorkerCard
from kvstore.wire.events import GPU_TIER, STORE_TIER, STORED, StoreEvent
from kvstore.wire.names import client_namespace_of

FINAL_NAMESPACE = "cluster.0123456789abcdef"
MODEL = "cluster-bench"
BLOCK_SIZE = 16
TIMED_PREFIX = "lat-"  # route request ids the replica's core times


@dataclass(frozen=True)
class ClusterShape:
    """How many stores and workers, and each worker's blocks."""

    stores: int
    workers: int
    gpu_blocks: int  # leading blocks of each history on the worker's GPU
    history_blocks: int  # blocks of each history sealed in the worker's node store
    seed: int = 0

    def node(self, index: int) -> str:
        return f"node-{index:04d}"

    def worker(self, j: int) -> str:
        return f"w{j:04d}"

    def node_of(self, j: int) -> int:
        return j % self.stores

    def workers_on(self, index: int) -> list[int]:
        return list(range(index, self.workers, self.stores))

    def history(self, j: int) -> np.ndarray:
        """Worker ``j``'s block hashes, oldest first (u64, never 0)."""
        rng = np.random.default_rng([self.seed, j])
        return rng.integers(1, 2**63, size=self.history_blocks, dtype=np.uint64)

    def store_address(self, index: int) -> str:
        return f"127.0.0.1:{20000 + index}"  # recorded by the routers, never dialled

    def card(self, j: int) -> WorkerCard:
        return WorkerCard(
            MODEL,
            BLOCK_SIZE,
            context_length=1 << 20,
            node_id=self.node(self.node_of(j)),
            namespace=client_namespace_of(FINAL_NAMESPACE),
            final_namespace=FINAL_NAMESPACE,
        )

    def indexed_blocks(self, live_nodes: int | None = None) -> int:
        """Distinct hashes a replica indexes when the first ``live_nodes`` stores
        (default all) have published: every GPU part, and the live nodes' stores."""
        live = self.stores if live_nodes is None else live_nodes
        stored = sum(1 for j in range(self.workers) if self.node_of(j) < live)
        return self.workers * self.gpu_blocks + stored * self.history_blocks


@dataclass
class SealedEvent(StoreEvent):
    """A store event encoded once: a store sends its sealed blocks again in every
    snapshot, to every replica. Its hashes live only in ``payload``, the bytes
    ``StoreEvent.encode`` wrote."""

    payload: bytes = b""

    @classmethod
    def of(cls, event: StoreEvent) -> SealedEvent:
        return cls(
            event.type, event.namespace, [], event.worker, event.tier, payload=event.encode()
        )

    def encode(self) -> bytes:
        return self.payload


class SimStore:
    """One simulated store server: the real cluster link; blocks sealed on demand."""

    def __init__(
        self,
        config: EtcdConfig,
        shape: ClusterShape,
        index: int,
        keeper: LeaseKeeper | None = None,
    ):
        """``keeper``: the lease keepalive thread shared by the stores of one
        process (by default each link runs its own)."""
        self.shape = shape
        self.index = index
        self.node_id = shape.node(index)
        self.link = ClusterRouterLink(config, self.node_id, keeper=keeper)
        self.sealed: list[SealedEvent] = []  # what every snapshot sends
        self._unsealed = self._blocks()

    def _blocks(self):
        """Its workers' GPU parts (relayed for them), then their histories in its store."""
        for j in self.shape.workers_on(self.index):
            history = self.shape.history(j)
            yield from _stored(history[: self.shape.gpu_blocks], self.shape.worker(j), GPU_TIER)
            yield from _stored(history, self.node_id, STORE_TIER)

    def snapshot(self) -> Listed:
        return Listed(list(self.sealed))

    def seal_next(self) -> bool:
        """Seal and publish the next event's blocks; False when all are sealed."""
        event = next(self._unsealed, None)
        if event is None:
            return False
        sealed = SealedEvent.of(event)
        self.sealed.append(sealed)
        self.link.publish(sealed)
        return True

    async def start(self) -> None:
        await self.link.start(self.shape.store_address(self.index), "", self.snapshot)


def _stored(hashes: np.ndarray, holder: str, tier: str):
    n = HASHES_PER_EVENT
    for i in range(0, len(hashes), n):
        yield StoreEvent(STORED, FINAL_NAMESPACE, hashes[i : i + n].tolist(), holder, tier)


async def fill(stores: list[SimStore], events_per_s: float) -> None:
    """Seal every store's blocks, one event (up to HASHES_PER_EVENT blocks) at a time,
    round-robin over the stores, at most ``events_per_s`` (0: unpaced, every
    block at once, yielding to the loop only between rounds)."""
    if events_per_s <= 0:
        pending = list(stores)
        while pending:
            pending = [store for store in pending if store.seal_next()]
            await asyncio.sleep(0)
        return
    tick = 0.05
    pending = list(stores)
    budget = 0.0
    while pending:
        budget += events_per_s * tick
        while budget >= 1 and pending:
            store = pending.pop(0)
            if store.seal_next():
                pending.append(store)
                budget -= 1
        await asyncio.sleep(tick)


async def run_stores(
    config: EtcdConfig, shape: ClusterShape, first: int, end: int, events_per_s: float
) -> None:
    """Stores ``first..end-1``: say ``ready``; on ``go`` start (register) all of
    them; on ``fill`` seal their blocks at ``events_per_s``; run until killed
    (the leases then expire on their own)."""
    keeper = LeaseKeeper(config, f"stores {first}:{end}")
    stores = [SimStore(config, shape, i, keeper) for i in range(first, end)]
    print("ready", flush=True)
    if await _line() != "go":
        return
    t0 = time.time()
    await asyncio.gather(*(s.start() for s in stores))
    print(f"started {time.time() - t0:.3f}", flush=True)
    if await _line() != "fill":
        return
    t0 = time.time()
    await fill(stores, events_per_s)
    print(f"filled {time.time() - t0:.3f}", flush=True)
    await asyncio.Event().wait()


async def _line() -> str:
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    return line.strip()


class TimedRouter(Router):
    """The router core, timing its own ``route`` for request ids of the benchmark."""

    def __init__(self, config: RouterConfig | None = None):
        super().__init__(config)
        self.route_s: list[float] = []

    def route(self, model: str, **kwargs) -> RouteResult:
        t0 = time.perf_counter()
        result = super().route(model, **kwargs)
        if kwargs.get("request_id", "").startswith(TIMED_PREFIX):
            self.route_s.append(time.perf_counter() - t0)
        return result


async def run_router(config: EtcdConfig, timings: str, seed: int) -> None:
    router = TimedRouter(RouterConfig(scoring=ScoringConfig(seed=seed)))
    served = ServedRouter(router, etcd=config)
    try:
        await serve_router(
            served, "127.0.0.1", 0, on_listening=lambda port: print(f"port {port}", flush=True)
        )
    finally:
        with open(timings, "w") as out:
            json.dump({"route_s": router.route_s}, out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvstore.testing.cluster_nodes")
    parser.add_argument("role", choices=["stores", "router"])
    parser.add_argument("--etcd", required=True)
    parser.add_argument("--ttl", type=int, default=2)
    parser.add_argument("--prefix", default="/kvstore/v1/")
    parser.add_argument("--shape", help="ClusterShape as JSON (stores)")
    parser.add_argument("--nodes", help="FIRST:END store indexes (stores)")
    parser.add_argument("--timings", help="where the router writes its route timings")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--events-per-s", type=float, default=100.0, help="fill rate (stores; 0: unpaced)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    config = EtcdConfig.parse(args.etcd, args.ttl, args.prefix)
    if args.role == "stores":
        shape = ClusterShape(**json.loads(args.shape))
        first, end = map(int, args.nodes.split(":"))
        asyncio.run(run_stores(config, shape, first, end, args.events_per_s))
    else:
        asyncio.run(run_router(config, args.timings, args.seed))


def shape_json(shape: ClusterShape) -> str:
    return json.dumps(asdict(shape))


if __name__ == "__main__":
    main()
