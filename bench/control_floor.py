"""The control floor of a one-slot peer fetch, back to back, against its parts
(issue 15 item 3: "fetch control floor <= 0.1 ms + vectorised O(slots)").

    python bench/control_floor.py --quick     # about two minutes on a 2-core host
    python bench/control_floor.py             # more rounds

bench/transfer.py times its control floor interleaved with every other op of a
configuration, so each fetch meets a peer that slept (woken by UCX's fd). This
bench times fetches back to back, as a busy serving node sees them, and in the
same run the two things a one-sided fetch cannot do without: one request round
trip and one NIXL read of the slot. What a fetch costs beyond them is the
control path's own (Python on both sides, the lease, the reservation, the
commit, the one-way RELEASE).

Two spawned processes, as in bench/transfer.py (its serving process: a store
node with sealed blocks of 16 KiB slots, a PeerServer with its pool registered
with NIXL, a raw ucxx listener). The fetching process has a store node of the
same layout. Two shapes, one after the other: one block of one slot, and 128
blocks of 16 slots (2,048 slots, 32 MiB: bench/transfer.py's second floor
shape, where what grows with the blocks shows). Each round runs every op
``--ops`` times in a row, the ops in a fresh random order per round:

  fetch_rma   StoreNode.prefetch of the blocks, one-sided (REQUEST, grant, NIXL
              READ into the reserved slots, commit, RELEASE); the blocks are
              dropped (untimed) after each, their bytes compared first
  fetch       the same two-sided (REQUEST, offer, GO, the slots as messages)
  rtt         raw ucxx: a 16-byte request, a 64-byte answer (bench/transfer.py's
              raw_one of 64 bytes): one round trip, no kvstore code
  nixl_read   one raw NIXL READ of the same bytes as ONE run (the same endpoints
              and registered pools as fetch_rma), a blocking wait; bytes
              compared after each

Per round the p50 of each op; over the rounds p10/p50/p90 of those, and per
round ``over_floor_us`` = fetch_rma p50 - (rtt p50 + nixl_read p50), the control
path's own cost, and ``ratio_floor`` = (rtt + nixl_read) / fetch_rma.

JSON to bench/results/control_floor.json: benchmark, note, host, runs{label:
code (git describe of the kvstore measured), generated, rounds, ops_per_round,
transports, env, shapes{"1", "2048": slots, slot_bytes, us_p10_p50_p90 (per
op), over_floor_us_p10_p50_p90, ratio_floor_p10_p50_p90, verified (fetches and
reads whose bytes were compared)}}. ``--label`` keeps other labels' runs (A/B of
two trees: run this script with PYTHONPATH set to the other tree's root).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: rma, transfer

import transfer as bt
from rma import RAW_DATA_TAG, RAW_ONE, RAW_REQUEST_TAG, polled, timed_read, ucx_env

OUT = Path(__file__).resolve().parent / "results" / "control_floor.json"
SLOT = 16 << 10
# (label, slot bytes, slots a block, tp, blocks): one slot, and 2,048 (bench/transfer.py's)
SHAPES = (("1", SLOT, 1, 1, 1), ("2048", SLOT, 16, 1, 128))
ANSWER_BYTES = 64
OPS = ("fetch_rma", "fetch", "rtt", "nixl_read")


class Floor:
    """The fetching process's timed ops."""

    def __init__(self, ctrl: Any, address: str, raw_ep: Any, card: Any, shape: bt.Shape):
        from kvstore.transfer import rma

        self.ctrl, self.raw_ep, self.shape = ctrl, raw_ep, shape
        self.namespace, sets = bt.ask(ctrl, "prepare", asdict(self.shape))
        self.hashes = sets[0]
        self.side = bt.StoreFetching("cpu", self.shape, address, one_sided=True)
        if self.side.namespace != self.namespace:
            raise AssertionError(f"namespaces differ: {self.side.namespace}")
        peer_card = rma.PeerCard.decode(card)
        self.peer = self.side.endpoint.connect(peer_card)
        remote = bt.ask(ctrl, "offsets", 0)
        self.read = bt.one_run_read(
            peer_card.region.addr, remote, self.side.endpoint.region.addr, self.shape
        )
        self.request = np.array([RAW_ONE, ANSWER_BYTES], dtype=np.uint64)
        self.answer = np.zeros(ANSWER_BYTES, dtype=np.uint8)
        self.held = bt.ask(ctrl, "held", ANSWER_BYTES)
        if bool((self.held == bt.POISON).all()):
            raise AssertionError("the serving pool's first bytes would not tell an answer")
        self.verified = 0

    async def op(self, name: str) -> float:
        """One timed op (its seconds); its bytes compared, untimed."""
        if name in ("fetch_rma", "fetch"):
            return await self.fetch(one_sided=name == "fetch_rma")
        if name == "rtt":
            return await self.rtt()
        return self.nixl_read()

    async def fetch(self, one_sided: bool) -> float:
        self.side.buffer[: self.shape.nbytes].fill_(bt.POISON)
        start = time.perf_counter()
        n = await self.side.fetch(self.namespace, self.hashes, one_sided=one_sided)
        elapsed = time.perf_counter() - start
        if n != len(self.hashes):
            raise AssertionError(f"fetched {n} of {len(self.hashes)} blocks")
        offsets = self.side.offsets(self.namespace, self.hashes)
        bt.check_slots(self.side.buffer, self.shape, offsets, 0, "fetched slots")
        self.side.node.index.clear(self.namespace)  # the next fetch fetches again
        self.verified += 1
        return elapsed

    async def rtt(self) -> float:
        self.answer.fill(bt.POISON)
        start = time.perf_counter()
        with polled():
            recv = asyncio.ensure_future(self.raw_ep.recv(self.answer, tag=RAW_DATA_TAG))
            await asyncio.sleep(0)  # the receive is posted before the request goes
            await self.raw_ep.send(self.request, tag=RAW_REQUEST_TAG)
            await recv
        elapsed = time.perf_counter() - start
        if not np.array_equal(self.answer, self.held):
            raise AssertionError("raw answer differs from the serving pool's first bytes")
        return elapsed

    def nixl_read(self) -> float:
        self.side.buffer.fill_(bt.POISON)
        elapsed = timed_read(self.side.endpoint, self.peer, self.read.runs)
        bt.check_slots(self.side.buffer, self.shape, self.read.landing, 0, "raw NIXL read")
        self.verified += 1
        return elapsed


async def _measure(ctrl: Any, opts: dict) -> dict:
    from kvstore.transfer.ucx import loop_progress, ucxx_module

    ucxx = ucxx_module()
    address, raw_port, transports, card = ctrl.recv()
    if card is None:
        raise AssertionError("the serving process has no NIXL card")
    loop_progress()
    raw_ep = await ucxx.create_endpoint("127.0.0.1", raw_port)
    rng = np.random.default_rng(opts["seed"])
    shapes = {}
    for label, *dims in SHAPES:
        floor = Floor(ctrl, address, raw_ep, card, bt.Shape(*dims))
        p50s: dict[str, list[float]] = {name: [] for name in OPS}
        bt.ask(ctrl, "progress", True)  # the serving side progresses NIXL, as under a lease
        for _ in range(opts["warmup"]):
            for name in OPS:
                await floor.op(name)
        for _ in range(opts["rounds"]):
            for name in rng.permutation(OPS):
                times = [await floor.op(name) for _ in range(opts["ops"])]
                p50s[name].append(float(np.median(times)) * 1e6)
        bt.ask(ctrl, "progress", False)
        floor.side.close()
        shapes[label] = {"p50s": p50s, "verified": floor.verified}
    return {"shapes": shapes, "transports": transports}


def spread(values: list[float] | np.ndarray, digits: int = 1) -> list[float]:
    return [round(float(v), digits) for v in np.percentile(values, [10, 50, 90])]


def summarise(out: dict, opts: dict) -> dict:
    rows = {}
    for (label, slot, per_block, _, blocks), shape in zip(SHAPES, out["shapes"].values()):
        p50s = {k: np.asarray(v) for k, v in shape["p50s"].items()}
        parts = p50s["rtt"] + p50s["nixl_read"]
        rows[label] = {
            "slots": per_block * blocks,
            "slot_bytes": slot,
            "us_p10_p50_p90": {name: spread(v) for name, v in p50s.items()},
            "over_floor_us_p10_p50_p90": spread(p50s["fetch_rma"] - parts),
            "ratio_floor_p10_p50_p90": spread(parts / p50s["fetch_rma"], 3),
            "verified": shape["verified"],
        }
    return {
        "rounds": opts["rounds"],
        "ops_per_round": opts["ops"],
        "shapes": rows,
        "transports": out["transports"],
    }


def run(opts: dict) -> dict:
    env = ucx_env("default")
    serve_opts = {
        "serve_device": "cpu",
        "source": "store",
        "serve_bytes": 2 * max(bt.Shape(*dims).nbytes for _, *dims in SHAPES),  # sets A, B
        "layers_by_name": False,
        "rma": True,
    }
    out = bt.run_pair(env, serve_opts, opts, _measure, opts["timeout_s"])
    return summarise(out, opts) | {"env": env}


def code_version() -> str:
    import kvstore

    root = Path(kvstore.__file__).resolve().parent.parent
    try:
        return subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 rounds of 40 ops (default 20)")
    parser.add_argument("--rounds", type=int, help="rounds (default 20; quick 8)")
    parser.add_argument("--ops", type=int, default=40, help="ops of one kind in a row (40)")
    parser.add_argument("--label", default="current", help="the run's key in the JSON")
    parser.add_argument("--out", type=Path, default=OUT, help="JSON to merge into")
    args = parser.parse_args()
    if args.ops < 1 or (args.rounds is not None and args.rounds < 1):
        parser.error("--rounds and --ops must be at least 1")
    opts = {
        "rounds": args.rounds or (8 if args.quick else 20),
        "ops": args.ops,
        "warmup": 20,
        "seed": 7,
        "timeout_s": 600,
    }
    from kvstore.transfer import rma

    ok = rma.available()
    if not ok:
        raise SystemExit(f"one-sided reads unavailable: {ok.reason}")
    row = run(opts) | {"code": code_version()}
    now = datetime.now(UTC).isoformat(timespec="seconds")
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    runs = old.get("runs", {}) | {args.label: row | {"generated": now}}
    doc = {
        "benchmark": "one-slot peer fetch back to back vs its parts: one raw ucxx round "
        "trip and one raw NIXL read, two processes on one host",
        "note": "per round (ops_per_round of one op in a row, ops in a random order per "
        "round) the p50 in microseconds; over rounds p10/p50/p90. over_floor_us = "
        "fetch_rma - (rtt + nixl_read) per round: what the control path adds; "
        "ratio_floor = (rtt + nixl_read) / fetch_rma. Every fetch and NIXL read has its "
        "bytes compared (verified). Fields: bench/control_floor.py docstring",
        "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
