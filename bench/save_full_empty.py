"""Save into a full pool against Save into an empty one, and the Python cost per block
of the Save RPC (issue 11 target: full <= 1.3x empty; issue 15 item 2: per-block cost).

    python -m bench.save_full_empty            # 15 interleaved repeats, about a minute
    python -m bench.save_full_empty --quick    # 5 repeats
    python -m bench.save_full_empty --label before --out bench/results/save_full_empty.json

Run from the repository root (the servers are ``python -m kvstore`` subprocesses).

Two `kvstore serve` subprocesses (host pools of 8 MiB slabs, as a server runs), each
with one TP1 rank of 32 layers registered from shared memory (1 KV head x 64, 16
tokens, fp16: 4 KiB a slot):

  full   its pool holds three 1,024-block requests and is filled first, so every
         Save evicts as many blocks as it brings (a cache in steady state);
  empty  its pool is cleared (untimed) before each Save, so nothing is evicted.

Per repeat, in a fresh random order, for each of 64, 256 and 1,024 blocks: a Save of
new blocks into each server, and ``copier`` = what the server's copy does for that
request (the RegionTable blocks path of the host copier, in this process, into
a scratch pool). Per block, the Python cost of the RPC path is
``(save_empty - copier) / blocks`` taken per repeat (same repeat, adjacent ops) and
reported as p10/p50/p90; ``slope_us_per_block`` is the least-squares slope of the
median ``save_empty - copier`` over the block counts (the fixed cost per call is its
intercept). ``full_over_empty`` is per repeat save_full / save_empty, p10/p50/p90.

Every Save (warm-up and timed) saves bytes of its own: before it (untimed) the first
8 bytes of the K and V halves of each saved block of every layer are stamped with the
block's new hash (the rest are the random bytes the sources started with). After it
(untimed) the server loads those hashes back into the other half of the cache
(blocks 1,024.., poisoned with 0xFF first: the random bytes are 0..254) and every byte
is compared with the saved blocks; ``verified_saves`` counts them. The check runs after
every timed Save, not only the first and last: a Load of the same blocks plus the compare
costs about as much as the Save itself, so it adds to the run's wall time but not to the
timed region. After the timed repeats the sources get fresh random bytes, each server
saves them under new hashes and loads them into other block ids, and every byte is compared.

JSON (--out, default bench/results/save_full_empty.json): ``runs[label]`` holds the
rows of one run (``--label``, e.g. "before" and "after" a change, each measured by
this script on the code of the time); other labels already in the file are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from kvstore.client.store_client import KVLayer, RankSession, StoreClient, kv_cache_shm
from kvstore.copy import RegionTable, copier_for, region_from_tensor
from kvstore.demo import free_port, start_server

LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 1, 64, 16
SLOT = 2 * BLOCK * HEADS * HEAD_DIM * 2  # K and V, fp16
COUNTS = (64, 256, 1024)
CACHE_BLOCKS = 2 * max(COUNTS)  # saves read 0..n-1, the check loads into n..2n-1
REQUEST = max(COUNTS) * LAYERS * SLOT


@dataclass
class Server:
    """One store server process, its client and the rank registered with it."""

    name: str
    proc: object
    client: StoreClient
    session: RankSession
    layers: list[KVLayer]

    def close(self) -> None:
        self.session.close()
        self.client.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)
        for layer in self.layers:
            layer.shm.close()


def make_layers() -> list[KVLayer]:
    layers = []
    for i in range(LAYERS):
        shm = kv_cache_shm("kv_first", CACHE_BLOCKS, BLOCK, HEADS, HEAD_DIM, torch.float16)
        shm.tensor.view(torch.uint8).random_(0, 255)
        layers.append(KVLayer(f"model.layers.{i}.self_attn", shm.tensor, "kv_first", "NHD", shm))
    return layers


def start(name: str, pool_bytes: int) -> Server:
    port = free_port()
    proc = start_server(port, "cpu", pool_bytes)
    client = StoreClient(f"127.0.0.1:{port}", timeout=120)
    layers = make_layers()
    session = client.register(name, "bench", layers, block_size=BLOCK)
    session.wait_sealed(30)
    return Server(name, proc, client, session, layers)


class Keys:
    """A fresh block hash for every block ever saved in this run."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        first, self.next = self.next, self.next + n
        return list(range(first, first + n))


def save(server: Server, keys: Keys, n: int, checked: list[int]) -> float:
    """Timed: one Save of blocks 0..n-1 under new hashes. Untimed: the blocks stamped
    with their hashes before it; after it the saved bytes loaded back and compared
    (``checked[0]`` counts the Saves verified)."""
    hashes = keys.take(n)
    stamp = torch.tensor(hashes, dtype=torch.int64)
    for layer in server.layers:  # word 0 of the K and of the V half of each block
        layer.tensor.view(torch.int64).view(2, CACHE_BLOCKS, -1)[:, :n, 0] = stamp
    refs = list(zip(hashes, range(n), strict=True))
    t0 = time.perf_counter()
    reply = server.session.save(refs, timeout=300)
    elapsed = time.perf_counter() - t0
    assert reply.written == n, reply
    check_saved(server, hashes)
    checked[0] += 1
    return elapsed


def check_saved(server: Server, hashes: list[int]) -> None:
    """Load ``hashes`` (saved from blocks 0..n-1) into the poisoned blocks from
    max(COUNTS) on and compare every byte with the blocks they were saved from."""
    n, first = len(hashes), max(COUNTS)
    for layer in server.layers:
        layer.tensor[:, first : first + n].view(torch.uint8).fill_(0xFF)
    server.session.load([(h, first + i) for i, h in enumerate(hashes)], timeout=300)
    for layer in server.layers:
        a = layer.tensor[:, :n].view(torch.int16)
        b = layer.tensor[:, first : first + n].view(torch.int16)
        if not torch.equal(a, b):
            raise AssertionError(f"{server.name} {layer.name}: saved bytes differ ({n} blocks)")


def copier_op(layers: list[KVLayer], n: int):
    """The server's copy of an n-block Save (the registration's RegionTable and the
    host copier, as the store runs it), into a scratch pool."""
    copier = copier_for("cpu")
    pool = torch.zeros(LAYERS * n * SLOT, dtype=torch.uint8)
    table = RegionTable([region_from_tensor(layer.tensor, "kv_first") for layer in layers])
    addrs = pool.data_ptr() + np.arange(LAYERS * n, dtype=np.uint64).reshape(
        n, LAYERS
    ).T * np.uint64(SLOT)
    ids = np.arange(n, dtype=np.int64)

    def op() -> float:
        t0 = time.perf_counter()
        copier.save_blocks(table, ids, addrs)
        return time.perf_counter() - t0

    op.pool = pool  # kept alive with the op
    return op


def run(repeats: int, seed: int = 0) -> tuple[dict[str, list[float]], dict]:
    full = start("full", 3 * REQUEST)
    empty = start("empty", REQUEST + (8 << 20))
    keys = Keys()
    checked = [0]  # Saves whose bytes were loaded back and compared
    try:
        for _ in range(4):  # fill the full server's pool; from the fourth on it evicts
            save(full, keys, max(COUNTS), checked)
        ops = {}
        for n in COUNTS:
            ops[f"full_{n}"] = lambda n=n: save(full, keys, n, checked)
            ops[f"empty_{n}"] = lambda n=n: (
                empty.client.clear(),
                save(empty, keys, n, checked),
            )[1]
            ops[f"copier_{n}"] = copier_op(full.layers, n)
        for op in ops.values():  # warm-up
            op()
        rng = np.random.default_rng(seed)
        t: dict[str, list[float]] = {name: [] for name in ops}
        for _ in range(repeats):
            for name in rng.permutation(list(ops)):
                t[name].append(ops[name]())
        meta = {
            "evictions_full": full.client.stats().evictions,
            "evictions_empty": empty.client.stats().evictions,
            "verified_saves": checked[0],
            "verified_blocks": verify(full, keys) + verify(empty, keys),
        }
    finally:
        full.close()
        empty.close()
    return t, meta


def verify(server: Server, keys: Keys) -> int:
    """Save fresh random bytes under new hashes, load them into other ids, compare all."""
    n = max(COUNTS)
    for layer in server.layers:
        layer.tensor.view(torch.uint8).random_(0, 255)
        layer.tensor[:, n:].zero_()
    hashes = keys.take(n)
    server.session.save(list(zip(hashes, range(n), strict=True)), timeout=300)
    server.session.load([(h, n + i) for i, h in enumerate(hashes)], timeout=300)
    for layer in server.layers:
        a = layer.tensor[:, :n].contiguous().view(torch.int16)
        b = layer.tensor[:, n:].contiguous().view(torch.int16)
        if not torch.equal(a, b):
            raise AssertionError(f"{server.name} {layer.name}: loaded bytes differ from saved")
    return n


def spread(xs: list[float], scale: float = 1.0, digits: int = 3) -> list[float]:
    return [round(float(x) * scale, digits) for x in np.quantile(xs, [0.1, 0.5, 0.9])]


def rows(t: dict[str, list[float]]) -> tuple[list[dict], float, float]:
    out, x, y = [], [], []
    for n in COUNTS:
        full, empty, cop = t[f"full_{n}"], t[f"empty_{n}"], t[f"copier_{n}"]
        per_block = [(e - c) / n for e, c in zip(empty, cop, strict=True)]
        per_block_full = [(f - c) / n for f, c in zip(full, cop, strict=True)]
        ratio = [f / e for f, e in zip(full, empty, strict=True)]
        x.append(n)
        y.append(statistics.median([e - c for e, c in zip(empty, cop, strict=True)]))
        out.append({
            "blocks": n, "layers": LAYERS, "slot_bytes": SLOT, "request_bytes": n * LAYERS * SLOT,
            "save_full_ms_p10_p50_p90": spread(full, 1e3, 2),
            "save_empty_ms_p10_p50_p90": spread(empty, 1e3, 2),
            "copier_ms_p10_p50_p90": spread(cop, 1e3, 2),
            "full_over_empty_p10_p50_p90": spread(ratio),
            "python_us_per_block_p10_p50_p90": spread(per_block, 1e6, 2),
            "python_us_per_block_full_p10_p50_p90": spread(per_block_full, 1e6, 2),
        })  # fmt: skip
    slope, intercept = np.polyfit(x, y, 1)
    return out, float(slope) * 1e6, float(intercept) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="5 repeats")
    p.add_argument("--repeats", type=int, default=0, help="interleaved repeats (default 15)")
    p.add_argument("--label", default="after", help="name of this run in the JSON")
    p.add_argument("--out", default="bench/results/save_full_empty.json")
    args = p.parse_args()
    repeats = args.repeats or (5 if args.quick else 15)
    t, meta = run(repeats)
    table, slope, intercept = rows(t)
    for r in table:
        print(
            f"{r['blocks']:5d} blocks: full {r['save_full_ms_p10_p50_p90'][1]:7.2f} ms, "
            f"empty {r['save_empty_ms_p10_p50_p90'][1]:7.2f} ms, "
            f"copier {r['copier_ms_p10_p50_p90'][1]:6.2f} ms, "
            f"full/empty {r['full_over_empty_p10_p50_p90']}, "
            f"python us/block {r['python_us_per_block_p10_p50_p90']}"
        )
    print(f"slope {slope:.2f} us/block, intercept {intercept:.2f} ms; {meta}")
    write_run(
        Path(args.out),
        "Save RPC into a full (evicting) pool vs an empty one; Python cost per block",
        "ms = wall time of one Save RPC seen by the client; copier = the host copier's "
        "RegionTable blocks path on the same blocks in-process; python_us_per_block = "
        "(save_empty - copier) / blocks per repeat; full_over_empty per repeat; all ops "
        "interleaved in random order; every Save's bytes loaded back and compared (untimed)",
        args.label,
        {"repeats": repeats, "rows": table, "slope_us_per_block": round(slope, 2),
         "intercept_ms": round(intercept, 3), **meta},
    )  # fmt: skip


def write_run(out: Path, benchmark: str, note: str, label: str, run: dict) -> None:
    """Merge one run into the JSON at ``out`` as ``runs[label]`` (other labels kept),
    stamped with the time and the host."""
    doc = json.loads(out.read_text()) if out.exists() else {}
    doc.update({"benchmark": benchmark, "note": note})
    doc.setdefault("runs", {})[label] = {
        "generated": datetime.now(UTC).isoformat(timespec="seconds"), **run,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                 "load_avg": [round(x, 2) for x in os.getloadavg()]},
    }  # fmt: skip
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
