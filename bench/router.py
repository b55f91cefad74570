"""Router benchmark: event ingestion, route latency, index memory, prefix hit rate.

    python bench/router.py            # full run (a few minutes on 2 cores)
    python bench/router.py --quick    # under a minute

Writes bench/results/router.json and bench/results/router.png.

1. Ingestion: ~1M blocks of events through the real decode + apply paths:
   vLLM ``KVEventBatch`` payloads (msgpack, array_like) for 64 workers, and
   store ``StoreEvent`` payloads for a store peer. blocks/s on one core.
2. Route latency: with 64 workers and >= 1M indexed blocks, requests whose
   prompts share a system prompt with many workers and a history with one,
   at 1k..16k tokens (block size 16); p50 / p99 of ``Router.route`` with
   block hashes (what a frontend that hashes once sends). Hashing the tokens
   in the router is timed separately.
3. Hit rate: a synthetic multi-turn trace shaped like published serving traces
   (Mooncake: long shared system prompts, multi-turn sessions whose prompts
   carry the whole history, mean input several thousand tokens, short
   outputs) over N workers with LRU caches that are too small for the trace.
   The KV-aware router (fed by the workers' own stored/removed events, with
   load tracking) against round-robin and random routing on the same trace.
"""

from __future__ import annotations

import os
import sys

# Run as `python bench/router.py`, this folder comes first on sys.path, where
# sibling benches (bench/copy.py) would shadow stdlib modules of the same name.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import argparse  # noqa: E402
import heapq  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from collections import OrderedDict, deque  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstore.router.core import Router, RouterConfig  # noqa: E402
from kvstore.router.scoring import ScoringConfig  # noqa: E402
from kvstore.router.vllm_events import BlockEvent, decode_batch  # noqa: E402
from kvstore.testing.vllm_events import encode_batch  # noqa: E402
from kvstore.wire.card import WorkerCard  # noqa: E402
from kvstore.wire.events import StoreEvent  # noqa: E402
from kvstore.wire.hashing import block_hashes  # noqa: E402

BLOCK = 16
SESSION_RATE = 2.0  # new sessions per time unit; think time between turns ~30 units
CACHE_BLOCKS = 8192  # per worker: 128k tokens of KV, a modest GPU's prefix cache
RESULTS = ROOT / "bench" / "results"
NS = "bench.0123456789abcdef"


def u64s(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, 2**63, size=n, dtype=np.uint64).tolist()


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


# -- 1 + 2: a 64-worker, 1M-block index built through the event paths -----------


def build_index(
    workers: int, blocks_per_worker: int, n_system: int, system_blocks: int, seed: int = 0
):
    """Returns (router, refs, system prompts, per-worker histories, ingest stats)."""
    rng = np.random.default_rng(seed)
    router = Router(RouterConfig())
    refs = [
        router.register_worker(f"w{i}", WorkerCard("bench", BLOCK, hash_format="vllm-sha256")).ref
        for i in range(workers)
    ]
    systems = [u64s(rng, system_blocks) for _ in range(n_system)]
    histories, payloads = [], []
    for i in range(workers):
        own = u64s(rng, blocks_per_worker)
        histories.append(own)
        events = [
            ["BlockStored", systems[(i * 7 + k) % n_system], None, [], BLOCK, None, "GPU", None]
            for k in range(max(1, n_system // 4))
        ]
        for start in range(0, len(own), 64):  # vLLM stores a request's new blocks in one event
            events.append(
                ["BlockStored", own[start : start + 64], None, [], BLOCK, None, "GPU", None]
            )
        for start in range(0, len(events), 32):  # a batch per engine step
            payloads.append((refs[i], encode_batch(events[start : start + 32], ts=1.0)))
    blocks = sum(len(e.hashes) for _, p in payloads for e in decode_batch(p).events)
    t0 = time.perf_counter()
    for ref, payload in payloads:
        router.apply_vllm_batch(ref, decode_batch(payload))
    vllm_s = time.perf_counter() - t0
    return router, refs, systems, histories, {"vllm_blocks": blocks, "vllm_s": vllm_s}


def ingest_store_events(router: Router, total_blocks: int, seed: int = 1) -> float:
    rng = np.random.default_rng(seed)
    peer = router.advertise_peer("store-0", "127.0.0.1:50051", "", [NS])
    payloads = [
        StoreEvent("stored", NS, u64s(rng, 64), "store-0").encode()
        for _ in range(total_blocks // 64)
    ]
    t0 = time.perf_counter()
    for start in range(0, len(payloads), 256):
        router.publish_store_events("store-0", peer.generation, payloads[start : start + 256])
    dt = time.perf_counter() - t0
    router.remove_peer("store-0")
    return len(payloads) * 64 / dt


def route_latency(router, systems, histories, prompt_tokens: int, samples: int, seed: int = 2):
    rng = random.Random(seed)
    n_blocks = prompt_tokens // BLOCK
    lat = []
    overlaps = []
    for _ in range(samples):
        w = rng.randrange(len(histories))
        system = systems[(w * 7) % len(systems)]
        sys_part = system[: min(len(system), n_blocks // 4)]
        hist_len = rng.randint(0, max(0, n_blocks - len(sys_part)))
        start = rng.randrange(0, len(histories[w]) - hist_len + 1)
        hist = histories[w][start : start + hist_len]
        tail = [rng.getrandbits(63) for _ in range(n_blocks - len(sys_part) - len(hist))]
        hashes = sys_part + hist + tail
        t0 = time.perf_counter()
        r = router.route("bench", hashes=hashes, request_id="q")
        lat.append((time.perf_counter() - t0) * 1e3)
        router.request_done(r.request_id)
        overlaps.append(r.overlap_blocks)
    return lat, float(np.mean(overlaps))


def hashing_ms(prompt_tokens: int, samples: int) -> float:
    tokens = np.arange(prompt_tokens, dtype=np.uint32)
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        block_hashes(tokens, BLOCK)
        times.append((time.perf_counter() - t0) * 1e3)
    return percentile(times, 50)


# -- 3: hit rate on a synthetic shared-prefix multi-turn trace -------------------


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


class LruCache:
    """A worker's prefix cache: LRU over blocks, tail blocks evicted first (as vLLM)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def prefix_hit(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def insert(self, hashes: list[int]) -> tuple[list[int], list[int]]:
        """Touch/insert ``hashes``; return (newly stored, evicted)."""
        new = []
        for h in reversed(hashes):  # the prefix ends up most recent
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                self.blocks[h] = None
                new.append(h)
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        new_set = set(evicted)
        return [h for h in reversed(new) if h not in new_set], evicted


def simulate(trace, policy: str, workers: int, capacity: int, in_flight: int, seed: int = 4):
    caches = [LruCache(capacity) for _ in range(workers)]
    rng = random.Random(seed)
    router = None
    if policy == "kv_aware":
        router = Router(RouterConfig(scoring=ScoringConfig(overlap_weight=1.0)))
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
                router.request_done(window.popleft())
        hit += caches[w].prefix_hit(prompt)
        total += len(prompt)
        per_worker[w] += 1
        stored, evicted = caches[w].insert(prompt + output)
        if router is not None:
            evs = []
            if evicted:
                evs.append(BlockEvent("removed", evicted))
            if stored:
                evs.append(BlockEvent("stored", stored))
            router.apply_worker_events(refs[w], evs)
    return hit / total, max(per_worker) / (sum(per_worker) / workers)


# -- main ------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller samples, under a minute")
    ap.add_argument("--out", default=str(RESULTS / "router.json"))
    args = ap.parse_args()
    quick = args.quick
    t_start = time.perf_counter()

    workers = 64
    per_worker = 16_000  # 64 x 16k unique blocks + shared system prompts > 1M
    print(f"building index: {workers} workers x {per_worker} blocks + shared system prompts ...")
    router, _refs, systems, histories, ing = build_index(
        workers, per_worker, n_system=64, system_blocks=256
    )
    stats = router.stats()
    ingest_vllm = ing["vllm_blocks"] / ing["vllm_s"]
    ingest_store = ingest_store_events(router, 256_000 if quick else 1_024_000)
    index_bytes = router.index_bytes()
    print(
        f"  indexed {stats.indexed_blocks:,} blocks, {index_bytes / 2**20:.0f} MiB; "
        f"ingest vLLM {ingest_vllm:,.0f} blocks/s, store {ingest_store:,.0f} blocks/s"
    )

    samples = 300 if quick else 2000
    rows = []
    for tokens in (1024, 2048, 4096, 8192, 16384):
        lat, mean_overlap = route_latency(router, systems, histories, tokens, samples)
        rows.append(
            {
                "prompt_tokens": tokens,
                "workers": workers,
                "indexed_blocks": stats.indexed_blocks,
                "p50": percentile(lat, 50),
                "p99": percentile(lat, 99),
                "mean_overlap_blocks": mean_overlap,
                "samples": samples,
            }
        )
        print(
            f"  route {tokens:>5} tokens: "
            f"p50 {rows[-1]['p50']:.3f} ms  p99 {rows[-1]['p99']:.3f} ms"
        )
    hash_8k = hashing_ms(8192, 50 if quick else 200)
    print(f"  hashing 8k tokens in the router (token_ids path): p50 {hash_8k:.3f} ms")
    del router, histories

    sessions = 500 if quick else 2000
    trace = make_trace(sessions)
    sim_workers = 16
    mean_prompt = float(np.mean([len(p) for p, _ in trace])) * BLOCK
    unique = len({h for p, o in trace for h in p + o})
    capacity = CACHE_BLOCKS
    print(
        f"trace: {len(trace)} requests, {sessions} sessions, mean prompt {mean_prompt:.0f} tokens, "
        f"{unique:,} unique blocks; {sim_workers} workers x {capacity:,} blocks of cache"
    )
    hit_rate, balance = {}, {}
    for policy in ("kv_aware", "round_robin", "random"):
        hit_rate[policy], balance[policy] = simulate(
            trace, policy, sim_workers, capacity, in_flight=2 * sim_workers
        )
        print(
            f"  {policy:>11}: hit rate {hit_rate[policy]:.3f}  (max/mean requests per worker "
            f"{balance[policy]:.2f})"
        )

    result = {
        "ingest_blocks_per_s": min(ingest_vllm, ingest_store),
        "ingest_vllm_blocks_per_s": ingest_vllm,
        "ingest_store_blocks_per_s": ingest_store,
        "route_latency_ms": rows,
        "hash_8k_tokens_ms_p50": hash_8k,
        "hit_rate": hit_rate,
        "load_balance_max_over_mean": balance,
        "index_bytes": index_bytes,
        "indexed_blocks": stats.indexed_blocks,
        "trace": {
            "requests": len(trace),
            "sessions": sessions,
            "mean_prompt_tokens": mean_prompt,
            "unique_blocks": unique,
            "workers": sim_workers,
            "cache_blocks_per_worker": capacity,
            "block_size": BLOCK,
        },
        "quick": quick,
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
        },
        "wall_s": time.perf_counter() - t_start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')} in {result['wall_s']:.0f} s")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    rows = result["route_latency_ms"]
    x = [r["prompt_tokens"] for r in rows]
    a.plot(x, [r["p50"] for r in rows], "o-", label="p50")
    a.plot(x, [r["p99"] for r in rows], "s-", label="p99")
    a.axhline(1.0, color="grey", ls="--", lw=1, label="1 ms target")
    a.set_xscale("log", base=2)
    a.set_xlabel("prompt tokens")
    a.set_ylabel("route latency (ms)")
    a.set_title(
        f"{rows[0]['workers']} workers, {rows[0]['indexed_blocks'] / 1e6:.2f}M indexed blocks"
    )
    a.legend()
    hr = result["hit_rate"]
    b.bar(list(hr), list(hr.values()), color=["tab:green", "tab:blue", "tab:orange"])
    for i, v in enumerate(hr.values()):
        b.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    b.set_ylabel("prefix hit rate (blocks)")
    t = result["trace"]
    b.set_title(
        f"{t['requests']} requests, {t['workers']} workers, "
        f"ingest {result['ingest_blocks_per_s'] / 1e6:.2f}M blocks/s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
