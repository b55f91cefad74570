"""What mutual TLS costs one RPC: Route on the router and a 1-block Save on the store.

    python bench/tls_cost.py            # 7 rounds x 300 calls per arm
    python bench/tls_cost.py --quick    # 3 rounds x 100 calls

Two store servers (each with its embedded router) on loopback, one plaintext
and one behind mutual TLS (a throwaway CA, kvstore.testing.pki); one worker
registered with each (host shared memory, 1 layer pair, tp 1). Rounds
alternate plaintext and TLS (interleaved, so drift hits both arms alike);
each round times ``calls`` sequential calls of each RPC on a warm channel.
Reported: p50 and p99 per arm over all calls, the p50 of each round (spread),
and the median ratio TLS/plaintext. Writes bench/results/tls_cost.json.
Connection setup (the TLS handshake, once per channel) is timed separately.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from kvstore.client.router_client import RouterClient
from kvstore.client.store_client import KVLayer, StoreClient, kv_cache_shm
from kvstore.router.core import Router, RouterConfig
from kvstore.service.router_server import ServedRouter
from kvstore.service.store_server import ServerConfig, StoreServer
from kvstore.testing.pki import Pki
from kvstore.wire.card import WorkerCard
from kvstore.wire.tls import TlsFiles

OUT = Path(__file__).parent / "results" / "tls_cost.json"


def card() -> WorkerCard:
    return WorkerCard(
        display_name="bench-model", kv_block_size=16, namespace="bench", address="127.0.0.1:8000"
    )


class ServerThread:
    """A store server (embedded router) on 127.0.0.1, free port, on its own loop."""

    def __init__(self, tls: TlsFiles | None):
        self.loop = asyncio.new_event_loop()
        config = ServerConfig(
            port=0, pool_size=64 << 20, device="cpu", slab_bytes=4 << 20, transfer=False, tls=tls
        )
        self.server = StoreServer(config, ServedRouter(Router(RouterConfig())))
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        port = self.run(self.server.start())
        self.address = f"127.0.0.1:{port}"

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def stop(self) -> None:
        self.run(self.server.stop(grace=0.5))
        self.loop.call_soon_threadsafe(self.loop.stop)


class Arm:
    def __init__(self, name: str, server_tls, client_tls):
        self.name = name
        self.server = ServerThread(server_tls)
        self.client_tls = client_tls
        self.store = StoreClient(self.server.address, tls=client_tls)
        self.router = RouterClient(self.server.address, tls=client_tls)
        self.router.register_worker("w0", card())
        self.shms = [kv_cache_shm("kv_first", 64, 16, 8, 128, torch.float16) for _ in range(2)]
        layers = [KVLayer(f"l{i}", s.tensor, "kv_first", "NHD", s) for i, s in enumerate(self.shms)]
        self.session = self.store.register("bench", "bench", layers, block_size=16)
        self.session.wait_sealed(10)
        self.tokens = list(range(1024))
        self.next_hash = 1

    def route(self) -> float:
        t = time.perf_counter()
        self.router.route("bench-model", token_ids=self.tokens)
        return time.perf_counter() - t

    def save(self) -> float:
        h, self.next_hash = self.next_hash, self.next_hash + 1
        t = time.perf_counter()
        self.session.save([(h, h % 64)])
        return time.perf_counter() - t

    def connect(self) -> float:
        """A fresh channel's first call (the handshake included)."""
        t = time.perf_counter()
        client = StoreClient(self.server.address, tls=self.client_tls)
        client.stats()
        elapsed = time.perf_counter() - t
        client.close()
        return elapsed

    def close(self) -> None:
        self.session.close()
        self.server.stop()
        for shm in self.shms:
            shm.close()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rounds, calls = (3, 100) if args.quick else (7, 300)
    pki = Pki(Path(tempfile.mkdtemp(prefix="kvstore-tls-bench-")))
    arms = [Arm("plaintext", None, None), Arm("tls", pki.server, pki.issue("bench"))]
    samples = {a.name: {"route": [], "save": [], "connect": []} for a in arms}
    rounds_p50 = {a.name: {"route": [], "save": []} for a in arms}
    try:
        for arm in arms:  # warm-up
            for _ in range(20):
                arm.route(), arm.save()
        for r in range(rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                for rpc in ("route", "save"):
                    times = [getattr(arm, rpc)() for _ in range(calls)]
                    samples[arm.name][rpc] += times
                    rounds_p50[arm.name][rpc].append(statistics.median(times) * 1e6)
                samples[arm.name]["connect"].append(arm.connect())
    finally:
        for arm in arms:
            arm.close()
    result = {"rounds": rounds, "calls_per_round": calls, "unit": "microseconds"}
    for name, by_rpc in samples.items():
        result[name] = {
            rpc: {
                "p50": pct(v, 0.5),
                "p99": pct(v, 0.99),
                **({"round_p50s": rounds_p50[name][rpc]} if rpc in rounds_p50[name] else {}),
            }
            for rpc, v in by_rpc.items()
        }
    result["tls_over_plaintext_p50"] = {
        rpc: result["tls"][rpc]["p50"] / result["plaintext"][rpc]["p50"]
        for rpc in ("route", "save", "connect")
    }
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["tls_over_plaintext_p50"], indent=2))
    for name in ("plaintext", "tls"):
        r = result[name]
        print(
            f"{name:9s} route p50 {r['route']['p50']:.0f} us  save p50 {r['save']['p50']:.0f} us"
            f"  connect p50 {r['connect']['p50']:.0f} us"
        )


if __name__ == "__main__":
    main()
