"""The block index's Python cost of one Save, and of both ends of one peer fetch, into
a full pool, against moving their bytes.

    python -m bench.index_cost                      # 60 interleaved repeats, ~20 s
    python -m bench.index_cost --label after --out bench/results/index_cost.json

The Save RPC's bookkeeping without gRPC, copy threads or another process, so
its per-block cost reads through the noise of a shared 2-core host: a
``BlockIndex`` over one host ``SlotPool`` (8 MiB slabs, as a server runs)
holds three requests of 256 blocks x 32 layers, and every timed Save claims
256 new blocks (evicting the 256 oldest: a cache in steady state), computes
their slot addresses and finishes (seals) them: ``kvstore.store.node``'s
save path minus the copy. The two ends of a peer fetch of such a request, minus
the transfer: ``serve`` leases the newest request's sealed blocks and builds
their slot table, then releases them (``kvstore.store.fetch.StoreSource``);
``fetch`` reserves 256 new detached blocks (evicting), builds their slot table
and adopts them (``StoreSink``, ``StoreReservation.commit``). The 64 KiB case
allocates (and zero-fills) a 1.5 GiB host pool.

Baseline, interleaved in random order with the index op in every repeat:
``memcpy``, one contiguous copy of the request's bytes (the least a Save must
move; the copied bytes are compared). ``ratio_index_over_memcpy`` is per repeat
index time / memcpy time: the share the bookkeeping adds to the cheapest copy
(``ratio_serve_over_memcpy``, ``ratio_fetch_over_memcpy`` likewise).

JSON (``--out``): ``runs[label]`` holds one run's rows (slot bytes 4 KiB and
64 KiB); other labels already in the file are kept.
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
from kvstore.store.pool import SlotPool

LAYERS, BLOCKS, HELD = 32, 256, 3  # a request; requests the pool holds
SLOTS = (4 << 10, 64 << 10)


@dataclass(frozen=True)
class Shape:
    """The blocks' slots (a registry Seal is the server's BlockShape)."""

    slot_bytes: np.ndarray
    tp_size: int = 1


class Churn:
    """An index whose pool is full: each save brings BLOCKS new blocks, evicts as many."""

    def __init__(self, slot: int):
        self.index = BlockIndex({"cpu": SlotPool(HELD * BLOCKS * LAYERS * slot, "cpu")})
        self.shape = Shape(np.full(LAYERS, slot, dtype=np.int64))
        self.slots = SlotSet.of(np.arange(LAYERS), self.shape.slot_bytes)
        self.writer = Writer("bench", 0, "cpu")
        self.source = StoreSource(self.index)
        self.next = 0
        for _ in range(HELD):
            self.save()
        assert self.index.stats().sealed_blocks == HELD * BLOCKS

    def _new(self) -> list[int]:
        hashes = self.newest = list(range(self.next, self.next + BLOCKS))
        self.next += BLOCKS
        return hashes

    def save(self) -> None:
        claim = self.index.claim("bench", self._new(), self.shape, self.slots, self.writer)
        self.index.addresses(claim.blocks, self.slots.slots, "cpu")
        done = self.index.finish(claim)
        assert done.sealed == BLOCKS

    def serve(self) -> None:
        lease = self.source.lease("bench", self.newest)
        assert lease is not None and len(lease.slots.ptr) == BLOCKS * LAYERS
        lease.release()

    def fetch(self) -> None:
        made = self.index.reserve("bench", self._new(), self.shape, ["cpu"])
        assert len(slot_table(self.index, made.blocks, made.offsets).ptr) == BLOCKS * LAYERS
        assert self.index.adopt(made.blocks) == BLOCKS


def measure(slot: int, repeats: int, seed: int) -> dict:
    churn = Churn(slot)
    nbytes = BLOCKS * LAYERS * slot
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
        ends[f"{op}_us_per_block_p10_p50_p90"] = quantiles(t / BLOCKS, 1e6)
        ends[f"ratio_{op}_over_memcpy_p10_p50_p90"] = quantiles(t / memcpy)
    return {
        "slot_bytes": slot,
        "blocks": BLOCKS,
        "layers": LAYERS,
        "request_bytes": nbytes,
        "evictions": churn.index.stats().evictions,
        "index_ms_p10_p50_p90": quantiles(index, 1e3),
        "index_us_per_block_p10_p50_p90": quantiles(index / BLOCKS, 1e6),
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
    rows = [measure(slot, args.repeats, seed) for seed, slot in enumerate(SLOTS)]
    for r in rows:
        print(
            f"{r['slot_bytes'] >> 10:>3} KiB slots: index {r['index_ms_p10_p50_p90']} ms, "
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
        "note": "index = claim of 256 new blocks x 32 slots evicting 256, their slot "
        "addresses, finish; serve = lease of the newest 256 sealed blocks, their slot "
        "table, release; fetch = reserve of 256 new detached blocks evicting 256, their "
        "slot table, adopt; memcpy = one contiguous copy of the request's bytes, bytes "
        "compared; all interleaved in random order; ratios per repeat (runs before "
        "fetch_* have index rows only)",
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
