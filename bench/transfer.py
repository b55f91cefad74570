"""Peer-transfer benchmark: PeerServer/fetch against raw ucxx between two processes.

    python bench/transfer.py --quick             # < 1 min on a 2-core host
    python bench/transfer.py                     # full sweep
    python bench/transfer.py --tls all --tls tcp,self   # one sweep per UCX_TLS
    python bench/transfer.py --mem cuda          # GPU to GPU (cupy pools), GPU host only

A serving process holds a slot pool and runs a PeerServer plus a raw ucxx
listener; a fetching process pulls N blocks (slot sizes 16 KiB .. 4 MiB)
through fetch() into a reserved pool, and, interleaved in the same run between
the same two processes, receives the same total bytes as ONE buffer from the
raw listener (the baseline: what UCX alone does on this path). Then the
latency of fetching a 32-block prefix of a 32-layer TP2 model (64 slots per
block, see LATENCY_SLOT) is sampled.

Both pools place slots the way the block store does: a tp_rank's slots of
consecutive blocks follow each other (slot s of a block belongs to rank
s % tp_size), so the transfer layer coalesces them into a few large messages.
Throughput rows model TP1 (a block's 16 slots back to back, block after
block); the latency case TP2 (each rank's slots in its own region of the pool
on the serving side, rank after rank on the fetching side, as
BlockStore.reserve_detached allocates). Rows go to bench/results/transfer.json
(rows of another mem kind already there are kept) and transfer.png.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.transfer import SlotTable

RESULTS = Path(__file__).resolve().parent / "results"
NS = "bench.0000000000000000"
SLOT_SIZES = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
SLOTS_PER_BLOCK = 16  # throughput rows; the latency case uses 64
# Latency case: Llama-3-8B-like, 32 layers, 8 KV heads x 128 dim, fp16,
# 16-token blocks, TP2: each rank holds 4 heads of K and V of one layer:
# 16 tokens * 4 heads * 128 dim * 2 bytes * 2 (K+V) = 32 KiB per slot,
# 32 layers * 2 ranks = 64 slots per block, 2 MiB per block, 64 MiB per prefix.
LATENCY_LAYERS, LATENCY_TP, LATENCY_BLOCKS = 32, 2, 32
LATENCY_SLOT = 16 * (8 // LATENCY_TP) * 128 * 2 * 2
GBPS_NOTE = (
    "gbps = slot payload bytes / median wall time of one fetch (request, offer, "
    "reserve, GO, all slots), 1 GB = 1e9 bytes; baseline_gbps = the same total bytes "
    "as one ucxx message between the same two processes, request round trip "
    "included, timed interleaved; ratio = gbps / baseline_gbps; for mem=cuda also "
    "device_copy_gbps = one device-to-device cudaMemcpy of the same bytes in the "
    "fetching process (bytes counted once) and ratio_device_copy = gbps / that; "
    "ratio_p10_p50_p90 = raw time / fetch time per interleaved repeat; verified = a fetch "
    "and a raw receive into a zeroed pool matched the serving pool's byte pattern"
)


# ---- the two processes' pools: slot views carved from one array -------------------------


PATTERN = 251  # the serving pool holds byte i % 251 at offset i: a fetch is checkable


def make_pool(nbytes: int, mem: str, device: int, pattern: bool = False) -> Any:
    """A pool with every page touched; ``pattern``: byte i is i % PATTERN, else zeros."""
    if mem == "cuda":
        import cupy

        with cupy.cuda.Device(device):
            if pattern:
                return (cupy.arange(nbytes, dtype=cupy.int64) % PATTERN).astype(cupy.uint8)
            return cupy.zeros(nbytes, dtype=cupy.uint8)
    if pattern:
        return np.resize(np.arange(PATTERN, dtype=np.uint8), nbytes)
    pool = np.empty(nbytes, dtype=np.uint8)
    pool.fill(0)  # touch every page before timing
    return pool


def check_pattern(pool: Any, nbytes: int, what: str) -> None:
    """The first ``nbytes`` of ``pool`` are the serving pool's bytes, as placed there."""
    head = pool[:nbytes]
    head = head.get() if hasattr(head, "get") else head  # cupy -> numpy
    want = np.resize(np.arange(PATTERN, dtype=np.uint8), nbytes)
    if not np.array_equal(head, want):
        bad = int(np.argmax(head != want))
        raise AssertionError(f"{what}: byte {bad} is {head[bad]}, expected {want[bad]}")


def encode_hash(slot_bytes: int, slots_per_block: int, index: int, tp: int = 1) -> int:
    """The bench source needs no index: a hash says where its block lives."""
    return (tp << 56) | (slot_bytes << 32) | (slots_per_block << 20) | index


def decode_hash(h: int) -> tuple[int, int, int, int]:
    """(slot bytes, slots per block, block index, tp size)."""
    return (h >> 32) & 0xFFFFFF, (h >> 20) & 0xFFF, h & 0xFFFFF, h >> 56


def pool_memory(pool: Any) -> tuple[int, int]:
    """(base address, memory key: 0 for host, else the CUDA allocation)."""
    if isinstance(pool, np.ndarray):
        return pool.__array_interface__["data"][0], 0
    return int(pool.data.ptr), int(pool.data.mem.ptr)


def tp_slots(
    pool: Any, region: int, slot: int, per_block: int, tp: int, index: np.ndarray
) -> SlotTable:
    """Slots of blocks ``index`` where rank r owns the r-th ``region`` bytes of the
    pool and, there, block i's slots of that rank (r, r + tp, ...) follow block i - 1's."""
    base, key = pool_memory(pool)
    s = np.arange(per_block, dtype=np.int64)
    at = (s % tp) * region + (index[:, None] * (per_block // tp) + s // tp) * slot
    n = at.size
    return SlotTable(
        (np.uint64(base) + at.ravel().astype(np.uint64)),
        np.full(n, slot, dtype=np.int64),
        np.full(n, key, dtype=np.int64),
        np.full(len(index), per_block, dtype=np.int64),
        owner=pool,
    )


@dataclass
class BenchLease:
    hashes: list[int]
    slots: SlotTable

    def release(self) -> None:
        pass


class BenchSource:
    """Every hash is sealed. Rank r of tp owns the r-th 1/tp of the pool; there,
    block i's slots of that rank (r, r + tp, ...) follow block i - 1's."""

    def __init__(self, pool: Any):
        self.pool = pool

    def lease(self, namespace: str, hashes: list[int]) -> BenchLease:
        slot, per_block, _, tp = decode_hash(hashes[0])
        index = np.array([decode_hash(h)[2] for h in hashes], dtype=np.int64)
        region = len(self.pool) // tp
        fits = (index + 1) * (per_block // tp) * slot <= region
        n = len(index) if fits.all() else int(np.argmin(fits))
        return BenchLease(hashes[:n], tp_slots(self.pool, region, slot, per_block, tp, index[:n]))


@dataclass
class BenchReservation:
    slots: SlotTable

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        pass


class BenchSink:
    """Reserves from the start of the pool every time, as a warm slab allocator would,
    and in BlockStore.reserve_detached's order: rank 0's slots of every block, then
    rank 1's, ... (every block of one layout, as a bench fetch is)."""

    def __init__(self, pool: Any):
        self.pool = pool

    def reserve(
        self, namespace: str, hashes: list[int], slot_sizes: list[list[int]]
    ) -> BenchReservation:
        tp = decode_hash(hashes[0])[3]
        per_block, slot = len(slot_sizes[0]), slot_sizes[0][0]
        region = len(hashes) * (per_block // tp) * slot
        index = np.arange(len(hashes), dtype=np.int64)
        return BenchReservation(tp_slots(self.pool, region, slot, per_block, tp, index))


# ---- serving process ------------------------------------------------------------------------


def serve_main(pipe: Any, env: dict, mem: str, pool_bytes: int) -> None:
    os.environ.update(env)
    asyncio.run(_serve(pipe, mem, pool_bytes))
    os._exit(0)  # skip UCX finalizers, which can stall interpreter exit


async def _serve(pipe: Any, mem: str, pool_bytes: int) -> None:
    from kvstore.transfer import PeerServer
    from kvstore.transfer.ucx import ucxx_module

    ucxx = ucxx_module()
    pool = make_pool(pool_bytes, mem, device=0, pattern=True)
    server = PeerServer(BenchSource(pool), timeout_s=60)
    await server.start()

    async def raw_handler(ep: Any) -> None:
        """Baseline: on an 8-byte request for n bytes, send pool[:n] as one message."""
        request = np.zeros(1, dtype=np.uint64)
        try:
            while True:
                await ep.recv(request)
                await ep.send(pool[: int(request[0])])
        except Exception:
            ep.abort()

    raw = ucxx.create_listener(raw_handler, port=0)
    pipe.send((server.address, raw.port, sorted(ucxx.get_active_transports())))
    await asyncio.get_running_loop().run_in_executor(None, pipe.recv)  # until told to stop
    raw.close()
    await server.stop()


# ---- fetching process -----------------------------------------------------------------------


@dataclass
class Row:
    transport: str
    mem: str
    slot_bytes: int
    slots_per_block: int
    num_blocks: int
    total_bytes: int
    gbps: float
    baseline_gbps: float
    ratio: float
    repeats: int
    device_copy_gbps: float | None = None  # cuda: one cudaMemcpy of the same bytes, in-process
    ratio_device_copy: float | None = None
    ratio_p10_p50_p90: list[float] | None = None  # per interleaved repeat: raw time / fetch time
    verified: bool = False  # a fetch and a raw receive into a zeroed pool matched the peer


def fetch_main(pipe: Any, env: dict, opts: dict) -> None:
    os.environ.update(env)
    pipe.send(asyncio.run(_measure(opts)))
    pipe.close()
    os._exit(0)  # skip UCX finalizers, which can stall interpreter exit


async def _measure(opts: dict) -> dict:
    from kvstore.transfer import close_endpoints, fetch
    from kvstore.transfer.ucx import ucxx_module

    ucxx = ucxx_module()
    mem, total = opts["mem"], opts["total_bytes"]
    pool = make_pool(total, mem, device=opts["fetch_device"])
    sink = BenchSink(pool)
    raw_ep = await ucxx.create_endpoint("127.0.0.1", opts["raw_port"])
    request = np.zeros(1, dtype=np.uint64)
    sync = _synchronize(mem)
    scratch = make_pool(total, mem, device=opts["fetch_device"]) if mem == "cuda" else None

    def device_copy_once(nbytes: int) -> float:
        """The GPU's own ceiling for these bytes: one device-to-device memcpy."""
        sync()
        start = time.perf_counter()
        scratch.data.copy_from_device(pool.data, nbytes)
        sync()
        return time.perf_counter() - start

    async def raw_once(nbytes: int) -> float:
        request[0] = nbytes
        start = time.perf_counter()
        await raw_ep.send(request)
        await raw_ep.recv(pool[:nbytes])
        sync()
        return time.perf_counter() - start

    async def fetch_once(hashes: list[int]) -> float:
        start = time.perf_counter()
        n = await fetch(opts["address"], NS, hashes, sink, timeout_s=60)
        sync()
        assert n == len(hashes), (n, len(hashes))
        return time.perf_counter() - start

    rows = []
    for slot in opts["slot_sizes"]:
        num_blocks = total // (slot * SLOTS_PER_BLOCK)
        hashes = [encode_hash(slot, SLOTS_PER_BLOCK, i) for i in range(num_blocks)]
        nbytes = num_blocks * SLOTS_PER_BLOCK * slot
        await raw_once(nbytes)  # warm up: registration caches, rendezvous paths
        await fetch_once(hashes)
        fetched, raw, dcopy = [], [], []
        for _ in range(opts["repeats"]):
            raw.append(await raw_once(nbytes))
            fetched.append(await fetch_once(hashes))
            if scratch is not None:
                dcopy.append(device_copy_once(nbytes))
        gbps = nbytes / statistics.median(fetched) / 1e9
        base = nbytes / statistics.median(raw) / 1e9
        row = Row(
            opts["tls"],
            mem,
            slot,
            SLOTS_PER_BLOCK,
            num_blocks,
            nbytes,
            round(gbps, 3),
            round(base, 3),
            round(gbps / base, 3),
            opts["repeats"],
        )
        if dcopy:
            dc = nbytes / statistics.median(dcopy) / 1e9
            row.device_copy_gbps, row.ratio_device_copy = round(dc, 3), round(gbps / dc, 3)
        ratios = np.asarray(raw) / np.asarray(fetched)
        row.ratio_p10_p50_p90 = [round(float(q), 3) for q in np.quantile(ratios, [0.1, 0.5, 0.9])]
        for what in ("fetch", "raw"):
            pool[:nbytes] = 0
            await (fetch_once(hashes) if what == "fetch" else raw_once(nbytes))
            check_pattern(pool, nbytes, f"{what} of {nbytes} bytes in {slot}-byte slots")
        row.verified = True
        rows.append(row)
        extra = f"  memcpy {row.device_copy_gbps} GB/s" if dcopy else ""
        print(
            f"  {opts['tls']:>10} {mem} slot {slot >> 10:>5} KiB"
            f" x {num_blocks * SLOTS_PER_BLOCK:>5}"
            f": fetch {gbps:6.2f} GB/s  raw {base:6.2f} GB/s  ratio {gbps / base:5.2f}{extra}",
            flush=True,
        )

    per_block = LATENCY_LAYERS * LATENCY_TP
    hashes = [encode_hash(LATENCY_SLOT, per_block, i, LATENCY_TP) for i in range(LATENCY_BLOCKS)]
    await fetch_once(hashes)
    samples = sorted([await fetch_once(hashes) for _ in range(opts["latency_iters"])])
    latency = {
        "transport": opts["tls"],
        "mem": mem,
        "model": "32 layers, TP2, 8 KV heads x 128, fp16",
        "block_tokens": 16,
        "slot_bytes": LATENCY_SLOT,
        "slots_per_block": per_block,
        "num_blocks": LATENCY_BLOCKS,
        "total_bytes": LATENCY_SLOT * per_block * LATENCY_BLOCKS,
        "iters": len(samples),
        "p50_ms": round(1e3 * _quantile(samples, 0.5), 3),
        "p99_ms": round(1e3 * _quantile(samples, 0.99), 3),
        "min_ms": round(1e3 * samples[0], 3),
    }
    print(
        f"  latency {LATENCY_BLOCKS}-block prefix ({latency['total_bytes'] >> 20} MiB): "
        f"p50 {latency['p50_ms']} ms  p99 {latency['p99_ms']} ms",
        flush=True,
    )
    raw_ep.abort()
    await close_endpoints()
    return {
        "rows": [asdict(r) for r in rows],
        "latency": latency,
        "active_transports": sorted(ucxx.get_active_transports()),
    }


def _synchronize(mem: str) -> Any:
    if mem == "cuda":
        import cupy

        return cupy.cuda.runtime.deviceSynchronize
    return lambda: None


def _quantile(sorted_samples: list[float], q: float) -> float:
    i = min(len(sorted_samples) - 1, round(q * (len(sorted_samples) - 1)))
    return sorted_samples[i]


# ---- driver ---------------------------------------------------------------------------------


def ucx_env(tls: str, mem: str) -> dict:
    from kvstore.transfer.ucx import UCX_DEFAULTS

    env = {k: os.environ.get(k, v) for k, v in UCX_DEFAULTS.items()}
    if tls != "default":
        env["UCX_TLS"] = tls
    return env


def run_sweep(tls: str, args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    env = ucx_env(tls, args.mem)
    total = args.total_mib << 20
    latency_bytes = LATENCY_SLOT * LATENCY_LAYERS * LATENCY_TP * LATENCY_BLOCKS
    serve_pipe, child = ctx.Pipe()
    server = ctx.Process(
        target=serve_main, daemon=True, args=(child, env, args.mem, max(total, latency_bytes))
    )
    server.start()
    fetcher = None
    try:
        address, raw_port, server_tls = serve_pipe.recv()
        opts = {
            "mem": args.mem,
            "total_bytes": max(total, latency_bytes),
            "tls": tls,
            "address": address,
            "raw_port": raw_port,
            "repeats": args.repeats,
            "latency_iters": args.latency_iters,
            "slot_sizes": args.slot_sizes,
            "fetch_device": 1 if args.mem == "cuda" and _gpu_count() > 1 else 0,
        }
        fetch_pipe, child = ctx.Pipe()
        fetcher = ctx.Process(target=fetch_main, args=(child, env, opts), daemon=True)
        fetcher.start()
        result = fetch_pipe.recv()
        fetcher.join(10)
        serve_pipe.send("stop")
        server.join(10)
    finally:
        for p in (server, fetcher):
            if p is not None and p.is_alive():
                p.kill()
    result["env"] = env
    result["server_active_transports"] = server_tls
    return result


def _gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def write_results(sweeps: list[dict], args: argparse.Namespace) -> None:
    path = args.out
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.exists() else {}
    keep = lambda items: [r for r in items if r.get("mem") != args.mem]  # noqa: E731
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows = keep(old.get("rows", [])) + [r for s in sweeps for r in s["rows"]]
    latency = keep(old.get("latency", [])) + [s["latency"] for s in sweeps]
    doc = {
        "benchmark": "peer transfer (kvstore.transfer) vs raw ucxx, two processes on loopback",
        "note": GBPS_NOTE,
        "generated": now,
        "quick": args.quick,
        "ucx": [
            {
                "transport": s["rows"][0]["transport"] if s["rows"] else "",
                "mem": args.mem,
                "env": s["env"],
                "active_transports": s["active_transports"],
                "host": {
                    "machine": platform.machine(),
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "date": now,
                },
            }
            for s in sweeps
        ]
        + [u for u in old.get("ucx", []) if u.get("mem") != args.mem],
        "rows": rows,
        "latency": latency,
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")
    plot(rows, latency, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png').name}")


def plot(rows: list[dict], latency: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_ratio) = plt.subplots(1, 2, figsize=(12, 4.5))
    series = sorted({(r["transport"], r["mem"]) for r in rows})
    for transport, mem in series:
        mine = sorted(
            (r for r in rows if (r["transport"], r["mem"]) == (transport, mem)),
            key=lambda r: r["slot_bytes"],
        )
        x = [r["slot_bytes"] >> 10 for r in mine]
        label = f"{mem}, UCX_TLS={transport}"
        line = ax.plot(x, [r["gbps"] for r in mine], "o-", label=f"fetch ({label})")[0]
        ax.plot(
            x,
            [r["baseline_gbps"] for r in mine],
            "s--",
            color=line.get_color(),
            label=f"raw ucxx, one buffer ({label})",
        )
        if mine and mine[0].get("device_copy_gbps"):
            ax.plot(
                x,
                [r["device_copy_gbps"] for r in mine],
                "^:",
                color=line.get_color(),
                label=f"cudaMemcpy in one process ({label})",
            )
        ax_ratio.plot(x, [r["ratio"] for r in mine], "o-", color=line.get_color(), label=label)
    for a in (ax, ax_ratio):
        a.set_xscale("log", base=2)
        a.set_xlabel("slot size (KiB)")
        a.grid(True, alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s")
    ax.set_title("pull throughput, two processes on loopback")
    ax.legend(fontsize=7)
    ax_ratio.axhline(0.7, color="grey", linestyle=":", label="0.7 target")
    ax_ratio.set_ylabel("fetch / raw")
    ax_ratio.set_ylim(0, 1.2)
    lat = "\n".join(
        f"{x['mem']}/{x['transport']}: p50 {x['p50_ms']} ms, p99 {x['p99_ms']} ms" for x in latency
    )
    ax_ratio.set_title(f"ratio to raw ucxx; 32-block prefix (64 MiB) latency:\n{lat}", fontsize=8)
    ax_ratio.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats (< 1 min)")
    p.add_argument("--mem", choices=("host", "cuda"), default="host")
    p.add_argument(
        "--tls",
        action="append",
        help="UCX_TLS value per sweep (repeatable); 'default' leaves UCX to choose",
    )
    p.add_argument("--total-mib", type=int, help="bytes per throughput measurement")
    p.add_argument("--repeats", type=int)
    p.add_argument("--latency-iters", type=int)
    p.add_argument(
        "--out",
        type=Path,
        default=RESULTS / "transfer.json",
        help="JSON to merge into (rows of the other mem kind are kept); PNG beside it",
    )
    args = p.parse_args()
    args.tls = args.tls or [os.environ.get("UCX_TLS", "default")]
    args.total_mib = args.total_mib or (64 if args.quick else 256)
    args.repeats = args.repeats or (7 if args.quick else 15)
    args.latency_iters = args.latency_iters or (20 if args.quick else 100)
    args.slot_sizes = list(SLOT_SIZES)
    return args


def main() -> None:
    args = parse_args()
    start = time.monotonic()
    sweeps = []
    for tls in args.tls:
        print(
            f"UCX_TLS={tls} mem={args.mem}: {args.total_mib} MiB per transfer, "
            f"median of {args.repeats}",
            flush=True,
        )
        sweeps.append(run_sweep(tls, args))
    write_results(sweeps, args)
    print(f"done in {time.monotonic() - start:.0f}s")


if __name__ == "__main__":
    main()
