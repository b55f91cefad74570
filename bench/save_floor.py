"""The fixed cost of a small Save and Load RPC against its floor: one gRPC round trip
plus the copy itself (issue 15 item 2: the Python a Save costs beyond moving its bytes).

    python -m bench.save_floor --quick     # 10 rounds, about half a minute
    python -m bench.save_floor --label after --out bench/results/save_floor.json

Run from the repository root (the server is a ``python -m kvstore`` subprocess).

One `kvstore serve` subprocess (a host pool, as a server runs) and one TP1 rank of 32
layers registered from shared memory (bench/save_full_empty.py's: 1 KV head x 64,
16 tokens, fp16: 4 KiB a slot, 128 KiB a block). A decode step saves the few blocks
that just filled, so the sizes here are 1, 2, 4 and 8 blocks (128 KiB to 1 MiB).
Each round runs every op ``--ops`` times in a row, the ops in a fresh random order
per round:

  rtt       an empty Stats RPC on the same channel: one gRPC round trip, the least
            any RPC costs
  save_N    a Save of blocks 0..N-1 under new hashes (each block stamped with its
            hash first, untimed; after the round's Saves the last one's blocks are
            loaded back and every byte compared)
  load_N    a Load of the last saved N blocks into blocks N.. of the cache (after the
            round's Loads every byte of the last one is compared with the source)
  copier_N  what the server's copy does for that request (the RegionTable blocks
            path of the host copier, in this process, into a scratch pool)

Per round the p50 of each op; over the rounds p10/p50/p90 of those, and per round
``save_over_floor_us`` = save_N p50 - (rtt p50 + copier_N p50) (load likewise):
what the RPC costs beyond one round trip and its bytes.

JSON (--out, default bench/results/save_floor.json): ``runs[label]`` holds one run's
rows; other labels in the file are kept (A/B of two trees: run this script from the
other tree's root with its PYTHONPATH).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.save_full_empty import (
    CACHE_BLOCKS,
    LAYERS,
    SLOT,
    Keys,
    copier_op,
    spread,
    start,
    write_run,
)

COUNTS = (1, 2, 4, 8)
FIRST = {n: sum(COUNTS[:i]) for i, n in enumerate(COUNTS)}  # each size's source blocks
LOADED = CACHE_BLOCKS // 2  # loads land from here on


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Ops:
    """The timed ops of one server, and the bytes they must have moved. Each size
    saves from blocks of its own (1: block 0, 2: blocks 1-2, 4: 3-6, 8: 7-14) and
    loads into the same blocks from LOADED on, so no op overwrites another's."""

    def __init__(self, server, keys: Keys):
        self.server, self.keys = server, keys
        self.saved: dict[int, list[int]] = {}  # N -> hashes of the last Save of N blocks
        self.verified = 0

    def save(self, n: int) -> float:
        hashes, first = self.keys.take(n), FIRST[n]
        stamp = torch.tensor(hashes, dtype=torch.int64)
        for layer in self.server.layers:  # word 0 of the K and the V half of each block
            layer.tensor.view(torch.int64).view(2, CACHE_BLOCKS, -1)[:, first : first + n, 0] = (
                stamp
            )
        refs = list(zip(hashes, range(first, first + n), strict=True))
        elapsed = timed(lambda: self.server.session.save(refs))
        self.saved[n] = hashes
        return elapsed

    def load(self, n: int) -> float:
        refs = [(h, LOADED + FIRST[n] + i) for i, h in enumerate(self.saved[n])]
        return timed(lambda: self.server.session.load(refs))

    def check(self, n: int) -> None:
        """The last Save of n blocks, loaded back, equals the blocks it was saved from."""
        src, dst = FIRST[n], LOADED + FIRST[n]
        for layer in self.server.layers:
            layer.tensor[:, dst : dst + n].view(torch.uint8).fill_(0xFF)
        self.load(n)
        for layer in self.server.layers:
            a, b = layer.tensor[:, src : src + n], layer.tensor[:, dst : dst + n]
            if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
                raise AssertionError(f"{layer.name}: loaded bytes differ ({n} blocks)")
        self.verified += 1


def us(xs: list[float]) -> list[float]:
    """p10/p50/p90 of seconds ``xs`` in microseconds."""
    return spread(xs, 1e6, 1)


def run(rounds: int, ops_per_round: int, seed: int = 0) -> tuple[list[dict], dict]:
    server = start("floor", 64 << 20)
    ops = Ops(server, Keys())
    copiers = {n: copier_op(server.layers, n) for n in COUNTS}
    table: dict[str, object] = {"rtt": lambda: timed(server.client.stats)}
    for n in COUNTS:
        table[f"save_{n}"] = lambda n=n: ops.save(n)
        table[f"load_{n}"] = lambda n=n: ops.load(n)
        table[f"copier_{n}"] = copiers[n]
    p50s: dict[str, list[float]] = {name: [] for name in table}
    rng = np.random.default_rng(seed)
    try:
        for n in COUNTS:  # warm-up, and a first verified round trip of each size
            ops.save(n)
            ops.check(n)
        for _ in range(rounds):
            for name in [str(x) for x in rng.permutation(list(table))]:
                p50s[name].append(statistics.median(table[name]() for _ in range(ops_per_round)))
            for n in COUNTS:
                ops.check(n)
        evictions = server.client.stats().evictions
    finally:
        server.close()
    rtt = p50s["rtt"]
    rows = []
    for n in COUNTS:
        save, load, cop = p50s[f"save_{n}"], p50s[f"load_{n}"], p50s[f"copier_{n}"]
        rows.append({
            "blocks": n, "request_bytes": n * LAYERS * SLOT,
            "rtt_us_p10_p50_p90": us(rtt),
            "save_us_p10_p50_p90": us(save),
            "load_us_p10_p50_p90": us(load),
            "copier_us_p10_p50_p90": us(cop),
            "save_over_floor_us_p10_p50_p90": us(
                [s - r - c for s, r, c in zip(save, rtt, cop, strict=True)]),
            "load_over_floor_us_p10_p50_p90": us(
                [x - r - c for x, r, c in zip(load, rtt, cop, strict=True)]),
        })  # fmt: skip
    return rows, {"verified_round_trips": ops.verified, "evictions": evictions}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="10 rounds")
    p.add_argument("--rounds", type=int, default=0, help="rounds (default 30)")
    p.add_argument("--ops", type=int, default=9, help="times each op runs in a row, a round")
    p.add_argument("--label", default="after", help="name of this run in the JSON")
    p.add_argument("--out", default="bench/results/save_floor.json")
    args = p.parse_args()
    rounds = args.rounds or (10 if args.quick else 30)
    rows, meta = run(rounds, args.ops)
    for r in rows:
        print(
            f"{r['blocks']} blocks: save {r['save_us_p10_p50_p90']} us, load "
            f"{r['load_us_p10_p50_p90']}, rtt {r['rtt_us_p10_p50_p90'][1]}, copier "
            f"{r['copier_us_p10_p50_p90'][1]}; over floor save "
            f"{r['save_over_floor_us_p10_p50_p90']} load {r['load_over_floor_us_p10_p50_p90']}"
        )
    print(meta)
    write_run(
        Path(args.out),
        "small Save and Load RPCs against one gRPC round trip plus their copy",
        "us = wall time of one RPC seen by the client; per round the p50 of --ops "
        "calls in a row, ops in a fresh random order per round; spread over rounds; "
        "over_floor = op - (rtt + copier) per round; copier = the host copier's RegionTable "
        "blocks path on the same blocks in-process; every round's last Save of each size "
        "loaded back and compared",
        args.label,
        {"rounds": rounds, "ops_per_round": args.ops, "rows": rows, **meta},
    )


if __name__ == "__main__":
    main()
