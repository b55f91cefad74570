"""The block index's Python cost of one Save, and of both ends of one peer fetch, into
a full pool, against moving their bytes.

    python -m bench.index_cost                      # 60 interleaved repeats, ~20 s
    python -m bench.index_cost --label after --out bench/results/index_cost.json

The Save RPC's bookkeeping without gRPC, copy threads or another process, so
its per-block cost reads through the noise of a shared 2-core host: a
``BlockIndex`` over one host ``SlotPool`` (8 MiB slabs, as a server runs)
holds three requests of 256 blocks x 32 layers (at least one slab of them: 64
requests of the one-block shape), and every timed Save claims a request's
new blocks (evicting as many of the oldest: a cache in steady state), computes
their slot addresses and finishes (seals) them: ``kvstore.store.node``'s
save path minus the copy. The two ends of a peer fetch of such a request, minus
the transfer: ``serve`` leases the newest request's sealed blocks and builds
their slot table, then releases them (``kvstore.store.fetch.StoreSource``);
``fetch`` reserves a request's new detached blocks (evicting), builds their slot table
and adopts them (``StoreSink``, ``StoreReservation.commit``). The 64 KiB case
allocates (and zero-fills) a 1.5 GiB host pool.

Baseline, interleaved in random order with the index op in every repeat:
``memcpy``, one contiguous copy of the request's bytes (the least a Save must
move; the copied bytes are compared). ``ratio_index_over_memcpy`` is per repeat
index time / memcpy time: the share the bookkeeping adds to the cheapest copy
(``ratio_serve_over_memcpy``, ``ratio_fetch_over_memcpy`` likewise).

JSON (``--out``): ``runs[label]`` holds one run's rows (256 blocks of 4 KiB and
of 64 KiB slots, and one block of 4 KiB slots: a decode step's Save, where the
cost per call shows); other labels already in the file are kept.
"""

from __future__ import annotations

import argparse
import json
import platform
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from bench.e2e_store import interleaved
from bench.rma import quantiles
from kvstore.store.block import SlotSet
from kvstore.store.blocks import BlockIndex, Writer
from kvstore.store.fetch import StoreSource, slot_table
from kvstore.store.pool import DEFAULT_SLAB_BYTES, SlotPool

LAYERS, HELD = 32, 3  # slots a block; requests the pool holds (at least one slab)
# (slot bytes, blocks a request): two large requests, and the one-block Save of a decode step
SHAPES = ((4 << 10, 256), (64 << 10, 256), (4 << 10, 1))


@dataclass(frozen=True)
class Shape:
    """The blocks' slots (a registry Seal is the server's BlockShape)."""

    slot_bytes: np.ndarray
    tp_size: int = 1


class Churn:
    """An index whose pool is full: each save brings ``blocks`` new blocks, evicts as many."""

    def __init__(self, slot: int, blocks: int):
        self.blocks = blocks
        request = blocks * LAYERS * slot
        held = max(HELD, DEFAULT_SLAB_BYTES // request)  # a pool holds one slab at least
        self.index = BlockIndex({"cpu": SlotPool(held * request, "cpu")})
        self.shape = Shape(np.full(LAYERS, slot, dtype=np.int64))
        self.slots = SlotSet.of(np.arange(LAYERS), self.shape.slot_bytes)
        self.writer = Writer("bench", 0, "cpu")
        self.source = StoreSource(self.index)
        self.next = 0
        for _ in range(held):
            self.save()
        assert self.index.stats().sealed_blocks == held * blocks
        assert self.index.pool_stats().free_bytes == 0

    def _new(self) -> list[int]:
        hashes = self.newest = list(range(self.next, self.next + self.blocks))
        self.next += self.blocks
        return hashes

    def save(self) -> None:
        claim = self.index.claim("bench", self._new(), self.shape, self.slots, self.writer)
        self.index.addresses(claim.blocks, self.slots.slots, "cpu")
        done = self.index.finish(claim)
        assert done.sealed == self.blocks

    def serve(self) -> None:
        lease = self.source.lease("bench", self.newest)
        assert lease is not None and len(lease.slots.ptr) == self.blocks * LAYERS
        lease.release()

    def fetch(self) -> None:
        made = self.index.reserve("bench", self._new(), self.shape, ["cpu"])
        assert len(slot_table(self.index, made.blocks, made.offsets).ptr) == self.blocks * LAYERS
        assert self.index.adopt(made.blocks) == self.blocks


def measure(slot: int, blocks: int, repeats: int, seed: int) -> dict:
    churn = Churn(slot, blocks)
    nbytes = blocks * LAYERS * slot
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    ops = {
        "index": lambda _: churn.save(),
        "serve": lambda _: churn.serve(),
        "fetch": lambda _: churn.fetch(),
        "memcpy": lambda _: dst.copy_(src),
    }
    for fn in ops.values():  # warm
        fn(0)
    times = interleaved(ops, repeats, seed)
    if not torch.equal(dst, src):
        raise AssertionError("memcpy baseline: copied bytes differ")
    index, memcpy = np.array(times["index"]), np.array(times["memcpy"])
    ends = {}
    for op in ("serve", "fetch"):
        t = np.array(times[op])
        ends[f"{op}_ms_p10_p50_p90"] = quantiles(t, 1e3)
        ends[f"{op}_us_per_block_p10_p50_p90"] = quantiles(t / blocks, 1e6)
        ends[f"ratio_{op}_over_memcpy_p10_p50_p90"] = quantiles(t / memcpy)
    return {
        "slot_bytes": slot,
        "blocks": blocks,
        "layers": LAYERS,
        "request_bytes": nbytes,
        "evictions": churn.index.stats().evictions,
        "index_ms_p10_p50_p90": quantiles(index, 1e3),
        "index_us_per_block_p10_p50_p90": quantiles(index / blocks, 1e6),
        "memcpy_ms_p10_p50_p90": quantiles(memcpy, 1e3),
        "ratio_index_over_memcpy_p10_p50_p90": quantiles(index / memcpy),
        **ends,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=60, help="timed repeats per slot size")
    p.add_argument("--label", default="latest", help="the run's name in the JSON")
    p.add_argument("--out", type=Path, default=Path("bench/results/index_cost.json"))
    args = p.parse_args(argv)
    rows = [measure(*shape, args.repeats, seed) for seed, shape in enumerate(SHAPES)]
    for r in rows:
        print(
            f"{r['blocks']:>3} x {r['slot_bytes'] >> 10:>2} KiB slots: "
            f"index {r['index_ms_p10_p50_p90']} ms, "
            f"{r['index_us_per_block_p10_p50_p90']} us/block; memcpy {r['memcpy_ms_p10_p50_p90']}"
            f" ms; index/memcpy {r['ratio_index_over_memcpy_p10_p50_p90']}; serve "
            f"{r['serve_ms_p10_p50_p90']} ms, fetch {r['fetch_ms_p10_p50_p90']} ms"
        )
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    runs = old.get("runs", {})
    runs[args.label] = {
        "generated": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "repeats": args.repeats,
        "rows": rows,
    }
    doc = {
        "benchmark": "BlockIndex bookkeeping in a full pool: a Save (claim, addresses, "
        "finish) and both ends of a peer fetch (serve, fetch)",
        "note": "index = claim of a request's new blocks (256, or 1) x 32 slots evicting as "
        "many, their slot addresses, finish; serve = lease of the newest request's sealed "
        "blocks, their slot table, release; fetch = reserve of a request's new detached "
        "blocks evicting as many, their "
        "slot table, adopt; memcpy = one contiguous copy of the request's bytes, bytes "
        "compared; all interleaved in random order; ratios per repeat (runs before "
        "fetch_* have index rows only)",
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
